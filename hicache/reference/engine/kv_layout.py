"""The L1 paged KV pool layout, in one place.

    kv_pool: jax.Array  # [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]
                        # kv_pool[:, 0] = K, kv_pool[:, 1] = V

This is the layout of ``hicache.kernels.paged_copy`` (one global array, sharded on the KV-head axis
by ``hicache.workers``). Token position ``p`` of a request lives in page ``page_table[p // page_size]``,
slot ``p % page_size``, for every layer and both of K and V.

The pool is owned by whoever holds the L1 shard (the HostWorker on TPU, a ``ModelRunner`` in the
embedded reference engine); the model forward donates it and returns the updated array. The forward,
the runner and the tests read and write pool contents only through the functions here, so a layout
change in the data plane is adapted here alone. ``LAYOUT_VERSION`` goes into cache fingerprints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from hicache.reference.engine.config import ModelConfig

LAYOUT_VERSION = 2
K, V = 0, 1  # index of the K / V half on axis 1
KV_HEAD_AXIS = 4  # the axis the data plane shards over a replica's mesh


@dataclass(frozen=True)
class PoolGeometry:
    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int


def pool_shape(cfg: ModelConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
    return (cfg.num_layers, 2, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)


def geometry(pool: jax.Array) -> PoolGeometry:
    """The geometry of a pool array (``pool`` may also be a ``jax.ShapeDtypeStruct``)."""
    if len(pool.shape) != 6 or pool.shape[1] != 2:
        raise ValueError(f"KV pool must be [layers, 2, pages, page_size, kv_heads, head_dim], "
                         f"got shape {tuple(pool.shape)}")
    num_layers, _, num_pages, page_size, num_kv_heads, head_dim = (int(d) for d in pool.shape)
    return PoolGeometry(num_layers, num_pages, page_size, num_kv_heads, head_dim)


def make_pool(cfg: ModelConfig, num_pages: int, page_size: int,
              device: jax.Device | jax.sharding.Sharding | None = None) -> jax.Array:
    """A zero-filled pool on ``device`` or with that sharding (default device when ``None``)."""
    return jnp.zeros(pool_shape(cfg, num_pages, page_size), cfg.jnp_dtype, device=device)


def sharded_spec(axis_name: str) -> jax.sharding.PartitionSpec:
    """PartitionSpec of a pool sharded on the KV-head axis over mesh axis ``axis_name``."""
    spec: list[str | None] = [None] * 6
    spec[KV_HEAD_AXIS] = axis_name
    return jax.sharding.PartitionSpec(*spec)


def replicated_like(pool: jax.Array) -> jax.sharding.Sharding:
    """Where the forward's other operands go: replicated over the pool's mesh, or the pool's device."""
    sharding = pool.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    if len(sharding.device_set) != 1:
        raise ValueError(f"KV pool sharding {sharding} is neither one device nor a NamedSharding")
    return jax.sharding.SingleDeviceSharding(next(iter(sharding.device_set)))


def check_pool(cfg: ModelConfig, pool: jax.Array) -> PoolGeometry:
    """Validate that ``pool`` matches ``cfg``; returns its geometry."""
    geo = geometry(pool)
    want = pool_shape(cfg, geo.num_pages, geo.page_size)
    if tuple(pool.shape) != want:
        raise ValueError(f"KV pool shape {tuple(pool.shape)} does not match the model, want {want}")
    if jnp.dtype(pool.dtype) != cfg.jnp_dtype:
        raise ValueError(f"KV pool dtype {pool.dtype} != model dtype {cfg.dtype}")
    return geo


# --- inside the jitted forward -------------------------------------------------------------------

def write_tokens(pool: jax.Array, layer: int, page_ids: jax.Array, slots: jax.Array,
                 k: jax.Array, v: jax.Array) -> jax.Array:
    """Scatter one layer's K and V of a chunk into the pool (in place when the pool is donated).

    pool:     [L, 2, P, S, Hkv, D]
    page_ids: i32[n]  page of each row; rows with ``page_ids >= P`` are dropped (padding rows)
    slots:    i32[n]  slot within the page
    k, v:     [n, Hkv, D]
    """
    pool = pool.at[layer, K, page_ids, slots].set(k.astype(pool.dtype), mode="drop")
    return pool.at[layer, V, page_ids, slots].set(v.astype(pool.dtype), mode="drop")


def read_context(pool: jax.Array, layer: int, page_table: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Gather one layer's K and V of a whole request context, in position order (one gather of whole
    pages for both).

    page_table: i32[max_pages]  (entries past the request's pages may be any valid page id)
    returns:    (k, v), each [max_pages * S, Hkv, D]; row ``t`` holds position ``t``.
    """
    pages = pool[layer][:, page_table]  # [2, max_pages, S, Hkv, D]
    k, v = pages.reshape(2, -1, *pages.shape[3:])
    return k, v


# --- host-side views and edits (tests, debugging, data-plane checks) -----------------------------

def read_positions(pool: jax.Array, page_table: np.ndarray, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Host copies of positions ``[0, num_tokens)`` of a request: ``(k, v)``, each ``[L, n, Hkv, D]``."""
    geo = geometry(pool)
    pos = np.arange(num_tokens)
    pages = np.asarray(page_table)[pos // geo.page_size]
    host = np.asarray(pool)
    return host[:, K, pages, pos % geo.page_size], host[:, V, pages, pos % geo.page_size]


def fill_pages(pool: jax.Array, page_ids: Sequence[int], value: float,
               layers: Sequence[int] | None = None) -> jax.Array:
    """Return ``pool`` with whole pages (K and V) set to ``value`` for ``layers`` (default all)."""
    layer_idx = np.arange(geometry(pool).num_layers) if layers is None else np.asarray(layers)
    idx = np.ix_(layer_idx, np.arange(2), np.asarray(page_ids))
    return pool.at[idx].set(jnp.asarray(value, pool.dtype))


def copy_pages(pool: jax.Array, src: Sequence[int], dst: Sequence[int]) -> jax.Array:
    """Return ``pool`` with pages ``dst[i]`` := ``src[i]`` (all layers, K and V)."""
    return pool.at[:, :, np.asarray(dst)].set(pool[:, :, np.asarray(src)])
