"""Paged KV gather/scatter: Pallas TPU kernel, portable XLA path, pure-jnp reference.

Layout of the L1 pool (one global array, sharded on the KV-head axis by ``hicache.workers``)::

    kv:    [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]   # [:, 0] = K, [:, 1] = V
    pages: [m, num_layers, 2, page_size, num_kv_heads, head_dim]           # staging: one row per page

``kv[l, 0]`` / ``kv[l, 1]`` are the per-layer K / V page arrays ``[num_pages, page_size, heads,
head_dim]`` the attention kernels consume. A staging row is exactly one L2 host slot (for the heads
of the shard it lives on).

Implementations (``CopyImpl``), all with the same signature and bit-identical results:

* ``PALLAS_TPU`` -- ``kernel.py``: DMA gather/scatter, all chunks in flight then wait all.
* ``PALLAS_INTERPRET`` -- the same kernels in TPU interpret mode (CPU tests only; slow).
* ``XLA`` -- ``portable.py``: fori_loop of dynamic slices, in place on donated buffers (CPU, GPU).

``select_impl(backend)`` is the one place that picks an implementation per backend.
All functions act on one shard and take pre-validated ids (``validation.py``).
"""

from __future__ import annotations

import enum

import jax

from hicache.kernels.paged_copy.kernel import (
    copy_pages_to_host,
    gather_pages_pallas,
    scatter_pages_pallas,
)
from hicache.kernels.paged_copy.portable import gather_pages_xla, scatter_pages_xla
from hicache.kernels.paged_copy.reference import (
    gather_pages_reference,
    scatter_pages_reference,
)
from hicache.kernels.paged_copy.validation import (
    page_row_shape,
    validate_count,
    validate_ids,
    validate_kv_shape,
    validate_pages_shape,
)


class CopyImpl(str, enum.Enum):
    XLA = "xla"
    PALLAS_TPU = "pallas_tpu"
    PALLAS_INTERPRET = "pallas_interpret"


_BY_BACKEND = {"tpu": CopyImpl.PALLAS_TPU, "gpu": CopyImpl.XLA, "cuda": CopyImpl.XLA,
               "rocm": CopyImpl.XLA, "cpu": CopyImpl.XLA}


def select_impl(backend: str | None = None) -> CopyImpl:
    """The kernel implementation for a JAX backend (default: ``jax.default_backend()``).

    TPU -> Pallas DMA kernels; CPU/GPU -> portable XLA (Pallas TPU kernels do not lower there and
    interpret mode is a test vehicle, far too slow to serve).
    """
    name = (backend or jax.default_backend()).lower()
    try:
        return _BY_BACKEND[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; expected one of {sorted(_BY_BACKEND)}") from None


def gather_pages(
    kv: jax.Array,  # [L, 2, P, S, H, D]
    page_ids: jax.Array,  # i32[m]
    count: jax.Array,  # i32[]
    out: jax.Array,  # [m, L, 2, S, H, D] staging (donated by the jitted callers)
    *,
    impl: CopyImpl = CopyImpl.XLA,
) -> jax.Array:  # [m, L, 2, S, H, D]
    impl = CopyImpl(impl)
    if impl is CopyImpl.XLA:
        return gather_pages_xla(kv, page_ids, count, out)
    return gather_pages_pallas(kv, page_ids, count, out, interpret=impl is CopyImpl.PALLAS_INTERPRET)


def scatter_pages(
    kv: jax.Array,  # [L, 2, P, S, H, D] (donated by the jitted callers)
    page_ids: jax.Array,  # i32[m]
    count: jax.Array,  # i32[]
    pages: jax.Array,  # [m, L, 2, S, H, D]
    *,
    impl: CopyImpl = CopyImpl.XLA,
) -> jax.Array:  # [L, 2, P, S, H, D]
    impl = CopyImpl(impl)
    if impl is CopyImpl.XLA:
        return scatter_pages_xla(kv, page_ids, count, pages)
    return scatter_pages_pallas(kv, page_ids, count, pages, interpret=impl is CopyImpl.PALLAS_INTERPRET)


__all__ = [
    "CopyImpl",
    "copy_pages_to_host",
    "gather_pages",
    "gather_pages_pallas",
    "gather_pages_reference",
    "gather_pages_xla",
    "page_row_shape",
    "scatter_pages",
    "scatter_pages_pallas",
    "scatter_pages_reference",
    "scatter_pages_xla",
    "select_impl",
    "validate_count",
    "validate_ids",
    "validate_kv_shape",
    "validate_pages_shape",
]
