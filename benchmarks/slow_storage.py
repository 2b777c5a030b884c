"""Multi-turn chat with L3 slowed (issue #27): is a cost-aware head ever slower than recompute?

The request stream is multiturn's (``multiturn.make_workload`` / ``build_stream``: N clients x R
rounds, each turn the whole history plus new tokens; the engine without cache decides the answers,
the reference outputs). A healthy stack serves it once into L3 (memory:// behind the fault wrapper:
pages and manifest). Then, for each L3 latency point (added to every object read; existence queries,
listings and writes are not slowed, so every config sees the same L3 hits offered) and each config,
a cold stack (empty L1/L2, the same L3, its warm restart settled) serves the stream one request at
a time; every output is compared with the reference:

- ``no_cache``: the engine alone (no tree, no L3): every prompt recomputed;
- ``always_load``: the stack with the cost model off: every L3 hit found is fetched;
- ``cost_aware``: the stack with the cost model on (``CostOptions()`` defaults; it learns during
  the run: its first fetch at every point is always taken and measured).

Every stack runs ``warm_up`` (its own namespace) after L3 is attached and before the stream, as a
replica does when it starts; the fill stack's warm-up stored its requests in L3, so every warm-up
also fetches from L3 at the point's latency: each stack's cost model starts the stream having measured
the engine's prefill and (where its warm-up waited for one) an L3 fetch.

JSON: ``{"points": [{"latency_s", "no_cache_ttft_mean_s", "always_load_ttft_mean_s",
"cost_aware_ttft_mean_s", ...}], "targets": {...}}``. Targets: at every point cost_aware mean TTFT
<= 1.05 x min(no_cache, always_load); at latency 0, >= 2x faster than no_cache.

    python -m benchmarks.slow_storage --json out.json [--quick] [--bandwidth-bps BPS]
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from collections.abc import Sequence

from benchmarks.chat_l3 import chat_sizes, close_stack, prepare_chat, serve_stream
from benchmarks.faulty_l3 import attach_faulty_l3
from benchmarks.report import jsonable
from benchmarks.workload import Stream, log
from hicache.cluster.cost_model import CostOptions
from hicache.reference.engine.runner import ModelRunner
from hicache.reference.stack import build_stack, warm_up
from hicache.storage.fault_injection import FaultPlan, OpFaults

SEED = 27
LATENCIES_S = (0.0, 0.01, 0.05, 0.2, 1.0)
QUICK_LATENCIES_S = (0.0, 0.05, 0.5)
CONFIGS = {"always_load": CostOptions(enabled=False), "cost_aware": CostOptions()}


def run_config(cost: CostOptions, plan: FaultPlan, runner: ModelRunner, stream: Stream, options, url: str) -> dict:
    stack = build_stack(options, runner)
    attach_faulty_l3(stack, url, plan, cost=cost)
    warm_up(stack)  # as a replica starts (module docstring)
    wrong, ttfts, l3 = serve_stream(stack, stream)
    st = stack.head.cache_stats()["storage"]
    close_stack(stack)
    return {"wrong": wrong, "ttft_mean_s": sum(ttfts) / len(ttfts), "l3_hit_tokens": l3,
            "cost_skips": st["cost_skips"], "cost_partial": st["cost_partial"], "cost_model": st["cost_model"]}


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, help="where to write the results")
    p.add_argument("--quick", action="store_true", help="a small stream and three latency points (CI smoke test)")
    p.add_argument("--bandwidth-bps", type=float, default=None, help="cap on L3 read bytes/s at every point")
    return chat_sizes(p.parse_args(argv), SEED)


def main(argv: Sequence[str] | None = None) -> dict:
    args = _args(argv)
    chat = prepare_chat(args, "memory://slow-storage-placeholder")  # L3 replaced by the faulty one per stack
    runner, stream, options, no_cache_mean = chat.runner, chat.stream, chat.options, chat.no_cache_ttft_mean_s
    url = f"memory://slow-storage-{uuid.uuid4().hex[:10]}"
    log("fill: a healthy stack stores the stream in L3")
    fill = build_stack(options, runner)
    attach_faulty_l3(fill, url, cost=CostOptions(enabled=False))
    warm_up(fill)  # its namespace's objects too: every point's warm-up meets the same L3
    wrong_fill, _, _ = serve_stream(fill, stream)
    close_stack(fill)
    points = []
    for latency in (QUICK_LATENCIES_S if args.quick else LATENCIES_S):
        plan = FaultPlan(read=OpFaults(latency_s=latency, bandwidth_bps=args.bandwidth_bps))
        point: dict = {"latency_s": latency, "no_cache_ttft_mean_s": no_cache_mean, "wrong_outputs": wrong_fill}
        for name, cost in CONFIGS.items():
            t = time.perf_counter()
            rec = run_config(cost, plan, runner, stream, options, url)
            point[f"{name}_ttft_mean_s"] = rec["ttft_mean_s"]
            point[f"{name}_l3_hit_tokens"] = rec["l3_hit_tokens"]
            point["wrong_outputs"] += rec["wrong"]
            if name == "cost_aware":
                point.update(cost_skips=rec["cost_skips"], cost_partial=rec["cost_partial"],
                             cost_model=rec["cost_model"])
            log(f"  latency {latency * 1e3:.0f} ms  {name:<12} ttft mean {rec['ttft_mean_s'] * 1e3:.1f} ms  "
                f"l3 hit tokens {rec['l3_hit_tokens']}  ({time.perf_counter() - t:.1f} s)")
        points.append(point)
    result = {"points": points, "targets": targets(points), "requests": len(stream.items), "quick": args.quick,
              "bandwidth_bps": args.bandwidth_bps}
    with open(args.json, "w") as f:
        json.dump(jsonable(result), f, indent=2)
    print_table(points)
    return result


def targets(points: Sequence[dict]) -> dict:
    """Each #27 target, met or not."""
    out = {}
    for p in points:
        best = min(p["no_cache_ttft_mean_s"], p["always_load_ttft_mean_s"])
        out[f"latency {p['latency_s']} s: cost_aware <= 1.05x min(no_cache, always_load)"] = (
            p["cost_aware_ttft_mean_s"] <= 1.05 * best)
        out[f"latency {p['latency_s']} s: 0 wrong outputs"] = p["wrong_outputs"] == 0
        if p["latency_s"] == 0:
            out["latency 0: cost_aware >= 2x faster than no_cache"] = (
                2 * p["cost_aware_ttft_mean_s"] <= p["no_cache_ttft_mean_s"])
    return out


def print_table(points: Sequence[dict]) -> None:
    print(f"{'latency ms':>10}{'no_cache ms':>13}{'always_load ms':>16}{'cost_aware ms':>15}{'skips':>7}{'wrong':>7}")
    for p in points:
        print(f"{p['latency_s'] * 1e3:>10.0f}{p['no_cache_ttft_mean_s'] * 1e3:>13.2f}"
              f"{p['always_load_ttft_mean_s'] * 1e3:>16.2f}{p['cost_aware_ttft_mean_s'] * 1e3:>15.2f}"
              f"{p['cost_skips']:>7}{p['wrong_outputs']:>7}")


if __name__ == "__main__":
    main()
