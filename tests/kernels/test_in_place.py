"""The compiled transfer programs update the pool in place: no copy of a pool-, L2- or
pool-shard-sized array, whatever the layout (size-1 axes included: XLA:CPU turned the reshape back
from the flat view into a relayout copy of the whole pool for those). Checked on the optimized HLO
and XLA's buffer assignment, so it fails without timing. Kernels alone and the engine's jitted
transfers, both directions, one device and heads sharded over 4 fake CPU devices."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hicache.kernels import paged_copy as pc
from hicache.workers import HostWorker, KVCacheSpec

# (layers, kv heads, head dim, page size, dtype); "degenerate" layouts have size-1 axes in the pool
# shard ([1, 2, P, 16, 1, 8]: hicache_bench's layout) and must stay in place too.
LAYOUTS = {
    "degenerate": KVCacheSpec(num_layers=1, num_kv_heads=4, head_dim=8, page_size=16, dtype="bfloat16"),
    "degenerate_f32": KVCacheSpec(num_layers=1, num_kv_heads=4, head_dim=8, page_size=1, dtype="float32"),
    "flat": KVCacheSpec(num_layers=2, num_kv_heads=8, head_dim=16, page_size=4, dtype="bfloat16"),
}
NUM_PAGES, NUM_SLOTS, ROWS = 256, 384, 8  # batch bucket << pool and L2

_BIG_OP = re.compile(r"=\s*\w+\[([\d,]*)\](?:\{[^}]*\})?\s+(copy|transpose)\(")


def big_copies(compiled, min_elements: int) -> list[str]:
    """HLO instructions (fused ones included) that copy or transpose >= ``min_elements`` elements."""
    out = []
    for line in compiled.as_text().splitlines():
        m = _BIG_OP.search(line)
        if m and int(np.prod([int(d) for d in m.group(1).split(",") if d], dtype=np.int64)) >= min_elements:
            out.append(line.strip()[:160])
    return out


def assert_in_place(lowered, big_elements: int, itemsize: int) -> None:
    compiled = lowered.compile()
    assert big_copies(compiled, big_elements) == []
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < big_elements * itemsize, f"temporary buffers {temp} B: a pool-sized copy"


# -- kernels --------------------------------------------------------------------------------------
def _shapes(spec: KVCacheSpec, heads: int):
    kv = (spec.num_layers, 2, NUM_PAGES, spec.page_size, heads, spec.head_dim)
    return kv, pc.page_row_shape(kv)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_kernels_compile_in_place(layout):
    spec = LAYOUTS[layout]
    kv_shape, row = _shapes(spec, 1 if layout.startswith("degenerate") else 2)
    kv = jax.ShapeDtypeStruct(kv_shape, jnp.uint16)
    ids = jax.ShapeDtypeStruct((ROWS,), jnp.int32)
    count = jax.ShapeDtypeStruct((), jnp.int32)
    staging = jax.ShapeDtypeStruct((ROWS, *row), jnp.uint16)
    pool_elems = int(np.prod(kv_shape))
    assert_in_place(jax.jit(pc.scatter_pages_xla, donate_argnums=0).lower(kv, ids, count, staging), pool_elems, 2)
    assert_in_place(jax.jit(pc.gather_pages_xla, donate_argnums=3).lower(kv, ids, count, staging), pool_elems, 2)


def test_kernels_compile_in_place_sharded():
    """shard_map over 4 devices, one KV head per shard (size-1 head axis inside every shard)."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("kv",))
    spec = P(None, None, None, None, "kv", None)
    sharding = NamedSharding(mesh, spec)
    kv_shape, row = _shapes(LAYOUTS["degenerate"], 4)
    kv = jax.ShapeDtypeStruct(kv_shape, jnp.uint16, sharding=sharding)
    staging = jax.ShapeDtypeStruct((ROWS, *row), jnp.uint16, sharding=sharding)
    ids = jax.ShapeDtypeStruct((ROWS,), jnp.int32)
    count = jax.ShapeDtypeStruct((), jnp.int32)

    def mapped(fn, in_specs, out_spec):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)

    scatter = mapped(pc.scatter_pages_xla, (spec, P(), P(), spec), spec)
    gather = mapped(pc.gather_pages_xla, (spec, P(), P(), spec), spec)
    shard_elems = int(np.prod(kv_shape)) // 4
    assert_in_place(jax.jit(scatter, donate_argnums=0).lower(kv, ids, count, staging), shard_elems, 2)
    assert_in_place(jax.jit(gather, donate_argnums=3).lower(kv, ids, count, staging), shard_elems, 2)


# -- the engine's jitted transfers ------------------------------------------------------------------
@pytest.mark.parametrize("devices", [1, 4])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_engine_transfers_compile_in_place(layout, devices):
    worker = HostWorker(LAYOUTS[layout], NUM_PAGES, NUM_SLOTS, devices=jax.devices()[:devices])
    try:
        engine, pool = worker.engine, worker.device_pool
        kv = pool.kv
        shard_elems = int(np.prod(kv.addressable_shards[0].data.shape))
        l2_elems = int(np.prod(worker.host_pool.slot_shape)) * NUM_SLOTS // devices
        big = min(shard_elems, l2_elems)
        itemsize = np.dtype(pool.storage_dtype).itemsize
        if layout.startswith("degenerate") and devices == 4:
            assert 1 in kv.addressable_shards[0].data.shape  # the case that used to copy
        staging = engine._take_staging(ROWS)
        one_list = np.zeros(1 + ROWS, np.int32)
        assert_in_place(engine._gather.lower(kv, one_list, staging), big, itemsize)  # D2H
        assert_in_place(engine._scatter.lower(kv, one_list, staging), big, itemsize)  # H2D (staged)
    finally:
        worker.close()
