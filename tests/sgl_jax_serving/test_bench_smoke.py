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
