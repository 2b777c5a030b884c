"""Batched decode: one dispatch advancing B requests by one token each, bit for bit what B
``ModelRunner.decode_step`` calls compute.

Why not one [B*C]-row forward: on XLA:CPU a matmul row rounds differently with another number of
rows (1 vs 16, 16 vs 64: measured), and a ``vmap`` of the [C] forward over B with shared weights
lowers to exactly that ([B, C, D] @ [D, E] merged into B*C rows: 12 of 80 shapes differed here).
An explicit batch dimension ([B, C, D] x [B, D, E]) and a ``lax.scan`` of the [C] program both gave
bits equal to the unbatched program in 80 of 80 shapes; the whole forward is scanned here: each
iteration of the scan is the same fixed-shape chunk program (``model.forward_chunk``), with the pool
as the carry, so every request's K/V and logits are those of its own ``decode_step`` (the tests
compare logits and pools bit for bit, B in 1..8). What it saves is the per-forward dispatch (measured
on a loaded 2-CPU host, best of 30: B=2 3.11 -> 2.39 ms, B=4 7.15 -> 5.06, B=8 8.72 -> 5.96); the
chunks still run one after another.

Backends: bit-identity is a property of the compiler, so it holds where it was checked: XLA:CPU (the
tests). On XLA:GPU (an H200, JAX 0.11.2) the scan's logits differed from ``decode_step``'s (the tokens
were equal), so ``compile_batches`` and ``decode_steps`` refuse any platform outside
``BIT_EXACT_PLATFORMS`` (``ValueError``): there a decode iteration calls ``decode_step`` per request.

Buffers: as ``ModelRunner``: the runner owns the pool between forwards; ``decode_steps`` donates it
to the scan and rebinds the runner to the result (``set_pool``), on the runner's thread. B is padded
to a power of two with chunks that have no valid row (they write nothing), so a few programs serve
every batch size.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np

from hicache.engine.config import ModelConfig
from hicache.engine.model import forward_chunk, step_input
from hicache.engine.runner import ModelRunner


BIT_EXACT_PLATFORMS = frozenset({"cpu"})  # where the scan's bits were checked equal to decode_step's


def supported(platform: str) -> bool:
    """Whether batched decode is bit-identical to ``decode_step`` on this JAX platform."""
    return platform in BIT_EXACT_PLATFORMS


def check_platform(runner: ModelRunner) -> None:
    """``ValueError`` unless the runner's pool lives on a platform in ``BIT_EXACT_PLATFORMS``."""
    platforms = {d.platform for d in runner.pool.devices()}
    if not all(supported(p) for p in platforms):
        raise ValueError(f"batched decode is not bit-identical to decode_step on {sorted(platforms)} "
                         f"(checked: {sorted(BIT_EXACT_PLATFORMS)}): decode one request per step there")


@functools.cache
def compiled_decode_batch(cfg: ModelConfig, chunk_size: int) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """``fn(params, kv_pool, steps i32[B, 3 + C + max_pages]) -> (logits f32[B, C, vocab], kv_pool)``:
    ``forward_chunk`` over the B steps in order (``lax.scan``, the pool as the carry), donating the pool."""

    def run(params, kv_pool, steps):
        def body(kv, step):
            logits, kv = forward_chunk(params, kv, step, cfg=cfg, chunk_size=chunk_size)
            return kv, logits

        kv_pool, logits = jax.lax.scan(body, kv_pool, steps)
        return logits, kv_pool

    return jax.jit(run, donate_argnums=1)


def padded_batch(n: int) -> int:
    """The batch size ``n`` requests run at: the next power of two."""
    if n < 1:
        raise ValueError(f"need at least one request, got {n}")
    return 1 << (n - 1).bit_length()


def _empty_step(runner: ModelRunner) -> np.ndarray:
    """A chunk with no valid row: it writes nothing and returns zero logits."""
    c = runner.fwd.chunk_size
    return step_input(np.zeros(0, np.int32), np.zeros(runner.fwd.max_pages, np.int32), 0, 0, 0, c)


def compile_batches(runner: ModelRunner, max_batch: int) -> list[int]:
    """Compiles the program of every padded batch size up to ``max_batch`` (chunks with no valid row:
    nothing is written), so that no request waits for a compile. Returns the sizes."""
    check_platform(runner)
    sizes = [1 << k for k in range(padded_batch(max_batch).bit_length())]
    fn = compiled_decode_batch(runner.model, runner.fwd.chunk_size)
    for b in sizes:
        logits, kv = fn(runner.params, runner.pool, runner.put_inputs(np.stack([_empty_step(runner)] * b)))
        runner.set_pool(kv)
        np.asarray(logits)
    return sizes


def decode_steps(runner: ModelRunner, seqs: Sequence[Sequence[int]],
                 tables: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """For each request, ``runner.decode_step(seqs[i], tables[i])``, in one dispatch: computes the
    last position of each sequence (all earlier ones are in its pages) and returns its logits
    ``f32[vocab]``, bit-identical to the unbatched call. Requests must not share pages they write.
    Every request is checked as ``decode_step`` checks it before anything runs (``ValueError``)."""
    if len(seqs) != len(tables) or not seqs:
        raise ValueError(f"need as many page tables as sequences (>= 1), got {len(seqs)} and {len(tables)}")
    check_platform(runner)
    steps, rows, written = [], [], []
    for seq, table in zip(seqs, tables):
        step, row, page = runner.decode_step_input(seq, table)
        steps.append(step)
        rows.append(row)
        written.append(page)
    if len(set(written)) != len(written):
        raise ValueError(f"two requests write the same page: {written}")
    steps += [_empty_step(runner)] * (padded_batch(len(seqs)) - len(seqs))
    fn = compiled_decode_batch(runner.model, runner.fwd.chunk_size)
    logits, kv = fn(runner.params, runner.pool, runner.put_inputs(np.stack(steps)))
    runner.set_pool(kv)
    runner.forwards += len(seqs)
    out = np.asarray(logits)
    return [out[i, r] for i, r in enumerate(rows)]
