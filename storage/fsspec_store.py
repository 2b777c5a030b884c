"""``FsspecStorage``: the one ``HiCacheStorage`` implementation, over fsspec by URL.

Schemes
-------
- ``file://DIR`` — embedded default. Write-once on a local filesystem: the final name is created
  with ``O_EXCL`` and no permission bits, written, then published with ``fchmod`` (readers take
  published objects only); on a network/FUSE mount a temp file + ``os.link``. Either way
  concurrent writers (threads or processes) leave exactly one complete object and readers never
  see a torn one. fsspec's own
  ``LocalFileSystem.pipe_file(mode="create")`` is exists-then-write, which is neither, hence the
  local fast path (plain ``os`` calls, no fsspec listing cache involved). Reads have no separate
  existence round: each object is opened directly (a failed ``open`` is the miss) and read with
  one ``preadv``, header into a small buffer and payload straight into the pool's slots
  (``slot_view``), then verified; a failure wipes those slots before the page is reported
  ``False``. Optional byte cap (``StorageConfig.max_bytes``) with LRU eviction; reads and writes
  set mtimes (on the open descriptor, chain order: shallow pages newest). No fsync: a cache; a
  crash can lose objects, and anything damaged fails its checksum and is a miss.
- ``memory://NAME`` — tests. ``pipe_file(mode="create")`` (per process).
- ``gs://BUCKET/PREFIX`` — gcsfs. ``pipe_file(mode="create")`` → ``ifGenerationMatch=0``
  (412 → ``FileExistsError``). Async batched I/O on gcsfs' loop; the instance and listings caches
  are off (``skip_instance_cache=True``, ``use_listings_cache=False``) so other replicas' writes
  are seen.
  Any other fsspec URL works through the generic sync (threads) or async path.

Object names (topology-free, content-addressed)::

    {root}/v{FORMAT_VERSION}/{fingerprint[:16]}/{pool}/{shard.tag()}/c{C}[l{S}]/{key[0]}/{key}
    {root}/v{FORMAT_VERSION}/{fingerprint[:16]}/manifest/{namespace[0]}/{namespace[:32]}-{tokens_tag}

Sixteen directories per pool and sixteen for the manifest (the first hex digit of the name), made
when a file:// store is opened (``_make_fanout``), so that no write creates a directory: on ext4 a
``mkdir`` costs more CPU than the object's own file (a new inode plus a directory block; measured
in the no-reuse benchmark, where 256 key-prefix directories and one manifest directory per new
namespace took as many ``mkdir`` calls per request as object files). A namespace's manifest
entries are the names with its prefix in one of the sixteen directories (one listing of that
directory). An ext4 directory indexes ~10M names, so sixteen hold far more than a local cache.

Chunking rule (``C`` = pages per object, per pool; default ``target_object_bytes // slot_bytes``)
------------------------------------------------------------------------------------------------
Chunks are aligned to absolute page positions in the chain: chunk ``j`` covers pages
``[jC, (j+1)C)``. Every sequence that shares a prefix therefore shares chunk boundaries. An object
holds pages ``[jC, jC+m)``, ``1 <= m <= C`` and is named by the key of its last page
``jC+m-1`` (the key fixes the position, so ``m`` is implied). ``C`` is in the path, so stores with
different chunk sizes never misread each other.

- Write (``batch_set``): ``first_page`` must be a multiple of ``C``. Every full chunk is written;
  the tail of a sequence that ends mid-chunk is written as a partial object of ``m < C`` pages
  (``write_partial_chunks``). Objects already present are skipped (one batched existence check;
  file://: each write task checks its own object right before writing it).
- Read (``batch_exists`` / ``batch_get``), prefix-ordered: for each chunk in order the natural
  candidate is the object ending at ``min(chunk end, query end)``. At the first chunk whose natural
  candidate is missing, the shorter partial objects of that chunk that lie inside the query are
  probed (one batched round, at most ``C-1`` names) and the longest one extends the hit.
  Consequences: (a) a prefix stored mid-chunk (partial object) is found by any later *longer*
  query through the probe; (b) a later *shorter* query that ends inside a chunk stored only as a
  full object cannot name that object (its name is the key of a page beyond the query) and loses
  at most ``C-1`` pages; (c) the later longer sequence writes the full chunk, the partial object
  stays until evicted (bounded duplication, ``<= C-1`` pages per sequence).
- Links (file://, ``link_every_pages`` = S < C; ``l{S}`` in the path): an object is also hard-linked
  under the key of every S-th page inside it (pages ``jC+S-1, jC+2S-1, ...``), and its header lists
  those keys. A natural or probed name may therefore open a longer object of the same chunk; the
  reader checks the header binds that name to that page, verifies the whole payload and lands the
  pages it asked for. So (b) loses ``< S`` pages, not ``< C``: one object per chunk of C pages
  costs one file creation plus ``C/S - 1`` links (a directory entry each) instead of ``C/S``
  objects. The byte cap counts an object once and evicts all of its names together. Format v4: an
  object of chunk 0 (more than 2 pages) is also linked at page 1 (``format.link_counts``), so every
  stored chain of >= 2 pages is named at its page 1, and a query from page 0 that needs >= 2 pages
  (``min_pages``) answers a miss with that one stat (v3: one per object size below S). It costs one
  link per stored chain (~20 us of ext4 CPU), not per object.

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
on gcsfs' event loop; file:// runs one loop per I/O thread that pulls objects in chain order, not
one task per object, and writes at most ``write_threads`` objects at once). file:// existence
checks, manifest writes and, if configured, small ``batch_set`` writes
(``local_inline_write_bytes``) run on the calling thread only when the root is on a local
filesystem (``mounts.py``, decided once at construction); on a network or FUSE mount they go to
the pool like any other I/O. The host pool is touched on the calling thread, or, for pools that
declare ``concurrent_slot_io``, by the I/O threads on disjoint slots and only until the call
returns (``_CallGuard``). Every call has a deadline (``StorageConfig.timeout_s`` or
``timeout_s=``): operations not finished by then are abandoned (counted in ``timeouts``) and their
pages report ``False``. A hung sync backend keeps its worker threads until it returns; later calls
still return by their deadline.
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
import stat
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
    CorruptReason,
    HeaderEncoder,
    decode_header,
    ObjectKind,
    ObjectMeta,
    decode,
    link_counts,
    payload_hasher,
)
from hicache.storage.keys import ModelFingerprint, Namespace, ShardCoord, _as_tokens, check_key, page_keys
from hicache.storage.mounts import stats_are_local

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
    # file:// concurrent object writes (None: min(io_threads, usable CPUs)). A buffered write is
    # CPU work (kernel copy into the page cache + checksum); more writers than CPUs only contend
    # on kernel locks (measured on 2 CPUs: 4 writers cost ~10% more CPU than 2 and were slower).
    local_write_threads: int | None = None
    max_pending_ops: int | None = None  # sync backends: cap on abandoned, still-running ops (8 * io_threads)
    target_object_bytes: int | None = None  # None → DEFAULT_TARGET_OBJECT_BYTES[scheme]
    pages_per_object: int | None = None  # overrides target_object_bytes for every pool
    write_partial_chunks: bool = True  # store the tail of a sequence that ends mid-chunk
    # file:// only: an object of more pages than this is also hard-linked under the chain key of
    # every this-many-th page inside it, so a query that ends or diverges inside the object still
    # reads its leading pages (it loses < this many pages, not < pages_per_object). A link costs a
    # directory entry, far less than an object (inode, header, checksum, publish); at most
    # MAX_LINKS_PER_OBJECT of them (the spacing grows with larger objects). None: off.
    link_every_pages: int | None = 4
    max_bytes: int | None = None  # file:// only: byte cap over the whole root, LRU eviction
    evict_low_watermark: float = 0.9  # evict down to this fraction of max_bytes
    max_inflight_bytes: int = 256 * MiB  # batch_set gathers from the pool in groups this large
    # file:// on a local filesystem: a batch_set of at most this many payload bytes is written on
    # the calling thread (``_write_inline``); None: always the I/O threads. The stack's caller is a
    # host worker's storage thread (``hicache.workers.storage_exec``), a background thread that
    # waits for the I/O threads anyway, and L2->L3 writes wait past the first token (write hold):
    # handing a request's few objects to the I/O threads costs wake-ups and context switches and
    # overlaps nothing worth it. No-reuse pair (benchmarks/multiturn.py, 2 busy CPUs): L3 write CPU
    # per request 1.59 -> 1.02 ms (I/O + storage threads), drain CPU 2.69 -> 1.87 ms. (Before the
    # write hold, writes overlapped prefills, and inline writes then cost the serving thread a few
    # points of TTFT.) Larger batches (bulk copies) still go to the I/O threads.
    local_inline_write_bytes: int | None = 4 * MiB
    # file:// on a local filesystem: a batch_get of at most this many payload bytes reads its objects
    # on the calling thread (None: always the I/O threads). The stack's caller is the worker's
    # storage thread, a background thread: handing a prefetch's one or two objects to the I/O
    # threads cost a wake-up per thread and the caller's, more CPU than the reads (on 2 busy CPUs
    # every extra runnable thread also delays the serving thread). Larger batches still read in
    # parallel on the I/O threads.
    local_inline_read_bytes: int | None = 4 * MiB
    delete_corrupt: bool = True  # remove objects that fail verification so they can be rewritten
    storage_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if self.io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {self.io_threads!r}")
        for name in ("target_object_bytes", "pages_per_object", "max_bytes", "local_write_threads", "local_inline_write_bytes",
                     "local_inline_read_bytes", "link_every_pages"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        if not 0.0 < self.evict_low_watermark <= 1.0:
            raise ValueError(f"evict_low_watermark must be in (0, 1], got {self.evict_low_watermark!r}")


# ---------------------------------------------------------------------------------------------
# Backends: a few primitives per filesystem family. Results are values or exception instances.
# ---------------------------------------------------------------------------------------------


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


_READ_CHUNK = 1 * MiB  # file:// reads: payload bytes per preadv, hashed while cache-hot


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    """``bufs`` without their first ``n`` bytes (after a partial ``readv``/``writev``)."""
    while bufs and n >= len(bufs[0]):
        n -= len(bufs[0])
        bufs = bufs[1:]
    if bufs and n:
        bufs = [bufs[0][n:], *bufs[1:]]
    return bufs


def _preadv_full(fd: int, bufs: list[memoryview], offset: int) -> int:
    """Fill ``bufs`` from ``offset`` (short only at end of file); returns the bytes read."""
    got = 0
    bufs = [b for b in bufs if len(b)]
    while bufs:
        n = os.preadv(fd, bufs, offset + got)
        if not n:
            break
        got += n
        bufs = _advance(bufs, n)
    return got


def _set_mtime(fd: int, mtime_ns: int | None) -> None:
    """Best-effort LRU timestamp on an open file (``None``: leave it)."""
    if mtime_ns is None:
        return
    try:
        os.utime(fd, ns=(mtime_ns, mtime_ns))
    except OSError:
        pass


# file:// on a local filesystem publishes an object in place: its final name is created exclusively
# (``O_EXCL``: one writer wins) with no permission bits (in progress), written, then given
# ``PUBLISHED_MODE`` (``fchmod``). One directory entry per object instead of a temp file + link +
# unlink (the filesystem's file creation is most of a small object's write cost). Readers and
# existence checks take published objects only: an unpublished one is a miss, never data (a writer
# is on it, or one died: older than ``STALE_UNPUBLISHED_S`` a reader removes it so the key can be
# written again). Network/FUSE mounts keep temp file + ``os.link`` (their attribute and data
# caches do not promise that a reader who sees the mode also sees the bytes).
PUBLISHED_MODE = 0o644
STALE_UNPUBLISHED_S = 600.0
MAX_LINKS_PER_OBJECT = 7  # file:// link names per object (``StorageConfig.link_every_pages``)


def _manifest_tag(seed: bytes, tokens: np.ndarray) -> str:
    """A manifest entry's name tag: SHA-256 of the namespace seed and the entry's tokens (int64 LE),
    hex. One hash over the tokens, not the chain's page by page (the name only has to be a pure
    function of the entry: equal entries share one write-once name, and a reader checks the
    content it lists against it)."""
    return hashlib.sha256(seed + tokens.astype("<i8", copy=False).tobytes()).hexdigest()


def _is_published(st: os.stat_result) -> bool:
    return st.st_mode & 0o777 != 0


def _published(path: str) -> bool:
    """Whether a published object (or any other file with permission bits) exists at ``path``."""
    try:
        return _is_published(os.stat(path))
    except (OSError, ValueError):
        return False


def _drop_if_stale(path: str, st: os.stat_result | None = None) -> None:
    """Removes the unpublished object at ``path`` if its writer is long gone (best effort)."""
    try:
        st = os.stat(path) if st is None else st
        if not _is_published(st) and time.time() - st.st_mtime > STALE_UNPUBLISHED_S:
            os.unlink(path)
    except OSError:
        pass


def _open_published_fd(path: str) -> tuple[int, int]:
    """``(fd, size)`` of the published object at ``path``; ``FileNotFoundError`` if there is none
    (missing, or still being written: a miss, never a torn object). Opened non-blocking (no effect
    on a regular file): anything else at that name (a FIFO, a device) is a miss at once, never a
    blocked ``open`` (reads of a local filesystem run on the calling thread)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    except PermissionError:  # unpublished, and we are not root
        _drop_if_stale(path)
        raise FileNotFoundError(path) from None
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise FileNotFoundError(path)
    if not _is_published(st):
        os.close(fd)
        _drop_if_stale(path, st)
        raise FileNotFoundError(path)
    return fd, st.st_size


