"""``FsspecStorage``: the one ``HiCacheStorage`` implementation, over fsspec by URL.

Schemes
-------
- ``file://DIR`` — embedded default. Write-once: the object is written to a unique temp name in
  its directory, then published with ``os.link`` (fails if the name exists), so concurrent
  writers (threads or processes) leave exactly one complete object and readers never see a torn
  one (fsspec's own ``LocalFileSystem.pipe_file(mode="create")`` is exists-then-write, which is
  neither). Optional byte cap (``StorageConfig.max_bytes``) with LRU
  eviction. No fsync: a cache; a crash can lose objects, and anything damaged fails its checksum
  and is a miss.
- ``memory://NAME`` — tests. ``pipe_file(mode="create")`` (per process).
- ``gs://BUCKET/PREFIX`` — gcsfs. ``pipe_file(mode="create")`` → ``ifGenerationMatch=0``
  (412 → ``FileExistsError``). Async batched I/O on gcsfs' loop; the instance and listings caches
  are off (``skip_instance_cache=True``, ``use_listings_cache=False``) so other replicas' writes
  are seen.
  Any other fsspec URL works through the generic sync (threads) or async path.

Every scheme resolves, reads and writes the same objects by the same rules, so the same writes give
the same hits on every scheme.

Object names (topology-free, content-addressed)::

    {root}/v{FORMAT_VERSION}/{fingerprint[:16]}/{pool}/{shard.tag()}/c{C}/{key[0]}/{key}
    {root}/v{FORMAT_VERSION}/{fingerprint[:16]}/manifest/{namespace[0]}/{namespace[:32]}-{tokens_tag}

Sixteen directories per pool and sixteen for the manifest (the first hex digit of the name). A
namespace's manifest entries are the names with its prefix in one of the sixteen directories (one
listing of that directory).

Chunking rule (``C`` = pages per object, per pool; default ``target_object_bytes // slot_bytes``)
------------------------------------------------------------------------------------------------
Chunks are aligned to absolute page positions in the chain: chunk ``j`` covers pages
``[jC, (j+1)C)``. Every sequence that shares a prefix therefore shares chunk boundaries. An object
holds pages ``[jC, jC+m)``, ``1 <= m <= C`` and is named by the key of its last page
``jC+m-1`` (the key fixes the position, so ``m`` is implied). ``C`` is in the path, so stores with
different chunk sizes never misread each other.

- Write (``batch_set``): ``first_page`` must be a multiple of ``C``. Every full chunk is written;
  the tail of a sequence that ends mid-chunk is written as a partial object of ``m < C`` pages
  (``write_partial_chunks``). Objects already present are skipped (one batched existence check).
- Read (``batch_exists`` / ``batch_get``), prefix-ordered: for each chunk in order the natural
  candidate is the object ending at ``min(chunk end, query end)``. At the first chunk whose natural
  candidate is missing, the shorter partial objects of that chunk that lie inside the query are
  probed (one batched round, at most ``C-1`` names) and the longest one extends the hit.
  Consequences: (a) a prefix stored mid-chunk (partial object) is found by any later *longer*
  query through the probe; (b) a later *shorter* query that ends inside a chunk stored only as a
  full object cannot name that object (its name is the key of a page beyond the query) and loses
  at most ``C-1`` pages; (c) the later longer sequence writes the full chunk, the partial object
  stays until evicted (bounded duplication, ``<= C-1`` pages per sequence).

gs:// capacity: bucket lifecycle rules (not enforced by this code)
------------------------------------------------------------------
Objects are immutable and content-addressed, so deleting any of them is always safe (a later
request recomputes and rewrites). Recommended bucket configuration for ``gs://BUCKET/PREFIX``:

- ``Delete`` with ``condition: {age: N, matchesPrefix: ["PREFIX/v1/"]}``: ``N`` days after creation
  (GCS cannot cheaply track reads, so this is FIFO, not LRU; pick ``N`` from the reuse horizon,
  e.g. 7). Optionally ``SetStorageClass`` → ``NEARLINE`` earlier; reads there cost more.
- Manifest entries (``.../manifest/``) may keep a longer age: they are tiny, and entries whose
  pages were deleted are trimmed by ``list_prefixes(verify=True)``.
- Old formats / fingerprints: delete ``PREFIX/v{old}/`` or ``PREFIX/v1/{fingerprint}/`` prefixes.
- Disable object versioning and soft delete on the cache bucket (every delete would otherwise keep
  billable noncurrent bytes); new buckets ramp to ~1000 writes/s, hence multi-MiB objects.

Threads. Calls may come from several threads. Backend I/O runs on this object's thread pool (or
on gcsfs' event loop). The host pool is touched on the calling thread, or, for pools that
declare ``concurrent_slot_io`` / ``concurrent_slot_reads``, by the I/O threads on disjoint slots
and only until the call returns (``_CallGuard``). Every call has a deadline
(``StorageConfig.timeout_s`` or ``timeout_s=``): operations not finished by then are abandoned
(counted in ``timeouts``) and their pages report ``False``. A hung sync backend keeps its worker
threads until it returns; later calls still return by their deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import functools
import hashlib
import itertools
import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import fsspec
import numpy as np
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.local import LocalFileSystem
from hicache.storage.base import (
    HiCacheStorage,
    HostPool,
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
from hicache.storage.format import (
    FORMAT_VERSION,
    CorruptObjectError,
    HeaderEncoder,
    ObjectKind,
    ObjectMeta,
    decode,
)
from hicache.storage.keys import (
    ModelFingerprint,
    Namespace,
    ShardCoord,
    _as_tokens,
    check_key,
    page_keys,
)

MiB = 1 << 20
DEFAULT_TARGET_OBJECT_BYTES: Mapping[str, int] = {"file": 4 * MiB, "local": 4 * MiB, "memory": 1 * MiB, "gs": 16 * MiB, "gcs": 16 * MiB}
_FALLBACK_TARGET_OBJECT_BYTES = 8 * MiB
_TMP_PREFIX = ".tmp-"
_TMP_TOKEN = secrets.token_hex(4)  # temp file names: unique across hosts sharing a directory
_TMP_SEQ = itertools.count()  # next() is atomic under the GIL


@dataclasses.dataclass(frozen=True)
class StorageConfig:
    timeout_s: float = 30.0  # default deadline of one call (exists/get/set)
    io_threads: int = 8  # sync backends: worker threads; async: max concurrent requests / 4
    max_pending_ops: int | None = None  # sync backends: cap on abandoned, still-running ops (8 * io_threads)
    target_object_bytes: int | None = None  # None → DEFAULT_TARGET_OBJECT_BYTES[scheme]
    pages_per_object: int | None = None  # overrides target_object_bytes for every pool
    write_partial_chunks: bool = True  # store the tail of a sequence that ends mid-chunk
    max_bytes: int | None = None  # file:// only: byte cap over the whole root, LRU eviction
    evict_low_watermark: float = 0.9  # evict down to this fraction of max_bytes
    max_inflight_bytes: int = 256 * MiB  # batch_set gathers from the pool in groups this large
    delete_corrupt: bool = True  # remove objects that fail verification so they can be rewritten
    storage_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if self.io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {self.io_threads!r}")
        for name in ("target_object_bytes", "pages_per_object", "max_bytes"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        if not 0.0 < self.evict_low_watermark <= 1.0:
            raise ValueError(f"evict_low_watermark must be in (0, 1], got {self.evict_low_watermark!r}")


# ---------------------------------------------------------------------------------------------
# Backends: a few primitives per filesystem family. Results are values or exception instances.
# ---------------------------------------------------------------------------------------------


def _manifest_tag(seed: bytes, tokens: np.ndarray) -> str:
    """A manifest entry's name tag: SHA-256 of the namespace seed and the entry's tokens (int64 LE),
    hex. One hash over the tokens, not the chain's page by page (the name only has to be a pure
    function of the entry: equal entries share one write-once name, and a reader checks the
    content it lists against it)."""
    return hashlib.sha256(seed + tokens.astype("<i8", copy=False).tobytes()).hexdigest()


def _write_all(fd: int, header: bytes, payload: np.ndarray) -> None:
    """Header then payload into the open file ``fd`` (closed here)."""
    with os.fdopen(fd, "wb") as f:
        f.write(header)
        f.write(memoryview(payload.reshape(-1).view(np.uint8)))


def _object_bytes(header: bytes, payload: np.ndarray) -> bytes:
    """Header + payload as one ``bytes`` for backends that take a whole object: one copy of the
    payload (``header + payload.tobytes()`` would copy it twice)."""
    return b"".join((header, memoryview(payload.reshape(-1).view(np.uint8))))


class _Deadline:
    def __init__(self, timeout_s: float) -> None:
        self.end = time.monotonic() + timeout_s

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())


class _Backend:
    """Thread-pool execution of per-path sync primitives (generic fsspec sync filesystems)."""

    def __init__(self, fs: Any, threads: int, max_pending: int | None = None) -> None:
        self.fs = fs
        self._threads = threads
        self._ex = cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hicache-l3")
        # Admission control: operations abandoned at a deadline and still running. A hung
        # backend accumulates them; past the cap, new calls fail fast instead of queueing
        # without bound (and holding their payloads) behind the stuck ones.
        self._max_abandoned = max_pending or threads * 8
        self._abandoned = 0
        self._plock = threading.Lock()

    # per-path primitives (run on worker threads) -------------------------------------------
    def _exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def _read(self, path: str) -> bytes | bytearray | memoryview:
        return self.fs.cat_file(path)

    def _write_once(self, path: str, header: bytes, payload: np.ndarray) -> bool:
        try:
            self.fs.pipe_file(path, _object_bytes(header, payload), mode="create")
        except FileExistsError:
            return False
        return True

    def _delete(self, path: str) -> None:
        self.fs.rm_file(path)

    def list_files(self, prefix: str) -> list[str]:
        try:
            return [p for p in self.fs.find(prefix) if not os.path.basename(p).startswith(_TMP_PREFIX)]
        except FileNotFoundError:
            return []

    def delete_tree(self, prefix: str) -> None:
        try:
            if self.fs.exists(prefix):
                self.fs.rm(prefix, recursive=True)
        except FileNotFoundError:
            pass

    # batch forms ---------------------------------------------------------------------------
    def map(self, fn: Callable[..., Any], items: Sequence[tuple], deadline: _Deadline) -> Iterator[tuple[int, Any]]:
        """Yield ``(index, result or exception)`` as completed; ``TimeoutError`` at the deadline."""
        with self._plock:
            saturated = self._abandoned >= self._max_abandoned
        if saturated:
            for i in range(len(items)):
                yield i, BlockingIOError("storage backend saturated: too many abandoned operations")
            return
        futs = {self._ex.submit(fn, *it): i for i, it in enumerate(items)}
        seen: set[int] = set()
        try:
            for f in cf.as_completed(futs, timeout=deadline.left()):
                i = futs[f]
                seen.add(i)
                exc = f.exception()
                yield i, (exc if exc is not None else f.result())
        except cf.TimeoutError:
            pass
        for f, i in futs.items():
            if i not in seen:  # abandoned: it still runs (harmlessly) in the background; not
                # cancelled, because a cancelled item would sit in the executor queue uncounted
                with self._plock:
                    self._abandoned += 1
                f.add_done_callback(self._release)
                yield i, TimeoutError(f"storage operation {i} did not finish by the deadline")

    def _release(self, _: cf.Future) -> None:
        with self._plock:
            self._abandoned -= 1

    def exists_many(self, paths: Sequence[str], deadline: _Deadline) -> list[Any]:
        out: list[Any] = [None] * len(paths)
        for i, r in self.map(self._exists, [(p,) for p in paths], deadline):
            out[i] = r
        return out

    def read_many(
        self, paths: Sequence[str], post: Callable[[int, Any], Any], deadline: _Deadline
    ) -> Iterator[tuple[int, Any]]:
        """Read each path and apply ``post(i, bytes)`` on the worker (verification)."""

        def task(i: int, p: str) -> Any:
            return post(i, self._read(p))

        return self.map(task, list(enumerate(paths)), deadline)

    def write_many(self, items: Sequence[tuple[str, Callable[[], tuple[bytes, np.ndarray]]]], deadline: _Deadline) -> Iterator[tuple[int, Any]]:
        """``items``: (path, make) where ``make()`` → (header, payload) runs on the worker."""

        def task(p: str, make: Callable[[], tuple[bytes, np.ndarray]]) -> bool:
            header, payload = make()
            return self._write_once(p, header, payload)

        return self.map(task, items, deadline)

    def delete_many(self, paths: Sequence[str], deadline: _Deadline) -> list[Any]:
        out: list[Any] = [None] * len(paths)
        for i, r in self.map(self._delete, [(p,) for p in paths], deadline):
            out[i] = r
        return out

    def close(self) -> None:
        self._ex.shutdown(wait=False, cancel_futures=True)


class _LocalBackend(_Backend):
    """Local directory: write-once through a temp file published with ``os.link`` (fsspec's
    ``LocalFileSystem.pipe_file(mode="create")`` is exists-then-write: two writers could both
    write, and a reader could see a partial object)."""

    @staticmethod
    def _create_tmp(d: str) -> tuple[int, str]:
        """A new, exclusively created temp file in directory ``d`` (created if missing), named
        unique per process (pid, a random token, a counter; ``O_EXCL`` settles the rest)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        made = False
        for _ in range(100):
            tmp = f"{d}/{_TMP_PREFIX}{os.getpid()}-{_TMP_TOKEN}-{next(_TMP_SEQ)}"
            try:
                return os.open(tmp, flags, 0o644), tmp
            except FileNotFoundError:  # first object of this directory (or the tree was cleared)
                if made:
                    raise
                os.makedirs(d, exist_ok=True)
                made = True
            except FileExistsError:
                continue
        raise FileExistsError(f"no free temp file name in {d}")

    def _write_once(self, path: str, header: bytes, payload: np.ndarray) -> bool:
        """The object written to a temp file in its directory, then linked to its name: the link
        fails if another writer published first (False), and a reader sees the whole object or
        none."""
        fd, tmp = self._create_tmp(path.rpartition("/")[0])
        try:
            _write_all(fd, header, payload)
            try:
                os.link(tmp, path)  # atomic; FileExistsError if another writer won
            except FileExistsError:
                return False
            except OSError:  # no hard links on this filesystem: an atomic rename, unless stored
                if os.path.exists(path):
                    return False
                os.replace(tmp, path)
                tmp = ""
            return True
        finally:
            if tmp:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass

    def _delete(self, path: str) -> None:
        os.unlink(path)

    def list_files(self, prefix: str) -> list[str]:
        out = []
        for d, _, files in os.walk(prefix):
            out += [os.path.join(d, f) for f in files if not f.startswith(_TMP_PREFIX)]
        return out

    def delete_tree(self, prefix: str) -> None:
        import shutil

        shutil.rmtree(prefix, ignore_errors=True)


