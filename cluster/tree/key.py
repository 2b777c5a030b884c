"""Radix keys: token ids of one request plus the namespace that isolates tenants.

``RadixKey`` is what serving code passes to every tree call. Token ids are normalised once, here, to a
contiguous ``int32`` numpy array; the tree stores slices of that representation (4 bytes/token).
Different ``extra_key`` (LoRA adapter, tenant) or ``cache_salt`` values live under different roots and
never share nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

TOKEN_DTYPE = np.int32
_MAX_TOKEN_ID = int(np.iinfo(TOKEN_DTYPE).max)

Namespace = tuple[str | None, str | None]


def as_token_array(token_ids: np.ndarray | Sequence[int]) -> np.ndarray:
    """Returns token ids as a contiguous 1-D int32 array; raises on anything that is not ids."""
    if isinstance(token_ids, np.ndarray):
        arr = token_ids
    elif isinstance(token_ids, (list, tuple, range)):
        if len(token_ids) == 0:
            return np.empty(0, dtype=TOKEN_DTYPE)
        arr = np.asarray(token_ids)
    else:
        raise TypeError(f"token_ids must be a numpy integer array or a list of ints, got {type(token_ids).__name__}")
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=TOKEN_DTYPE)
    if arr.dtype.kind not in "iu":
        bad = next((t for t in arr.tolist() if not isinstance(t, int) or isinstance(t, bool)), arr.dtype)
        raise TypeError(f"token ids must be integers, got {bad!r} (dtype {arr.dtype})")
    if arr.dtype == TOKEN_DTYPE:
        # One pass: negative int32 ids become >= 2**31 when viewed as uint32.
        if int(arr.view(np.uint32).max()) <= _MAX_TOKEN_ID:
            return np.ascontiguousarray(arr)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0:
        raise ValueError(f"token ids must be >= 0, got {lo}")
    if hi > _MAX_TOKEN_ID:
        raise ValueError(f"token ids must fit in int32, got {hi}")
    return np.ascontiguousarray(arr, dtype=TOKEN_DTYPE)


@dataclass(frozen=True, eq=False)
class RadixKey:
    """Token ids of a sequence and its namespace (``extra_key`` for LoRA/tenant, ``cache_salt``)."""

    token_ids: np.ndarray  # i32[n]
    extra_key: str | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", as_token_array(self.token_ids))
        for name in ("extra_key", "cache_salt"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a str or None, got {value!r}")

    @property
    def namespace(self) -> Namespace:
        return (self.extra_key, self.cache_salt)

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    def prefix(self, num_tokens: int) -> RadixKey:
        """The first ``num_tokens`` tokens, same namespace (no re-validation)."""
        key = object.__new__(RadixKey)
        object.__setattr__(key, "token_ids", self.token_ids[:num_tokens])
        object.__setattr__(key, "extra_key", self.extra_key)
        object.__setattr__(key, "cache_salt", self.cache_salt)
        return key
