"""``multiturn.py --model-kind swa|mamba``: the multi-turn stream through a hybrid model's stack (issue #26).

The same workload as the Full model's run (``multiturn.make_workload``: N clients x R rounds, shared system
prompts, each round the whole history plus new tokens; the model's real answers become the history), with
the reference engine as an SWA+Full model (every other layer local, ``--window`` tokens) or a
recurrent+Full model (one recurrent layer: its context is one state per cached node end). Each config is a
fresh stack whose head is built with the model's components, serving the stream one request at a time in
the workload's order (this path measures reuse, prefill tokens and pool sizes, not TTFT: the Full model's
run keeps the serving loop and its virtual clocks). Every output is compared with the no-cache run of the
same model (tokens and logits, bit for bit): a mismatch raises.

Configs: ``l1_only``; ``l1_l2`` (write-through; SWA: the window's pages in L2 beside the Full pages; Mamba:
the states at node ends, loaded back with the Full pages of an L2 hit); ``l1_l2_l3`` (``l1_l2`` plus an L3 on
a file:// directory: Full pages and, per component pool, the SWA window's pages / the states at node ends,
``hicache.cluster.storage_components``; prefetch ``wait_complete``, the cost model off, so what L3 holds is
loaded whatever this box's speed); ``l1_l2_unbounded`` (an L2 of 8 x ``l1_l2``'s, holding the whole stream:
since an L3 hit comes back through L2, about the most an L3 could add). ``full_model_same_path``: the Full
model's ``l1_only`` and ``l1_l2`` on this path, for comparison. Sizes as the Full run: L1 = ``--l1-fraction`` of the working set,
L2 = ``--l2-fraction``; SWA pool = L1 (``--swa-fractions`` sweep below), its L2 as the Full L2; state slots
= L1 pages, their L2 as many as the Full L2's pages.

SWA pool sweep (swa only): ``l1_only`` with L1 = the working set, served again with the SWA pool at each of
``--swa-fractions`` x the Full pool (at least the longest request's pages); reported: each pool's size and hit
tokens, and the smallest SWA pool that keeps the hit tokens of an SWA pool as large as the Full pool (same
hit rate; and within 2% of them).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.workload import FWD, MODEL, log
from hicache.cluster.cost_model import CostOptions
from hicache.cluster.storage_tier import PrefetchPolicy
from hicache.reference.engine.config import ModelConfig
from hicache.reference.serve_types import ServeRequest
from hicache.reference.stack import StackOptions, build_stack

MODEL_KINDS = ("full", "swa", "mamba")


def hybrid_model(kind: str, window: int, full: ModelConfig = MODEL):
    """The Full run's model (``full``) as an SWA+Full or recurrent+Full model of the same size."""
    if kind == "swa":
        return dataclasses.replace(full, sliding_window=window)
    if kind == "mamba":
        return dataclasses.replace(full, recurrent_layers=(1,))
    raise ValueError(f"model kind {kind!r} has no hybrid path; choose one of {MODEL_KINDS[1:]}")


def reference(runner, wl, args) -> list[tuple[np.ndarray, object]]:
    """(prompt, no-cache generation) per request in stream order: the answers become the next turns."""
    history = [wl.systems[c % len(wl.systems)] if wl.systems else np.zeros(0, np.int32) for c in range(args.clients)]
    out = []
    for r in range(args.rounds):
        for c in wl.order[r]:
            prompt = np.concatenate([history[c], wl.user[c][r]])
            gen = runner.generate_no_cache(prompt, args.output_tokens)
            out.append((prompt, gen))
            history[c] = np.concatenate([prompt, np.asarray(gen.tokens, np.int32)])
    return out


def serve(name: str, options: StackOptions, stream, runner, args) -> dict:
    if options.l3_url is None:
        return _serve(name, options, stream, runner, args)
    with tempfile.TemporaryDirectory(prefix="hicache-mt-hybrid-") as tmp:  # a fresh L3 per run
        out = _serve(name, dataclasses.replace(options, l3_url=f"file://{tmp}"), stream, runner, args)
        out["components"]["l3"]["objects"] = l3_objects(Path(tmp))
        return out


def l3_objects(root: Path) -> dict[str, int]:
    """Files in an L3 directory per pool folder (``.../v*/<fingerprint>/<pool>/...``): objects, and apart the
    leading-page index entries (``/i/``), which cost a write each too."""
    out: dict[str, int] = {}
    for p in root.rglob("*"):
        parts = p.relative_to(root).parts
        if p.is_file() and len(parts) > 3 and parts[0].startswith("v"):
            name = parts[2] + ("_index" if "i" in parts[3:-1] else "")
            out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))


