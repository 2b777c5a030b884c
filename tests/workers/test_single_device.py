"""The single-device engine paths (the CPU backend's usual case): ``DataPath.HOST_MEMORY`` (numpy
copies between the L1 buffer and the slab at dispatch, both directions; a load takes the L1 buffer
over by donation first, unless it is a finished forward's output), the async D2H fallback, and
their ordering/failure rules; the numpy ``PageCopier`` against a numpy model."""

from __future__ import annotations

import functools
import gc
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax import lax

from hicache.workers import DevicePool, HostWorker, KVCacheSpec, OpKind, TransferOp, TransferPlan
from hicache.workers import host_copy, hugepages
from hicache.workers import transfer as transfer_mod
from hicache.workers.transfer import DataPath, row_major_address

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
    """Default data path (HOST_MEMORY); with ``backup_mode`` "thread", the copy thread's."""
    thread = getattr(request.node, "callspec", None) and request.node.callspec.params.get("backup_mode") == "thread"
    w = HostWorker(SPECS[request.param], NUM_PAGES, NUM_SLOTS, devices=[jax.devices()[0]],
                   host_pool_kind="numpy_slab", data_path="host_thread" if thread else None)
    yield w
    w.close(timeout_s=60)


def _per_page(monkeypatch, copier: host_copy.PageCopier) -> None:
    copier.set_strategy("numpy")
    monkeypatch.setattr(host_copy, "VECTOR_PAGE_MAX_BYTES", 0)


def _vectorised(monkeypatch, copier: host_copy.PageCopier, chunk_pages: int) -> None:
    """np.take per chunk of ``chunk_pages`` pages: several chunks and a partial last one."""
    copier.set_strategy("numpy")
    monkeypatch.setattr(host_copy, "VECTOR_PAGE_MAX_BYTES", copier.slot_bytes)
    monkeypatch.setattr(host_copy, "VECTOR_MIN_PAGES", 1)
    monkeypatch.setattr(copier, "chunk_pages", chunk_pages)


@pytest.fixture(params=["sync_compiled", "sync", "sync_vectorised", "thread", "async"])
def backup_mode(request, monkeypatch, worker) -> str:
    """How pages move: the compiled loops (the default), numpy per page, numpy vectorised (both
    directions), (D2H) vectorised on the copy thread, or (D2H) the async jitted gather with its commit."""
    assert (worker.engine.data_path is DataPath.HOST_THREAD) == (request.param == "thread")
    if request.param == "async":
        monkeypatch.setattr(transfer_mod, "SYNC_BACKUP_MAX_BYTES", 0)
    elif request.param == "sync_compiled":
        assert worker.host_pool.page_copier().strategy is host_copy.CopyStrategy.COMPILED
        monkeypatch.setattr(transfer_mod, "ASYNC_MIN_PAGES", NUM_PAGES + 1)
    elif request.param == "sync":
        _per_page(monkeypatch, worker.host_pool.page_copier())
        monkeypatch.setattr(transfer_mod, "ASYNC_MIN_PAGES", NUM_PAGES + 1)
    else:
        _vectorised(monkeypatch, worker.host_pool.page_copier(), 3)
        monkeypatch.setattr(transfer_mod, "ASYNC_MIN_PAGES", 1 if request.param == "thread" else NUM_PAGES + 1)
    return request.param


def test_fast_paths_are_selected(worker):
    engine = worker.engine
    assert engine.single_device and engine.data_path is DataPath.HOST_MEMORY
    assert engine._copier is worker.host_pool.page_copier()
    # the copier writes the slab itself, not a copy of it
    assert engine._copier._slab_rows.ctypes.data == worker.host_pool._slabs[0].ctypes.data


def test_transfers_keep_the_pool_donatable(worker):
    """Neither direction leaves a numpy reference on the L1 buffer: a forward that donates the pool
    still gets its buffer in place (a referenced buffer is copied by the runtime instead)."""
    dp = worker.device_pool
    dp.write_pages([1], _random_pages(worker, 1, seed=20))
    worker.submit(_plan(_op(1, "d2h", [1], [2]), _op(2, "h2d", [3], [2])))
    assert [a.ok for a in worker.wait(timeout_s=60)] == [True, True]
    address = dp.kv.unsafe_buffer_pointer()
    forward = jax.jit(lambda kv: kv, donate_argnums=0)
    dp.set_kv(forward(dp.kv))
    assert dp.kv.unsafe_buffer_pointer() == address
    assert row_major_address(dp.kv) == address


