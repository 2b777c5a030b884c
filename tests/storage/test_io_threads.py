"""``DaemonThreadPool``: results and exceptions through futures, daemon threads up to the cap,
queued items cancelled at shutdown, no submit after it. Synchronised by events, never by sleeping."""

from __future__ import annotations

import threading

import pytest

from hicache.storage.io_threads import DaemonThreadPool

JOIN_S = 60.0  # a bound for a wait that must end; never a timing assertion


def test_results_exceptions_and_daemon_threads_up_to_the_cap():
    pool = DaemonThreadPool(2, "t")
    gate = threading.Event()
    started = threading.Semaphore(0)

    def blocked(i: int) -> int:
        started.release()
        assert gate.wait(JOIN_S)
        return i

    futs = [pool.submit(blocked, i) for i in range(4)]
    assert started.acquire(timeout=JOIN_S) and started.acquire(timeout=JOIN_S)
    assert len(pool._threads) == 2  # two threads at most: the others wait in the queue and all(t.daemon for t in pool._threads)
    gate.set()
    assert [f.result(JOIN_S) for f in futs] == [0, 1, 2, 3]
    bad = pool.submit(lambda: 1 / 0)
    assert isinstance(bad.exception(JOIN_S), ZeroDivisionError)
    pool.shutdown(wait=True)
    assert not any(t.is_alive() for t in pool._threads)
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(int)


def test_shutdown_cancels_queued_items_without_waiting():
    pool = DaemonThreadPool(1, "t")
    gate, started = threading.Event(), threading.Event()

    def blocked() -> bool:
        started.set()
        return gate.wait(JOIN_S)

    running = pool.submit(blocked)
    assert started.wait(JOIN_S)
    queued = pool.submit(int)
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled() and not running.done()
    gate.set()
    assert running.result(JOIN_S) is True


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_bad_worker_counts_name_the_value(bad):
    with pytest.raises(ValueError, match=repr(bad)):
        DaemonThreadPool(bad, "t")
