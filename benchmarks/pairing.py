"""Configs served side by side on a shared, noisy machine, and the no-reuse overhead pair.

``serve_segments`` / ``serve_interleaved`` alternate the configs over the same stream (segments of
requests, or request by request) so that load drift falls on all of them alike, each config's
background work drained on its own account; ``best_of_reps`` and ``paired_overhead`` turn repeated runs
into robust figures; ``overhead_pair`` is the no-reuse pair (the bare engine vs a stack that never
reuses) that ``warm_up_and_baselines`` runs for both end-to-end benchmarks.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

import numpy as np

from benchmarks.clocks import CLOCKS, cpu_by_group, on_cpu_clock, on_wall_clock, thread_cpu_s
from benchmarks.oracle import serve_items, spot_check
from benchmarks.report import jsonable, phase_means_ms
from benchmarks.stacks import BareEngine, VirtualTimeRun, close_stack, drain_stack, run_stack
from benchmarks.workload import Item, Served, log
from hicache.reference.engine.runner import ModelRunner
from hicache.reference.serve_types import ServeRequest, ServeResult


class PairMode(str, Enum):
    """How ``overhead_pair`` alternates the bare engine and the no-reuse stack."""

    SEGMENTS = "segments"  # ``segment`` requests in a row per config, the stack drained after each of its segments
    INTERLEAVED = "interleaved"  # request by request, nothing drained in between (the figure before segments)


PAIR_BLOCK = 16  # requests per block of ``paired_overhead``


@dataclass
class ConfigRun:
    """One config's part of ``serve_segments``: its results (in stream order; each segment's drain
    added to the latency of its last request), the CPU its process spent while it served or drained,
    by thread group (``thread_cpu_s``), and each drain's duration."""

    served: list[Served] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)
    drain_s: list[float] = field(default_factory=list)

    def cpu_ms_per_request(self) -> dict[str, float]:
        return cpu_ms_per_request([self])


def cpu_ms_per_request(runs: Sequence[ConfigRun]) -> dict[str, float]:
    """CPU ms per request served, by thread group, over ``runs`` (one config's reps)."""
    served = sum(len(r.served) for r in runs)
    groups = sorted({g for r in runs for g in r.cpu_s})
    return {g: round(1e3 * sum(r.cpu_s.get(g, 0.0) for r in runs) / max(1, served), 3) for g in groups}


def one_at_a_time(serve: Callable[[ServeRequest], ServeResult], reference: Sequence[tuple[int, ...]],
                  config: str, salt: Callable[[Item], str | None] = lambda it: None
                  ) -> Callable[[Sequence[Item]], list[Served]]:
    """A ``serve_segments`` server that serves a segment's items one at a time (``serve_items``, each
    request in the cache_salt ``salt(item)``)."""
    return lambda part: serve_items(serve, part, reference, config, salt)


def in_virtual_time(run: VirtualTimeRun) -> Callable[[Sequence[Item]], list[Served]]:
    """A ``serve_segments`` server that runs ``run``'s loop until a segment's items are done (later items
    sent meanwhile are in its queue or running: they stay there until the config's next segment)."""
    return lambda part: run.serve_until(part[-1].index + 1)


def drain_charged(stack, run: VirtualTimeRun) -> Callable[[], None]:
    """A drain of ``stack`` whose time (on ``run``'s clock) advances ``run``'s clock (the server is busy)."""
    def drain() -> None:
        t0 = run.clock()
        drain_stack(stack)
        run.charge(run.clock() - t0)
    return drain


