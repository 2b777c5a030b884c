"""``DaemonThreadPool``: the I/O threads of a sync storage backend, which never hold the process.

A ``concurrent.futures.ThreadPoolExecutor`` joins its threads at interpreter exit, so one thread
blocked in a hung backend call (a sync filesystem has no way to cancel it) would keep the process
from exiting, beyond every deadline. This pool's threads are daemon threads: ``batch_io``
abandons an item at its deadline, ``close`` stops waiting at its own, and the process may exit
while an abandoned item still blocks.

The same ``Executor`` surface (``submit``, ``shutdown(wait, cancel_futures)``), so ``batch_io``
waits on its futures with ``concurrent.futures.wait``. Threads start on demand up to
``max_workers`` (one per submit while none is idle) and end at ``shutdown``. Any thread may submit;
items run in submission order on whichever thread is free.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any

_Item = tuple[cf.Future, Callable[..., Any], tuple, dict]


class DaemonThreadPool(cf.Executor):
    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers must be an int >= 1, got {max_workers!r}")
        self._max = max_workers
        self._prefix = thread_name_prefix
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # threads waiting for an item
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._names = itertools.count()
        self._shutdown = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future:
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            f: cf.Future = cf.Future()
            self._queue.put((f, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max:
                t = threading.Thread(target=self._work, name=f"{self._prefix}_{next(self._names)}", daemon=True)
                t.start()
                self._threads.append(t)
            return f

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:  # shutdown
                return
            f, fn, args, kwargs = item
            if f.set_running_or_notify_cancel():
                try:
                    r = fn(*args, **kwargs)
                except BaseException as e:  # (the future carries it to the waiter)
                    f.set_exception(e)
                else:
                    f.set_result(r)
            del item, f  # drop references to the result before idling
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no more items; ``cancel_futures``: cancel the queued ones; ``wait``: join the
        threads (each ends after its current item)."""
        with self._lock:
            self._shutdown = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in threads:
            self._queue.put(None)
        if wait:
            for t in threads:
                t.join()
