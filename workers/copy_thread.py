"""CopyThread: the CPU data plane's "DMA engine" -- one background thread running page copies in order.

On TPU the DMA engines move KV bytes while the host thread goes on; on the CPU backend the bytes
move by numpy copies (``hicache.workers.host_copy``), which release the GIL while they copy (checked
here: during one vectorised 60k-page call on this thread, another thread ran Python at 90-130 % of
its rate alone, f32 and bf16 layouts, both directions). A ``CopyThread`` runs such copies on a
second thread (``hicache.workers.transfer.DataPath.HOST_THREAD``). The thread needs the GIL to wake
and between its numpy calls, so it overlaps the owner thread only while that one gives the GIL
away (blocks, or runs GIL-free C); see the transfer module for what that measured.

Contract:

* jobs run one at a time, in submission order (FIFO): a job starts only after every earlier job
  finished, so copies submitted in plan order land in plan order;
* ``CopyJob.is_ready`` turns true only once the job's function returned (its bytes are in place) or
  raised (``CopyJob.error``); ``wait(timeout_s)`` blocks, bounded, without holding the GIL;
* ``cancel`` withdraws a job that has not started (it then never runs); a running job cannot be
  stopped (a numpy copy of bounded size), so callers wait for it;
* ``drain(timeout_s)`` waits for every job submitted so far (``TimeoutError`` past the bound);
* ``close(timeout_s)`` refuses new jobs, lets the queued ones finish (bounded) and ends the thread.

Who owns what: the thread owns nothing. A job holds references to the arrays it reads and writes
until it finished (then drops them), so no buffer it touches is freed under it; *when* a buffer
may be touched concurrently is the submitter's rule (``hicache.workers.transfer``). The thread is
started on the first job (a worker that never copies asynchronously has no thread) and is a
daemon: a process may exit with it parked.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

_QUEUED, _RUNNING, _FINISHED, _CANCELLED = range(4)


class CopyJob:
    """One submitted copy: ``fn(*args)`` on the copy thread."""

    __slots__ = ("_fn", "_args", "_state", "_state_lock", "_done", "error")

    def __init__(self, fn: Callable[..., object], args: tuple) -> None:
        self._fn, self._args = fn, args
        self._state = _QUEUED
        self._state_lock = threading.Lock()
        self._done = threading.Lock()  # held until the job finished or was cancelled
        self._done.acquire()
        self.error: BaseException | None = None

    def is_ready(self) -> bool:
        """True once the job finished (bytes in place, or ``error`` set) or was cancelled."""
        return self._state >= _FINISHED

    def wait(self, timeout_s: float) -> bool:
        """Blocks (GIL released) until ready; ``False`` if ``timeout_s`` passed first."""
        if self._state >= _FINISHED:
            return True
        if not self._done.acquire(timeout=max(0.0, timeout_s)):
            return False
        self._done.release()
        return True

    def cancel(self) -> bool:
        """Withdraws the job if it has not started; True if it will never run (or never ran)."""
        with self._state_lock:
            if self._state == _QUEUED:
                self._state = _CANCELLED
                self.error = RuntimeError("copy cancelled before it started")
                self._fn = self._args = None  # type: ignore[assignment]
                self._done.release()
            return self._state == _CANCELLED

    def _run(self) -> None:
        with self._state_lock:
            if self._state != _QUEUED:
                return  # cancelled
            self._state = _RUNNING
        try:
            self._fn(*self._args)
        except BaseException as e:  # reported to the waiter, never raised on the copy thread
            self.error = e
        self._fn = self._args = None  # type: ignore[assignment]  # drop the buffers' references
        self._state = _FINISHED
        self._done.release()


class CopyThread:
    """A FIFO of ``CopyJob``s served by one daemon thread (see the module docstring)."""

    def __init__(self, name: str = "copy") -> None:
        self.name = name
        self._queue: queue.SimpleQueue[CopyJob | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._last: CopyJob | None = None  # the latest job submitted (FIFO: done => all done)
        self._closed = False

    def submit(self, fn: Callable[..., object], *args: object) -> CopyJob:
        """Queues ``fn(*args)`` behind every job submitted before; returns its job at once."""
        if self._closed:
            raise RuntimeError(f"copy thread {self.name!r} is closed")
        job = CopyJob(fn, args)
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self._thread.start()
        self._queue.put(job)
        self._last = job
        return job

    @property
    def idle(self) -> bool:
        """True when every submitted job is ready (nothing queued or running)."""
        last = self._last
        return last is None or last.is_ready()

    def drain(self, timeout_s: float) -> None:
        """Waits until every job submitted so far is ready; ``TimeoutError`` after ``timeout_s``."""
        last = self._last
        if last is None:
            return
        if not last.wait(timeout_s):
            raise TimeoutError(f"copy thread {self.name!r}: copies still running after {timeout_s} s")
        if self._last is last:
            self._last = None

    def close(self, timeout_s: float) -> bool:
        """Refuses new jobs, lets the queued ones finish and ends the thread, waiting at most
        ``timeout_s``; True if everything finished in time (else the daemon thread finishes the
        queue on its own, holding the buffers it needs)."""
        self._closed = True
        thread = self._thread
        if thread is None:
            return True
        self._queue.put(None)
        thread.join(timeout=max(0.0, timeout_s))
        return not thread.is_alive()

    def _serve(self) -> None:
        get = self._queue.get
        while True:
            job = get()
            if job is None:
                return
            job._run()