def serve_segments(serves: dict[str, Callable[[Sequence[Item]], list[Served]]], items: Sequence[Item],
                   drains: dict[str, Callable[[], object]] | None = None,
                   segment: int = 16, rotate: int = 0, lead: str | None = None,
                   clock: Callable[[], float] = time.perf_counter) -> dict[str, ConfigRun]:
    """Every config serves the stream, ``segment`` consecutive items at a time (``serves[config](part)``
    returns their results, checked against the reference: ``one_at_a_time``, ``in_virtual_time``): one
    config serves a segment, then ``drains[config]()`` waits for its in-flight transfers (L1->L2 copies, L3 writes),
    then the next config serves the same items (the first config rotates per segment, shifted by
    ``rotate``). A config's background work so runs inside its own requests or its drain, never inside
    another config's, and the drain's time is charged to the latency of the segment's last request
    (the server was busy with it). Segments short on a noisy machine keep the configs close in time
    (load drift hits all alike). ``lead``, if given, serves every segment first (the others rotate
    after it): its results may set up the others' (``VirtualTimeRun.speed``). ``clock`` measures the
    drains (wall time by default; ``time.process_time``: the CPU the process spent meanwhile)."""
    if segment < 1:
        raise ValueError(f"segment must be >= 1, got {segment}")
    if lead is not None and lead not in serves:
        raise ValueError(f"lead {lead!r} is not one of the configs {list(serves)}")
    names = [n for n in serves if n != lead]
    drains = drains or {}
    runs = {n: ConfigRun() for n in serves}
    for s, lo in enumerate(range(0, len(items), segment)):
        part = items[lo:lo + segment]
        k = (s + rotate) % max(1, len(names))
        for name in ([lead] if lead is not None else []) + names[k:] + names[:k]:
            run = runs[name]
            before = thread_cpu_s()
            done = serves[name](part)
            t0 = clock()
            drains.get(name, lambda: None)()
            drained = clock() - t0
            for group, cpu in cpu_by_group(before, thread_cpu_s()).items():
                run.cpu_s[group] = run.cpu_s.get(group, 0.0) + cpu
            last = done[-1]
            done[-1] = replace(last, result=replace(last.result, latency_s=last.result.latency_s + drained))
            run.served += done
            run.drain_s.append(drained)
    return runs


def serve_interleaved(serves: dict[str, Callable[[ServeRequest], ServeResult]], items: Sequence[Item],
                      reference: Sequence[tuple[int, ...]], rotate: int = 0) -> dict[str, list[Served]]:
    """Each item is served by every config in turn (the first config rotates, shifted by ``rotate``),
    so that load drift on a shared machine falls on all configs alike; each config has its own stack
    and state."""
    names = list(serves)
    out: dict[str, list[Served]] = {n: [] for n in names}
    for i, it in enumerate(items):
        k = (i + rotate) % len(names)
        for name in names[k:] + names[:k]:
            out[name] += serve_items(serves[name], [it], reference, name)
    return out


def best_of_reps(reps: Sequence[dict[str, list[Served]]]) -> tuple[dict[str, list[Served]], dict[str, int]]:
    """Rep 0's results, each request's ``ttft_s`` and ``latency_s`` (and, served in virtual time, its
    queue wait and client TTFT) replaced by its best (minimum) over the reps that served it with the
    same hits and computed tokens (one at a time the cache state is deterministic; in virtual time the
    schedule follows the measured step times, so reps may disagree). Returns (served, per config the
    requests whose reps disagreed on hits)."""
    def shape(r: ServeResult) -> tuple:
        return r.device_hit_tokens, r.loaded_tokens, r.storage_tokens, r.computed_tokens

    out, disagreed = {}, {}
    for name, first in reps[0].items():
        out[name], disagreed[name] = [], 0
        for i, s in enumerate(first):
            same = [rep[name][i] for rep in reps if shape(rep[name][i].result) == shape(s.result)]
            disagreed[name] += len(same) < len(reps)
            timing = s.timing and replace(s.timing, queue_wait_s=min(x.timing.queue_wait_s for x in same),
                                          client_ttft_s=min(x.timing.client_ttft_s for x in same))
            out[name].append(Served(s.item, replace(s.result, ttft_s=min(x.result.ttft_s for x in same),
                                                    latency_s=min(x.result.latency_s for x in same)), timing))
    return out, disagreed


