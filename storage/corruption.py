"""Telling an object corrupted in transit from one corrupt at rest, before anything is deleted.

A read that fails verification (``format.CorruptObjectError``) proves only that the bytes that
arrived were bad: a flaky link or proxy flips and cuts bytes of intact objects, and deleting them
would empty a shared bucket for every replica. So a failed read is a miss, and the object is read
again, fresh and whole, after a ``stat`` (stored size and generation). It is *corrupt at rest*
only if the re-read fails verification too and both reads returned the same bytes (equal length,
equal digest), as many as are stored; otherwise it was *in transit* (and if the re-read verified,
its pages are used). Only an object corrupt at rest is deleted, conditionally on the generation
``stat`` saw (where the backend has one), so a rewrite in between survives.

``note_failure`` runs where the first read finished (``post`` of ``BatchIO.read_many``: an I/O
thread or gcsfs' loop); ``recheck`` on the calling thread, its re-reads through ``BatchIO``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import xxhash

from hicache.storage.batch_io import BatchIO, Deadline, Stat
from hicache.storage.format import CorruptObjectError


def _digest(raw: Any) -> bytes:
    return xxhash.xxh3_128_digest(memoryview(raw).cast("B"))


def note_failure(err: CorruptObjectError, raw: Any) -> CorruptObjectError:
    """``err`` with the length and digest of the bytes that failed (for ``recheck``)."""
    err.size = len(memoryview(raw).cast("B"))
    err.digest = _digest(raw)
    return err


class Verdict(NamedTuple):
    """What ``recheck`` found out about one object whose read failed verification."""

    path: str
    error: CorruptObjectError  # the first read's failure
    at_rest: bool  # the same stored bytes failed twice: delete it (if configured)
    generation: str | None  # the stored generation ``stat`` saw (conditional delete)


def recheck(io: BatchIO, paths: Sequence[str], firsts: Sequence[CorruptObjectError],
            verify: Callable[[int, Any], Any], deadline: Deadline) -> list[tuple[Any, Verdict]]:
    """Re-read ``paths`` (whose first reads failed with ``firsts``) within ``deadline``. Per path:
    (``verify(i, bytes)``'s value if the re-read verified, else the exception; its ``Verdict``)."""
    verdicts: list[Verdict | None] = [None] * len(paths)

    def post(i: int, raw: Any, stat: Stat) -> Any:
        try:
            return verify(i, raw)
        except CorruptObjectError:
            first = firsts[i]
            size, generation = stat
            same = getattr(first, "size", None) == size and len(memoryview(raw).cast("B")) == size \
                and getattr(first, "digest", None) == _digest(raw)
            verdicts[i] = Verdict(paths[i], first, same, generation)
            raise

    out = []
    for i, r in enumerate(io.reread_many(paths, post, deadline)):
        v = verdicts[i] or Verdict(paths[i], firsts[i], False, None)
        out.append((r, v))
    return out
