"""L3 key scheme: model fingerprint, namespaced SHA-256 page chain, topology-free shard coordinate.

Everything here is a pure function of its inputs (no clocks, no process state, no ``hash()``), so
two processes, two replicas or two restarts compute the same keys for the same tokens (DESIGN.md
§5). Nothing here touches storage or buffers.

Page chain::

    seed = SHA256(framed("hicache/ns/v1", fingerprint.digest(), extra_key, cache_salt))
    h_0  = SHA256(seed    || tokens[0:P]    as little-endian int64)
    h_i  = SHA256(h_{i-1} || tokens[iP:(i+1)P] as little-endian int64)

``P`` is ``fingerprint.page_size``. Only full pages get a key; a trailing partial page is not
cacheable in L3. Keys are 64-character lowercase hex strings (they cross Ray boundaries and name
objects). Framing is length-prefixed with a presence tag, so ``extra_key=None`` differs from
``extra_key=""`` and ``("ab", "c")`` differs from ``("a", "bc")``.

Shard coordinate: a host holds KV heads ``[h0, h1)`` of ``H`` and layers ``[l0, l1)`` of ``L``; the
coordinate names exactly that, independent of how many hosts or chips the replica has, so a replica
with another TP degree computes the same name for the same heads.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import struct
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

KEY_HEX_LEN = 64
_KEY_RE = re.compile(r"^[0-9a-f]{64}$")
_NS_TAG = b"hicache/ns/v1"
_FP_TAG = b"hicache/fingerprint/v1"


def _frame(*fields: bytes | str | int | None) -> bytes:
    """Unambiguous encoding: each field = presence tag + u64 length + bytes."""
    out = bytearray()
    for f in fields:
        if f is None:
            out += b"\x00"
            continue
        if isinstance(f, bool):
            raise TypeError(f"bool is not a frameable field: {f!r}")
        if isinstance(f, int):
            b = str(f).encode()
            tag = b"\x02"
        elif isinstance(f, str):
            b = f.encode("utf-8")
            tag = b"\x01"
        elif isinstance(f, bytes):
            b = f
            tag = b"\x03"
        else:
            raise TypeError(f"unsupported field type {type(f).__name__}: {f!r}")
        out += tag + struct.pack("<Q", len(b)) + b
    return bytes(out)


def _check_pos_int(name: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}: {v!r}")
    if v <= 0:
        raise ValueError(f"{name} must be > 0, got {v!r}")


@dataclasses.dataclass(frozen=True)
class ModelFingerprint:
    """What makes KV bytes of one model interchangeable. Any field change → disjoint keys."""

    model_id: str
    dtype: str  # numpy dtype name of the KV cache, e.g. "bfloat16", "float16", "float32"
    page_size: int  # tokens per page
    num_layers: int
    num_kv_heads: int  # total KV heads of the model (not per host)
    head_dim: int
    layout_version: int = 1  # bump when the slot byte layout changes

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError(f"model_id must be a non-empty str, got {self.model_id!r}")
        if not isinstance(self.dtype, str) or not self.dtype:
            raise ValueError(f"dtype must be a non-empty dtype name str, got {self.dtype!r}")
        for name in ("page_size", "num_layers", "num_kv_heads", "head_dim", "layout_version"):
            _check_pos_int(name, getattr(self, name))

    def digest(self) -> bytes:
        """32-byte SHA-256 over a framed, field-named encoding (stable across processes). Computed
        once per instance (the fields are frozen; every key computation starts from it)."""
        d = self.__dict__.get("_digest")
        if d is None:
            d = self._compute_digest()
            object.__setattr__(self, "_digest", d)
        return d

    def _compute_digest(self) -> bytes:
        return hashlib.sha256(
            _frame(
                _FP_TAG,
                "model_id", self.model_id,
                "dtype", self.dtype,
                "page_size", int(self.page_size),
                "num_layers", int(self.num_layers),
                "num_kv_heads", int(self.num_kv_heads),
                "head_dim", int(self.head_dim),
                "layout_version", int(self.layout_version),
            )
        ).digest()

    def hexdigest(self) -> str:
        return self.digest().hex()


@dataclasses.dataclass(frozen=True)
class Namespace:
    """Key namespace: fingerprint + ``extra_key`` (LoRA/tenant) + ``cache_salt``.

    Different namespaces never share a key, hence never share an L3 object.
    """

    fingerprint: ModelFingerprint
    extra_key: str | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.fingerprint, ModelFingerprint):
            raise TypeError(f"fingerprint must be a ModelFingerprint, got {self.fingerprint!r}")
        for name in ("extra_key", "cache_salt"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise TypeError(f"{name} must be str or None, got {type(v).__name__}: {v!r}")

    def seed(self) -> bytes:
        """Chain seed (32 bytes). Memoized per (fingerprint, extra_key, cache_salt): the head builds a
        fresh ``Namespace`` for every L3 query and backup, and framing + hashing cost more than the
        chain's first pages."""
        return _seed(self.fingerprint.digest(), self.extra_key, self.cache_salt)

    def hexdigest(self) -> str:
        return self.seed().hex()