def paired_overhead(reps: Sequence[dict[str, list[Served]]], block: int = PAIR_BLOCK, base: str = "bare_engine",
                    other: str = "no_cache") -> tuple[float, float]:
    """(overhead of ``other`` over ``base``, ``base``'s mean TTFT) from reps that each served the same
    stream with both configs (results in stream order), robust to a shared machine's load: the
    stream is cut into blocks of ``block`` requests; in each rep a block's ratio is ``other``'s summed
    TTFT over ``base``'s (both served it within seconds, so load drift largely cancels); a block's
    ratio is its median over the reps (a rep whose windows of one config met a burst of load is
    outvoted, a cost that recurs in every rep stays, as a deterministic one does); the overhead is
    the blocks' ratios weighted by ``base``'s block TTFT (median over the reps), minus 1: a ratio of
    mean TTFTs. ``base``'s mean TTFT: those weights summed over the requests."""
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be an int >= 1, got {block!r}")
    if not reps:
        raise ValueError("need at least one rep")
    order = [s.item.index for s in reps[0][base]]
    for rep in reps:
        for name in (base, other):
            if [s.item.index for s in rep[name]] != order:
                raise ValueError(f"every rep must serve the same items in the same order with {base!r} and "
                                 f"{other!r}; {name!r} served {[s.item.index for s in rep[name]][:8]}... vs "
                                 f"{order[:8]}...")
    ratios, weights = [], []
    for lo in range(0, len(order), block):
        b = np.array([sum(s.result.ttft_s for s in rep[base][lo:lo + block]) for rep in reps])
        o = np.array([sum(s.result.ttft_s for s in rep[other][lo:lo + block]) for rep in reps])
        ratios.append(float(np.median(o / b)))
        weights.append(float(np.median(b)))
    w = np.array(weights)
    return float((np.array(ratios) * w).sum() / w.sum() - 1), float(w.sum() / len(order))


