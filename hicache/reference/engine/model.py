"""The reference model: a tiny deterministic decoder-only transformer over the paged L1 pool.

RMSNorm -> GQA attention (RoPE, causal, optional sliding window per layer) -> RMSNorm -> SwiGLU MLP,
untied LM head; ``ModelConfig.recurrent_layers`` replace attention with a gated linear recurrence whose
state lives in a state pool (``hicache.reference.engine.recurrent``, which extends the argument below). Weights are a pure function of ``ModelConfig.seed`` (threefry PRNG).

Buffers: ``params`` are owned by the caller (a ``ModelRunner``) and never donated. ``kv_pool``
(layout in ``hicache.reference.engine.kv_layout``) belongs to the L1 owner; ``forward_chunk`` *donates* it and
returns the updated pool, so the caller must drop its old reference and use the returned one. Any
other reader or writer of L1 (the transfer engine) runs between forwards, on the thread that owns
the pool.

Bit-exactness: why cached KV and recomputed KV are the same bits
-----------------------------------------------------------------
Claim: for a fixed model, forward shape (``ForwardConfig``) and backend, the K/V written for position
``p`` and the logits of position ``p`` are a function of ``tokens[0..p]`` only, bit for bit. They do not
depend on how the sequence was split into chunks, on whether earlier positions came from prefill or
decode, on which request computed them, or on which pages hold them. Hence a request that reuses
pages of a prefix computed by anyone else produces exactly the logits, KV and greedy tokens of a
request that recomputes everything.

Why it holds, step by step:

1. *One program.* Every forward (prefill chunk or decode step) calls the same jitted function
   (``compiled_forward``) with the same shapes: one ``step: i32[3 + C + max_pages]`` (chunk base,
   valid range, tokens, page table) and a pool of fixed shape. XLA compiles it once; the kernels, blocking and reduction
   orders are then fixed. (On XLA:CPU the same row of a matmul rounds differently with a different
   number of rows, e.g. M=1 vs M=16: different kernels and blocking. Measured here: the dense forward
   over 17 vs 40 tokens differs by ~1e-6 in row 16. Hence a decode step is a padded chunk, not an M=1
   matmul, and attention always spans the padded maximum context.)
2. *Fixed row.* Position ``p`` is always computed in row ``p % C`` (``chunk_rows``; the forward derives
   row ``r``'s position as ``base + r`` from the chunk base, a multiple of ``C``): a token's row does
   not depend on where the chunk starts, so even a kernel whose code path depends on the row index
   (edge tiles, vector tails) treats it identically every time.
3. *Row independence.* Every op in the forward is row-wise: embedding lookup, RMSNorm (reduces over
   features), the projections and MLP (row ``r`` of ``x @ W`` reads only row ``r`` of ``x``), RoPE
   (from the row's own position), the LM head. The values in the other rows (padding, other tokens of
   the chunk) never enter row ``r``'s arithmetic.
4. *Attention reads the pool, not the fresh values.* Each layer first scatters the chunk's K/V into the
   pool (cast to the pool dtype), then gathers the request's whole context from the pool. So a query
   always sees exactly the bits that a later request will read from those pages.
5. *Fixed-size, masked attention.* Keys are gathered into ``max_pages * page_size`` rows; key row
   ``t`` *is* position ``t`` regardless of page ids. For each query the mask keeps exactly its visible
   keys (causal, inside its window), which hold the same bits in every run (induction, step 6).
   Scores of the other keys are replaced (``where``) by ``-inf``, so the max is taken over visible keys
   only and every masked probability is exactly ``+0.0``; the softmax denominator then adds exact
   zeros at fixed indices, and ``x + 0.0 == x``. In ``p @ V`` a masked key contributes ``0 * v``,
   which is ``+0.0`` or ``-0.0``: adding it to a nonzero partial sum changes nothing, so it can at most
   flip the sign of an attention output element that is exactly zero, and that element is consumed
   only as a summand of the ``wo`` projection, where it again changes nothing. The masked slots
   themselves differ between runs (stale data, another request's tokens, later positions of this
   chunk); value rows that no valid query of the chunk may see are replaced by ``0.0`` so that NaN or
   inf left there cannot turn ``0 * v`` into NaN. The grouping of the summed terms depends only on key
   positions, the same in every run.
6. *Induction over positions.* Position 0 depends only on token 0. If all positions ``< p`` hold the
   same bits in every run, then by 1-5 the K/V and logits of ``p`` are the same bits, whether ``p`` is
   computed now or was computed earlier by another request and then read from its pages.

What it does *not* cover: another chunk size, page size, ``max_pages``, dtype, backend or jax/XLA
version, or a sharded forward over another mesh (split reductions round differently). These are the
``numerics_key`` a KV fingerprint must include. The tests in ``tests/engine`` check the claim on the
current backend, and ``reference_forward`` (dense, no pages) checks that the model is what it says it
is, to floating-point tolerance.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hicache.reference.engine import kv_layout, recurrent
from hicache.reference.engine.config import ModelConfig

Params = dict[str, Any]


# --- weights -------------------------------------------------------------------------------------

_BLOCK = 1 << 16


@jax.jit
def _normal_block(seed: jax.Array, index: jax.Array) -> jax.Array:
    """f32[_BLOCK] standard normals, block ``index`` of the stream of ``seed`` (threefry)."""
    return jax.random.normal(jax.random.fold_in(jax.random.key(seed), index), (_BLOCK,), jnp.float32)


def _normal_stream(seed: int, n: int) -> np.ndarray:
    """The first ``n`` numbers of the seed's normal stream: fixed-shape blocks, so one compile serves
    every config (per-tensor PRNG calls cost seconds of op-by-op compiles on a busy CPU)."""
    blocks = [np.asarray(_normal_block(np.int32(seed), np.int32(b))) for b in range(-(-n // _BLOCK))]
    return np.concatenate(blocks)[:n]


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """The weights as drawn from the seed's stream, in drawing order, with shapes as leaves. The
    params pytree (``init_params``) concatenates each layer's ``wq|wk|wv`` into ``wqkv`` and
    ``w_gate|w_up`` into ``w_gate_up`` (one matmul each in the forward instead of three and two)."""
    h, q_dim, kv_dim = cfg.hidden, cfg.num_q_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = {
        "attn_norm": (h,), "wq": (h, q_dim), "wk": (h, kv_dim), "wv": (h, kv_dim), "wo": (q_dim, h),
        "mlp_norm": (h,), "w_gate": (h, cfg.mlp_hidden), "w_up": (h, cfg.mlp_hidden),
        "w_down": (cfg.mlp_hidden, h),
    }
    recurrent = {  # ``hicache.reference.engine.recurrent``: (decay, inflow, gate) projections, output
        "attn_norm": (h,), "w_rec": (h, 3 * h), "w_rec_out": (h, h),
        "mlp_norm": (h,), "w_gate": (h, cfg.mlp_hidden), "w_up": (h, cfg.mlp_hidden),
        "w_down": (cfg.mlp_hidden, h),
    }
    return {"embed": (cfg.vocab_size, h),
            "layers": [dict(recurrent if cfg.is_recurrent(i) else layer) for i in range(cfg.num_layers)],
            "final_norm": (h,), "lm_head": (h, cfg.vocab_size)}


def init_params(cfg: ModelConfig, device: jax.Device | jax.sharding.Sharding | None = None) -> Params:
    """Deterministic weights, a pure function of ``cfg`` (seed and shapes).

    Tensors take consecutive slices of the seed's normal stream in a fixed order (embed, then each
    layer's tensors in ``param_shapes`` order, then the head): matrices scaled by 1/sqrt(fan_in) so
    activations stay O(1), norm weights 1 + 0.1 * noise (the final norm is ones). Each layer holds
    ``attn_norm``, ``wqkv`` (``[wq | wk | wv]``), ``wo``, ``mlp_norm``, ``w_gate_up``
    (``[w_gate | w_up]``) and ``w_down``.
    """
    shapes = param_shapes(cfg)
    sizes = [int(np.prod(s)) for s in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))]
    stream = _normal_stream(cfg.seed, sum(sizes))
    offset = 0

    def take(shape: tuple[int, ...]) -> np.ndarray:
        nonlocal offset
        n = int(np.prod(shape))
        out = stream[offset: offset + n].reshape(shape)
        offset += n
        return out

    def draw(name: str, shape: tuple[int, ...]) -> np.ndarray:
        x = take(shape)
        if name.endswith("norm"):
            x = 1.0 + 0.1 * x
        elif name != "embed":
            x = x / np.sqrt(shape[0])
        return x.astype(np.float32)

    def put(x: np.ndarray) -> jax.Array:
        return jnp.asarray(x, cfg.jnp_dtype, device=device)

    def layer_params(drawn: dict[str, np.ndarray]) -> Params:
        if "w_rec" in drawn:  # a recurrent layer
            return {"attn_norm": put(drawn["attn_norm"]), "w_rec": put(drawn["w_rec"]),
                    "w_rec_out": put(drawn["w_rec_out"]), "mlp_norm": put(drawn["mlp_norm"]),
                    "w_gate_up": put(np.concatenate([drawn["w_gate"], drawn["w_up"]], axis=1)),
                    "w_down": put(drawn["w_down"])}
        return {"attn_norm": put(drawn["attn_norm"]),
                "wqkv": put(np.concatenate([drawn["wq"], drawn["wk"], drawn["wv"]], axis=1)),
                "wo": put(drawn["wo"]), "mlp_norm": put(drawn["mlp_norm"]),
                "w_gate_up": put(np.concatenate([drawn["w_gate"], drawn["w_up"]], axis=1)),
                "w_down": put(drawn["w_down"])}

    embed = put(draw("embed", shapes["embed"]))
    layers = [layer_params({name: draw(name, shape) for name, shape in layer.items()})
              for layer in shapes["layers"]]
    final_norm = jnp.ones(shapes["final_norm"], cfg.jnp_dtype, device=device)
    take(shapes["final_norm"])  # keep the stream order independent of how the final norm is set
    lm_head = put(draw("lm_head", shapes["lm_head"]))
    return {"embed": embed, "layers": layers, "final_norm": final_norm, "lm_head": lm_head}


# --- building blocks (shared by the paged forward and the dense reference) -----------------------

def _rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """x: [n, H] -> [n, H]; normalised in float32, returned in x.dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * w.astype(jnp.float32)).astype(x.dtype)


