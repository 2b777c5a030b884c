"""The chunk program scanned over several steps in one dispatch, and where its bits were checked.

``compiled_scan`` runs ``model.forward_chunk`` once per step of a ``[B, 3 + C + max_pages]`` step
array, in order (``lax.scan``, the pool as the carry): each iteration is the same fixed-shape chunk
program, so each step's K/V and logits are those of its own ``compiled_forward`` call, and a later
step reads what an earlier one wrote (the carry). Users: ``hicache.reference.engine.batched`` (B requests' decode
steps) and ``ModelRunner.prefill`` (one request's consecutive chunks).

Why not one [B*C]-row forward: on XLA:CPU a matmul row rounds differently with another number of
rows (1 vs 16, 16 vs 64: measured), and a ``vmap`` of the [C] forward over B with shared weights
lowers to exactly that ([B, C, D] @ [D, E] merged into B*C rows: 12 of 80 shapes differed here).
A ``lax.scan`` of the [C] program gave bits equal to the unbatched program in 80 of 80 shapes (and
``tests/engine`` compare logits and pools bit for bit). A ``lax.fori_loop`` over a padded step array
with a traced trip count did not (session 10: other logits in the first case tried), so a scan is
compiled per B and callers use a few sizes (powers of two).

Backends: bit-identity is a property of the compiler, so it holds where it was checked: XLA:CPU. On
XLA:GPU (an H200, JAX 0.11.2) the scan's logits differed from ``decode_step``'s (the tokens were
equal); callers use the scan only on ``BIT_EXACT_PLATFORMS`` (``supported``).

Buffers: the pool argument is donated; the caller rebinds to the returned pool (``ModelRunner``
owns it between forwards). ``params`` are never donated.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from hicache.reference.engine.config import ModelConfig
from hicache.reference.engine.model import forward_chunk

BIT_EXACT_PLATFORMS = frozenset({"cpu"})  # where the scan's bits were checked equal to the chunk program's


def supported(platform: str) -> bool:
    """Whether the scanned chunk program is bit-identical to one forward per step on this JAX platform."""
    return platform in BIT_EXACT_PLATFORMS


def groups(n: int, cap: int | None = None) -> list[int]:
    """``n`` consecutive steps as scans of power-of-two lengths (up to ``cap``, a power of two, if
    given), largest first: a few compiled programs, no padding (a padded step costs a whole forward)."""
    out = []
    while n:
        size = 1 << (n.bit_length() - 1)
        size = size if cap is None else min(size, cap)
        out.append(size)
        n -= size
    return out


@functools.cache
def compiled_scan(cfg: ModelConfig, chunk_size: int) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """``fn(params, kv_pool, steps i32[B, 3 + C + max_pages]) -> (logits f32[B, C, vocab], kv_pool)``:
    ``forward_chunk`` over the B steps in order (``lax.scan``, the pool as the carry), donating the pool."""

    def run(params, kv_pool, steps):
        def body(kv, step):
            logits, kv = forward_chunk(params, kv, step, cfg=cfg, chunk_size=chunk_size)
            return kv, logits

        kv_pool, logits = jax.lax.scan(body, kv_pool, steps)
        return logits, kv_pool

    return jax.jit(run, donate_argnums=1)