def _open_published(path: str):  # -> a binary, unbuffered file object
    return os.fdopen(_open_published_fd(path)[0], "rb", buffering=0)


Payload = np.ndarray | list[memoryview]  # an object's pages: one array, or byte runs in order (of pool slots)


def _payload_bufs(payload: Payload) -> list[memoryview]:
    """The payload's bytes as buffers in order (no copy)."""
    return payload if isinstance(payload, list) else [memoryview(payload.reshape(-1).view(np.uint8))]


def _writev_all(fd: int, header: bytes, payload: Payload) -> None:
    """Header and payload (its parts: ``iovec`` entries) with one ``writev`` (more only after a
    short write)."""
    bufs = [memoryview(header).cast("B"), *_payload_bufs(payload)]
    n, total = os.writev(fd, bufs), sum(len(b) for b in bufs)
    if n < total:  # a short write (rare): finish it
        bufs = _advance(bufs, n)
        while bufs:
            bufs = _advance(bufs, os.writev(fd, bufs))


def _add_links(path: str, links: Sequence[str]) -> None:
    """Hard links ``links`` -> the published object ``path`` (best effort: a name that exists
    already names an object holding the same pages; a filesystem without hard links gets none,
    and queries ending inside the object then read less of it)."""
    for link in links:
        try:
            os.link(path, link)
        except FileExistsError:
            continue
        except FileNotFoundError:  # first name in that directory
            try:
                os.makedirs(link.rpartition("/")[0], exist_ok=True)
                os.link(path, link)
            except OSError:
                return
        except OSError:
            return


