"""sgl-jax served through hicache vs sgl-jax's own caches: multi-turn chat through the real sgl-jax Engine.

Tiny random Qwen3 (``hicache.sgl_jax.tiny_model``), CPU, greedy. The workload: ``--conversations`` chats
sharing a system prompt, ``--turns`` turns each, served one request at a time round-robin (turn 1 of every
chat, then turn 2, ...), each turn the chat's history (its own earlier answers included) plus a new user
message; the working set outgrows L1 + L2, so what a chat computed is evicted before its next turn.
Configs, in one run (same L1 and L2 sizes):

* ``no_cache``: sgl-jax without a prefix cache (the reference every output is compared with: ``exact``);
* ``sgl_jax_radix``: sgl-jax's RadixCache (L1 only);
* ``sgl_jax_hicache``: sgl-jax's own HiCache (its L1 + L2, ``hicache_storage="none"``; its host->device
  load on CPU needs the stand-in of sgl-jax's own tests, installed in its scheduler process here);
* ``hicache_l1_l2`` / ``hicache_l1_l2_l3``: sgl-jax through hicache (L3 on ``file://`` in a temp folder);
* ``hicache_cold_restart``: a new engine on the same L3 serving the same workload.

Then the no-reuse pair: fresh ``sgl_jax_radix`` and ``hicache_l1_l2_l3`` engines, both live, serve the same
random prompts (no shared prefix; 12, or 24 without ``--quick``), each prompt on both, the order
alternating (``paired_random_ttfts``): ``no_reuse_overhead`` = hicache's mean TTFT / sgl-jax radix's - 1
(and the median of the per-prompt ratios beside it). TTFT is the time to the first streamed chunk of each
``generate`` call. Targets (printed, and in the JSON): L1+L2+L3
computes <= 1/2 the prefill tokens of ``sgl_jax_hicache``; L1+L2 no more than it; the cold restart gets
>= 80% of the warm hit tokens; no-reuse overhead <= 10%. ``unbounded_cache_prefill_tokens``: what a cache
that never evicts would compute (the floor: each turn's new message and the last answer token, the system
prompt once), so the first target is reachable only where ``sgl_jax_hicache`` computes >= 2x that.

    python benchmarks/sgl_jax_bench.py --json out.json [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

SAMPLING = {"max_new_tokens": 8, "temperature": 0.0}


def chat_turns(conversations: int, turns: int, seed: int = 0) -> tuple[list[int], list[list[list[int]]]]:
    """(a shared system prompt, per chat the user messages of each turn) as token ids."""
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return rng.integers(2, 500, size=n).tolist()  # 0 and 1 are bos/eos in the tiny model

    return ids(32), [[ids(int(rng.integers(24, 40))) for _ in range(turns)] for _ in range(conversations)]


def timed_generate(engine: Any, prompt: list[int]) -> tuple[list[int], int, float]:
    """(output ids, cached prompt tokens, seconds to the first streamed chunk) of one request."""
    t0 = time.perf_counter()
    ttft = None
    last: dict = {}
    for chunk in engine.generate(input_ids=prompt, sampling_params=SAMPLING, stream=True):
        if ttft is None:
            ttft = time.perf_counter() - t0
        last = chunk
    return list(last["output_ids"]), int(last["meta_info"]["cached_tokens"]), float(ttft or 0.0)


def serve_chats(engine: Any, system: list[int], chats: list[list[list[int]]]) -> dict[str, Any]:
    histories = [list(system) for _ in chats]
    outputs, ttfts, computed, cached_total = [], [], 0, 0
    for turn in range(len(chats[0])):
        for c, messages in enumerate(chats):
            prompt = histories[c] + messages[turn]
            out, cached, ttft = timed_generate(engine, prompt)
            histories[c] = prompt + out
            outputs.append(out)
            ttfts.append(ttft)
            computed += len(prompt) - cached
            cached_total += cached
    return {"outputs": outputs, "ttfts": ttfts, "prefill_tokens_computed": computed, "cached_tokens": cached_total}


def unbounded_cache_prefill(system: list[int], chats: list[list[list[int]]], outputs: list[list[int]]) -> int:
    """Prefill tokens a cache that never evicts computes for the workload (``outputs``: the reference run's, in
    serving order): per request, its prompt less the longest prefix whose KV an earlier request left (its prompt
    and its output but the last token, whose KV no forward made), at most the prompt but its last token (the
    cache key's length). No cache, of any size or tier, computes fewer: the floor the configs are measured to."""
    histories = [list(system) for _ in chats]
    computed_kv: list[list[int]] = []
    total, i = 0, 0
    for turn in range(len(chats[0])):
        for c, messages in enumerate(chats):
            prompt = histories[c] + messages[turn]
            best = 0
            for seq in computed_kv:
                n = min(len(seq), len(prompt) - 1)
                k = next((j for j in range(n) if seq[j] != prompt[j]), n)
                best = max(best, k)
            total += len(prompt) - best
            computed_kv.append(prompt + outputs[i][:-1])
            histories[c] = prompt + outputs[i]
            i += 1
    return total


def paired_random_ttfts(a: Any, b: Any, n: int, warm: int = 2, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """TTFTs of ``n`` random 48-token prompts (no shared prefix) on two live engines, each prompt on both,
    the order alternating, after ``warm`` untimed pairs (first-use compiles): the same load meets both
    engines within a second, so their ratio holds on a shared machine whose load swings. Equal outputs
    asserted."""
    rng = np.random.default_rng(seed)
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(warm + n):
        prompt = rng.integers(2, 500, size=48).tolist()
        order = (0, 1) if i % 2 == 0 else (1, 0)
        got = {k: timed_generate((a, b)[k], prompt) for k in order}
        if got[0][0] != got[1][0]:
            raise AssertionError(f"random prompt {i}: outputs differ: {got[0][0]} vs {got[1][0]}")
        if i >= warm:
            for k in (0, 1):
                times[k].append(got[k][2])
    return np.asarray(times[0]), np.asarray(times[1])


def _scheduler_with_cpu_kv_scatter(*args: Any) -> None:
    """sgl-jax's scheduler entry point after its own tests' CPU stand-in for the TPU-only fused KV write
    (importing that module installs it; on TPU it leaves the kernel alone)."""
    import sgl_jax.test.mem_cache.conftest  # noqa: F401
    from sgl_jax.srt.managers import scheduler

    scheduler.run_scheduler_process(*args)


@contextlib.contextmanager
def cpu_kv_scatter_in_scheduler() -> Iterator[None]:
    """While active, sgl-jax Engines start their scheduler through ``_scheduler_with_cpu_kv_scatter``."""
    from sgl_jax.srt.entrypoints import engine as sgl_engine

    original = sgl_engine.run_scheduler_process
    sgl_engine.run_scheduler_process = functools.partial(_scheduler_with_cpu_kv_scatter)
    try:
        yield
    finally:
        sgl_engine.run_scheduler_process = original


@contextlib.contextmanager
def engine(kind: str, kwargs: dict[str, Any], hicache: Any = None) -> Iterator[Any]:
    """A started Engine (sgl-jax's, or hicache's with options ``hicache``); stops only its own processes."""
    from sgl_jax.srt.entrypoints.engine import Engine as SglEngine

    from hicache.sgl_jax.engine import Engine, start_recording_processes, stop_processes

    with cpu_kv_scatter_in_scheduler() if kind == "sgl_jax_hicache" else contextlib.nullcontext():
        if hicache is None:
            eng, procs = start_recording_processes(lambda: SglEngine(**kwargs))
        else:
            eng, procs = start_recording_processes(lambda: Engine(**kwargs, hicache=hicache))
    try:
        yield eng
    finally:
        import atexit

        atexit.unregister(eng.shutdown)
        if hicache is not None:
            eng.shutdown()  # (flushes L3 first)
        stop_processes(procs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--quick", action="store_true", help="fewer chats and turns (a smoke run)")
    parser.add_argument("--model", help="an HF-layout model folder (default: the tiny Qwen3, written to a temp dir)")
    args = parser.parse_args()
    from hicache.sgl_jax import HiCacheOptions
    from hicache.sgl_jax.hits import hit_tokens_by_tier
    from hicache.sgl_jax.tiny_model import write_tiny_qwen3

    conversations, turns, random_n = (6, 3, 12) if args.quick else (10, 4, 24)
    l1_tokens, l2_tokens = (256, 512) if args.quick else (384, 768)
    tmp = Path(tempfile.mkdtemp(prefix="sgl_jax_bench-"))
    # One JAX compilation cache for every engine of the run (sgl-jax's scheduler reads it; its processes
    # inherit it): programs compiled by the first engine are loaded by the later ones instead of being
    # compiled inside their requests' TTFT.
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(tmp / "jit-cache"))
    model = args.model or str(write_tiny_qwen3(tmp / "model"))
    base = dict(model_path=model, skip_tokenizer_init=True, device="cpu", dtype="float32", max_total_tokens=l1_tokens,
                mem_fraction_static=0.05, disable_precompile=True, skip_server_warmup=True, random_seed=0,
                disable_overlap_schedule=True, log_level="error")
    system, chats = chat_turns(conversations, turns)
    l3 = (tmp / "l3").as_uri()
    hicache_opts = dict(host_pages=l2_tokens, l3_pages_per_object=8)
    configs: list[tuple[str, dict, Any]] = [
        ("no_cache", {**base, "disable_radix_cache": True}, None),
        ("sgl_jax_radix", base, None),
        ("sgl_jax_hicache", {**base, "hicache_storage": "none", "hicache_ratio": l2_tokens / l1_tokens}, None),
        ("hicache_l1_l2", base, HiCacheOptions(**hicache_opts)),
        ("hicache_l1_l2_l3", base, HiCacheOptions(**hicache_opts, l3_url=l3)),
        ("hicache_cold_restart", base, HiCacheOptions(**hicache_opts, l3_url=l3)),
    ]
    records, reference = [], None
    for name, kwargs, options in configs:
        t0 = time.perf_counter()
        with engine(name, kwargs, options) as eng:
            r = serve_chats(eng, system, chats)
            tiers: dict[str, Any] = {"L1": r["cached_tokens"] if name == "sgl_jax_radix" else None, "L2": None, "L3": None}
            if options is not None:
                stats = eng.hicache_stats()
                tiers = hit_tokens_by_tier(stats, r["cached_tokens"])
                tiers["loaded_past_free_tokens"] = stats["loaded_past_free_tokens"]
                tiers["recomputed_no_room_tokens"] = stats["miss_tokens"].get("no_space", 0)
        reference = reference or r["outputs"]
        ttfts = np.asarray(r["ttfts"])
        records.append({"name": name, "prefill_tokens_computed": r["prefill_tokens_computed"],
                        "hit_tokens": r["cached_tokens"], "ttft_mean_s": float(ttfts.mean()),
                        "ttft_p90_s": float(np.percentile(ttfts, 90)), "hit_tokens_by_tier": tiers,
                        "exact": r["outputs"] == reference, "wall_s": time.perf_counter() - t0,
                        "outputs": r["outputs"]})
        print(f"{name:22s} prefill {r['prefill_tokens_computed']:6d}  hits {r['cached_tokens']:6d}  "
              f"ttft mean {ttfts.mean() * 1e3:7.1f} ms  exact {records[-1]['exact']}  tiers {tiers}", flush=True)
    by = {r["name"]: r for r in records}
    floor = unbounded_cache_prefill(system, chats, by["no_cache"]["outputs"])
    for r in records:
        r.pop("outputs")
    print(f"a cache that never evicts computes {floor} prefill tokens; sgl_jax_hicache computes "
          f"{by['sgl_jax_hicache']['prefill_tokens_computed'] / floor:.2f}x that")
    # the no-reuse pair: both engines live at once (fresh, hicache on its own L3), each prompt on both
    with contextlib.ExitStack() as stack:
        radix = stack.enter_context(engine("sgl_jax_radix", base))
        ours = stack.enter_context(engine("hicache_l1_l2_l3", base,
                                          HiCacheOptions(**hicache_opts, l3_url=(tmp / "l3-pair").as_uri())))
        radix_s, ours_s = paired_random_ttfts(radix, ours, random_n)
    random_ttft = {"sgl_jax_radix": float(radix_s.mean()), "hicache_l1_l2_l3": float(ours_s.mean())}
    overhead = random_ttft["hicache_l1_l2_l3"] / random_ttft["sgl_jax_radix"] - 1
    pair_median = float(np.median(ours_s / radix_s) - 1)
    own = by["sgl_jax_hicache"]["prefill_tokens_computed"]
    targets = {
        "l1_l2_l3_computes_half_of_sgl_jax_hicache": by["hicache_l1_l2_l3"]["prefill_tokens_computed"] * 2 <= own,
        "l1_l2_no_more_than_sgl_jax_hicache": by["hicache_l1_l2"]["prefill_tokens_computed"] <= own,
        "cold_restart_gets_80pct_of_warm_hits":
            by["hicache_cold_restart"]["hit_tokens"] >= 0.8 * by["hicache_l1_l2_l3"]["hit_tokens"],
        "no_reuse_overhead_at_most_10pct": overhead <= 0.10,
        "all_exact": all(r["exact"] for r in records),
    }
    out = {"configs": records, "no_reuse_overhead": overhead, "no_reuse_overhead_median_pair": pair_median,
           "unbounded_cache_prefill_tokens": floor, "random_ttft_mean_s": random_ttft, "targets": targets,
           "workload": {"conversations": conversations, "turns": turns, "l1_tokens": l1_tokens, "l2_tokens": l2_tokens,
                        "max_new_tokens": SAMPLING["max_new_tokens"], "random_prompts": random_n}}
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"no-reuse overhead {overhead * 100:+.1f}% (median of pairs {pair_median * 100:+.1f}%, {random_n} prompts "
          f"on both engines)  targets {targets}")


if __name__ == "__main__":
    main()