@functools.lru_cache(maxsize=4096)
def _seed(fingerprint_digest: bytes, extra_key: str | None, cache_salt: str | None) -> bytes:
    return hashlib.sha256(_seed_head(fingerprint_digest, extra_key) + _frame(cache_salt)).digest()


@functools.lru_cache(maxsize=256)
def _seed_head(fingerprint_digest: bytes, extra_key: str | None) -> bytes:
    """The seed's framed fields before ``cache_salt`` (framing is field by field, so the bytes are
    those of framing all four at once): a new salt, every request of a no-reuse workload, frames
    one field instead of four on the serving thread."""
    return _frame(_NS_TAG, fingerprint_digest, extra_key)


_min_reduce = np.minimum.reduce  # the ufunc directly: ndarray.min adds a Python frame per call
_I32 = np.dtype(np.int32)


def _as_tokens(tokens: object) -> np.ndarray:
    """Validate token ids → contiguous little-endian int64 array (a copy only when needed)."""
    if type(tokens) is np.ndarray and tokens.ndim == 1 and tokens.dtype == _I32 and tokens.shape[0]:
        # fast path (the head's int32 ids): one reduction, one conversion
        if _min_reduce(tokens) >= 0:
            return tokens.astype("<i8")
    if isinstance(tokens, np.ndarray):
        arr = tokens
        if arr.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise TypeError(f"tokens must be an integer array, got dtype {arr.dtype}")
    elif isinstance(tokens, (list, tuple)):
        for i, t in enumerate(tokens):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise TypeError(f"tokens[{i}] must be an int, got {type(t).__name__}: {t!r}")
        arr = np.asarray(tokens, dtype=np.int64) if tokens else np.zeros(0, np.int64)
    else:
        raise TypeError(f"tokens must be a numpy int array or a list of ints, got {type(tokens).__name__}")
    if arr.size and int(arr.min()) < 0:
        i = int(np.argmin(arr))
        raise ValueError(f"token ids must be >= 0, got tokens[{i}] = {int(arr[i])}")
    return np.ascontiguousarray(arr, dtype="<i8")


def check_key(key: object, *, what: str = "key") -> str:
    if not isinstance(key, str):
        raise TypeError(f"{what} must be a 64-char hex str, got {type(key).__name__}: {key!r}")
    if not _KEY_RE.match(key):
        raise ValueError(f"{what} must be 64 lowercase hex chars, got {key!r}")
    return key