FANOUT = "0123456789abcdef"  # object and manifest names are hex: one directory per first digit


def _make_fanout(parent: str) -> None:
    """The sixteen fan-out directories under ``parent`` (file://; best effort: a write still makes
    a missing one)."""
    for digit in FANOUT:
        try:
            os.makedirs(f"{parent}/{digit}", exist_ok=True)
        except OSError:
            return


def _object_bytes(header: bytes, payload: Payload) -> bytes:
    """Header + payload as one ``bytes`` for backends that take a whole object: one copy of the
    payload (``header + payload.tobytes()`` would copy it twice)."""
    return b"".join((header, *_payload_bufs(payload)))


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

    def _write_once(self, path: str, header: bytes, payload: Payload) -> bool:
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

    def map_pull(
        self, fn: Callable[..., Any], items: Sequence[tuple], deadline: _Deadline, threads: int | None = None
    ) -> Iterator[tuple[int, Any]]:
        """``map`` with one task per worker instead of one per item: up to ``threads`` loops pull
        the next item index (items start in order) until none is left. A thread handoff costs
        tens of microseconds on a busy host, per item that is as much as a small local I/O.
        Results are handed over once, when all are in or at the deadline (in completion order);
        at the deadline the loops stop taking items, results that come later are dropped (their
        items report ``TimeoutError``) and loops still busy count as abandoned."""
        n = len(items)
        if not n:
            return
        with self._plock:
            saturated = self._abandoned >= self._max_abandoned
        if saturated:
            for i in range(n):
                yield i, BlockingIOError("storage backend saturated: too many abandoned operations")
            return
        nxt = itertools.count()
        stop, done, lock = threading.Event(), threading.Event(), threading.Lock()
        results: list[tuple[int, Any]] = []

        def loop() -> None:
            while not stop.is_set():
                i = next(nxt)  # atomic under the GIL
                if i >= n:
                    return
                try:
                    r = fn(*items[i])
                except BaseException as e:  # noqa: BLE001 - handed to the caller as a value
                    r = e
                with lock:
                    if stop.is_set():  # the call is over: this item already counts as timed out
                        return
                    results.append((i, r))
                    if len(results) == n:
                        done.set()

        futs = [self._ex.submit(loop) for _ in range(min(n, self._threads, threads or self._threads))]
        # One wake-up of the calling thread per call, not one per item (each costs a context
        # switch: on a busy 2-CPU host as much CPU as a small local I/O).
        done.wait(deadline.left())
        with lock:
            stop.set()
            got = list(results)
        for f in futs:
            if not f.done():  # still busy with an item: runs (harmlessly) in the background
                with self._plock:
                    self._abandoned += 1
                f.add_done_callback(self._release)
        yield from got
        if len(got) < n:
            seen = {i for i, _ in got}
            for i in range(n):
                if i not in seen:
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
    """Local directory via ``os``: atomic write-once, zero-copy header+payload writes, existence
    checks on the calling thread."""

    def __init__(self, fs: Any, threads: int, max_pending: int | None = None) -> None:
        super().__init__(fs, threads, max_pending)
        self.inline_io = False  # until ``attach_root`` finds the root on a local filesystem
        self.local_fs = False  # the root is on a local filesystem (decided once; publish in place)

    def attach_root(self, root: str) -> None:
        """Create ``root`` and decide, once, where existence checks run: inline only on a local
        filesystem (a stat cannot hang there); on a network/FUSE mount or an unknown one, on the
        pool, bounded by each call's deadline."""
        os.makedirs(root, exist_ok=True)
        self.local_fs = self.inline_io = stats_are_local(root)

    def map(self, fn: Callable[..., Any], items: Sequence[tuple], deadline: _Deadline) -> Iterator[tuple[int, Any]]:
        return self.map_pull(fn, items, deadline)

    @staticmethod
    def map_inline(fn: Callable[..., Any], items: Sequence[tuple], deadline: _Deadline) -> Iterator[tuple[int, Any]]:
        """``map`` on the calling thread, in item order (a local filesystem's small batches): the
        deadline is checked before each item (items not started by then report ``TimeoutError``)."""
        for i, it in enumerate(items):
            if time.monotonic() >= deadline.end:
                yield i, TimeoutError(f"storage operation {i} did not start by the deadline")
                continue
            try:
                r = fn(*it)
            except Exception as e:  # noqa: BLE001 - handed to the caller as a value
                r = e
            yield i, r

    def _exists(self, path: str) -> bool:
        return _published(path)

    def _read(self, path: str) -> memoryview:
        with _open_published(path) as f:
            size = os.fstat(f.fileno()).st_size
            buf = np.empty(size, dtype=np.uint8)
            mv = memoryview(buf)
            got = 0
            while got < size:
                n = f.readinto(mv[got:])
                if not n:
                    break
                got += n
        return mv[:got]

    # A batch of stats slower than this on the calling thread means a slow (network) mount: later
    # existence queries go to the pool thread again, where the deadline bounds them. Well above a
    # preemption on a busy host (tens of ms), which must not switch a local disk back.
    INLINE_STAT_LIMIT_S = 0.5

    def exists_many(self, paths: Sequence[str], deadline: _Deadline) -> list[Any]:
        # A local stat is microseconds; handing the batch to a pool thread and waking the caller
        # costs 0.3-3 ms on a busy 2-CPU host (it was most of an L3 query). So on a local
        # filesystem (``attach_root``) the stats run on the calling thread, the deadline checked
        # between them (paths past it: TimeoutError). If one batch still takes over
        # INLINE_STAT_LIMIT_S (an overloaded disk), this backend stops stating inline. Otherwise
        # (network/FUSE mounts, where a stat can hang) a batch runs as one pool task, bounded by
        # the deadline.
        if not paths:
            return []
        paths = list(paths)
        if self.inline_io:
            return [self.exists_one(p, deadline) for p in paths]
        (r,) = dict(self.map(lambda: [_published(p) for p in paths], [()], deadline)).values()
        return r if isinstance(r, list) else [r] * len(paths)

    def exists_one(self, path: str, deadline: _Deadline) -> bool | TimeoutError:
        """One existence check on the calling thread (``inline_io`` only): ``TimeoutError`` past
        the deadline. A stat slower than ``INLINE_STAT_LIMIT_S`` turns ``inline_io`` off."""
        t0 = time.monotonic()
        if t0 >= deadline.end:
            return TimeoutError(f"existence check of {path} did not start by the deadline")
        r = _published(path)
        if time.monotonic() - t0 > self.INLINE_STAT_LIMIT_S:
            self.inline_io = False
        return r

    def read_into(
        self,
        path: str,
        meta: ObjectMeta,
        payload_len: int,
        dest: np.ndarray,
        guard: _CallGuard,
        mtime_ns: int | None = None,
        longer_ok: bool = False,
    ) -> int:
        """Read one object straight into ``dest`` (pool memory) and verify it: the header (into a
        small buffer) and the payload's first chunk with one ``preadv``, the header checked, then
        the payload chunk by chunk (``_READ_CHUNK``), each chunk hashed right after it lands,
        while it is still in the CPU cache (hashing the whole object after one big read re-reads
        it from memory: measured ~6% more CPU per read). On any failure ``dest`` is zeroed before
        raising, so unverified bytes never stay in the pool. A missing object raises
        ``FileNotFoundError`` from the ``open`` (no separate existence round). ``mtime_ns``: LRU
        bump, set on the open descriptor after verification. ``longer_ok``: a larger object (a link
        to a longer one, maybe) raises ``_LongerObject`` before the pool is touched. Returns the
        object's size."""
        u8 = dest.reshape(-1).view(np.uint8)
        hl = meta.header_len
        fd, total = _open_published_fd(path)
        try:
            if total != hl + payload_len:  # wrong size: classify from the header, never touch the pool
                if longer_ok and total > hl + payload_len:
                    raise _LongerObject(path)
                head = os.pread(fd, min(total, hl), 0)
                decode_header(head, meta, payload_len=payload_len, total_len=total)  # raises
                raise CorruptObjectError(CorruptReason.SHORT, f"{total} bytes, expected {hl + payload_len}")  # pragma: no cover
            head = bytearray(hl)
            mv = memoryview(u8)
            step = _READ_CHUNK
            with guard:  # never touch the pool after the call returned
                try:
                    got = _preadv_full(fd, [memoryview(head), mv[:step]], 0)
                    if got != hl + min(step, payload_len):
                        raise CorruptObjectError(CorruptReason.SHORT, f"read {got} of {total} bytes")
                    digest = decode_header(head, meta, payload_len=payload_len, total_len=total)
                    h = payload_hasher()
                    h.update(mv[:step])
                    for off in range(step, payload_len, step):
                        chunk = mv[off : off + step]
                        if _preadv_full(fd, [chunk], hl + off) != len(chunk):
                            raise CorruptObjectError(CorruptReason.SHORT, f"object shrank while read: {path}")
                        h.update(chunk)
                    if h.digest() != digest:
                        raise CorruptObjectError(CorruptReason.BAD_CHECKSUM, "payload checksum mismatch")
                except BaseException:
                    u8[:] = 0  # corrupt or unverified bytes never stay in the pool
                    raise
            _set_mtime(fd, mtime_ns)
        finally:
            os.close(fd)
        return total

    # write-once outcomes of ``write_once_local``
    WROTE, EXISTED, RACED = 1, 0, -1

    @staticmethod
    def _create_tmp(d: str) -> tuple[int, str]:
        """A new, exclusively created temp file in directory ``d`` (created if missing). The name
        is unique per process (pid, a random token, a counter; ``O_EXCL`` settles the rest): far
        cheaper than ``tempfile.mkstemp``, whose random names cost tens of microseconds."""
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

    def write_once_local(
        self, path: str, header: bytes, payload: Payload, mtime_ns: int | None = None, links: Sequence[str] = ()
    ) -> int:
        """Write-once of one object. Returns ``WROTE``, ``EXISTED`` (stored, or being written by
        another writer: nothing written) or ``RACED`` (lost a race at the publish step). On a
        local filesystem: exclusive create of the final name, one ``writev``, mtime (LRU),
        ``fchmod`` to publish (module comment at ``PUBLISHED_MODE``); elsewhere temp file +
        ``os.link``. This is the only existence check of a file:// ``batch_set``. A written
        object then gets its ``links`` (hard links: other names of the same, published object)."""
        if not self.local_fs:
            r = self._write_once_linked(path, header, payload, mtime_ns)
            if r == self.WROTE:
                _add_links(path, links)
            return r
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags, 0)
        except FileNotFoundError:  # first object of this directory (or the tree was cleared)
            os.makedirs(path.rpartition("/")[0], exist_ok=True)
            try:
                fd = os.open(path, flags, 0)
            except FileExistsError:
                return self.EXISTED
        except FileExistsError:
            return self.EXISTED
        try:
            _writev_all(fd, header, payload)
            _set_mtime(fd, mtime_ns)
            os.fchmod(fd, PUBLISHED_MODE)
        except BaseException:
            try:  # ours (created exclusively) and never published: nobody reads it
                os.unlink(path)
            except OSError:
                pass
            raise
        finally:
            os.close(fd)
        _add_links(path, links)
        return self.WROTE

    def _write_once_linked(self, path: str, header: bytes, payload: Payload, mtime_ns: int | None = None) -> int:
        """Temp file in the object's directory (one ``writev``), its mtime set (LRU), then
        ``os.link`` to the final name, which fails if another writer won."""
        if os.path.exists(path):
            return self.EXISTED
        fd, tmp = self._create_tmp(path.rpartition("/")[0])
        try:
            try:
                _writev_all(fd, header, payload)
                _set_mtime(fd, mtime_ns)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)  # atomic; FileExistsError if another writer won
            except FileExistsError:
                return self.RACED
            except OSError:  # no hard links on this filesystem: best effort (content is deterministic)
                if os.path.exists(path):
                    return self.RACED
                os.replace(tmp, path)
                tmp = ""
            return self.WROTE
        finally:
            if tmp:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass

    def _write_once(self, path: str, header: bytes, payload: Payload) -> bool:
        return self.write_once_local(path, header, payload) == self.WROTE

    def write_many(self, items: Sequence[tuple[str, Callable[[], tuple[bytes, np.ndarray]]]], deadline: _Deadline) -> Iterator[tuple[int, Any]]:
        """On a local filesystem on the calling thread (manifest entries: a few hundred bytes
        each, far cheaper than a hand-off), the deadline checked between items."""
        if not self.inline_io:
            return super().write_many(items, deadline)
        out: list[tuple[int, Any]] = []
        for i, (path, make) in enumerate(items):
            if time.monotonic() >= deadline.end:
                out.append((i, TimeoutError(f"write of {path} did not start by the deadline")))
                continue
            try:
                out.append((i, self._write_once(path, *make())))
            except Exception as e:  # noqa: BLE001 - handed to the caller as a value
                out.append((i, e))
        return iter(out)

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


