"""Storage ops (H2S/S2H) run on the worker's storage threads (one per direction): ``submit`` does not
wait for them, they are acked through ``poll``/``wait``, keep the slot ordering rules, and a hung one never holds back
D2H/H2D acks."""

from __future__ import annotations

import inspect
import threading
import time

import jax
import numpy as np
import pytest

from hicache.workers import HostWorker, KVCacheSpec, OpKind, TransferOp, TransferPlan, storage_exec

SPEC = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32")
_seq = iter(range(1, 10**6))


def _plan(*ops) -> TransferPlan:
    return TransferPlan(next(_seq), tuple(ops))


def _op(op_id, kind, pages, slots, keys=()):
    return TransferOp(op_id, OpKind(kind), np.asarray(pages, np.int32), np.asarray(slots, np.int32), tuple(keys))


def _pages(worker: HostWorker, n: int, seed: int) -> np.ndarray:
    shape = (n, *worker.device_pool.host_row_shape)
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


@pytest.fixture
def worker():
    w = HostWorker(SPEC, 16, 16, devices=[jax.devices()[0]])
    yield w
    w.close()


def test_hung_storage_op_does_not_block_submit_or_device_acks(worker):
    release = threading.Event()
    ran_on = []

    def executor(op, pool):
        ran_on.append(threading.current_thread().name)
        release.wait(30)
        return op.num_pages * pool.slot_bytes

    worker.storage_executor = executor
    worker.device_pool.write_pages([1], _pages(worker, 1, 0))
    t0 = time.perf_counter()
    worker.submit(_plan(_op(1, "h2s", [], [5], ["k"])))
    worker.submit(_plan(_op(2, "d2h", [1], [6]), _op(3, "h2d", [6], [2])))
    # submit never waited for the storage call (it blocks 30 s; the bound is loose for loaded hosts)
    assert time.perf_counter() - t0 < 20
    acks = worker.wait(timeout_s=0.5)  # the storage op is still running: the device ops are acked
    assert sorted(a.op_id for a in acks) == [2, 3] and all(a.ok for a in acks)
    assert worker.num_pending == 1 and worker.poll() == []
    release.set()
    (ack,) = worker.wait(timeout_s=10)
    assert ack.op_id == 1 and ack.ok and ack.bytes_moved == SPEC.page_bytes
    assert ran_on and ran_on[0].startswith("storage-")
    worker.storage_executor = None


def test_prefetch_commits_on_ack_and_loads_see_it(worker):
    data = _pages(worker, 2, 1)
    started = threading.Event()

    def executor(op, pool):
        started.set()
        time.sleep(0.2)
        if op.kind is OpKind.PREFETCH_S2H:
            return op.num_pages * pool.slot_bytes, lambda: pool.write_slots(op.host_slots, data)
        return op.num_pages * pool.slot_bytes

    worker.storage_executor = executor
    # S2H into slots 3,4, then (same plan order) a load of those slots: the load waits for the prefetch.
    worker.submit(_plan(_op(1, "s2h", [], [3, 4], ["a", "b"]), _op(2, "h2d", [7, 8], [3, 4])))
    acks = worker.wait(timeout_s=10)
    assert [a.op_id for a in acks] == [1, 2] and all(a.ok for a in acks)
    np.testing.assert_array_equal(worker.device_pool.read_pages([7, 8]), data)
    worker.storage_executor = None


def test_failed_prefetch_leaves_pool_unchanged(worker):
    before = _pages(worker, 1, 2)
    worker.host_pool.write_slots([9], before)
    calls = []

    def executor(op, pool):
        calls.append(op.op_id)
        raise RuntimeError("1 of 1 pages failed")

    worker.storage_executor = executor
    worker.submit(_plan(_op(1, "s2h", [], [9], ["a"])))
    (ack,) = worker.wait(timeout_s=10)
    assert not ack.ok and "pages failed" in ack.error and calls == [1]
    np.testing.assert_array_equal(worker.host_pool.read_slots([9]), before)
    worker.storage_executor = None


