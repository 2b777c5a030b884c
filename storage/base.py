"""``HiCacheStorage``: the L3 interface the HiCache controller talks to (vocabulary after SGLang's
``HiCacheStorage``; our own code).

Units. The unit of transfer is a *page* (one host-pool slot: all layers, K and V, this host's KV
heads). A page is named by its chain key (``hicache.storage.keys.page_keys``) and identified by
its absolute index in its chain (``first_page + i``). Storage groups consecutive pages of a chain
into objects (``pages_per_object``); callers only ever see pages.

Buffer ownership. The host pool (``HostSlots``, implemented by the worker's host pool) owns its
slots. Storage calls ``read_slots`` / ``write_slots`` only during a ``batch_get`` /
``batch_set`` call, from the calling thread (or from its I/O threads, on disjoint slots, if the
pool declares ``concurrent_slot_io`` / ``concurrent_slot_reads``: ``slot_access``), never after
the call returned; ``read_slots`` returns a fresh array that storage owns and drops when the call
returns; ``write_slots`` copies out of a buffer storage owns.
The caller must keep the slots of an in-flight call pinned (not freed, not reused) until it
returns. Storage never keeps a reference to pool memory between calls.

Who calls. Storage is per host: each host's worker holds one instance over its own shard (its
``ShardCoord``) and answers for its shard only; the replica's head combines hosts (MIN of
``batch_exists``, AND of per-key results). Storage knows neither the tree nor device pools.

Errors. Bad arguments raise ``TypeError``/``ValueError`` naming the offending value, before any I/O
and without changing state. Backend trouble (missing, corrupt, short, mismatched objects,
exceptions, hangs beyond the call's timeout, a missing bucket, an open breaker) never raises and
never returns ``None``: it shows up as per-page ``False`` / a shorter hit count, plus a counter by
kind in ``stats()`` (``StorageStats.error_counts``). One exception: ``batch_set`` while the
location is marked unavailable (breaker open) raises ``StorageUnavailableError`` at once, before
reading a slot: a backup skipped, which its caller counts (a read in that state is a plain miss).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from hicache.storage.keys import (
    ChainKeys,
    ModelFingerprint,
    Namespace,
    ShardCoord,
    check_key,
)


class PoolKind(str, enum.Enum):
    """Which host pool a transfer targets (hybrid models have several)."""

    KV = "kv"  # full-attention KV pages
    SWA = "swa"  # sliding-window-attention KV pages
    MAMBA = "mamba"  # recurrent state snapshots (usually one key per request tip)


@runtime_checkable
class HostSlots(Protocol):
    """What storage needs from a host (L2) pool: its slots. One slot = one page of this host's
    shard."""

    slot_shape: tuple[int, ...]
    dtype: np.dtype
    slot_bytes: int
    # Optional (not part of the structural check): a pool that sets ``concurrent_slot_io = True``
    # allows storage's I/O threads to call read_slots/write_slots concurrently on *disjoint* slots
    # during a call (copies and checksums then run in parallel); ``concurrent_slot_reads = True``
    # allows only read_slots there (a pool written on the calling thread only). Storage
    # guarantees no such access after the call returns, also when the call times out.

    def read_slots(self, slots: np.ndarray) -> np.ndarray:  # slots: i32[n] -> [n, *slot_shape]
        """Copy of the slots' contents (owned by the caller)."""
        ...

    def write_slots(self, slots: np.ndarray, data: np.ndarray) -> None:  # data: [n, *slot_shape]
        """Copy ``data`` into the slots (``data`` stays owned by the caller)."""
        ...


@dataclasses.dataclass(frozen=True, eq=False)
class PoolTransfer:
    """Pages ``first_page .. first_page+len(keys)-1`` of one chain, for one pool.

    ``keys[i]`` is the chain key of page ``first_page + i``; ``host_slots[i]`` its slot.
    ``chunk_start_key``: where ``first_page`` lies inside a chunk, the chain key of that chunk's
    first page (``first_page - first_page % pages_per_object(pool)``), which the caller holds: with
    it the store can find that chunk's objects by their first page (the leading-page index); None:
    not known, so a hit that stops inside that chunk gets no leading pages.
    """

    pool: PoolKind
    keys: Sequence[str]
    host_slots: np.ndarray  # i32[len(keys)]
    first_page: int = 0
    chunk_start_key: str | None = None


