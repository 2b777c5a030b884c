"""A plain numpy host pool satisfying ``HostPool``, for tests, benchmarks and examples.

It is a real buffer (one ``[num_slots, *slot_shape]`` array that this object owns), not a mock;
the production host pool lives in ``hicache.workers``. ``read_slots`` returns a fresh copy owned by
the caller; ``write_slots`` copies from the caller's buffer.
"""

from __future__ import annotations

import math

import numpy as np


class NumpyHostPool:
    def __init__(self, num_slots: int, slot_shape: tuple[int, ...], dtype: np.dtype | str = np.float32) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.slot_shape = tuple(int(d) for d in slot_shape)
        self.dtype = np.dtype(dtype)
        self.slot_bytes = math.prod(self.slot_shape) * self.dtype.itemsize
        self.buf = np.zeros((num_slots, *self.slot_shape), dtype=self.dtype)  # owned here

    @property
    def num_slots(self) -> int:
        return self.buf.shape[0]

    def read_slots(self, slots: np.ndarray) -> np.ndarray:  # slots: i32[n] -> [n, *slot_shape]
        return self.buf[np.asarray(slots)]  # fancy indexing = copy

    def write_slots(self, slots: np.ndarray, data: np.ndarray) -> None:  # data: [n, *slot_shape]
        self.buf[np.asarray(slots)] = data

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
