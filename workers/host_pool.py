"""L2: the host pool. Fixed-size slots (one slot = one page: all layers, K and V, this host's heads).

Who owns what: each host's ``HostWorker`` owns one ``HostPool`` holding *its* heads of every slot
(``head_range``); nothing here is shared between hosts. Slot ids are allocated by the head (control
plane) and are identical on every host; the pool only validates them (range, duplicates).
``SlotAllocator`` is a reusable free list for tests and standalone use. All calls are local to one
host (no collectives).

Organisation per backend (``select_host_pool_kind``), both behind ``HostPool``:

* ``NUMPY_SLAB`` (CPU backend): one preallocated numpy slab per local head shard,
  ``[num_slots, L, 2, S, H_shard, D]``, in its own page-aligned mapping advised to use transparent
  huge pages (``slab_empty``). On XLA:CPU "device" memory already is host DRAM, so the cheapest L2
  is plain memory written by numpy. With one head shard the pool offers a ``PageCopier``
  (``page_copier``, ``hicache.workers.host_copy``): a single-device CPU engine then copies pages
  between the L1 buffer and the slab with numpy on the owner thread, both directions, nothing
  staged and nothing in flight. Otherwise a D2H commit is one ``slab[slots] = staged`` copy, and
  an H2D stage is one ``np.take(..., out=aligned_buffer)`` per shard followed by a zero-copy
  ``device_put`` and array assembly. Cost is O(batch), never O(pool).
  Measured here (2 cores): one big jax host array written by jitted ``dynamic_update_slice``
  ("mode B") costs ~75-120 ms per GiB of pool per write, and a bf16 scatter even converts the whole
  pool to f32; ``device_put(memory_kind="pinned_host")`` per batch reached ~19% of memcpy.
* ``PINNED_PAGES`` (TPU/GPU backends): one ``pinned_host`` ``jax.Array`` per slot and local head
  shard ("mode A", as sglang-jax): D2H gathers a batch on device, splits it into page rows there and
  moves them with one batched ``device_put`` to ``pinned_host``; freeing a slot drops the reference.
  A single big pinned array updated in place crashes on sharded multi-chip TPU hosts, and Pallas
  host DMAs (``pl.HOST``) cannot be tested in interpret mode. It also runs on CPU (the memory kind
  exists there), which is how it is tested.

Capacity: ``num_slots`` is fixed; ``capacity_bytes = num_slots * slot_bytes`` is a hard cap (the
slab is allocated up front; pinned pages are at most one live array per slot). ``size_host_pool``
checks the request against ``psutil`` available memory minus a reserve.
"""

from __future__ import annotations

import abc
import enum
import functools
import math
import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from hicache.kernels.paged_copy import validate_ids
from hicache.workers.device_pool import HEAD_AXIS, DevicePool, HeadShard
from hicache.workers.host_copy import PageCopier

ALIGN = 4096


class HostPoolKind(str, enum.Enum):
    NUMPY_SLAB = "numpy_slab"
    PINNED_PAGES = "pinned_pages"


def select_host_pool_kind(backend: str | None = None) -> HostPoolKind:
    """CPU -> numpy slab; TPU/GPU -> one pinned_host array per slot (see module docstring)."""
    name = (backend or jax.default_backend()).lower()
    if name == "cpu":
        return HostPoolKind.NUMPY_SLAB
    if name in ("tpu", "gpu", "cuda", "rocm"):
        return HostPoolKind.PINNED_PAGES
    raise ValueError(f"unknown backend {name!r}")


@dataclass(frozen=True)
class HostPoolConfig:
    """How big L2 is: exactly one of ``num_slots``, ``max_bytes`` or ``ratio_to_device`` (L2 bytes
    per byte of this host's share of L1). ``reserve_bytes`` of host memory stay free."""

    num_slots: int | None = None
    max_bytes: int | None = None
    ratio_to_device: float | None = None
    reserve_bytes: int = 2 << 30
    kind: HostPoolKind | None = None  # None: per backend

    def __post_init__(self) -> None:
        given = [n for n in ("num_slots", "max_bytes", "ratio_to_device") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"HostPoolConfig needs exactly one of num_slots/max_bytes/ratio_to_device, got {given}")
        value = getattr(self, given[0])
        if value <= 0:
            raise ValueError(f"HostPoolConfig.{given[0]} must be > 0, got {value}")
        if self.reserve_bytes < 0:
            raise ValueError(f"HostPoolConfig.reserve_bytes must be >= 0, got {self.reserve_bytes}")
        if self.kind is not None:
            object.__setattr__(self, "kind", HostPoolKind(self.kind))