def _serve(name: str, options: StackOptions, stream, runner, args) -> dict:
    """Serves the stream on a fresh stack; raises on any output that differs from the no-cache run."""
    stack = build_stack(options, runner)
    t0 = time.perf_counter()
    results = []
    try:
        for i, (tokens, ref) in enumerate(stream):
            res = stack.scheduler.serve(ServeRequest(tokens, args.output_tokens))
            if res.output != ref.tokens or res.logits is None or not np.array_equal(res.logits, ref.logits):
                raise AssertionError(f"{name}: request {i} differs from the no-cache run")
            results.append((res.prompt_len, res.computed_tokens, res.device_hit_tokens, res.loaded_tokens))
            if options.l3_url is not None:  # its L2->L3 writes land before the next request asks L3 (the figures
                stack.client.flush_write_through_acks()  # then do not depend on this box's speed)
        prompt, computed, l1_hits, loaded = (sum(col) for col in zip(*results))
        if stack.head.controller is not None:
            stack.client.flush_write_through_acks()
        stats = stack.head.cache_stats()
        l3 = stats.get("storage")
    finally:
        if stack.worker is not None:
            stack.worker.close()
    comps = {k: dict(v) for k, v in stats.items() if k in ("swa", "mamba")}
    if l3 is not None:
        comps["l3"] = {k: l3[k] for k in ("backup_pages", "prefetch_pages", "prefetch_started", "prefetch_failures",
                                          "prefetch_redundant_pages", "l3_queries")}
        comps["l3"].update(l3.get("component_values", {}))
    return {"requests": len(stream), "prompt_tokens": prompt, "prefill_tokens_computed": computed,
            "l1_hit_tokens": l1_hits, "l2_hit_tokens": loaded, "exact": True, "seconds": round(time.perf_counter() - t0, 2),
            "l1_pages": options.l1_pages, "l2_pages": options.l2_slots,
            "device_evicted_tokens": stats.get("device_evicted_tokens", 0), "components": comps}


def run(args, wl, l1_pages: int, l2_slots: int, full: ModelConfig = MODEL) -> dict:
    """The hybrid record (``--json``) of ``full`` made hybrid: configs, targets, the SWA pool sweep."""
    from hicache.reference.engine.runner import ModelRunner

    kind = args.model_kind
    model = hybrid_model(kind, args.window, full)
    ps = FWD.page_size
    runner = ModelRunner(model, FWD, num_pages=l1_pages, state_slots=l1_pages if model.recurrent_layers else 0)
    log(f"multiturn --model-kind {kind}: {args.clients} clients x {args.rounds} rounds; reference pass (no cache) ...")
    stream = reference(runner, wl, args)
    base = {"model": model, "forward": FWD, "l1_pages": l1_pages}
    configs = {
        "l1_only": StackOptions(**base),
        "l1_l2": StackOptions(**base, l2_slots=l2_slots),
        # ``serve`` gives it a fresh file:// directory
        "l1_l2_l3": StackOptions(**base, l2_slots=l2_slots, l3_url="file://", prefetch_policy=PrefetchPolicy.WAIT_COMPLETE,
                                 prefetch_min_tokens=2 * ps, l3_cost=CostOptions(enabled=False)),
        # an L2 that holds the whole stream (8 x the 50% L2): what an L3 per pool could add at most, since an
        # L3 hit comes back through L2 (a bound for l1_l2_l3, not an L3 run)
        "l1_l2_unbounded": StackOptions(**base, l2_slots=8 * l2_slots),
    }
    out: dict = {"model_kind": kind, "clients": args.clients, "rounds": args.rounds, "page_size": ps,
                 "window": model.sliding_window, "recurrent_layers": list(model.recurrent_layers), "configs": {}}
    for name, options in configs.items():
        log(f"  {name} (L1 {l1_pages} pages, L2 {options.l2_slots} pages) ...")
        out["configs"][name] = rec = serve(name, options, stream, runner, args)
        log(f"    prompt {rec['prompt_tokens']:,}, computed {rec['prefill_tokens_computed']:,}, "
            f"L1 hits {rec['l1_hit_tokens']:,}, L2 hits {rec['l2_hit_tokens']:,}, exact")
    c = out["configs"]
    reduction = c["l1_only"]["prefill_tokens_computed"] / max(1, c["l1_l2"]["prefill_tokens_computed"])
    with_l3 = c["l1_only"]["prefill_tokens_computed"] / max(1, c["l1_l2_l3"]["prefill_tokens_computed"])
    bound = c["l1_only"]["prefill_tokens_computed"] / max(1, c["l1_l2_unbounded"]["prefill_tokens_computed"])
    out["l1_l2_l3"] = {"served": True, "l3_pages_fetched": c["l1_l2_l3"]["components"]["l3"]["prefetch_pages"]}
    log(f"  L1+L2+L3 / L1 only: {with_l3:.2f}x (L1+L2: {reduction:.2f}x, unbounded L2: {bound:.2f}x)")
    out["targets"] = {"prefill_reduction_l1_l2_vs_l1_only": round(reduction, 3),
                      "prefill_reduction_l1_l2_l3_vs_l1_only": round(with_l3, 3),
                      "prefill_reduction_l1_l2_unbounded_vs_l1_only": round(bound, 3),
                      "met": {"prefill_2_5x_l1_l2_l3": with_l3 >= 2.5, "prefill_2_5x_with_l1_l2_only": reduction >= 2.5,
                              "prefill_2_5x_bound_for_l3": bound >= 2.5}}
    if kind == "swa":
        out["swa_pool_sweep"] = swa_sweep(args, stream, runner, model, 2 * l2_slots)
    out["full_model_same_path"] = full_baseline(args, wl, l1_pages, l2_slots, full)
    return out


