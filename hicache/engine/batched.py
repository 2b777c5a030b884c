"""Batched decode: one dispatch advancing B requests by one token each, bit for bit what B
``ModelRunner.decode_step`` calls compute.

The dispatch is ``scan.compiled_scan`` over the B requests' decode chunks (see ``hicache.engine.scan``
for why a scan of the chunk program, not a [B*C]-row forward, and on which platforms its bits were
checked: ``compile_batches`` and ``decode_steps`` refuse the others with ``ValueError``; there a decode
iteration calls ``decode_step`` per request). What it saves is the per-forward dispatch (measured
on a loaded 2-CPU host, best of 30: B=2 3.11 -> 2.39 ms, B=4 7.15 -> 5.06, B=8 8.72 -> 5.96); the
chunks still run one after another.

Checks: each request's page table is checked as ``decode_step`` checks it, through the runner's memo
of checked tables (``ModelRunner.checked_table``: a table seen before with the same contents is not
checked again), so a request decoding for many steps costs its table's check once.

Buffers: as ``ModelRunner``: the runner owns the pool between forwards; ``decode_steps`` donates it
to the scan and rebinds the runner to the result (``set_pool``), on the runner's thread. B is padded
to a power of two with chunks that have no valid row (they write nothing), so a few programs serve
every batch size.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from hicache.engine.model import step_input
from hicache.engine.runner import ModelRunner
from hicache.engine import scan
from hicache.engine.scan import compiled_scan, supported

__all__ = ["check_platform", "compile_batches", "decode_steps", "padded_batch", "supported"]


def check_platform(runner: ModelRunner) -> None:
    """``ValueError`` unless the runner's pool lives on a platform in ``scan.BIT_EXACT_PLATFORMS``."""
    platforms = {d.platform for d in runner.pool.devices()}
    if not all(supported(p) for p in platforms):
        raise ValueError(f"batched decode is not bit-identical to decode_step on {sorted(platforms)} "
                         f"(checked: {sorted(scan.BIT_EXACT_PLATFORMS)}): decode one request per step there")


def padded_batch(n: int) -> int:
    """The batch size ``n`` requests run at: the next power of two."""
    if n < 1:
        raise ValueError(f"need at least one request, got {n}")
    return 1 << (n - 1).bit_length()


def _empty_step(runner: ModelRunner) -> np.ndarray:
    """A chunk with no valid row: it writes nothing and returns zero logits (read-only)."""
    return _empty_step_of(runner.fwd.chunk_size, runner.fwd.max_pages)


@functools.cache
def _empty_step_of(chunk_size: int, max_pages: int) -> np.ndarray:
    step = step_input(np.zeros(0, np.int32), np.zeros(max_pages, np.int32), 0, 0, 0, chunk_size)
    step.flags.writeable = False
    return step


def compile_batches(runner: ModelRunner, max_batch: int) -> list[int]:
    """Compiles the program of every padded batch size up to ``max_batch`` (chunks with no valid row:
    nothing is written), so that no request waits for a compile. Returns the sizes."""
    check_platform(runner)
    sizes = [1 << k for k in range(padded_batch(max_batch).bit_length())]
    fn = compiled_scan(runner.model, runner.fwd.chunk_size)
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
    fn = compiled_scan(runner.model, runner.fwd.chunk_size)
    logits, kv = fn(runner.params, runner.pool, runner.put_inputs(np.stack(steps)))
    runner.set_pool(kv)
    runner.forwards += len(seqs)
    out = np.asarray(logits)
    return [out[i, r] for i, r in enumerate(rows)]
