"""Pure-jnp reference for the paged copy family: the semantics every kernel must match bit for bit.

Simple, obviously-correct and slow-ish (XLA gather/scatter with default modes); used by the tests
and by ``DevicePool.read_pages``/``write_pages``. Arguments are validated by the caller
(``validation.py``); these functions assume in-range, unique ids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gather_pages_reference(
    kv: jax.Array,  # [L, 2, P, S, H, D]
    page_ids: jax.Array,  # i32[n]
) -> jax.Array:  # [n, L, 2, S, H, D]
    """Rows ``out[i] = kv[:, :, page_ids[i]]``."""
    return jnp.moveaxis(jnp.take(kv, page_ids, axis=2), 2, 0)


def scatter_pages_reference(
    kv: jax.Array,  # [L, 2, P, S, H, D]
    page_ids: jax.Array,  # i32[n]
    pages: jax.Array,  # [n, L, 2, S, H, D]
) -> jax.Array:  # [L, 2, P, S, H, D]
    """Returns ``kv`` with ``kv[:, :, page_ids[i]] = pages[i]``."""
    return kv.at[:, :, page_ids].set(jnp.moveaxis(pages, 0, 2).astype(kv.dtype))