def _pending_read(kv: jax.Array, page: int) -> jax.Array:
    """A jitted read of ``kv[:, :, page]`` queued behind a long matmul, so still pending on return."""
    x = jnp.ones((1024, 1024), jnp.float32)
    jax.block_until_ready(_read_page_after(kv, jnp.int32(page), _slow(x)))  # compiled
    seen = _read_page_after(kv, jnp.int32(page), _slow(x))
    assert not seen.is_ready()  # the premise: the reader is pending when the load comes
    return seen


@jax.jit
def _slow(x):
    return (x @ x @ x @ x)[0, 0]


@jax.jit
def _read_page_after(kv, page, after):  # the page index depends on the slow result: it waits for it
    page = page + (after > jnp.inf).astype(jnp.int32)
    return lax.dynamic_index_in_dim(kv, page, axis=2, keepdims=False)


def _assert_page(seen: jax.Array, want: np.ndarray) -> None:
    got = _bits(np.asarray(seen))
    np.testing.assert_array_equal(got, _bits(want).reshape(got.shape))


def test_engine_keeps_no_replaced_pool_array_alive(worker):
    """The engine remembers the pool array it holds (and the last one it checked) by weak
    reference only: an array replaced by ``set_kv`` and not donated is freed, not kept as a hidden
    second pool."""
    dp = worker.device_pool
    worker.submit(_plan(_op(1, "h2d", [1], [1])))  # the engine holds dp.kv now
    assert [a.ok for a in worker.wait(timeout_s=60)] == [True]
    replaced = weakref.ref(dp.kv)
    dp.set_kv(jax.device_put(np.zeros(dp.shape, dp.storage_dtype), dp.sharding))
    worker.submit(_plan(_op(2, "d2h", [1], [2])))  # reads the new array (layout checked, remembered)
    assert [a.ok for a in worker.wait(timeout_s=60)] == [True]
    gc.collect()
    assert replaced() is None
    assert not _bits(worker.host_pool.read_slots([2])).any()  # the new array's zeros were backed up


def test_load_waits_for_a_pending_reader_of_the_pool(worker):
    """A load writes the L1 buffer in place only after every computation already dispatched on it
    has run: a reader of page 7 still pending when a load overwrites page 7 sees the old page."""
    dp, hp = worker.device_pool, worker.host_pool
    old, new = _random_pages(worker, 1, seed=21), _random_pages(worker, 1, seed=22)
    dp.write_pages([7], old)
    hp.write_slots([0], new)
    seen = _pending_read(dp.kv, 7)
    worker.submit(_plan(_op(1, "h2d", [7], [0])))
    assert [a.ok for a in worker.wait(timeout_s=60)] == [True]
    _assert_page(seen, old[0])
    np.testing.assert_array_equal(_bits(dp.read_pages([7])), _bits(new))


class _ReadingModel:
    """A PoolModel whose calls dispatch a read of the pool and return without waiting (no forward:
    the worker gets the same array back)."""

    def __init__(self, kv: jax.Array) -> None:
        self.pool = kv

    def set_pool(self, kv: jax.Array) -> None:
        self.pool = kv


def test_load_after_run_model_waits_for_the_models_pending_work(worker):
    """The engine holds the pool array between loads (no take-over per load) but lets go of it when
    the worker lends it to the model: a read the model left pending still sees the old page."""
    dp, hp = worker.device_pool, worker.host_pool
    old, new = _random_pages(worker, 2, seed=23), _random_pages(worker, 1, seed=24)
    hp.write_slots([0, 1], old)
    worker.submit(_plan(_op(1, "h2d", [7, 8], [0, 1])))  # the engine now holds the pool array
    assert [a.ok for a in worker.wait(timeout_s=60)] == [True]
    worker.attach_model(_ReadingModel)
    seen = worker.run_model(lambda model: _pending_read(model.pool, 7))
    hp.write_slots([2], new)
    worker.submit(_plan(_op(2, "h2d", [7], [2])))
    assert [a.ok for a in worker.wait(timeout_s=60)] == [True]
    _assert_page(seen, old[0])
    np.testing.assert_array_equal(_bits(dp.read_pages([7, 8])), _bits(np.stack([new[0], old[1]])))