def size_host_pool(
    config: HostPoolConfig, slot_bytes: int, device_bytes_on_host: int, available_bytes: int | None = None
) -> int:
    """Number of slots for ``config``; ``ValueError`` if it would not fit in host memory."""
    if config.num_slots is not None:
        slots = int(config.num_slots)
    elif config.max_bytes is not None:
        slots = int(config.max_bytes) // slot_bytes
    else:
        slots = int(device_bytes_on_host * float(config.ratio_to_device)) // slot_bytes
    if slots <= 0:
        raise ValueError(f"host pool of {config} holds no slot of {slot_bytes} bytes")
    if available_bytes is None:
        import psutil

        available_bytes = psutil.virtual_memory().available
    budget = available_bytes - config.reserve_bytes
    if slots * slot_bytes > budget:
        raise ValueError(
            f"host pool of {slots} slots x {slot_bytes} B = {slots * slot_bytes} B exceeds available host "
            f"memory {available_bytes} B minus reserve {config.reserve_bytes} B"
        )
    return slots


class SlotAllocator:
    """Free list of slot ids (lowest id first). The head has its own; this one serves tests/tools."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._used = np.zeros(num_slots, bool)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> np.ndarray:
        if n <= 0 or n > len(self._free):
            raise ValueError(f"cannot allocate {n} slots: {len(self._free)} free of {self.num_slots}")
        out = np.array([self._free.pop() for _ in range(n)], np.int32)
        self._used[out] = True
        return out

    def free(self, slots: object) -> None:
        ids = validate_ids(slots, self.num_slots, name="slots")
        if not self._used[ids].all():
            raise ValueError(f"slots not allocated: {ids[~self._used[ids]].tolist()}")
        self._used[ids] = False
        self._free.extend(sorted(ids.tolist(), reverse=True))
        self._free.sort(reverse=True)


def aligned_empty(shape: Sequence[int], dtype: np.dtype, align: int = ALIGN) -> np.ndarray:
    """An uninitialised numpy array whose data pointer is ``align``-byte aligned."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off : off + nbytes].view(dtype).reshape(shape)


