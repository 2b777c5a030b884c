"""``HostKVPoolAdapter`` beyond sgl-jax's own tests: what the tests the plugin skips guard (a slot freed and
reallocated while a transfer is staged gets nothing from it), batches larger than one transfer program, a
flush of rows staged by several calls, and KV heads sharded over this session's 4 devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("sgl_jax")

from sgl_jax.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sgl_jax.srt.utils.mesh_utils import create_device_mesh  # noqa: E402

from hicache.sgl_jax.host_kv_pool import HostKVPoolAdapter  # noqa: E402

PAGES = 40


@pytest.fixture(scope="module")
def device_pool() -> MHATokenToKVPool:
    mesh = create_device_mesh(ici_parallelism=[1, -1], dcn_parallelism=[1, 1])  # KV heads over every device
    return MHATokenToKVPool(size=PAGES * 2, page_size=2, dtype=jnp.bfloat16, head_num=4, head_dim=128, layer_num=2,
                            mesh=mesh, dp_size=1)


def make_pool(device_pool: MHATokenToKVPool, slots: int) -> HostKVPoolAdapter:
    return HostKVPoolAdapter(device_pool, slots, device_pool.page_size, device_pool.layer_num,
                             tuple(device_pool.kv_buffer[0].shape[1:]), device_pool.dtype, device_pool.mesh,
                             device_pool.kv_sharding.spec)


def fill(device_pool: MHATokenToKVPool, pages: list[int], seed: int) -> list[np.ndarray]:
    """Random KV in ``pages`` of every layer; returns each layer's ``[len(pages), ...]`` copy."""
    out = []
    for layer, buf in enumerate(device_pool.kv_buffer):
        values = jax.random.normal(jax.random.PRNGKey(seed * 10 + layer), (len(pages), *buf.shape[1:]), buf.dtype)
        device_pool.kv_buffer[layer] = buf.at[np.asarray(pages)].set(values, out_sharding=buf.sharding)
        out.append(np.asarray(device_pool.kv_buffer[layer])[pages])
    return out


def read(device_pool: MHATokenToKVPool, pages: list[int]) -> list[np.ndarray]:
    return [np.asarray(buf)[pages] for buf in device_pool.kv_buffer]


def test_heads_sharded_over_devices(device_pool: MHATokenToKVPool) -> None:
    assert len(jax.devices()) > 1 and len(make_pool(device_pool, 1).host.head_shards) == len(jax.devices())


def test_round_trip_larger_than_one_transfer_program(device_pool: MHATokenToKVPool) -> None:
    pool = make_pool(device_pool, 8)
    pool.max_batch_pages = 2  # programs of 2 pages: 5 pages run as 2 + 2 + 1
    n = 5
    src, dst = list(range(1, 1 + n)), list(range(PAGES - n, PAGES))
    want = fill(device_pool, src, seed=1)
    slots = [int(s) for s in pool.alloc(n)]
    pool.copy_into(src, slots)
    pool.copy_to_device(slots, dst)
    for got, expected in zip(read(device_pool, dst), want):
        np.testing.assert_array_equal(got, expected)


def test_flush_of_rows_staged_by_several_calls_in_another_order(device_pool: MHATokenToKVPool) -> None:
    pool = make_pool(device_pool, 8)
    src, dst = [2, 3, 4, 5], [30, 31, 32, 33]
    want = fill(device_pool, src, seed=2)
    slots = [int(s) for s in pool.alloc(4)]
    pool.stage_backup(src[:2], slots[:2])
    pool.stage_backup(src[2:], slots[2:])
    pool.flush_backup(slots[::-1])  # rows of two gathers, reversed
    pool.stage_load(slots[1:3])
    pool.stage_load([slots[3], slots[0]])
    pool.flush_load([slots[3], slots[1], slots[0], slots[2]], [dst[3], dst[1], dst[0], dst[2]])
    for got, expected in zip(read(device_pool, dst), want):
        np.testing.assert_array_equal(got, expected)


def test_slot_reallocated_after_stage_backup_keeps_nothing(device_pool: MHATokenToKVPool) -> None:
    pool = make_pool(device_pool, 1)
    fill(device_pool, [6], seed=3)
    [slot] = [int(s) for s in pool.alloc(1)]
    pool.stage_backup([6], [slot])
    pool.free([slot])
    assert [int(s) for s in pool.alloc(1)] == [slot]  # the same id, a new allocation
    with pytest.raises(RuntimeError, match="nothing staged"):
        pool.flush_backup([slot])
    with pytest.raises(RuntimeError, match="empty"):
        pool.stage_load([slot])


def test_slot_reallocated_after_stage_load_is_not_scattered(device_pool: MHATokenToKVPool) -> None:
    pool = make_pool(device_pool, 2)
    fill(device_pool, [7], seed=4)
    guard = fill(device_pool, [20], seed=5)
    slot, other = (int(s) for s in pool.alloc(2))
    pool.copy_into([7], [slot])
    pool.stage_load([slot])
    pool.free([slot])
    [again] = [int(s) for s in pool.alloc(1)]
    assert again == slot
    pool.copy_into([7], [other])  # a real transfer beside it still lands
    pool.stage_load([other])
    with pytest.raises(RuntimeError, match="nothing staged"):
        pool.flush_load([slot, other], [20, 21])  # the reallocated slot's staging was dropped with it
    pool.flush_load([other], [20])
    assert not all(np.array_equal(g, w) for g, w in zip(read(device_pool, [20]), guard))


def test_bad_input_is_rejected_and_changes_nothing(device_pool: MHATokenToKVPool) -> None:
    pool = make_pool(device_pool, 4)
    with pytest.raises(ValueError, match="pool_size"):
        make_pool(device_pool, 0)
    slots = [int(s) for s in pool.alloc(2)]
    with pytest.raises(ValueError, match=str(PAGES + 1)):
        pool.stage_backup([PAGES + 1, 1], slots)
    with pytest.raises(ValueError, match="pairwise"):
        pool.copy_into([1], slots)
    pool.inc_lock_ref(slots[0])
    with pytest.raises(RuntimeError, match="locked"):
        pool.free(slots[::-1])
    assert pool.available_size() == 2  # neither slot was freed
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([3])
    pool.dec_lock_ref(slots[0])
    pool.free(slots)
    assert pool.available_size() == 4
    assert pool.alloc(5) is None and pool.available_size() == 4
