"""Batches of object-store calls under one deadline: where L3 I/O runs, how long it may take, what
is retried, and when the location's breaker stops it.

``FsspecStorage`` hands every backend call to a ``BatchIO`` as a batch (one per round of a
``batch_exists`` / ``batch_get`` / ``batch_set``, a listing, a delete) with the call's
``Deadline``. Results come back as one list in item order; each item is a value or the exception it
raised (``TimeoutError`` for items not finished by the deadline), never raised (``list`` raises its
one error).

- ``ThreadBatchIO`` (sync filesystems: file://, memory://, any other): the items run on this
  object's I/O threads (``io_threads.DaemonThreadPool``: daemon threads). Items not finished by
  the deadline are abandoned, not cancelled (a thread cannot be): they go on in the background
  until the backend returns, and never hold process exit; past ``max_pending``
  abandoned items every new item fails fast (``BlockingIOError``, a timeout kind) instead of
  queueing behind a hung backend.
- ``InlineBatchIO`` (file:// on this host's own disk, ``StorageConfig.local_io``): the items run on
  the calling thread, in order; an item starts only while the deadline has not passed (one already
  running is not stopped: a local file call ends within the kernel's own I/O bounds).
- ``LoopBatchIO`` (async filesystems: gcsfs): the items run as coroutines on the filesystem's event
  loop, at most ``limit`` at once; at the deadline the caller stops waiting and every unfinished
  item is cancelled (the ``CancelledError`` lands wherever it waits: a request, a retry backoff), so
  nothing of a call outlives it. gcsfs' own retries are off (``object_store.own_retries``).

Retries are ours (``RetryPolicy``): a transient error (``errors.is_transient``: connection errors,
408/429/5xx, EIO) is retried up to ``retries`` times with doubling backoff, only while the backoff
ends before the deadline.

Breaker (``breaker.Breaker``, one per store): a batch the open breaker does not allow fails fast
with ``StorageUnavailableError`` per item, without touching the network; every batch let through
reports its outcome (any answer; any timeout or connection error; every item refused), once per
call as a failure (the call's ``Deadline`` remembers that a round of it failed).

Mixed rounds (``mixed``): existence checks, reads and listings of one call that do not depend on
each other go out as one round (``IoItem`` each; an item may end earlier than the round, so a slow
listing beside a round's existence checks costs only its own answer, and its running out of that
earlier end is a slow answer, not a failure: it does not count toward the breaker).

``read_many``'s ``post(i, bytes)`` (verification, and landing pages in a pool that allows it) runs
where the read finished: on an I/O thread, or on the loop. Everything else of a call runs on the
calling thread, which waits at most until the deadline (plus twice ``LOOP_GRACE_S`` on gcsfs' loop:
cancelled items get one to unwind, the loop one to hand the batch back).
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures as cf
import enum
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, NamedTuple

import numpy as np

from hicache.storage.breaker import Breaker
from hicache.storage.errors import TRIPS_BREAKER, ErrorKind, StorageUnavailableError, classify, is_transient
from hicache.storage.io_threads import DaemonThreadPool
from hicache.storage.object_store import AsyncFsspecObjectStore, ObjectStore

MakeObject = Callable[[], tuple[bytes, np.ndarray]]  # -> (header, payload), run where the write runs
SyncCall = Callable[..., Any]  # one item's work on a sync backend
AsyncCall = Callable[..., Coroutine[Any, Any, Any]]  # the same on an async backend
Stat = tuple[int, "str | None"]  # (stored size, generation)
LOOP_GRACE_S = 0.05  # cancelled items' time to unwind; the loop's to hand back a batch


class Deadline:
    """The end of one storage call (monotonic clock), and whether a round of that call already
    counted a failure toward the breaker (``failed``: its later failed rounds do not count again)."""

    __slots__ = ("end", "failed")

    def __init__(self, timeout_s: float) -> None:
        self.end = time.monotonic() + timeout_s
        self.failed = False

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())


class IoKind(str, enum.Enum):
    """What one item of a mixed round does (``BatchIO.mixed``)."""

    EXISTS = "exists"  # -> bool
    READ = "read"  # -> post(bytes)
    LIST = "list"  # -> paths under the item's path


class IoItem(NamedTuple):
    """One item of a mixed round: ``post`` (reads) runs where the read finished; ``end``: this item
    gives up by then (None: the round's deadline), e.g. a listing that may only cost itself."""

    kind: IoKind
    path: str
    post: Callable[[Any], Any] | None = None
    end: Deadline | None = None
    first: int | None = None  # listings: only the first that many paths in name order (``ObjectStore.list``)


class RetryPolicy(NamedTuple):
    retries: int  # extra attempts after a transient error
    backoff_s: float  # before the first retry; doubles per retry


class BatchIO(abc.ABC):
    """Runs object-store primitives over a batch of paths (module docstring)."""

    def __init__(self, store: ObjectStore, breaker: Breaker, retry: RetryPolicy) -> None:
        self.store = store
        self.breaker = breaker
        self.retry = retry
        self.retried = 0  # retries made (monotonic; read by stats)
        self._closed = False

    @abc.abstractmethod
    def _map(self, fn: SyncCall, afn: AsyncCall, items: Sequence[tuple], deadline: Deadline,
             ends: Sequence[Deadline] | None = None) -> list[Any]:
        """``fn(*item)`` (sync backends) or ``await afn(*item)`` (async) for every item: results
        or exceptions, in item order. ``ends[i]``: item ``i``'s own deadline (none past
        ``deadline``)."""

    def _run(self, fn: SyncCall, afn: AsyncCall, items: Sequence[tuple], deadline: Deadline,
             ends: Sequence[Deadline] | None = None) -> list[Any]:
        """``_map`` behind the breaker: fail fast if it is open, else report the outcome to it."""
        if not items:
            return []
        if self._closed:
            return [StorageUnavailableError("storage is closed")] * len(items)
        if deadline.left() <= 0:  # an earlier round spent the call's time: not the backend's fault
            return [TimeoutError("the call's deadline passed before this round")] * len(items)
        if not self.breaker.allow():
            return [StorageUnavailableError("storage location marked unavailable (breaker open)")] * len(items)
        out: list[Any] = []
        try:
            out = self._map(fn, afn, items, deadline, ends)
        finally:
            # an item that ran out its own earlier end is slow, not failed: it never trips the breaker
            kinds = [classify(r) if isinstance(r, BaseException) and not (
                ends is not None and isinstance(r, TimeoutError) and ends[i].end < deadline.end) else None
                for i, r in enumerate(out)]
            tripped = not out or any(k in TRIPS_BREAKER for k in kinds)
            self.breaker.record(answered=any(k not in TRIPS_BREAKER and k is not ErrorKind.UNAVAILABLE for k in kinds),
                                tripped=tripped, refused=bool(kinds) and all(k is ErrorKind.REFUSED for k in kinds),
                                repeat=deadline.failed)
            deadline.failed = deadline.failed or tripped
        return out

    # ---- our retry policy ------------------------------------------------------------------
    def _next_delay(self, e: BaseException, attempt: int, delay: float, deadline: Deadline) -> float | None:
        """The backoff before retrying after ``e`` (attempt ``attempt``), or None: give up."""
        if attempt >= self.retry.retries or not is_transient(e) or deadline.left() <= delay:
            return None
        self.retried += 1  # (a lost increment under a race only blurs a statistic)
        return delay

    def _retrying(self, call: SyncCall, deadline: Deadline) -> SyncCall:
        def run(*args: Any) -> Any:
            delay, attempt = self.retry.backoff_s, 0
            while True:
                try:
                    return call(*args)
                except Exception as e:
                    wait = self._next_delay(e, attempt, delay, deadline)
                    if wait is None:
                        raise
                    time.sleep(wait)  # on an I/O thread, ending before the deadline
                    delay, attempt = delay * 2, attempt + 1

        return run

    def _aretrying(self, call: AsyncCall, deadline: Deadline) -> AsyncCall:
        async def run(*args: Any) -> Any:
            delay, attempt = self.retry.backoff_s, 0
            while True:
                try:
                    return await call(*args)
                except Exception as e:
                    wait = self._next_delay(e, attempt, delay, deadline)
                    if wait is None:
                        raise
                    await asyncio.sleep(wait)  # cancelled with the item at the deadline
                    delay, attempt = delay * 2, attempt + 1

        return run

    def _astore(self) -> AsyncFsspecObjectStore:
        return self.store  # type: ignore[return-value]  # only LoopBatchIO awaits, over an async store

    # ---- primitives over batches -----------------------------------------------------------
    def exists_many(self, paths: Sequence[str], deadline: Deadline) -> list[Any]:
        exists = self._retrying(self.store.exists, deadline)
        aexists = self._aretrying(lambda p: self._astore().aexists(p), deadline)
        return self._run(exists, aexists, [(p,) for p in paths], deadline)

    def mixed(self, items: Sequence[IoItem], deadline: Deadline) -> list[Any]:
        """One round of existence checks, reads and listings (``IoItem``), each retried by our
        policy: per item its answer or exception, in item order."""
        calls: dict[IoKind, SyncCall] = {IoKind.EXISTS: self._retrying(self.store.exists, deadline),
                                         IoKind.READ: self._retrying(self.store.read, deadline),
                                         IoKind.LIST: self._retrying(self.store.list, deadline)}
        acalls: dict[IoKind, AsyncCall] = {
            IoKind.EXISTS: self._aretrying(lambda p: self._astore().aexists(p), deadline),
            IoKind.READ: self._aretrying(lambda p: self._astore().aread(p), deadline),
            IoKind.LIST: self._aretrying(lambda p, n: self._astore().alist(p, n), deadline)}

        def one(it: IoItem) -> Any:
            r = calls[it.kind](*((it.path,) if it.kind is not IoKind.LIST else (it.path, it.first)))
            return r if it.post is None else it.post(r)

        async def aone(it: IoItem) -> Any:
            r = await acalls[it.kind](*((it.path,) if it.kind is not IoKind.LIST else (it.path, it.first)))
            return r if it.post is None else it.post(r)

        ends = [deadline if it.end is None or it.end.end > deadline.end else it.end for it in items]
        return self._run(one, aone, [(it,) for it in items], deadline, ends)

    def read_many(self, paths: Sequence[str], post: Callable[[int, Any], Any], deadline: Deadline) -> list[Any]:
        """Read each path and apply ``post(i, bytes)`` where the read finished."""
        read = self._retrying(self.store.read, deadline)
        aread = self._aretrying(lambda p: self._astore().aread(p), deadline)

        def one(i: int, p: str) -> Any:
            return post(i, read(p))

        async def aone(i: int, p: str) -> Any:
            return post(i, await aread(p))

        return self._run(one, aone, list(enumerate(paths)), deadline)

    def reread_many(self, paths: Sequence[str], post: Callable[[int, Any, Stat], Any], deadline: Deadline) -> list[Any]:
        """Stat, then read each path whole, fresh; ``post(i, bytes, (size, generation))`` where
        the read finished (the proof that an object is corrupt at rest)."""
        stat = self._retrying(self.store.stat, deadline)
        read = self._retrying(self.store.read, deadline)
        astat = self._aretrying(lambda p: self._astore().astat(p), deadline)
        aread = self._aretrying(lambda p: self._astore().aread(p), deadline)

        def one(i: int, p: str) -> Any:
            st = stat(p)
            return post(i, read(p), st)

        async def aone(i: int, p: str) -> Any:
            st = await astat(p)
            return post(i, await aread(p), st)

        return self._run(one, aone, list(enumerate(paths)), deadline)

    def write_many(self, items: Sequence[tuple[str, MakeObject]], deadline: Deadline) -> list[Any]:
        """Write-once each ``(path, make)`` (``make()`` runs where the write runs): True if this
        call published it, False if another writer had."""
        write_once = self._retrying(self.store.write_once, deadline)
        awrite_once = self._aretrying(lambda p, h, d: self._astore().awrite_once(p, h, d), deadline)

        def write(p: str, make: MakeObject) -> bool:
            try:
                write_once(p, *make())
            except FileExistsError:
                return False
            return True

        async def awrite(p: str, make: MakeObject) -> bool:
            try:
                await awrite_once(p, *make())
            except FileExistsError:
                return False
            return True

        return self._run(write, awrite, items, deadline)

    def delete_many(self, items: Sequence[tuple[str, str | None]], deadline: Deadline) -> list[Any]:
        """Delete each ``(path, generation)`` (conditional on the generation where the backend
        can tell, ``ObjectStore.delete``)."""
        delete = self._retrying(self.store.delete, deadline)
        adelete = self._aretrying(lambda p, g: self._astore().adelete(p, g), deadline)
        return self._run(delete, adelete, items, deadline)

    def list(self, prefix: str, deadline: Deadline) -> list[str]:
        """Paths under ``prefix``; raises the listing's error (``TimeoutError`` at the deadline)."""
        r = self._run(self._retrying(self.store.list, deadline),
                      self._aretrying(lambda p: self._astore().alist(p), deadline), [(prefix,)], deadline)[0]
        if isinstance(r, BaseException):
            raise r
        return r

    def list_dirs(self, prefix: str, deadline: Deadline) -> tuple[str, ...]:
        """Names of the folders directly under ``prefix``; raises the listing's error."""
        r = self._run(self._retrying(self.store.list_dirs, deadline),
                      self._aretrying(lambda p: self._astore().alist_dirs(p), deadline), [(prefix,)], deadline)[0]
        if isinstance(r, BaseException):
            raise r
        return r

    def delete_tree(self, prefix: str, deadline: Deadline) -> None:
        r = self._run(self.store.delete_tree, lambda p: self._astore().adelete_tree(p), [(prefix,)], deadline)[0]
        if isinstance(r, BaseException):
            raise r

    @abc.abstractmethod
    def close(self, timeout_s: float) -> bool:
        """Stop taking work; wait up to ``timeout_s`` for operations in flight, then drop them
        (idempotent). True if nothing was left running."""


class ThreadBatchIO(BatchIO):
    def __init__(self, store: ObjectStore, breaker: Breaker, retry: RetryPolicy, threads: int,
                 max_pending: int | None = None) -> None:
        super().__init__(store, breaker, retry)
        self._ex = DaemonThreadPool(threads, "hicache-l3")  # a hung item never holds process exit
        self._max_abandoned = max_pending or threads * 8
        self._abandoned = 0  # items abandoned at a deadline and still running
        self._inflight: set[cf.Future] = set()  # every submitted item not finished yet
        self._plock = threading.Lock()

    def _map(self, fn: SyncCall, afn: AsyncCall, items: Sequence[tuple], deadline: Deadline,
             ends: Sequence[Deadline] | None = None) -> list[Any]:
        with self._plock:
            saturated = self._abandoned >= self._max_abandoned
        if saturated:
            return [BlockingIOError("storage backend saturated: too many abandoned operations")] * len(items)
        with self._plock:  # in flight before any item can run, so close() sees every one
            try:
                futs = [self._ex.submit(fn, *it) for it in items]
            except RuntimeError:  # closed meanwhile
                return [StorageUnavailableError("storage is closed")] * len(items)
            self._inflight.update(futs)
        for f in futs:  # (outside the lock: a finished future runs its callback right here)
            f.add_done_callback(self._finished)
        done: set[cf.Future] = set()
        # items with an earlier end are waited for first, each group until its own end
        for end in sorted({id(e): e for e in ends or (deadline,)}.values(), key=lambda e: e.end):
            group = futs if ends is None else [f for f, e in zip(futs, ends) if e is end]
            done |= cf.wait(group, timeout=end.left())[0]
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

    def _finished(self, f: cf.Future) -> None:
        with self._plock:
            self._inflight.discard(f)

    def _release(self, _: cf.Future) -> None:
        with self._plock:
            self._abandoned -= 1

    def close(self, timeout_s: float) -> bool:
        self._closed = True
        with self._plock:
            pending = set(self._inflight)
        _, left = cf.wait(pending, timeout=timeout_s)
        self._ex.shutdown(wait=False, cancel_futures=True)
        return not left


class InlineBatchIO(BatchIO):
    def __init__(self, store: ObjectStore, breaker: Breaker, retry: RetryPolicy) -> None:
        super().__init__(store, breaker, retry)
        self._running = 0  # batches running on callers' threads (close waits for them)
        self._idle = threading.Condition()

    def _map(self, fn: SyncCall, afn: AsyncCall, items: Sequence[tuple], deadline: Deadline,
             ends: Sequence[Deadline] | None = None) -> list[Any]:
        out: list[Any] = []
        with self._idle:
            self._running += 1
        try:
            for i, it in enumerate(items):
                if (deadline if ends is None else ends[i]).left() <= 0:
                    out.append(TimeoutError("storage operation did not start before the deadline"))
                    continue
                try:
                    out.append(fn(*it))
                except Exception as e:  # (returned per item, as on the I/O threads)
                    out.append(e)
        finally:
            with self._idle:
                self._running -= 1
                self._idle.notify_all()
        return out

    def close(self, timeout_s: float) -> bool:
        self._closed = True
        with self._idle:
            return self._idle.wait_for(lambda: self._running == 0, timeout=timeout_s)


class LoopBatchIO(BatchIO):
    def __init__(self, store: AsyncFsspecObjectStore, breaker: Breaker, retry: RetryPolicy, limit: int) -> None:
        super().__init__(store, breaker, retry)
        self._loop = store.loop
        self._limit = limit  # concurrent requests; pending ones are cancelled at the deadline
        self._active: set[cf.Future] = set()  # batches running on the loop
        self._alock = threading.Lock()

    def _map(self, fn: SyncCall, afn: AsyncCall, items: Sequence[tuple], deadline: Deadline,
             ends: Sequence[Deadline] | None = None) -> list[Any]:
        limit = self._limit

        async def run() -> list[Any]:
            sem = asyncio.Semaphore(limit)

            async def one(it: tuple, end: Deadline | None) -> Any:
                async with sem:
                    if end is None or end is deadline:
                        return await afn(*it)
                    return await asyncio.wait_for(afn(*it), end.left())  # its own end: a TimeoutError

            tasks = [asyncio.ensure_future(one(it, None if ends is None else ends[i])) for i, it in enumerate(items)]
            try:
                done, pending = await asyncio.wait(tasks, timeout=deadline.left())
            finally:  # also when the caller gave up and cancelled this batch
                for t in tasks:
                    if not t.done():
                        t.cancel()
            if pending:  # let them unwind (close connections, leave waits), briefly
                await asyncio.wait(pending, timeout=LOOP_GRACE_S)
            out: list[Any] = []
            for t in tasks:
                if t in done:
                    exc = t.exception()
                    out.append(exc if exc is not None else t.result())
                else:
                    out.append(TimeoutError("storage operation did not finish by the deadline"))
            return out

        coro = run()
        with self._alock:  # registered before any item can run, so close() sees every batch
            if self._closed:
                coro.close()
                return [StorageUnavailableError("storage is closed")] * len(items)
            try:
                fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
            except RuntimeError as e:  # the loop is closed
                coro.close()
                return [e] * len(items)
            self._active.add(fut)
        try:
            return fut.result(timeout=deadline.left() + 2 * LOOP_GRACE_S)
        except cf.TimeoutError:  # the loop is stuck or slow: cancel the batch there, answer now
            fut.cancel()
            return [TimeoutError("storage event loop did not answer by the deadline")] * len(items)
        except cf.CancelledError:  # close() cancelled it
            return [StorageUnavailableError("storage is closed")] * len(items)
        except Exception as e:
            return [e] * len(items)
        finally:
            with self._alock:
                self._active.discard(fut)

    def close(self, timeout_s: float) -> bool:
        with self._alock:
            self._closed = True
            active = set(self._active)
        _, left = cf.wait(active, timeout=timeout_s)
        for f in left:
            f.cancel()  # cancels the batch's task on the loop, which cancels its items
        return not left


def make_batch_io(store: ObjectStore, breaker: Breaker, retry: RetryPolicy, io_threads: int,
                  max_pending: int | None, inline: bool = False) -> BatchIO:
    """``inline``: the store is local and its calls may run on the calling thread (``InlineBatchIO``)."""
    if isinstance(store, AsyncFsspecObjectStore):
        return LoopBatchIO(store, breaker, retry, io_threads * 4)
    if inline:
        return InlineBatchIO(store, breaker, retry)
    return ThreadBatchIO(store, breaker, retry, io_threads, max_pending)
