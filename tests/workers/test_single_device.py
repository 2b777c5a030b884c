"""The engine on one device (the CPU backend's usual case): jitted gather into staging + commit into
the pinned host pool (D2H), staged slots + jitted scatter into the donated pool (H2D), with the XLA
kernels and the Pallas TPU kernels in interpret mode; their ordering against model forwards and
pending readers of the pool (the JAX runtime's donation rules), and their failure rules."""

from __future__ import annotations

import functools
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from hicache.workers import HostWorker, KVCacheSpec, OpKind, TransferOp, TransferPlan

NUM_PAGES, NUM_SLOTS = 40, 32
SPECS = {
    "bf16": KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, dtype="bfloat16"),
    "f32": KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, page_size=16, dtype="float32"),
}
IMPLS = ["xla", "pallas_interpret"]  # the CPU/GPU kernels, and the TPU kernels interpreted


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


@pytest.fixture
def impl() -> str:
    """The kernel implementation; tests that check bytes parametrize it over ``IMPLS``."""
    return "xla"


@pytest.fixture(params=sorted(SPECS))
def worker(request, impl) -> HostWorker:
    w = HostWorker(SPECS[request.param], NUM_PAGES, NUM_SLOTS, devices=[jax.devices()[0]], impl=impl)
    assert w.engine.impl.value == impl
    yield w
    w.close()


def test_transfers_keep_the_pool_donatable(worker):
    """Neither direction leaves an external reference on the L1 buffer: a forward that donates the
    pool still gets its buffer in place (a referenced buffer is copied by the runtime instead)."""
    dp = worker.device_pool
    dp.write_pages([1], _random_pages(worker, 1, seed=20))
    worker.submit(_plan(_op(1, "d2h", [1], [2]), _op(2, "h2d", [3], [2])))
    assert [a.ok for a in worker.wait(timeout_s=60)] == [True, True]
    address = dp.kv.unsafe_buffer_pointer()
    forward = jax.jit(lambda kv: kv, donate_argnums=0)
    dp.set_kv(forward(dp.kv))
    assert dp.kv.unsafe_buffer_pointer() == address


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
    """The engine keeps no reference to a pool array: one replaced by ``set_kv`` and not donated is
    freed, not kept as a hidden second pool."""
    dp = worker.device_pool
    worker.submit(_plan(_op(1, "h2d", [1], [1])))
    assert [a.ok for a in worker.wait(timeout_s=60)] == [True]
    replaced = weakref.ref(dp.kv)
    dp.set_kv(jax.device_put(np.zeros(dp.shape, dp.storage_dtype), dp.sharding))
    worker.submit(_plan(_op(2, "d2h", [1], [2])))  # reads the new array
    assert [a.ok for a in worker.wait(timeout_s=60)] == [True]
    gc.collect()
    assert replaced() is None
    assert not _bits(worker.host_pool.read_slots([2])).any()  # the new array's zeros were backed up


def test_load_waits_for_a_pending_reader_of_the_pool(worker):
    """A load's scatter donates the L1 buffer, so it runs only after every computation already
    dispatched on it: a reader of page 7 still pending when a load overwrites page 7 sees the old
    page."""
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
    """A read the model left pending on the array lent to it still sees the old page when a load
    overwrites that page right after ``run_model``."""
    dp, hp = worker.device_pool, worker.host_pool
    old, new = _random_pages(worker, 2, seed=23), _random_pages(worker, 1, seed=24)
    hp.write_slots([0, 1], old)
    worker.submit(_plan(_op(1, "h2d", [7, 8], [0, 1])))
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


def test_load_after_a_forward_keeps_the_forwards_pages(worker):
    """A load right after a forward (its output donated to the scatter) lands its page, and the page
    the forward wrote stays; the model is handed the new array on its next call."""
    dp, hp = worker.device_pool, worker.host_pool
    page = _random_pages(worker, 1, seed=25)[0]  # [L, 2, S, H, D]: the pool's slice at page 7
    new = _random_pages(worker, 1, seed=26)
    hp.write_slots([0], new)
    model = worker.attach_model(_ForwardingModel)
    worker.run_model(lambda m: m.forward(page.astype(dp.storage_dtype), slow=False))
    dp.kv.block_until_ready()
    worker.submit(_plan(_op(1, "h2d", [7], [0])))
    assert [a.ok for a in worker.wait(timeout_s=60)] == [True]
    np.testing.assert_array_equal(_bits(dp.read_pages([7])), _bits(new))
    worker.run_model(lambda m: None)
    assert model.pool is dp.kv


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