class _ForwardingModel:
    """A PoolModel whose forward writes page 7 of the pool (donating it), after a slow computation
    when asked: its output may still be pending when the call returns."""

    def __init__(self, kv: jax.Array) -> None:
        self.pool = kv

    def set_pool(self, kv: jax.Array) -> None:
        self.pool = kv

    def forward(self, page: np.ndarray, slow: bool) -> None:
        after = _slow(jnp.ones((1024, 1024), jnp.float32)) if slow else jnp.float32(0)
        self.pool = _write_page_after(self.pool, jnp.asarray(page), after)


@functools.partial(jax.jit, donate_argnums=0)
def _write_page_after(kv, page, after):  # the written value depends on the slow result: it waits for it
    page = page + (after > jnp.inf).astype(page.dtype)
    return lax.dynamic_update_index_in_dim(kv, page, 7, axis=2)


def test_load_after_a_forward_writes_its_output_in_place(worker):
    """A forward's ready output (it donated the array lent) is loaded into in place: no take-over,
    so the model's array stays the pool, alive, with the loaded page."""
    dp, hp = worker.device_pool, worker.host_pool
    page = _random_pages(worker, 1, seed=25)[0]  # [L, 2, S, H, D]: the pool's slice at page 7
    new = _random_pages(worker, 1, seed=26)
    hp.write_slots([0], new)
    model = worker.attach_model(_ForwardingModel)
    worker.run_model(lambda m: m.forward(page.astype(dp.storage_dtype), slow=False))
    dp.kv.block_until_ready()
    worker.submit(_plan(_op(1, "h2d", [7], [0])))
    assert [a.ok for a in worker.wait(timeout_s=60)] == [True]
    assert dp.kv is model.pool and not model.pool.is_deleted()
    np.testing.assert_array_equal(_bits(dp.read_pages([7])), _bits(new))


def test_load_after_a_pending_forward_lands_after_it(worker):
    """A load right after a forward whose output is still being computed waits for it (the forward's
    write of the page lands first, then the load's)."""
    dp, hp = worker.device_pool, worker.host_pool
    written = _random_pages(worker, 1, seed=27)[0]
    new = _random_pages(worker, 1, seed=28)
    hp.write_slots([0], new)
    worker.attach_model(_ForwardingModel)
    worker.run_model(lambda m: m.forward(written.astype(dp.storage_dtype), slow=True))  # compiles
    worker.run_model(lambda m: m.forward(written.astype(dp.storage_dtype), slow=True))
    assert not dp.kv.is_ready()  # the premise: the forward is pending when the load comes
    worker.submit(_plan(_op(1, "h2d", [7], [0])))
    assert [a.ok for a in worker.wait(timeout_s=60)] == [True]
    np.testing.assert_array_equal(_bits(dp.read_pages([7])), _bits(new))


def test_round_trip_is_bit_identical(worker, backup_mode):
    dp, hp = worker.device_pool, worker.host_pool
    src = np.array([31, 3, 17, 0, 22, 9, 39], np.int32)  # unsorted, non-contiguous, not a power of 2
    slots = np.array([5, 30, 1, 12, 7, 0, 19], np.int32)
    data = _random_pages(worker, src.size, seed=1)
    dp.write_pages(src, data)
    worker.submit(_plan(_op(1, "d2h", src, slots)))
    acks = worker.wait(timeout_s=60)
    assert [(a.ok, a.error, a.bytes_moved) for a in acks] == [(True, None, src.size * hp.slot_bytes)]
    assert acks[0].duration_s > 0  # the copy's own time, also when it is done at dispatch
    np.testing.assert_array_equal(_bits(hp.read_slots(slots)), _bits(data))
    assert not _bits(hp.read_slots(np.setdiff1d(np.arange(NUM_SLOTS), slots))).any()  # no other slot written

    before = _bits(dp.read_pages(np.arange(NUM_PAGES))).copy()
    dst = np.array([2, 38, 11, 25, 6, 14, 33], np.int32)
    worker.submit(_plan(_op(2, "h2d", dst, slots)))
    assert [a.ok for a in worker.wait(timeout_s=60)] == [True]
    after = _bits(dp.read_pages(np.arange(NUM_PAGES)))
    np.testing.assert_array_equal(after[dst], _bits(data))
    untouched = np.setdiff1d(np.arange(NUM_PAGES), dst)
    np.testing.assert_array_equal(after[untouched], before[untouched])  # no other page written


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

    copier = hp.page_copier()
    monkeypatch.setattr(copier, "to_slab", boom)
    monkeypatch.setattr(copier, "to_pool", boom)
    real_begin = hp.begin_backup

    def begin_then_break(ids, staged, count):
        pending = real_begin(ids, staged, count)
        pending.commit = boom  # type: ignore[method-assign]
        return pending

    monkeypatch.setattr(hp, "begin_backup", begin_then_break)
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
    """Single device on the JIT path (pinned pages, or a slab pool without a copier)."""
    if kind == "numpy_slab":
        from hicache.workers.host_pool import NumpySlabHostPool

        monkeypatch.setattr(NumpySlabHostPool, "page_copier", lambda self: None)
    w = HostWorker(SPECS["bf16"], NUM_PAGES, NUM_SLOTS, devices=[jax.devices()[1]], host_pool_kind=kind)
    assert w.engine.single_device and w.engine.data_path is DataPath.JIT
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


