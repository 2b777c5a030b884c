"""Shared shape and index validation for the paged copy kernels.

Every kernel in this family (Pallas, portable XLA, pure-jnp reference) runs these checks on the
host, on plain numpy/int data, *before* any buffer is touched: a kernel cannot raise from inside a
DMA loop, and an out-of-range page id would silently read or clobber another page. Errors are
``ValueError``/``TypeError`` naming the offending values.

Layout shared by the family (see ``kernels/paged_copy/__init__.py``)::

    kv:     [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]   # K = [:, 0], V = [:, 1]
    pages:  [n, num_layers, 2, page_size, num_kv_heads, head_dim]           # one row per page id
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

KV_RANK = 6  # [L, 2, P, S, H, D]


def _preview(values: np.ndarray, limit: int = 8) -> str:
    vals = values.tolist()
    if len(vals) <= limit:
        return str(vals)
    return f"{vals[:limit]}... ({len(vals)} values)"


def validate_ids(
    ids: object,
    upper: int,
    *,
    name: str = "page_ids",
    allow_empty: bool = False,
) -> np.ndarray:
    """Returns ``ids`` as a fresh ``int32[n]`` numpy array after checking it.

    Raises ``TypeError`` for non-integer input and ``ValueError`` for a wrong rank, an empty list
    (unless ``allow_empty``), ids outside ``[0, upper)`` or duplicate ids (a duplicate in a scatter
    makes the result order-dependent; in a gather it is almost always a caller bug).

    Cost: O(n log n) in numpy, no Python step per id except for tiny arrays (``_PY_MAX_IDS``), where
    a Python pass over the list beats numpy's per-call overhead. One sort gives the range (first and
    last) and the duplicates (equal neighbours).
    """
    if type(ids) is np.ndarray and ids.dtype == np.int32 and ids.ndim == 1 and ids.size:
        # Fast path (plans carry int32 arrays). Errors fall through to the general path below,
        # which names the bad values.
        if ids.size <= _PY_MAX_IDS:
            vals = ids.tolist()
            if min(vals) >= 0 and max(vals) < upper and len(set(vals)) == len(vals):
                return ids.copy()
        elif _sorted_ok(np.sort(ids), upper):
            return ids.copy()
    if hasattr(ids, "devices") and not isinstance(ids, np.ndarray):
        # A jax.Array: pulling it to host is fine for validation, but say what we expect.
        ids = np.asarray(ids)
    arr = np.asarray(ids)
    if arr.dtype == np.bool_ or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise TypeError(f"{name} must be integers, got dtype {arr.dtype}: {_preview(arr.ravel())}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0 and not allow_empty:
        raise ValueError(f"{name} is empty: nothing to copy")
    arr = arr.astype(np.int64, copy=False)
    if arr.size:
        srt = np.sort(arr)
        if srt[0] < 0 or srt[-1] >= upper:
            bad = arr[(arr < 0) | (arr >= upper)]
            raise ValueError(f"{name} out of range [0, {upper}): {_preview(np.unique(bad))}")
        dup = srt[1:] == srt[:-1]
        if dup.any():
            raise ValueError(f"{name} has duplicates: {_preview(np.unique(srt[1:][dup]))}")
    return arr.astype(np.int32)


# Up to this many ids, the fast path checks a Python list (each numpy call has a fixed overhead).
_PY_MAX_IDS = 24


def _sorted_ok(srt: np.ndarray, upper: int) -> bool:
    """``srt`` (sorted ids) lies in ``[0, upper)`` and has no two equal neighbours."""
    return bool(srt[0] >= 0 and srt[-1] < upper and not (srt[1:] == srt[:-1]).any())


def validate_kv_shape(kv_shape: Sequence[int], *, name: str = "kv") -> tuple[int, ...]:
    """Checks the paged pool shape ``[L, 2, P, S, H, D]``; returns it as a tuple."""
    shape = tuple(int(d) for d in kv_shape)
    if len(shape) != KV_RANK:
        raise ValueError(
            f"{name} must be [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim], "
            f"got shape {shape}"
        )
    if shape[1] != 2:
        raise ValueError(f"{name} axis 1 must be 2 (K and V), got shape {shape}")
    if any(d <= 0 for d in shape):
        raise ValueError(f"{name} has an empty axis: shape {shape}")
    return shape


def page_row_shape(kv_shape: Sequence[int]) -> tuple[int, ...]:
    """Shape of one gathered page row: ``[L, 2, S, H, D]``."""
    L, two, _, S, H, D = validate_kv_shape(kv_shape)
    return (L, two, S, H, D)


def validate_pages_shape(
    kv_shape: Sequence[int], pages_shape: Sequence[int], num_ids: int, *, name: str = "pages"
) -> None:
    """Checks that ``pages`` is ``[m, L, 2, S, H, D]`` with ``m >= num_ids`` rows for ``kv``."""
    row = page_row_shape(kv_shape)
    shape = tuple(int(d) for d in pages_shape)
    if len(shape) != KV_RANK or shape[1:] != row:
        raise ValueError(f"{name} must be [n, *{row}], got shape {shape}")
    if shape[0] < num_ids:
        raise ValueError(f"{name} has {shape[0]} rows but {num_ids} page ids were given")


def validate_count(count: int, capacity: int, *, name: str = "count") -> int:
    """``count`` valid rows out of a ``capacity``-row (bucketed) buffer."""
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(count).__name__}: {count!r}")
    if not 0 < int(count) <= capacity:
        raise ValueError(f"{name}={count} must be in [1, {capacity}]")
    return int(count)
