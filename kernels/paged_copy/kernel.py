"""Pallas TPU paged gather/scatter: many ``make_async_copy`` DMAs in flight, then wait all.

Model: tpu-inference ``multi_layer_copy``. One DMA per (page, layer, K/V) chunk ``[S, H, D]``
(contiguous in both the pool and the staging buffer); all chunks of a call are started before any is
waited on, so the DMA engines see the whole batch at once. All chunks have the same size, so they
share one DMA semaphore: each ``wait`` on a same-shaped descriptor retires one chunk's bytes.

Memory spaces: pool and staging stay where XLA put them (``pl.ANY`` = HBM on TPU); page ids and the
valid-row count are scalar-prefetched into SMEM. ``interpret=pltpu.InterpretParams()`` runs the same
kernels on CPU (DMAs and semaphores included); that is how the tests check them against
``reference.py``.

``copy_pages_to_host`` DMAs pages straight into a ``pl.HOST`` (pinned host) output. Interpret mode
cannot model host memory, so it refuses to run there; it is exercised only on a real TPU
(``benchmarks/transfer_bench.py --impl pallas_tpu``).

All functions act on one shard (wrap them in ``shard_map`` for a sharded pool) and assume validated
ids (``validation.py``): a kernel cannot raise on a bad id, it would copy the wrong memory.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def _interpret_arg(interpret: bool) -> Any:
    return pltpu.InterpretParams() if interpret else False


def _chunk_loop(count_ref, num_layers: int, start_one, wait_one) -> None:
    """Starts ``count * L * 2`` copies, then waits as many."""
    total = count_ref[0] * (2 * num_layers)

    def start(t, carry):
        i = t // (2 * num_layers)
        r = t % (2 * num_layers)
        start_one(i, r // 2, r % 2)
        return carry

    def wait(t, carry):
        wait_one()
        return carry

    jax.lax.fori_loop(0, total, start, 0)
    jax.lax.fori_loop(0, total, wait, 0)


def _gather_kernel(ids_ref, count_ref, kv_ref, out_in_ref, out_ref, sem):
    # ids_ref: i32[m] SMEM; count_ref: i32[1] SMEM; kv_ref: [L, 2, P, S, H, D] ANY;
    # out_in_ref aliases out_ref: [m, L, 2, S, H, D] ANY; sem: DMA semaphore[1]
    del out_in_ref
    num_layers = kv_ref.shape[0]

    def copy(i, layer, kv):
        return pltpu.make_async_copy(
            kv_ref.at[layer, kv, ids_ref[i]], out_ref.at[i, layer, kv], sem.at[0]
        )

    _chunk_loop(count_ref, num_layers, lambda i, l, k: copy(i, l, k).start(), lambda: copy(0, 0, 0).wait())


def _scatter_kernel(ids_ref, count_ref, pages_ref, kv_in_ref, kv_ref, sem):
    # pages_ref: [m, L, 2, S, H, D] ANY; kv_in_ref aliases kv_ref: [L, 2, P, S, H, D] ANY
    del kv_in_ref
    num_layers = kv_ref.shape[0]

    def copy(i, layer, kv):
        return pltpu.make_async_copy(
            pages_ref.at[i, layer, kv], kv_ref.at[layer, kv, ids_ref[i]], sem.at[0]
        )

    _chunk_loop(count_ref, num_layers, lambda i, l, k: copy(i, l, k).start(), lambda: copy(0, 0, 0).wait())


def _count_arr(count: jax.Array | int) -> jax.Array:
    return jnp.reshape(jnp.asarray(count, jnp.int32), (1,))


def _dma_copy_call(kernel, target: jax.Array, name: str, interpret: bool):
    """The pallas_call shared by gather and scatter: 2 prefetched scalars (ids, count), refs left in
    place (``pl.ANY``), one DMA semaphore, and the output aliasing operand 3 (``target``, donated)."""
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(target.shape, target.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(),
            in_specs=[any_spec, any_spec],
            out_specs=any_spec,
            scratch_shapes=[pltpu.SemaphoreType.DMA((1,))],
        ),
        input_output_aliases={3: 0},
        interpret=_interpret_arg(interpret),
        name=name,
    )


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("out",))
def gather_pages_pallas(
    kv: jax.Array,  # [L, 2, P, S, H, D]
    page_ids: jax.Array,  # i32[m]; the first `count` are used
    count: jax.Array,  # i32[] valid ids, 1 <= count <= m
    out: jax.Array,  # [m, L, 2, S, H, D] staging buffer, donated and written in place
    *,
    interpret: bool = False,
) -> jax.Array:  # [m, L, 2, S, H, D]
    # operands: (ids, count, kv, out) -> out aliases operand 3
    return _dma_copy_call(_gather_kernel, out, "hicache_gather_pages", interpret)(
        page_ids.astype(jnp.int32), _count_arr(count), kv, out)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("kv",))
def scatter_pages_pallas(
    kv: jax.Array,  # [L, 2, P, S, H, D], donated and updated in place
    page_ids: jax.Array,  # i32[m]; the first `count` are used
    count: jax.Array,  # i32[]
    pages: jax.Array,  # [m, L, 2, S, H, D]
    *,
    interpret: bool = False,
) -> jax.Array:  # [L, 2, P, S, H, D]
    # operands: (ids, count, pages, kv) -> out aliases operand 3
    return _dma_copy_call(_scatter_kernel, kv, "hicache_scatter_pages", interpret)(
        page_ids.astype(jnp.int32), _count_arr(count), pages.astype(kv.dtype), kv)


def _to_host_kernel(ids_ref, count_ref, kv_ref, out_ref, sem):
    # kv_ref: [L, 2, P, S, H, D] HBM; out_ref: [m, L, 2, S, H, D] HOST (pinned); sem: DMA[1]
    num_layers = kv_ref.shape[0]

    def copy(i, layer, kv):
        return pltpu.make_async_copy(
            kv_ref.at[layer, kv, ids_ref[i]], out_ref.at[i, layer, kv], sem.at[0]
        )

    _chunk_loop(count_ref, num_layers, lambda i, l, k: copy(i, l, k).start(), lambda: copy(0, 0, 0).wait())


@functools.partial(jax.jit, static_argnames=("num_rows",))
def copy_pages_to_host(
    kv: jax.Array,  # [L, 2, P, S, H, D] in HBM
    page_ids: jax.Array,  # i32[num_rows]; the first `count` are used
    count: jax.Array,  # i32[]
    *,
    num_rows: int,
) -> jax.Array:  # [num_rows, L, 2, S, H, D] in pinned host memory
    """TPU only: HBM pages -> one pinned-host batch array by DMA (no HBM staging copy).

    Interpret mode has no host memory space, so this refuses to run off-TPU.
    """
    if jax.default_backend() != "tpu":
        raise NotImplementedError(
            "copy_pages_to_host needs a TPU: pl.HOST DMAs cannot run in Pallas interpret mode; "
            "use the portable path (gather -> device_put(memory_kind='pinned_host'))"
        )
    L, two, _, S, H, D = kv.shape
    return pl.pallas_call(
        _to_host_kernel,
        out_shape=jax.ShapeDtypeStruct((num_rows, L, two, S, H, D), kv.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.HOST),
            scratch_shapes=[pltpu.SemaphoreType.DMA((1,))],
        ),
        name="hicache_copy_pages_to_host",
    )(page_ids.astype(jnp.int32), _count_arr(count), kv)