@pytest.mark.parametrize("data_path", ["host_memory", "host_thread"])
def test_merged_ops_on_a_huge_page_pool_are_bit_identical(data_path):
    """hicache_bench's layout (1 KiB pages, size-1 axes) at its scale: merged ops of thousands of
    random pages over a pool of several 2 MiB pages, advised into huge pages. The whole L1 pool and
    every slot are checked against a numpy model after each step, so a page copied to a wrong
    place, a torn page or a write outside the op fails. (On the copy thread, each step's load reads
    the slots its backup is still writing.)"""
    spec = SPECS["f32"]
    num_pages, num_slots = 6144, 8192  # 6 MiB of L1: >= 2 whole huge pages at any alignment
    w = HostWorker(spec, num_pages, num_slots, devices=[jax.devices()[0]], host_pool_kind="numpy_slab",
                   data_path=data_path)
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


@pytest.mark.parametrize("strategy", ["compiled", "per_page", "vectorised", "own_scratch"])
@pytest.mark.parametrize("shape", [(1, 2, 16, 1, 8), (2, 2, 4, 2, 16), (3, 2, 1, 1, 1)])
def test_page_copier_matches_a_numpy_model(shape, strategy, monkeypatch):
    """``PageCopier`` both ways against plain numpy indexing, on a private pool buffer: layouts with
    size-1 axes and odd run counts, random and consecutive ids, chunks that split a batch (a copy to
    a wrong place, a torn page or a write outside the ids fails); ``own_scratch``: the chunks of a
    caller's scratch buffer (the copy thread's), 3 pages each."""
    rng = np.random.default_rng(30)
    num_pages, num_slots = 50, 70
    pool = rng.integers(0, 1 << 16, (shape[0], shape[1], num_pages, *shape[2:]), dtype=np.uint16)
    slab = rng.integers(0, 1 << 16, (num_slots, *shape), dtype=np.uint16)
    copier = host_copy.PageCopier(slab, num_pages)
    scratch = None
    if strategy == "compiled":
        assert copier.strategy is host_copy.CopyStrategy.COMPILED
    elif strategy == "per_page":
        _per_page(monkeypatch, copier)
    else:
        _vectorised(monkeypatch, copier, 4)
    if strategy == "own_scratch":
        scratch = copier.new_scratch(3 * copier.slot_bytes + 1)
        assert scratch.size == 3 * copier.slot_bytes
    model_pool, model_slab = pool.copy(), slab.copy()
    cases = [(rng.permutation(num_pages)[:11], rng.permutation(num_slots)[:11]),
             (np.arange(20, 29), np.arange(60, 69)), (np.array([49]), np.array([0]))]
    for pages, slots in cases:
        pages, slots = pages.astype(np.int32), slots.astype(np.int32)
        copier.to_slab(pool.ctypes.data, pages, slots, scratch)
        model_slab[slots] = np.moveaxis(model_pool[:, :, pages], 2, 0)
        np.testing.assert_array_equal(slab, model_slab)
        back = rng.permutation(num_pages)[: pages.size].astype(np.int32)
        copier.to_pool(pool.ctypes.data, back, slots, scratch)
        model_pool[:, :, back] = np.moveaxis(model_slab[slots], 0, 2)
        np.testing.assert_array_equal(pool, model_pool)


