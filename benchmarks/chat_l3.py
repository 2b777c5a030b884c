"""The multi-turn chat stream that the L3 benchmarks (``l3_faults``, ``slow_storage``) share.

``chat_sizes`` sets the stream's sizes on parsed arguments (quick or full); ``prepare_chat`` runs the
reference pass (the engine alone decides the stream and its outputs), measures the engine alone's
TTFT on it, sizes L1/L2 from it and compiles every transfer bucket on a warm-up stack; ``serve_stream``
serves the stream one request at a time on a stack and checks every output. All on the caller's thread.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from benchmarks.multiturn import build_stream, make_workload
from benchmarks.stacks import BareEngine, stack_options
from benchmarks.workload import FWD, MODEL, Stream, log, tier_sizes
from hicache.reference.engine.runner import ModelRunner
from hicache.reference.serve_types import ServeRequest
from hicache.reference.stack import build_stack, warm_up

QUICK = dict(clients=3, rounds=2, system_prompts=1, system_tokens=(24, 40), request_tokens=(8, 16), output_tokens=4)
FULL = dict(clients=8, rounds=4, system_prompts=2, system_tokens=(96, 160), request_tokens=(16, 32), output_tokens=8)


def chat_sizes(args: argparse.Namespace, seed: int) -> argparse.Namespace:
    """``args`` with the stream's sizes (``args.quick``: the small stream) and ``seed``."""
    for k, v in (QUICK if args.quick else FULL).items():
        setattr(args, k, v)
    args.seed = seed
    return args


@dataclass(frozen=True)
class Chat:
    runner: ModelRunner
    stream: Stream
    no_cache_ttft_mean_s: float  # the engine alone (no tree, no L3) on the stream
    options: Any  # StackOptions of the L3 stacks (L3 URL a placeholder: each run attaches its own)


def prepare_chat(args: argparse.Namespace, placeholder_url: str) -> Chat:
    runner = ModelRunner(MODEL, FWD, num_pages=8)
    bare = BareEngine(runner, FWD.max_pages)
    wl = make_workload(args)
    log("reference pass (engine alone): the stream and its outputs")
    stream = build_stream(bare, wl, args)
    log("no-cache TTFT (engine alone)")
    no_cache = [bare.serve(ServeRequest(it.prompt, it.max_new_tokens)).ttft_s for it in stream.items]
    ps = FWD.page_size
    pages = sum(-(-len(it.prompt) // ps) for it in stream.items if it.round == args.rounds - 1)
    l1, l2 = tier_sizes(pages, max(len(it.prompt) for it in stream.items) + args.output_tokens, 0.25, 0.5)
    options = stack_options(l1, l2, "/unused")
    options = type(options)(**{**options.__dict__, "l3_url": placeholder_url})
    log("warm-up (compiles every transfer bucket outside the timings)")
    warmed = build_stack(options, runner)
    warm_up(warmed)
    close_stack(warmed)
    return Chat(runner, stream, sum(no_cache) / len(no_cache), options)


def serve_stream(stack, stream: Stream) -> tuple[int, list[float], int]:
    """Serves the stream in order: (wrong outputs, TTFTs, L3 hit tokens)."""
    wrong, ttfts, l3 = 0, [], 0
    for it in stream.items:
        res = stack.scheduler.serve(ServeRequest(it.prompt, it.max_new_tokens))
        wrong += tuple(res.output) != tuple(stream.outputs[it.index])
        ttfts.append(res.ttft_s)
        l3 += res.storage_tokens
    return wrong, ttfts, l3


def close_stack(stack) -> None:
    """Flushes a stack's transfers and detaches its L3 (the manifest is written)."""
    stack.client.flush_write_through_acks()
    stack.head.detach_storage_backend()
