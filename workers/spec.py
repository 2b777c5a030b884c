"""Model-side description of one KV cache: what a page is, in shapes and bytes.

Plain data; safe to send across Ray. Every host of a replica builds the same ``KVCacheSpec``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int8")


def _np_dtype(name: str) -> np.dtype:
    import ml_dtypes  # shipped with jax; gives numpy bfloat16/float8

    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the paged KV cache of one model.

    A *page* holds ``page_size`` tokens of K and V for every layer and every KV head; it is the unit
    of L1 allocation, of L2 slots and of transfers.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"KVCacheSpec.{name} must be an int, got {type(value).__name__}: {value!r}")
            if value <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be > 0, got {value}")
        if not isinstance(self.dtype, str) or self.dtype not in _DTYPES:
            raise ValueError(f"KVCacheSpec.dtype must be one of {_DTYPES}, got {self.dtype!r}")

    @property
    def np_dtype(self) -> np.dtype:
        return _np_dtype(self.dtype)

    @property
    def itemsize(self) -> int:
        return self.np_dtype.itemsize

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """One page, all heads: ``[num_layers, 2, page_size, num_kv_heads, head_dim]``."""
        return (self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers, K and V, all KV heads."""
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim * self.itemsize

    def pool_shape(self, num_pages: int) -> tuple[int, int, int, int, int, int]:
        """The L1 pool: ``[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]``."""
        return (self.num_layers, 2, int(num_pages), self.page_size, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class ComponentPool:
    """A hybrid model's pool besides the Full KV pool, as paged as it (e.g. ``"swa"``: the sliding-window
    layers' K/V, ``spec.num_layers`` of them): ``num_device_pages`` in L1 (the head's component pool ids)
    and ``host_slots`` in L2 on every host. The worker moves its pages with the same transfer code as the
    Full pool's."""

    name: str
    spec: KVCacheSpec
    num_device_pages: int
    host_slots: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or self.name == "kv":
            raise ValueError(f"ComponentPool.name must name a component pool (not 'kv'), got {self.name!r}")
        if not isinstance(self.spec, KVCacheSpec):
            raise TypeError(f"ComponentPool.spec must be a KVCacheSpec, got {type(self.spec).__name__}")
        for field_name in ("num_device_pages", "host_slots"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"ComponentPool {self.name!r}: {field_name} must be a positive int, got {value!r}")