class _AsyncBackend(_Backend):
    """Async fsspec filesystems (gcsfs): coroutines gathered on the filesystem's loop."""

    def __init__(self, fs: Any, threads: int, max_pending: int | None = None) -> None:
        super().__init__(fs, 1)
        self._limit = threads * 4  # concurrent requests; pending ones are cancelled at the deadline

    def _amap_sync(self, make_coro: Callable[..., Any], items: Sequence[tuple], deadline: _Deadline) -> list[Any]:
        if not items:
            return []
        limit = self._limit

        async def run() -> list[Any]:
            sem = asyncio.Semaphore(limit)

            async def one(it: tuple) -> Any:
                async with sem:
                    return await make_coro(*it)

            tasks = [asyncio.ensure_future(one(it)) for it in items]
            done, pending = await asyncio.wait(tasks, timeout=deadline.left())
            for t in pending:
                t.cancel()
            out = []
            for t in tasks:
                if t in done:
                    exc = t.exception()
                    out.append(exc if exc is not None else t.result())
                else:
                    out.append(TimeoutError("storage operation did not finish by the deadline"))
            return out

        try:
            return fsspec.asyn.sync(self.fs.loop, run, timeout=deadline.left() + 5.0)
        except Exception as e:  # loop stuck or gone: every item fails
            return [e] * len(items)

    def map(self, fn: Callable[..., Any], items: Sequence[tuple], deadline: _Deadline) -> Iterator[tuple[int, Any]]:
        async def call(*args: Any) -> Any:  # only used for coroutine functions
            return await fn(*args)

        return iter(enumerate(self._amap_sync(call, items, deadline)))

    def exists_many(self, paths: Sequence[str], deadline: _Deadline) -> list[Any]:
        return list(dict(self.map(self.fs._exists, [(p,) for p in paths], deadline)).values())

    def read_many(self, paths, post, deadline):  # type: ignore[override]
        async def task(i: int, p: str) -> Any:
            return post(i, await self.fs._cat_file(p))

        return self.map(task, list(enumerate(paths)), deadline)

    def write_many(self, items, deadline):  # type: ignore[override]
        async def task(p: str, make: Callable[[], tuple[bytes, np.ndarray]]) -> bool:
            header, payload = make()
            try:
                await self.fs._pipe_file(p, _object_bytes(header, payload), mode="create")
            except FileExistsError:
                return False
            return True

        return self.map(task, items, deadline)

    def delete_many(self, paths: Sequence[str], deadline: _Deadline) -> list[Any]:
        return list(dict(self.map(self.fs._rm_file, [(p,) for p in paths], deadline)).values())