def test_page_copier_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"C-contiguous \[N, L, 2, S, H, D\].*\(4, 2\)"):
        host_copy.PageCopier(np.zeros((4, 2), np.uint16), 8)
    with pytest.raises(ValueError, match="num_pages must be a positive int, got 0"):
        host_copy.PageCopier(np.zeros((4, 1, 2, 1, 1, 8), np.uint16), 0)


# -- the copy thread (DataPath.HOST_THREAD): backups run on it, acked once their bytes landed ---------
@pytest.fixture
def threaded(monkeypatch) -> HostWorker:
    """A HOST_THREAD worker whose backups of any size go to the copy thread."""
    monkeypatch.setattr(transfer_mod, "ASYNC_MIN_PAGES", 1)
    w = HostWorker(SPECS["f32"], NUM_PAGES, NUM_SLOTS, devices=[jax.devices()[0]], host_pool_kind="numpy_slab",
                   data_path="host_thread")
    yield w
    w.close(timeout_s=60)


class _Gate:
    """Holds the copy thread (a job that waits for ``open``), so the copies queued behind it are in
    flight for as long as a test needs. Opens by itself after ``auto_open_s`` if given."""

    def __init__(self, worker: HostWorker, auto_open_s: float | None = None) -> None:
        self.event = threading.Event()
        self.job = worker.engine._copies.submit(self.event.wait, 60)
        self.timer = None
        if auto_open_s is not None:
            self.timer = threading.Timer(auto_open_s, self.event.set)
            self.timer.start()

    def open(self) -> None:
        self.event.set()


def test_copy_thread_acks_a_backup_only_after_its_bytes_landed(threaded):
    dp, hp = threaded.device_pool, threaded.host_pool
    data = _random_pages(threaded, 3, seed=40)
    dp.write_pages([4, 5, 6], data)
    gate = _Gate(threaded)
    threaded.submit(_plan(_op(1, "d2h", [4, 5, 6], [7, 8, 9])))
    assert threaded.poll() == []  # in flight: no ack, no byte written yet
    assert threaded.wait(timeout_s=0.05) == []  # a bounded wait gives up
    assert not _bits(hp.read_slots([7, 8, 9])).any()
    gate.open()
    acks = threaded.wait(timeout_s=60)
    assert [(a.op_id, a.ok, a.bytes_moved) for a in acks] == [(1, True, 3 * hp.slot_bytes)]
    np.testing.assert_array_equal(_bits(hp.read_slots([7, 8, 9])), _bits(data))


def test_copy_thread_keeps_plan_order(threaded, monkeypatch):
    """Copies land in plan order: two backups to one slot (the later wins, also when the later one is
    small enough to be copied at dispatch), and a load of a slot whose backup is in flight."""
    dp, hp = threaded.device_pool, threaded.host_pool
    data = _random_pages(threaded, 4, seed=41)
    dp.write_pages([1, 2, 3, 4], data)
    _Gate(threaded, auto_open_s=0.2)
    threaded.submit(_plan(_op(1, "d2h", [1, 2], [10, 11])))
    threaded.submit(_plan(_op(2, "d2h", [3], [10])))  # on the thread, behind op 1
    monkeypatch.setattr(transfer_mod, "ASYNC_MIN_PAGES", 2)
    threaded.submit(_plan(_op(3, "d2h", [4], [11])))  # at dispatch: waits for op 1's write of slot 11
    threaded.submit(_plan(_op(4, "h2d", [20, 21], [10, 11])))  # reads both slots after their backups
    acks = threaded.wait(timeout_s=60)
    assert [(a.op_id, a.ok) for a in acks] == [(1, True), (2, True), (3, True), (4, True)]
    np.testing.assert_array_equal(_bits(hp.read_slots([10, 11])), _bits(data[[2, 3]]))
    np.testing.assert_array_equal(_bits(dp.read_pages([20, 21])), _bits(data[[2, 3]]))


