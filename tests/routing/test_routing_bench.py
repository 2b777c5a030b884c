"""routing_bench end to end on a few trace requests (the routers that need no Ray instance)."""

from __future__ import annotations

import json

import pytest

from benchmarks import routing_bench


@pytest.mark.slow  # ~30 s (compiles, calibrates, 3 replays): CI's fast variant is test_router.py's embedded routing
def test_routing_bench_tiny(tmp_path):
    out = tmp_path / "routing.json"
    routing_bench.main(["--json", str(out), "--requests", "40", "--workloads", "trace", "--l1-pages", "160",
                        "--l2-slots", "256", "--routers", "round_robin,power_of_two,hicache_tier_aware"])
    data = json.loads(out.read_text())
    (wl,) = data["workloads"]
    assert wl["workload"] == "mooncake_trace" and wl["requests"] == 40 and wl["outputs_agree"]
    recs = {r["name"]: r for r in wl["routers"]}
    assert set(recs) == {"round_robin", "power_of_two", "hicache_tier_aware"}
    for r in recs.values():
        assert {"prefill_tokens_computed", "hit_rate", "ttft_mean_s", "ttft_p90_s", "max_over_mean_load"} <= set(r)
        assert r["requests"] == 40 and sum(r["requests_per_replica"]) == 40 and r["max_over_mean_load"] >= 1.0
        assert r["prefill_tokens_computed"] + sum(r["reused_tokens"].values()) == r["prompt_tokens"]
    assert recs["hicache_tier_aware"]["router_stats"]["decisions"] == 40
    assert wl["targets"]["best_other"] in ("round_robin", "power_of_two")