def _make_backend(fs: Any, threads: int, max_pending: int | None) -> _Backend:
    if isinstance(fs, LocalFileSystem):
        return _LocalBackend(fs, threads, max_pending)
    if isinstance(fs, AsyncFileSystem):
        return _AsyncBackend(fs, threads, max_pending)
    return _Backend(fs, threads, max_pending)


# ---------------------------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------------------------


class _CallGuard:
    """Pool access of one call from I/O threads (many at once) stops for good when the call
    returns: ``close`` waits for copies in progress, later ``enter`` fails."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._active = 0
        self._closed = False

    def __enter__(self) -> None:
        with self._cv:
            if self._closed:
                raise TimeoutError("the call returned before this object reached the host pool")
            self._active += 1

    def __exit__(self, *exc: object) -> None:
        with self._cv:
            self._active -= 1
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.wait_for(lambda: self._active == 0)


def _concurrent_io(pool: HostPool) -> bool:
    """Pools that declare ``concurrent_slot_io = True`` are read/written from I/O threads
    (disjoint slots, concurrently); others only from the calling thread."""
    return bool(getattr(pool, "concurrent_slot_io", False))


def _concurrent_reads(pool: HostPool) -> bool:
    """Pools whose slots I/O threads may read during a call (``concurrent_slot_io``, or
    ``concurrent_slot_reads`` for a pool written only on the calling thread)."""
    return _concurrent_io(pool) or bool(getattr(pool, "concurrent_slot_reads", False))


_NO_SLOTS = np.zeros(0, np.int32)  # batch_exists' queries carry no slots (read-only, shared)


class _Candidates(Sequence):
    """A read-only sequence whose items (``make(m)`` for ``m`` in ``ms``) are made on access."""

    def __init__(self, make: Callable[[int], Any], ms: range) -> None:
        self._make, self._ms = make, ms

    def __len__(self) -> int:
        return len(self._ms)

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        if isinstance(i, slice):
            return _Candidates(self._make, self._ms[i])
        return self._make(self._ms[i])

    def __iter__(self) -> Iterator[Any]:  # (Sequence's own ends on an IndexError, an exception per loop)
        return map(self._make, self._ms)


def _with_header(header: Callable[[Any], bytes], gather: Callable[[], np.ndarray]) -> tuple[bytes, np.ndarray]:
    """``(header(payload), payload)`` of the pages ``gather()`` returns; ``header``: an object's
    ``HeaderEncoder.encode`` with its key and position bound."""
    data = gather()
    return header(data.reshape(-1).view(np.uint8)), data


@dataclasses.dataclass(frozen=True)
class _PoolReg:
    pool: HostPool
    shard: ShardCoord
    kind: PoolKind
    ppo: int  # pages per object
    dtype_name: str
    prefix: str  # directory of this pool's objects
    header: HeaderEncoder  # this pool's object headers
    shape: tuple[int, ...]  # per-page shape (the pool's ``slot_shape``)
    slot_bytes: int  # bytes per page

    def object_bytes(self, m: int) -> int:
        return self.header.header_len + m * self.slot_bytes


class _Obj(NamedTuple):
    """One object = pages [start, start+m) of a chain; ``key`` names its last page. (A tuple: a
    query builds one per chunk and probe, a frozen dataclass costs ~10x more to make.)"""

    t: int  # transfer index
    start: int
    m: int
    key: str
    path: str


class FsspecStorage(HiCacheStorage):
    """L3 over one fsspec URL for one model fingerprint; one instance per host process."""

    def __init__(
        self,
        url: str,
        fingerprint: ModelFingerprint,
        config: StorageConfig | None = None,
        *,
        fs: Any = None,
    ) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError(f"url must be a non-empty str, got {url!r}")
        if not isinstance(fingerprint, ModelFingerprint):
            raise TypeError(f"fingerprint must be a ModelFingerprint, got {type(fingerprint).__name__}")
        config = StorageConfig() if config is None else config
        if not isinstance(config, StorageConfig):
            raise TypeError(f"config must be a StorageConfig, got {type(config).__name__}")
        scheme = url.split("://", 1)[0] if "://" in url else "file"
        opts = dict(config.storage_options)
        if scheme in ("gs", "gcs"):
            opts.setdefault("skip_instance_cache", True)
            opts.setdefault("use_listings_cache", False)
        if fs is None:
            fs, root = fsspec.core.url_to_fs(url, **opts)
        else:
            root = fs._strip_protocol(url)
        if config.max_bytes is not None and not isinstance(fs, LocalFileSystem):
            raise ValueError(f"max_bytes (LRU byte cap) is only supported for file:// urls, got {url!r}")
        self.url = url
        self.scheme = scheme
        self.fingerprint = fingerprint
        self.config = config
        self._fp = fingerprint.digest()
        self._root = root.rstrip("/")
        self._base = f"{self._root}/v{FORMAT_VERSION}/{fingerprint.hexdigest()[:16]}"
        self._io = _make_backend(fs, config.io_threads, config.max_pending_ops)
        self._local = isinstance(self._io, _LocalBackend)
        if isinstance(self._io, _LocalBackend):
            os.makedirs(self._root, exist_ok=True)
        self._target = config.target_object_bytes or DEFAULT_TARGET_OBJECT_BYTES.get(scheme, _FALLBACK_TARGET_OBJECT_BYTES)
        self._pools: dict[PoolKind, _PoolReg] = {}
        self._manifest_header = HeaderEncoder(ObjectKind.MANIFEST, self._fp, "int64", ())
        self._lock = threading.Lock()
        self._counters: dict[str, int] = {f.name: 0 for f in dataclasses.fields(StorageStats) if f.name not in ("corrupt_by_reason", "used_bytes")}
        self._corrupt: dict[str, int] = {}
        # file:// LRU index: path -> (size, mtime_ns); built lazily, refreshed when over the cap.
        self._index: dict[str, tuple[int, int]] | None = None
        self._used = 0
        self._closed = False

    # ---- helpers -----------------------------------------------------------------------------
    def _count(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self._counters[k] += v

    def _timeout(self, timeout_s: float | None) -> _Deadline:
        if timeout_s is None:
            return _Deadline(self.config.timeout_s)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number or None, got {timeout_s!r}")
        return _Deadline(float(timeout_s))

    def _reg(self, kind: object) -> _PoolReg:
        reg = self._pools.get(kind) if type(kind) is PoolKind else None  # type: ignore[arg-type]
        if reg is not None:  # (the usual call: a registered PoolKind, no enum lookup)
            return reg
        k = check_pool_kind(kind)
        reg = self._pools.get(k)
        if reg is None:
            raise ValueError(f"no host pool registered for pool kind {k.value!r}; call register_host_pool first")
        return reg

    def _path(self, reg: _PoolReg, key: str) -> str:
        return f"{reg.prefix}/{key[0]}/{key}"

    def _meta(self, reg: _PoolReg, start: int, m: int, key: str) -> ObjectMeta:
        return ObjectMeta(ObjectKind.PAGES, self._fp, bytes.fromhex(key), start, m, reg.dtype_name, reg.shape)

    def _check_transfers(self, transfers: object, *, for_set: bool) -> list[tuple[_PoolReg, list[str], np.ndarray, int]]:
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
            if for_set and first % reg.ppo:
                raise ValueError(
                    f"first_page={first} is not a multiple of pages_per_object={reg.ppo} for pool "
                    f"{reg.kind.value!r}; batch_set must start at a chunk boundary"
                )
            if not for_set and len(np.unique(slots)) != len(slots):
                raise ValueError(f"transfers[{ti}].host_slots has duplicate slots: {slots.tolist()}")
            out.append((reg, keys, slots, first))
        return out

    # ---- pools -------------------------------------------------------------------------------
    def register_host_pool(
        self,
        pool: HostPool,
        *,
        shard: ShardCoord,
        kind: PoolKind = PoolKind.KV,
        pages_per_object: int | None = None,
    ) -> None:
        kind = check_pool_kind(kind)
        if not isinstance(pool, HostPool):
            raise TypeError(f"pool must implement HostPool (read_slots, write_slots, slot_shape, dtype, slot_bytes), got {type(pool).__name__}")
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
        ppo = pages_per_object or self.config.pages_per_object or max(1, self._target // int(pool.slot_bytes))
        prefix = f"{self._base}/{kind.value}/{shard.tag()}/c{ppo}"
        header = HeaderEncoder(ObjectKind.PAGES, self._fp, dtype.name, shape)
        self._pools[kind] = _PoolReg(pool, shard, kind, ppo, dtype.name, prefix, header, shape, int(pool.slot_bytes))

    def pages_per_object(self, kind: PoolKind = PoolKind.KV) -> int:
        return self._reg(kind).ppo

    def object_path(self, key: str, *, pool: PoolKind = PoolKind.KV) -> str:
        """Backend path of the object named ``key`` (admin, debugging, tests)."""
        return self._path(self._reg(pool), check_key(key))

    @property
    def fs(self) -> Any:
        """The underlying fsspec filesystem."""
        return self._io.fs

    # ---- resolution ----------------------------------------------------------------------------
    def _naturals(self, t: int, reg: _PoolReg, keys: list[str], first: int) -> list[_Obj]:
        """Natural candidate object of every chunk intersecting the query, in order."""
        return list(self._iter_naturals(t, reg, keys, first))

    def _iter_naturals(self, t: int, reg: _PoolReg, keys: list[str], first: int) -> Iterator[_Obj]:
        for start, m in self._spans(reg, len(keys), first):
            yield self._obj(t, reg, keys, first, start, m)

    @staticmethod
    def _spans(reg: _PoolReg, n: int, first: int) -> Iterator[tuple[int, int]]:
        """``(start, pages)`` of the natural candidate of every chunk intersecting pages
        ``[first, first + n)``, in order (no key read: ``keys`` may be lazy)."""
        C = reg.ppo
        if n == 0:
            return
        for j in range(first // C, (first + n - 1) // C + 1):
            s = j * C
            yield s, min(s + C, first + n) - s

    def _obj(self, t: int, reg: _PoolReg, keys: Sequence[str], first: int, start: int, m: int) -> _Obj:
        """The object holding pages ``[start, start + m)`` (named by the key of its last page)."""
        k = keys[start + m - 1 - first]
        return _Obj(t, start, m, k, self._path(reg, k))

    def _partials(self, t: int, reg: _PoolReg, keys: list[str], first: int, start: int, m: int,
                  min_pages: int = 1) -> Sequence[_Obj]:
        """Objects of the chunk at ``start`` shorter than ``m`` pages that end inside the query at
        its page ``min_pages - 1`` or later (a shorter hit is of no use to the caller), longest first
        (made on access: a probe usually asks a few of them)."""
        shortest = max(1, first + min_pages - start)
        return _Candidates(lambda mm: self._obj(t, reg, keys, first, start, mm), range(m - 1, shortest - 1, -1))

    def _exists_flags(self, objs: Sequence[_Obj], deadline: _Deadline) -> list[bool]:
        res = self._io.exists_many([o.path for o in objs], deadline)
        flags = []
        for r in res:
            if isinstance(r, BaseException):
                self._count_exc(r)
                flags.append(False)
            else:
                flags.append(bool(r))
        return flags

    def _count_exc(self, e: BaseException) -> None:
        if isinstance(e, TimeoutError) or type(e).__name__ in ("FSTimeoutError",):
            self._count(timeouts=1)
        elif not isinstance(e, FileNotFoundError):
            self._count(errors=1)

    def _resolve(self, queries: list[tuple[_PoolReg, list[str], np.ndarray, int]], deadline: _Deadline,
                 min_pages: int = 1) -> list[list[_Obj]]:
        """Objects that cover the longest stored prefix of each query (≤ 2 batched rounds).
        ``min_pages`` (``batch_exists``): shorter partial objects that would end a hit before the
        query's page ``min_pages - 1`` are not asked about (the answer is then short of
        ``min_pages`` anyway)."""
        nats = [self._naturals(t, reg, keys, first) for t, (reg, keys, _, first) in enumerate(queries)]
        flat = [o for ns in nats for o in ns]
        flags = iter(self._exists_flags(flat, deadline))
        found: list[list[_Obj]] = []
        probes: list[tuple[int, list[_Obj]]] = []
        for t, ns in enumerate(nats):
            fl = [next(flags) for _ in ns]
            cut = fl.index(False) if False in fl else len(ns)
            found.append(ns[:cut])
            if cut < len(ns):
                reg, keys, _, first = queries[t]
                parts = self._partials(t, reg, keys, first, ns[cut].start, ns[cut].m, min_pages)
                if parts:
                    probes.append((t, parts))
        if probes:
            pflat = [o for _, ps in probes for o in ps]
            pflags = iter(self._exists_flags(pflat, deadline))
            for t, ps in probes:
                fl = [next(pflags) for _ in ps]
                if True in fl:
                    found[t].append(ps[fl.index(True)])
        return found

    # ---- data path -----------------------------------------------------------------------------
    def batch_exists(
        self,
        keys: Sequence[str],
        *,
        first_page: int = 0,
        pool: PoolKind = PoolKind.KV,
        timeout_s: float | None = None,
        min_pages: int = 1,
    ) -> int:
        reg = self._reg(pool)
        keys = check_keys(keys)
        first = check_first_page(first_page)
        least = check_min_pages(min_pages)
        deadline = self._timeout(timeout_s)
        self._count(exists_calls=1)
        if len(keys) < least:  # no hit could reach min_pages (also: no keys)
            return 0
        objs = self._resolve([(reg, keys, _NO_SLOTS, first)], deadline, least)[0]
        if not objs:
            return 0
        return objs[-1].start + objs[-1].m - first

    def exists(self, key: str, page_index: int, *, pool: PoolKind = PoolKind.KV) -> bool:
        reg = self._reg(pool)
        check_key(key)
        check_first_page(page_index)
        r = self._io.exists_many([self._path(reg, key)], self._timeout(None))[0]
        if isinstance(r, BaseException):
            self._count_exc(r)
            return False
        return bool(r)

    def batch_get_pools(self, transfers: Sequence[PoolTransfer], *, timeout_s: float | None = None) -> list[list[bool]]:
        queries = self._check_transfers(transfers, for_set=False)
        deadline = self._timeout(timeout_s)
        self._count(get_calls=1)
        results = [[False] * len(keys) for _, keys, _, _ in queries]
        guard = _CallGuard()
        try:
            objs = [o for os_ in self._resolve(queries, deadline) for o in os_]
            for o, r in zip(objs, self._read_objs(queries, objs, guard, deadline)):
                self._apply_read(queries, results, o, r, deadline)
        finally:
            guard.close()  # from here on no I/O thread touches the pool for this call
        for r in results:  # only the contiguous prefix counts
            if False in r:
                cut = r.index(False)
                r[cut:] = [False] * (len(r) - cut)
        hits = sum(sum(r) for r in results)
        self._count(hit_pages=hits, miss_pages=sum(len(r) for r in results) - hits)
        return results

    def _read_objs(self, queries, objs: list[_Obj], guard: _CallGuard, deadline: _Deadline) -> list[Any]:  # type: ignore[no-untyped-def]
        """Read and verify ``objs`` concurrently. Per object: the object's size (its pages are in
        the pool: pools with concurrent slot I/O are written on the I/O threads), a verified
        payload view (to scatter on the calling thread) or an exception (``FileNotFoundError``:
        missing)."""
        out: list[Any] = [None] * len(objs)

        def post(i: int, raw: Any) -> Any:
            o = objs[i]
            reg = queries[o.t][0]
            payload = decode(raw, self._meta(reg, o.start, o.m, o.key), payload_len=o.m * reg.slot_bytes)
            if not _concurrent_io(reg.pool):
                return payload  # scattered on the calling thread
            with guard:  # never touch the pool after the call returned
                self._scatter(queries, o, payload)
            return len(raw)

        for i, r in self._io.read_many([o.path for o in objs], post, deadline):
            out[i] = r
        if self._local and self.config.max_bytes is not None:
            self._touch([o.path for o, r in zip(objs, out) if not isinstance(r, BaseException)])
        return out

    def _touch(self, paths: list[str]) -> None:
        """file:// LRU recency of objects read, in chain order: shallow pages newest."""
        for p, mt in zip(paths, self._write_mtimes(len(paths))):
            try:
                os.utime(p, ns=(mt, mt))
            except OSError:
                pass

    def _scatter(self, queries, o: _Obj, payload: memoryview) -> None:  # type: ignore[no-untyped-def]
        reg, keys, slots, first = queries[o.t]
        lo, hi = max(o.start, first), min(o.start + o.m, first + len(keys))
        pages = np.frombuffer(payload, dtype=np.dtype(reg.pool.dtype)).reshape((o.m, *reg.pool.slot_shape))
        reg.pool.write_slots(slots[lo - first : hi - first], pages[lo - o.start : hi - o.start])

    def _apply_read(self, queries, results, o: _Obj, r: Any, deadline: _Deadline) -> bool:  # type: ignore[no-untyped-def]
        """Account one read result; mark its pages loaded. True if the object was loaded."""
        if isinstance(r, CorruptObjectError):
            self._on_corrupt(o.path, r, deadline)
            return False
        if isinstance(r, BaseException):
            self._count_exc(r)
            return False
        if not isinstance(r, int):
            self._scatter(queries, o, r)  # calling thread, before the call returns
        reg, keys, _, first = queries[o.t]
        for p in range(max(o.start, first), min(o.start + o.m, first + len(keys))):
            results[o.t][p - first] = True
        self._count(objects_read=1, bytes_read=reg.object_bytes(o.m))
        return True

    def _on_corrupt(self, path: str, err: CorruptObjectError, deadline: _Deadline) -> None:
        with self._lock:
            self._counters["corrupt_objects"] += 1
            self._corrupt[err.reason.value] = self._corrupt.get(err.reason.value, 0) + 1
        if self.config.delete_corrupt:
            self._io.delete_many([path], deadline)
            if self._index is not None:
                with self._lock:
                    ent = self._index.pop(path, None)
                    if ent:
                        self._used -= ent[0]

    def batch_set_pools(self, transfers: Sequence[PoolTransfer], *, timeout_s: float | None = None) -> list[list[bool]]:
        queries = self._check_transfers(transfers, for_set=True)
        deadline = self._timeout(timeout_s)
        self._count(set_calls=1)
        results = [[False] * len(keys) for _, keys, _, _ in queries]
        objs: list[_Obj] = []
        for t, (reg, keys, _, first) in enumerate(queries):
            for o in self._naturals(t, reg, keys, first):
                if o.m == reg.ppo or self.config.write_partial_chunks:
                    objs.append(o)
        if not objs:
            return results

        def mark(o: _Obj) -> None:
            first = queries[o.t][3]
            results[o.t][o.start - first : o.start - first + o.m] = [True] * o.m

        flags = self._exists_flags(objs, deadline)
        todo = []
        for o, f in zip(objs, flags):
            if f:
                mark(o)
                self._count(objects_skipped_existing=1)
            else:
                todo.append(o)
        written: list[tuple[int, int, str, int]] = []  # (transfer, start, path, size)
        guard = _CallGuard()
        try:
            self._write_groups(queries, todo, guard, deadline, mark, written)
        finally:
            guard.close()
        self._count(set_pages=sum(sum(r) for r in results))
        if self._local and self.config.max_bytes is not None:
            written.sort()
            self._account([(p, n) for _, _, p, n in written])
        return results

    def _gather(self, reg: _PoolReg, slots: np.ndarray, guard: _CallGuard | None) -> np.ndarray:
        """A contiguous copy of ``slots`` (``guard``: an I/O thread's read, bounded by the call)."""
        if guard is None:
            data = reg.pool.read_slots(slots)
        else:
            with guard:  # never read slots after the call returned (they may be reused)
                data = reg.pool.read_slots(slots)
        want = (len(slots), *reg.pool.slot_shape)
        if not isinstance(data, np.ndarray) or data.shape != want or data.dtype != np.dtype(reg.pool.dtype):
            raise ValueError(
                f"host pool read_slots returned {getattr(data, 'shape', type(data))}/"
                f"{getattr(data, 'dtype', '')}, expected {want}/{np.dtype(reg.pool.dtype)}"
            )
        return np.ascontiguousarray(data)

    def _write_groups(self, queries, todo, guard, deadline, mark, written) -> None:  # type: ignore[no-untyped-def]
        """Gather from the pool in groups bounded by ``max_inflight_bytes``, write each group
        concurrently (write-once: an object another writer published first counts as raced, and
        its pages as stored)."""
        gi = 0
        while gi < len(todo) and deadline.left() > 0:
            group, nbytes = [], 0
            while gi < len(todo):
                o = todo[gi]
                ob = o.m * queries[o.t][0].slot_bytes
                if group and nbytes + ob > self.config.max_inflight_bytes:
                    break
                group.append(o)
                nbytes += ob
                gi += 1
            items = []
            for o in group:
                reg, _, slots, first = queries[o.t]
                sl = slots[o.start - first : o.start - first + o.m]
                header = functools.partial(reg.header.encode, bytes.fromhex(o.key), o.start, o.m)
                if _concurrent_reads(reg.pool):  # gathered on an I/O thread, bounded by the call
                    gather = functools.partial(self._gather, reg, sl, guard)
                else:  # gathered here, on the calling thread
                    gather = functools.partial(lambda data: data, self._gather(reg, sl, None))
                items.append((o.path, functools.partial(_with_header, header, gather)))
            tally: dict[str, int] = {}
            for i, r in self._io.write_many(items, deadline):
                self._record_write(queries, group[i], r, mark, written, tally)
            self._count(**tally)
        for o in todo[gi:]:
            self._count(timeouts=1)

    def _record_write(self, queries, o: _Obj, r: Any, mark, written, tally: dict[str, int]) -> None:  # type: ignore[no-untyped-def]
        """Account one object's write outcome in ``tally`` (counter deltas, applied by the caller
        in one ``_count``): True (written), False (another writer published it first) or an
        exception (the object's pages stay unmarked)."""
        if isinstance(r, BaseException):
            self._count_exc(r)
            return
        mark(o)
        name = "objects_written" if r else "objects_raced"
        tally[name] = tally.get(name, 0) + 1
        if r:
            size = queries[o.t][0].object_bytes(o.m)
            tally["bytes_written"] = tally.get("bytes_written", 0) + size
            written.append((o.t, o.start, o.path, size))

    @staticmethod
    def _write_mtimes(n: int) -> list[int]:
        """file:// LRU timestamps of ``n`` objects in chain order: shallow pages newest (file
        timestamps come from a coarse kernel clock, so write order alone would tie)."""
        now = time.time_ns()
        return [now - i * 1000 for i in range(n)]

    # ---- file:// capacity ------------------------------------------------------------------------
    def _scan(self) -> None:
        """Index of every published object: path -> (bytes, mtime_ns)."""
        idx: dict[str, tuple[int, int]] = {}
        used = 0
        top = f"{self._root}/v{FORMAT_VERSION}"
        now = time.time()
        for d, _, files in os.walk(top):
            if "/manifest" in d[len(top):]:
                continue
            for f in files:
                p = os.path.join(d, f)
                try:
                    st = os.stat(p)
                except FileNotFoundError:
                    continue
                if f.startswith(_TMP_PREFIX):
                    if now - st.st_mtime > 3600:  # crashed writer's leftover
                        try:
                            os.unlink(p)
                        except OSError:
                            pass
                    continue
                idx[p] = (st.st_size, st.st_mtime_ns)
                used += st.st_size
        self._index, self._used = idx, used

    def _account(self, written: list[tuple[str, int]]) -> None:
        """Adds objects just written (in chain order) to the index, then evicts least recently
        used objects down to ``evict_low_watermark`` if the root is over ``max_bytes``."""
        cap = self.config.max_bytes
        assert cap is not None
        self._touch([p for p, _ in written])
        with self._lock:
            if self._index is None:
                self._scan()
            else:
                now = time.time_ns()
                for p, s in written:
                    if p not in self._index:
                        self._used += s
                    self._index[p] = (s, now)
            if self._used <= cap:
                return
            self._scan()  # include other processes' writes, fresh mtimes (read bumps)
            if self._used <= cap:
                return
            goal = int(cap * self.config.evict_low_watermark)
            for p, (size, _) in sorted(self._index.items(), key=lambda kv: kv[1][1]):
                if self._used <= goal:
                    break
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
                except OSError:
                    self._counters["errors"] += 1
                    continue
                del self._index[p]
                self._used -= size
                self._counters["evicted_objects"] += 1
                self._counters["evicted_bytes"] += size

    def used_bytes(self) -> int:
        """Bytes of page objects under the root (file:// only; rescans the directory)."""
        if not self._local:
            raise ValueError(f"used_bytes is only tracked for file:// urls, not {self.url!r}")
        with self._lock:
            self._scan()
            return self._used

    # ---- manifest (warm restart) -----------------------------------------------------------------
    def _manifest_parent(self, first_digit: str = "") -> str:
        """The manifest's directory (``first_digit``: one of its sixteen fan-out directories)."""
        return f"{self._base}/manifest" + (f"/{first_digit}" if first_digit else "")

    def _manifest_name(self, namespace: Namespace) -> tuple[str, str]:
        """(directory, name prefix) of ``namespace``'s manifest entries: ``{prefix}{tokens_tag}``
        (``_manifest_tag``)."""
        h = namespace.hexdigest()
        return self._manifest_parent(h[0]), f"{h[:32]}-"

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
        seed = ns.seed()
        d, name = self._manifest_name(ns)
        path = f"{d}/{name}{_manifest_tag(seed, arr)}"
        make = lambda: (self._manifest_header.encode(seed, 0, len(arr), arr.view(np.uint8)), arr)  # noqa: E731
        for _, r in self._io.write_many([(path, make)], self._timeout(None)):
            if isinstance(r, BaseException):
                self._count_exc(r)
                return False
        return True

    def list_prefixes(self, namespace: Namespace, *, pool: PoolKind = PoolKind.KV, verify: bool = True) -> list[StoredPrefix]:
        ns = self._check_ns(namespace)
        reg = self._reg(pool) if verify else None
        deadline = self._timeout(None)
        try:
            d, name = self._manifest_name(ns)
            paths = sorted(p for p in self._io.list_files(d) if os.path.basename(p).startswith(name))
        except Exception as e:  # backend outage: nothing listed
            self._count_exc(e)
            return []
        seed = ns.seed()
        P = self.fingerprint.page_size
        entries: list[np.ndarray] = []

        def post(i: int, raw: Any) -> np.ndarray:
            n = (len(raw) - ObjectMeta(ObjectKind.MANIFEST, self._fp, seed, 0, 0, "int64", ()).header_len) // 8
            meta = ObjectMeta(ObjectKind.MANIFEST, self._fp, seed, 0, max(n, 0), "int64", ())
            return np.frombuffer(decode(raw, meta, payload_len=max(n, 0) * 8), dtype="<i8").copy()

        for i, r in self._io.read_many(paths, post, deadline):
            if isinstance(r, CorruptObjectError):
                self._on_corrupt(paths[i], r, deadline)
            elif isinstance(r, BaseException):
                self._count_exc(r)
            elif len(r) and len(r) % P == 0 and _manifest_tag(seed, r) == os.path.basename(paths[i])[len(name):]:
                entries.append(r)
        out = []
        for toks in entries:
            keys = page_keys(ns, toks)
            n = len(keys)
            if verify and reg is not None:
                n = self.batch_exists(keys, pool=reg.kind, timeout_s=max(deadline.left(), 1e-3))
            if n:
                out.append(StoredPrefix(toks[: n * P], n, tuple(keys[:n])))
        # Drop entries that are a prefix of a longer one (the tree insert would be a no-op).
        out.sort(key=lambda sp: -sp.num_pages)
        kept: list[StoredPrefix] = []
        tips: set[str] = set()
        for sp in out:
            if sp.keys[-1] in tips:
                continue
            kept.append(sp)
            tips.update(sp.keys)
        return kept

    # ---- admin ---------------------------------------------------------------------------------
    def clear(self) -> None:
        self._io.delete_tree(self._base)
        with self._lock:
            if self._local and self._index is not None:
                self._scan()

    def stats(self) -> StorageStats:
        with self._lock:
            c = dict(self._counters)
            corrupt = dict(self._corrupt)
            used = self._used if (self._local and self._index is not None) else -1
        return StorageStats(**c, corrupt_by_reason=corrupt, used_bytes=used)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._io.close()

    def __repr__(self) -> str:
        pools = {k.value: r.ppo for k, r in self._pools.items()}
        return f"FsspecStorage({self.url!r}, model={self.fingerprint.model_id!r}, pages_per_object={pools})"
