"""How storage touches a host pool's slots during one call (``base.HostSlots``).

The pool owns its slots; storage copies pages out (``gather``: ``read_slots``) for writes and in
(``scatter``: ``write_slots``) for reads, only while a ``batch_get`` / ``batch_set`` call runs:

- on the calling thread, by default;
- on the I/O threads (disjoint slots, concurrently) for a pool that declares
  ``concurrent_slot_io = True`` (reads and writes) or ``concurrent_slot_reads = True`` (reads
  only). Those accesses go through the call's ``CallGuard``: when the call returns, ``close``
  waits for copies in progress and every later one fails, so an I/O thread that finishes after
  the call's deadline never touches slots the caller may have reused.
"""

from __future__ import annotations

import threading

import numpy as np

from hicache.storage.base import HostSlots


class CallGuard:
    """Pool access of one call from I/O threads stops for good when the call returns: ``close``
    waits for copies in progress, later ``enter`` raises ``TimeoutError``."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._active = 0
        self._closed = False

    def __enter__(self) -> None:
        with self._cv:
            if self._closed:
                raise TimeoutError("the call returned before this object reached the host pool")
            self._active += 1

    def __exit__(self, *exc: object) -> None:
        with self._cv:
            self._active -= 1
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.wait_for(lambda: self._active == 0)


def writes_on_io_threads(pool: HostSlots) -> bool:
    """Whether I/O threads may ``write_slots`` (``concurrent_slot_io``)."""
    return bool(getattr(pool, "concurrent_slot_io", False))


def reads_on_io_threads(pool: HostSlots) -> bool:
    """Whether I/O threads may ``read_slots`` (``concurrent_slot_io`` or ``concurrent_slot_reads``)."""
    return writes_on_io_threads(pool) or bool(getattr(pool, "concurrent_slot_reads", False))


def gather(pool: HostSlots, slots: np.ndarray, guard: CallGuard | None) -> np.ndarray:
    """A contiguous copy of ``slots`` (``guard``: on an I/O thread, bounded by the call)."""
    if guard is None:
        data = pool.read_slots(slots)
    else:
        with guard:  # never read slots after the call returned (they may be reused)
            data = pool.read_slots(slots)
    want = (len(slots), *pool.slot_shape)
    if not isinstance(data, np.ndarray) or data.shape != want or data.dtype != np.dtype(pool.dtype):
        raise ValueError(
            f"host pool read_slots returned {getattr(data, 'shape', type(data))}/"
            f"{getattr(data, 'dtype', '')}, expected {want}/{np.dtype(pool.dtype)}"
        )
    return np.ascontiguousarray(data)


def scatter(pool: HostSlots, slots: np.ndarray, payload: memoryview, m: int, skip: int) -> None:
    """Pages ``skip .. skip + len(slots)`` of an ``m``-page payload into ``slots``."""
    pages = np.frombuffer(payload, dtype=np.dtype(pool.dtype)).reshape((m, *pool.slot_shape))
    pool.write_slots(slots, pages[skip : skip + len(slots)])
