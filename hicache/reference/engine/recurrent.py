"""The reference engine's recurrent layer kind and its state pool (the Mamba-like part of a hybrid model).

A recurrent layer replaces attention with a gated linear recurrence over positions (a small stand-in for
Mamba / linear-attention / RG-LRU layers): for the normalised input row ``h_t``,

    a_t, b_t, g_t = split(h_t @ w_rec)            # [D] each, D = hidden
    s_t = sigmoid(a_t) * s_{t-1} + (1 - sigmoid(a_t)) * b_t   # the state, f32[D], s_{-1} = 0
    out_t = (s_t * silu(g_t)) @ w_rec_out

so a layer's whole context is one state vector: a request continuing at position ``p`` needs the state
after exactly ``p`` tokens, nothing else (no KV of earlier positions). The pool holds one such state per
slot and recurrent layer, laid out as a paged KV pool whose page is one slot (``page_size`` 1) and whose
"K/V" halves and "heads" are the state vector's parts, so the data plane moves states with the very
programs that move KV pages (``hicache.workers``' ``ComponentPool``, sharded on the head axis like L1):

    state_pool: jax.Array  # f32[num_recurrent_layers, 2, num_slots, 1, num_kv_heads, hidden // (2 * num_kv_heads)]
    # the state of layer r in slot s: state_pool[r, :, s, 0].reshape(hidden)

Slots are the head's Mamba component's ids (``MambaComponent``: a slot is a cached node end's state or a
running request's working state). The pool's owner is the L1 owner (a ``ModelRunner``); the forward
donates it like the KV pool. Cached states are never written: a request works in its own slot and starts
by copying the cached one into it (``copy_states``) or zeroing it (``zero_states``).

Bit-exactness (continuing the argument in ``hicache.reference.engine.model``): the recurrence runs as a
``lax.scan`` over the chunk's rows inside the one fixed-shape program; each step is elementwise on f32[D]
with ``a_t``, ``b_t``, ``g_t`` from row ``t`` only, and invalid rows leave the state unchanged (``where``).
So the state after position ``p`` is a function of ``tokens[0..p]`` only, bit for bit, whichever chunk
computed each position and whether the state came from a cached slot or the same request's last chunk.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hicache.reference.engine.config import ModelConfig

STATE_DTYPE = jnp.float32


def state_shape(cfg: ModelConfig, num_slots: int) -> tuple[int, int, int, int, int, int]:
    """The pool's shape (the module docstring's layout); ``hidden`` must split into 2 x num_kv_heads parts."""
    heads = cfg.num_kv_heads
    if cfg.hidden % (2 * heads):
        raise ValueError(f"hidden={cfg.hidden} must split into 2 x num_kv_heads={heads} parts (the state pool's layout)")
    return (len(cfg.recurrent_layers), 2, num_slots, 1, heads, cfg.hidden // (2 * heads))


def read_state(pool: jax.Array, slot: jax.Array) -> jax.Array:
    """f32[R, hidden]: every recurrent layer's state in ``slot`` (inside the jitted forward)."""
    part = pool[:, :, slot, 0]  # [R, 2, H, d]
    return part.reshape(part.shape[0], -1)


def write_state(pool: jax.Array, slot: jax.Array, states: jax.Array) -> jax.Array:
    """``pool`` with ``slot`` := ``states`` (f32[R, hidden]; in place when the pool is donated)."""
    r, two, _, _, heads, d = pool.shape
    return pool.at[:, :, slot, 0].set(states.reshape(r, two, heads, d))


def make_state_pool(cfg: ModelConfig, num_slots: int,
                    device: jax.Device | jax.sharding.Sharding | None = None) -> jax.Array:
    """A zeroed state pool on ``device`` (replicated: states are small and every host reads them)."""
    return jnp.zeros(state_shape(cfg, num_slots), STATE_DTYPE, device=device)


def mix(h: jax.Array, w_rec: jax.Array, w_rec_out: jax.Array, state: jax.Array,
        valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One recurrent layer over a chunk's rows in order.

    h: [n, D] (normalised input); state: f32[D] (after the position before row 0's); valid: bool[n]
    (invalid rows keep the state). Returns (the layer's output [n, D] in h.dtype, the state after the
    last valid row).
    """
    a, b, g = jnp.split((h @ w_rec).astype(jnp.float32), 3, axis=-1)
    decay = jax.nn.sigmoid(a)
    inflow = (1.0 - decay) * b

    def step(s: jax.Array, row: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        d, u, ok = row
        s = jnp.where(ok, d * s + u, s)
        return s, s

    state, states = jax.lax.scan(step, state.astype(jnp.float32), (decay, inflow, valid))
    out = (states * jax.nn.silu(g)).astype(h.dtype)
    return out @ w_rec_out, state


@functools.partial(jax.jit, donate_argnums=0)
def _copy(pool: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    return pool.at[:, :, dst].set(pool[:, :, src])


@functools.partial(jax.jit, donate_argnums=0)
def _zero(pool: jax.Array, slots: jax.Array) -> jax.Array:
    return pool.at[:, :, slots].set(0.0)


def num_slots(pool: jax.Array) -> int:
    return int(pool.shape[2])


def _slot_array(pool: jax.Array, slots: Sequence[int] | np.ndarray, what: str) -> np.ndarray:
    arr = np.asarray(slots, dtype=np.int64).reshape(-1)
    n = num_slots(pool)
    if arr.size and (arr.min() < 0 or arr.max() >= n):
        bad = arr[(arr < 0) | (arr >= n)][0]
        raise ValueError(f"{what} slot {int(bad)} is outside the state pool [0, {n})")
    return arr.astype(np.int32)


def copy_states(pool: jax.Array, copies: Sequence[tuple[int, int]]) -> jax.Array:
    """``pool`` with ``pool[dst] := pool[src]`` for each ``(src, dst)`` (donated; rebind to the result)."""
    if not copies:
        return pool
    pairs = np.asarray(copies, dtype=np.int64).reshape(-1, 2)
    src = _slot_array(pool, pairs[:, 0], "copy source")
    dst = _slot_array(pool, pairs[:, 1], "copy destination")
    return _copy(pool, src, dst)


def zero_states(pool: jax.Array, slots: Sequence[int]) -> jax.Array:
    """``pool`` with ``slots`` zeroed (the state before any token; donated)."""
    arr = _slot_array(pool, slots, "zeroed")
    return _zero(pool, arr) if arr.size else pool