def test_a_load_of_other_pages_overlaps_a_backup_in_flight(threaded):
    """A load that touches neither the pages nor the slots of an in-flight backup runs at dispatch,
    while the backup still waits on the copy thread; then both are bit-exact. (The engine holds the
    pool array from the first load on: no take-over, which would wait for the copy thread.)"""
    dp, hp = threaded.device_pool, threaded.host_pool
    data, loaded = _random_pages(threaded, 2, seed=42), _random_pages(threaded, 2, seed=43)
    hp.write_slots([20, 21, 22, 23], np.concatenate([loaded, data]))
    threaded.submit(_plan(_op(0, "h2d", [1, 2], [22, 23])))
    assert [a.ok for a in threaded.wait(timeout_s=60)] == [True]
    gate = _Gate(threaded)
    threaded.submit(_plan(_op(1, "d2h", [1, 2], [5, 6])))
    threaded.submit(_plan(_op(2, "h2d", [30, 31], [20, 21])))
    assert threaded.poll() == []  # the load is done, but acks keep their order behind the backup
    handles = [p.handle for p in threaded._pending]
    assert [h.is_ready() for h in handles] == [False, True]
    gate.open()
    assert [(a.op_id, a.ok) for a in threaded.wait(timeout_s=60)] == [(1, True), (2, True)]
    np.testing.assert_array_equal(_bits(hp.read_slots([5, 6])), _bits(data))
    np.testing.assert_array_equal(_bits(dp.read_pages([30, 31])), _bits(loaded))


@pytest.mark.parametrize("writer", ["write_pages", "load", "forward"])
def test_writing_l1_pages_while_their_backup_is_in_flight_keeps_the_backup(threaded, writer):
    """The backup copies the pages as they were when it was submitted: a later write of them (the
    pool's own write, a load into them, a model forward that donates the pool) waits for it."""
    dp, hp = threaded.device_pool, threaded.host_pool
    old, new = _random_pages(threaded, 2, seed=44), _random_pages(threaded, 2, seed=45)
    dp.write_pages([3, 7], old)
    hp.write_slots([0, 1], new)
    _Gate(threaded, auto_open_s=0.2)
    threaded.submit(_plan(_op(1, "d2h", [3, 7], [12, 13])))
    if writer == "write_pages":
        dp.write_pages([3, 7], new)
    elif writer == "load":
        threaded.submit(_plan(_op(2, "h2d", [3, 7], [0, 1])))
    else:
        model = threaded.attach_model(_ForwardingModel)  # writes page 7, donating the pool
        threaded.run_model(lambda m: m.forward(new[1].astype(dp.storage_dtype), slow=False))
        threaded.submit(_plan(_op(2, "h2d", [3], [0])))
        assert dp.kv is model.pool
    assert all(a.ok for a in threaded.wait(timeout_s=60))
    np.testing.assert_array_equal(_bits(hp.read_slots([12, 13])), _bits(old))
    np.testing.assert_array_equal(_bits(dp.read_pages([3, 7])), _bits(new))


def test_close_with_copies_in_flight_lands_them_then_copies_inline(threaded):
    dp, hp = threaded.device_pool, threaded.host_pool
    data = _random_pages(threaded, 3, seed=46)
    dp.write_pages([1, 2, 3], data)
    _Gate(threaded, auto_open_s=0.2)
    threaded.submit(_plan(_op(1, "d2h", [1, 2], [4, 5])))
    threaded.close(timeout_s=60)  # waits for the queued copy
    assert threaded.engine.data_path is DataPath.HOST_MEMORY
    assert [(a.op_id, a.ok) for a in threaded.poll()] == [(1, True)]
    threaded.submit(_plan(_op(2, "d2h", [3], [6])))  # after close: copied at dispatch
    assert [(a.op_id, a.ok) for a in threaded.poll()] == [(2, True)]
    np.testing.assert_array_equal(_bits(hp.read_slots([4, 5, 6])), _bits(data))


