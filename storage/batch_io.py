"""Batches of object-store calls under one deadline: where L3 I/O runs and how long it may take.

``FsspecStorage`` hands every backend call to a ``BatchIO`` as a batch (one per round of a
``batch_exists`` / ``batch_get`` / ``batch_set``) with the call's ``Deadline``. Results come back as
one list in item order; each item is a value or the exception it raised (``TimeoutError`` for items
not finished by the deadline), never raised.

- ``ThreadBatchIO`` (sync filesystems: file://, memory://, any other): the items run on this
  object's I/O threads. Items not finished by the deadline are abandoned, not cancelled: they go on
  in the background until the backend returns; past ``max_pending`` abandoned items every new item
  fails fast (``BlockingIOError``) instead of queueing behind a hung backend.
- ``LoopBatchIO`` (async filesystems: gcsfs): the items run as coroutines on the filesystem's event
  loop, at most ``limit`` at once; items not finished by the deadline are cancelled.

``read_many``'s ``post(i, bytes)`` (verification, and landing pages in a pool that allows it) runs
where the read finished: on an I/O thread, or on the loop. Listing and ``delete_tree`` run on the
calling thread. Issue #23 adds per-call deadlines that hold whatever the client library does, and a
breaker, here.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures as cf
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import fsspec.asyn
import numpy as np

from hicache.storage.object_store import AsyncFsspecObjectStore, ObjectStore

MakeObject = Callable[[], tuple[bytes, np.ndarray]]  # -> (header, payload), run where the write runs
SyncCall = Callable[..., Any]  # one item's work on a sync backend
AsyncCall = Callable[..., Coroutine[Any, Any, Any]]  # the same on an async backend


class Deadline:
    """The end of one storage call (monotonic clock)."""

    __slots__ = ("end",)

    def __init__(self, timeout_s: float) -> None:
        self.end = time.monotonic() + timeout_s

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())


class BatchIO(abc.ABC):
    """Runs object-store primitives over a batch of paths (module docstring)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    @abc.abstractmethod
    def _map(self, fn: SyncCall, afn: AsyncCall, items: Sequence[tuple], deadline: Deadline) -> list[Any]:
        """``fn(*item)`` (sync backends) or ``await afn(*item)`` (async) for every item: results
        or exceptions, in item order."""

    def exists_many(self, paths: Sequence[str], deadline: Deadline) -> list[Any]:
        store = self.store

        async def aexists(p: str) -> bool:
            return await store.aexists(p)  # type: ignore[attr-defined]

        return self._map(store.exists, aexists, [(p,) for p in paths], deadline)

    def read_many(self, paths: Sequence[str], post: Callable[[int, Any], Any], deadline: Deadline) -> list[Any]:
        """Read each path and apply ``post(i, bytes)`` where the read finished."""
        store = self.store

        def read(i: int, p: str) -> Any:
            return post(i, store.read(p))

        async def aread(i: int, p: str) -> Any:
            return post(i, await store.aread(p))  # type: ignore[attr-defined]

        return self._map(read, aread, list(enumerate(paths)), deadline)

    def write_many(self, items: Sequence[tuple[str, MakeObject]], deadline: Deadline) -> list[Any]:
        """Write-once each ``(path, make)`` (``make()`` runs where the write runs): True if this
        call published it, False if another writer had."""
        store = self.store

        def write(p: str, make: MakeObject) -> bool:
            try:
                store.write_once(p, *make())
            except FileExistsError:
                return False
            return True

        async def awrite(p: str, make: MakeObject) -> bool:
            try:
                await store.awrite_once(p, *make())  # type: ignore[attr-defined]
            except FileExistsError:
                return False
            return True

        return self._map(write, awrite, items, deadline)

    def delete_many(self, paths: Sequence[str], deadline: Deadline) -> list[Any]:
        store = self.store

        async def adelete(p: str) -> None:
            await store.adelete(p)  # type: ignore[attr-defined]

        return self._map(store.delete, adelete, [(p,) for p in paths], deadline)

    def list(self, prefix: str) -> list[str]:
        return self.store.list(prefix)

    def delete_tree(self, prefix: str) -> None:
        self.store.delete_tree(prefix)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop taking work (idempotent)."""


class ThreadBatchIO(BatchIO):
    def __init__(self, store: ObjectStore, threads: int, max_pending: int | None = None) -> None:
        super().__init__(store)
        self._ex = cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hicache-l3")
        self._max_abandoned = max_pending or threads * 8
        self._abandoned = 0  # items abandoned at a deadline and still running
        self._plock = threading.Lock()

    def _map(self, fn: SyncCall, afn: AsyncCall, items: Sequence[tuple], deadline: Deadline) -> list[Any]:
        with self._plock:
            saturated = self._abandoned >= self._max_abandoned
        if saturated:
            return [BlockingIOError("storage backend saturated: too many abandoned operations")] * len(items)
        futs = [self._ex.submit(fn, *it) for it in items]
        done, _ = cf.wait(futs, timeout=deadline.left())
        out: list[Any] = []
        for f in futs:
            if f in done:
                exc = f.exception()
                out.append(exc if exc is not None else f.result())
            else:  # abandoned: it still runs (harmlessly) in the background; not cancelled, because
                # a cancelled item would sit in the executor queue uncounted
                with self._plock:
                    self._abandoned += 1
                f.add_done_callback(self._release)
                out.append(TimeoutError("storage operation did not finish by the deadline"))
        return out

    def _release(self, _: cf.Future) -> None:
        with self._plock:
            self._abandoned -= 1

    def close(self) -> None:
        self._ex.shutdown(wait=False, cancel_futures=True)


class LoopBatchIO(BatchIO):
    def __init__(self, store: AsyncFsspecObjectStore, limit: int) -> None:
        super().__init__(store)
        self._astore = store
        self._limit = limit  # concurrent requests; pending ones are cancelled at the deadline

    def _map(self, fn: SyncCall, afn: AsyncCall, items: Sequence[tuple], deadline: Deadline) -> list[Any]:
        if not items:
            return []
        limit = self._limit

        async def run() -> list[Any]:
            sem = asyncio.Semaphore(limit)

            async def one(it: tuple) -> Any:
                async with sem:
                    return await afn(*it)

            tasks = [asyncio.ensure_future(one(it)) for it in items]
            done, pending = await asyncio.wait(tasks, timeout=deadline.left())
            for t in pending:
                t.cancel()
            out: list[Any] = []
            for t in tasks:
                if t in done:
                    exc = t.exception()
                    out.append(exc if exc is not None else t.result())
                else:
                    out.append(TimeoutError("storage operation did not finish by the deadline"))
            return out

        try:
            return fsspec.asyn.sync(self._astore.loop, run, timeout=deadline.left() + 5.0)
        except Exception as e:  # loop stuck or gone: every item fails
            return [e] * len(items)


def make_batch_io(store: ObjectStore, io_threads: int, max_pending: int | None) -> BatchIO:
    if isinstance(store, AsyncFsspecObjectStore):
        return LoopBatchIO(store, io_threads * 4)
    return ThreadBatchIO(store, io_threads, max_pending)