def _view_of(pool: HostPool, fn: Callable[[int, int], Any], start: int, n: int) -> np.ndarray | None:
    """``fn(start, n)`` (the pool's ``slot_view``) if it is a C-contiguous ``[n, *slot_shape]``
    array of the pool's dtype, else None."""
    v = fn(start, n)
    if (
        not isinstance(v, np.ndarray)
        or v.shape != (n, *pool.slot_shape)
        or v.dtype != np.dtype(pool.dtype)
        or not v.flags.c_contiguous
    ):
        return None
    return v


def _slot_view(pool: HostPool, slots: np.ndarray) -> np.ndarray | None:
    """Zero-copy view of consecutive slots if the pool offers ``slot_view(start, n)``."""
    fn = getattr(pool, "slot_view", None)
    n = len(slots)
    if fn is None or n == 0:
        return None
    ids = slots.tolist()  # (plain ints: far cheaper than numpy ops on a handful of slots)
    s0 = ids[0]
    if ids[-1] - s0 != n - 1 or (n > 2 and ids != list(range(s0, s0 + n))):
        return None
    return _view_of(pool, fn, s0, n)


def _slot_runs(pool: HostPool, slots: np.ndarray) -> list[memoryview] | None:
    """The bytes of ``slots`` in their order, zero-copy, one buffer per run of consecutive ids, if
    the pool offers ``slot_view(start, n)`` (else None): a payload written straight from pool
    memory, the slots as they lie (a backup's slots come from a free list, often not consecutive).
    One ``slot_view`` of the span of ``slots``, then byte slices of it (a view per slot would cost
    more Python than the gathered copy it saves)."""
    fn = getattr(pool, "slot_view", None)
    n = len(slots)
    if fn is None or n == 0:
        return None
    ids = slots.tolist()  # (plain ints: a handful of slots, numpy calls would cost more)
    lo = min(ids)
    span = _view_of(pool, fn, lo, max(ids) - lo + 1)
    if span is None:
        return None
    flat = memoryview(span.reshape(-1).view(np.uint8))
    sb = len(flat) // len(span)
    out = []
    a = prev = ids[0]
    for s in ids[1:]:
        if s != prev + 1:  # a run ends at prev
            out.append(flat[(a - lo) * sb : (prev + 1 - lo) * sb])
            a = s
        prev = s
    out.append(flat[(a - lo) * sb : (prev + 1 - lo) * sb])
    return out