def test_close_that_times_out_leaves_the_copies_to_finish(threaded):
    """A bounded close gives up on a held copy thread; the copy still lands and is acked, and an
    access to the pool waits for it first."""
    dp, hp = threaded.device_pool, threaded.host_pool
    data, new = _random_pages(threaded, 1, seed=47), _random_pages(threaded, 1, seed=48)
    dp.write_pages([1], data)
    gate = _Gate(threaded)
    threaded.submit(_plan(_op(1, "d2h", [1], [4])))
    threaded.close(timeout_s=0.05)
    assert threaded.poll() == []
    threading.Timer(0.1, gate.open).start()
    dp.write_pages([1], new)  # waits for the backup still queued
    assert [(a.op_id, a.ok) for a in threaded.wait(timeout_s=60)] == [(1, True)]
    np.testing.assert_array_equal(_bits(hp.read_slots([4])), _bits(data))
    np.testing.assert_array_equal(_bits(dp.read_pages([1])), _bits(new))


def test_a_copy_that_times_out_is_withdrawn_and_fails(threaded, monkeypatch):
    """A copy still queued when its bounded wait runs out never runs: its op fails, its slots keep
    their bytes, and the load behind it goes on."""
    monkeypatch.setattr(transfer_mod, "COPY_TIMEOUT_S", 0.05)
    dp, hp = threaded.device_pool, threaded.host_pool
    dp.write_pages([1], _random_pages(threaded, 1, seed=49))
    before = _bits(hp.read_slots([4])).copy()
    gate = _Gate(threaded)
    threaded.submit(_plan(_op(1, "d2h", [1], [4])))
    threaded.submit(_plan(_op(2, "h2d", [9], [4])))  # reads slot 4: waits for op 1, bounded
    acks = threaded.poll()
    assert [(a.op_id, a.ok) for a in acks] == [(1, False), (2, True)]
    assert "withdrawn" in acks[0].error
    gate.open()
    threaded.engine._copies.drain(60)
    np.testing.assert_array_equal(_bits(hp.read_slots([4])), before)
    np.testing.assert_array_equal(_bits(dp.read_pages([9])), before)


def test_forcing_a_data_path():
    spec = SPECS["f32"]
    w = HostWorker(spec, NUM_PAGES, NUM_SLOTS, devices=[jax.devices()[0]], host_pool_kind="numpy_slab",
                   data_path="host_thread")
    assert w.engine.data_path is DataPath.HOST_THREAD and w.engine._copies is not None
    w.close(timeout_s=60)
    with pytest.raises(ValueError, match="data path 'host_thread' needs one CPU device.*PinnedPagesHostPool"):
        HostWorker(spec, NUM_PAGES, NUM_SLOTS, devices=[jax.devices()[0]], host_pool_kind="pinned_pages",
                   data_path="host_thread")
    with pytest.raises(ValueError, match="'dma'"):
        HostWorker(spec, NUM_PAGES, NUM_SLOTS, devices=[jax.devices()[0]], data_path="dma")


class _CopyingModel(_ForwardingModel):
    """A forward that returns its result in a new buffer (no donation): the lent buffer is not kept."""

    def forward(self, page: np.ndarray, slow: bool) -> None:
        self.pool = _plus_zero(self.pool)


@jax.jit
def _plus_zero(kv):
    return kv + jnp.zeros((), kv.dtype)


@pytest.mark.parametrize("model_cls, layout_queries", [(_ForwardingModel, 0), (_CopyingModel, 1)])
def test_a_forward_output_in_the_lent_buffer_needs_no_layout_query(worker, monkeypatch, model_cls, layout_queries):
    """A load right after a forward: when the forward kept the lent buffer (its donation aliased it)
    the engine knows it by its pointer (no layout query, ~80 us with cold caches); a forward that
    returns another buffer has its layout checked. Either way the load lands bit-exact."""
    dp, hp = worker.device_pool, worker.host_pool
    new = _random_pages(worker, 2, seed=50)
    hp.write_slots([0, 1], new)
    worker.submit(_plan(_op(1, "h2d", [1], [0])))  # the engine checks and holds the pool array
    assert [a.ok for a in worker.wait(timeout_s=60)] == [True]
    worker.attach_model(model_cls)
    page = _random_pages(worker, 1, seed=51)[0].astype(dp.storage_dtype)
    worker.run_model(lambda m: m.forward(page, slow=False))  # compiles
    queries = []
    real = transfer_mod.row_major_address
    monkeypatch.setattr(transfer_mod, "row_major_address", lambda a: queries.append(a) or real(a))
    lent = dp.kv.unsafe_buffer_pointer()
    worker.run_model(lambda m: m.forward(page, slow=False))
    dp.kv.block_until_ready()
    assert (dp.kv.unsafe_buffer_pointer() == lent) == (layout_queries == 0)
    worker.submit(_plan(_op(2, "h2d", [9], [1])))
    assert [a.ok for a in worker.wait(timeout_s=60)] == [True]
    assert len(queries) == layout_queries
    np.testing.assert_array_equal(_bits(dp.read_pages([1, 9])), _bits(new))