@dataclasses.dataclass(frozen=True)
class StoredPrefix:
    """A manifest entry trimmed to what is stored: for warm restart of a head's tree."""

    tokens: np.ndarray  # i64[num_pages * page_size]
    num_pages: int
    keys: tuple[str, ...]  # chain keys of the stored pages


@dataclasses.dataclass(frozen=True)
class StorageStats:
    """Monotonic counters since construction (plus current ``used_bytes`` where tracked)."""

    exists_calls: int = 0
    get_calls: int = 0
    set_calls: int = 0
    hit_pages: int = 0  # pages loaded into host slots
    miss_pages: int = 0  # pages requested by batch_get and not loaded
    set_pages: int = 0  # pages confirmed stored by batch_set (written or already present)
    objects_read: int = 0
    objects_written: int = 0
    objects_skipped_existing: int = 0  # batch_set found the object already stored
    objects_raced: int = 0  # write-once lost a race to a concurrent writer (still stored)
    bytes_read: int = 0
    bytes_written: int = 0
    corrupt_objects: int = 0  # reads that failed verification: corrupt_in_transit + corrupt_at_rest
    corrupt_by_reason: Mapping[str, int] = dataclasses.field(default_factory=dict)  # first failures by CorruptReason
    corrupt_in_transit: int = 0  # failed verification, not proven bad at rest: a miss, never deleted
    corrupt_at_rest: int = 0  # failed twice with the same stored bytes: deleted if delete_corrupt
    corrupt_deleted: int = 0  # objects deleted as corrupt at rest
    errors: int = 0  # backend errors other than timeouts (refused + missing_bucket + permission + other_errors)
    timeouts: int = 0  # object operations not finished by the call's deadline (or refused by a hung backend)
    refused: int = 0  # connection refused / reset / unreachable
    missing_bucket: int = 0  # operations that found the bucket (root) gone
    permission: int = 0  # 401 / 403 / EACCES
    other_errors: int = 0  # anything else (5xx, EIO, ...)
    unavailable: int = 0  # object operations failed fast by the open breaker (no network)
    skipped_write_pages: int = 0  # pages of batch_set calls refused while the breaker was open
    retries: int = 0  # transient errors retried within the deadline
    breaker_opens: int = 0  # times the breaker opened
    breaker_state: str = "closed"  # now: "closed", "open" or "half_open" (a call would probe)
    evicted_objects: int = 0
    evicted_bytes: int = 0  # page objects and their index entries
    # leading-page index (``leading_index``): entries are not counted as objects above
    index_written: int = 0  # entries published (beside objects written or raced)
    index_bytes_written: int = 0
    index_deleted: int = 0  # entries deleted by the byte cap, with their objects or orphaned
    index_lookups: int = 0  # index folders listed (a hit stopped inside a chunk)
    index_reads: int = 0  # entries read after a listing (at most leading_index.MAX_CANDIDATES per folder)
    index_hits: int = 0  # lookups that extended a hit with an object's leading pages
    used_bytes: int = -1  # -1: not tracked (only file:// with a byte cap tracks it)

    def error_counts(self) -> dict[str, int]:
        """Errors by kind (``errors.ErrorKind`` values), for metrics and ``hicache status``."""
        return {
            "timeout": self.timeouts,
            "refused": self.refused,
            "missing_bucket": self.missing_bucket,
            "permission": self.permission,
            "other": self.other_errors,
            "corrupt_in_transit": self.corrupt_in_transit,
            "corrupt_at_rest": self.corrupt_at_rest,
            "unavailable": self.unavailable,
        }