@pytest.mark.parametrize("impl", IMPLS)
def test_round_trip_is_bit_identical(worker):
    dp, hp = worker.device_pool, worker.host_pool
    src = np.array([31, 3, 17, 0, 22, 9, 39], np.int32)  # unsorted, non-contiguous, not a power of 2
    slots = np.array([5, 30, 1, 12, 7, 0, 19], np.int32)
    data = _random_pages(worker, src.size, seed=1)
    dp.write_pages(src, data)
    worker.submit(_plan(_op(1, "d2h", src, slots)))
    acks = worker.wait(timeout_s=60)
    assert [(a.ok, a.error, a.bytes_moved) for a in acks] == [(True, None, src.size * hp.slot_bytes)]
    assert acks[0].duration_s > 0
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


@pytest.mark.parametrize("impl", IMPLS)
def test_backup_then_load_of_same_slots_in_one_plan(worker):
    dp = worker.device_pool
    data = _random_pages(worker, 3, seed=2)
    dp.write_pages([2, 4, 6], data)
    worker.submit(_plan(_op(1, "d2h", [2, 4, 6], [0, 1, 3]), _op(2, "h2d", [10, 11, 13], [3, 0, 1])))
    acks = worker.wait(timeout_s=60)
    assert [(a.op_id, a.ok) for a in acks] == [(1, True), (2, True)]
    np.testing.assert_array_equal(_bits(dp.read_pages([10, 11, 13])), _bits(data[[2, 0, 1]]))


def test_later_backup_to_same_slot_wins_over_a_pending_one(worker):
    """Two backups in flight into one slot: the later one's bytes stay (commits in plan order)."""
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


@pytest.mark.parametrize("impl", IMPLS)
def test_failures_leave_both_pools_unchanged(worker, monkeypatch):
    """A D2H that fails at its commit and an H2D that fails while staging change neither pool; the
    same pages and slots work afterwards."""
    dp, hp = worker.device_pool, worker.host_pool
    dp.write_pages(np.arange(NUM_PAGES), _random_pages(worker, NUM_PAGES, seed=7))
    hp.write_slots(np.arange(NUM_SLOTS), _random_pages(worker, NUM_SLOTS, seed=8))
    before_l1 = _bits(dp.read_pages(np.arange(NUM_PAGES))).copy()
    before_l2 = _bits(hp.read_slots(np.arange(NUM_SLOTS))).copy()

    def boom(*a, **k):
        raise RuntimeError("injected failure")

    real_begin = hp.begin_backup

    def begin_then_break(ids, staged, count):
        pending = real_begin(ids, staged, count)
        pending.commit = boom  # type: ignore[method-assign]
        return pending

    monkeypatch.setattr(hp, "begin_backup", begin_then_break)
    monkeypatch.setattr(hp, "stage_load", boom)
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


def test_a_worker_on_another_device_round_trips_exactly():
    """A worker whose one device is not the default one: staging, host pages and pool all live there."""
    w = HostWorker(SPECS["bf16"], NUM_PAGES, NUM_SLOTS, devices=[jax.devices()[1]])
    assert w.engine.single_device and w.device_pool.kv.devices() == {jax.devices()[1]}
    data = _random_pages(w, 5, seed=10)
    w.device_pool.write_pages([9, 1, 30, 4, 12], data)
    w.submit(_plan(_op(1, "d2h", [9, 1, 30, 4, 12], [2, 7, 0, 31, 5]),
                   _op(2, "h2d", [0, 3, 8, 39, 20], [2, 7, 0, 31, 5])))
    assert all(a.ok for a in w.wait(timeout_s=60))
    np.testing.assert_array_equal(_bits(w.host_pool.read_slots([2, 7, 0, 31, 5])), _bits(data))
    np.testing.assert_array_equal(_bits(w.device_pool.read_pages([0, 3, 8, 39, 20])), _bits(data))