def overhead_pair(bare: BareEngine, runner: ModelRunner, options: Callable[[str], object], items: Sequence[Item],
                  reference: Sequence[tuple[int, ...]], reps: int, segment: int = 1, clock: str = "cpu"):
    """The no-reuse workload through the full stack (``no_cache``: every request in its own cache_salt)
    and through ``bare`` (never caches), as a server serves its own requests: in segments of
    ``segment`` requests (``serve_segments``: the configs alternate per segment, the first one rotated
    per rep), the stack's background work (L1->L2 copies, L3 writes and their acks) drained at the
    end of each of its segments. That work so lands in the stack's own requests or in its drains,
    never in the bare engine's; the drains are reported per request (wall and CPU ms, and as a bound
    the overhead with every drain charged to a TTFT), and so is each config's thread CPU per request
    (``cpu_ms_per_request``, ``thread_cpu_s`` groups). ``options(tag)`` gives a fresh stack's options
    (its own L3 directory per tag). A shorter segment drains more often: the background work left by
    each segment's last request goes to its drain (the stack's latency) rather than into the next
    request. The stack keeps that work out of TTFT windows itself (its L3 writes wait past the next
    request's first token, ``Scheduler`` ``hold_storage_writes``; L1->L2 backups go in batches at a
    finish), and the drain figures bound what is left.

    Every request is timed on both clocks (``by_clock``): wall time (``ServePhases``) and this
    process's CPU time, every thread (``on_cpu_clock``: what the work took, whatever other processes
    on a shared machine take; background threads count as if on the critical path); ``clock`` says
    which one the top-level figures (the target) use. Robust to a noisy machine (``paired_overhead``):
    the overhead is a ratio of mean TTFTs over blocks of ``PAIR_BLOCK`` requests, each block's ratio
    the median over ``reps`` (fresh stack per rep) of the two configs' summed TTFTs on it, served
    within seconds of each other. On a shared machine the CPU time of the same work swings with the
    other processes' load, on the scale of seconds, so short segments (default 1) pair the configs
    closely in time; a block holds several of them.
    Beside it: the ratio of the mean best-of-N TTFTs (each request's best of ``reps``,
    ``best_of_reps``; noisier: a request's minimum comes from whichever rep met a quiet moment) and
    the median of the per-request best-of-N ratios. Each rep also serves the pair interleaved request by request with nothing drained
    (``PairMode.INTERLEAVED``, another fresh stack; the summary's ``interleaved``), so that both
    protocols meet the same machine state. Returns (bare served, no_cache served: best-of-N wall
    timings of the segments; no_cache stats and spot checks of rep 0; summary)."""
    from hicache.reference.stack import build_stack

    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}")
    plans = {PairMode.SEGMENTS: segment, PairMode.INTERLEAVED: 1}
    cpu_served: dict[PairMode, list[dict[str, list[Served]]]] = {m: [] for m in plans}
    wall_served: dict[PairMode, list[dict[str, list[Served]]]] = {m: [] for m in plans}
    runs: dict[PairMode, list[dict[str, ConfigRun]]] = {m: [] for m in plans}
    wall_drain_s: dict[PairMode, list[float]] = {m: [] for m in plans}
    first = None
    for rep in range(reps):
        for mode in (list(plans) if rep % 2 == 0 else list(plans)[::-1]):
            stack = build_stack(options(f"{mode.value}-{rep}"), runner)
            salt = lambda it, tag=f"nc-{mode.value}-{rep}": f"{tag}-{it.index}"  # noqa: E731
            serves = {"bare_engine": one_at_a_time(on_cpu_clock(bare.serve), reference, "bare_engine"),
                      "no_cache": one_at_a_time(on_cpu_clock(stack.scheduler.serve), reference, "no_cache", salt)}
            wall_drains: list[float] = []

            def drain(st=stack, out=wall_drains) -> None:
                t0 = time.perf_counter()
                drain_stack(st)
                out.append(time.perf_counter() - t0)
            drains = {"no_cache": drain} if mode is PairMode.SEGMENTS else {}
            run = serve_segments(serves, items, drains, plans[mode], rotate=rep, clock=time.process_time)
            drain_stack(stack)  # the interleaved pair's writes land here, outside its timings
            runs[mode].append(run)
            wall_drain_s[mode] += wall_drains
            cpu_served[mode].append({n: r.served for n, r in run.items()})
            wall_served[mode].append({n: on_wall_clock(r.served, wall_drains if n == "no_cache" else (), plans[mode])
                                      for n, r in run.items()})
            if first is None and mode is PairMode.SEGMENTS:
                stats = jsonable(stack.head.cache_stats())
                spots = (spot_check(bare.runner, run["bare_engine"].served, "bare_engine", 1),
                         spot_check(stack.runner, run["no_cache"].served, "no_cache", 1))
                first = (stats, spots)
            close_stack(stack)
    summaries = {m: _pair_summary(m, plans[m], clock, {"cpu": cpu_served[m], "wall": wall_served[m]}, runs[m],
                                  wall_drain_s[m]) for m in plans}
    best, summary = summaries[PairMode.SEGMENTS]
    summary["interleaved"] = summaries[PairMode.INTERLEAVED][1]
    return (best["bare_engine"], best["no_cache"], *first, summary)


def _pair_summary(mode: PairMode, segment: int, clock: str, served: dict[str, Sequence[dict[str, list[Served]]]],
                  runs: Sequence[dict[str, ConfigRun]], wall_drain_s: Sequence[float]
                  ) -> tuple[dict[str, list[Served]], dict]:
    """(best-of-reps wall results, the summary ``overhead_pair`` reports) of one protocol's reps;
    ``served[clock]``: the reps timed on that clock; the no_cache drains: CPU in ``runs``, wall given."""
    requests = sum(len(run["no_cache"].served) for run in runs)
    drains = {"cpu": [d for run in runs for d in run["no_cache"].drain_s], "wall": wall_drain_s}
    by_clock, best_wall = {}, None
    for name, reps in served.items():
        best, _ = best_of_reps(reps)
        best_wall = best if name == "wall" else best_wall
        ttft = {c: np.array([s.result.ttft_s for s in best[c]]) for c in best}
        latency = {c: np.array([s.result.latency_s for s in best[c]]) for c in best}
        b, n = ttft["bare_engine"], ttft["no_cache"]
        drain_s = sum(drains[name]) / requests
        overhead, bare_mean = paired_overhead(reps)
        by_clock[name] = {
            "bare_engine_best_of_n_ttft_mean_s": float(b.mean()), "no_cache_best_of_n_ttft_mean_s": float(n.mean()),
            "overhead_mean_ttft": overhead, "paired_block": PAIR_BLOCK, "bare_engine_paired_ttft_mean_s": bare_mean,
            "overhead_best_of_n_mean_ttft": float(n.mean() / b.mean() - 1),
            "overhead_median_request_ratio": float(np.median(n / b)) - 1,
            "overhead_mean_latency": float(latency["no_cache"].mean() / latency["bare_engine"].mean() - 1),
            "no_cache_drain_ms_per_request": round(1e3 * drain_s, 3),
            "overhead_mean_ttft_drain_charged": overhead + drain_s / bare_mean,
            "per_rep_service_ttft_mean_s": [{c: statistics.fmean(s.result.ttft_s for s in rep[c]) for c in rep}
                                            for rep in reps]}
    return best_wall, {
        "mode": mode.value, "segment": segment, "reps": len(runs), "clock": clock, **by_clock[clock],
        "by_clock": by_clock, "no_cache_drains": len(drains["cpu"]),
        "cpu_ms_per_request": {c: cpu_ms_per_request([run[c] for run in runs]) for c in runs[0]},
        "service_phases_mean_ms": {c: phase_means_ms([s.result for rep in served["wall"] for s in rep[c]])
                                   for c in runs[0]}}


