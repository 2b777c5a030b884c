"""Long-document QA through the embedded stack: documents shared by several questions, per cache config.

``--docs`` documents of ``--doc-tokens`` tokens (the long shared prefix), each asked ``--questions``
short questions (``--question-tokens``, ``--output-tokens`` answer). Round q asks question q of every
document, documents in a seeded random order; requests are independent (no client waits for another)
and arrive as a Poisson process at ``--request-rate`` (default ``--load`` x the service rate of the
engine without cache). L1 = ``--l1-fraction`` (25%) of the working set (documents + question/answer
pages), L2 = ``--l2-fraction`` (50%), L3 a local directory without cap. Queueing and offline-optimal
models: ``benchmarks/workload.py`` and ``benchmarks/oracle.py``.

Configs (same request stream, fresh stack each, one compiled engine):
  bare_engine      the engine alone: never caches
  no_cache         the full L1+L2+L3 stack, every request in its own cache_salt (nothing reusable)
  l1_only, l1_l2, l1_l2_l3
                   the warm replica: serves every round
  l3_prepopulated  a cold replica (empty L1/L2, new tree) whose L3 is a copy of the warm l1_l2_l3
                   replica's L3 taken after round 0; it serves rounds 1.. (its "round 1" is the first
                   round it serves). Target: its round-1 hit rate >= 90% of the warm replica's round-1
                   hit rate (same requests; the warm replica has L1, L2 and L3 from round 0).

Reference pass, warm-up pass, the no-reuse pair (bare_engine vs no_cache in segments of ``--pair-segment``
requests, ``pairing.overhead_pair``, its target on ``--clock``, both clocks reported) and exactness
checks as in ``multiturn.py``.

    python benchmarks/long_doc_qa.py [--quick] [--json out.json] [--png out.png]
    ray job submit --runtime-env ray_configs/runtime_env/local.yaml -- python benchmarks/long_doc_qa.py --json ldqa.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks.clocks import CLOCKS  # noqa: E402
from benchmarks.oracle import accesses, belady_hit_tokens, serve_items, working_set  # noqa: E402
from benchmarks.pairing import no_reuse_targets, serve_interleaved, warm_up_and_baselines  # noqa: E402
from benchmarks.report import ConfigRecord, make_record, report  # noqa: E402
from benchmarks.stacks import BareEngine, finish_stack, in_scratch_dir, stack_options  # noqa: E402
from benchmarks.workload import FWD, MODEL, Item, log, poisson_ticks, tier_sizes  # noqa: E402
from hicache.reference.engine.runner import ModelRunner  # noqa: E402

CONFIGS = ("bare_engine", "no_cache", "l1_only", "l1_l2", "l1_l2_l3", "l3_prepopulated")


def make_items(args: argparse.Namespace) -> tuple[list[Item], int]:
    """(items in serving order, working set in pages)."""
    rng = np.random.default_rng(args.seed)
    vocab, ps = MODEL.vocab_size, FWD.page_size

    def tokens(lo: int, hi: int) -> np.ndarray:
        return rng.integers(0, vocab, size=int(rng.integers(lo, hi + 1)), dtype=np.int32)

    docs = [tokens(*args.doc_tokens) for _ in range(args.docs)]
    questions = [[tokens(*args.question_tokens) for _ in range(args.questions)] for _ in range(args.docs)]
    longest = max(len(d) for d in docs) + args.question_tokens[1] + args.output_tokens
    if longest > FWD.max_context:
        raise SystemExit(f"a request reaches {longest} tokens > max context {FWD.max_context}: shorter documents")
    items = []
    for q in range(args.questions):
        for d in rng.permutation(args.docs):
            d = int(d)
            items.append(Item(len(items), None, q, np.concatenate([docs[d], questions[d][q]]), args.output_tokens))
    working = sum(-(-len(d) // ps) for d in docs) + sum(
        -(-(len(q) + args.output_tokens) // ps) for qs in questions for q in qs)
    return items, working


def main(argv: list[str] | None = None) -> list[ConfigRecord]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=12)
    p.add_argument("--questions", type=int, default=4, help="questions per document (= rounds)")
    p.add_argument("--doc-tokens", type=int, nargs=2, default=(320, 440), metavar=("LO", "HI"))
    p.add_argument("--question-tokens", type=int, nargs=2, default=(12, 24), metavar=("LO", "HI"))
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--request-rate", type=float, default=0.0, help="requests/s; 0: --load x bare service rate")
    p.add_argument("--load", type=float, default=0.7)
    p.add_argument("--l1-fraction", type=float, default=0.25)
    p.add_argument("--l2-fraction", type=float, default=0.5)
    p.add_argument("--overhead-reps", type=int, default=3,
                   help="bare_engine/no_cache repeats (in segments, and interleaved; median over the reps per block "
                        "of requests, pairing.paired_overhead)")
    p.add_argument("--pair-segment", "--segment", dest="pair_segment", type=int, default=1,
                   help="no-reuse pair: requests a config serves in a row (no_cache then drained) before the other "
                        "serves them; short, so that the two configs meet the same machine load")
    p.add_argument("--clock", default="cpu", choices=sorted(CLOCKS),
                   help="what times the no-reuse pair's target: this process's CPU time (all threads; robust to "
                        "other processes on a shared machine), or wall time; both are reported")
    p.add_argument("--spot-checks", type=int, default=3, help="generate_no_cache comparisons per config")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--l3-dir", help="parent of the L3 directories (default: a temp dir, removed)")
    p.add_argument("--json")
    p.add_argument("--png")
    p.add_argument("--quick", action="store_true", help="4 documents x 3 questions, 1 overhead rep")
    args = p.parse_args(argv)
    if args.quick:
        args.docs, args.questions, args.overhead_reps = 4, 3, 1
    if args.questions < 2:
        raise SystemExit("--questions must be >= 2 (the cold replica serves rounds 1..)")
    t_start = time.perf_counter()
    items, est = make_items(args)
    longest = max(len(it.prompt) + it.max_new_tokens for it in items)
    l1_pages, l2_slots = tier_sizes(est, longest, args.l1_fraction, args.l2_fraction)
    base = ModelRunner(MODEL, FWD, num_pages=l1_pages)
    bare = BareEngine(base, l1_pages)
    log(f"long_doc_qa: {args.docs} documents x {args.questions} questions; reference pass (no cache; compiles) ...")
    ref = tuple(tuple(s.result.output) for s in serve_items(bare.serve, items, None, "reference"))
    acc, working = working_set(items, ref)
    log(f"  {len(items)} requests, {sum(len(it.prompt) for it in items):,} prompt tokens; working set {working} "
        f"pages ({est} estimated); L1 {l1_pages} pages ({l1_pages / working:.0%}), L2 {l2_slots} pages "
        f"({l2_slots / working:.0%})")
    return in_scratch_dir(args.l3_dir, "hicache-ldqa-", lambda tmp: _run(
        args, items, ref, acc, l1_pages, l2_slots, working, base, bare, tmp, t_start))


def _run(args, items, ref, acc, l1_pages, l2_slots, working, base, bare, tmp, t_start) -> list[ConfigRecord]:
    ps = FWD.page_size
    full = lambda d: stack_options(l1_pages, l2_slots, tmp / d)  # noqa: E731
    served, spots, stats, overhead = warm_up_and_baselines(args, items, ref, base, bare, full)
    from hicache.reference.stack import build_stack

    opts = {"l1_only": stack_options(l1_pages), "l1_l2": stack_options(l1_pages, l2_slots), "l1_l2_l3": full("l3")}
    first = [it for it in items if it.round == 0]
    rest = [it for it in items if it.round > 0]
    log(f"  round 0: {', '.join(opts)} (the warm replicas), interleaved per request ...")
    stacks = {name: build_stack(o, base) for name, o in opts.items()}
    served.update(serve_interleaved({n: st.scheduler.serve for n, st in stacks.items()}, first, ref))
    stacks["l1_l2_l3"].client.flush_write_through_acks()
    snap = tmp / "l3-after-round-0"
    shutil.rmtree(snap, ignore_errors=True)
    shutil.copytree(tmp / "l3", snap)
    log("  rounds 1..: the warm replicas + l3_prepopulated (a cold replica on a copy of the warm L3), "
        "interleaved per request ...")
    stacks["l3_prepopulated"] = build_stack(full(snap.name), base)
    served["l3_prepopulated"] = []
    more = serve_interleaved({n: st.scheduler.serve for n, st in stacks.items()}, rest, ref)
    for name, st in stacks.items():
        served[name] += more[name]
        spots[name], stats[name] = finish_stack(name, st, served[name], args.spot_checks)

    rate = args.request_rate or args.load / float(np.mean([s.result.latency_s for s in served["bare_engine"]]))
    inf = float("inf")
    nc_acc = accesses([(it.prompt, o) for it, o in zip(items, ref)], ps, [f"nc-{it.index}" for it in items])
    n0 = len(first)  # items are in round order: round 0 first
    optimal = {
        "bare_engine": (None, None),
        "no_cache": (belady_hit_tokens(nc_acc, inf, ps), inf),
        "l1_only": (belady_hit_tokens(acc, l1_pages, ps), l1_pages * ps),
        "l1_l2": (belady_hit_tokens(acc, l1_pages + l2_slots, ps), (l1_pages + l2_slots) * ps),
        "l1_l2_l3": (belady_hit_tokens(acc, inf, ps), inf),
        "l3_prepopulated": (belady_hit_tokens(acc[n0:], inf, ps, preload=acc[:n0]), inf),
    }
    caps = {"bare_engine": (0, 0, False), "no_cache": (l1_pages, l2_slots, True), "l1_only": (l1_pages, 0, False),
            "l1_l2": (l1_pages, l2_slots, False), "l1_l2_l3": (l1_pages, l2_slots, True),
            "l3_prepopulated": (l1_pages, l2_slots, True)}
    records = []
    for name in CONFIGS:
        l1, l2, l3 = caps[name]
        s = served[name]
        notes = {"working_set_tokens": working * ps, "rounds": sorted({x.item.round for x in s}),
                 "cache_stats": stats[name]}
        if name in ("bare_engine", "no_cache"):
            notes["overhead_vs_bare"] = overhead
        ticks = poisson_ticks(len(s), rate, args.seed + 1)
        records.append(make_record(name, s, ticks, rate, l1_tokens=l1 * ps, l2_tokens=l2 * ps, l3=l3,
                                   optimal_hits=optimal[name][0], optimal_capacity=optimal[name][1],
                                   exact_checked=len(s), spot=spots[name], notes=notes))

    def round_hit(name: str, rd: int) -> float:
        rs = [x.result for x in served[name] if x.item.round == rd]
        return sum(r.prompt_len - r.computed_tokens for r in rs) / sum(r.prompt_len for r in rs)

    warm1, cold1 = round_hit("l1_l2_l3", 1), round_hit("l3_prepopulated", 1)
    targets = {
        "warm_round1_hit_rate": warm1, "cold_round1_hit_rate": cold1, "cold_vs_warm_round1": cold1 / warm1,
        **no_reuse_targets(overhead),
    }
    targets["met"] = {"cold_90pct_of_warm": targets["cold_vs_warm_round1"] >= 0.9,
                      "overhead_5pct": targets["no_reuse_overhead_service_ttft"] <= 0.05}
    report(records, targets, ("l3_prepopulated", "no_cache"), rate, args.json, args.png,
           f"long_doc_qa: {args.docs} documents x {args.questions} questions, L1 = "
           f"{args.l1_fraction:.0%} of the working set, {rate:.1f} req/s", t_start)
    return records


if __name__ == "__main__":
    main()
