"""L1: the paged KV pool in device memory, one global ``jax.Array`` sharded on the KV-head axis.

Layout (see ``hicache.kernels.paged_copy``)::

    kv: [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]    # kv[l, 0] = K, kv[l, 1] = V

sharded ``P(None, None, None, None, head_axis, None)`` over the replica's mesh: every device holds
all pages of its heads, so a page copy never crosses devices and a host's L2 slot holds exactly the
heads of its addressable shards.

Ownership: the ``HostWorker`` of each host owns one ``DevicePool`` object; the *array* is owned by
whichever call currently holds it, all on the worker's owner thread. A model forward donates ``kv``
and hands the new array back with ``set_kv``; the transfer engine's jitted scatter donates it and
hands the new one back with ``adopt_kv``, between forwards (DESIGN §4 "donation safety": the JAX
runtime runs a donating call only after every computation already dispatched on the buffer).

Multi-host: construction, ``read_pages``, ``write_pages`` and every transfer are SPMD programs --
every host of the replica calls them in the same order with the same ids. ``read_pages`` returns
and ``write_pages`` takes only this host's heads (``host_head_range``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from hicache.kernels.paged_copy import (
    gather_pages_reference,
    scatter_pages_reference,
    validate_ids,
)
from hicache.workers.spec import KVCacheSpec

HEAD_AXIS = 4  # position of num_kv_heads in the pool shape


@dataclass(frozen=True)
class HeadShard:
    """One distinct head range held by this host, and the local devices holding it."""

    heads: slice  # global head range [start, stop)
    devices: tuple[jax.Device, ...]

    @property
    def num_heads(self) -> int:
        return self.heads.stop - self.heads.start


def storage_dtype(dtype: npt.DTypeLike, backend: str | None = None) -> np.dtype:
    """dtype the L1 pool is *stored* in. On XLA:CPU, 16/8-bit floats are stored as their same-width
    unsigned bit pattern: XLA:CPU upcasts every bf16 dynamic_update_slice/scatter to f32 over the
    whole pool (O(pool) per transfer, see ``kernels/paged_copy/portable.py``). TPU/GPU store the
    logical dtype. Consumers view pages back with ``DevicePool.to_logical``."""
    dt = np.dtype(dtype)
    name = (backend or jax.default_backend()).lower()
    if name == "cpu" and dt.kind not in "iub" and dt.itemsize < 4:
        return np.dtype(f"u{dt.itemsize}")
    return dt


def default_mesh(num_kv_heads: int, devices: list[jax.Device] | None = None, head_axis: str = "kv") -> Mesh:
    """A 1-D mesh over the largest prefix of ``devices`` whose size divides ``num_kv_heads``."""
    devs = list(devices if devices is not None else jax.devices())
    n = math.gcd(len(devs), num_kv_heads)
    return Mesh(np.array(devs[:n]), (head_axis,))


def local_head_shards(sharding: NamedSharding, shape: tuple[int, ...]) -> tuple[HeadShard, ...]:
    """Distinct head ranges of this host's addressable shards, sorted by head."""
    by_heads: dict[tuple[int, int], list[jax.Device]] = {}
    for dev, idx in sharding.addressable_devices_indices_map(shape).items():
        assert idx is not None  # a NamedSharding maps every device to an index
        s = idx[HEAD_AXIS]
        start, stop, _ = s.indices(shape[HEAD_AXIS])
        by_heads.setdefault((start, stop), []).append(dev)
    shards = tuple(
        HeadShard(slice(a, b), tuple(sorted(devs, key=lambda d: d.id))) for (a, b), devs in sorted(by_heads.items())
    )
    for prev, nxt in zip(shards, shards[1:]):
        if prev.heads.stop != nxt.heads.start:
            raise ValueError(
                f"this host's KV heads are not contiguous: {[(s.heads.start, s.heads.stop) for s in shards]}"
            )
    return shards