def page_keys(
    namespace: Namespace,
    tokens: Sequence[int] | np.ndarray,
    *,
    parent: str | None = None,
) -> list[str]:
    """Chain keys of the full pages of ``tokens``.

    ``parent`` continues an existing chain: pass the key of the page just before ``tokens[0]``
    (``tokens`` must then start at a page boundary). ``page_keys(ns, a + b)`` equals
    ``page_keys(ns, a) + page_keys(ns, b, parent=page_keys(ns, a)[-1])`` when ``len(a)`` is a
    multiple of the page size.
    """
    if not isinstance(namespace, Namespace):
        raise TypeError(f"namespace must be a Namespace, got {type(namespace).__name__}")
    arr = _as_tokens(tokens)
    prev = namespace.seed() if parent is None else bytes.fromhex(check_key(parent, what="parent"))
    p = namespace.fingerprint.page_size
    raw = arr.tobytes()
    stride = p * 8
    out: list[str] = []
    for i in range(len(arr) // p):
        prev = hashlib.sha256(prev + raw[i * stride : (i + 1) * stride]).digest()
        out.append(prev.hex())
    return out


class ChainKeys(Sequence):
    """``page_keys(namespace, tokens, parent=parent)`` as a lazy, read-only sequence: a key is hashed
    when it (or a later one) is first read, and kept. An L3 query that ends early (a miss is known
    after the first few pages of the chain) hashes only those pages, not the whole prompt's.
    Valid by construction (every item is a chain key), equal item by item to ``page_keys``; a
    prefix slice (``keys[:n]``) is lazy too and shares the hashed keys, any other slice is a list.
    Picklable (a Ray call carries the seed and the tokens; the receiver hashes what it reads)."""

    __slots__ = ("_prev", "_raw", "_page_bytes", "_n", "_done")

    def __init__(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray, *, parent: str | None = None) -> None:
        if not isinstance(namespace, Namespace):
            raise TypeError(f"namespace must be a Namespace, got {type(namespace).__name__}")
        arr = _as_tokens(tokens)
        p = namespace.fingerprint.page_size
        self._prev = namespace.seed() if parent is None else bytes.fromhex(check_key(parent, what="parent"))
        self._raw = arr[: len(arr) - len(arr) % p].tobytes()
        self._page_bytes = p * 8
        self._n = len(arr) // p
        self._done: list[str] = []

    @classmethod
    def _view(cls, base: ChainKeys, n: int) -> ChainKeys:
        out = cls.__new__(cls)
        out._prev, out._raw, out._page_bytes, out._done = base._prev, base._raw, base._page_bytes, base._done
        out._n = n
        return out

    def __len__(self) -> int:
        return self._n

    def _upto(self, n: int) -> None:
        """Hashes pages until ``n`` keys are known."""
        done, stride, raw = self._done, self._page_bytes, self._raw
        prev = bytes.fromhex(done[-1]) if done else self._prev
        for i in range(len(done), n):
            prev = hashlib.sha256(prev + raw[i * stride : (i + 1) * stride]).digest()
            done.append(prev.hex())

    def __getitem__(self, i: Any) -> Any:  # Sequence's two overloads (int -> str, slice -> keys) in one
        if type(i) is int and 0 <= i < len(self._done) and i < self._n:  # a key hashed already
            return self._done[i]
        if isinstance(i, slice):
            idx = range(*i.indices(self._n))
            if idx.start == 0 and idx.step == 1:
                return ChainKeys._view(self, len(idx))
            if idx:
                self._upto(max(idx[0], idx[-1]) + 1)
            return [self._done[j] for j in idx]
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"ChainKeys indices must be ints or slices, got {type(i).__name__}")
        j = int(i) + self._n if i < 0 else int(i)
        if not 0 <= j < self._n:
            raise IndexError(f"key index {i} out of range for {self._n} keys")
        if j >= len(self._done):
            self._upto(j + 1)
        return self._done[j]

    def __iter__(self) -> Iterator[str]:
        for j in range(self._n):
            yield self[j]

    def __getstate__(self) -> tuple:
        return (self._prev, self._raw[: self._n * self._page_bytes], self._page_bytes, self._n)

    def __setstate__(self, state: tuple) -> None:
        self._prev, self._raw, self._page_bytes, self._n = state
        self._done = []

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (str, bytes)) or not isinstance(other, Sequence):
            return NotImplemented
        return len(other) == self._n and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # mutable cache, compares by items

    def __repr__(self) -> str:
        return f"ChainKeys({self._n} keys, {self.hashed} hashed)"

    @property
    def hashed(self) -> int:
        """Keys hashed so far (for tests and profiling)."""
        return min(len(self._done), self._n)


@dataclasses.dataclass(frozen=True)
class ShardCoord:
    """This host's slice of a page: KV heads ``[head_start, head_end)`` of ``num_heads`` and
    layers ``[layer_start, layer_end)`` of ``num_layers``. Topology-free (no host/TP index)."""

    head_start: int
    head_end: int
    num_heads: int
    layer_start: int
    layer_end: int
    num_layers: int

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_layers"):
            _check_pos_int(name, getattr(self, name))
        for lo, hi, tot in (("head_start", "head_end", "num_heads"), ("layer_start", "layer_end", "num_layers")):
            a, b, n = getattr(self, lo), getattr(self, hi), getattr(self, tot)
            for name, v in ((lo, a), (hi, b)):
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                    raise TypeError(f"{name} must be an int, got {v!r}")
            if not (0 <= a < b <= n):
                raise ValueError(f"need 0 <= {lo} < {hi} <= {tot}, got {a}, {b}, {n}")

    @classmethod
    def full(cls, fp: ModelFingerprint) -> ShardCoord:
        """All heads and layers of the model (single host)."""
        return cls(0, fp.num_kv_heads, fp.num_kv_heads, 0, fp.num_layers, fp.num_layers)

    def tag(self) -> str:
        """Path component, e.g. ``h0-4of8.l0-32of32``."""
        return (
            f"h{self.head_start}-{self.head_end}of{self.num_heads}"
            f".l{self.layer_start}-{self.layer_end}of{self.num_layers}"
        )

    def check_against(self, fp: ModelFingerprint) -> None:
        if self.num_heads != fp.num_kv_heads or self.num_layers != fp.num_layers:
            raise ValueError(
                f"shard {self.tag()} does not match fingerprint "
                f"(num_kv_heads={fp.num_kv_heads}, num_layers={fp.num_layers})"
            )
