"""The L1 paged KV pool layout, in one place.

    k_pool, v_pool: jax.Array  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]

Token position ``p`` of a request lives in page ``page_table[p // page_size]``, slot ``p % page_size``,
for every layer. The pools are owned by whoever holds the L1 shard (the HostWorker on TPU, a
``ModelRunner`` in the embedded reference engine); the model forward donates them and returns the
updated arrays. Every other module (the forward, the runner, the tests) reads and writes pool contents
only through the functions here, so a layout change in ``workers/device_pool.py`` (e.g. fused K/V or
pages before layers) is adapted here alone. ``LAYOUT_VERSION`` goes into cache fingerprints.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from hicache.engine.config import ModelConfig

LAYOUT_VERSION = 1


@dataclass(frozen=True)
class PoolGeometry:
    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int


def pool_shape(cfg: ModelConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
    return (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)


def geometry(pool: jax.Array) -> PoolGeometry:
    """The geometry of a pool array (``pool`` may also be a ``jax.ShapeDtypeStruct``)."""
    if len(pool.shape) != 5:
        raise ValueError(f"KV pool must be 5-D [layers, pages, page_size, kv_heads, head_dim], "
                         f"got shape {tuple(pool.shape)}")
    return PoolGeometry(*(int(d) for d in pool.shape))


def make_pools(cfg: ModelConfig, num_pages: int, page_size: int,
               device: jax.Device | None = None) -> tuple[jax.Array, jax.Array]:
    """Zero-filled ``(k_pool, v_pool)`` on ``device`` (default device when ``None``)."""
    shape = pool_shape(cfg, num_pages, page_size)
    k = jnp.zeros(shape, cfg.jnp_dtype, device=device)
    v = jnp.zeros(shape, cfg.jnp_dtype, device=device)
    return k, v


def check_pools(cfg: ModelConfig, k_pool: jax.Array, v_pool: jax.Array) -> PoolGeometry:
    """Validate that both pools match ``cfg``; returns their geometry."""
    geo = geometry(k_pool)
    if tuple(k_pool.shape) != tuple(v_pool.shape):
        raise ValueError(f"k_pool shape {tuple(k_pool.shape)} != v_pool shape {tuple(v_pool.shape)}")
    want = pool_shape(cfg, geo.num_pages, geo.page_size)
    if tuple(k_pool.shape) != want:
        raise ValueError(f"KV pool shape {tuple(k_pool.shape)} does not match the model, want {want}")
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if jnp.dtype(pool.dtype) != cfg.jnp_dtype:
            raise ValueError(f"{name} dtype {pool.dtype} != model dtype {cfg.dtype}")
    return geo


# --- inside the jitted forward -------------------------------------------------------------------

def write_tokens(pool: jax.Array, layer: int, page_ids: jax.Array, slots: jax.Array,
                 values: jax.Array) -> jax.Array:
    """Scatter one layer's K (or V) of a chunk into the pool.

    pool:     [L, P, S, Hkv, D]
    page_ids: i32[n]  page of each row; rows with ``page_ids >= P`` are dropped (padding rows)
    slots:    i32[n]  slot within the page
    values:   [n, Hkv, D]
    """
    return pool.at[layer, page_ids, slots].set(values.astype(pool.dtype), mode="drop")


def read_context(pool: jax.Array, layer: int, page_table: jax.Array) -> jax.Array:
    """Gather one layer's K (or V) of a whole request context, in position order.

    page_table: i32[max_pages]  (entries past the request's pages may be any valid page id)
    returns:    [max_pages * S, Hkv, D]; row ``t`` holds position ``t``.
    """
    pages = pool[layer, page_table]  # [max_pages, S, Hkv, D]
    return pages.reshape(-1, *pages.shape[2:])


# --- host-side views (tests, debugging, data-plane checks) ---------------------------------------

def read_positions(pool: jax.Array, page_table: np.ndarray, num_tokens: int) -> np.ndarray:
    """Host copy of positions ``[0, num_tokens)`` of a request: ``[L, num_tokens, Hkv, D]``."""
    geo = geometry(pool)
    pos = np.arange(num_tokens)
    pages = np.asarray(page_table)[pos // geo.page_size]
    host = np.asarray(pool)
    return host[:, pages, pos % geo.page_size]


def fill_pages(pool: jax.Array, page_ids: np.ndarray, value: float,
               layers: tuple[int, ...] | None = None) -> jax.Array:
    """Return ``pool`` with whole pages set to ``value`` (for ``layers``, default all)."""
    layer_idx = np.arange(geometry(pool).num_layers) if layers is None else np.asarray(layers)
    idx = np.ix_(layer_idx, np.asarray(page_ids))
    return pool.at[idx].set(jnp.asarray(value, pool.dtype))
