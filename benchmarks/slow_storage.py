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

from benchmarks.faulty_l3 import attach_faulty_l3
from benchmarks.multiturn import build_stream, make_workload
from benchmarks.report import jsonable
from benchmarks.stacks import BareEngine, stack_options
from benchmarks.workload import FWD, MODEL, Stream, log, tier_sizes
from hicache.cluster.cost_model import CostOptions
from hicache.reference.engine.runner import ModelRunner
from hicache.reference.serve_types import ServeRequest
from hicache.reference.stack import build_stack, warm_up
from hicache.storage.fault_injection import FaultPlan, OpFaults

SEED = 27
LATENCIES_S = (0.0, 0.01, 0.05, 0.2, 1.0)
QUICK_LATENCIES_S = (0.0, 0.05, 0.5)
CONFIGS = {"always_load": CostOptions(enabled=False), "cost_aware": CostOptions()}


def _serve(stack, stream: Stream) -> tuple[int, list[float], int]:
    """Serves the stream in order: (wrong outputs, TTFTs, L3 hit tokens)."""
    wrong, ttfts, l3 = 0, [], 0
    for it in stream.items:
        res = stack.scheduler.serve(ServeRequest(it.prompt, it.max_new_tokens))
        wrong += tuple(res.output) != tuple(stream.outputs[it.index])
        ttfts.append(res.ttft_s)
        l3 += res.storage_tokens
    return wrong, ttfts, l3


def _close(stack) -> None:
    stack.client.flush_write_through_acks()
    stack.head.detach_storage_backend()


def run_config(cost: CostOptions, plan: FaultPlan, runner: ModelRunner, stream: Stream, options, url: str) -> dict:
    stack = build_stack(options, runner)
    attach_faulty_l3(stack, url, plan, cost=cost)
    wrong, ttfts, l3 = _serve(stack, stream)
    st = stack.head.cache_stats()["storage"]
    _close(stack)
    return {"wrong": wrong, "ttft_mean_s": sum(ttfts) / len(ttfts), "l3_hit_tokens": l3,
            "cost_skips": st["cost_skips"], "cost_partial": st["cost_partial"], "cost_model": st["cost_model"]}


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, help="where to write the results")
    p.add_argument("--quick", action="store_true", help="a small stream and three latency points (CI smoke test)")
    p.add_argument("--bandwidth-bps", type=float, default=None, help="cap on L3 read bytes/s at every point")
    a = p.parse_args(argv)
    quick = dict(clients=3, rounds=2, system_prompts=1, system_tokens=(24, 40), request_tokens=(8, 16), output_tokens=4)
    full = dict(clients=8, rounds=4, system_prompts=2, system_tokens=(96, 160), request_tokens=(16, 32), output_tokens=8)
    for k, v in (quick if a.quick else full).items():
        setattr(a, k, v)
    a.seed = SEED
    return a


def main(argv: Sequence[str] | None = None) -> dict:
    args = _args(argv)
    runner = ModelRunner(MODEL, FWD, num_pages=8)
    bare = BareEngine(runner, FWD.max_pages)
    wl = make_workload(args)
    log("reference pass (engine alone): the stream and its outputs")
    stream = build_stream(bare, wl, args)
    log("no-cache TTFT (engine alone)")
    no_cache = [bare.serve(ServeRequest(it.prompt, it.max_new_tokens)).ttft_s for it in stream.items]
    no_cache_mean = sum(no_cache) / len(no_cache)
    ps = FWD.page_size
    pages = sum(-(-len(it.prompt) // ps) for it in stream.items if it.round == args.rounds - 1)
    l1, l2 = tier_sizes(pages, max(len(it.prompt) for it in stream.items) + args.output_tokens, 0.25, 0.5)
    options = stack_options(l1, l2, "/unused")  # L3 replaced by the faulty memory:// one per stack
    options = type(options)(**{**options.__dict__, "l3_url": "memory://slow-storage-placeholder"})
    log("warm-up (compiles every transfer bucket outside the timings)")
    warmed = build_stack(options, runner)
    warm_up(warmed)
    _close(warmed)
    url = f"memory://slow-storage-{uuid.uuid4().hex[:10]}"
    log("fill: a healthy stack stores the stream in L3")
    fill = build_stack(options, runner)
    attach_faulty_l3(fill, url, cost=CostOptions(enabled=False))
    wrong_fill, _, _ = _serve(fill, stream)
    _close(fill)
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