def _rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate-half RoPE. x: [n, heads, D]; positions: i32[n]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float32) / d))  # [D/2], a constant
    ang = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [n, D/2]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _mlp(x: jax.Array, lp: Params) -> jax.Array:
    """SwiGLU. x: [n, H] -> [n, H]; gate and up in one matmul."""
    gate, up = jnp.split(x @ lp["w_gate_up"], 2, axis=-1)
    return (jax.nn.silu(gate) * up) @ lp["w_down"]


def _qkv(h: jax.Array, lp: Params, positions: jax.Array,
         cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """h: [n, H] -> q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, D] (RoPE applied to q and k)."""
    n = h.shape[0]
    q_dim, kv_dim = cfg.num_q_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q, k, v = jnp.split(h @ lp["wqkv"], [q_dim, q_dim + kv_dim], axis=-1)  # one matmul
    q = q.reshape(n, cfg.num_q_heads, cfg.head_dim)
    k = k.reshape(n, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(n, cfg.num_kv_heads, cfg.head_dim)
    return _rope(q, positions, cfg.rope_theta), _rope(k, positions, cfg.rope_theta), v


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Masked GQA attention in float32.

    q: [n, Hq, D]; k, v: [T, Hkv, D]; mask: bool[n, T] (True = visible). Returns [n, Hq * D] in q.dtype.
    Rows with no visible key return zeros. A masked score is -inf whatever its key holds, so its
    probability is exp(-inf) = +0.0 exactly.
    """
    n = q.shape[0]
    qg = q.astype(jnp.float32).reshape(n, cfg.num_kv_heads, cfg.q_per_kv, cfg.head_dim)
    qg = qg * (1.0 / np.sqrt(cfg.head_dim))
    s = jnp.einsum("ngqd,tgd->ngqt", qg, k.astype(jnp.float32))  # [n, Hkv, G, T]
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    s_max = jnp.max(s, axis=-1, keepdims=True)
    s_max = jnp.where(jnp.isfinite(s_max), s_max, 0.0)
    p = jnp.exp(s - s_max)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("ngqt,tgd->ngqd", p, v.astype(jnp.float32))
    o = o / jnp.where(denom > 0.0, denom, 1.0)
    return o.reshape(n, cfg.num_q_heads * cfg.head_dim).astype(q.dtype)


def _window_mask(q_pos: jax.Array, k_pos: jax.Array, window: int | None) -> jax.Array:
    """bool[n, T]: causal, and within the last ``window`` positions (query included) if given."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


# --- the paged forward ---------------------------------------------------------------------------

STEP_HEADER = 3  # (base, lo, hi) at the head of a forward's step input
RECURRENT_STEP_HEADER = 4  # (base, lo, hi, state slot): the step input of a model with recurrent layers


def step_header(cfg: ModelConfig) -> int:
    return RECURRENT_STEP_HEADER if cfg.recurrent_layers else STEP_HEADER


def step_input(chunk_tokens: np.ndarray, page_table: np.ndarray, base: int, lo: int, hi: int,
               chunk_size: int, state_slot: int | None = None, swa_table: np.ndarray | None = None) -> np.ndarray:
    """A forward's one small input, ``i32[3 + C + max_pages]``: ``(base, lo, hi)``, the chunk's
    tokens by row (row ``r`` = position ``base + r``; positions ``[lo, hi)`` hold ``chunk_tokens``,
    the other rows 0), then the padded page table. One array, so one host->device transfer per
    forward. With ``state_slot`` (models with recurrent layers), ``i32[4 + C + max_pages]``: the
    header ends with the request's state slot. With ``swa_table`` (sliding-window layers in their own
    pool), the SWA page ids of the request's pages follow the page table (``i32[max_pages]`` each).

    chunk_tokens: i32[hi - lo]  the tokens of positions ``[lo, hi)``
    page_table:   i32[max_pages]
    """
    header = STEP_HEADER if state_slot is None else RECURRENT_STEP_HEADER
    tail = page_table.size if swa_table is None else 2 * page_table.size
    step = np.zeros(header + chunk_size + tail, np.int32)
    step[:STEP_HEADER] = base, lo, hi
    if state_slot is not None:
        step[STEP_HEADER] = state_slot
    step[header + lo - base: header + hi - base] = chunk_tokens
    step[header + chunk_size: header + chunk_size + page_table.size] = page_table
    if swa_table is not None:
        step[header + chunk_size + page_table.size:] = swa_table
    return step


def forward_chunk(
    params: Params,
    kv_pool: jax.Array,  # [L, 2, P, S, Hkv, D] (kv_layout), donated by ``compiled_forward``
    step: jax.Array,  # i32[3 + C + max_pages] from ``step_input``
    *,
    cfg: ModelConfig,
    chunk_size: int,
    state_pool: jax.Array | None = None,  # f32[R, 2, slots, 1, H, D/2H] (``recurrent``), recurrent layers only
    swa_pool: jax.Array | None = None,  # [L_swa, 2, P_swa, S, Hkv, D]: the sliding-window layers' own pool
) -> tuple[jax.Array, ...]:
    """One chunk of one request: write its K/V into the request's pages and return its logits.

    ``step`` holds ``(base, lo, hi)``, the tokens of rows ``0..C-1`` and the request's page table
    (``step_input``). Row ``r`` is position ``base + r`` (``base`` a multiple of ``C``, see
    ``chunk_rows``) and is valid iff ``lo <= base + r < hi``. Valid rows attend to every earlier
    position of the request (already in the pool or in this chunk) through the page table. Invalid
    rows write nothing and return zero logits. All positions ``< lo`` must already be in the pool.

    Returns ``(logits f32[C, vocab], kv_pool)``; the returned pool replaces the donated one. Run it
    through ``compiled_forward``. A model with recurrent layers also takes the state pool and the
    request's slot (``step[3]``): recurrent layers continue from ``state_pool[slot]`` (the state after
    position ``lo - 1``) and the forward returns ``(logits, kv_pool, state_pool)`` with the state after
    position ``hi - 1`` in that slot. With ``swa_pool``, sliding-window layers write and read their
    K/V there, through the SWA page table at the end of ``step`` (``SWAComponent.translate`` of the
    page table; -1 where the tree dropped the SWA KV: only positions outside every valid query's window),
    and the forward returns the updated ``swa_pool`` after ``kv_pool`` (before ``state_pool``).
    """
    c = chunk_size
    header = step_header(cfg)
    base, lo, hi = step[0], step[1], step[2]
    tokens = step[header: header + c]
    tail = step[header + c:]
    swa_table = None
    if swa_pool is not None:  # (static: the tail holds two tables)
        page_table, swa_table = tail[: tail.shape[0] // 2], tail[tail.shape[0] // 2:]
    else:
        page_table = tail  # i32[max_pages]
    positions = base + jnp.arange(c, dtype=jnp.int32)
    valid = (positions >= lo) & (positions < hi)

    geo = kv_layout.geometry(kv_pool)
    num_pages, page_size = geo.num_pages, geo.page_size
    ctx = page_table.shape[0] * page_size
    k_pos = jnp.arange(ctx, dtype=jnp.int32)  # key row t is position t

    # Where each row's K/V goes; padding rows get an out-of-range page and are dropped.
    page_ids = jnp.where(valid, page_table[jnp.clip(positions // page_size, 0, page_table.shape[0] - 1)],
                         num_pages)
    slots = positions % page_size

    states = None
    if cfg.recurrent_layers:
        if state_pool is None:
            raise ValueError("a model with recurrent layers needs its state pool")
        slot = step[STEP_HEADER]
        states = recurrent.read_state(state_pool, slot)  # f32[R, D]: the state after position lo - 1
    x = params["embed"][tokens]  # [C, H]
    for layer, lp in enumerate(params["layers"]):
        window = cfg.window_of(layer)
        h = _rms_norm(x, lp["attn_norm"], cfg.norm_eps)
        if cfg.is_recurrent(layer):
            assert states is not None  # set above for models with recurrent layers
            r = cfg.recurrent_layers.index(layer)
            mixed, new_state = recurrent.mix(h, lp["w_rec"], lp["w_rec_out"], states[r], valid)
            states = states.at[r].set(new_state)
            x = x + mixed
            x = x + _mlp(_rms_norm(x, lp["mlp_norm"], cfg.norm_eps), lp)
            continue
        q, k, v = _qkv(h, lp, positions, cfg)
        if window is not None and swa_pool is not None:
            assert swa_table is not None
            i = cfg.swa_layers.index(layer)
            n_swa = swa_pool.shape[2]
            swa_ids = swa_table[jnp.clip(positions // page_size, 0, swa_table.shape[0] - 1)]
            swa_ids = jnp.where(valid & (swa_ids >= 0), swa_ids, n_swa)  # (own pages always map an SWA page)
            swa_pool = kv_layout.write_tokens(swa_pool, i, swa_ids, slots, k, v)
            # dropped SWA pages (-1) read page 0: only keys no valid query sees (masked, values zeroed below)
            k_ctx, v_ctx = kv_layout.read_context(swa_pool, i, jnp.maximum(swa_table, 0))
        else:
            kv_pool = kv_layout.write_tokens(kv_pool, layer, page_ids, slots, k, v)
            k_ctx, v_ctx = kv_layout.read_context(kv_pool, layer, page_table)  # [ctx, Hkv, D] each
        # Value rows no valid query may see are zeroed: stale/NaN slots cannot leak through 0 * v.
        # (Their scores are -inf whatever the keys hold, so keys need no zeroing.)
        live = k_pos < hi
        if window is not None:
            live &= k_pos > lo - window
        v_ctx = jnp.where(live[:, None, None], v_ctx, 0)
        mask = _window_mask(positions, k_pos, window) & valid[:, None] & live[None, :]
        x = x + _attend(q, k_ctx, v_ctx, mask, cfg) @ lp["wo"]
        x = x + _mlp(_rms_norm(x, lp["mlp_norm"], cfg.norm_eps), lp)

    logits = (_rms_norm(x, params["final_norm"], cfg.norm_eps) @ params["lm_head"]).astype(jnp.float32)
    logits = jnp.where(valid[:, None], logits, 0.0)
    results: tuple[jax.Array, ...] = (logits, kv_pool) if swa_pool is None else (logits, kv_pool, swa_pool)
    if states is None:
        return results
    assert state_pool is not None
    return (*results, recurrent.write_state(state_pool, step[STEP_HEADER], states))


@functools.cache
def compiled_forward(cfg: ModelConfig, chunk_size: int, swa_pool: bool = False) -> Callable[..., tuple[jax.Array, ...]]:
    """``forward_chunk`` jitted for one model and chunk size, donating the pool:
    ``fn(params, kv_pool, step) -> (logits, kv_pool)``. With an SWA pool and/or recurrent layers the
    extra pools follow ``kv_pool`` in arguments and results, donated too:
    ``fn(params, kv_pool, [swa_pool], [state_pool], step) -> (logits, kv_pool, [swa_pool], [state_pool])``.
    One function per (config, chunk size, SWA pool) for the process, so every runner of a config shares
    one compiled program, and a call hashes no static argument (a ``ModelConfig`` hash costs microseconds
    on every forward)."""
    if not cfg.recurrent_layers and not swa_pool:
        return jax.jit(functools.partial(forward_chunk, cfg=cfg, chunk_size=chunk_size), donate_argnums=1)
    n_extra = int(swa_pool) + int(bool(cfg.recurrent_layers))

    def hybrid(params: Params, kv_pool: jax.Array, *rest: jax.Array) -> tuple[jax.Array, ...]:
        *pools, step = rest
        swa = pools[0] if swa_pool else None
        state = pools[-1] if cfg.recurrent_layers else None
        return forward_chunk(params, kv_pool, step, cfg=cfg, chunk_size=chunk_size, state_pool=state, swa_pool=swa)

    return jax.jit(hybrid, donate_argnums=tuple(range(1, 2 + n_extra)))


def chunk_rows(start: int, end: int, chunk_size: int) -> list[tuple[int, int, int]]:
    """Split positions ``[start, end)`` into aligned chunks ``(base, lo, hi)``.

    ``base`` is a multiple of ``chunk_size``; row ``r`` of the chunk is position ``base + r`` and is
    valid iff ``lo <= base + r < hi``. So position ``p`` always lands in row ``p % chunk_size``.
    """
    if not 0 <= start < end:
        raise ValueError(f"need 0 <= start < end, got start={start}, end={end}")
    out = []
    base = start - start % chunk_size
    while base < end:
        out.append((base, max(start, base), min(end, base + chunk_size)))
        base += chunk_size
    return out


# --- dense reference (no pages, no chunks) -------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("cfg",))
def reference_forward(params: Params, tokens: jax.Array, *, cfg: ModelConfig) -> jax.Array:
    """Plain causal forward over a whole sequence. tokens: i32[T] -> logits f32[T, vocab].

    Same math as ``forward_chunk`` without paging or chunking; equal to it up to float rounding
    (not bit-exact: other shapes, other kernels). Used to check that the paged path is the model.
    """
    pos = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    x = params["embed"][tokens]
    for layer, lp in enumerate(params["layers"]):
        h = _rms_norm(x, lp["attn_norm"], cfg.norm_eps)
        if cfg.is_recurrent(layer):
            zero = jnp.zeros((cfg.hidden,), jnp.float32)
            x = x + recurrent.mix(h, lp["w_rec"], lp["w_rec_out"], zero, jnp.ones(pos.shape, bool))[0]
            x = x + _mlp(_rms_norm(x, lp["mlp_norm"], cfg.norm_eps), lp)
            continue
        q, k, v = _qkv(h, lp, pos, cfg)
        k = k.astype(cfg.jnp_dtype)
        v = v.astype(cfg.jnp_dtype)
        x = x + _attend(q, k, v, _window_mask(pos, pos, cfg.window_of(layer)), cfg) @ lp["wo"]
        x = x + _mlp(_rms_norm(x, lp["mlp_norm"], cfg.norm_eps), lp)
    return (_rms_norm(x, params["final_norm"], cfg.norm_eps) @ params["lm_head"]).astype(jnp.float32)
