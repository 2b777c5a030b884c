"""``FusedLayerPool``: a host worker over an engine's per-layer fused KV arrays (sgl-jax's layout).

The slot layout a backup writes is checked against the fused layout's definition (heads interleaved
K0, V0, K1, V1, ..., packed for 16-bit dtypes), and a load writes exactly the pages it names, bit for
bit, into the engine's arrays (handed back through the owner's setter), on one device and sharded on
KV heads over two.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hicache.workers import HostWorker, KVCacheSpec, OpKind, TransferOp, TransferPlan
from hicache.workers.fused_pool import FusedLayerPool

LAYER_SPEC = P("data", None, "tensor", None, None)  # sgl-jax's kv_sharding


def fused_layers(spec: KVCacheSpec, num_pages: int, mesh: Mesh) -> list[jax.Array]:
    packing = 4 // spec.itemsize if spec.itemsize < 4 else 1
    shape = (num_pages, spec.page_size, 2 * spec.num_kv_heads // packing, packing, spec.head_dim)
    rng = np.random.default_rng(0)
    return [jax.device_put(rng.standard_normal(shape).astype(spec.np_dtype), NamedSharding(mesh, LAYER_SPEC))
            for _ in range(spec.num_layers)]


def expected_rows(layers: list[np.ndarray], pages: list[int], num_kv_heads: int) -> np.ndarray:
    """``[n, L, 2, S, H, D]`` by the fused layout's definition: fused index ``2*h + kv``."""
    out = []
    for p in pages:
        per_layer = []
        for buf in layers:
            page = buf[p].reshape(buf.shape[1], -1, buf.shape[-1])  # [S, 2H, D]
            k = np.stack([page[:, 2 * h] for h in range(num_kv_heads)], axis=1)
            v = np.stack([page[:, 2 * h + 1] for h in range(num_kv_heads)], axis=1)
            per_layer.append(np.stack([k, v]))
        out.append(np.stack(per_layer))
    return np.stack(out)


@pytest.mark.parametrize(("dtype", "num_devices"), [("float32", 1), ("bfloat16", 2)])
def test_backup_then_load_moves_pages_bit_for_bit(dtype: str, num_devices: int) -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=128, page_size=4, dtype=dtype)
    mesh = Mesh(np.array(jax.devices()[:num_devices]).reshape(1, num_devices), ("data", "tensor"))
    owner = {"layers": fused_layers(spec, 9, mesh)}
    before = [np.asarray(a) for a in owner["layers"]]
    pool = FusedLayerPool(spec, lambda: owner["layers"], lambda new: owner.update(layers=new), mesh=mesh,
                          layer_spec=LAYER_SPEC)
    assert len(pool.head_shards) == num_devices and pool.host_row_shape == (2, 2, 4, 2, 128)
    worker = HostWorker(spec, 9, 4, device_pool=pool)

    want = expected_rows(before, [3, 5], spec.num_kv_heads)
    np.testing.assert_array_equal(pool.read_pages([3, 5]), want)
    pool.write_pages([8], want[:1])  # page 8 := page 3
    np.testing.assert_array_equal(np.asarray(owner["layers"][1])[8], before[1][3])
    before = [np.asarray(a) for a in owner["layers"]]
    worker.submit(TransferPlan(0, (TransferOp(0, OpKind.BACKUP_D2H, [3, 5], [2, 0]),)))
    assert all(a.ok for a in worker.wait(30))
    np.testing.assert_array_equal(worker.host_pool.read_slots([2, 0]), want)

    worker.submit(TransferPlan(1, (TransferOp(1, OpKind.LOAD_H2D, [7, 1], [2, 0]),)))
    assert all(a.ok for a in worker.wait(30))
    after = [np.asarray(a) for a in owner["layers"]]  # the owner got the new arrays
    assert owner["layers"][0].sharding.is_equivalent_to(NamedSharding(mesh, LAYER_SPEC), 5)
    for old, new in zip(before, after):
        np.testing.assert_array_equal(new[7], old[3])
        np.testing.assert_array_equal(new[1], old[5])
        untouched = [p for p in range(9) if p not in (1, 7)]
        np.testing.assert_array_equal(new[untouched], old[untouched])


def test_layouts_the_pool_cannot_hold_are_rejected() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=128, page_size=4, dtype="float32")
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
    layers = fused_layers(spec, 5, mesh)
    with pytest.raises(ValueError, match="layer arrays must all be"):
        FusedLayerPool(KVCacheSpec(2, 2, 64, 4, "float32"), lambda: layers, lambda new: None, mesh=mesh,
                       layer_spec=LAYER_SPEC)
    with pytest.raises(ValueError, match="2 layer arrays for a spec of 3"):
        FusedLayerPool(KVCacheSpec(3, 2, 128, 4, "float32"), lambda: layers, lambda new: None, mesh=mesh,
                       layer_spec=LAYER_SPEC)
    two = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("data", "tensor"))
    with pytest.raises(ValueError, match="only the KV-head axis"):
        FusedLayerPool(spec, lambda: layers, lambda new: None, mesh=two, layer_spec=LAYER_SPEC)
    pool = FusedLayerPool(spec, lambda: layers, lambda new: None, mesh=mesh, layer_spec=LAYER_SPEC)
    with pytest.raises(ValueError, match="must match spec"):
        HostWorker(KVCacheSpec(2, 2, 128, 1, "float32"), 5, 4, device_pool=pool)