def test_forwards_in_a_row_after_a_copying_forward_forget_the_lent_address(worker):
    """The engine knows a forward's output by the address of the buffer lent to the model only while
    the forwards alias it. After a forward that returned a new buffer, the buffer lent before may be
    freed and its address handed to a later output (a fresh allocation, layout unchecked), so the next
    hand-out forgets that address and the next load queries the layout. (The flaky form of this:
    ``test_a_forward_output_in_the_lent_buffer_needs_no_layout_query[*-_CopyingModel-1]`` saw no query
    whenever the allocator reused the address.) Donating forwards keep it."""
    dp, hp = worker.device_pool, worker.host_pool
    new = _random_pages(worker, 2, seed=52)
    hp.write_slots([0, 1], new)
    worker.submit(_plan(_op(1, "h2d", [1], [0])))  # the engine checks and holds the pool array
    assert [a.ok for a in worker.wait(timeout_s=60)] == [True]
    taken = dp.kv.unsafe_buffer_pointer()
    page = _random_pages(worker, 1, seed=53)[0].astype(dp.storage_dtype)
    worker.attach_model(_ForwardingModel)
    worker.run_model(lambda m: m.forward(page, slow=False))  # donates: the output is the buffer lent
    worker.run_model(lambda m: m.forward(page, slow=False))  # lent on: still that buffer
    assert worker.engine._lent_address == taken == dp.kv.unsafe_buffer_pointer()
    worker.run_model(lambda m: setattr(m, "pool", _plus_zero(m.pool)))  # a forward that copies
    assert dp.kv.unsafe_buffer_pointer() != taken
    worker.run_model(lambda m: m.forward(page, slow=False))  # the copy lent on: not the buffer lent before
    assert worker.engine._lent_address is None
    worker.submit(_plan(_op(2, "h2d", [9], [1])))
    assert [a.ok for a in worker.wait(timeout_s=60)] == [True]
    np.testing.assert_array_equal(_bits(dp.read_pages([1, 9])), _bits(new))


class _CountingModel(_ForwardingModel):
    """A forwarding model that counts the arrays it is handed."""

    def __init__(self, kv: jax.Array) -> None:
        super().__init__(kv)
        self.handed: list[jax.Array] = []

    def set_pool(self, kv: jax.Array) -> None:
        self.handed.append(kv)
        super().set_pool(kv)


def test_run_model_hands_over_and_checks_only_an_array_that_changed(worker):
    """The model is handed the L1 array only when it does not hold it already (a transfer or
    ``set_kv`` replaced it since its last call); its forward's output becomes the pool, and an output
    whose sharding is not the pool's is still refused after outputs that were accepted."""
    dp = worker.device_pool
    model = worker.attach_model(_CountingModel)
    page = _random_pages(worker, 1, seed=60)[0].astype(dp.storage_dtype)
    for _ in range(2):
        worker.run_model(lambda m: m.forward(page, slow=False))
        assert dp.kv is model.pool
    assert model.handed == []  # it held the array it was built over, then its own outputs
    fresh = jax.device_put(np.zeros(dp.shape, dp.storage_dtype), dp.sharding)
    dp.set_kv(fresh)
    assert worker.run_model(lambda m: m.pool) is fresh and model.handed == [fresh]
    worker.run_model(lambda m: m.forward(page, slow=False))
    np.testing.assert_array_equal(_bits(dp.read_pages([7])), _bits(page[None]))  # written into ``fresh``'s pool
    elsewhere = jax.device_put(np.zeros(dp.shape, dp.storage_dtype), jax.devices()[1])
    with pytest.raises(ValueError, match="set_kv: sharding .* differs from the pool's"):
        worker.run_model(lambda m: m.set_pool(elsewhere))
    with pytest.raises(ValueError, match="set_kv: sharding .* differs from the pool's"):
        dp.set_kv(elsewhere)
    assert dp.kv is not elsewhere
