"""Helpers for tests of sgl-jax served through hicache: Engine arguments, a clean start environment, and a
deterministic multi-round workload whose prompts share prefixes (and outgrow a 128-token pool).

Engines start their scheduler in a spawned subprocess, which inherits this process's environment: the
session's forced host device count (tests/conftest.py) is taken out while an Engine starts, because
sgl-jax builds its mesh over every device it sees.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# Small enough that the workload below evicts: the pool holds 128 tokens.
POOL_TOKENS = 128
SAMPLING = {"max_new_tokens": 6, "temperature": 0.0}


def engine_kwargs(model_path: Path, **overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model_path=str(model_path), skip_tokenizer_init=True, device="cpu", dtype="float32",
        max_total_tokens=POOL_TOKENS, mem_fraction_static=0.05, disable_precompile=True,
        skip_server_warmup=True, random_seed=0,
        # sgl-jax's overlap scheduler on XLA:CPU now and then gives other tokens than the reference, with its
        # own RadixCache too (cause open, issue #24); without it the batches, and the tokens, reproduce.
        disable_overlap_schedule=True,
    )
    kwargs.update(overrides)
    return kwargs


@contextmanager
def single_device_env() -> Iterator[None]:
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XLA_FLAGS", flags)
        mp.setenv("JAX_PLATFORMS", "cpu")
        yield


@contextmanager
def running(engine_class: Callable[..., Any], **kwargs: Any) -> Iterator[Any]:
    """An Engine (sgl-jax's or hicache's) while the block runs; then only its own subprocesses are stopped
    (sgl-jax's ``shutdown`` would kill every child of the test process)."""
    from hicache.sgl_jax.engine import start_recording_processes, stop_processes

    with single_device_env():
        engine, processes = start_recording_processes(lambda: engine_class(**kwargs))
    try:
        yield engine
    finally:
        atexit.unregister(engine.shutdown)
        if hasattr(engine, "hicache_options"):  # hicache's Engine stops only its own processes (after an L3 flush)
            engine.shutdown()
        stop_processes(processes)



# The tier rounds: this many 40-token prefixes (320 tokens: more than L1 and than L2 of HOST_PAGES pages).
TIER_PREFIXES = 8
HOST_PAGES = 192  # hicache's L2 in the tier tests: more than L1, less than the tier rounds' prefixes


def rounds(seed: int = 0) -> list[list[list[int]]]:
    """Rounds of prompts (token ids) sent one ``generate`` call per round: three shared 24-token prefixes,
    varied suffixes; then the tier rounds, one prompt each: ``TIER_PREFIXES`` 40-token prefixes in order and
    again in reverse, so that with LRU tiers the second pass finds the last ones in L1, the middle ones in
    L2 (``HOST_PAGES``) and the first ones only in L3; an exact repeat at the end."""
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return rng.integers(2, 500, size=n).tolist()  # 0 and 1 are bos/eos in the tiny model

    p0, p1, p2 = ids(24), ids(24), ids(24)
    first = p0 + ids(7)
    shared = [
        [first, p1 + ids(6)],
        [p0 + ids(9), p0 + ids(5), p2 + ids(8)],
        [p1 + ids(7), p2 + ids(6), p0 + ids(10)],
        [first, p1 + ids(5)],
    ]
    tier = [ids(40) for _ in range(TIER_PREFIXES)]  # (drawn after the others: those keep their tokens)
    passes = [[[p + ids(6)] for p in tier], [[p + ids(5)] for p in reversed(tier)]]
    return [*shared[:3], *passes[0], *passes[1], shared[3]]


def run(engine: Any, seed: int = 0) -> tuple[list[list[int]], int]:
    """Output ids of every prompt, in order, and the prefix tokens sgl-jax reported as cached."""
    outputs, cached = [], 0
    for prompts in rounds(seed):
        for out in engine.generate(input_ids=prompts, sampling_params=SAMPLING):
            outputs.append(out["output_ids"])
            cached += out["meta_info"]["cached_tokens"]
    return outputs, cached