def test_backup_to_slot_waits_for_pending_storage_reader(worker):
    old, new = _pages(worker, 1, 3), _pages(worker, 1, 4)
    worker.host_pool.write_slots([10], old)
    worker.device_pool.write_pages([4], new)
    seen = []

    def executor(op, pool):
        time.sleep(0.3)  # the D2H below is submitted meanwhile
        seen.append(pool.read_slots(op.host_slots))
        return op.num_pages * pool.slot_bytes

    worker.storage_executor = executor
    worker.submit(_plan(_op(1, "h2s", [], [10], ["k"])))
    worker.submit(_plan(_op(2, "d2h", [4], [10])))  # writes the slot the H2S still reads
    acks = worker.wait(timeout_s=10)
    assert sorted(a.op_id for a in acks) == [1, 2] and all(a.ok for a in acks)
    np.testing.assert_array_equal(seen[0], old)  # the H2S read the slot before it was overwritten
    np.testing.assert_array_equal(worker.host_pool.read_slots([10]), new)
    worker.storage_executor = None


def test_a_prefetch_does_not_queue_behind_write_backs(worker):
    """Storage ops run on one thread per direction, each in submission order: an L3->L2 prefetch (a
    request may be waiting for it) is done while an earlier L2->L3 write still runs, and a later write
    waits for the earlier one."""
    release = threading.Event()
    order = []

    def executor(op, pool):
        if op.op_id == 1:
            release.wait(60)
        order.append(op.op_id)
        return 0

    worker.storage_executor = executor
    worker.submit(_plan(_op(1, "h2s", [], [1], ["a"]), _op(2, "s2h", [], [2], ["b"])))
    worker.submit(_plan(_op(3, "h2s", [], [2], ["b"])))  # reads what op 2 wrote: waits for its commit
    try:
        acks = worker.wait(timeout_s=60, op_ids=[2])
        assert [a.op_id for a in acks] == [2] and order == [2]  # op 1 still runs, op 3 queues behind it
    finally:
        release.set()
    acks = worker.wait(timeout_s=60)
    assert [a.op_id for a in acks] == [1, 3] and order == [2, 1, 3]
    worker.storage_executor = None


def test_wait_for_named_ops_does_not_wait_for_storage_writes(worker):
    """A load-back waits for its load only: an L2->L3 write still running is neither waited for nor
    acked (if it were waited for, the timer below would release it first and it would be acked)."""
    release = threading.Event()

    def executor(op, pool):
        release.wait(60)
        return op.num_pages * pool.slot_bytes

    worker.storage_executor = executor
    data = _pages(worker, 2, 5)
    worker.device_pool.write_pages([1, 2], data)
    worker.submit(_plan(_op(1, "h2s", [], [5], ["k"])))
    worker.submit(_plan(_op(2, "d2h", [1, 2], [6, 7]), _op(3, "h2d", [9, 10], [6, 7])))
    timer = threading.Timer(10.0, release.set)
    timer.start()
    try:
        acks = worker.wait(timeout_s=60, op_ids=[3])
        assert not release.is_set()
        assert sorted(a.op_id for a in acks) == [2, 3] and all(a.ok for a in acks)
        assert worker.num_pending == 1  # the storage op
        np.testing.assert_array_equal(worker.device_pool.read_pages([9, 10]), data)
        assert worker.wait(timeout_s=60, op_ids={3, 12345}) == []  # acked earlier / unknown: done
    finally:
        release.set()
        timer.cancel()
    (ack,) = worker.wait(timeout_s=30, op_ids=np.array([1]))
    assert ack.op_id == 1 and ack.ok
    worker.storage_executor = None


def test_wait_for_a_storage_op_blocks_until_it_is_acked(worker):
    started = threading.Event()

    def executor(op, pool):
        started.set()
        time.sleep(0.2)
        return op.num_pages * pool.slot_bytes

    worker.storage_executor = executor
    worker.submit(_plan(_op(1, "h2s", [], [5], ["k"]), _op(2, "d2h", [3], [4])))
    acks = worker.wait(timeout_s=30, op_ids=[1])
    assert sorted(a.op_id for a in acks) == [1, 2] and all(a.ok for a in acks) and worker.num_pending == 0
    worker.storage_executor = None


