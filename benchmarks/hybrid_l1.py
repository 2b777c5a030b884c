"""Hybrid models on the embedded L1 stack: prefill tokens saved and pool sizes per model kind (issue #26).

The same multi-turn stream (``hicache.workloads.multi_turn``, shared system prompts) is served one request
at a time by the reference engine as a Full-attention model, an SWA+Full model (every other layer local)
and a recurrent+Full model (one recurrent layer), each on a fresh L1-only stack whose head is built with
the model's components (``StackOptions.head_components``). L1 holds ``--l1-fraction`` of the stream's
distinct pages; the SWA pool ``--swa-fractions`` x L1 (the engine's sliding-window layers read and write
only that pool); the recurrent state pool ``--state-slots``. Every output is compared with the no-cache
run (tokens and logits, bit for bit): a mismatch raises. Reported per config: prompt tokens, tokens
prefilled (computed past the reused prefix), the ratio, L1 hit tokens, and each pool's bytes.

With ``--l2-fraction f`` (f x the stream's distinct pages of L2; write-through), the full, swa and mamba configs
are also served with L1+L2 (the swa model's SWA pages get ``--swa-host-fraction`` x the Full L2, as host
tails: only the window a hit reads; the mamba model its states at node ends in an L2 of as many
states as the Full L2 has pages, loaded back with an L2 hit's Full pages); the record adds L2 hit tokens
(loaded back) and the L2 bytes.

    python benchmarks/hybrid_l1.py [--quick] [--json out.json] [--l2-fraction 1.0]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import numpy as np

from hicache.reference.engine.config import ForwardConfig, ModelConfig
from hicache.reference.serve_types import ServeRequest
from hicache.reference.stack import StackOptions, build_stack
from hicache.workloads import MultiTurnSpec, multi_turn

FWD = ForwardConfig(chunk_size=16, page_size=8, max_pages=40)
MODELS = {
    "full": ModelConfig(num_layers=4),
    "swa": ModelConfig(num_layers=4, sliding_window=48),  # layers 0, 2 local (48 tokens), 1, 3 global
    "mamba": ModelConfig(num_layers=4, recurrent_layers=(1, 3)),  # layers 1, 3 recurrent
}


@dataclass(frozen=True)
class HybridRecord:
    model_kind: str
    swa_fraction: float  # SWA pool / L1 pool in pages (swa only)
    requests: int
    prompt_tokens: int
    prefilled_tokens: int
    prefill_reduction: float  # prompt_tokens / prefilled_tokens
    hit_tokens: int
    l1_pages: int
    l1_bytes: int  # attention layers' KV pages (full-attention layers only for swa/mamba)
    swa_bytes: int
    state_bytes: int
    exact: bool
    seconds: float
    l2_slots: int = 0  # Full L2 pages (0: L1 only)
    l2_hit_tokens: int = 0  # tokens loaded back from L2
    l2_bytes: int = 0  # Full L2 (full-attention layers only for swa)
    l2_used_tokens: int = 0  # Full L2 tokens held at the end
    swa_l2_bytes: int = 0  # the SWA pages' L2
    swa_l2_used_tokens: int = 0  # SWA host-tail tokens held at the end


def spec(quick: bool) -> MultiTurnSpec:
    if quick:
        return MultiTurnSpec(conversations=12, turns=4, system_prompts=2, system_tokens=(64, 96),
                             user_tokens=(16, 32), output_tokens=(8, 16), vocab_size=512)
    return MultiTurnSpec(conversations=24, turns=5, system_prompts=4, system_tokens=(64, 112),
                         user_tokens=(16, 32), output_tokens=(8, 16), vocab_size=512)


def working_set_pages(rounds, page_size: int) -> int:
    pages = {tuple(t.prompt[: (i + 1) * page_size]) for r in rounds for t in r for i in range(len(t.prompt) // page_size)}
    return len(pages)


def run(kind: str, rounds, l1_pages: int, swa_fraction: float, state_slots: int, new_tokens: int,
        l2_slots: int = 0, swa_host_fraction: float = 1.0) -> HybridRecord:
    model = MODELS[kind]
    ps = FWD.page_size
    swa_tokens = max(FWD.max_pages, int(l1_pages * swa_fraction)) * ps
    swa_host_tokens = max(model.sliding_window or 0, int(l2_slots * swa_host_fraction) * ps) if l2_slots else None
    stack = build_stack(StackOptions(model=model, forward=FWD, l1_pages=l1_pages, swa_tokens=swa_tokens,
                                     state_slots=state_slots, l2_slots=l2_slots,
                                     swa_host_tokens=swa_host_tokens if model.swa_layers else None))
    runner = stack.runner
    t0 = time.perf_counter()
    prompt_tokens = prefilled = hits = loaded = n = 0
    for rnd in rounds:
        for turn in rnd:
            res = stack.scheduler.serve(ServeRequest(turn.prompt, new_tokens))
            ref = runner.generate_no_cache(turn.prompt, new_tokens)
            if res.output != ref.tokens or res.logits is None or not np.array_equal(res.logits, ref.logits):
                raise AssertionError(f"{kind}: request {n} differs from the no-cache run")
            prompt_tokens += res.prompt_len
            prefilled += res.computed_tokens
            hits += res.device_hit_tokens
            loaded += res.loaded_tokens
            n += 1
    itemsize = np.dtype(model.dtype).itemsize
    page_bytes = 2 * ps * model.num_kv_heads * model.head_dim * itemsize  # K and V of one layer
    full_layers = [i for i in model.attention_layers if model.window_of(i) is None]
    swa = runner.swa_pool
    state = runner.state_pool
    stats = stack.head.cache_stats()
    swa_host = stats.get("swa", {}).get("host_capacity_tokens", 0)
    return HybridRecord(
        kind, swa_fraction if kind == "swa" else 0.0, n, prompt_tokens, prefilled,
        prompt_tokens / max(prefilled, 1), hits, l1_pages, l1_pages * page_bytes * len(full_layers),
        0 if swa is None else int(swa.size) * itemsize, 0 if state is None else int(state.size) * 4, True,  # (raised if not)
        time.perf_counter() - t0, l2_slots, loaded, l2_slots * page_bytes * len(full_layers),
        stats.get("host_tokens", 0),
        swa_host // ps * page_bytes * len(model.swa_layers), stats.get("swa", {}).get("host_tokens", 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--l1-fraction", type=float, default=0.25, help="L1 pages / the stream's distinct pages")
    parser.add_argument("--swa-fractions", default="1.0,0.5", help="SWA pool / L1, one swa config each")
    parser.add_argument("--state-slots", type=int, default=0, help="recurrent state slots (0: L1 pages / 4)")
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--l2-fraction", type=float, default=0.0,
                        help="L2 pages / the stream's distinct pages (0: L1 only); every kind runs with it too")
    parser.add_argument("--swa-host-fraction", type=float, default=1.0, help="the SWA pages' L2 / the Full L2")
    args = parser.parse_args()
    rounds = multi_turn(spec(args.quick))
    l1_pages = max(FWD.max_pages, int(working_set_pages(rounds, FWD.page_size) * args.l1_fraction))
    slots = args.state_slots or max(8, l1_pages // 4)
    records = [run("full", rounds, l1_pages, 1.0, slots, args.new_tokens)]
    records += [run("swa", rounds, l1_pages, float(f), slots, args.new_tokens) for f in args.swa_fractions.split(",")]
    records.append(run("mamba", rounds, l1_pages, 1.0, slots, args.new_tokens))
    if args.l2_fraction > 0:
        l2 = max(FWD.max_pages, int(working_set_pages(rounds, FWD.page_size) * args.l2_fraction))
        records.append(run("full", rounds, l1_pages, 1.0, slots, args.new_tokens, l2))
        records += [run("swa", rounds, l1_pages, float(f), slots, args.new_tokens, l2, args.swa_host_fraction)
                    for f in args.swa_fractions.split(",")]
        records.append(run("mamba", rounds, l1_pages, 1.0, slots, args.new_tokens, l2))
    for r in records:
        print(f"{r.model_kind:6s} swa_frac={r.swa_fraction:.2f} requests={r.requests} prompt={r.prompt_tokens} "
              f"prefilled={r.prefilled_tokens} reduction={r.prefill_reduction:.2f}x hits={r.hit_tokens} "
              f"L1={r.l1_bytes / 2**20:.2f}MiB swa={r.swa_bytes / 2**20:.2f}MiB state={r.state_bytes / 2**10:.1f}KiB "
              f"L2={r.l2_slots}p hits={r.l2_hit_tokens} {r.l2_bytes / 2**20:.2f}MiB (used {r.l2_used_tokens} tok) "
              f"swa_L2={r.swa_l2_bytes / 2**20:.2f}MiB (used {r.swa_l2_used_tokens} tok) exact={r.exact} {r.seconds:.0f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in records], f, indent=1)


if __name__ == "__main__":
    main()