def slab_empty(shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """An uninitialised, page-aligned array in its own anonymous mapping, advised to use transparent
    huge pages (``MADV_HUGEPAGE``; the kernel default here is ``madvise``). A slab is far larger
    than what the TLB covers with 4 KiB pages, and the page-table entries of a multi-GiB slab miss
    the cache, so each random slot access would pay a longer walk as the pool grows; 2 MiB pages
    keep the walk short. (On this noisy 2-core VM the effect is within the noise: the per-batch
    time at 4 GiB was <= 1.1x the 256 MiB one with and without it.) Unmapped when freed."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP disabled or unsupported: 4 KiB pages still work
            pass
    return np.frombuffer(buf, np.uint8, count=nbytes).view(dtype).reshape(shape)


def _bits(a: np.ndarray) -> np.ndarray:
    """Same-width unsigned view: numpy copies of custom dtypes (bf16) go through slow paths."""
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


class PendingBackup(abc.ABC):
    """A D2H in flight: ``is_ready`` without blocking, then ``commit`` exactly once."""

    @abc.abstractmethod
    def is_ready(self) -> bool: ...

    @abc.abstractmethod
    def block(self) -> None:
        """Blocks until ``is_ready``."""

    @abc.abstractmethod
    def commit(self) -> None: ...

    def release(self) -> None:  # return staging buffers; called after commit or on failure
        pass


class HostPool(abc.ABC):
    """L2 slots for this host's heads. See the module docstring for the organisations."""

    kind: HostPoolKind

    def __init__(self, device_pool: DevicePool, num_slots: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, (int, np.integer)) or num_slots <= 0:
            raise ValueError(f"num_slots must be a positive int, got {num_slots!r}")
        self.device_pool = device_pool
        self.num_slots = int(num_slots)
        self.head_shards: tuple[HeadShard, ...] = device_pool.head_shards
        self.head_range: tuple[int, int] = device_pool.host_head_range
        self.slot_shape: tuple[int, ...] = device_pool.host_row_shape
        self.dtype: np.dtype = np.dtype(device_pool.dtype)  # logical dtype of read/write_slots
        self.storage_dtype: np.dtype = np.dtype(device_pool.storage_dtype)  # dtype of device staging
        self.slot_bytes: int = math.prod(self.slot_shape) * self.dtype.itemsize  # read per transfer

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int:
        """Host bytes held by slot data right now (never above ``capacity_bytes``)."""

    def check_slots(self, slots: object, *, name: str = "host_slots") -> np.ndarray:
        return validate_ids(slots, self.num_slots, name=name)

    def _shard_cols(self, shard: HeadShard) -> slice:
        a = self.head_range[0]
        return slice(shard.heads.start - a, shard.heads.stop - a)

    # -- numpy access (L3 storage layer, tests) ------------------------------------------------------
    def read_slots(self, slots: object) -> np.ndarray:
        """``[n, *slot_shape]`` copy of the slots' data."""
        ids = self.check_slots(slots, name="slots")
        out = np.empty((ids.size, *self.slot_shape), self.dtype)
        for k, shard in enumerate(self.head_shards):
            out[..., self._shard_cols(shard), :] = self._read_shard(k, ids)
        return out

    def write_slots(self, slots: object, data: np.ndarray) -> None:
        """Sets the slots from ``data [n, *slot_shape]`` (validated before anything is written)."""
        ids = self.check_slots(slots, name="slots")
        arr = np.asarray(data)
        if arr.shape != (ids.size, *self.slot_shape):
            raise ValueError(f"data must have shape {(ids.size, *self.slot_shape)}, got {arr.shape}")
        if arr.dtype != self.dtype:
            raise TypeError(f"data must have dtype {self.dtype}, got {arr.dtype}")
        for k, shard in enumerate(self.head_shards):
            self._write_shard(k, ids, arr[..., self._shard_cols(shard), :])

    @abc.abstractmethod
    def _read_shard(self, k: int, ids: np.ndarray) -> np.ndarray: ...

    @abc.abstractmethod
    def _write_shard(self, k: int, ids: np.ndarray, data: np.ndarray) -> None: ...

    # -- transfer path (TransferEngine) ---------------------------------------------------------
    @abc.abstractmethod
    def begin_backup(self, ids: np.ndarray, staged: jax.Array, count: int) -> PendingBackup:
        """``staged [m, L, 2, S, H, D]`` (device, head-sharded) rows ``[:count]`` -> slots ``ids``.
        Nothing is visible in the pool before ``commit``."""

    @abc.abstractmethod
    def stage_load(self, ids: np.ndarray, rows: int) -> tuple[jax.Array, Callable[[], None]]:
        """Slots ``ids`` as a device array ``[rows, L, 2, S, H, D]`` sharded like the pool (rows past
        ``ids.size`` are unspecified) and a ``release`` to call once the consumer has finished."""

    def page_copier(self) -> PageCopier | None:
        """A numpy copier between an L1 view and this pool's memory, when the pool is one slab of
        plain host memory (one head shard), else ``None``. Used by a single-device CPU engine
        (``hicache.workers.transfer.DataPath.HOST_MEMORY``)."""
        return None


# ------------------------------------------------------------------------------------------------
class NumpySlabHostPool(HostPool):
    kind = HostPoolKind.NUMPY_SLAB

    def __init__(self, device_pool: DevicePool, num_slots: int) -> None:
        super().__init__(device_pool, num_slots)
        L, two, S, _, D = self.slot_shape
        self._slabs = []
        for shard in self.head_shards:
            slab = slab_empty((self.num_slots, L, two, S, shard.num_heads, D), self.dtype)
            _bits(slab).fill(0)  # commit the memory now: the cap is real RSS, not a promise
            self._slabs.append(slab)
        self._staging_free: dict[tuple[int, int], list[np.ndarray]] = {}
        self._copier = PageCopier(_bits(self._slabs[0]), device_pool.num_pages) if len(self._slabs) == 1 else None

    def page_copier(self) -> PageCopier | None:
        return self._copier

    def slot_view(self, start: int, n: int) -> np.ndarray | None:
        """Zero-copy ``[n, *slot_shape]`` view of slots ``start .. start+n-1`` when the pool is one
        slab (one head shard), else None: the L3 storage's optional ``slot_view`` (it writes backups
        straight from pinned slots, ``hicache.storage.base.HostPool``)."""
        return self._slabs[0][start : start + n] if len(self._slabs) == 1 else None

    @property
    def used_bytes(self) -> int:
        return sum(s.nbytes for s in self._slabs)

    def _read_shard(self, k: int, ids: np.ndarray) -> np.ndarray:
        return self._slabs[k][ids]

    def _write_shard(self, k: int, ids: np.ndarray, data: np.ndarray) -> None:
        _bits(self._slabs[k])[ids] = _bits(np.ascontiguousarray(data))

    def begin_backup(self, ids: np.ndarray, staged: jax.Array, count: int) -> PendingBackup:
        return _SlabBackup(self, ids, staged, count)

    def _take_staging(self, k: int, rows: int) -> np.ndarray:
        free = self._staging_free.setdefault((k, rows), [])
        if free:
            return free.pop()
        shape = (rows, *self._slabs[k].shape[1:])
        buf = aligned_empty(shape, self.dtype)
        _bits(buf).fill(0)
        return buf

    def stage_load(self, ids: np.ndarray, rows: int) -> tuple[jax.Array, Callable[[], None]]:
        pool = self.device_pool
        global_shape = (rows, *pool.spec.page_shape)
        taken: list[tuple[int, np.ndarray]] = []
        pieces = []
        for k, shard in enumerate(self.head_shards):
            buf = self._take_staging(k, rows)
            taken.append((k, buf))
            np.take(_bits(self._slabs[k]), ids, axis=0, out=_bits(buf)[: ids.size])
            # Zero-copy on CPU (aligned buffer): buf must stay untouched until release().
            pieces += [jax.device_put(buf.view(self.storage_dtype), dev, may_alias=True) for dev in shard.devices]
        arr = jax.make_array_from_single_device_arrays(global_shape, _row_sharding(pool), pieces)

        def release() -> None:
            for k, buf in taken:
                self._staging_free[(k, rows)].append(buf)
            taken.clear()

        return arr, release


def _row_sharding(pool: DevicePool) -> NamedSharding:
    return NamedSharding(pool.mesh, pool.partition_spec)


class _SlabBackup(PendingBackup):
    def __init__(self, pool: NumpySlabHostPool, ids: np.ndarray, staged: jax.Array, count: int) -> None:
        self.pool, self.ids, self.staged, self.count = pool, ids, staged, count
        self._done = False

    def is_ready(self) -> bool:
        return self.staged.is_ready()

    def block(self) -> None:
        self.staged.block_until_ready()

    def commit(self) -> None:
        if self._done:
            return
        pool = self.pool
        if len(self.staged.sharding.device_set) == 1:  # one device, one shard: zero-copy view
            # of a temporary shard array: numpy's reference must not stay cached on ``staged``, or
            # the next gather could not donate it (the runtime would copy instead)
            views = [np.asarray(self.staged.addressable_data(0))]
        else:
            by_device = {s.device: s for s in self.staged.addressable_shards}
            # Read every shard first, then write: a failure while reading leaves the slab untouched.
            views = [np.asarray(by_device[shard.devices[0]].data) for shard in pool.head_shards]
        for k, view in enumerate(views):
            _bits(pool._slabs[k])[self.ids] = _bits(view)[: self.count]
        del views
        self._done = True


# ------------------------------------------------------------------------------------------------
class PinnedPagesHostPool(HostPool):
    kind = HostPoolKind.PINNED_PAGES

    def __init__(self, device_pool: DevicePool, num_slots: int, memory_kind: str = "pinned_host") -> None:
        super().__init__(device_pool, num_slots)
        self.memory_kind = memory_kind
        # _pages[k][slot] -> jax.Array [L, 2, S, H_shard, D] in host memory on shard k's first device
        self._pages: list[list[jax.Array | None]] = [[None] * self.num_slots for _ in self.head_shards]
        self._host_sharding = [
            SingleDeviceSharding(shard.devices[0], memory_kind=memory_kind) for shard in self.head_shards
        ]
        L, two, S, _, D = self.slot_shape
        self._shard_row_shape = [(L, two, S, shard.num_heads, D) for shard in self.head_shards]
        self._zero_rows: dict[tuple[int, jax.Device], jax.Array] = {}  # one per (head shard, device)

    @property
    def used_bytes(self) -> int:
        return sum(p.nbytes for pages in self._pages for p in pages if p is not None)

    def _device_zero_row(self, k: int, dev: jax.Device) -> jax.Array:
        """A zero page row of head shard ``k`` on ``dev``: pads a load to its row bucket on device."""
        row = self._zero_rows.get((k, dev))
        if row is None:
            row = jax.device_put(np.zeros(self._shard_row_shape[k], self.storage_dtype), SingleDeviceSharding(dev))
            self._zero_rows[(k, dev)] = row
        return row

    def _read_shard(self, k: int, ids: np.ndarray) -> np.ndarray:
        out = np.zeros((ids.size, *self._shard_row_shape[k]), self.dtype)
        for i, slot in enumerate(ids):
            page = self._pages[k][slot]
            if page is not None:
                out[i] = np.asarray(page).view(self.dtype)
        return out

    def _write_shard(self, k: int, ids: np.ndarray, data: np.ndarray) -> None:
        rows = [np.array(row).view(self.storage_dtype) for row in data]
        arrays = jax.device_put(rows, [self._host_sharding[k]] * ids.size)
        for slot, arr in zip(ids.tolist(), arrays):
            self._pages[k][slot] = arr

    def begin_backup(self, ids: np.ndarray, staged: jax.Array, count: int) -> PendingBackup:
        by_device = {s.device: s.data for s in staged.addressable_shards}
        moved = []
        for k, shard in enumerate(self.head_shards):
            # device-side slices of every staged row (one program per row bucket, not per count)
            rows = _split_rows(staged.shape[0])(by_device[shard.devices[0]])
            moved.append(jax.device_put(list(rows[:count]), [self._host_sharding[k]] * count))  # batched D2H
        return _PinnedBackup(self, ids, moved)

    def stage_load(self, ids: np.ndarray, rows: int) -> tuple[jax.Array, Callable[[], None]]:
        pool = self.device_pool
        global_shape = (rows, *pool.spec.page_shape)
        pieces = []
        for k, shard in enumerate(self.head_shards):
            pages = []
            for slot in ids.tolist():
                page = self._pages[k][slot]
                if page is None:  # never written: zeros, like a fresh slab
                    page = jax.device_put(np.zeros(self._shard_row_shape[k], self.storage_dtype), self._host_sharding[k])
                pages.append(page)
            for dev in shard.devices:
                on_dev = jax.device_put(pages, [SingleDeviceSharding(dev)] * len(pages))  # batched H2D
                pad = [self._device_zero_row(k, dev)] * (rows - len(pages))  # no bytes moved for padding
                pieces.append(_stack_rows(rows)(*on_dev, *pad))
        arr = jax.make_array_from_single_device_arrays(global_shape, _row_sharding(pool), pieces)
        return arr, lambda: None


class _PinnedBackup(PendingBackup):
    def __init__(self, pool: PinnedPagesHostPool, ids: np.ndarray, moved: list[list[jax.Array]]) -> None:
        self.pool, self.ids, self.moved = pool, ids, moved

    def is_ready(self) -> bool:
        return all(a.is_ready() for arrays in self.moved for a in arrays)

    def block(self) -> None:
        jax.block_until_ready(self.moved)

    def commit(self) -> None:
        for k, arrays in enumerate(self.moved):
            for slot, arr in zip(self.ids.tolist(), arrays):
                self.pool._pages[k][slot] = arr  # the old page (if any) is freed by dropping it


# Both are keyed by the transfer's row bucket (a power of two), never by its page count: a program
# per distinct count compiled for 0.2-5 s on every new batch size (seen on an H200 and on CPU).
@functools.lru_cache(maxsize=64)
def _split_rows(rows: int):
    return jax.jit(lambda x: tuple(x[i] for i in range(rows)))


@functools.lru_cache(maxsize=64)
def _stack_rows(rows: int):
    return jax.jit(lambda *pages: jnp.stack(pages))


def make_host_pool(device_pool: DevicePool, num_slots: int, kind: HostPoolKind | str | None = None) -> HostPool:
    kind = HostPoolKind(kind) if kind is not None else select_host_pool_kind()
    if kind is HostPoolKind.NUMPY_SLAB:
        return NumpySlabHostPool(device_pool, num_slots)
    return PinnedPagesHostPool(device_pool, num_slots)
