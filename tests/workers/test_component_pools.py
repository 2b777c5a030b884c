"""A hybrid model's component pools on a HostWorker: one D2H / H2D op moves the Full pages and the same copy's
pages of each component pool (``PoolCopy``) with the same transfer code, acked once; bad pools or ids are
refused before anything runs, and a part that fails leaves every pool unchanged."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from hicache.workers import ComponentPool, HostWorker, KVCacheSpec, OpKind, PoolCopy, TransferOp, TransferPlan

SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32")
SWA = ComponentPool("swa", KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32"),
                    num_device_pages=6, host_slots=5)


def _rows(pool, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *pool.host_row_shape)).astype(np.float32)


@pytest.fixture
def worker():
    w = HostWorker(SPEC, 10, 8, devices=[jax.devices()[0]], component_pools=(SWA,))
    yield w
    w.close()


def test_one_op_moves_full_and_component_pages_and_acks_once(worker):
    kv, (swa, swa_host, _) = worker.device_pool, worker.pools["swa"]
    full_data, swa_data = _rows(kv, 2, 1), _rows(swa, 2, 2)
    kv.write_pages([3, 4], full_data)
    swa.write_pages([0, 5], swa_data)
    backup = TransferOp(1, OpKind.BACKUP_D2H, [3, 4], [6, 7], pools=(PoolCopy("swa", [0, 5], [4, 1]),))
    worker.submit(TransferPlan(1, (backup,)))
    (ack,) = worker.wait(60)
    assert ack.ok and ack.op_id == 1
    np.testing.assert_array_equal(swa_host.read_slots([4, 1]), swa_data)  # the component's own L2 pool
    load = TransferOp(2, OpKind.LOAD_H2D, [8, 9], [6, 7], pools=(PoolCopy("swa", [2, 3], [4, 1]),))
    worker.submit(TransferPlan(2, (load,)))
    (ack,) = worker.wait(60)
    assert ack.ok
    np.testing.assert_array_equal(kv.read_pages([8, 9]), full_data)
    np.testing.assert_array_equal(swa.read_pages([2, 3]), swa_data)


@pytest.mark.parametrize(
    "pools, match",
    [
        ((PoolCopy("mamba", [0], [0]),), r"unknown component pool 'mamba' \(this worker has \['swa'\]\)"),
        ((PoolCopy("swa", [6], [0]),), "pool 'swa'.*device_pages.*6"),
        ((PoolCopy("swa", [0], [5]),), "pool 'swa'.*host_slots.*5"),
    ],
)
def test_bad_component_copies_are_refused_before_anything_runs(worker, pools, match):
    with pytest.raises(ValueError, match=match):
        worker.submit(TransferPlan(1, (TransferOp(1, OpKind.BACKUP_D2H, [0], [0]),
                                       TransferOp(2, OpKind.BACKUP_D2H, [1], [1], pools=pools))))
    assert worker.num_pending == 0
    worker.submit(TransferPlan(1, ()))  # the refused plan's seq was not taken


def test_bad_op_and_pool_definitions():
    with pytest.raises(ValueError, match="pools .*'swa'.* in a h2s op"):
        TransferOp(1, OpKind.BACKUP_H2S, [], [0], storage_keys=("k",), pools=(PoolCopy("swa", [0], [0]),))
    with pytest.raises(ValueError, match="appears twice"):
        TransferOp(1, OpKind.BACKUP_D2H, [0], [0], pools=(PoolCopy("swa", [0], [0]), PoolCopy("swa", [1], [1])))
    with pytest.raises(ValueError, match="must name a component pool"):
        PoolCopy("kv", [0], [0])
    with pytest.raises(ValueError, match="2 device_pages vs 1 host_slots"):
        PoolCopy("swa", [0, 1], [0])
    with pytest.raises(ValueError, match="host_slots must be a positive int"):
        ComponentPool("swa", SPEC, 4, 0)
    with pytest.raises(ValueError, match="given twice"):
        HostWorker(SPEC, 10, 8, devices=[jax.devices()[0]], component_pools=(SWA, SWA))


def test_run_model_lends_the_component_pools(worker):
    class Model:
        def __init__(self, kv):
            self.pool, self.parts = kv, {}

        def set_pool(self, kv):
            self.pool = kv

        def component_pool(self, name):
            return self.parts.get(name)

        def set_component_pool(self, name, array):
            self.parts[name] = array

    model = worker.attach_model(Model)
    lent = worker.pools["swa"][0].kv
    out = worker.run_model(lambda m: m.component_pool("swa"))
    assert out is lent
    replaced = lent + 1.0  # a forward's output: the worker's pool takes it back
    worker.run_model(lambda m: m.set_component_pool("swa", replaced))
    assert worker.pools["swa"][0].kv is replaced and model.parts["swa"] is replaced

    class Plain:
        def __init__(self, kv):
            self.pool = kv

        def set_pool(self, kv):
            self.pool = kv

    with pytest.raises(TypeError, match="no 'component_pool'"):
        worker.attach_model(Plain)


def test_storage_ops_move_component_pages_with_the_full_pages_and_commit_together(worker, tmp_path):
    """An H2S op with a ``StoragePart`` stores the component pool's slots as objects of its own pool; the S2H back
    writes both pools only at its commit (the owner thread, at the ack); a part whose objects are missing fails the
    whole op and no pool changes."""
    from hicache.storage import ModelFingerprint, Namespace, page_keys
    from hicache.workers import StoragePart
    from hicache.workers.storage_exec import StorageAttachment, StorageExecutor

    fp = ModelFingerprint("parts", SPEC.dtype, SPEC.page_size, SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim)
    _, swa_host, _ = worker.pools["swa"]
    ex = StorageExecutor(StorageAttachment(f"file://{tmp_path}/l3", fp, pages_per_object=2), worker.host_pool,
                         component_pools={"swa": swa_host})
    try:
        keys = page_keys(Namespace(fp), np.arange(4 * SPEC.page_size))
        full, swa = _rows(worker.device_pool, 4, 3), _rows(worker.pools["swa"][0], 2, 4)
        worker.host_pool.write_slots(np.array([0, 1, 2, 3], np.int32), full)
        swa_host.write_slots(np.array([3, 1], np.int32), swa)
        part = StoragePart("swa", 2, keys[3], np.array([3, 1], np.int32))  # the last two pages' window
        empty = np.empty(0, np.int32)
        assert ex(TransferOp(1, OpKind.BACKUP_H2S, empty, np.arange(4, dtype=np.int32), tuple(keys),
                             storage_parts=(part,)), worker.host_pool) == (4 * worker.host_pool.slot_bytes
                                                                           + 2 * swa_host.slot_bytes)
        # the window's pages are ONE object, named by the key of its last page (no index entries)
        (obj,) = [p for p in (tmp_path / "l3").rglob("*") if p.is_file() and "/swa/" in str(p)]
        assert obj.name == keys[3]
        back = StoragePart("swa", 2, keys[3], np.array([0, 4], np.int32))
        before = swa_host.read_slots(np.array([0, 4], np.int32))
        _, commit = ex(TransferOp(2, OpKind.PREFETCH_S2H, empty, np.array([4, 5, 6, 7], np.int32), tuple(keys),
                                  storage_parts=(back,)), worker.host_pool)
        np.testing.assert_array_equal(swa_host.read_slots(np.array([0, 4], np.int32)), before)  # not before commit
        commit()
        np.testing.assert_array_equal(worker.host_pool.read_slots(np.array([4, 5, 6, 7], np.int32)), full)
        np.testing.assert_array_equal(swa_host.read_slots(np.array([0, 4], np.int32)), swa)
        missing = StoragePart("swa", 0, keys[0], np.array([2], np.int32))  # never stored
        with pytest.raises(RuntimeError, match="1 of 3 pages failed"):
            ex(TransferOp(3, OpKind.PREFETCH_S2H, empty, np.array([0, 1], np.int32), tuple(keys[:2]),
                          storage_parts=(missing,)), worker.host_pool)
    finally:
        ex.close()


def test_bad_storage_parts_are_refused(worker):
    from hicache.workers import StoragePart

    key = "ab" * 32
    with pytest.raises(ValueError, match="not 'kv'"):
        StoragePart("kv", 0, key, [0])
    with pytest.raises(ValueError, match="at least one page"):
        StoragePart("swa", 0, key, [])
    with pytest.raises(ValueError, match="first_page"):
        StoragePart("swa", -1, key, [0])
    with pytest.raises(ValueError, match=r"H2S/S2H only"):
        TransferOp(1, OpKind.BACKUP_D2H, [0], [0], storage_parts=(StoragePart("swa", 0, key, [0]),))
    for part, match in ((StoragePart("mamba", 0, key, [0]), "unknown component pool 'mamba'"),
                        (StoragePart("swa", 0, key, [5]), "host_slots")):
        with pytest.raises(ValueError, match=match):
            worker.submit(TransferPlan(1, (TransferOp(1, OpKind.PREFETCH_S2H, [], [0], (key,), storage_parts=(part,)),)))
        assert worker.num_pending == 0