def full_baseline(args, wl, l1_pages: int, l2_slots: int, full: ModelConfig = MODEL) -> dict:
    """The Full model (``full``) on this path (one request at a time, same sizes): what its L1+L2
    saves against L1 only here, beside the hybrid model's figure (its own answers make its own history)."""
    from hicache.reference.engine.runner import ModelRunner

    runner = ModelRunner(full, FWD, num_pages=l1_pages)
    log("  full model on the same path (its own reference pass) ...")
    stream = reference(runner, wl, args)
    base = {"model": full, "forward": FWD, "l1_pages": l1_pages}
    recs = {name: serve(f"full {name}", options, stream, runner, args)
            for name, options in (("l1_only", StackOptions(**base)), ("l1_l2", StackOptions(**base, l2_slots=l2_slots)),
                                  ("l1_l2_unbounded", StackOptions(**base, l2_slots=8 * l2_slots)))}
    computed = {n: r["prefill_tokens_computed"] for n, r in recs.items()}
    reduction = computed["l1_only"] / max(1, computed["l1_l2"])
    bound = computed["l1_only"] / max(1, computed["l1_l2_unbounded"])
    log(f"    full: computed {computed}: {reduction:.2f}x (l1_l2), {bound:.2f}x (unbounded L2)")
    return {"configs": recs, "prefill_reduction_l1_l2_vs_l1_only": round(reduction, 3),
            "prefill_reduction_l1_l2_unbounded_vs_l1_only": round(bound, 3)}


def swa_sweep(args, stream, runner, model, l1_pages: int) -> dict:
    """``l1_only`` with L1 = the working set (``l1_pages``: room to shrink the SWA pool below it) at each SWA
    pool size (fractions of the Full pool, but never below the longest request's pages: a request holds
    SWA pages for all its new tokens until its prefill ends); the smallest that keeps the full-size hits."""
    ps = FWD.page_size
    longest = max(-(-(len(tokens) + args.output_tokens) // ps) for tokens, _ in stream)
    base = {"model": model, "forward": FWD, "l1_pages": l1_pages}
    rows = []
    for f in sorted({float(x) for x in args.swa_fractions.split(",")} | {1.0}, reverse=True):
        swa_pages = max(longest + 2, round(l1_pages * f))
        rec = serve(f"l1_only swa={f}", StackOptions(**base, swa_tokens=swa_pages * ps), stream, runner, args)
        rows.append({"swa_fraction": f, "swa_pool_pages": swa_pages, "full_pool_pages": l1_pages,
                     "hit_tokens": rec["l1_hit_tokens"], "prefill_tokens_computed": rec["prefill_tokens_computed"]})
        log(f"    SWA pool {swa_pages} pages ({f:.0%} of Full's {l1_pages}): hits {rec['l1_hit_tokens']:,}")
    out: dict = {"rows": rows}
    for name, share in (("same_hit_rate", 1.0), ("within_2pct", 0.98)):  # of the full-size pool's hit tokens
        kept = [r for r in rows if r["hit_tokens"] >= share * rows[0]["hit_tokens"]]
        best = min(kept, key=lambda r: r["swa_pool_pages"])
        out[name] = {"full_pool_pages": l1_pages, "swa_pool_pages": best["swa_pool_pages"],
                     "hit_tokens": best["hit_tokens"], "swa_smaller": best["swa_pool_pages"] < l1_pages}
    return out
