"""file:// byte cap: least-recently-used eviction of page objects under one root.

Recency is the object file's mtime. Objects written or read together get mtimes in chain order,
shallow pages newest (``touch``), so eviction takes a chain's deep end first and keeps the prefix
that most requests share; a read makes its objects newer than any write before it. When the
objects under the root exceed ``max_bytes`` after a write, the directory is rescanned (other
processes sharing the root write too) and the oldest objects are deleted down to
``low_watermark * max_bytes``. Manifest entries are not counted (tiny); temp files of crashed
writers (``object_store.TMP_PREFIX``, over an hour old) are removed by the scan. A leading-page
index entry (``leading_index``) is counted and evicted with the object it names (one unit, the
object's recency); an entry whose object is gone (deleted by another process, or as corrupt) is
evicted before any object, so no entry outlives the eviction pass that finds it orphaned.

gs:// has no byte cap here: use bucket lifecycle rules (``fsspec_store``'s docstring).

Threads: called by ``FsspecStorage`` on the calling thread of a ``batch_get`` / ``batch_set``
(after its I/O), from any number of threads; the index is guarded by this object's lock. The
filesystem operations (utime, walk, unlink) run on that calling thread.
"""

from __future__ import annotations

import os
import threading
import time
from typing import NamedTuple

from hicache.storage.chunking import Chunking
from hicache.storage.object_store import TMP_PREFIX

STALE_TMP_S = 3600.0  # a temp file this old belongs to a crashed writer


def chain_order_mtimes(n: int) -> list[int]:
    """mtimes (ns) for ``n`` objects in chain order, shallow pages newest (file timestamps come
    from a coarse kernel clock, so the order of writes alone would tie)."""
    now = time.time_ns()
    return [now - i * 1000 for i in range(n)]


class Evicted(NamedTuple):
    objects: int = 0
    bytes: int = 0  # objects' and index entries'
    errors: int = 0  # objects that could not be deleted
    entries: int = 0  # index entries deleted (with their objects, or orphaned)


class Unit(NamedTuple):
    """What eviction deletes at once: a page object and its index entries, or an orphaned entry
    (``objects == 0``: the path itself is the entry; recency 0, so evicted first)."""

    bytes: int
    mtime_ns: int
    entries: tuple[str, ...] = ()
    objects: int = 1


def scan(top: str) -> tuple[dict[str, Unit], int]:
    """Every page object under ``top`` with its index entries: ``({path: Unit}, total bytes)``."""
    idx: dict[str, Unit] = {}
    entries: list[tuple[str, str, int]] = []  # (entry, its object, bytes)
    used = 0
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
            if f.startswith(TMP_PREFIX):
                if now - st.st_mtime > STALE_TMP_S:
                    try:
                        os.unlink(p)
                    except OSError:
                        pass
                continue
            used += st.st_size
            obj = Chunking.object_of_index_entry(p)
            if obj is None:
                idx[p] = Unit(st.st_size, st.st_mtime_ns)
            else:
                entries.append((p, obj, st.st_size))
    for p, obj, size in entries:
        u = idx.get(obj)
        idx[obj if u is not None else p] = (u._replace(bytes=u.bytes + size, entries=u.entries + (p,))
                                            if u is not None else Unit(size, 0, (), 0))
    return idx, used


class ByteCapLRU:
    """The byte cap of the page objects under directory ``top`` (module docstring)."""

    def __init__(self, top: str, max_bytes: int, low_watermark: float) -> None:
        self.top = top
        self.max_bytes = max_bytes
        self.low_watermark = low_watermark
        self._lock = threading.Lock()
        self._index: dict[str, Unit] | None = None  # object path -> its unit; built lazily
        self._used = 0

    def touch(self, paths: list[str]) -> None:
        """Marks the objects at ``paths`` (in chain order) used now."""
        for p, mt in zip(paths, chain_order_mtimes(len(paths))):
            try:
                os.utime(p, ns=(mt, mt))
            except OSError:
                pass

    def add(self, written: list[tuple[str, int]]) -> Evicted:
        """Accounts objects just written (``(path, bytes)`` in chain order) and evicts if the root
        is over the cap."""
        self.touch([p for p, _ in written])
        with self._lock:
            if self._index is None:
                self._index, self._used = scan(self.top)
            else:
                now = time.time_ns()
                for p, size in written:
                    if p not in self._index:
                        self._used += size
                    self._index[p] = Unit(size, now)  # (bytes only: eviction rescans first)
            if self._used <= self.max_bytes:
                return Evicted()
            self._index, self._used = scan(self.top)  # other processes' writes, read bumps
            return self._evict_locked()

    def _evict_locked(self) -> Evicted:
        assert self._index is not None
        goal = int(self.max_bytes * self.low_watermark)
        n = freed = errors = entries = 0
        for p, u in sorted(self._index.items(), key=lambda kv: kv[1].mtime_ns):
            if self._used <= goal and u.objects:
                break
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
            except OSError:
                errors += 1
                continue
            for e in u.entries:  # after the object: an entry never names a missing object for long
                try:
                    os.unlink(e)
                except OSError:  # (a leftover entry dangles: a miss, removed by the next pass)
                    pass
            del self._index[p]
            self._used -= u.bytes
            n += u.objects
            entries += len(u.entries) + 1 - u.objects
            freed += u.bytes
        return Evicted(n, freed, errors, entries)

    def forget(self, path: str) -> None:
        """``path`` was deleted by someone else (a corrupt object)."""
        with self._lock:
            if self._index is not None and path in self._index:
                self._used -= self._index.pop(path).bytes

    def rescan(self) -> int:
        """Bytes of page objects under the root now (rescans the directory)."""
        with self._lock:
            self._index, self._used = scan(self.top)
            return self._used

    def tracked_bytes(self) -> int:
        """Bytes as last accounted (-1 before the first write or rescan)."""
        with self._lock:
            return self._used if self._index is not None else -1
