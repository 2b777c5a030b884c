"""Portable (XLA) paged gather/scatter for the CPU and GPU backends.

Same semantics as ``reference.py`` but written for in-place, O(batch) execution:

* a ``fori_loop`` of ``dynamic_slice``/``dynamic_update_slice`` over the first ``count`` ids, so the
  caller can bucket ``n`` to a few compiled shapes (padding rows are never read or written);
* the output of the gather is a *donated* staging buffer and the scatter updates the *donated*
  pool, so XLA writes in place and never allocates a pool-sized or batch-sized temporary;
* data is moved as same-width unsigned integers (``bitcast_convert_type``): XLA:CPU has no native
  bf16 arithmetic and otherwise wraps a bf16 scatter in a convert of the *whole pool* to f32, i.e.
  O(pool) per call (measured: 200 ms for one page of a 256 MiB pool; 60 us with the bitcast).

The caller validates ids (``validation.py``) and handles sharding (these act on one shard).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_UINT_OF_SIZE = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def as_bits(x: jax.Array) -> jax.Array:
    """Same-width unsigned view (a free bitcast in XLA)."""
    u = _UINT_OF_SIZE[jnp.dtype(x.dtype).itemsize]
    return x if x.dtype == u else lax.bitcast_convert_type(x, u)


def from_bits(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    return x if x.dtype == dtype else lax.bitcast_convert_type(x, dtype)


def gather_pages_xla(
    kv: jax.Array,  # [L, 2, P, S, H, D]
    page_ids: jax.Array,  # i32[m]; the first `count` are used
    count: jax.Array,  # i32[] number of valid ids, 1 <= count <= m
    out: jax.Array,  # [m, L, 2, S, H, D] staging buffer (donate it)
) -> jax.Array:  # [m, L, 2, S, H, D]; rows >= count keep out's content
    L, two, _, S, H, D = kv.shape
    src = as_bits(kv)

    def body(j, dst):
        row = lax.dynamic_slice(src, (0, 0, page_ids[j], 0, 0, 0), (L, two, 1, S, H, D))
        return lax.dynamic_update_slice(dst, row.reshape(1, L, two, S, H, D), (j, 0, 0, 0, 0, 0))

    return from_bits(lax.fori_loop(0, count, body, as_bits(out)), out.dtype)


def scatter_pages_xla(
    kv: jax.Array,  # [L, 2, P, S, H, D] (donate it)
    page_ids: jax.Array,  # i32[m]; the first `count` are used
    count: jax.Array,  # i32[]
    pages: jax.Array,  # [m, L, 2, S, H, D]
) -> jax.Array:  # [L, 2, P, S, H, D]
    L, two, _, S, H, D = kv.shape
    src = as_bits(pages)

    def body(j, dst):
        row = lax.dynamic_slice(src, (j, 0, 0, 0, 0, 0), (1, L, two, S, H, D))
        return lax.dynamic_update_slice(dst, row.reshape(L, two, 1, S, H, D), (0, 0, page_ids[j], 0, 0, 0))

    return from_bits(lax.fori_loop(0, count, body, as_bits(kv)), kv.dtype)
