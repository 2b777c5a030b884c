"""routing_bench end to end on a few trace requests (the routers that need no Ray instance)."""

from __future__ import annotations

import json

import numpy as np
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


def test_prefill_floor_counts_what_one_shared_cache_would_compute():
    page = 4
    a, b, c = (np.arange(k * 100, k * 100 + 2 * page, dtype=np.int32) for k in range(3))
    prompts = [np.concatenate([a, b, [7]]), np.concatenate([a, b, [8]]), np.concatenate([c, [9]]),
               np.concatenate([a, [5]])]
    streams = [[routing_bench.Request(i, float(i), p, "", 1)] for i, p in enumerate(prompts)]
    outputs = {i: (1,) for i in range(len(prompts))}
    # Unbounded: request 1 reuses a+b (16 tokens), request 3 reuses a (8); 17 + 1 + 9 + 1 computed.
    assert routing_bench.prefill_floor(streams, outputs, page) == 28
    # Four pages, least recently used out: request 2's c evicts b (a is more recent), request 3 still reuses a.
    assert routing_bench.prefill_floor(streams, outputs, page, capacity_pages=4) == 28
    # Two pages: only a stays of request 0 (request 1 reuses 8, computes 9), c evicts it: 17 + 9 + 9 + 9.
    assert routing_bench.prefill_floor(streams, outputs, page, capacity_pages=2) == 44
