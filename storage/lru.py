"""file:// byte cap: least-recently-used eviction of page objects under one root.

Recency is the object file's mtime. Objects written or read together get mtimes in chain order,
shallow pages newest (``touch``), so eviction takes a chain's deep end first and keeps the prefix
that most requests share; a read makes its objects newer than any write before it. When the
objects under the root exceed ``max_bytes`` after a write, the directory is rescanned (other
processes sharing the root write too) and the oldest objects are deleted down to
``low_watermark * max_bytes``. Manifest entries are not counted (tiny); temp files of crashed
writers (``object_store.TMP_PREFIX``, over an hour old) are removed by the scan.

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

from hicache.storage.object_store import TMP_PREFIX

STALE_TMP_S = 3600.0  # a temp file this old belongs to a crashed writer


def chain_order_mtimes(n: int) -> list[int]:
    """mtimes (ns) for ``n`` objects in chain order, shallow pages newest (file timestamps come
    from a coarse kernel clock, so the order of writes alone would tie)."""
    now = time.time_ns()
    return [now - i * 1000 for i in range(n)]


class Evicted(NamedTuple):
    objects: int = 0
    bytes: int = 0
    errors: int = 0  # objects that could not be deleted


def scan(top: str) -> tuple[dict[str, tuple[int, int]], int]:
    """Every page object under ``top``: ``({path: (bytes, mtime_ns)}, total bytes)``."""
    idx: dict[str, tuple[int, int]] = {}
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
            idx[p] = (st.st_size, st.st_mtime_ns)
            used += st.st_size
    return idx, used


class ByteCapLRU:
    """The byte cap of the page objects under directory ``top`` (module docstring)."""

    def __init__(self, top: str, max_bytes: int, low_watermark: float) -> None:
        self.top = top
        self.max_bytes = max_bytes
        self.low_watermark = low_watermark
        self._lock = threading.Lock()
        self._index: dict[str, tuple[int, int]] | None = None  # path -> (bytes, mtime_ns); built lazily
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
                    self._index[p] = (size, now)
            if self._used <= self.max_bytes:
                return Evicted()
            self._index, self._used = scan(self.top)  # other processes' writes, read bumps
            return self._evict_locked()

    def _evict_locked(self) -> Evicted:
        assert self._index is not None
        goal = int(self.max_bytes * self.low_watermark)
        n = freed = errors = 0
        for p, (size, _) in sorted(self._index.items(), key=lambda kv: kv[1][1]):
            if self._used <= goal:
                break
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
            except OSError:
                errors += 1
                continue
            del self._index[p]
            self._used -= size
            n += 1
            freed += size
        return Evicted(n, freed, errors)

    def forget(self, path: str) -> None:
        """``path`` was deleted by someone else (a corrupt object)."""
        with self._lock:
            if self._index is not None and path in self._index:
                self._used -= self._index.pop(path)[0]

    def rescan(self) -> int:
        """Bytes of page objects under the root now (rescans the directory)."""
        with self._lock:
            self._index, self._used = scan(self.top)
            return self._used

    def tracked_bytes(self) -> int:
        """Bytes as last accounted (-1 before the first write or rescan)."""
        with self._lock:
            return self._used if self._index is not None else -1