class HiCacheStorage(abc.ABC):
    """Abstract L3 store. Implementations: ``FsspecStorage`` (file://, memory://, gs://)."""

    fingerprint: ModelFingerprint

    # ---- pools ---------------------------------------------------------------------------
    @abc.abstractmethod
    def register_host_pool(
        self,
        pool: HostSlots,
        *,
        shard: ShardCoord,
        kind: PoolKind = PoolKind.KV,
        pages_per_object: int | None = None,
    ) -> None:
        """Attach the host pool whose slots ``batch_get``/``batch_set`` address for ``kind``."""

    @abc.abstractmethod
    def pages_per_object(self, kind: PoolKind = PoolKind.KV) -> int:
        """Chunk size of ``kind``'s objects; ``batch_set`` needs ``first_page`` aligned to it."""

    # ---- data path -----------------------------------------------------------------------
    @abc.abstractmethod
    def batch_exists(
        self,
        keys: Sequence[str],
        *,
        first_page: int = 0,
        pool: PoolKind = PoolKind.KV,
        timeout_s: float | None = None,
        min_pages: int = 1,
        fingerprint: ModelFingerprint | None = None,
        chunk_start_key: str | None = None,
    ) -> int:
        """Number of consecutive pages, from ``keys[0]``, that ``batch_get`` can load now
        (``chunk_start_key``: as ``PoolTransfer``'s; pass ``batch_get`` the same).

        ``min_pages``: the caller has no use for a hit shorter than this (a prefetch below its
        minimum). The answer is exact when it is ``>= min_pages``; below, it is some smaller number,
        so a store may leave out the objects that could only make such a hit (fewer existence
        checks on a miss). A query of fewer than ``min_pages`` keys is 0 without I/O.

        ``fingerprint``: count the pages stored under another model fingerprint instead (``keys``
        computed in its namespace; this host's shard and chunk size): what explains a miss as
        "fingerprint differs". Such pages are never loaded."""

    @abc.abstractmethod
    def batch_get_pools(
        self, transfers: Sequence[PoolTransfer], *, timeout_s: float | None = None
    ) -> list[list[bool]]:
        """Load the longest stored prefix of each transfer into its host slots.

        Per transfer, per page: loaded or not. Only a contiguous prefix is usable by the tree, so
        every page after the first missing/corrupt/failed one reports ``False`` (objects after the
        first missing one are not read). Slots of ``False`` pages may have been overwritten and
        must be treated as garbage; bytes that failed verification never reach them.
        """

    @abc.abstractmethod
    def batch_set_pools(
        self, transfers: Sequence[PoolTransfer], *, timeout_s: float | None = None
    ) -> list[list[bool]]:
        """Store pages from host slots; per transfer, per page: stored (now or before) or not.
        ``StorageUnavailableError`` (nothing read or written) while the location is marked
        unavailable."""

    def batch_get(
        self,
        keys: Sequence[str],
        host_slots: np.ndarray,
        *,
        first_page: int = 0,
        pool: PoolKind = PoolKind.KV,
        timeout_s: float | None = None,
        chunk_start_key: str | None = None,
    ) -> list[bool]:
        return self.batch_get_pools([PoolTransfer(pool, keys, host_slots, first_page, chunk_start_key)],
                                    timeout_s=timeout_s)[0]

    def batch_set(
        self,
        keys: Sequence[str],
        host_slots: np.ndarray,
        *,
        first_page: int = 0,
        pool: PoolKind = PoolKind.KV,
        timeout_s: float | None = None,
    ) -> list[bool]:
        return self.batch_set_pools([PoolTransfer(pool, keys, host_slots, first_page)], timeout_s=timeout_s)[0]

    def exists_each(self, keys: Sequence[str], *, pool: PoolKind, timeout_s: float | None = None) -> list[bool]:
        """Per key, whether the one-page object of ``pool`` named by it is stored (a pool registered with one
        page per object: sparse values such as recurrent states at node ends). Errors are ``False``."""
        raise NotImplementedError(f"{type(self).__name__} has no exists_each")

    @abc.abstractmethod
    def exists(self, key: str, page_index: int, *, pool: PoolKind = PoolKind.KV) -> bool:
        """Whether an object named ``key`` (ending at page ``page_index``) is stored."""

    # ---- warm restart --------------------------------------------------------------------
    @abc.abstractmethod
    def record_prefix(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> bool:
        """Add a manifest entry for the full pages of ``tokens`` (call after they are stored)."""

    @abc.abstractmethod
    def list_prefixes(
        self, namespace: Namespace, *, pool: PoolKind = PoolKind.KV, verify: bool = True,
        timeout_s: float | None = None,
    ) -> list[StoredPrefix]:
        """Manifest entries of ``namespace``, trimmed to stored pages when ``verify``; the whole
        call within ``timeout_s`` (or the store's listing deadline)."""

    # ---- admin ---------------------------------------------------------------------------
    @abc.abstractmethod
    def clear(self, *, timeout_s: float | None = None) -> None:
        """Delete every object and manifest entry of this store's fingerprint."""

    @abc.abstractmethod
    def stats(self) -> StorageStats: ...

    def close(self) -> bool:
        """Release threads/sessions, waiting a bounded time for operations in flight. Idempotent.
        True if nothing was left running."""
        return True

    def __enter__(self) -> HiCacheStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- shared argument validation ------------------------------------------------------------


def _all_keys_valid(keys: list[str]) -> bool:
    """Whether every key is 64 lowercase hex chars, checked over the whole batch at once (C
    loops over one joined string, not a regex per key)."""
    try:
        b = ",".join(keys).encode("ascii")
    except (TypeError, UnicodeEncodeError):
        return False
    n = len(keys)
    return (
        len(b) == 65 * n - 1
        and b.count(b",") == n - 1
        and b[64::65] == b"," * (n - 1)  # so every key is exactly 64 chars long
        and not b.translate(None, b"0123456789abcdef,")
    )


def check_keys(keys: object) -> Sequence[str]:
    """``keys`` as a list of valid chain keys; a ``ChainKeys`` is valid by construction and stays
    lazy (a query that ends early hashes only the pages it reads)."""
    if isinstance(keys, ChainKeys):
        return keys
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise TypeError(f"keys must be a sequence of hex str, got {type(keys).__name__}")
    out = list(keys)
    if _all_keys_valid(out):
        return out
    for i, k in enumerate(out):  # the slow path names the offending key
        check_key(k, what=f"keys[{i}]")
    return out


def _check_int_at_least(name: str, v: object, least: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}: {v!r}")
    if v < least:
        raise ValueError(f"{name} must be >= {least}, got {v}")
    return int(v)


def check_first_page(first_page: object) -> int:
    return _check_int_at_least("first_page", first_page, 0)


def check_min_pages(min_pages: object) -> int:
    return _check_int_at_least("min_pages", min_pages, 1)


def check_slots(host_slots: object, n: int) -> np.ndarray:
    if isinstance(host_slots, (list, tuple)):
        for i, s in enumerate(host_slots):
            if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
                raise TypeError(f"host_slots[{i}] must be an int, got {s!r}")
        host_slots = np.asarray(host_slots, dtype=np.int64).reshape(-1)
    if not isinstance(host_slots, np.ndarray):
        raise TypeError(f"host_slots must be an int32 numpy array, got {type(host_slots).__name__}")
    if host_slots.dtype.kind not in "iu":
        raise TypeError(f"host_slots must be an integer array, got dtype {host_slots.dtype}")
    if host_slots.ndim != 1 or host_slots.shape[0] != n:
        raise ValueError(f"host_slots must have shape ({n},) to match keys, got {host_slots.shape}")
    if n and int(host_slots.min()) < 0:
        i = int(np.argmin(host_slots))
        raise ValueError(f"host_slots[{i}] = {int(host_slots[i])} is negative")
    if n and int(host_slots.max()) >= 2**31:
        i = int(np.argmax(host_slots))
        raise ValueError(f"host_slots[{i}] = {int(host_slots[i])} does not fit int32")
    return host_slots.astype(np.int32, copy=False)


def check_pool_kind(kind: object) -> PoolKind:
    try:
        return PoolKind(kind)
    except ValueError:
        raise ValueError(f"unknown pool kind {kind!r}; expected one of {[k.value for k in PoolKind]}") from None
