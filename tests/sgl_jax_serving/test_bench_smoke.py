"""``benchmarks/sgl_jax_bench.py --quick``: the JSON the issue asks for, every config exact (slow: six engines)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.sgl_jax_env import single_device_env

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ["no_cache", "sgl_jax_radix", "sgl_jax_hicache", "hicache_l1_l2", "hicache_l1_l2_l3", "hicache_cold_restart"]


@pytest.mark.slow
def test_quick_bench_writes_every_config_exact(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    with single_device_env():
        res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sgl_jax_bench.py"), "--quick", "--json", str(out)],
                             capture_output=True, text=True, timeout=3000)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [c["name"] for c in report["configs"]] == CONFIGS
    for c in report["configs"]:
        assert c["exact"], c["name"]
        assert {"prefill_tokens_computed", "ttft_mean_s", "ttft_p90_s", "hit_tokens_by_tier"} <= set(c)
    by = {c["name"]: c for c in report["configs"]}
    assert by["no_cache"]["hit_tokens"] == 0
    assert by["hicache_l1_l2_l3"]["hit_tokens_by_tier"]["L3"] > 0
    assert by["hicache_cold_restart"]["hit_tokens_by_tier"]["L3"] > 0
    assert isinstance(report["no_reuse_overhead"], float)


def test_unbounded_cache_floor_counts_each_turn_new_tokens() -> None:
    """The floor the bench prints: per request, its new message and the last answer token (whose KV no forward
    made), the system prompt once, and never less than the prompt's last token."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from sgl_jax_bench import unbounded_cache_prefill

    system = [5, 6, 7]
    chats = [[[10, 11], [12]], [[20], [21, 22]]]
    outputs = [[30, 31], [40, 41], [50, 51], [60, 61]]  # served turn by turn: chat 0, chat 1, chat 0, chat 1
    # turn 1: 3 + 2 (the system prompt computed once), then 1; turn 2: the last answer token + the message
    assert unbounded_cache_prefill(system, chats, outputs) == 5 + 1 + (1 + 1) + (1 + 2)
    assert unbounded_cache_prefill(system, [[[10]], [[10]]], [[30], [30]]) == 4 + 1  # a repeat: its last token