class DevicePool:
    """The L1 paged KV pool of one replica, as seen from one host."""

    def __init__(
        self,
        spec: KVCacheSpec,
        num_pages: int,
        *,
        mesh: Mesh | None = None,
        head_axis: str = "kv",
    ) -> None:
        if not isinstance(spec, KVCacheSpec):
            raise TypeError(f"spec must be a KVCacheSpec, got {type(spec).__name__}")
        if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)) or num_pages <= 0:
            raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
        mesh = mesh if mesh is not None else default_mesh(spec.num_kv_heads, head_axis=head_axis)
        if head_axis not in mesh.shape:
            raise ValueError(f"head_axis {head_axis!r} is not an axis of the mesh {dict(mesh.shape)}")
        if spec.num_kv_heads % mesh.shape[head_axis]:
            raise ValueError(
                f"num_kv_heads={spec.num_kv_heads} is not divisible by mesh axis "
                f"{head_axis!r} of size {mesh.shape[head_axis]}"
            )
        self.spec = spec
        self.num_pages = int(num_pages)
        self.mesh = mesh
        self.head_axis = head_axis
        self.partition_spec = P(None, None, None, None, head_axis, None)
        self.sharding = NamedSharding(mesh, self.partition_spec)
        self.shape = spec.pool_shape(self.num_pages)
        self.dtype = np.dtype(spec.np_dtype)  # logical dtype
        self.storage_dtype = storage_dtype(self.dtype, mesh.devices.flat[0].platform)
        self.head_shards = local_head_shards(self.sharding, self.shape)
        self.host_head_range = (self.head_shards[0].heads.start, self.head_shards[-1].heads.stop)
        # What the pool array carries: on one device, a jitted program (a forward, a scatter) returns
        # a SingleDeviceSharding, and a program compiles once per input sharding *type*, so the pool
        # starts with, and every transfer returns, the sharding the forwards return.
        self.array_sharding: jax.sharding.Sharding = (
            SingleDeviceSharding(mesh.devices.flat[0]) if mesh.devices.size == 1 else self.sharding)
        self._kv = zeros_fn(self.shape, self.storage_dtype, self.array_sharding)()
        # the last sharding set_kv found equivalent to the pool's
        self._accepted_sharding: jax.sharding.Sharding = self.array_sharding

    @classmethod
    def from_memory_fraction(
        cls, spec: KVCacheSpec, fraction: float, *, mesh: Mesh | None = None, head_axis: str = "kv"
    ) -> "DevicePool":
        """Sizes the pool to ``fraction`` of the smallest device memory of the mesh (HBM on TPU)."""
        if not 0.0 < fraction <= 0.95:
            raise ValueError(f"fraction must be in (0, 0.95], got {fraction}")
        mesh = mesh if mesh is not None else default_mesh(spec.num_kv_heads, head_axis=head_axis)
        limit = min(device_memory_bytes(d) for d in mesh.devices.flat)
        per_device_page = spec.page_bytes // mesh.shape[head_axis]
        pages = int(limit * fraction) // per_device_page
        if pages <= 0:
            raise ValueError(f"fraction={fraction} of {limit} bytes holds no page of {per_device_page} bytes")
        return cls(spec, pages, mesh=mesh, head_axis=head_axis)

    # -- the array the model forward uses ---------------------------------------------------------
    @property
    def kv(self) -> jax.Array:
        """``[L, 2, P, S, H, D]`` in ``storage_dtype``. After a forward that donated it, hand the
        result to ``set_kv``; view gathered pages with ``to_logical``."""
        return self._kv

    def to_logical(self, x: jax.Array) -> jax.Array:
        """Storage-dtype values (e.g. gathered pages) -> the model dtype (no-op off CPU)."""
        return x if x.dtype == self.dtype else jax.lax.bitcast_convert_type(x, self.dtype)

    def to_storage(self, x: jax.Array) -> jax.Array:
        """Model-dtype values (new K/V to write into pages) -> the storage dtype."""
        x = x.astype(self.dtype)
        return x if x.dtype == self.storage_dtype else jax.lax.bitcast_convert_type(x, self.storage_dtype)

    def set_kv(self, new_kv: jax.Array) -> None:
        if not isinstance(new_kv, jax.Array):
            raise TypeError(f"set_kv expects a jax.Array, got {type(new_kv).__name__}")
        if tuple(new_kv.shape) != self.shape or new_kv.dtype != self.storage_dtype:
            raise ValueError(
                f"set_kv: expected {self.storage_dtype}{list(self.shape)}, got {new_kv.dtype}{list(new_kv.shape)}"
            )
        sharding = new_kv.sharding
        # A sharding equal to one accepted before passes with a cheap ``==``; ``is_equivalent_to``
        # converts both shardings, which is too slow to pay on every model call's output.
        if sharding != self._accepted_sharding:
            if not sharding.is_equivalent_to(self.sharding, new_kv.ndim):
                raise ValueError(f"set_kv: sharding {sharding} differs from the pool's {self.sharding}")
            self._accepted_sharding = sharding
        self._kv = new_kv

    def adopt_kv(self, new_kv: jax.Array) -> None:
        """``set_kv`` without the checks, for the transfer engine: its jitted scatters return the
        pool's shape, dtype and sharding by construction, so the checks would only add latency."""
        self._kv = new_kv

    # -- sizes --------------------------------------------------------------------------------------
    @property
    def page_bytes(self) -> int:
        return self.spec.page_bytes

    @property
    def capacity_bytes(self) -> int:
        """Bytes of the whole global pool (all hosts)."""
        return self.num_pages * self.spec.page_bytes

    @property
    def host_row_shape(self) -> tuple[int, ...]:
        """One page restricted to this host's heads: ``[L, 2, S, H_host, D]``."""
        a, b = self.host_head_range
        L, _, S, _, D = self.spec.page_shape
        return (L, 2, S, b - a, D)

    # -- numpy access (tests, engine checks) ------------------------------------------------------
    def read_pages(self, pages: object) -> np.ndarray:
        """``[n, L, 2, S, H_host, D]`` copy of this host's heads of ``pages``. Runs on every host."""
        ids = validate_ids(pages, self.num_pages, name="pages")
        rows = _gather_jit(self.sharding)(self._kv, jnp.asarray(ids))
        out = np.empty((ids.size, *self.host_row_shape), self.dtype)
        a = self.host_head_range[0]
        for shard in self.head_shards:
            piece = next(s for s in rows.addressable_shards if s.device == shard.devices[0])
            out[..., shard.heads.start - a : shard.heads.stop - a, :] = np.asarray(piece.data).view(self.dtype)
        return out

    def write_pages(self, pages: object, data: np.ndarray) -> None:
        """Sets this host's heads of ``pages`` from ``data [n, L, 2, S, H_host, D]``. Every host."""
        ids = validate_ids(pages, self.num_pages, name="pages")
        arr = np.asarray(data)
        want = (ids.size, *self.host_row_shape)
        if arr.shape != want:
            raise ValueError(f"data must have shape {want}, got {arr.shape}")
        arr = arr.astype(self.dtype, copy=False).view(self.storage_dtype)
        row_sharding = NamedSharding(self.mesh, P(None, None, None, None, self.head_axis, None))
        global_shape = (ids.size, *self.spec.page_shape)
        a = self.host_head_range[0]
        pieces = []
        for dev, idx in row_sharding.addressable_devices_indices_map(global_shape).items():
            assert idx is not None  # a NamedSharding maps every device to an index
            h0, h1, _ = idx[HEAD_AXIS].indices(self.spec.num_kv_heads)
            pieces.append(jax.device_put(np.ascontiguousarray(arr[..., h0 - a : h1 - a, :]), dev))
        rows = jax.make_array_from_single_device_arrays(global_shape, row_sharding, pieces)
        self._kv = _scatter_jit(self.array_sharding)(self._kv, jnp.asarray(ids), rows)


def device_memory_bytes(device: jax.Device) -> int:
    """Memory limit of one device (``bytes_limit`` on TPU/GPU; on CPU, total RAM / local devices)."""
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # CPU devices may not implement it
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    import psutil

    return psutil.virtual_memory().total // max(1, jax.local_device_count())


@functools.lru_cache(maxsize=64)
def zeros_fn(shape: tuple[int, ...], dtype: np.dtype, sharding: jax.sharding.Sharding):
    """Jitted ``() -> zeros(shape, dtype)`` placed by ``sharding``; compiled once per key (a pool
    or staging buffer of a known shape costs no trace/compile when built again)."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _gather_jit(sharding: NamedSharding):
    return jax.jit(gather_pages_reference, out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _scatter_jit(sharding: jax.sharding.Sharding):
    return jax.jit(scatter_pages_reference, out_shardings=sharding, donate_argnums=0)