_NO_SLOTS = np.zeros(0, np.int32)  # batch_exists' queries carry no slots (read-only, shared)
_SKIPPED = object()  # a read not started because an earlier object of its chain is missing


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


class _LongerObject(Exception):
    """``read_into``: the object is larger than expected (possibly a link to a longer object)."""


def _with_header(header: Callable[[Any], bytes], data: Payload) -> tuple[bytes, Payload]:
    """``(header(payload), data)``; ``header``: an object's ``HeaderEncoder.encode`` with its key
    and position bound (it takes one array or a list of parts)."""
    return header(data if isinstance(data, list) else data.reshape(-1).view(np.uint8)), data


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
    link_every: int = 0  # S: link names every S pages inside an object (format.link_counts; 0: none)

    def num_links(self, start: int, m: int) -> int:
        return len(link_counts(start, m, self.link_every))

    def object_bytes(self, start: int, m: int) -> int:
        return self.header.header_len + 32 * self.num_links(start, m) + m * self.slot_bytes


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
        self._write_threads = config.local_write_threads or min(config.io_threads, _usable_cpus())
        if isinstance(self._io, _LocalBackend):
            self._io.attach_root(self._root)
            _make_fanout(self._manifest_parent())
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
        return ObjectMeta(ObjectKind.PAGES, self._fp, bytes.fromhex(key), start, m, reg.dtype_name, reg.shape, reg.num_links(start, m))

    @staticmethod
    def _link_pages(reg: _PoolReg, o: _Obj) -> list[int]:
        """Pages of ``o`` (absolute) whose chain keys name it too (``format.link_counts``): every
        ``link_every``-th inside it, and page 1 of an object that starts the chain."""
        return [o.start + c - 1 for c in link_counts(o.start, o.m, reg.link_every)]

    def _link_keys(self, reg: _PoolReg, keys: list[str], first: int, o: _Obj) -> tuple[bytes, ...]:
        return tuple(bytes.fromhex(keys[p - first]) for p in self._link_pages(reg, o))

    def _link_paths(self, reg: _PoolReg, keys: list[str], first: int, o: _Obj) -> tuple[str, ...]:
        return tuple(self._path(reg, keys[p - first]) for p in self._link_pages(reg, o))

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
        every = max(self.config.link_every_pages or 0, -(-ppo // (MAX_LINKS_PER_OBJECT + 1)))
        every = every if self._local and self.config.link_every_pages and every < ppo else 0
        prefix = f"{self._base}/{kind.value}/{shard.tag()}/c{ppo}" + (f"l{every}" if every else "")
        header = HeaderEncoder(ObjectKind.PAGES, self._fp, dtype.name, shape, every)
        self._pools[kind] = _PoolReg(pool, shard, kind, ppo, dtype.name, prefix, header, shape, int(pool.slot_bytes), every)
        if self._local:
            _make_fanout(prefix)

    def pages_per_object(self, kind: PoolKind = PoolKind.KV) -> int:
        return self._reg(kind).ppo

    def object_path(self, key: str, *, pool: PoolKind = PoolKind.KV) -> str:
        """Backend path of the object named ``key`` (admin, debugging, tests)."""
        return self._path(self._reg(pool), check_key(key))

    @property
    def write_threads(self) -> int:
        """file://: how many objects one ``batch_set`` writes at once."""
        return self._write_threads

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

    def _stored_here(self, t: int, reg: _PoolReg, keys: Sequence[str], first: int, start: int, sizes: Iterator[int] | range,
                     deadline: _Deadline) -> _Obj | None:
        """Local filesystem, calling thread: the first stored of the objects of ``sizes`` pages that
        start at page ``start`` (one stat each, in the given order, up to the first one stored; an
        error or the deadline is a counted miss), or None. Callers ask in chain order and stop at
        the answer: a miss costs the objects up to it, not one stat per candidate of the whole
        query (each stat gives the GIL away; on a busy host getting it back costs more than the
        stat). Only the object found is built (``_Obj``): a miss builds nothing but path strings."""
        exists_one = self._io.exists_one  # type: ignore[attr-defined]
        for m in sizes:
            k = keys[start + m - 1 - first]
            path = self._path(reg, k)
            r = exists_one(path, deadline)
            if r is True:
                return _Obj(t, start, m, k, path)
            if r is not False:
                self._count_exc(r)
        return None

    def _probe_here(self, t: int, reg: _PoolReg, keys: Sequence[str], first: int, start: int, lo: int, hi: int,
                    deadline: _Deadline, known: _Obj | None = None) -> _Obj | None:
        """The longest stored object of the chunk at ``start`` of ``lo`` to ``hi`` pages (else
        ``known``, a shorter one known stored, or None), local, calling thread. With links, every
        object of the chunk with >= c pages is named at the chunk's page c - 1, for each of its link
        counts c (``format.link_counts``): those names are asked first, ascending, up to the first
        missing one, then only the sizes below it (a miss costs the sizes below the chunk's first
        link count, not one stat per size)."""
        for c in link_counts(start, hi + 1, reg.link_every):
            if c < lo:
                continue
            o = self._stored_here(t, reg, keys, first, start, (c,), deadline)
            if o is None:
                return self._stored_here(t, reg, keys, first, start, range(c - 1, lo - 1, -1), deadline) or known
            known, lo = o, c + 1
        return self._stored_here(t, reg, keys, first, start, range(hi, lo - 1, -1), deadline) or known

    def _resolve_here(self, t: int, reg: _PoolReg, keys: Sequence[str], first: int, least: int,
                      deadline: _Deadline) -> list[_Obj]:
        """``_resolve`` of one query on a local filesystem, on the calling thread: stats in chain
        order up to the first missing object, then that chunk's shorter candidates (``_probe_here``).
        With links, the chain's first chunk is gated (``_resolve``)."""
        objs: list[_Obj] = []
        for start, m in self._spans(reg, len(keys), first):
            shortest = max(1, first + least - start)  # the shortest object of this chunk of any use
            gate = None
            counts = link_counts(start, m, reg.link_every) if not objs and shortest < m else ()  # the query's first chunk
            if counts:  # is it stored at all? Every object of >= g pages is named at page g - 1
                g = max((c for c in counts if c <= shortest), default=counts[0])
                if first - start < g:  # (the gate's page is inside the query)
                    gate = self._stored_here(t, reg, keys, first, start, (g,), deadline)
                    if gate is None:
                        part = self._stored_here(t, reg, keys, first, start, range(g - 1, shortest - 1, -1), deadline)
                        if part is not None:  # an object of < g pages
                            objs.append(part)
                        return objs
            o = self._stored_here(t, reg, keys, first, start, (m,), deadline)  # the natural candidate
            if o is None:
                lo = shortest if gate is None else gate.m + 1
                part = self._probe_here(t, reg, keys, first, start, lo, m - 1, deadline, known=gate)
                if part is not None:
                    objs.append(part)
                return objs
            objs.append(o)
        return objs

    def _resolve(self, queries: list[tuple[_PoolReg, list[str], np.ndarray, int]], deadline: _Deadline,
                 min_pages: int = 1) -> list[list[_Obj]]:
        """Objects that cover the longest stored prefix of each query (≤ 2 batched rounds; on a
        local filesystem, stats in chain order up to the first missing object). ``min_pages``
        (``batch_exists``): shorter partial objects that would end a hit before the query's page
        ``min_pages - 1`` are not asked about (the answer is then short of ``min_pages`` anyway).
        Local, with links:
        a query's first chunk is gated: asked first at its page g-1, where every object of >= g
        pages is named (g one of the chunk's link counts, ``format.link_counts``: the largest up to
        the shortest useful object, else the smallest). If that is missing, only the chunk's
        objects of < g pages remain, so a miss costs one stat per useful size below g and reads only
        the first g keys (lazy ``ChainKeys`` hash no more); a hit costs one stat more than without
        that question. A chain's first chunk has the count 2 (its page 1 names every stored chain
        of >= 2 pages): a query from page 0 that needs >= 2 pages answers a miss with one stat,
        hashing two keys."""
        if self._local and self._io.inline_io:  # type: ignore[attr-defined]
            return [self._resolve_here(t, reg, keys, first, min_pages, deadline) for t, (reg, keys, _, first) in enumerate(queries)]
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
            if self._local:
                self._get_local(queries, results, guard, deadline)
            else:
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

    def _get_local(self, queries, results, guard, deadline) -> None:  # type: ignore[no-untyped-def]
        """file://: no existence round. Every natural object of the query is opened and read
        straight away (a failed ``open`` is the miss); reads of a transfer's objects behind its
        first missing one are skipped if not yet started, and never count (contiguous prefix).
        Only when a natural object is missing are that chunk's shorter partial objects probed
        (one batched existence round) and the longest one read."""
        nats = [self._naturals(t, reg, keys, first) for t, (reg, keys, _, first) in enumerate(queries)]
        objs = [o for ns in nats for o in ns]
        pos = [(t, j) for t, ns in enumerate(nats) for j in range(len(ns))]
        stop = [len(ns) for ns in nats]  # per transfer: index of the first missing natural object
        lock = threading.Lock()

        def skip(i: int) -> bool:
            t, j = pos[i]
            return j > stop[t]

        def on_missing(i: int) -> None:
            t, j = pos[i]
            with lock:
                stop[t] = min(stop[t], j)

        now = time.time_ns()  # LRU: chain order, shallow pages newest
        mtimes = [now - i * 1000 for i in range(len(objs))]
        ok = [False] * len(objs)

        def apply(i: int, r: Any) -> None:  # on this thread, as results are handed over
            ok[i] = self._apply_read(queries, results, objs[i], r, deadline)

        res = self._read_objs(queries, objs, guard, deadline, mtimes=mtimes, skip=skip, on_missing=on_missing, on_result=apply)
        probes: list[tuple[int, list[_Obj], int]] = []
        base = 0
        for t, ns in enumerate(nats):
            miss = [j for j in range(len(ns)) if isinstance(res[base + j], FileNotFoundError)]
            if miss and all(ok[base : base + miss[0]]):
                reg, keys, _, first = queries[t]
                parts = self._partials(t, reg, keys, first, ns[miss[0]].start, ns[miss[0]].m)
                if parts:
                    probes.append((t, parts, base + miss[0]))
            base += len(ns)
        if not probes:
            return
        found: list[tuple[_Obj, int]] = []
        if self._io.inline_io:  # type: ignore[attr-defined]
            for t, ps, rank in probes:
                reg, keys, _, first = queries[t]
                part = self._probe_here(t, reg, keys, first, ps[0].start, ps[-1].m, ps[0].m, deadline)
                if part is not None:
                    found.append((part, mtimes[rank]))
        else:
            flags = iter(self._exists_flags([o for _, ps, _ in probes for o in ps], deadline))
            for _, ps, rank in probes:
                fl = [next(flags) for _ in ps]
                if True in fl:
                    found.append((ps[fl.index(True)], mtimes[rank]))
        if found:
            objs2 = [o for o, _ in found]
            res2 = self._read_objs(queries, objs2, guard, deadline, mtimes=[m for _, m in found])
            for o, r in zip(objs2, res2):
                self._apply_read(queries, results, o, r, deadline)

    def _read_objs(  # type: ignore[no-untyped-def]
        self,
        queries,
        objs: list[_Obj],
        guard: _CallGuard,
        deadline: _Deadline,
        *,
        mtimes: list[int] | None = None,
        skip: Callable[[int], bool] | None = None,
        on_missing: Callable[[int], None] | None = None,
        on_result: Callable[[int, Any], None] | None = None,
    ) -> list[Any]:
        """Read and verify ``objs`` concurrently. Per object: the object's size (its pages are in
        the pool), a verified payload view (to scatter on the calling thread: pools without
        concurrent slot I/O), ``_SKIPPED`` or an exception (``FileNotFoundError``: missing).
        ``on_result(i, r)`` runs on the calling thread for each result as the backend hands it
        over. Per-object setup (expected header, pool view) runs on the I/O threads."""
        out: list[Any] = [None] * len(objs)
        if not objs:
            return out

        def expect(i: int) -> tuple[ObjectMeta, int]:
            o = objs[i]
            reg = queries[o.t][0]
            return self._meta(reg, o.start, o.m, o.key), o.m * int(reg.pool.slot_bytes)

        def post(i: int, raw: Any) -> Any:
            meta, plen = expect(i)
            o = objs[i]
            # a name may be a link to a longer object of the same chunk: its leading pages count
            payload = decode(raw, meta, payload_len=plen, longer_ok=bool(queries[o.t][0].link_every))[:plen]
            if not _concurrent_io(queries[o.t][0].pool):
                return payload  # scattered on the calling thread
            with guard:  # never touch the pool after the call returned
                self._scatter(queries, o, payload)
            return len(raw)

        def view(i: int) -> np.ndarray | None:
            """The object's slots in pool memory, if it lies inside its query and the pool offers
            zero-copy views to I/O threads (touched only in ``read_into``, under the guard)."""
            o = objs[i]
            reg, keys, slots, first = queries[o.t]
            if o.start >= first and o.start + o.m <= first + len(keys) and _concurrent_io(reg.pool):
                return _slot_view(reg.pool, slots[o.start - first : o.start - first + o.m])
            return None

        io: _LocalBackend = self._io  # type: ignore[assignment]

        def task(i: int, path: str) -> Any:
            if skip is not None and skip(i):
                return _SKIPPED
            mt = None if mtimes is None else mtimes[i]
            try:
                v = view(i)
                if v is not None:
                    try:
                        return io.read_into(path, *expect(i), v, guard, mt, longer_ok=bool(queries[objs[i].t][0].link_every))
                    except _LongerObject:  # reached through a link: read whole, land the leading pages
                        pass
                r = post(i, io._read(path))
            except FileNotFoundError:
                if on_missing is not None:
                    on_missing(i)
                raise
            if mt is not None:
                try:
                    os.utime(path, ns=(mt, mt))
                except OSError:
                    pass
            return r

        if self._local:
            items = [(i, o.path) for i, o in enumerate(objs)]
            inline = self.config.local_inline_read_bytes
            if io.inline_io and inline is not None and sum(o.m * queries[o.t][0].slot_bytes for o in objs) <= inline:
                results = io.map_inline(task, items, deadline)
            else:
                results = io.map(task, items, deadline)
        else:
            results = self._io.read_many([o.path for o in objs], post, deadline)
        for i, r in results:
            out[i] = r
            if on_result is not None:
                on_result(i, r)
        return out

    def _scatter(self, queries, o: _Obj, payload: memoryview) -> None:  # type: ignore[no-untyped-def]
        reg, keys, slots, first = queries[o.t]
        lo, hi = max(o.start, first), min(o.start + o.m, first + len(keys))
        pages = np.frombuffer(payload, dtype=np.dtype(reg.pool.dtype)).reshape((o.m, *reg.pool.slot_shape))
        reg.pool.write_slots(slots[lo - first : hi - first], pages[lo - o.start : hi - o.start])

    def _apply_read(self, queries, results, o: _Obj, r: Any, deadline: _Deadline) -> bool:  # type: ignore[no-untyped-def]
        """Account one read result; mark its pages loaded. True if the object was loaded."""
        if r is _SKIPPED:
            return False
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
        self._count(objects_read=1, bytes_read=reg.object_bytes(o.start, o.m))
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

        # file://: no separate existence round; each write task checks its object itself
        flags = [False] * len(objs) if self._local else self._exists_flags(objs, deadline)
        todo = []
        for o, f in zip(objs, flags):
            if f:
                mark(o)
                self._count(objects_skipped_existing=1)
            else:
                todo.append(o)
        written: list[tuple[int, int, str, int]] = []  # (transfer, start, path, size)
        inline = self.config.local_inline_write_bytes
        if (
            self._local
            and self._io.inline_io  # type: ignore[attr-defined]
            and inline is not None
            and sum(o.m * queries[o.t][0].slot_bytes for o in todo) <= inline
        ):
            self._write_inline(queries, todo, deadline, mark, written)
        else:
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
        # Gather from the pool in groups bounded by max_inflight_bytes, write each group concurrently.
        # file://: each object's mtime (LRU) is set before it is published: chain order (not
        # completion order), shallow pages newest.
        mtimes = self._write_mtimes(len(todo))
        rank = {id(o): i for i, o in enumerate(todo)}
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
                reg, keys, slots, first = queries[o.t]
                meta = functools.partial(reg.header.encode, bytes.fromhex(o.key), o.start, o.m,
                                         link_keys=self._link_keys(reg, keys, first, o))
                v = _slot_runs(reg.pool, slots[o.start - first : o.start - first + o.m]) if self._local and _concurrent_reads(reg.pool) else None
                if v is not None:  # zero-copy: checksum and write straight from pool memory
                    items.append((o.path, meta, v))
                    continue
                gather = (lambda reg=reg, sl=slots[o.start - first : o.start - first + o.m]: self._gather(reg, sl, guard))
                if not _concurrent_io(reg.pool):
                    data = gather()  # on the calling thread
                    gather = (lambda data=data: data)
                items.append((o.path, meta, gather))

            def task(path: str, meta: Callable[[np.ndarray], bytes], src: Any, mtime_ns: int | None = None,
                     links: tuple[str, ...] = ()) -> int:
                if not self._local:
                    wrote = self._io._write_once(path, *_with_header(meta, src()))
                    return _LocalBackend.WROTE if wrote else _LocalBackend.RACED
                io: _LocalBackend = self._io  # type: ignore[assignment]
                if isinstance(src, list):
                    with guard:  # pool memory is read until the write is done
                        return io.write_once_local(path, *_with_header(meta, src), mtime_ns, links)
                return io.write_once_local(path, *_with_header(meta, src()), mtime_ns, links)

            if isinstance(self._io, _AsyncBackend):
                writes = self._io.write_many([(p, (lambda m=m, g=g: _with_header(m, g()))) for p, m, g in items], deadline)
            elif self._local:
                ranked = [(*it, mtimes[rank[id(o)]], self._link_paths(*queries[o.t][0:2], queries[o.t][3], o))
                          for it, o in zip(items, group)]
                writes = self._io.map_pull(task, ranked, deadline, threads=self._write_threads)
            else:
                writes = self._io.map(task, items, deadline)
            tally: dict[str, int] = {}
            for i, r in writes:
                self._record_write(queries, group[i], r, mark, written, tally)
            self._count(**tally)
        for o in todo[gi:]:
            self._count(timeouts=1)

    _OUTCOME = {1: "objects_written", 0: "objects_skipped_existing", -1: "objects_raced"}  # by _LocalBackend code

    def _record_write(self, queries, o: _Obj, r: Any, mark, written, tally: dict[str, int]) -> None:  # type: ignore[no-untyped-def]
        """Account one object's write outcome in ``tally`` (counter deltas, applied by the caller
        in one ``_count``): a ``WROTE``/``EXISTED``/``RACED`` code, an async backend's bool, or an
        exception (the object's pages stay unmarked)."""
        if isinstance(r, BaseException):
            self._count_exc(r)
            return
        mark(o)
        if isinstance(r, bool):  # async ``write_many``: wrote / lost the race
            r = _LocalBackend.WROTE if r else _LocalBackend.RACED
        name = self._OUTCOME[r]
        tally[name] = tally.get(name, 0) + 1
        if r == _LocalBackend.WROTE:
            size = queries[o.t][0].object_bytes(o.start, o.m)
            tally["bytes_written"] = tally.get("bytes_written", 0) + size
            written.append((o.t, o.start, o.path, size))

    @staticmethod
    def _write_mtimes(n: int) -> list[int]:
        """file:// LRU timestamps of ``n`` objects written in chain order: shallow pages newest
        (set even without a byte cap here: another process sharing the directory may have one).
        File timestamps come from a coarse kernel clock, so write order alone would tie."""
        now = time.time_ns()
        return [now - i * 1000 for i in range(n)]

    def _write_inline(self, queries, todo: list[_Obj], deadline: _Deadline, mark, written) -> None:  # type: ignore[no-untyped-def]
        """file:// on a local filesystem, batches up to ``local_inline_write_bytes``: the objects
        are written here, on the calling thread, in chain order, the deadline checked between
        them (objects not started by then count as timeouts). For small batches the hand-off to
        the I/O threads (a wake-up per thread, then the caller's) cost more CPU than the writes,
        and every extra thread that takes the GIL delays the serving thread. The pages of a
        transfer are written straight from pool memory (``_slot_runs``) or come from ONE ``read_slots``
        (not one per object)."""
        io: _LocalBackend = self._io  # type: ignore[assignment]
        mtimes = self._write_mtimes(len(todo))
        tally: dict[str, int] = {}
        i = 0
        for t, group in itertools.groupby(todo, key=lambda o: o.t):
            objs = list(group)  # consecutive pages of one transfer
            reg, keys, slots, first = queries[t]
            lo = objs[0].start
            sl = slots[lo - first : objs[-1].start + objs[-1].m - first]
            views = [_slot_runs(reg.pool, sl[o.start - lo : o.start - lo + o.m]) for o in objs]
            u8 = None
            if None in views:  # no zero-copy access: ONE gather for the transfer
                u8 = self._gather(reg, sl, None).reshape(len(sl), -1).view(np.uint8)  # [pages, slot_bytes]
            for o, v in zip(objs, views):
                if time.monotonic() >= deadline.end:
                    r: Any = TimeoutError(f"write of {o.path} did not start by the deadline")
                else:
                    payload: Payload = v if u8 is None else u8[o.start - lo : o.start - lo + o.m]
                    try:
                        header = reg.header.encode(bytes.fromhex(o.key), o.start, o.m, payload,
                                                   self._link_keys(reg, keys, first, o))
                        r = io.write_once_local(o.path, header, payload, mtimes[i], self._link_paths(reg, keys, first, o))
                    except OSError as e:
                        r = e
                i += 1
                self._record_write(queries, o, r, mark, written, tally)
        self._count(**tally)

    # ---- file:// capacity ------------------------------------------------------------------------
    def _scan(self) -> None:
        """Index of every published object name: path -> (bytes, mtime_ns, inode). An object's
        link names share its inode: its bytes count once, on the first name seen."""
        idx: dict[str, tuple[int, int, int]] = {}
        seen: set[int] = set()
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
                if not _is_published(st):  # being written (its writer accounts it), or a crashed one's
                    _drop_if_stale(p, st)
                    continue
                size = 0 if st.st_ino in seen else st.st_size
                seen.add(st.st_ino)
                idx[p] = (size, st.st_mtime_ns, st.st_ino)
                used += size
        self._index, self._used = idx, used

    def _account(self, written: list[tuple[str, int]]) -> None:
        cap = self.config.max_bytes
        assert cap is not None
        with self._lock:
            if self._index is None:
                self._scan()
            else:
                now = time.time_ns()
                for p, s in written:
                    if p not in self._index:
                        self._used += s
                    self._index[p] = (s, now, -1)  # inode: read at the next scan (before any eviction)
            if self._used <= cap:
                return
            self._scan()  # include other processes' writes, fresh mtimes (read bumps)
            if self._used <= cap:
                return
            goal = int(cap * self.config.evict_low_watermark)
            names: dict[int, list[str]] = {}
            for p, (_, _, ino) in self._index.items():
                names.setdefault(ino, []).append(p)
            for p, (_, _, ino) in sorted(self._index.items(), key=lambda kv: kv[1][1]):
                if self._used <= goal:
                    break
                if p not in self._index:  # gone with another name of its object
                    continue
                freed = 0
                for q in names[ino]:  # every name of the object: its bytes are freed with the last
                    try:
                        os.unlink(q)
                    except FileNotFoundError:
                        pass
                    except OSError:
                        self._counters["errors"] += 1
                        continue
                    freed += self._index.pop(q, (0,))[0]
                self._used -= freed
                self._counters["evicted_objects"] += 1
                self._counters["evicted_bytes"] += freed

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
