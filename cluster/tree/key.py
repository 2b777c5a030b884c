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

# (extra_key, cache_salt): the tree keeps one root per value (not ``hicache.storage.Namespace``, which
# also names the model).
NamespaceKey = tuple[str | None, str | None]


_TOKEN_DTYPE_OBJ = np.dtype(TOKEN_DTYPE)
_min_reduce = np.minimum.reduce  # the ufunc itself: ndarray.min wraps it in Python code on every call
_new_object = object.__new__


def as_token_array(token_ids: np.ndarray | Sequence[int]) -> np.ndarray:
    """Returns token ids as a contiguous 1-D int32 array; raises on anything that is not ids."""
    if type(token_ids) is np.ndarray and token_ids.ndim == 1 and (
        token_ids.dtype is _TOKEN_DTYPE_OBJ or token_ids.dtype == _TOKEN_DTYPE_OBJ  # unpickled: equal, not same
    ):
        # Fast path (int32 ids, what the serving code sends): one pass, int32 ids only need to be >= 0.
        if token_ids.shape[0] == 0 or _min_reduce(token_ids) >= 0:
            return token_ids if token_ids.flags.c_contiguous else np.ascontiguousarray(token_ids)
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
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0:
        raise ValueError(f"token ids must be >= 0, got {lo}")
    if hi > _MAX_TOKEN_ID:
        raise ValueError(f"token ids must fit in int32, got {hi}")
    return np.ascontiguousarray(arr, dtype=TOKEN_DTYPE)


@dataclass(slots=True, eq=False, init=False)
class RadixKey:
    """Token ids of a sequence and its namespace (``extra_key`` for LoRA/tenant, ``cache_salt``).

    Read-only by convention: not ``frozen``, because one is built per request and a frozen dataclass
    stores each field through ``object.__setattr__``.
    """

    token_ids: np.ndarray  # i32[n]
    extra_key: str | None
    cache_salt: str | None

    def __init__(self, token_ids: np.ndarray | Sequence[int], extra_key: str | None = None,
                 cache_salt: str | None = None) -> None:
        if extra_key is not None and not isinstance(extra_key, str):
            raise TypeError(f"extra_key must be a str or None, got {extra_key!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {cache_salt!r}")
        self.token_ids = as_token_array(token_ids)
        self.extra_key = extra_key
        self.cache_salt = cache_salt

    @classmethod
    def from_checked(cls, token_ids: np.ndarray, extra_key: str | None, cache_salt: str | None) -> RadixKey:
        """A key from ids the caller already validated (contiguous int32, all >= 0) and a namespace of
        ``str``/``None``: nothing is scanned or checked again."""
        key = _new_object(cls)
        key.token_ids = token_ids
        key.extra_key = extra_key
        key.cache_salt = cache_salt
        return key

    @property
    def namespace(self) -> NamespaceKey:
        return (self.extra_key, self.cache_salt)

    def __len__(self) -> int:
        return self.token_ids.shape[0]

    def prefix(self, num_tokens: int) -> RadixKey:
        """The first ``num_tokens`` tokens, same namespace (no re-validation)."""
        return RadixKey.from_checked(self.token_ids[:num_tokens], self.extra_key, self.cache_salt)
