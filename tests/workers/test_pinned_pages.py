"""The host pool (one ``pinned_host`` array per slot, as on TPU): its device-side split (D2H) and stack
(H2D) programs are compiled per row bucket, never per page count (a program per distinct batch
size would compile on every new size in the serving path); its capacity is a hard cap."""

from __future__ import annotations

import itertools

import jax
import numpy as np

from hicache.workers import HostWorker, KVCacheSpec, OpKind, TransferOp, TransferPlan, host_pool

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="bfloat16")
_ids = itertools.count(1)


def _run(worker: HostWorker, kind: str, pages: np.ndarray, slots: np.ndarray) -> None:
    op = TransferOp(next(_ids), OpKind(kind), np.asarray(pages, np.int32), np.asarray(slots, np.int32))
    worker.submit(TransferPlan(next(_ids), (op,)))
    assert [a.ok for a in worker.wait(timeout_s=60)] == [True]


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16)


def test_batches_of_one_bucket_share_one_program_and_round_trip_exactly():
    worker = HostWorker(SPEC, 64, 64, devices=[jax.devices()[0]])
    try:
        assert all(m == "pinned_host" for m in {s.memory_kind for s in worker.host_pool._host_sharding})
        rng = np.random.default_rng(0)
        shape = (64, *worker.device_pool.host_row_shape)
        data = rng.standard_normal(shape, dtype=np.float32).astype(worker.device_pool.dtype)
        worker.device_pool.write_pages(np.arange(64), data)
        split0 = host_pool._split_rows.cache_info().currsize
        stack0 = host_pool._stack_rows.cache_info().currsize
        for n in (5, 6, 7, 8):  # all in the 8-row bucket
            src, slots, dst = rng.choice(64, n, replace=False), rng.choice(64, n, replace=False), None
            _run(worker, "d2h", src, slots)
            dst = rng.choice(np.setdiff1d(np.arange(64), src), n, replace=False)
            _run(worker, "h2d", dst, slots)
            np.testing.assert_array_equal(_bits(worker.device_pool.read_pages(dst)), _bits(data[src]))
            data[dst] = data[src]
        assert host_pool._split_rows.cache_info().currsize - split0 <= 1
        assert host_pool._stack_rows.cache_info().currsize - stack0 <= 1
        # the rest of L1 is untouched by the padded rows of the bucket
        np.testing.assert_array_equal(_bits(worker.device_pool.read_pages(np.arange(64))), _bits(data))
    finally:
        worker.close()


def test_used_bytes_counts_held_slots_up_to_the_cap():
    worker = HostWorker(SPEC, 8, 6, devices=[jax.devices()[0]])
    hp = worker.host_pool
    assert hp.used_bytes == 0 and hp.capacity_bytes == 6 * hp.slot_bytes
    rows = np.zeros((3, *hp.slot_shape), hp.dtype)
    hp.write_slots([0, 4, 5], rows)
    assert hp.used_bytes == 3 * hp.slot_bytes
    hp.write_slots([4, 5], rows[:2])  # overwrites replace, they do not add
    assert hp.used_bytes == 3 * hp.slot_bytes
    _run(worker, "d2h", np.arange(6), np.arange(6))
    assert hp.used_bytes == hp.capacity_bytes
