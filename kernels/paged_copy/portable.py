"""Portable (XLA) paged gather/scatter for the CPU and GPU backends.

Same semantics as ``reference.py`` but written for in-place, O(batch) execution:

* a ``fori_loop`` of ``dynamic_slice``/``dynamic_update_slice`` over the first ``count`` ids, so the
  caller can bucket ``n`` to a few compiled shapes (padding rows are never read or written);
* the output of the gather is a *donated* staging buffer and the scatter updates the *donated*
  pool, so XLA writes in place and never allocates a pool-sized or batch-sized temporary;
* dtype caveat (XLA:CPU): float normalization upcasts every bf16/f16 ``dynamic_slice``,
  ``dynamic_update_slice`` and scatter to f32 *over the whole operand*, i.e. O(pool) per call, and
  a ``bitcast_convert_type`` to u16 is emitted as a full copy too. So on the CPU backend the device
  pool *stores* 16-bit floats as their same-width unsigned bit pattern
  (``hicache.workers.device_pool.storage_dtype``); these functions are dtype-agnostic and then run
  in place;
* the loops run on the flat views ``[L*2, P, S*H*D]`` / ``[m, L*2, S*H*D]`` when those reshapes are
  free (``_flat_is_free``: no size-1 axis), i.e. one page is ``L*2`` long contiguous runs; otherwise
  on the 6-D shapes (inner runs of ``D``). XLA:CPU turns a reshape *back* to a shape with a size-1
  axis into a relayout copy of the whole result (every H2D of a ``[1, 2, P, 16, 1, 8]`` pool copied
  pool and output twice), so degenerate layouts keep the 6-D loop. ``tests/kernels/test_in_place.py``
  checks the compiled programs.

The caller validates ids (``validation.py``) and handles sharding (these act on one shard).
"""

from __future__ import annotations

import jax
from jax import lax


def _flat_is_free(kv_shape: tuple[int, ...], rows_shape: tuple[int, ...]) -> bool:
    """Whether the flat views of ``kv [L, 2, P, S, H, D]`` and ``rows [m, L, 2, S, H, D]`` are bitcasts
    both ways on every backend: only when no axis has size 1. With a size-1 axis XLA:CPU's layout
    assignment places it arbitrarily in the reshape's result layout and then copies the whole array
    to the row-major result (also for a mere squeeze/expand_dims), so the in-place update is lost."""
    return min(kv_shape) > 1 and min(rows_shape) > 1


def _views(kv: jax.Array, rows: jax.Array) -> tuple[jax.Array, jax.Array, int]:
    """``(kv view, rows view, page axis of the kv view)``: the flat ``[L*2, P, S*H*D]`` and
    ``[m, L*2, S*H*D]`` views when free (long contiguous runs per page: faster than the 6-D loop,
    whose inner runs are only ``D`` long), else the arrays themselves (page axis 2)."""
    if not _flat_is_free(kv.shape, rows.shape):
        return kv, rows, 2
    L, two, P, S, H, D = kv.shape
    return kv.reshape(L * two, P, S * H * D), rows.reshape(rows.shape[0], L * two, S * H * D), 1


def _page(kv: jax.Array, axis: int, page: jax.Array) -> jax.Array:
    """``kv[..., page:page+1, ...]`` along ``axis`` (a dynamic slice of one page)."""
    start: list[int | jax.Array] = [0] * kv.ndim
    start[axis] = page
    return lax.dynamic_slice(kv, start, kv.shape[:axis] + (1,) + kv.shape[axis + 1 :])


def gather_pages_xla(
    kv: jax.Array,  # [L, 2, P, S, H, D]
    page_ids: jax.Array,  # i32[m]; the first `count` are used
    count: jax.Array,  # i32[] number of valid ids, 1 <= count <= m
    out: jax.Array,  # [m, L, 2, S, H, D] staging buffer (donate it)
) -> jax.Array:  # [m, L, 2, S, H, D]; rows >= count keep out's content
    src, dst0, axis = _views(kv, out)
    row_shape = (1, *dst0.shape[1:])

    def body(j, dst):
        row = _page(src, axis, page_ids[j]).reshape(row_shape)
        return lax.dynamic_update_slice(dst, row, (j,) + (0,) * (dst.ndim - 1))

    return lax.fori_loop(0, count, body, dst0).reshape(out.shape)


def scatter_pages_xla(
    kv: jax.Array,  # [L, 2, P, S, H, D] (donate it)
    page_ids: jax.Array,  # i32[m]; the first `count` are used
    count: jax.Array,  # i32[]
    pages: jax.Array,  # [m, L, 2, S, H, D]
) -> jax.Array:  # [L, 2, P, S, H, D]
    """``kv[:, :, page_ids[j]] = pages[j]`` for ``j < count``, in place on the donated pool."""
    dst0, src, axis = _views(kv, pages.astype(kv.dtype))
    page_shape = dst0.shape[:axis] + (1,) + dst0.shape[axis + 1 :]

    def body(j, dst):
        row = lax.dynamic_slice(src, (j,) + (0,) * (src.ndim - 1), (1, *src.shape[1:]))
        start = [0] * dst.ndim
        start[axis] = page_ids[j]
        return lax.dynamic_update_slice(dst, row.reshape(page_shape), start)

    return lax.fori_loop(0, count, body, dst0).reshape(kv.shape)
