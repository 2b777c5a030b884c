"""Batched decode: B requests advanced by one token each in a few dispatches, bit for bit what B
``ModelRunner.decode_step`` calls compute.

Each dispatch is ``scan.compiled_scan`` over some of the B requests' decode chunks (a lone chunk: the
chunk program itself, ``ModelRunner._forward_steps``, as ``decode_step`` runs it: cheaper than a scan
of one). See ``hicache.reference.engine.scan`` for why a scan of the chunk program, not a [B*C]-row
forward, and on which platforms its bits were checked: ``compile_batches`` and ``decode_steps`` refuse
the others with ``ValueError``; there a decode iteration calls ``decode_step`` per request. What it
saves is the per-forward dispatch (timings: docs/performance.md); the chunks still run one after
another.

Checks: each request's page table is checked as ``decode_step`` checks it, through the runner's memo
of checked tables (``ModelRunner._check_table``: a table seen before with the same contents is not
checked again), so a request decoding for many steps costs its table's check once.

Buffers: as ``ModelRunner``: the runner owns the pool between forwards; ``decode_steps`` donates it
to the scan and rebinds the runner to the result (``set_pool``), on the runner's thread. B requests
go in scans of power-of-two lengths, so a few programs serve every batch size: padded with chunks
that have no valid row (they write nothing) or split (5 = 4 + 1), whichever costs less
(``scan_lengths``: a padded chunk costs a whole forward, and so, measured here, does a dispatch).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hicache.reference.engine import scan
from hicache.reference.engine.model import step_input
from hicache.reference.engine.runner import ModelRunner, TokenIds
from hicache.reference.engine.scan import supported

__all__ = ["batch_sizes", "check_platform", "compile_batches", "decode_steps", "scan_lengths", "supported"]


def check_platform(runner: ModelRunner) -> None:
    """``ValueError`` unless the runner's pool lives on a platform in ``scan.BIT_EXACT_PLATFORMS`` (and its
    model has no recurrent layers: the scan carries no state pool)."""
    if runner.model.recurrent_layers:
        raise ValueError(f"batched decode of a model with recurrent layers {runner.model.recurrent_layers} "
                         "is not supported: decode one request per step")
    if not runner.scan_supported:  # (set with the pool: a pool's platform does not change)
        platforms = {d.platform for d in runner.pool.devices()}
        raise ValueError(f"batched decode is not bit-identical to decode_step on {sorted(platforms)} "
                         f"(checked: {sorted(scan.BIT_EXACT_PLATFORMS)}): decode one request per step there")


def batch_sizes(max_batch: int) -> list[int]:
    """The scan lengths ``decode_steps`` runs for up to ``max_batch`` requests: the powers of two up to it."""
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"need at least one request, got {max_batch!r}")
    return [1 << k for k in range(max_batch.bit_length())]


DISPATCH_COST_STEPS = 1.0  # a scan dispatch's own cost, in chunk forwards (fit of B=5 and 7, padded vs grouped)


def scan_lengths(n: int) -> list[int]:
    """The scans ``decode_steps`` runs ``n`` requests in: the powers of two (largest first) of the
    ``m >= n`` that costs least, ``DISPATCH_COST_STEPS`` per scan plus one per step (``m - n`` of them
    empty chunks), the smallest ``m`` of equal cost: 5 -> [4, 1], 6 -> [4, 2], 7 -> [8] (the paired
    timings that set ``DISPATCH_COST_STEPS``: docs/performance.md)."""
    if n <= 2:
        return [n]
    top = 1 << (n - 1).bit_length()
    m = min(range(n, top + 1), key=lambda m: (DISPATCH_COST_STEPS * m.bit_count() + m, m))
    return scan.groups(m)


def _empty_step(runner: ModelRunner) -> np.ndarray:
    """A chunk with no valid row: it writes nothing and returns zero logits."""
    c = runner.fwd.chunk_size
    return step_input(np.zeros(0, np.int32), np.zeros(runner.fwd.max_pages, np.int32), 0, 0, 0, c)


def compile_batches(runner: ModelRunner, max_batch: int) -> list[int]:
    """Compiles the program of every scan length up to ``max_batch`` requests (``batch_sizes``; 1: the
    chunk program itself; run on chunks with no valid row: nothing is written), so that no request
    waits for a compile. Returns the sizes."""
    check_platform(runner)
    sizes = batch_sizes(max_batch)
    for b in sizes:
        np.asarray(runner._forward_steps([_empty_step(runner)] * b))
    return sizes


def decode_steps(runner: ModelRunner, seqs: Sequence[TokenIds],
                 tables: Sequence[TokenIds]) -> list[np.ndarray]:
    """For each request, ``runner.decode_step(seqs[i], tables[i])``, in a few dispatches (scans of
    power-of-two lengths, ``scan_lengths``: 5 requests = 4 + 1, 7 = 8 with one empty chunk):
    computes the last position of each sequence (all earlier ones are in its pages) and returns its
    logits ``f32[vocab]``, bit-identical to the unbatched call. Requests must not share pages they
    write. Every request is checked as ``decode_step`` checks it before anything runs (``ValueError``)."""
    if len(seqs) != len(tables) or not seqs:
        raise ValueError(f"need as many page tables as sequences (>= 1), got {len(seqs)} and {len(tables)}")
    check_platform(runner)
    if len(seqs) == 1:  # the unbatched call itself (a shorter Python path, and the most frequent case)
        return [runner.decode_step(seqs[0], tables[0])]
    steps, rows, written = [], [], []
    for seq, table in zip(seqs, tables):
        step, row, page = runner.decode_step_input(seq, table)
        steps.append(step)
        rows.append(row)
        written.append(page)
    if len(set(written)) != len(written):
        raise ValueError(f"two requests write the same page: {written}")
    lengths = scan_lengths(len(steps))
    steps += [_empty_step(runner)] * (sum(lengths) - len(steps))
    outs, i = [], 0
    for size in lengths:  # a lone step runs the chunk program itself (cheaper than a scan of one)
        outs.append(runner._forward_steps(steps[i:i + size]))
        i += size
    runner.forwards += len(seqs)
    host = np.concatenate([np.asarray(x).reshape(-1, *x.shape[-2:]) for x in outs])
    return [host[i, r] for i, r in enumerate(rows)]
