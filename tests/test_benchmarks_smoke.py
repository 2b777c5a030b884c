"""Smoke test of the end-to-end benchmarks with tiny settings: JSON schema and exactness checks ran."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIGS = ["bare_engine", "no_cache", "l1_only", "l1_l2", "l1_l2_l3", "l3_prepopulated"]
REQUIRED = {"config": str, "prefill_tokens_computed": int, "ttft_mean_s": float, "ttft_p90_s": float,
            "service_ttft_mean_s": float, "throughput_requests_per_s": float, "throughput_tokens_per_s": float,
            "hit_rate_by_tier": dict, "exact_outputs_checked": int, "exact_spot_checks": int}


def _check(path: Path, png: Path) -> dict:
    records = json.loads(path.read_text())
    assert isinstance(records, list) and [r["config"] for r in records] == CONFIGS
    for r in records:
        for key, typ in REQUIRED.items():
            assert isinstance(r[key], typ), (r["config"], key, r[key])
        assert set(r["hit_rate_by_tier"]) == {"l1", "l2", "l3"}
        assert 0 <= sum(r["hit_rate_by_tier"].values()) <= 1
        assert r["exact_outputs_checked"] == r["requests"] > 0  # every output equals the no-cache output
        assert r["exact_spot_checks"] >= 1  # and some were compared with generate_no_cache, logits too
        assert r["prefill_tokens_computed"] + sum(r["hit_tokens_by_tier"].values()) == r["prompt_tokens"]
    by = {r["config"]: r for r in records}
    assert by["no_cache"]["hit_rate_total"] == 0 and by["no_cache"]["optimal_hit_rate"] == 0
    assert by["l3_prepopulated"]["hit_rate_by_tier"]["l3"] > 0
    for r in records:
        if r["optimal_hit_rate"] is not None:
            assert r["hit_rate_total"] <= r["optimal_hit_rate"] + 1e-9, r["config"]
    assert png.stat().st_size > 0
    return by


def test_multiturn_and_long_doc_qa_tiny(tmp_path):
    from benchmarks import long_doc_qa, multiturn

    mt = tmp_path / "mt.json"
    multiturn.main(["--clients", "3", "--rounds", "2", "--system-tokens", "24", "40", "--request-tokens", "8", "16",
                    "--output-tokens", "4", "--overhead-reps", "1", "--spot-checks", "1", "--l2-fraction", "2",
                    "--json", str(mt), "--png", str(tmp_path / "mt.png")])
    by = _check(mt, tmp_path / "mt.png")
    assert "targets" in by["l1_l2_l3"]["notes"]
    ld = tmp_path / "ld.json"
    long_doc_qa.main(["--docs", "2", "--questions", "2", "--doc-tokens", "64", "96", "--question-tokens", "8", "12",
                      "--output-tokens", "4", "--overhead-reps", "1", "--spot-checks", "1",
                      "--l2-fraction", "2",  # an L3 prefetch needs L2 room for the whole run it fetches
                      "--json", str(ld), "--png", str(tmp_path / "ld.png")])
    by = _check(ld, tmp_path / "ld.png")
    assert by["l3_prepopulated"]["notes"]["targets"]["cold_round1_hit_rate"] > 0