def test_merged_ops_over_many_pages_are_bit_identical():
    """hicache_bench's layout (1 KiB pages, size-1 axes) with merged ops of thousands of random pages
    (several row buckets). The whole L1 pool and every slot are checked against a numpy model after
    each step, so a page copied to a wrong place, a torn page or a write outside the op fails."""
    spec = SPECS["f32"]
    num_pages, num_slots = 3072, 4096
    w = HostWorker(spec, num_pages, num_slots, devices=[jax.devices()[0]])
    dp, hp = w.device_pool, w.host_pool
    rng = np.random.default_rng(11)
    model_l1 = _random_pages(w, num_pages, seed=12)
    dp.write_pages(np.arange(num_pages), model_l1)
    model_l2 = np.zeros((num_slots, *dp.host_row_shape), dp.dtype)
    for step in range(3):
        n = [1500, 750, 1025][step]
        src, dst = rng.permutation(num_pages)[:n].astype(np.int32), rng.permutation(num_pages)[:n].astype(np.int32)
        slots = rng.permutation(num_slots)[:n].astype(np.int32)
        w.submit(_plan(_op(2 * step, "d2h", src, slots), _op(2 * step + 1, "h2d", dst, slots)))
        assert [a.ok for a in w.wait(timeout_s=120)] == [True, True]
        model_l2[slots] = model_l1[src]
        model_l1[dst] = model_l2[slots]
        np.testing.assert_array_equal(_bits(dp.read_pages(np.arange(num_pages))), _bits(model_l1))
        np.testing.assert_array_equal(_bits(hp.read_slots(np.arange(num_slots))), _bits(model_l2))


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



def _watch_programs(monkeypatch):
    """Records every jitted program the transfer path builds; returns a count of their compilations."""
    from hicache.workers import host_pool, transfer

    built: list = []
    for module, name in ((host_pool, "_rows_to_device"), (host_pool, "_rows_to_host"),
                         (transfer, "_scatter_single_fn"), (transfer, "_gather_single_fn")):
        def builder(*args, _fn=getattr(module, name)):
            jitted = _fn(*args)
            built.append(jitted)
            return jitted
        monkeypatch.setattr(module, name, builder)
    return lambda: sum(j._cache_size() for j in {id(j): j for j in built}.values())


def test_a_load_compiles_once_per_row_bucket_not_per_page_count(monkeypatch):
    """Loads of 5, 6 and 7 pages share the 8-row programs (host pages padded with host zero pages:
    one memory kind for every argument), so serving never compiles for a new batch size."""
    compiled_programs = _watch_programs(monkeypatch)
    w = HostWorker(SPECS["f32"], NUM_PAGES, NUM_SLOTS, devices=[jax.devices()[0]])
    try:
        w.host_pool.write_slots(np.arange(8, dtype=np.int32), _random_pages(w, 8, seed=3))
        w.engine.load(np.arange(5, dtype=np.int32), np.arange(5, dtype=np.int32)).finish()
        compiled = compiled_programs()
        for n in (6, 7, 8, 5):
            w.engine.load(np.arange(n, dtype=np.int32), np.arange(10, 10 + n, dtype=np.int32)).finish()
        assert compiled_programs() == compiled
        got = w.device_pool.read_pages(np.arange(10, 15))
        np.testing.assert_array_equal(_bits(got), _bits(w.host_pool.read_slots(np.arange(5))))
    finally:
        w.close()


def test_transfers_return_the_pool_with_the_sharding_a_forward_returns(worker):
    """On one device a jitted forward returns its pool with a SingleDeviceSharding; the pool starts
    with it and every load returns it too, so no program compiles twice for two sharding types."""
    forward = jax.jit(lambda kv: kv + 0, donate_argnums=0)
    dp = worker.device_pool
    start = type(dp.kv.sharding)
    dp.set_kv(forward(dp.kv))
    assert type(dp.kv.sharding) is start
    worker.submit(_plan(_op(1, "d2h", [1], [2]), _op(2, "h2d", [3], [2])))
    assert [a.ok for a in worker.wait(timeout_s=60)] == [True, True]
    assert type(dp.kv.sharding) is start


def test_a_load_is_acked_without_waiting_for_an_earlier_backup(worker):
    """A D2H still in flight (on TPU the slow direction: here held unfinished through its handle)
    holds back neither the ack of a later H2D nor a wait for it; it is acked once it is done."""
    dp = worker.device_pool
    dp.write_pages([1], _random_pages(worker, 1, seed=70))
    worker.submit(_plan(_op(1, "d2h", [1], [2])))
    assert [a.ok for a in worker.wait(timeout_s=60)] == [True]
    worker.submit(_plan(_op(2, "d2h", [4], [5]), _op(3, "h2d", [6], [2])))
    backup = worker._pending[0]
    assert backup.op.op_id == 2
    ready, backup.handle._ready = backup.handle._ready, lambda: False  # still moving to host
    assert [a.op_id for a in worker.wait(timeout_s=60, op_ids=[3])] == [3]
    assert worker.num_pending == 1
    np.testing.assert_array_equal(_bits(dp.read_pages([6])), _bits(dp.read_pages([1])))
    backup.handle._ready = ready
    assert [(a.op_id, a.ok) for a in worker.wait(timeout_s=60)] == [(2, True)]
    np.testing.assert_array_equal(_bits(worker.host_pool.read_slots([5])), _bits(dp.read_pages([4])))
