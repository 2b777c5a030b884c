"""Data plane on a 4-device fake CPU mesh, heads sharded: exact round trips (XLA and interpreted
Pallas kernels), validation, caps."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from hicache.workers import (
    HostPoolConfig,
    HostWorker,
    KVCacheSpec,
    OpKind,
    SlotAllocator,
    TransferOp,
    TransferPlan,
    size_host_pool,
)

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=8, head_dim=64, page_size=16, dtype="bfloat16")
NUM_PAGES, NUM_SLOTS = 24, 16


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _random_pages(worker: HostWorker, n: int, seed: int) -> np.ndarray:
    shape = (n, *worker.device_pool.host_row_shape)
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32).astype(worker.device_pool.dtype)


@pytest.fixture(scope="module")
def worker() -> HostWorker:
    assert len(jax.devices()) == 4
    return HostWorker(SPEC, NUM_PAGES, NUM_SLOTS)


def _op(op_id, kind, pages, slots, keys=()):
    return TransferOp(op_id, OpKind(kind), np.asarray(pages, np.int32), np.asarray(slots, np.int32), tuple(keys))


_seq = iter(range(1, 10**6))


def _plan(*ops) -> TransferPlan:
    return TransferPlan(next(_seq), tuple(ops))


def test_mesh_shards_heads(worker):
    kv = worker.device_pool.kv
    assert kv.shape == (2, 2, NUM_PAGES, 16, 8, 64)
    assert {s.data.shape[4] for s in kv.addressable_shards} == {2}
    assert len(kv.addressable_shards) == 4
    assert worker.host_pool.slot_shape == (2, 2, 16, 8, 64)
    assert worker.host_pool.slot_bytes == SPEC.page_bytes


def test_backup_overwrite_load_is_bit_identical(worker):
    dp, hp = worker.device_pool, worker.host_pool
    src_pages = np.array([17, 3, 9, 22, 0], np.int32)  # unsorted, non-contiguous
    slots = np.array([11, 2, 7, 15, 4], np.int32)
    data = _random_pages(worker, src_pages.size, seed=1)
    dp.write_pages(src_pages, data)
    worker.submit(_plan(_op(1, "d2h", src_pages, slots)))
    acks = worker.wait(timeout_s=60)
    assert [(a.ok, a.error, a.bytes_moved) for a in acks] == [(True, None, 5 * SPEC.page_bytes)]
    np.testing.assert_array_equal(_bits(hp.read_slots(slots)), _bits(data))

    # overwrite L1 everywhere, then load into *other* pages
    dp.write_pages(np.arange(NUM_PAGES), _random_pages(worker, NUM_PAGES, seed=2))
    dst_pages = np.array([5, 20, 1, 12, 8], np.int32)
    worker.submit(_plan(_op(2, "h2d", dst_pages, slots)))
    acks = worker.wait(timeout_s=60)
    assert [a.ok for a in acks] == [True] and acks[0].op_id == 2 and acks[0].host == 0
    np.testing.assert_array_equal(_bits(dp.read_pages(dst_pages)), _bits(data))


# Pallas interpret mode over 4 fake CPU devices hangs in its buffer-allocation callbacks once a
# shard is larger than this layout's (seen with SPEC's 64-wide heads and 16-token pages on 2 cores).
SMALL_SPEC = KVCacheSpec(num_layers=2, num_kv_heads=8, head_dim=16, page_size=4, dtype="bfloat16")


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_every_kernel_impl_round_trips_exactly_on_the_sharded_mesh(impl):
    """The TPU kernels (Pallas, interpreted) and the XLA ones run the same engine code, per shard."""
    w = HostWorker(SMALL_SPEC, NUM_PAGES, NUM_SLOTS, impl=impl)
    assert w.engine.impl.value == impl and len(w.device_pool.kv.addressable_shards) == 4
    data = _random_pages(w, 5, seed=11)
    w.device_pool.write_pages([17, 3, 9, 22, 0], data)
    before = _bits(w.device_pool.read_pages(np.arange(NUM_PAGES))).copy()
    w.submit(_plan(_op(1, "d2h", [17, 3, 9, 22, 0], [11, 2, 7, 15, 4]),
                   _op(2, "h2d", [5, 20, 1, 12, 8], [4, 15, 7, 2, 11])))
    assert [a.ok for a in w.wait(timeout_s=120)] == [True, True]
    np.testing.assert_array_equal(_bits(w.host_pool.read_slots([11, 2, 7, 15, 4])), _bits(data))
    after = _bits(w.device_pool.read_pages(np.arange(NUM_PAGES)))
    np.testing.assert_array_equal(after[[5, 20, 1, 12, 8]], _bits(data[::-1]))
    untouched = np.setdiff1d(np.arange(NUM_PAGES), [5, 20, 1, 12, 8])
    np.testing.assert_array_equal(after[untouched], before[untouched])


def test_plan_with_backup_then_load_of_same_slots_in_order(worker):
    dp = worker.device_pool
    data = _random_pages(worker, 3, seed=3)
    dp.write_pages([2, 4, 6], data)
    # D2H into slots, then (same plan) H2D from those slots: the load must see the backup.
    worker.submit(_plan(_op(1, "d2h", [2, 4, 6], [0, 1, 3]), _op(2, "h2d", [10, 11, 13], [3, 0, 1])))
    acks = worker.wait(timeout_s=60)
    assert [(a.op_id, a.ok) for a in acks] == [(1, True), (2, True)]
    np.testing.assert_array_equal(_bits(dp.read_pages([10, 11, 13])), _bits(data[[2, 0, 1]]))


def test_poll_is_non_blocking_and_acks_in_seq_order(worker):
    worker.device_pool.write_pages([1], _random_pages(worker, 1, seed=4))
    plans = [_plan(_op(7, "d2h", [1], [5])), _plan(_op(8, "h2d", [2], [5])), _plan(_op(9, "d2h", [2], [6]))]
    for p in plans:
        worker.submit(p)
    acks = []
    for _ in range(2000):
        acks += worker.poll()
        if len(acks) == 3:
            break
    acks += worker.wait(timeout_s=60)
    assert [a.seq for a in acks] == [p.seq for p in plans]
    assert all(a.ok for a in acks) and worker.num_pending == 0


def test_wait_needs_a_timeout(worker):
    with pytest.raises(ValueError, match="timeout_s"):
        worker.wait(timeout_s=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "op, match",
    [
        (("d2h", [1, 99], [0, 1]), r"device_pages out of range \[0, 24\): \[99\]"),
        (("h2d", [1, 2], [0, 16]), r"host_slots out of range \[0, 16\): \[16\]"),
        (("d2h", [3, 3], [0, 1]), r"device_pages has duplicates: \[3\]"),
        (("h2d", [3, 4], [5, 5]), r"host_slots has duplicates: \[5\]"),
        (("d2h", [], []), "empty"),
    ],
)
def test_bad_plans_rejected_before_touching_buffers(worker, op, match):
    dp, hp = worker.device_pool, worker.host_pool
    before_l1 = _bits(dp.read_pages(np.arange(NUM_PAGES))).copy()
    before_l2 = _bits(hp.read_slots(np.arange(NUM_SLOTS))).copy()
    # the first op is valid: a plan is all-or-nothing
    plan = _plan(_op(1, "d2h", [0], [9]), _op(2, *op))
    with pytest.raises(ValueError, match=match):
        worker.submit(plan)
    assert worker.num_pending == 0
    np.testing.assert_array_equal(_bits(dp.read_pages(np.arange(NUM_PAGES))), before_l1)
    np.testing.assert_array_equal(_bits(hp.read_slots(np.arange(NUM_SLOTS))), before_l2)
    worker.submit(_plan(_op(1, "d2h", [0], [9])))  # the rejected seq was not consumed
    assert [a.ok for a in worker.wait(timeout_s=60)] == [True]


def test_seq_must_increase(worker):
    p = _plan(_op(1, "d2h", [0], [0]))
    worker.submit(p)
    worker.wait(timeout_s=60)
    with pytest.raises(ValueError, match=f"seq {p.seq} must be > last submitted seq {p.seq}"):
        worker.submit(TransferPlan(p.seq, ()))


def test_failed_transfer_leaves_pools_unchanged_and_slots_reusable(worker, monkeypatch):
    dp, hp = worker.device_pool, worker.host_pool
    before_l1 = _bits(dp.read_pages(np.arange(NUM_PAGES))).copy()
    before_l2 = _bits(hp.read_slots(np.arange(NUM_SLOTS))).copy()

    def broken_commit(*a, **k):
        raise RuntimeError("injected DMA failure")

    # D2H fails at commit time (after the device work): L2 untouched.
    real_begin = hp.begin_backup

    def begin_then_break(ids, staged, count):
        pending = real_begin(ids, staged, count)
        pending.commit = broken_commit  # type: ignore[method-assign]
        return pending

    monkeypatch.setattr(hp, "begin_backup", begin_then_break)
    worker.submit(_plan(_op(1, "d2h", [0, 1, 2], [3, 4, 5])))
    # H2D fails while staging: L1 untouched.
    monkeypatch.setattr(hp, "stage_load", lambda ids, rows: (_ for _ in ()).throw(RuntimeError("injected H2D failure")))
    worker.submit(_plan(_op(2, "h2d", [7, 8], [3, 4])))
    acks = worker.wait(timeout_s=60)
    assert [(a.ok, a.bytes_moved) for a in acks] == [(False, 0), (False, 0)]
    assert "injected DMA failure" in acks[0].error and "injected H2D failure" in acks[1].error
    np.testing.assert_array_equal(_bits(dp.read_pages(np.arange(NUM_PAGES))), before_l1)
    np.testing.assert_array_equal(_bits(hp.read_slots(np.arange(NUM_SLOTS))), before_l2)
    monkeypatch.undo()
    # the same slots and pages work afterwards
    data = _random_pages(worker, 3, seed=5)
    dp.write_pages([0, 1, 2], data)
    worker.submit(_plan(_op(1, "d2h", [0, 1, 2], [3, 4, 5]), _op(2, "h2d", [7, 8, 9], [3, 4, 5])))
    assert all(a.ok for a in worker.wait(timeout_s=60))
    np.testing.assert_array_equal(_bits(dp.read_pages([7, 8, 9])), _bits(data))


def test_storage_ops_without_backend_fail_cleanly(worker):
    worker.submit(_plan(_op(1, "h2s", [], [0], ["k0"])))
    (ack,) = worker.wait(timeout_s=60)
    assert not ack.ok and "no storage backend" in ack.error


def test_storage_executor_is_pluggable_and_ordered(worker):
    seen = []

    def executor(op, pool):
        seen.append(pool.read_slots(op.host_slots))
        return op.num_pages * pool.slot_bytes

    data = _random_pages(worker, 1, seed=6)
    worker.device_pool.write_pages([3], data)
    worker.storage_executor = executor
    try:
        worker.submit(_plan(_op(1, "d2h", [3], [12]), _op(2, "h2s", [], [12], ["key"])))
        acks = worker.wait(timeout_s=60)
    finally:
        worker.storage_executor = None
    assert [a.ok for a in acks] == [True, True] and acks[1].bytes_moved == SPEC.page_bytes
    np.testing.assert_array_equal(_bits(seen[0]), _bits(data))  # H2S saw the committed D2H


def test_host_pool_numpy_access_validates(worker):
    hp = worker.host_pool
    data = _random_pages(worker, 2, seed=7)
    hp.write_slots([1, 14], data)
    np.testing.assert_array_equal(_bits(hp.read_slots([1, 14])), _bits(data))
    with pytest.raises(ValueError, match=r"slots out of range \[0, 16\): \[16\]"):
        hp.read_slots([16])
    with pytest.raises(ValueError, match="shape"):
        hp.write_slots([1], data)
    with pytest.raises(TypeError, match="dtype"):
        hp.write_slots([1, 2], data.astype(np.float32))
    np.testing.assert_array_equal(_bits(hp.read_slots([1, 14])), _bits(data))
    assert hp.used_bytes <= hp.capacity_bytes == NUM_SLOTS * SPEC.page_bytes


def test_host_pool_never_exceeds_cap(worker):
    hp = worker.host_pool
    worker.device_pool.write_pages(np.arange(NUM_SLOTS), _random_pages(worker, NUM_SLOTS, seed=8))
    for _ in range(2):  # fill every slot twice: overwrites release the old page
        worker.submit(_plan(_op(1, "d2h", np.arange(NUM_SLOTS), np.arange(NUM_SLOTS)[::-1])))
        assert all(a.ok for a in worker.wait(timeout_s=60))
        assert hp.used_bytes <= hp.capacity_bytes
    with pytest.raises(ValueError, match="out of range"):
        worker.submit(_plan(_op(1, "d2h", [0], [NUM_SLOTS])))


def test_size_host_pool_checks_available_memory():
    assert size_host_pool(HostPoolConfig(max_bytes=10 * 4096, reserve_bytes=0), 4096, 0, available_bytes=1 << 30) == 10
    assert size_host_pool(HostPoolConfig(ratio_to_device=2.0, reserve_bytes=0), 100, 1000, available_bytes=10**6) == 20
    with pytest.raises(ValueError, match="exceeds available host memory"):
        size_host_pool(HostPoolConfig(num_slots=100, reserve_bytes=1 << 20), 1 << 20, 0, available_bytes=100 << 20)
    with pytest.raises(ValueError, match="exactly one of"):
        HostPoolConfig(num_slots=1, max_bytes=2)
    with pytest.raises(ValueError, match="holds no slot"):
        size_host_pool(HostPoolConfig(max_bytes=10), 4096, 0, available_bytes=1 << 30)


def test_slot_allocator():
    a = SlotAllocator(4)
    s = a.alloc(3)
    assert s.tolist() == [0, 1, 2] and a.num_free == 1
    with pytest.raises(ValueError, match="cannot allocate 2 slots: 1 free"):
        a.alloc(2)
    a.free([1])
    with pytest.raises(ValueError, match=r"not allocated: \[1\]"):
        a.free([1])
    assert a.alloc(2).tolist() == [1, 3]


def test_spec_validation_and_page_bytes():
    assert SPEC.page_bytes == 2 * 2 * 16 * 8 * 64 * 2
    with pytest.raises(ValueError, match="page_size must be > 0, got 0"):
        KVCacheSpec(2, 8, 64, 0)
    with pytest.raises(ValueError, match="'float64'"):
        KVCacheSpec(2, 8, 64, 16, dtype="float64")
    with pytest.raises(TypeError, match="num_layers must be an int"):
        KVCacheSpec(2.0, 8, 64, 16)  # type: ignore[arg-type]


def test_transfer_op_validation():
    with pytest.raises(ValueError, match="2 device_pages vs 1 host_slots"):
        _op(1, "d2h", [1, 2], [0])
    with pytest.raises(TypeError, match="integers"):
        TransferOp(1, OpKind.BACKUP_D2H, np.array([1.5]), np.array([0]))
    with pytest.raises(ValueError, match="'x2y'"):
        _op(1, "x2y", [1], [0])
    with pytest.raises(ValueError, match="duplicate op_id"):
        TransferPlan(1, (_op(1, "d2h", [1], [0]), _op(1, "h2d", [1], [0])))


def test_device_pool_rejects_indivisible_mesh():
    from jax.sharding import Mesh

    from hicache.workers import DevicePool

    with pytest.raises(ValueError, match="num_kv_heads=6 is not divisible by mesh axis 'kv' of size 4"):
        DevicePool(KVCacheSpec(1, 6, 64, 16), 4, mesh=Mesh(np.array(jax.devices()), ("kv",)))


def test_a_batch_over_max_batch_pages_runs_in_pieces_and_round_trips_exactly():
    """5 pages with 2 pages per program: 3 backups and 3 loads behind one handle each, bit-exact."""
    from hicache.workers.transfer import TransferEngine

    worker = HostWorker(SPEC, NUM_PAGES, NUM_SLOTS)
    engine = TransferEngine(worker.device_pool, worker.host_pool, max_batch_pages=2)
    dp, hp = worker.device_pool, worker.host_pool
    pages, slots = np.array([17, 3, 9, 22, 0], np.int32), np.array([11, 2, 7, 15, 4], np.int32)
    data = _random_pages(worker, pages.size, seed=5)
    dp.write_pages(pages, data)
    handle = engine.backup(pages, slots)
    assert handle.num_pages == 5 and handle.bytes_moved == 5 * SPEC.page_bytes
    handle.finish()
    np.testing.assert_array_equal(_bits(hp.read_slots(slots)), _bits(data))
    dp.write_pages(np.arange(NUM_PAGES), _random_pages(worker, NUM_PAGES, seed=6))
    dst = np.array([5, 20, 1, 12, 8], np.int32)
    handle = engine.load(slots, dst)
    assert handle.block_until_ready(60) and handle.finish() == 5 * SPEC.page_bytes
    np.testing.assert_array_equal(_bits(dp.read_pages(dst)), _bits(data))


@pytest.mark.parametrize("bad", [0, 3, -4, 2.0])
def test_max_batch_pages_must_be_a_power_of_two(bad):
    from hicache.workers.transfer import TransferEngine

    worker = HostWorker(SPEC, NUM_PAGES, NUM_SLOTS)
    with pytest.raises(ValueError, match="max_batch_pages"):
        TransferEngine(worker.device_pool, worker.host_pool, max_batch_pages=bad)


def test_a_batch_that_fails_to_dispatch_returns_the_staging_of_the_batches_before_it(monkeypatch):
    from hicache.workers.transfer import TransferEngine

    worker = HostWorker(SPEC, NUM_PAGES, NUM_SLOTS)
    engine = TransferEngine(worker.device_pool, worker.host_pool, max_batch_pages=2)
    real, calls = worker.host_pool.begin_backup, []

    def fail_second(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return real(*args)

    monkeypatch.setattr(worker.host_pool, "begin_backup", fail_second)
    with pytest.raises(RuntimeError, match="injected"):
        engine.backup(np.array([1, 2, 3, 4], np.int32), np.array([5, 6, 7, 8], np.int32))
    assert len(engine._staging[2]) == 2  # the first batch's buffer (aborted) and the failed one's
    np.testing.assert_array_equal(worker.host_pool.read_slots(np.array([5, 6], np.int32)), 0)  # nothing committed
