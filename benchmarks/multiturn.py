"""Multi-turn chat through the embedded stack (SGLang ``bench_multiturn`` shape), per cache config.

N clients x R rounds. Client c starts from shared system prompt ``c mod --system-prompts`` (0: none)
and each round sends its whole history (earlier prompts and the model's real answers) plus
``--request-tokens`` new tokens, asking for ``--output-tokens``. Within a round clients come in a
seeded random order. Arrivals are Poisson at ``--request-rate`` (default: ``--load`` x the service
rate of the engine without cache), a client's next turn waits for its previous answer. The cache
configs are served by their stack's ``ServingLoop`` (``--policy``, default prefill_first: SGLang's
iteration-level scheduler, a waiting request's prefill before the running requests' next decode step;
a decode iteration advances every running request, in one dispatch unless ``--no-batched-decode``)
on a virtual clock (``stacks.VirtualTimeRun``): each iteration advances it by its measured time,
a request enters the loop's queue (``Scheduler.arrive`` starts its L3 prefetch then, as SGLang does on
entry to the waiting queue) when the clock passes its send time, and the execution order, hence the
cache state, is the one that clock gives. Its TTFT = queue wait (send -> start of its prefill
iteration) + service TTFT (that iteration). The bare engine and the no-reuse pair are served one at a
time under the FCFS whole-request model (``workload.simulate_arrivals``; the record's
``notes.queue_model`` says which). Sizes: L1 = ``--l1-fraction`` (25%) of the working set (distinct full
KV pages the stream writes), L2 = ``--l2-fraction`` (50%), L3 a local directory without cap.
``--model`` (``workload.MODELS``): ``small`` by default, ``tiny`` the tests' model, whose prefill per
token is so cheap that the data path's fixed work per request weighs like a page's prefill (the
comment at ``MODELS`` says why neither is a real model's ratio).

Configs (same request stream, fresh stack each, one compiled engine):
  bare_engine      the engine alone: never caches (no tree, no transfers)
  no_cache         the full L1+L2+L3 stack, every request in its own cache_salt (nothing reusable)
  l1_only          L1 only
  l1_l2            L1 + L2 (write-through)
  l1_l2_l3         L1 + L2 + L3 (file://, write-through, prefetch wait_complete)
  l3_prepopulated  a cold stack (empty L1/L2) reading the L3 directory that l1_l2_l3 filled

Before the timed configs: a reference pass (no cache, decides the stream and the expected outputs)
and a warm-up pass of the full stack in its own namespace (compiles every transfer bucket), so compile
stalls stay out of the timings. Then the no-reuse pair (``pairing.overhead_pair``: bare_engine vs
no_cache in segments of ``--pair-segment`` requests, no_cache's transfers drained after each of its
segments, the drain reported per request; ``--overhead-reps`` reps, the overhead a ratio of mean TTFTs
over blocks of 16 requests, each block's ratio its median over the reps (``pairing.paired_overhead``:
the load of the other processes on a shared machine swings the same work's time by tens of % within
seconds); TTFT on ``--clock``, the other clock's figures beside it: the overhead target; no_cache's
record: best of the reps per request, wall time; the same pair interleaved per request is in
``overhead_vs_bare.interleaved``, for comparison). Then the TTFT phase
(``pairing.serve_segments``): bare_engine, l1_only, l1_l2 and l1_l2_l3, each on a fresh stack, serve
the stream ``--segment`` (16) requests at a time: one config serves a segment, waits for its own
in-flight transfers (L1->L2 copies, L3 writes; the wait is charged to its latency), then the next
config serves the same requests, the first config rotating (a loop's later requests sent meanwhile
wait in its queue or keep running until its next segment; its drain advances its clock).
``--ttft-reps`` reps; each request's TTFT, queue wait, service TTFT and latency are its best over the
reps that served it with the same hits (the schedule follows measured times, so reps may differ;
``ttft_reps`` in the stats counts those that did). So a config's background threads and async copies burden that config only:
served interleaved per request, they ran inside the other configs' requests (a decode uses both
cores here, the serving thread and XLA's executor threads, so any CPU they take shows up in its wall
time), while short segments keep the configs close in time on a noisy machine. The request rate is
``--load`` x the bare engine's service rate measured in the no-reuse pair (best of its reps per request; the
clock needs it before the TTFT phase starts). The bare engine serves every segment first in the TTFT
phase: its time on the segment's requests against its time on them in the no-reuse pair gives the
machine's speed now (a shared machine's load drifts), and the clocks of that segment advance by the
measured times x that speed (``VirtualTimeRun.speed``), so the arrivals load the server at ``--load``
x the bare engine's rate measured in the same segment, whatever the machine's load then; bare_engine's
stats give the speeds, the rate measured there and the load it means unscaled. What is measured
(``--clock``): by default this process's CPU time, every thread (``time.process_time``), the bare
engine's segment too: the work each iteration did, whatever the other processes on a shared 2-CPU
machine take (in wall time the bare engine's speed swings far more between segments of one run, and
the configs' queues with it: docs/performance.md). A config's background threads (copies, L3 writes) then count as if they
ran on the serving path, which can only slow the cache configs. ``--clock wall``: wall time.
Each config's CPU per request by thread group (serving, native = XLA's threads,
storage, L3 writers; ``clocks.thread_cpu_s``) is in its ``cache_stats``. Every config's outputs must equal the reference outputs, and a few requests
per config (those with the most L3 / L2 / L1 hits) are compared tokens + logits with
``ModelRunner.generate_no_cache``; a mismatch raises.

    python benchmarks/multiturn.py [--quick] [--json out.json] [--png out.png]
    python benchmarks/multiturn.py --model-kind swa|mamba [--quick] [--json out.json]

``--model-kind swa|mamba``: the same workload through a hybrid model's stack (``benchmarks.multiturn_hybrid``:
reuse, prefill tokens and pool sizes, every output exact; its own JSON); the default ``full`` is the run above.
    ray job submit --runtime-env ray_configs/runtime_env/local.yaml -- python benchmarks/multiturn.py --json mt.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import multiturn_hybrid  # noqa: E402
from benchmarks.clocks import CLOCKS  # noqa: E402
from benchmarks.multiturn_hybrid import MODEL_KINDS  # noqa: E402
from benchmarks.oracle import accesses, belady_hit_tokens, working_set  # noqa: E402
from benchmarks.pairing import (  # noqa: E402
    best_of_reps,
    cpu_ms_per_request,
    drain_charged,
    in_virtual_time,
    no_reuse_targets,
    one_at_a_time,
    serve_segments,
    warm_up_and_baselines,
)
from benchmarks.report import ConfigRecord, jsonable, make_record, report  # noqa: E402
from benchmarks.stacks import (  # noqa: E402
    BareEngine,
    VirtualTimeRun,
    close_stack,
    finish_stack,
    in_scratch_dir,
    stack_options,
)
from benchmarks.workload import FWD, MODEL, MODELS, Item, Stream, log, poisson_ticks, tier_sizes  # noqa: E402
from hicache.reference.engine import batched  # noqa: E402
from hicache.reference.engine.config import ModelConfig  # noqa: E402
from hicache.reference.engine.runner import ModelRunner  # noqa: E402
from hicache.reference.serve_types import ServeRequest  # noqa: E402
from hicache.reference.serving_loop import LoopOptions, SchedulePolicy, ServingLoop  # noqa: E402

CONFIGS = ("bare_engine", "no_cache", "l1_only", "l1_l2", "l1_l2_l3", "l3_prepopulated")


@dataclass(frozen=True)
class Workload:
    systems: list  # i32[n] arrays
    user: list  # user[c][r]: i32[n]
    order: list  # order[r]: client ids

    def working_set_pages(self, clients: int, rounds: int, output_tokens: int) -> int:
        """Distinct tokens of the final conversations, in pages (before the answers are known)."""
        ps = FWD.page_size
        shared = sum(-(-len(s) // ps) for s in self.systems[:clients])
        own = sum(-(-(sum(len(u) for u in self.user[c]) + rounds * output_tokens) // ps) for c in range(clients))
        return shared + own

    def final_len(self, c: int, args: argparse.Namespace) -> int:
        system = len(self.systems[c % len(self.systems)]) if self.systems else 0
        return system + sum(len(u) for u in self.user[c]) + args.rounds * args.output_tokens


def make_workload(args: argparse.Namespace, model: ModelConfig = MODEL) -> Workload:
    rng = np.random.default_rng(args.seed)
    vocab = model.vocab_size

    def tokens(lo: int, hi: int) -> np.ndarray:
        return rng.integers(0, vocab, size=int(rng.integers(lo, hi + 1)), dtype=np.int32)

    systems = [tokens(*args.system_tokens) for _ in range(args.system_prompts)]
    user = [[tokens(*args.request_tokens) for _ in range(args.rounds)] for _ in range(args.clients)]
    order = [[int(c) for c in rng.permutation(args.clients)] for _ in range(args.rounds)]
    wl = Workload(systems, user, order)
    need = max(wl.final_len(c, args) for c in range(args.clients))
    if need > FWD.max_context:
        raise SystemExit(f"a conversation reaches {need} tokens > max context {FWD.max_context}: "
                         "fewer rounds or shorter prompts")
    return wl


def build_stream(engine: BareEngine, wl: Workload, args: argparse.Namespace) -> Stream:
    """Runs the workload once without cache: the model's answers become the next turns' history."""
    history = [wl.systems[c % len(wl.systems)] if wl.systems else np.zeros(0, np.int32)
               for c in range(args.clients)]
    items, outputs = [], []
    for r in range(args.rounds):
        for c in wl.order[r]:
            prompt = np.concatenate([history[c], wl.user[c][r]])
            res = engine.serve(ServeRequest(prompt, args.output_tokens))
            items.append(Item(len(items), c, r, prompt, args.output_tokens))
            outputs.append(tuple(res.output))
            history[c] = np.concatenate([prompt, np.asarray(res.output, np.int32)])
    return Stream(tuple(items), tuple(outputs))


def main(argv: list[str] | None = None) -> list[ConfigRecord]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", choices=sorted(MODELS),
                   help="benchmarks/workload.py MODELS: small (default) or tiny (the tests' model)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--system-prompts", type=int, default=4, help="shared system prompts (0: none)")
    p.add_argument("--system-tokens", type=int, nargs=2, default=(96, 160), metavar=("LO", "HI"))
    p.add_argument("--request-tokens", type=int, nargs=2, default=(16, 32), metavar=("LO", "HI"))
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--request-rate", type=float, default=0.0, help="requests/s; 0: --load x bare service rate")
    p.add_argument("--load", type=float, default=0.7)
    p.add_argument("--l1-fraction", type=float, default=0.25)
    p.add_argument("--l2-fraction", type=float, default=0.5)
    p.add_argument("--overhead-reps", type=int, default=3,
                   help="bare_engine/no_cache repeats (in segments, and interleaved; median over the reps per block "
                        "of requests, pairing.paired_overhead)")
    p.add_argument("--ttft-reps", type=int, default=3,
                   help="bare_engine/l1_only/l1_l2/l1_l2_l3 repeats (fresh stacks, one config at a time; "
                        "best-of-N TTFT per request)")
    p.add_argument("--segment", type=int, default=16,
                   help="TTFT phase: requests a config serves in a row before the next config serves them")
    p.add_argument("--pair-segment", type=int, default=1,
                   help="no-reuse pair: requests a config serves in a row (no_cache then drained) before the other "
                        "serves them; short, so that the two configs meet the same machine load")
    p.add_argument("--policy", default=SchedulePolicy.PREFILL_FIRST.value, choices=[x.value for x in SchedulePolicy],
                   help="the cache configs' ServingLoop policy (TTFT phase and l3_prepopulated)")
    p.add_argument("--decode-batch", type=int, default=0,
                   help="running requests one decode iteration advances, round-robin (0: all; LoopOptions)")
    p.add_argument("--batched-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="a decode iteration in one dispatch (hicache.reference.engine.batched: a scan of the [C] program, "
                        "bit-identical where checked), as SGLang's decode batch runs one forward; default: on "
                        "where batched.supported (XLA:CPU), else one decode_step per request")
    p.add_argument("--clock", default="cpu", choices=sorted(CLOCKS),
                   help="what advances the loops' virtual clocks and times the no-reuse pair's target: this "
                        "process's CPU time (all threads; robust to other processes on a shared machine; background "
                        "work counts as if on the critical path), or wall time")
    p.add_argument("--spot-checks", type=int, default=3, help="generate_no_cache comparisons per config")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--l3-dir", help="parent of the L3 directories (default: a temp dir, removed)")
    p.add_argument("--json")
    p.add_argument("--png")
    p.add_argument("--quick", action="store_true", help="6 clients x 3 rounds, 1 overhead rep, 1 TTFT rep")
    p.add_argument("--model-kind", default="full", choices=MODEL_KINDS,
                   help="full: the run above; swa / mamba: the hybrid model's path (benchmarks.multiturn_hybrid)")
    p.add_argument("--window", type=int, default=64, help="--model-kind swa: the local layers' window (tokens)")
    p.add_argument("--swa-fractions", default="1.0,0.75,0.5,0.25",
                   help="--model-kind swa: SWA pool sizes (x the Full pool) of the l1_only pool sweep")
    args = p.parse_args(argv)
    if args.quick:
        args.clients, args.rounds, args.overhead_reps, args.ttft_reps = 6, 3, 1, 1
    if args.ttft_reps < 1 or args.overhead_reps < 1:
        raise SystemExit(f"--ttft-reps and --overhead-reps must be >= 1, got {args.ttft_reps}, {args.overhead_reps}")
    t_start = time.perf_counter()
    ps = FWD.page_size
    model = MODELS[args.model]
    wl = make_workload(args, model)
    est = wl.working_set_pages(args.clients, args.rounds, args.output_tokens)
    longest = max(wl.final_len(c, args) for c in range(args.clients))
    l1_pages, l2_slots = tier_sizes(est, longest, args.l1_fraction, args.l2_fraction)
    if args.model_kind != "full":
        out = multiturn_hybrid.run(args, wl, l1_pages, l2_slots, model)
        out["model"] = args.model
        out["seconds"] = round(time.perf_counter() - t_start, 1)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
        log(f"  targets: {out['targets']}")
        return []
    base = ModelRunner(model, FWD, num_pages=l1_pages)
    bare = BareEngine(base, l1_pages)
    log(f"multiturn: model {args.model} (hidden {model.hidden}, MLP {model.mlp_hidden}, {model.num_layers} layers), "
        f"{args.clients} clients x {args.rounds} rounds; reference pass (no cache; compiles) ...")
    stream = build_stream(bare, wl, args)
    items, ref = stream.items, stream.outputs
    acc, working = working_set(items, ref)
    log(f"  {len(items)} requests, {stream.prompt_tokens:,} prompt tokens; working set {working} pages "
        f"({working * ps:,} tokens, {est} estimated); L1 {l1_pages} pages ({l1_pages / working:.0%}), "
        f"L2 {l2_slots} pages ({l2_slots / working:.0%})")
    return in_scratch_dir(args.l3_dir, "hicache-mt-", lambda tmp: _run(
        args, items, ref, acc, l1_pages, l2_slots, working, base, bare, tmp, t_start))


def _rate(args: argparse.Namespace, bare: list) -> float:
    """Requests/s: ``--request-rate``, or ``--load`` x the service rate of ``bare`` (bare_engine results)."""
    return args.request_rate or args.load / statistics.fmean(s.result.latency_s for s in bare)


def _run(args, items, ref, acc, l1_pages, l2_slots, working, base, bare, tmp, t_start) -> list[ConfigRecord]:
    ps = FWD.page_size
    model = base.model  # (--model's, which the reference pass ran)
    full = lambda d: stack_options(l1_pages, l2_slots, tmp / d, model)  # noqa: E731
    served, spots, stats, overhead = warm_up_and_baselines(args, items, ref, base, bare, full)
    from hicache.reference.stack import build_stack

    rate = _rate(args, served["bare_engine"])  # the no-reuse pair's bare engine, best of its reps
    ref_latency = [s.result.latency_s for s in served["bare_engine"]]  # in item order
    speeds: list[float] = []
    utilization: dict[str, list[float]] = {}  # per config, per rep: the server's busy share of its clock
    bare_part = one_at_a_time(bare.serve, ref, "bare_engine")
    ticks = poisson_ticks(len(items), rate, args.seed + 1)

    clock = CLOCKS[args.clock]

    def bare_first(clocks: dict[str, VirtualTimeRun], part):
        """The bare engine serves the segment first; its time on these requests (on ``clock``) against
        its wall time on them in the no-reuse pair (the rate's reference) sets the clocks' speed for
        the segment."""
        t0 = clock()
        done = bare_part(part)
        spent = clock() - t0 if args.clock == "cpu" else sum(d.result.latency_s for d in done)
        speed = sum(ref_latency[it.index] for it in part) / spent
        speeds.append(speed)
        for c in clocks.values():
            c.speed = speed
        return done

    if args.batched_decode is None:
        args.batched_decode = batched.supported(jax.default_backend())
    loop_options = LoopOptions(policy=args.policy, decode_batch=args.decode_batch, batched_decode=args.batched_decode)
    log(f"  bare_engine, l1_only, l1_l2, l1_l2_l3 in segments of {args.segment} requests, each config's transfers "
        f"drained before the next config's segment, {args.ttft_reps} rep(s), fresh stacks; cache configs in a "
        f"{args.policy} ServingLoop on a virtual clock, arrivals at {rate:.1f} req/s ...")
    names = ("bare_engine", "l1_only", "l1_l2", "l1_l2_l3")
    runs: list[dict] = []
    for rep in range(args.ttft_reps):
        opts = {"l1_only": stack_options(l1_pages, model=model), "l1_l2": stack_options(l1_pages, l2_slots, model=model),
                "l1_l2_l3": full("l3" if rep == 0 else f"l3-rep{rep}")}
        stacks = {n: build_stack(o, base) for n, o in opts.items()}
        clocks = {n: VirtualTimeRun(items, ticks, ServingLoop(st.scheduler, loop_options), ref, n, clock=clock)
                  for n, st in stacks.items()}
        runs.append(serve_segments({"bare_engine": partial(bare_first, clocks),
                                    **{n: in_virtual_time(c) for n, c in clocks.items()}},
                                   items, {n: drain_charged(st, clocks[n]) for n, st in stacks.items()},
                                   args.segment, rotate=rep, lead="bare_engine"))
        for name, st in stacks.items():
            utilization.setdefault(name, []).append(clocks[name].busy_s / clocks[name].now)
            if rep == 0:  # rep 0's stacks give the stats and the spot checks
                spots[name], stats[name] = finish_stack(name, st, runs[0][name].served, args.spot_checks)
            else:
                close_stack(st)
        del stacks, clocks
    best, disagreed = best_of_reps([{n: run[n].served for n in names} for run in runs])
    served.update(best)
    segment_rate = _rate(args, served["bare_engine"])
    stats["bare_engine"] = {"request_rate_from_segments": segment_rate, "load_in_segments": args.load * rate / segment_rate,
                            "clock_speed_per_segment": {"min": min(speeds), "mean": statistics.fmean(speeds),
                                                        "max": max(speeds)}}
    for name in names:
        stats[name]["cpu_ms_per_request"] = cpu_ms_per_request([run[name] for run in runs])
        stats[name]["drain_ms_mean"] = round(1e3 * statistics.fmean(d for run in runs for d in run[name].drain_s), 3)
        stats[name]["ttft_reps"] = {"reps": args.ttft_reps, "requests_whose_reps_disagreed_on_hits": disagreed[name]}
        if name in utilization:
            stats[name]["server_utilization_per_rep"] = [round(u, 3) for u in utilization[name]]
    log("  l3_prepopulated (cold stack on l1_l2_l3's L3; in segments after the bare engine, for its clock's speed) ...")
    cold = build_stack(full("l3"), base)
    cold_clock = VirtualTimeRun(items, ticks, ServingLoop(cold.scheduler, loop_options), ref, "l3_prepopulated",
                                clock=clock)
    run = serve_segments({"bare_engine": partial(bare_first, {"l3_prepopulated": cold_clock}),
                          "l3_prepopulated": in_virtual_time(cold_clock)}, items,
                         {"l3_prepopulated": drain_charged(cold, cold_clock)}, args.segment, lead="bare_engine")
    served["l3_prepopulated"] = run["l3_prepopulated"].served
    spots["l3_prepopulated"], stats["l3_prepopulated"] = finish_stack("l3_prepopulated", cold,
                                                                      served["l3_prepopulated"], args.spot_checks)

    inf = float("inf")
    nc_acc = accesses([(it.prompt, o) for it, o in zip(items, ref)], ps, [f"nc-{it.index}" for it in items])
    optimal = {
        "bare_engine": (None, None),
        "no_cache": (belady_hit_tokens(nc_acc, inf, ps), inf),
        "l1_only": (belady_hit_tokens(acc, l1_pages, ps), l1_pages * ps),
        "l1_l2": (belady_hit_tokens(acc, l1_pages + l2_slots, ps), (l1_pages + l2_slots) * ps),
        "l1_l2_l3": (belady_hit_tokens(acc, inf, ps), inf),
        "l3_prepopulated": (belady_hit_tokens(acc, inf, ps, preload=acc), inf),
    }
    caps = {"bare_engine": (0, 0, False), "no_cache": (l1_pages, l2_slots, True), "l1_only": (l1_pages, 0, False),
            "l1_l2": (l1_pages, l2_slots, False), "l1_l2_l3": (l1_pages, l2_slots, True),
            "l3_prepopulated": (l1_pages, l2_slots, True)}
    records = []
    for name in CONFIGS:
        l1, l2, l3 = caps[name]
        notes = {"model": args.model, "working_set_tokens": working * ps, "cache_stats": jsonable(stats[name])}
        if name in ("bare_engine", "no_cache"):
            notes["overhead_vs_bare"] = overhead
        records.append(make_record(name, served[name], ticks, rate, l1_tokens=l1 * ps, l2_tokens=l2 * ps, l3=l3,
                                   optimal_hits=optimal[name][0], optimal_capacity=optimal[name][1],
                                   exact_checked=len(served[name]), spot=spots[name], notes=notes))
    by = {r.config: r for r in records}
    targets = {
        "prefill_reduction_l1_l2_l3_vs_l1_only": by["l1_only"].prefill_tokens_computed
        / max(1, by["l1_l2_l3"].prefill_tokens_computed),
        "ttft_speedup_l1_l2_l3_vs_l1_only": by["l1_only"].ttft_mean_s / by["l1_l2_l3"].ttft_mean_s,
        "service_ttft_speedup_l1_l2_l3_vs_l1_only": by["l1_only"].service_ttft_mean_s
        / by["l1_l2_l3"].service_ttft_mean_s,
        **no_reuse_targets(overhead),
    }
    targets["met"] = {"prefill_3x": targets["prefill_reduction_l1_l2_l3_vs_l1_only"] >= 3,
                      "ttft_2x": targets["ttft_speedup_l1_l2_l3_vs_l1_only"] >= 2,
                      "service_ttft_2x": targets["service_ttft_speedup_l1_l2_l3_vs_l1_only"] >= 2,
                      "overhead_5pct": targets["no_reuse_overhead_service_ttft"] <= 0.05}
    report(records, targets, ("l1_l2_l3", "no_cache"), rate, args.json, args.png,
           f"multiturn: {args.clients} clients x {args.rounds} rounds, L1 = "
           f"{args.l1_fraction:.0%} of the working set, {rate:.1f} req/s", t_start)
    return records


if __name__ == "__main__":
    main()
