"""L1 held by a serving engine as per-layer fused KV arrays, wrapped as hicache's L1 pool.

sgl-jax (and tpu-inference's ragged paged attention) keep one array per layer, K and V interleaved by
head (``merge_kv``: K0, V0, K1, V1, ...) and packed for sub-32-bit dtypes::

    layers[l]: [num_pages, page_size, 2 * num_kv_heads // packing, packing, head_dim]

sharded ``layer_spec`` (KV heads on axis 2). ``FusedLayerPool`` lets a ``HostWorker`` (its host pool
and transfer engine) run over those arrays: its transfer programs convert pages to and from the host
slot layout ``[L, 2, S, H, D]`` inside the jitted gather/scatter, so L2 slots and L3 objects have one
layout whatever engine filled them. The programs are plain XLA gathers/scatters (no Pallas variant of
this layout yet).

Ownership: the engine owns the arrays (its forward donates them and hands back new ones). This object
reads the current ones through ``get_layers()`` and hands the arrays a load produced (it donates the
old ones) back through ``set_layers(...)``; every call runs on the engine's KV-owning thread, between
forwards, on every host in the same order (SPMD, as ``DevicePool``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hicache.kernels.paged_copy import validate_ids
from hicache.workers.device_pool import local_head_shards
from hicache.workers.spec import KVCacheSpec

LAYER_HEAD_AXIS = 2  # position of the fused (2 * heads // packing) axis in a layer array


class FusedLayerPool:
    """hicache's L1 pool over an engine's per-layer fused KV arrays (module docstring)."""

    def __init__(self, spec: KVCacheSpec, get_layers: Callable[[], Sequence[jax.Array]],
                 set_layers: Callable[[list[jax.Array]], None], *, mesh: Mesh, layer_spec: P) -> None:
        if not isinstance(spec, KVCacheSpec):
            raise TypeError(f"spec must be a KVCacheSpec, got {type(spec).__name__}")
        layers = list(get_layers())
        if len(layers) != spec.num_layers:
            raise ValueError(f"{len(layers)} layer arrays for a spec of {spec.num_layers} layers")
        packing = 4 // spec.itemsize if spec.itemsize < 4 else 1
        want = (None, spec.page_size, 2 * spec.num_kv_heads // packing, packing, spec.head_dim)
        shape = tuple(layers[0].shape)
        if len(shape) != 5 or shape[1:] != want[1:] or any(tuple(a.shape) != shape for a in layers):
            raise ValueError(f"layer arrays must all be [pages, {', '.join(map(str, want[1:]))}] for {spec}, "
                             f"got {[tuple(a.shape) for a in layers][:2]}...")
        if np.dtype(layers[0].dtype) != spec.np_dtype:
            raise ValueError(f"layer dtype {layers[0].dtype} != spec dtype {spec.dtype}")
        spec_axes = tuple(layer_spec) + (None,) * (5 - len(tuple(layer_spec)))
        head_axis = spec_axes[LAYER_HEAD_AXIS]
        if any(a is not None and i != LAYER_HEAD_AXIS and _axis_size(mesh, a) > 1 for i, a in enumerate(spec_axes)):
            raise ValueError(f"only the KV-head axis of the layer arrays may be sharded, got {layer_spec}")
        self.spec = spec
        self.packing = packing
        self.num_pages = int(shape[0])
        self.mesh = mesh
        self.head_axis = head_axis
        self.layer_spec = P(*spec_axes)
        self.layer_sharding = NamedSharding(mesh, self.layer_spec)
        # Transfer staging rows [m, L, 2, S, H, D], sharded on heads as the layers are.
        self.partition_spec = P(None, None, None, None, head_axis, None)
        self.sharding = NamedSharding(mesh, self.partition_spec)
        self.shape = spec.pool_shape(self.num_pages)
        self.dtype = np.dtype(spec.np_dtype)
        self.storage_dtype = self.dtype  # the engine's arrays hold the model dtype
        self.head_shards = local_head_shards(self.sharding, self.shape)
        self.host_head_range = (self.head_shards[0].heads.start, self.head_shards[-1].heads.stop)
        self._get_layers, self._set_layers = get_layers, set_layers

    # -- the arrays (the engine's) -------------------------------------------------------------------
    @property
    def kv(self) -> list[jax.Array]:
        return list(self._get_layers())

    def adopt_kv(self, new_layers: list[jax.Array]) -> None:
        """Hands the arrays a load produced back to the engine (it donated the ones it read)."""
        self._set_layers(list(new_layers))

    # -- sizes (as DevicePool) -----------------------------------------------------------------------
    @property
    def page_bytes(self) -> int:
        return self.spec.page_bytes

    @property
    def host_row_shape(self) -> tuple[int, ...]:
        a, b = self.host_head_range
        L, _, S, _, D = self.spec.page_shape
        return (L, 2, S, b - a, D)

    # -- transfer programs (TransferEngine) ----------------------------------------------------------
    def transfer_fns(self) -> tuple[Callable, Callable]:
        """``(gather, scatter)`` with ``TransferEngine``'s signatures: ``gather(layers, ids, out) -> rows``
        and ``scatter(layers, ids, rows) -> (new_layers, token)``, ``ids = [count, *page_ids]``."""
        return (_gather_fn(self.mesh, self.layer_spec, self.partition_spec, self.packing),
                _scatter_fn(self.mesh, self.layer_spec, self.partition_spec, self.packing))

    def read_pages(self, pages: object) -> np.ndarray:
        """``[n, L, 2, S, H, D]`` copy of ``pages`` in the host slot layout (one host; tests, checks)."""
        ids = validate_ids(pages, self.num_pages, name="pages")
        packed = np.concatenate([[ids.size], ids]).astype(np.int32)
        gather, _ = self.transfer_fns()
        return np.asarray(gather(self.kv, packed, None))


    def write_pages(self, pages: object, data: np.ndarray) -> None:
        """Sets ``pages`` from ``data [n, L, 2, S, H, D]`` in the host slot layout (one host; tests)."""
        ids = validate_ids(pages, self.num_pages, name="pages")
        arr = np.asarray(data, dtype=self.dtype)
        if arr.shape != (ids.size, *self.host_row_shape):
            raise ValueError(f"data must have shape {(ids.size, *self.host_row_shape)}, got {arr.shape}")
        packed = np.concatenate([[ids.size], ids]).astype(np.int32)
        _, scatter = self.transfer_fns()
        new, _token = scatter(self.kv, packed, jax.device_put(arr, self.sharding))
        self.adopt_kv(new)


def _axis_size(mesh: Mesh, axis: str | tuple[str, ...]) -> int:
    names = axis if isinstance(axis, tuple) else (axis,)
    return math.prod(mesh.shape[n] for n in names)


def _to_rows(picked: jax.Array) -> jax.Array:
    """``[m, L, S, 2H/pk, pk, D]`` (pages taken from each layer) -> ``[m, L, 2, S, H, D]``."""
    m, L, S, a, pk, D = picked.shape
    return picked.reshape(m, L, S, a * pk // 2, 2, D).transpose(0, 1, 4, 2, 3, 5)


def _from_rows(rows: jax.Array, packing: int) -> jax.Array:
    """``[m, L, 2, S, H, D]`` -> ``[L, m, S, 2H/pk, pk, D]`` (each layer's pages, fused)."""
    m, L, _, S, H, D = rows.shape
    return rows.transpose(1, 0, 3, 4, 2, 5).reshape(L, m, S, 2 * H // packing, packing, D)


@functools.lru_cache(maxsize=None)
def _gather_fn(mesh: Mesh, layer_spec: P, row_spec: P, packing: int):
    def local(layers, ids):  # ids = [count, *page_ids]; rows past count read page ids[1+count:] (padding)
        return _to_rows(jnp.stack([buf[ids[1:]] for buf in layers], axis=1))

    mapped = jax.shard_map(local, mesh=mesh, in_specs=(layer_spec, P()), out_specs=row_spec, check_vma=False)
    fn = jax.jit(mapped)
    return lambda layers, ids, out: fn(layers, ids)  # (no staging buffer to reuse: the output is fresh)


@functools.lru_cache(maxsize=None)
def _scatter_fn(mesh: Mesh, layer_spec: P, row_spec: P, packing: int):
    def local(layers, ids, rows):  # ids = [count, *page_ids]
        rows, layers = lax.optimization_barrier((rows, layers))
        page_ids = ids[1:]
        # rows past count are padding: sent out of range, where the scatter drops them
        target = jnp.where(jnp.arange(page_ids.shape[0]) < ids[0], page_ids, layers[0].shape[0])
        fused = _from_rows(rows, packing)
        return [buf.at[target].set(fused[i], mode="drop") for i, buf in enumerate(layers)]

    mapped = jax.shard_map(local, mesh=mesh, in_specs=(layer_spec, P(), row_spec), out_specs=layer_spec,
                           check_vma=False)

    def scatter(layers, ids, rows):
        new = mapped(layers, ids, rows)
        return lax.optimization_barrier((new, ids[0]))  # (new layers, a token nobody donates)

    return jax.jit(scatter, donate_argnums=(0,))
