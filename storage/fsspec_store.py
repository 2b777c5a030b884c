"""``FsspecStorage``: the one ``HiCacheStorage`` implementation, over fsspec by URL.

It puts together (one module per concept):

- ``object_store``: whole objects by path for the URL's scheme (exists / read / write-once /
  delete / list);
- ``batch_io``: batches of those calls under the call's deadline (I/O threads, or gcsfs' loop),
  with our retry policy, behind the location's ``breaker``;
- ``errors``: what went wrong, by kind (``StorageStats``);
- ``corruption``: corrupt in transit (a miss) vs corrupt at rest (deleted);
- ``chunking``: which objects hold which pages of a chain (the chunking rule, ``resolve``);
- ``shard_cover``: topology-free reads, a host's heads assembled from the shard objects another
  layout (host count, devices per host, chunk size) stored, found by listing the pool's shard
  folders at most every ``layout_refresh_s``;
- ``format``: the self-verifying object header;
- ``slot_access``: copies between objects and the host pool's slots, and when I/O threads may
  make them;
- ``lru``: the optional byte cap of a file:// root;
- ``manifest``: stored prefixes for warm restart;
- ``leading_index``: the leading pages of an object a query ends or diverges inside.

Schemes
-------
- ``file://DIR`` — embedded default. Write-once through a temp file and ``os.link``
  (``object_store``). Optional byte cap (``StorageConfig.max_bytes``) with LRU eviction. No
  fsync: a cache; a crash can lose objects, and anything damaged fails its checksum and is a miss.
- ``memory://NAME`` — tests (per process).
- ``gs://BUCKET/PREFIX`` — gcsfs; write-once is ``ifGenerationMatch=0``. The instance and
  listings caches are off (``skip_instance_cache=True``, ``use_listings_cache=False``) so other
  replicas' writes are seen.
- Any other fsspec URL works through the generic sync (threads) or async path. A chained URL
  (``faulty::gs://BUCKET/PREFIX``: the fault wrapper over gcsfs) gets its innermost scheme's
  defaults (object size, gs:// cache options and bucket probe); options per protocol.

Every scheme names, resolves, reads and writes the same objects by the same rules: the same writes
give the same hits on every scheme.

Object names (topology-free, content-addressed)::

    {root}/v{FORMAT_VERSION}/{fingerprint[:16]}/{pool}/{shard.tag()}/c{C}/{key[0]}/{key}
    {root}/v{FORMAT_VERSION}/{fingerprint[:16]}/manifest/{namespace[0]}/{namespace[:32]}-{tag}
    {root}/v{FORMAT_VERSION}/{fingerprint[:16]}/{pool}/{shard.tag()}/c{C}/i/{first key}/{key}

The last: leading-page index entries (``leading_index``), with ``StorageConfig.leading_page_index``
(on by default).

Call flow. ``batch_exists``: ``chunking.resolve`` (at most two batched existence rounds, the second
with the leading-page index listing beside it, and one round of index entry reads where that
listing shows entries; where other
layouts hold this host's heads, over them too, and two more rounds per layout switch along the
chain: ``shard_cover.plan``).
``batch_get``: resolve, then read and verify the objects concurrently; objects that fail
verification are re-read once (``corruption``: used if the re-read verifies, deleted only if proven
corrupt at rest); a miss, a corrupt object or a failure ends the usable prefix. ``batch_set``:
``first_page`` on a chunk boundary; one batched existence round skips stored objects, the rest are
gathered from the pool and written once (``max_inflight_bytes`` at a time).

gs:// capacity: bucket lifecycle rules (not enforced by this code)
------------------------------------------------------------------
Objects are immutable and content-addressed, so deleting any of them is always safe (a later
request recomputes and rewrites). Recommended bucket configuration for ``gs://BUCKET/PREFIX``:

- ``Delete`` with ``condition: {age: N, matchesPrefix: ["PREFIX/v4/"]}``: ``N`` days after creation
  (GCS cannot cheaply track reads, so this is FIFO, not LRU; pick ``N`` from the reuse horizon,
  e.g. 7). Optionally ``SetStorageClass`` → ``NEARLINE`` earlier; reads there cost more.
- Manifest entries (``.../manifest/``) may keep a longer age: they are tiny, and entries whose
  pages were deleted are trimmed by ``list_prefixes(verify=True)``.
- Old formats / fingerprints: delete ``PREFIX/v{old}/`` or ``PREFIX/v4/{fingerprint}/`` prefixes.
- Disable object versioning and soft delete on the cache bucket (every delete would otherwise keep
  billable noncurrent bytes); new buckets ramp to ~1000 writes/s, hence multi-MiB objects.

Threads. Calls may come from several threads at once (counters under ``_lock``). Each call runs
on its calling thread and hands its I/O to ``batch_io`` (I/O threads or gcsfs' loop); verification
runs where a read finished. The host pool is touched on the calling thread, or by the I/O threads
for pools that allow it, only until the call returns (``slot_access``).

Deadlines and the breaker. Every call has a deadline (``timeout_s=`` or the ``StorageConfig``
default of its kind: ``exists_timeout_s`` for existence checks, ``list_timeout_s`` for listings,
``timeout_s`` for reads and writes; ``close_timeout_s`` for ``close``): operations not finished by
then are abandoned or cancelled (counted in ``timeouts``) and their pages report ``False``. After
``breaker_threshold`` calls with timeouts / connection errors within ``breaker_window_s`` (a call
counts once, whatever its rounds; or one round in which every connection was refused), the location's breaker opens (``available`` is False): calls answer
at once as misses (``unavailable``), and ``batch_set`` raises ``StorageUnavailableError`` before
touching the pool (``skipped_write_pages``: the caller counts the skipped backup), until a probe
after ``breaker_cooldown_s`` gets an answer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from hicache.storage import leading_index, shard_cover, slot_access
from hicache.storage.base import (
    HiCacheStorage,
    HostSlots,
    PoolKind,
    PoolTransfer,
    StorageStats,
    StoredPrefix,
    check_first_page,
    check_keys,
    check_min_pages,
    check_pool_kind,
    check_slots,
)
from hicache.storage.batch_io import Deadline, InlineBatchIO, IoItem, IoKind, RetryPolicy, make_batch_io
from hicache.storage.breaker import Breaker, BreakerState
from hicache.storage.chunking import Chunking, ObjectRef, resolve
from hicache.storage.config import LocalIO, StorageConfig
from hicache.storage.corruption import Verdict, note_failure, recheck
from hicache.storage.errors import ErrorKind, StorageUnavailableError, classify
from hicache.storage.format import FORMAT_VERSION, CorruptObjectError, HeaderEncoder, ObjectKind, ObjectMeta, decode
from hicache.storage.keys import ModelFingerprint, Namespace, ShardCoord, _as_tokens, check_key, page_keys
from hicache.storage.lru import ByteCapLRU, scan
from hicache.storage.manifest import Manifest, longest_first
from hicache.storage.object_store import LocalObjectStore, on_local_disk, open_object_store

_NO_SLOTS = np.zeros(0, np.int32)  # batch_exists' queries carry no slots (read-only, shared)
# StorageStats counter of each error kind (MISSING: a plain miss, no counter)
_KIND_COUNTER = {ErrorKind.TIMEOUT: "timeouts", ErrorKind.REFUSED: "refused", ErrorKind.MISSING_BUCKET: "missing_bucket",
                 ErrorKind.PERMISSION: "permission", ErrorKind.OTHER: "other_errors", ErrorKind.UNAVAILABLE: "unavailable"}
_NOT_COUNTERS = ("corrupt_by_reason", "used_bytes", "breaker_state", "breaker_opens", "retries")


@dataclasses.dataclass(frozen=True)
class _PoolReg:
    """A registered host pool: its slots, shard and object layout."""

    pool: HostSlots
    shard: ShardCoord
    kind: PoolKind
    chunking: Chunking
    dtype_name: str
    header: HeaderEncoder  # this pool's object headers
    shape: tuple[int, ...]  # per-page shape (the pool's ``slot_shape``)
    slot_bytes: int  # bytes per page

    @property
    def ppo(self) -> int:
        return self.chunking.pages_per_object

    def object_bytes(self, m: int) -> int:
        return self.header.header_len + m * self.slot_bytes


class _Transfer(NamedTuple):
    """A validated ``PoolTransfer``: ``keys[i]`` is page ``first + i``, in slot ``slots[i]``;
    ``before``: ``(page, key)`` of one page before ``first`` the caller knows (its
    ``chunk_start_key``), or None."""

    reg: _PoolReg
    keys: Sequence[str]
    slots: np.ndarray
    first: int
    before: tuple[int, str] | None = None

    def key_at(self, page: int) -> str | None:
        """The chain key of ``page`` where this transfer knows it."""
        if self.first <= page < self.first + len(self.keys):
            return self.keys[page - self.first]
        return self.before[1] if self.before is not None and self.before[0] == page else None

    def slots_of(self, o: ObjectRef) -> np.ndarray:
        """The slots of the pages of ``o`` that lie inside this transfer."""
        lo, hi = max(o.start, self.first), min(o.stop(), self.first + len(self.keys))
        return self.slots[lo - self.first : hi - self.first]


class FsspecStorage(HiCacheStorage):
    """L3 over one fsspec URL for one model fingerprint; one instance per host process."""

    def __init__(
        self,
        url: str,
        fingerprint: ModelFingerprint,
        config: StorageConfig | None = None,
        *,
        fs: Any = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """``fs``: an fsspec filesystem to use instead of the one ``url`` names; ``clock``: the
        breaker's clock (tests move it instead of waiting out the cooldown)."""
        if not isinstance(url, str) or not url:
            raise ValueError(f"url must be a non-empty str, got {url!r}")
        if not isinstance(fingerprint, ModelFingerprint):
            raise TypeError(f"fingerprint must be a ModelFingerprint, got {type(fingerprint).__name__}")
        config = StorageConfig() if config is None else config
        if not isinstance(config, StorageConfig):
            raise TypeError(f"config must be a StorageConfig, got {type(config).__name__}")
        scheme, opts = _scheme_and_options(url, config.storage_options)
        store, root = open_object_store(url, opts, fs)
        self._local = isinstance(store, LocalObjectStore)
        if config.max_bytes is not None and not self._local:
            raise ValueError(f"max_bytes (LRU byte cap) is only supported for file:// urls, got {url!r}")
        self.url = url
        self.scheme = scheme
        self.fingerprint = fingerprint
        self.config = config
        self._fp = fingerprint.digest()
        self._root = root
        self._base = f"{root}/v{FORMAT_VERSION}/{fingerprint.hexdigest()[:16]}"
        self.breaker = Breaker(config.breaker_threshold, config.breaker_cooldown_s, clock or time.monotonic,
                               config.breaker_window_s)
        inline = self._local and (config.local_io is LocalIO.INLINE
                                  or config.local_io is LocalIO.AUTO and on_local_disk(root))
        self._io = make_batch_io(store, self.breaker, RetryPolicy(config.retries, config.retry_backoff_s),
                                 config.io_threads, config.max_pending_ops, inline)
        self._manifest = Manifest(self._base, self._fp, fingerprint.page_size, self._io)
        self._lru = (ByteCapLRU(f"{root}/v{FORMAT_VERSION}", config.max_bytes, config.evict_low_watermark)
                     if config.max_bytes is not None else None)
        self._pools: dict[PoolKind, _PoolReg] = {}
        self._sources: dict[PoolKind, tuple[_PoolReg, ...]] = {}  # other layouts' shards (shard_cover)
        self._sources_at: dict[PoolKind, float] = {}  # when they were last listed
        self._lock = threading.Lock()
        self._counters: dict[str, int] = {f.name: 0 for f in dataclasses.fields(StorageStats) if f.name not in _NOT_COUNTERS}
        self._corrupt: dict[str, int] = {}
        self._closed = False

    # ---- helpers -----------------------------------------------------------------------------
    def _count(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self._counters[k] += v

    def _count_exc(self, e: BaseException, *, on_root: bool = False) -> None:
        """Count a failed object operation by its kind (``on_root``: a write or a listing,
        ``errors.classify``)."""
        counter = _KIND_COUNTER.get(classify(e, on_root=on_root))
        if counter is None:  # a missing object: a plain miss
            return
        with self._lock:
            self._counters[counter] += 1
            if counter not in ("timeouts", "unavailable"):
                self._counters["errors"] += 1

    def _deadline(self, timeout_s: float | None, default: float | None = None) -> Deadline:
        if timeout_s is None:
            return Deadline(self.config.timeout_s if default is None else default)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number or None, got {timeout_s!r}")
        return Deadline(float(timeout_s))

    def _reg(self, kind: object) -> _PoolReg:
        reg = self._pools.get(kind) if type(kind) is PoolKind else None
        if reg is not None:  # (the usual call: a registered PoolKind, no enum lookup)
            return reg
        k = check_pool_kind(kind)
        reg = self._pools.get(k)
        if reg is None:
            raise ValueError(f"no host pool registered for pool kind {k.value!r}; call register_host_pool first")
        return reg

    def _meta(self, reg: _PoolReg, o: ObjectRef) -> ObjectMeta:
        return ObjectMeta(ObjectKind.PAGES, self._fp, bytes.fromhex(o.key), o.start, o.m, reg.dtype_name, reg.shape)

    def _check_transfers(self, transfers: object, *, for_set: bool) -> list[_Transfer]:
        if not isinstance(transfers, Sequence):
            raise TypeError(f"transfers must be a sequence of PoolTransfer, got {type(transfers).__name__}")
        out = []
        for ti, tr in enumerate(transfers):
            if not isinstance(tr, PoolTransfer):
                raise TypeError(f"transfers[{ti}] must be a PoolTransfer, got {type(tr).__name__}")
            reg = self._reg(tr.pool)
            keys = check_keys(tr.keys)
            slots = check_slots(tr.host_slots, len(keys))
            first = check_first_page(tr.first_page)
            before = None
            if tr.chunk_start_key is not None:
                before = (first - first % reg.ppo, check_key(tr.chunk_start_key, what=f"transfers[{ti}].chunk_start_key"))
            if for_set and first % reg.ppo:
                raise ValueError(
                    f"first_page={first} is not a multiple of pages_per_object={reg.ppo} for pool "
                    f"{reg.kind.value!r}; batch_set must start at a chunk boundary"
                )
            if not for_set and len(np.unique(slots)) != len(slots):
                raise ValueError(f"transfers[{ti}].host_slots has duplicate slots: {slots.tolist()}")
            out.append(_Transfer(reg, keys, slots, first, before))
        return out

    def _exists_flags(self, objs: list[ObjectRef], deadline: Deadline) -> list[bool]:
        return [self._flag(r) for r in self._io.exists_many([o.path for o in objs], deadline)]

    def _flag(self, r: Any) -> bool:
        """An existence check's answer: an error is a miss (counted)."""
        if isinstance(r, BaseException):
            self._count_exc(r)
            return False
        return bool(r)

    def _resolve(self, queries: list[_Transfer], deadline: Deadline, min_pages: int = 1) -> list[list[ObjectRef]]:
        leading = _Leading(self, queries, deadline) if self.config.leading_page_index else None
        return resolve([(q.reg.chunking, q.keys, q.first) for q in queries],
                       lambda objs, folders: self._probe(objs, folders, deadline), min_pages, leading)

    def _probe(self, objs: list[ObjectRef], folders: list[str], deadline: Deadline) -> tuple[list[bool], list[Any]]:
        """One round: existence of ``objs`` and, beside them, listings of the index ``folders`` (a
        listing ends by half the call's time left, within the existence bound: a hung one costs only
        the leading pages, never the reads of the objects found before them; it lists the first
        names only, enough for ``leading_index.candidates``: one request for a folder of thousands)."""
        if not folders:
            return self._exists_flags(objs, deadline), []
        end = Deadline(min(deadline.left() / 2, self._exists_timeout()))
        self._count(index_lookups=len(folders))
        most = leading_index.MAX_CANDIDATES + max(r.ppo for r in self._pools.values())  # (own objects are skipped)
        out = self._io.mixed([IoItem(IoKind.EXISTS, o.path) for o in objs]
                             + [IoItem(IoKind.LIST, f, end=end, first=most) for f in folders], deadline)
        return [self._flag(r) for r in out[: len(objs)]], out[len(objs):]

    def _other_layouts(self, reg: _PoolReg, deadline: Deadline) -> tuple[_PoolReg, ...]:
        """Shards of other layouts holding some of ``reg``'s heads (``shard_cover``), each as a pool
        registration without a pool; listed again at most every ``layout_refresh_s`` (a failed
        listing keeps what was known, and is counted)."""
        every = self.config.layout_refresh_s
        if every is None or reg.kind is not PoolKind.KV or not shard_cover.can_assemble(reg.shard, reg.shape):
            return ()
        now = time.monotonic()
        with self._lock:
            due = now - self._sources_at.get(reg.kind, -math.inf) >= every
            if due:
                self._sources_at[reg.kind] = now
        if due:
            try:
                found = shard_cover.discover(self._io, f"{self._base}/{reg.kind.value}", reg.shard, reg.chunking,
                                             reg.shape, deadline)
            except Exception as e:
                self._count_exc(e, on_root=True)
            else:
                self._sources[reg.kind] = tuple(
                    dataclasses.replace(reg, shard=src.coord, chunking=src.chunking, shape=src.shape,
                                        header=HeaderEncoder(ObjectKind.PAGES, self._fp, reg.dtype_name, src.shape),
                                        slot_bytes=math.prod(src.shape) * np.dtype(reg.pool.dtype).itemsize)
                    for src in found)
        return self._sources.get(reg.kind, ())

    def refresh_layouts(self, *, timeout_s: float | None = None) -> int:
        """List the other layouts' shard objects now (within ``timeout_s`` or ``list_timeout_s``);
        returns how many shard folders hold some of this host's KV heads."""
        deadline = self._deadline(timeout_s, self.config.list_timeout_s)
        with self._lock:
            self._sources_at.clear()
        return sum(len(self._other_layouts(reg, deadline)) for reg in self._pools.values())

    def _covered(self, queries: list[_Transfer], deadline: Deadline, min_pages: int = 1) -> tuple[
            list[_Transfer], list[list[ObjectRef]], list[list[shard_cover.Segment]]]:
        """Existence of every query under its own shard and the other layouts' shards holding its
        heads (``shard_cover.plan``; just ``_resolve`` where there are none)."""
        return shard_cover.plan(queries, lambda reg: self._other_layouts(reg, deadline),
                                lambda batch, least: self._resolve(batch, deadline, least), deadline, min_pages)

    # ---- pools -------------------------------------------------------------------------------
    def register_host_pool(
        self,
        pool: HostSlots,
        *,
        shard: ShardCoord,
        kind: PoolKind = PoolKind.KV,
        pages_per_object: int | None = None,
        named_objects: bool = False,
    ) -> None:
        """``named_objects``: the pool's objects are found by their own name only (``Chunking.named``; a
        component pool whose values at a node end are one object: ``exists_each``)."""
        kind = check_pool_kind(kind)
        if not isinstance(pool, HostSlots):
            raise TypeError(f"pool must implement HostSlots (read_slots, write_slots, slot_shape, dtype, slot_bytes), got {type(pool).__name__}")
        if not isinstance(shard, ShardCoord):
            raise TypeError(f"shard must be a ShardCoord, got {type(shard).__name__}")
        shape = tuple(int(d) for d in pool.slot_shape)
        dtype = np.dtype(pool.dtype)
        if int(pool.slot_bytes) != math.prod(shape) * dtype.itemsize or pool.slot_bytes <= 0:
            raise ValueError(f"pool.slot_bytes={pool.slot_bytes} != prod({shape}) * {dtype.itemsize}")
        if kind is PoolKind.KV:
            shard.check_against(self.fingerprint)
            if dtype.name != self.fingerprint.dtype:
                raise ValueError(f"KV pool dtype {dtype.name!r} != fingerprint dtype {self.fingerprint.dtype!r}")
        if pages_per_object is not None and (isinstance(pages_per_object, bool) or not isinstance(pages_per_object, int) or pages_per_object < 1):
            raise ValueError(f"pages_per_object must be a positive int, got {pages_per_object!r}")
        if kind in self._pools:
            raise ValueError(f"a host pool is already registered for {kind.value!r}")
        ppo = pages_per_object or self.config.pages_per_object or max(1, self.config.object_bytes_for(self.scheme) // int(pool.slot_bytes))
        if named_objects and kind is PoolKind.KV:
            raise ValueError("named_objects is for component pools; the KV pool's objects are chunks of the chain")
        chunking = Chunking(f"{self._base}/{kind.value}/{shard.tag()}/c{ppo}", ppo, bool(named_objects))
        header = HeaderEncoder(ObjectKind.PAGES, self._fp, dtype.name, shape)
        self._pools[kind] = _PoolReg(pool, shard, kind, chunking, dtype.name, header, shape, int(pool.slot_bytes))

    def pages_per_object(self, kind: PoolKind = PoolKind.KV) -> int:
        return self._reg(kind).ppo

    def object_path(self, key: str, *, pool: PoolKind = PoolKind.KV) -> str:
        """Backend path of the object named ``key`` (admin, debugging, tests)."""
        return self._reg(pool).chunking.path(check_key(key))

    @property
    def fs(self) -> Any:
        """The underlying fsspec filesystem."""
        return self._io.store.fs

    @property
    def runs_inline(self) -> bool:
        """Whether this store's I/O runs on the calling thread (a local disk, ``StorageConfig.local_io``):
        a caller that hands calls to another thread only so as not to block on I/O need not."""
        return isinstance(self._io, InlineBatchIO)

    @property
    def available(self) -> bool:
        """False while the breaker is open (calls fail fast as misses, without I/O); True when
        closed, or when the cooldown has passed and the next call would probe."""
        return self.breaker.state is not BreakerState.OPEN

    def probe(self, *, timeout_s: float | None = None) -> bool:
        """Whether the location answers now: one existence check of the root (gs://: of the
        bucket) within ``timeout_s`` (or ``exists_timeout_s``), through the breaker: while it is
        open and cooling down, False at once without I/O; after the cooldown this call is the
        probe that closes or reopens it. For a caller that attaches or watches L3 in the
        background (no request waits on it). A missing bucket is False (and counted)."""
        bucket = self.scheme in ("gs", "gcs")
        path = self._root.split("/", 1)[0] if bucket else self._root
        r = self._io.exists_many([path], self._deadline(timeout_s, self._exists_timeout()))[0]
        if isinstance(r, BaseException):
            self._count_exc(r, on_root=True)
            return False
        if bucket and not r:
            self._count(missing_bucket=1, errors=1)
            return False
        return True

    def _exists_timeout(self) -> float:
        return min(self.config.exists_timeout_s, self.config.timeout_s)

    # ---- data path -----------------------------------------------------------------------------
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
        reg = self._reg(pool)
        keys = check_keys(keys)
        first = check_first_page(first_page)
        least = check_min_pages(min_pages)
        before = None if chunk_start_key is None else (first - first % reg.ppo, check_key(chunk_start_key, what="chunk_start_key"))
        if fingerprint is not None and not isinstance(fingerprint, ModelFingerprint):
            raise TypeError(f"fingerprint must be a ModelFingerprint or None, got {type(fingerprint).__name__}")
        deadline = self._deadline(timeout_s, self._exists_timeout())
        self._count(exists_calls=1)
        if len(keys) < least:  # no hit could reach min_pages (also: no keys)
            return 0
        if fingerprint is not None and fingerprint != self.fingerprint:
            # the other fingerprint's objects of this shard, chunked alike (its own shard only: a diagnostic)
            base = f"{self._root}/v{FORMAT_VERSION}/{fingerprint.hexdigest()[:16]}"
            other = dataclasses.replace(reg, chunking=Chunking(
                f"{base}/{reg.kind.value}/{reg.shard.tag()}/c{reg.ppo}", reg.ppo, reg.chunking.named))
            return sum(o.stop() - o.start for o in self._resolve([_Transfer(other, keys, _NO_SLOTS, first)], deadline, least)[0])
        return sum(seg.pages for seg in self._covered([_Transfer(reg, keys, _NO_SLOTS, first, before)], deadline, least)[2][0])

    def exists(self, key: str, page_index: int, *, pool: PoolKind = PoolKind.KV) -> bool:
        reg = self._reg(pool)
        check_key(key)
        check_first_page(page_index)
        r = self._io.exists_many([reg.chunking.path(key)], self._deadline(None, self._exists_timeout()))[0]
        if isinstance(r, BaseException):
            self._count_exc(r)
            return False
        return bool(r)

    def exists_each(self, keys: Sequence[str], *, pool: PoolKind, timeout_s: float | None = None) -> list[bool]:
        """Per key, whether ``pool``'s object named by that key (the one ending at that page) is stored: one
        batched existence round (pools of one page per object, or of named objects: a hybrid model's sparse values,
        one object per node end, e.g. a recurrent state or an SWA window's pages)."""
        reg = self._reg(pool)
        if reg.ppo != 1 and not reg.chunking.named:
            raise ValueError(f"exists_each needs a pool of one page or one named object per key; {reg.kind.value!r} "
                             f"has {reg.ppo} pages per object along the chain (use batch_exists)")
        keys = check_keys(keys)
        self._count(exists_calls=1)
        if not keys:
            return []
        deadline = self._deadline(timeout_s, self._exists_timeout())
        return [self._flag(r) for r in self._io.exists_many([reg.chunking.path(k) for k in keys], deadline)]

    def batch_get_pools(self, transfers: Sequence[PoolTransfer], *, timeout_s: float | None = None) -> list[list[bool]]:
        queries = self._check_transfers(transfers, for_set=False)
        deadline = self._deadline(timeout_s)
        self._count(get_calls=1)
        guard = slot_access.CallGuard()
        try:
            flat, found, plans = self._covered(queries, deadline)
            bufs = [[shard_cover.assemble(flat, seg) for seg in segs] for segs in plans]
            objs = [o for segs in plans for seg in segs for c in seg.chosen for o in found[c]
                    if o.start < flat[c].first + seg.pages]
            flat_results = [[False] * len(q.keys) for q in flat]
            loaded = [self._apply_read(flat, flat_results, o, r, deadline)
                      for o, r in zip(objs, self._read_objs(flat, objs, guard, deadline))]
        finally:
            guard.close()  # from here on no I/O thread touches the pool for this call
        results = [shard_cover.combine(q, segs, b, flat_results) for q, segs, b in zip(queries, plans, bufs)]
        hits = sum(sum(r) for r in results)
        self._count(hit_pages=hits, miss_pages=sum(len(r) for r in results) - hits)
        if self._lru is not None:
            self._lru.touch([o.path for o, ok in zip(objs, loaded) if ok])
        return results

    def _read_objs(self, queries: list[_Transfer], objs: list[ObjectRef], guard: slot_access.CallGuard,
                   deadline: Deadline) -> list[Any]:
        """Read and verify ``objs`` concurrently. Per object: True (its pages are in the pool: the
        pool takes writes from I/O threads), a verified payload view (to scatter on the calling
        thread) or an exception (``FileNotFoundError``: missing)."""

        def verify(i: int, raw: Any) -> Any:  # where the read finished
            o = objs[i]
            q = queries[o.t]
            payload = decode(raw, self._meta(q.reg, o), payload_len=o.m * q.reg.slot_bytes)
            if not slot_access.writes_on_io_threads(q.reg.pool):
                return payload
            with guard:  # never touch the pool after the call returned
                self._scatter(q, o, payload)
            return True

        def post(i: int, raw: Any) -> Any:
            try:
                return verify(i, raw)
            except CorruptObjectError as e:
                raise note_failure(e, raw) from None

        out = self._io.read_many([o.path for o in objs], post, deadline)
        bad = [i for i, r in enumerate(out) if isinstance(r, CorruptObjectError)]
        if bad:  # a miss now; re-read to tell transit from rest (module ``corruption``)
            firsts = [out[i] for i in bad]
            again = recheck(self._io, [objs[i].path for i in bad], firsts,
                            lambda j, raw: verify(bad[j], raw), deadline)
            for i, (r, verdict) in zip(bad, again):
                self._on_corrupt(verdict, deadline)
                out[i] = r
        return out

    @staticmethod
    def _scatter(q: _Transfer, o: ObjectRef, payload: memoryview) -> None:
        slot_access.scatter(q.reg.pool, q.slots_of(o), payload, o.m, max(q.first - o.start, 0))

    def _apply_read(self, queries: list[_Transfer], results: list[list[bool]], o: ObjectRef, r: Any, deadline: Deadline) -> bool:
        """Account one read result; mark its pages loaded. True if the object was loaded."""
        if isinstance(r, CorruptObjectError):  # counted by _on_corrupt
            return False
        if isinstance(r, BaseException):
            self._count_exc(r)
            return False
        q = queries[o.t]
        if r is not True:
            self._scatter(q, o, r)  # calling thread, before the call returns
        for p in range(max(o.start, q.first), min(o.stop(), q.first + len(q.keys))):
            results[o.t][p - q.first] = True
        self._count(objects_read=1, bytes_read=q.reg.object_bytes(o.m))
        return True

    def _on_corrupt(self, v: Verdict, deadline: Deadline) -> None:
        """Count a read that failed verification; delete the object if it is proven corrupt at
        rest (conditionally on the generation seen, where the backend has generations)."""
        reason = v.error.reason.value
        with self._lock:
            self._counters["corrupt_objects"] += 1
            self._counters["corrupt_at_rest" if v.at_rest else "corrupt_in_transit"] += 1
            self._corrupt[reason] = self._corrupt.get(reason, 0) + 1
        if not (v.at_rest and self.config.delete_corrupt):
            return
        r = self._io.delete_many([(v.path, v.generation)], deadline)[0]
        if isinstance(r, BaseException):
            self._count_exc(r)  # (a generation mismatch: rewritten meanwhile, and kept)
            return
        self._count(corrupt_deleted=1)
        if self._lru is not None:
            self._lru.forget(v.path)

    def batch_set_pools(self, transfers: Sequence[PoolTransfer], *, timeout_s: float | None = None) -> list[list[bool]]:
        queries = self._check_transfers(transfers, for_set=True)
        deadline = self._deadline(timeout_s)
        self._count(set_calls=1)
        if self.breaker.state is BreakerState.OPEN:  # nothing gathered, nothing sent
            pages = sum(len(q.keys) for q in queries)
            self._count(skipped_write_pages=pages)
            raise StorageUnavailableError(f"L3 {self.url!r} unavailable (breaker open): {pages} pages not written")
        results = [[False] * len(q.keys) for q in queries]
        objs = [o for t, q in enumerate(queries) for o in q.reg.chunking.naturals(t, q.keys, q.first)
                if o.m == q.reg.ppo or self.config.write_partial_chunks]
        if not objs:
            return results

        def mark(o: ObjectRef) -> None:
            first = queries[o.t].first
            results[o.t][o.start - first : o.start - first + o.m] = [True] * o.m

        todo = []
        for o, stored in zip(objs, self._exists_flags(objs, deadline)):
            if stored:
                mark(o)
                self._count(objects_skipped_existing=1)
            else:
                todo.append(o)
        written: list[tuple[int, int, str, int]] = []  # (transfer, start, path, size)
        guard = slot_access.CallGuard()
        try:
            self._write_groups(queries, todo, guard, deadline, mark, written)
        finally:
            guard.close()
        self._count(set_pages=sum(sum(r) for r in results))
        if self._lru is not None:
            written.sort()  # chain order
            evicted = self._lru.add([(p, n) for _, _, p, n in written])
            self._count(evicted_objects=evicted.objects, evicted_bytes=evicted.bytes, errors=evicted.errors,
                        index_deleted=evicted.entries)
        return results

    def _write_groups(self, queries: list[_Transfer], todo: list[ObjectRef], guard: slot_access.CallGuard,
                      deadline: Deadline, mark: Any, written: list[tuple[int, int, str, int]]) -> None:
        """Gather from the pool in groups bounded by ``max_inflight_bytes``, write each group
        concurrently (write-once: an object another writer published first counts as raced, and
        its pages as stored)."""
        gi = 0
        while gi < len(todo) and deadline.left() > 0:
            group: list[ObjectRef] = []
            nbytes = 0
            while gi < len(todo):
                o = todo[gi]
                ob = o.m * queries[o.t].reg.slot_bytes
                if group and nbytes + ob > self.config.max_inflight_bytes:
                    break
                group.append(o)
                nbytes += ob
                gi += 1
            items = []
            for o in group:
                q = queries[o.t]
                header = functools.partial(q.reg.header.encode, bytes.fromhex(o.key), o.start, o.m)
                if slot_access.reads_on_io_threads(q.reg.pool):  # gathered on an I/O thread, bounded by the call
                    pages = functools.partial(slot_access.gather, q.reg.pool, q.slots_of(o), guard)
                else:  # gathered here, on the calling thread
                    pages = functools.partial(np.asarray, slot_access.gather(q.reg.pool, q.slots_of(o), None))
                items.append((o.path, functools.partial(_with_header, header, pages)))
            tally: dict[str, int] = {}
            published = []
            for o, r in zip(group, self._io.write_many(items, deadline)):
                if isinstance(r, BaseException):
                    self._count_exc(r, on_root=True)
                    continue
                mark(o)
                name = "objects_written" if r else "objects_raced"
                tally[name] = tally.get(name, 0) + 1
                published.append(o)  # (raced too: its winner may not have written the entry yet)
                if r:
                    size = queries[o.t].reg.object_bytes(o.m)
                    tally["bytes_written"] = tally.get("bytes_written", 0) + size
                    written.append((o.t, o.start, o.path, size))
            self._count(**tally)
            # (a pool of one page per object needs no entry: each object is found by its own page's key)
            indexed = [o for o in published if queries[o.t].reg.ppo > 1 and not queries[o.t].reg.chunking.named]
            if self.config.leading_page_index and indexed:
                self._write_index(queries, indexed, deadline, written)
        if gi < len(todo):
            self._count(timeouts=len(todo) - gi)

    def _write_index(self, queries: list[_Transfer], objs: list[ObjectRef], deadline: Deadline,
                     written: list[tuple[int, int, str, int]]) -> None:
        """The leading-page index entries of objects just stored (``leading_index``), after them,
        so an entry never names an object not yet there (the byte cap deletes it with its object:
        ``lru``); a failed one only costs leading hits. Write-once: an entry is a pure function of
        its object's keys, so a raced writer's is the same bytes."""
        items = []
        for o in objs:
            q = queries[o.t]
            keys = list(q.keys[o.start - q.first : o.start - q.first + o.m])
            data = np.frombuffer(leading_index.encode(keys), np.uint8)
            items.append((q.reg.chunking.index_path(keys[0], o.key), functools.partial(_as_object, data)))
        n = nbytes = 0
        for o, (path, make), r in zip(objs, items, self._io.write_many(items, deadline)):
            if isinstance(r, BaseException):
                self._count_exc(r, on_root=True)
            elif r:
                size = len(make.args[0])
                n, nbytes = n + 1, nbytes + size
                written.append((o.t, o.start, path, size))
        self._count(index_written=n, index_bytes_written=nbytes)

    def used_bytes(self) -> int:
        """Bytes of page objects under the root (file:// only; rescans the directory)."""
        if self._lru is not None:
            return self._lru.rescan()
        if not self._local:
            raise ValueError(f"used_bytes is only tracked for file:// urls, not {self.url!r}")
        return scan(f"{self._root}/v{FORMAT_VERSION}")[1]

    # ---- manifest (warm restart) -----------------------------------------------------------------
    def _check_ns(self, namespace: object) -> Namespace:
        if not isinstance(namespace, Namespace):
            raise TypeError(f"namespace must be a Namespace, got {type(namespace).__name__}")
        if namespace.fingerprint != self.fingerprint:
            raise ValueError(f"namespace fingerprint {namespace.fingerprint} != store fingerprint {self.fingerprint}")
        return namespace

    def record_prefix(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> bool:
        ns = self._check_ns(namespace)
        arr = _as_tokens(tokens)
        P = self.fingerprint.page_size
        arr = arr[: (len(arr) // P) * P]
        if len(arr) == 0:
            return False
        r = self._manifest.record(ns, arr, self._deadline(None))
        if isinstance(r, BaseException):
            self._count_exc(r, on_root=True)
            return False
        return True

    def list_prefixes(self, namespace: Namespace, *, pool: PoolKind = PoolKind.KV, verify: bool = True,
                      timeout_s: float | None = None) -> list[StoredPrefix]:
        """Manifest entries of ``namespace`` (``HiCacheStorage.list_prefixes``), all within one
        deadline (``timeout_s`` or ``list_timeout_s``): listing, entry reads and, with ``verify``,
        the existence checks that trim them. An unreachable store lists nothing (counted)."""
        ns = self._check_ns(namespace)
        reg = self._reg(pool) if verify else None
        deadline = self._deadline(timeout_s, self.config.list_timeout_s)
        try:
            entries = self._manifest.read(ns, deadline)
        except Exception as e:  # backend outage: nothing listed
            self._count_exc(e, on_root=True)
            return []
        for v in entries.corrupt:
            self._on_corrupt(v, deadline)
        for _, err in entries.failed:
            self._count_exc(err)
        P = self.fingerprint.page_size
        out = []
        for toks in entries.tokens:
            keys = page_keys(ns, toks)
            n = len(keys)
            if reg is not None:
                if deadline.left() <= 0:
                    break
                n = self.batch_exists(keys, pool=reg.kind, timeout_s=deadline.left())
            if n:
                out.append(StoredPrefix(toks[: n * P], n, tuple(keys[:n])))
        return longest_first(out)

    # ---- admin ---------------------------------------------------------------------------------
    def clear(self, *, timeout_s: float | None = None) -> None:
        """Delete everything of this fingerprint, within ``timeout_s`` (or ``list_timeout_s``);
        backend errors raise (an admin call: the caller must know it did not happen)."""
        self._io.delete_tree(self._base, self._deadline(timeout_s, self.config.list_timeout_s))
        if self._lru is not None:
            self._lru.rescan()

    def stats(self) -> StorageStats:
        with self._lock:
            c = dict(self._counters)
            corrupt = dict(self._corrupt)
        used = self._lru.tracked_bytes() if self._lru is not None else -1
        return StorageStats(**c, corrupt_by_reason=corrupt, used_bytes=used, retries=self._io.retried,
                            breaker_opens=self.breaker.opens, breaker_state=self.breaker.state.value)

    def close(self, *, timeout_s: float | None = None) -> bool:
        """Stop; wait up to ``timeout_s`` (or ``close_timeout_s``) for operations in flight, then
        abandon or cancel them. Idempotent; True if nothing was left running."""
        if self._closed:
            return True
        self._closed = True
        return self._io.close(self.config.close_timeout_s if timeout_s is None else timeout_s)

    def __repr__(self) -> str:
        pools = {k.value: r.ppo for k, r in self._pools.items()}
        return f"FsspecStorage({self.url!r}, model={self.fingerprint.model_id!r}, pages_per_object={pools})"


class _Leading:
    """``chunking.LeadingPages`` over one call's queries (``leading_index``): the folders are listed
    in ``resolve``'s probe round; ``find`` reads at most ``leading_index.MAX_CANDIDATES`` listed
    entries per folder and checks their objects' existence, together in one round, within half the
    call's time left and the existence bound."""

    def __init__(self, store: FsspecStorage, queries: list[_Transfer], deadline: Deadline) -> None:
        self.store, self.queries, self.deadline = store, queries, deadline

    def folder(self, t: int, start: int) -> str | None:
        q = self.queries[t]
        first_key = None if q.reg.chunking.named else q.key_at(start)
        return None if first_key is None else q.reg.chunking.index_dir(first_key)

    def find(self, asks: list[tuple[int, int, int]], listed: list[Any]) -> list[ObjectRef | None]:
        st = self.store
        cands: list[tuple[int, str, str]] = []  # (ask, first key, last key)
        for a, ((t, start, _), paths) in enumerate(zip(asks, listed)):
            if isinstance(paths, BaseException):  # a failed listing: no leading pages (counted)
                st._count_exc(paths, on_root=True)
                continue
            q = self.queries[t]
            # objects ending inside the query were probed by name already
            own = {q.keys[p - q.first] for p in range(max(start, q.first), min(start + q.reg.ppo, q.first + len(q.keys)))}
            first_key = q.key_at(start)
            assert first_key is not None  # (``folder`` named it)
            cands += [(a, first_key, lk) for lk in leading_index.candidates(paths, own)]
        best: list[ObjectRef | None] = [None] * len(asks)
        if not cands:
            return best
        items = []
        for a, fk, lk in cands:
            reg = self.queries[asks[a][0]].reg
            items += [IoItem(IoKind.READ, reg.chunking.index_path(fk, lk),
                             functools.partial(leading_index.decode, first_key=fk, last_key=lk, max_pages=reg.ppo)),
                      IoItem(IoKind.EXISTS, reg.chunking.path(lk))]
        st._count(index_reads=len(cands))
        end = Deadline(min(self.deadline.left() / 2, st._exists_timeout()))
        out = st._io.mixed([it._replace(end=end) for it in items], self.deadline)
        for i, (a, _, lk) in enumerate(cands):
            keys, there = out[2 * i], out[2 * i + 1]
            if isinstance(keys, BaseException):
                st._count_exc(keys)
                continue
            if not st._flag(there) or keys is None:  # a dangling or bad entry: no candidate
                continue
            t, start, have = asks[a]
            q = self.queries[t]
            use = leading_index.matching(keys, q.keys, start - q.first)
            b = best[a]
            if use > have and (b is None or use > b.stop() - start):
                best[a] = ObjectRef(t, start, len(keys), lk, q.reg.chunking.path(lk), use if use < len(keys) else 0)
        st._count(index_hits=sum(b is not None for b in best))
        return best


def _scheme_and_options(url: str, storage_options: Any) -> tuple[str, dict[str, Any]]:
    """The URL's storage scheme (a chained URL's innermost: ``faulty::gs://...`` is gs) and the
    fsspec options with that scheme's defaults (gs://: no instance or listings cache, so other
    replicas' writes are seen); a chained URL's options are keyed by protocol."""
    protocols = url.split("://", 1)[0].split("::") if "://" in url else ["file"]
    scheme = protocols[-1]
    opts = dict(storage_options)
    if scheme in ("gs", "gcs"):
        inner = opts if len(protocols) == 1 else dict(opts.get(scheme) or {})
        inner.setdefault("skip_instance_cache", True)
        inner.setdefault("use_listings_cache", False)
        if len(protocols) > 1:
            opts[scheme] = inner
    return scheme, opts


def _as_object(data: np.ndarray) -> tuple[bytes, np.ndarray]:
    """``(header, payload)`` of an object stored as ``data`` alone."""
    return b"", data


def _with_header(header: Any, pages: Any) -> tuple[bytes, np.ndarray]:
    """``(header(payload), payload)`` of the pages ``pages()`` returns; ``header``: an object's
    ``HeaderEncoder.encode`` with its key and position bound."""
    data = pages()
    return header(data.reshape(-1).view(np.uint8)), data