def no_reuse_targets(overhead: dict) -> dict[str, float]:
    """The no-reuse pair's figures for a benchmark's targets: the overhead on the pair's clock (the
    target, ``paired_overhead``), its median per request, the other clock's and the interleaved pair's."""
    out = {"no_reuse_overhead_service_ttft": overhead["overhead_mean_ttft"],
           "no_reuse_overhead_median_request": overhead["overhead_median_request_ratio"]}
    for clock, seg in overhead["by_clock"].items():
        out[f"no_reuse_overhead_service_ttft_{clock}"] = seg["overhead_mean_ttft"]
    out["no_reuse_overhead_interleaved"] = overhead["interleaved"]["overhead_mean_ttft"]
    return out


def warm_up_and_baselines(args, items: Sequence[Item], ref, base: ModelRunner, bare: BareEngine,
                          full: Callable[[str], object]):
    """Compile pass (full stack, then a cold stack on its L3, own namespace), then the no-reuse pair
    (bare engine vs a stack that never reuses; ``overhead_pair``: in segments of ``args.pair_segment``,
    and interleaved per request for comparison).

    Returns (served, spot checks, stats, overhead) keyed by config name, for the two baseline configs.
    """
    log("  warm-up pass (full stack then a cold stack on its L3, own namespace; compiles transfers) ...")
    run_stack("warm-up", full("l3-warm-up"), base, items, ref, salt=lambda it: "warm-up", spot=1)
    run_stack("warm-up cold", full("l3-warm-up"), base, items, ref, salt=lambda it: "warm-up", spot=0)
    log(f"  bare_engine + no_cache in segments of {args.pair_segment} requests (no_cache drained after each of its "
        f"segments), and interleaved per request, {args.overhead_reps} rep(s) ...")
    b, n, nc_stats, (sp_b, sp_n), overhead = overhead_pair(
        bare, base, lambda tag: full(f"l3-nc-{tag}"), items, ref, args.overhead_reps, args.pair_segment, args.clock)
    for clock, seg in overhead["by_clock"].items():
        interleaved = overhead["interleaved"]["by_clock"][clock]
        log(f"  no-reuse overhead on the {clock} clock (mean service TTFT, blocks of {PAIR_BLOCK} requests, median "
            f"of {args.overhead_reps} rep(s)): {seg['overhead_mean_ttft']:+.1%} in segments of {args.pair_segment} "
            f"(best-of-N {seg['overhead_best_of_n_mean_ttft']:+.1%}; drain {seg['no_cache_drain_ms_per_request']:.2f} "
            f"ms per request; {seg['overhead_mean_ttft_drain_charged']:+.1%} with every drain on a TTFT), "
            f"{interleaved['overhead_mean_ttft']:+.1%} interleaved per request")
    return ({"bare_engine": b, "no_cache": n}, {"bare_engine": sp_b, "no_cache": sp_n},
            {"bare_engine": {}, "no_cache": nc_stats}, overhead)
