"""The single-device engine paths (the CPU backend's usual case): synchronous D2H into the slab, H2D
read in place from the slab (zero-copy jit argument), and their ordering/failure rules."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from hicache.workers import DevicePool, HostWorker, KVCacheSpec, OpKind, TransferOp, TransferPlan
from hicache.workers import host_pool as host_pool_mod
from hicache.workers import hugepages
from hicache.workers import transfer as transfer_mod

NUM_PAGES, NUM_SLOTS = 40, 32
SPECS = {
    "bf16": KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, dtype="bfloat16"),
    "f32": KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, page_size=16, dtype="float32"),
}


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _random_pages(worker: HostWorker, n: int, seed: int) -> np.ndarray:
    shape = (n, *worker.device_pool.host_row_shape)
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32).astype(worker.device_pool.dtype)


_seq = iter(range(1, 10**6))


def _plan(*ops) -> TransferPlan:
    return TransferPlan(next(_seq), tuple(ops))


def _op(op_id, kind, pages, slots) -> TransferOp:
    return TransferOp(op_id, OpKind(kind), np.asarray(pages, np.int32), np.asarray(slots, np.int32))


@pytest.fixture(params=sorted(SPECS))
def worker(request) -> HostWorker:
    return HostWorker(SPECS[request.param], NUM_PAGES, NUM_SLOTS, devices=[jax.devices()[0]],
                      host_pool_kind="numpy_slab")


@pytest.fixture(params=["sync", "sync_vectorised", "async"])
def backup_mode(request, monkeypatch, worker) -> str:
    if request.param == "async":
        monkeypatch.setattr(transfer_mod, "SYNC_BACKUP_MAX_BYTES", 0)
    elif request.param == "sync":  # one numpy copy per page
        monkeypatch.setattr(host_pool_mod, "VECTOR_PAGE_MAX_BYTES", 0)
    else:  # np.take per chunk of 3 pages: several chunks and a partial last one
        monkeypatch.setattr(host_pool_mod, "VECTOR_PAGE_MAX_BYTES", worker.host_pool.slot_bytes)
        monkeypatch.setattr(host_pool_mod, "VECTOR_MIN_PAGES", 1)
        monkeypatch.setattr(host_pool_mod, "VECTOR_CHUNK_BYTES", 3 * worker.host_pool.slot_bytes)
    return request.param


def test_fast_paths_are_selected(worker):
    assert worker.engine.single_device and worker.engine.direct_load
    # the slab really is aliased: the device array's buffer is the slab's memory
    rows = worker.host_pool.direct_rows()
    assert rows.unsafe_buffer_pointer() == worker.host_pool._slabs[0].ctypes.data


def test_round_trip_is_bit_identical(worker, backup_mode):
    dp, hp = worker.device_pool, worker.host_pool
    src = np.array([31, 3, 17, 0, 22, 9, 39], np.int32)  # unsorted, non-contiguous, not a power of 2
    slots = np.array([5, 30, 1, 12, 7, 0, 19], np.int32)
    data = _random_pages(worker, src.size, seed=1)
    dp.write_pages(src, data)
    worker.submit(_plan(_op(1, "d2h", src, slots)))
    acks = worker.wait(timeout_s=60)
    assert [(a.ok, a.error, a.bytes_moved) for a in acks] == [(True, None, src.size * hp.slot_bytes)]
    np.testing.assert_array_equal(_bits(hp.read_slots(slots)), _bits(data))
    assert not _bits(hp.read_slots(np.setdiff1d(np.arange(NUM_SLOTS), slots))).any()  # no other slot written

    before = _bits(dp.read_pages(np.arange(NUM_PAGES))).copy()
    dst = np.array([2, 38, 11, 25, 6, 14, 33], np.int32)
    worker.submit(_plan(_op(2, "h2d", dst, slots)))
    assert [a.ok for a in worker.wait(timeout_s=60)] == [True]
    after = _bits(dp.read_pages(np.arange(NUM_PAGES)))
    np.testing.assert_array_equal(after[dst], _bits(data))
    untouched = np.setdiff1d(np.arange(NUM_PAGES), dst)
    np.testing.assert_array_equal(after[untouched], before[untouched])  # padding rows wrote nothing


def test_backup_then_load_of_same_slots_in_one_plan(worker, backup_mode):
    dp = worker.device_pool
    data = _random_pages(worker, 3, seed=2)
    dp.write_pages([2, 4, 6], data)
    worker.submit(_plan(_op(1, "d2h", [2, 4, 6], [0, 1, 3]), _op(2, "h2d", [10, 11, 13], [3, 0, 1])))
    acks = worker.wait(timeout_s=60)
    assert [(a.op_id, a.ok) for a in acks] == [(1, True), (2, True)]
    np.testing.assert_array_equal(_bits(dp.read_pages([10, 11, 13])), _bits(data[[2, 0, 1]]))


def test_later_backup_to_same_slot_wins_over_pending_async_one(worker, monkeypatch):
    # 2 pages go async (over the threshold); the 1-page backup after it would be synchronous, but an
    # async backup is outstanding, so it must not overtake it.
    monkeypatch.setattr(transfer_mod, "SYNC_BACKUP_MAX_BYTES", worker.host_pool.slot_bytes)
    dp, hp = worker.device_pool, worker.host_pool
    data = _random_pages(worker, 3, seed=3)
    dp.write_pages([1, 2, 3], data)
    worker.submit(_plan(_op(1, "d2h", [1, 2], [4, 5])))
    worker.submit(_plan(_op(1, "d2h", [3], [4])))
    assert all(a.ok for a in worker.wait(timeout_s=60))
    np.testing.assert_array_equal(_bits(hp.read_slots([4, 5])), _bits(data[[2, 1]]))


def test_slab_writes_wait_for_loads_reading_it(worker):
    dp, hp = worker.device_pool, worker.host_pool
    old = _random_pages(worker, 4, seed=4)
    hp.write_slots([8, 9, 10, 11], old)
    worker.submit(_plan(_op(1, "h2d", [20, 21, 22, 23], [8, 9, 10, 11])))
    assert hp._readers  # the load reads the slab in place: registered
    hp.write_slots([8, 9, 10, 11], _random_pages(worker, 4, seed=5))  # waits for the load first
    assert not hp._readers
    assert [a.ok for a in worker.wait(timeout_s=60)] == [True]
    np.testing.assert_array_equal(_bits(dp.read_pages([20, 21, 22, 23])), _bits(old))


def test_load_completes_even_if_the_pool_array_is_donated_before_poll(worker):
    dp, hp = worker.device_pool, worker.host_pool
    data = _random_pages(worker, 2, seed=6)
    hp.write_slots([3, 4], data)
    worker.submit(_plan(_op(1, "h2d", [5, 6], [3, 4])))
    forward = jax.jit(lambda kv: kv, donate_argnums=0)  # a model forward donates the pool
    dp.set_kv(forward(dp.kv))
    assert [a.ok for a in worker.wait(timeout_s=60)] == [True]
    np.testing.assert_array_equal(_bits(dp.read_pages([5, 6])), _bits(data))


def test_failures_leave_both_pools_unchanged(worker, backup_mode, monkeypatch):
    dp, hp = worker.device_pool, worker.host_pool
    dp.write_pages(np.arange(NUM_PAGES), _random_pages(worker, NUM_PAGES, seed=7))
    hp.write_slots(np.arange(NUM_SLOTS), _random_pages(worker, NUM_SLOTS, seed=8))
    before_l1 = _bits(dp.read_pages(np.arange(NUM_PAGES))).copy()
    before_l2 = _bits(hp.read_slots(np.arange(NUM_SLOTS))).copy()

    def boom(*a, **k):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(hp, "backup_now", boom)
    real_begin = hp.begin_backup

    def begin_then_break(ids, staged, count):
        pending = real_begin(ids, staged, count)
        pending.commit = boom  # type: ignore[method-assign]
        return pending

    monkeypatch.setattr(hp, "begin_backup", begin_then_break)
    monkeypatch.setattr(worker.engine, "_scatter_rows", boom)
    worker.submit(_plan(_op(1, "d2h", [0, 1, 2], [3, 4, 5])))
    worker.submit(_plan(_op(2, "h2d", [7, 8], [3, 4])))
    acks = worker.wait(timeout_s=60)
    assert [(a.ok, a.bytes_moved) for a in acks] == [(False, 0), (False, 0)]
    assert all("injected failure" in a.error for a in acks)
    np.testing.assert_array_equal(_bits(dp.read_pages(np.arange(NUM_PAGES))), before_l1)
    np.testing.assert_array_equal(_bits(hp.read_slots(np.arange(NUM_SLOTS))), before_l2)
    monkeypatch.undo()
    data = _random_pages(worker, 3, seed=9)
    dp.write_pages([0, 1, 2], data)
    worker.submit(_plan(_op(1, "d2h", [0, 1, 2], [3, 4, 5]), _op(2, "h2d", [7, 8, 9], [3, 4, 5])))
    assert all(a.ok for a in worker.wait(timeout_s=60))
    np.testing.assert_array_equal(_bits(dp.read_pages([7, 8, 9])), _bits(data))


def test_bad_ids_still_rejected_with_names(worker):
    with pytest.raises(ValueError, match=r"device_pages has duplicates: \[3\]"):
        worker.submit(_plan(_op(1, "d2h", [3, 3], [0, 1])))
    with pytest.raises(ValueError, match=r"host_slots out of range \[0, 32\): \[32\]"):
        worker.submit(_plan(_op(1, "h2d", [3, 4], [0, 32])))
    assert worker.num_pending == 0


@pytest.mark.parametrize("kind", ["numpy_slab", "pinned_pages"])
def test_single_device_staged_paths(kind, monkeypatch):
    """Single device without the direct load (pinned pages, or a slab the runtime would copy)."""
    if kind == "numpy_slab":
        from hicache.workers.host_pool import NumpySlabHostPool

        monkeypatch.setattr(NumpySlabHostPool, "_make_direct", lambda self: None)
    w = HostWorker(SPECS["bf16"], NUM_PAGES, NUM_SLOTS, devices=[jax.devices()[1]], host_pool_kind=kind)
    assert w.engine.single_device and not w.engine.direct_load
    data = _random_pages(w, 5, seed=10)
    w.device_pool.write_pages([9, 1, 30, 4, 12], data)
    w.submit(_plan(_op(1, "d2h", [9, 1, 30, 4, 12], [2, 7, 0, 31, 5]), _op(2, "h2d", [0, 3, 8, 39, 20], [2, 7, 0, 31, 5])))
    assert all(a.ok for a in w.wait(timeout_s=60))
    np.testing.assert_array_equal(_bits(w.host_pool.read_slots([2, 7, 0, 31, 5])), _bits(data))
    np.testing.assert_array_equal(_bits(w.device_pool.read_pages([0, 3, 8, 39, 20])), _bits(data))


def _thp_available() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def test_huge_page_range():
    mib2 = hugepages.HUGE_PAGE_BYTES
    assert hugepages.huge_page_range(mib2, 3 * mib2) == (mib2, 3 * mib2)
    assert hugepages.huge_page_range(mib2 + 1, 3 * mib2) == (2 * mib2, 2 * mib2)  # ends at 4 MiB + 1
    assert hugepages.huge_page_range(1, mib2) == (mib2, 0)  # no whole huge page inside
    with pytest.raises(ValueError, match="-1"):
        hugepages.huge_page_range(-1, 10)


def test_merged_ops_on_a_huge_page_pool_are_bit_identical():
    """hicache_bench's layout (1 KiB pages, size-1 axes) at its scale: merged ops of thousands of
    random pages over a pool of several 2 MiB pages, advised into huge pages. The whole L1 pool and
    every slot are checked against a numpy model after each step, so a page copied to a wrong
    place, a torn page or a write outside the op fails."""
    spec = SPECS["f32"]
    num_pages, num_slots = 6144, 8192  # 6 MiB of L1: >= 2 whole huge pages at any alignment
    w = HostWorker(spec, num_pages, num_slots, devices=[jax.devices()[0]], host_pool_kind="numpy_slab")
    assert DevicePool(spec, num_pages, mesh=w.device_pool.mesh, huge_pages=False).huge_page_bytes == 0
    dp, hp = w.device_pool, w.host_pool
    if hugepages._MADVISE is not None and _thp_available():
        assert dp.huge_page_bytes >= 2 * hugepages.HUGE_PAGE_BYTES
    assert not _bits(dp.read_pages(np.arange(num_pages))).any()  # advising kept the zeros
    rng = np.random.default_rng(11)
    model_l1 = _random_pages(w, num_pages, seed=12)
    dp.write_pages(np.arange(num_pages), model_l1)
    model_l2 = np.zeros((num_slots, *dp.host_row_shape), dp.dtype)
    for step in range(3):
        n = [3000, 1500, 2049][step]
        src, dst = rng.permutation(num_pages)[:n].astype(np.int32), rng.permutation(num_pages)[:n].astype(np.int32)
        slots = rng.permutation(num_slots)[:n].astype(np.int32)
        w.submit(_plan(_op(2 * step, "d2h", src, slots), _op(2 * step + 1, "h2d", dst, slots)))
        assert [a.ok for a in w.wait(timeout_s=120)] == [True, True]
        model_l2[slots] = model_l1[src]
        model_l1[dst] = model_l2[slots]
        np.testing.assert_array_equal(_bits(dp.read_pages(np.arange(num_pages))), _bits(model_l1))
        np.testing.assert_array_equal(_bits(hp.read_slots(np.arange(num_slots))), _bits(model_l2))