@pytest.mark.parametrize("op_ids, err", [("ab", TypeError), ([1.5], TypeError), ([True], TypeError), (3, TypeError)])
def test_wait_rejects_bad_op_ids(worker, op_ids, err):
    worker.submit(_plan(_op(1, "d2h", [3], [4])))
    with pytest.raises(err, match="op_ids"):
        worker.wait(timeout_s=1, op_ids=op_ids)
    assert [a.op_id for a in worker.wait(timeout_s=30)] == [1]  # state unchanged by the bad call


def test_storage_view_of_the_pool_passes_the_static_protocol_check(worker):
    """Storage checks ``HostPool`` structurally, and Python >= 3.12 reads a protocol's members with
    ``inspect.getattr_static`` (no ``__getattr__`` forwarding): the storage thread's view of the pool
    must hold them itself (a Python 3.12 GPU run failed to attach L3 without this)."""
    view = storage_exec._DeferredWrites(worker.host_pool)
    for name in ("slot_shape", "dtype", "slot_bytes", "read_slots", "write_slots"):
        inspect.getattr_static(view, name)
    assert (view.slot_shape, view.slot_bytes) == (worker.host_pool.slot_shape, worker.host_pool.slot_bytes)


def test_backup_to_storage_and_prefetch_back_are_exact_and_commit_on_the_owner(worker, tmp_path):
    """An L2->L3 backup of scattered slots through the storage thread's view of the pool reads every
    slot, and the prefetch back into other slots is collected on the storage thread: the pool is
    untouched until the owner runs the returned commit, then holds the same bytes."""
    from hicache.storage import ModelFingerprint, Namespace, page_keys

    fp = ModelFingerprint("async-test", SPEC.dtype, SPEC.page_size, SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim)
    ex = storage_exec.StorageExecutor(storage_exec.StorageAttachment(f"file://{tmp_path}/l3", fp, pages_per_object=4), worker.host_pool)
    pool = worker.host_pool
    reads = []
    inner = pool.read_slots
    pool.read_slots = lambda slots: reads.append(len(slots)) or inner(slots)
    try:
        keys = page_keys(Namespace(fp, cache_salt="zero-copy"), np.arange(6 * SPEC.page_size))
        src = np.array([9, 2, 3, 12, 0, 7], np.int32)
        data = _pages(worker, 6, 5)
        pool.write_slots(src, data)
        assert ex(TransferOp(1, OpKind.BACKUP_H2S, np.empty(0, np.int32), src, tuple(keys)), pool) == 6 * pool.slot_bytes
        assert sum(reads) == 6  # one gather of the backup's pages (storage has no zero-copy path)
        dst = np.array([1, 4, 5, 6, 8, 10], np.int32)
        before = pool.read_slots(dst)
        moved, commit = ex(TransferOp(2, OpKind.PREFETCH_S2H, np.empty(0, np.int32), dst, tuple(keys)), pool)
        assert moved == 6 * pool.slot_bytes
        assert np.array_equal(pool.read_slots(dst).view(np.uint32), before.view(np.uint32))
        commit()
        assert np.array_equal(pool.read_slots(dst).view(np.uint32), data.view(np.uint32))
    finally:
        del pool.read_slots
        ex.close()


class _LocalReads:
    """A storage executor over a local disk (``StorageExecutor.inline_reads``): records where it ran."""

    inline_reads = True

    def __init__(self) -> None:
        self.ran_on: list[tuple[str, int]] = []

    def __call__(self, op, pool):
        self.ran_on.append((op.kind.value, threading.get_ident()))
        return op.num_pages * pool.slot_bytes


def test_local_disk_prefetch_runs_at_dispatch_and_writes_on_their_thread(worker):
    executor = _LocalReads()
    worker.storage_executor = executor
    worker.submit(_plan(_op(1, "s2h", [], [3], ["a"])))
    assert executor.ran_on == [("s2h", threading.get_ident())]  # done before submit returned
    assert [(a.op_id, a.ok) for a in worker.poll()] == [(1, True)]
    worker.submit(_plan(_op(2, "h2s", [], [3], ["a"])))  # a write-back stays off the caller's thread
    assert [(a.op_id, a.ok) for a in worker.wait(timeout_s=60)] == [(2, True)]
    assert executor.ran_on[1][0] == "h2s" and executor.ran_on[1][1] != threading.get_ident()
    worker.storage_executor = None
