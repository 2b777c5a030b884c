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
