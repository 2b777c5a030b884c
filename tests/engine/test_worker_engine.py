"""The engine inside a HostWorker (DESIGN.md §1): the model forwards over the worker's L1 array.

Real JAX on CPU and a real ``HostWorker``; the model's KV is checked through the data plane (a D2H
backup into L2 must carry exactly the KV the forward wrote) and the pool hand-over survives errors.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from hicache.reference.engine import ForwardConfig, ModelConfig, ModelRunner, kv_layout
from hicache.reference.engine_adapters import WorkerEngine
from hicache.workers import HostWorker, KVCacheSpec
from hicache.workers.plan import OpKind, TransferOp, TransferPlan

MODEL = ModelConfig(num_layers=2)
FWD = ForwardConfig(chunk_size=16, page_size=8, max_pages=8)
SPEC = KVCacheSpec(MODEL.num_layers, MODEL.num_kv_heads, MODEL.head_dim, FWD.page_size, MODEL.dtype)


@pytest.fixture(scope="module")
def worker() -> HostWorker:
    w = HostWorker(SPEC, 16, 8, devices=jax.devices()[:1])
    w.attach_model(lambda kv: ModelRunner(MODEL, FWD, pool=kv))
    return w


def test_forward_writes_the_workers_l1_and_a_backup_moves_exactly_that(worker):
    tokens = np.arange(3, 27, dtype=np.int32)  # 24 tokens = 3 pages
    table = np.array([5, 9, 2], np.int32)
    logits = WorkerEngine(worker).extend(tokens, table, 0)
    assert logits.shape == (24, MODEL.vocab_size)
    k, v = kv_layout.read_positions(worker.device_pool.kv, table, 24)
    assert np.abs(k).sum() > 0 and np.abs(v).sum() > 0  # the forward wrote the worker's L1 array
    worker.submit(TransferPlan(0, (TransferOp(1, OpKind.BACKUP_D2H, table, np.array([0, 1, 2], np.int32)),)))
    (ack,) = worker.wait(10.0)
    assert ack.ok
    rows = worker.host_pool.read_slots(np.array([0, 1, 2], np.int32))  # [n, L, 2, S, H, D]
    np.testing.assert_array_equal(rows, worker.device_pool.read_pages(table))
    ref = ModelRunner(MODEL, FWD, num_pages=16, params=worker.model.params)
    np.testing.assert_array_equal(ref.extend(tokens, table, 0), logits)  # same model, own pool
    np.testing.assert_array_equal(rows, np.asarray(ref.pool)[:, :, table].transpose(2, 0, 1, 3, 4, 5))


def test_run_model_hands_the_pool_back_when_the_model_raises(worker):
    before = worker.device_pool.kv
    with pytest.raises(ValueError, match="page id"):
        WorkerEngine(worker).extend(np.arange(4, dtype=np.int32), np.array([99], np.int32), 0)
    assert worker.device_pool.kv is before  # validation failed before any donation: same array


def test_attach_model_rejects_what_is_not_a_pool_model():
    w = HostWorker(SPEC, 4, 2, devices=jax.devices()[:1])
    with pytest.raises(RuntimeError, match="no model attached"):
        w.run_model(lambda m: None)
    with pytest.raises(ValueError, match="no model attached"):
        WorkerEngine(w)
    with pytest.raises(TypeError, match="PoolModel"):
        w.attach_model(lambda kv: object())
    assert w.model is None


def test_decode_with_a_hook_is_checked_once_and_lends_the_pool_back_between_steps(worker):
    engine = WorkerEngine(worker)
    prompt = np.arange(40, 57, dtype=np.int32)  # 17 tokens; 6 new tokens write positions up to 21: 3 pages
    table = np.array([7, 3, 12], np.int32)
    logits = engine.prefill(prompt, table, 0)
    slots = iter(range(8))
    acks = []

    def hook() -> None:  # a transfer over L1 between steps, as a serving loop's cache calls may run
        worker.submit(TransferPlan(100 + len(acks), (TransferOp(len(acks), OpKind.BACKUP_D2H, table[:1],
                                                                np.array([next(slots)], np.int32)),)))
        acks.extend(worker.wait(10.0))

    gen = engine.decode(prompt, logits, table, 6, between_steps=hook)
    assert len(acks) == 5 and all(a.ok for a in acks)
    ref = ModelRunner(MODEL, FWD, num_pages=16, params=worker.model.params)
    own = np.array([0, 1, 2], np.int32)
    want = ref.decode(prompt, ref.prefill(prompt, own, 0), own, 6)
    assert gen.tokens == want.tokens
    np.testing.assert_array_equal(gen.logits, want.logits)  # bit-identical to the runner's own decode
    np.testing.assert_array_equal(kv_layout.read_positions(worker.device_pool.kv, table, 22)[0],
                                  kv_layout.read_positions(ref.pool, own, 22)[0])

    # The pages of the final length are checked before the first decode forward: a table too short
    # before anything (no hook), a bad page once the first token is out (its hook ran), not a step later.
    before, calls = worker.model.forwards, []
    with pytest.raises(ValueError, match=r"page_table has 2 pages, 3 needed for 17 tokens \+ 6 new tokens"):
        engine.decode(prompt, logits, table[:2], 6, between_steps=lambda: calls.append(1))
    assert not calls
    with pytest.raises(ValueError, match=r"page id 16 at index 2 is outside the pool"):
        engine.decode(prompt, logits, np.array([7, 3, 16], np.int32), 6, between_steps=lambda: calls.append(1))
    assert worker.model.forwards == before and calls == [1]
