"""What the per-request miss accounting (issue #27) adds to the head's tree work, paired in one process.

The tree benchmark's multi-turn workload (``benchmarks/tree_bench.py``: match, lock, alloc,
cache_finished_req per request) runs on a plain tree (``plain``: an L1-only head before #27) and on a
tree with what an L1-only head now adds (``accounted``): the ``TierEvents`` listener without an event
log (ghosts of evicted nodes), ``record_match`` after every match (the miss reason, the namespace check
on a miss from the root) and per request ``add_to`` of the request's ``TokenAccount`` (the head's
``report_tokens``). A head with L2 had the listener and ``record_match`` before; for it ``add_to`` is the
only new work. The record the serving code builds (``account_request``) is timed apart
(``account_request_us``): it runs on the serving side, not on the head. The two variants alternate
``--repeat`` times (order flipped every pair); times are the process's CPU seconds
(``time.process_time``: this box is shared, wall time mostly measures the neighbours). The record gives
both best-of-N rates and the median of the per-pair ratios.

    python benchmarks/token_account_bench.py [--json out.json] [--quick] [--repeat 7]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.tree_bench import build_tree, requests_of, serve  # noqa: E402
from hicache.cluster.events import CacheCounters, MissReason  # noqa: E402
from hicache.cluster.tier_events import TierEvents  # noqa: E402
from hicache.cluster.token_account import account_request, add_to  # noqa: E402
from hicache.cluster.tree import RadixTree  # noqa: E402
from hicache.workloads import MultiTurnSpec, multi_turn  # noqa: E402


def _accounted(tree: RadixTree) -> dict[str, int]:
    """Makes ``tree`` do what an L1-only accounting head does around it; returns the per-fate totals."""
    events = TierEvents(tree.page_size, CacheCounters(), tree.cached_elsewhere, keep_events=False)
    tree.listener = events
    match, totals = tree.match_prefix, {}
    record = account_request(41, 16, hit_l1=16)  # (its content does not change add_to's cost)

    def match_prefix(key):  # the head's match_prefix, and its report_tokens at the request's finish
        m = match(key)
        events.record_match(key, m)
        add_to(totals, record)
        return m

    tree.match_prefix = match_prefix  # type: ignore[method-assign]  # (an instance attribute: this tree only)
    return totals


def timed(requests, page_size: int, capacity_tokens: int, accounted: bool) -> float:
    tree = build_tree(page_size, capacity_tokens, "full")
    if accounted:
        _accounted(tree)
    gc.collect()
    t0 = time.process_time()
    serve(tree, requests)
    return time.process_time() - t0


def account_request_us(n: int = 20_000) -> float:
    """CPU microseconds of one ``account_request`` (a hit, a miss and the tail: the usual record)."""
    t0 = time.process_time()
    for _ in range(n):
        account_request(41, 16, hit_l1=16, rest=MissReason.EVICTED_L1)
    return (time.process_time() - t0) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--quick", action="store_true", help="the tree benchmark's --quick workload")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    spec = MultiTurnSpec(conversations=40, turns=4, seed=0) if args.quick else MultiTurnSpec(seed=0)
    requests = requests_of(multi_turn(spec))
    records = []
    for page_size in (1, 16):
        for capacity in (0, 200_000):
            times: dict[bool, list[float]] = {False: [], True: []}
            for i in range(args.repeat):
                for accounted in ((False, True) if i % 2 == 0 else (True, False)):
                    times[accounted].append(timed(requests, page_size, capacity, accounted))
            ratios = [p / a for p, a in zip(times[False], times[True])]  # accounted rate / plain rate
            rec = {"page_size": page_size, "capacity_tokens": capacity, "pairs": args.repeat,
                   "plain_requests_per_s": len(requests) / min(times[False]),
                   "accounted_requests_per_s": len(requests) / min(times[True]),
                   "ratio_median": statistics.median(ratios)}
            records.append(rec)
            print(f"page {page_size:2d} capacity {capacity:6d}: plain {rec['plain_requests_per_s']:8.0f} req/s, "
                  f"accounted {rec['accounted_requests_per_s']:8.0f} req/s, median ratio {rec['ratio_median']:.3f}")
    us = account_request_us()
    print(f"account_request (serving side): {us:.2f} us per request")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"points": records, "account_request_us": us}, f, indent=1)


if __name__ == "__main__":
    main()
