"""A plain numpy host pool satisfying ``HostSlots``, for tests, benchmarks and examples.

It is a real buffer (one ``[num_slots, *slot_shape]`` array that this object owns), not a mock;
the production host pool lives in ``hicache.workers``. ``read_slots`` returns a fresh copy owned by
the caller; ``write_slots`` copies from the caller's buffer.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt


class NumpyHostPool:
    concurrent_slot_io = True  # disjoint-slot copies from several threads are safe on one ndarray

    def __init__(self, num_slots: int, slot_shape: tuple[int, ...], dtype: npt.DTypeLike = np.float32) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.slot_shape = tuple(int(d) for d in slot_shape)
        self.dtype = np.dtype(dtype)
        self.slot_bytes = math.prod(self.slot_shape) * self.dtype.itemsize
        self.buf = np.zeros((num_slots, *self.slot_shape), dtype=self.dtype)  # owned here

    @property
    def num_slots(self) -> int:
        return self.buf.shape[0]

    @staticmethod
    def _as_range(slots: np.ndarray) -> slice | None:
        """``slots`` as a slice when they are consecutive ids (the common case): memcpy speed."""
        n = len(slots)
        if n and int(slots[-1]) - int(slots[0]) == n - 1 and (n < 3 or bool(np.all(np.diff(slots) == 1))):
            return slice(int(slots[0]), int(slots[0]) + n)
        return None

    def read_slots(self, slots: np.ndarray) -> np.ndarray:  # slots: i32[n] -> [n, *slot_shape]
        slots = np.asarray(slots)
        r = self._as_range(slots)
        return self.buf[r].copy() if r is not None else self.buf[slots]  # always a copy

    def write_slots(self, slots: np.ndarray, data: np.ndarray) -> None:  # data: [n, *slot_shape]
        slots = np.asarray(slots)
        r = self._as_range(slots)
        if r is not None:
            self.buf[r] = data
        else:
            self.buf[slots] = data

    def fill_random(self, slots: np.ndarray, seed: int) -> None:
        """Deterministic pseudo-random bytes in ``slots`` (any dtype, bit patterns included)."""
        rng = np.random.default_rng(seed)
        raw = rng.integers(0, 256, size=(len(slots), self.slot_bytes), dtype=np.uint8)
        self.buf.reshape(self.num_slots, -1).view(np.uint8)[np.asarray(slots)] = raw


def slot_range(a: int, b: int) -> np.ndarray:
    """``i32[b-a]`` slot ids ``a..b-1``."""
    return np.arange(a, b, dtype=np.int32)


def same_bytes(x: np.ndarray, y: np.ndarray) -> bool:
    """Bit-identical (NaN payloads included)."""
    return x.shape == y.shape and x.dtype == y.dtype and np.array_equal(
        np.ascontiguousarray(x).view(np.uint8), np.ascontiguousarray(y).view(np.uint8)
    )


class ManualClock:
    """A monotonic clock that moves only when told (``advance``): pass it where a component takes
    a ``clock`` (``FsspecStorage``'s breaker), so tests step past a cooldown instead of sleeping."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a monotonic clock cannot go back, got {seconds!r}")
        self.now += seconds
