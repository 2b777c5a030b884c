"""L2: the host pool. Fixed-size slots (one slot = one page: all layers, K and V, this host's heads).

Organisation (the same on every backend): one ``pinned_host`` ``jax.Array`` per slot and local head
shard, ``[L, 2, S, H_shard, D]`` on that shard's first device (as sglang-jax). A D2H
(``begin_backup``) splits the engine's device staging batch into page rows on the device and moves
them with one batched ``device_put`` per head shard; the rows replace the slots' arrays at
``commit`` (a dropped array frees its page). An H2D (``stage_load``) moves the slots' arrays to every
device of their shard with one batched ``device_put`` and stacks them into a staging batch there.
Neither ever touches a pool-sized array: cost is O(batch). The CPU backend has the ``pinned_host``
memory kind too, so CI runs this very code. (A single big pinned array updated in place crashes on
sharded multi-chip TPU hosts, and Pallas host DMAs, ``pl.HOST``, cannot run in interpret mode.)

Who owns what: each host's ``HostWorker`` owns one ``HostPool`` holding *its* heads of every slot
(``head_range``); nothing here is shared between hosts and no call is a collective. The slot arrays
belong to the pool; a transfer in flight holds its own references (an H2D keeps reading the arrays
it was given even if a later commit replaces them). Every method runs on the worker's owner thread,
except ``read_slots``, which the L3 storage also calls on its own threads (it only reads the slot
table and copies arrays out). Slot ids are allocated by the head (control plane) and are identical
on every host; the pool only validates them (range, duplicates). ``SlotAllocator`` is a reusable
free list for tests and standalone use.

Capacity: ``num_slots`` is fixed and ``capacity_bytes = num_slots * slot_bytes`` is a hard cap (at
most one live array per slot and shard). ``size_host_pool`` checks a request against ``psutil``'s
available memory minus a reserve.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from hicache.kernels.paged_copy import validate_ids
from hicache.workers.device_pool import DevicePool
from hicache.workers.fused_pool import FusedLayerPool

MEMORY_KIND = "pinned_host"


@dataclass(frozen=True)
class HostPoolConfig:
    """How big L2 is: exactly one of ``num_slots``, ``max_bytes`` or ``ratio_to_device`` (L2 bytes
    per byte of this host's share of L1). ``reserve_bytes`` of host memory stay free."""

    num_slots: int | None = None
    max_bytes: int | None = None
    ratio_to_device: float | None = None
    reserve_bytes: int = 2 << 30

    def __post_init__(self) -> None:
        given = [n for n in ("num_slots", "max_bytes", "ratio_to_device") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"HostPoolConfig needs exactly one of num_slots/max_bytes/ratio_to_device, got {given}")
        value = getattr(self, given[0])
        if value <= 0:
            raise ValueError(f"HostPoolConfig.{given[0]} must be > 0, got {value}")
        if self.reserve_bytes < 0:
            raise ValueError(f"HostPoolConfig.reserve_bytes must be >= 0, got {self.reserve_bytes}")


def size_host_pool(
    config: HostPoolConfig, slot_bytes: int, device_bytes_on_host: int, available_bytes: int | None = None
) -> int:
    """Number of slots for ``config``; ``ValueError`` if it would not fit in host memory."""
    if config.num_slots is not None:
        slots = int(config.num_slots)
    elif config.max_bytes is not None:
        slots = int(config.max_bytes) // slot_bytes
    else:
        assert config.ratio_to_device is not None  # exactly one of the three is set
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


class HostPool:
    """L2 slots for this host's heads: one ``pinned_host`` array per slot and head shard (module
    docstring)."""

    def __init__(self, device_pool: DevicePool | FusedLayerPool, num_slots: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, (int, np.integer)) or num_slots <= 0:
            raise ValueError(f"num_slots must be a positive int, got {num_slots!r}")
        self.device_pool = device_pool
        self.num_slots = int(num_slots)
        self.head_shards = device_pool.head_shards
        self.head_range: tuple[int, int] = device_pool.host_head_range
        self.slot_shape: tuple[int, ...] = device_pool.host_row_shape
        self.dtype: np.dtype = np.dtype(device_pool.dtype)  # logical dtype of read/write_slots
        self.storage_dtype: np.dtype = np.dtype(device_pool.storage_dtype)  # dtype of the arrays
        self.slot_bytes: int = math.prod(self.slot_shape) * self.dtype.itemsize
        # _pages[k][slot]: the slot's rows of head shard k ([L, 2, S, H_shard, D], pinned host
        # memory of the shard's first device), None until first written (reads as zeros)
        self._pages: list[list[jax.Array | None]] = [[None] * self.num_slots for _ in self.head_shards]
        self._live = [0] * len(self.head_shards)  # slots holding an array, per head shard
        self._host_sharding = [SingleDeviceSharding(s.devices[0], memory_kind=MEMORY_KIND) for s in self.head_shards]
        L, two, S, _, D = self.slot_shape
        self._shard_row_shape = [(L, two, S, s.num_heads, D) for s in self.head_shards]
        self._shard_row_bytes = [math.prod(shape) * self.dtype.itemsize for shape in self._shard_row_shape]
        self._zero_rows: dict[tuple[int, jax.Device], jax.Array] = {}  # (head shard, device) -> zero row
        self._zero_host: dict[int, jax.Array] = {}  # head shard -> zero page in host memory

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def used_bytes(self) -> int:
        """Host bytes held by slot data right now (never above ``capacity_bytes``)."""
        return sum(n * b for n, b in zip(self._live, self._shard_row_bytes))

    def check_slots(self, slots: object, *, name: str = "host_slots") -> np.ndarray:
        return validate_ids(slots, self.num_slots, name=name)

    def _shard_cols(self, k: int) -> slice:
        a = self.head_range[0]
        heads = self.head_shards[k].heads
        return slice(heads.start - a, heads.stop - a)

    def _set(self, k: int, ids: list[int], arrays: list[jax.Array]) -> None:
        pages = self._pages[k]
        fresh = 0
        for slot, arr in zip(ids, arrays):
            fresh += pages[slot] is None
            pages[slot] = arr  # the old page (if any) is freed by dropping it
        self._live[k] += fresh

    # -- numpy access (L3 storage layer, tests) ------------------------------------------------------
    def read_slots(self, slots: object) -> np.ndarray:
        """``[n, *slot_shape]`` copy of the slots' data (zeros for a slot never written)."""
        ids = self.check_slots(slots, name="slots").tolist()
        out = np.zeros((len(ids), *self.slot_shape), self.dtype)
        for k in range(len(self.head_shards)):
            pages = self._pages[k]
            held = [(i, pages[s]) for i, s in enumerate(ids) if pages[s] is not None]
            if held:
                # host-memory arrays: one np.asarray each (device_get's batched async copies buy nothing here)
                rows = [np.asarray(a) for _, a in held]
                cols = self._shard_cols(k)
                for (i, _), row in zip(held, rows):
                    out[i, ..., cols, :] = np.asarray(row).view(self.dtype)
        return out

    def write_slots(self, slots: object, data: np.ndarray) -> None:
        """Sets the slots from ``data [n, *slot_shape]`` (validated before anything is written)."""
        ids = self.check_slots(slots, name="slots")
        arr = np.asarray(data)
        if arr.shape != (ids.size, *self.slot_shape):
            raise ValueError(f"data must have shape {(ids.size, *self.slot_shape)}, got {arr.shape}")
        if arr.dtype != self.dtype:
            raise TypeError(f"data must have dtype {self.dtype}, got {arr.dtype}")
        moved = []
        for k in range(len(self.head_shards)):  # every shard moved before any slot changes
            rows = [np.ascontiguousarray(row[..., self._shard_cols(k), :]).view(self.storage_dtype) for row in arr]
            moved.append(jax.device_put(rows, [self._host_sharding[k]] * ids.size))
        for k, arrays in enumerate(moved):
            self._set(k, ids.tolist(), arrays)

    # -- transfer path (TransferEngine, owner thread) ---------------------------------------------
    def begin_backup(self, ids: np.ndarray, staged: jax.Array, count: int) -> PendingBackup:
        """``staged [m, L, 2, S, H, D]`` (device, head-sharded) rows ``[:count]`` -> slots ``ids``,
        moved to host memory now (asynchronously); nothing is visible in the pool before ``commit``."""
        by_device = {s.device: s.data for s in staged.addressable_shards}
        moved = []
        for k, shard in enumerate(self.head_shards):
            # one program splits the batch into rows and writes them to host memory (its outputs)
            rows = _rows_to_host(staged.shape[0], self._host_sharding[k])(by_device[shard.devices[0]])
            moved.append(list(rows[:count]))
        return PendingBackup(self, ids, moved)

    def stage_load(self, ids: np.ndarray, rows: int) -> tuple[jax.Array, Callable[[], None]]:
        """Slots ``ids`` as a device array ``[rows, L, 2, S, H, D]`` sharded like the pool (rows past
        ``ids.size`` are zeros) and a ``release`` to call once the consumer has finished."""
        pool = self.device_pool
        slots = ids.tolist()
        pieces = []
        for k, shard in enumerate(self.head_shards):
            table = self._pages[k]
            pages = [p if p is not None else self._zero_host_page(k) for p in (table[s] for s in slots)]
            for dev in shard.devices:
                if dev == shard.devices[0]:  # the pages' own device: one program moves and stacks them
                    # padded with host zero pages: every argument in host memory, so the program is
                    # one per row bucket (a mix of memory kinds would compile once per page count)
                    pad = [self._zero_host_page(k)] * (rows - len(pages))
                    pieces.append(_rows_to_device(rows, SingleDeviceSharding(dev))(*pages, *pad))
                else:  # another replica of these heads: copy the pages over first
                    on_dev = jax.device_put(pages, [SingleDeviceSharding(dev)] * len(pages))
                    pad = [self._device_zero_row(k, dev)] * (rows - len(pages))
                    pieces.append(_stack_rows(rows)(*on_dev, *pad))
        global_shape = (rows, *pool.spec.page_shape)
        sharding = NamedSharding(pool.mesh, pool.partition_spec)
        arr = jax.make_array_from_single_device_arrays(global_shape, sharding, pieces)
        return arr, _noop

    def _zero_host_page(self, k: int) -> jax.Array:
        page = self._zero_host.get(k)
        if page is None:
            page = jax.device_put(np.zeros(self._shard_row_shape[k], self.storage_dtype), self._host_sharding[k])
            self._zero_host[k] = page
        return page

    def _device_zero_row(self, k: int, dev: jax.Device) -> jax.Array:
        """A zero page row of head shard ``k`` on ``dev``: pads a load to its row bucket on device."""
        row = self._zero_rows.get((k, dev))
        if row is None:
            row = jax.device_put(np.zeros(self._shard_row_shape[k], self.storage_dtype), SingleDeviceSharding(dev))
            self._zero_rows[(k, dev)] = row
        return row


class PendingBackup:
    """A D2H in flight (its rows on their way to host memory): ``is_ready`` without blocking, then
    ``commit`` once, on the owner thread."""

    def __init__(self, pool: HostPool, ids: np.ndarray, moved: list[list[jax.Array]]) -> None:
        self.pool, self.ids, self.moved = pool, ids, moved

    def is_ready(self) -> bool:
        # is_ready is on every concrete jax.Array, but not in its type stub
        return all(a.is_ready() for arrays in self.moved for a in arrays)  # type: ignore[attr-defined]

    def block(self) -> None:
        """Blocks until ``is_ready``."""
        jax.block_until_ready(self.moved)

    def commit(self) -> None:
        ids = self.ids.tolist()
        for k, arrays in enumerate(self.moved):
            self.pool._set(k, ids, arrays)

    def release(self) -> None:  # called after commit or on failure: nothing to return
        pass


def _noop() -> None:
    pass


# Programs are keyed by the transfer's row bucket (a power of two), never by its page count: a
# program per distinct count would compile on every new batch size. The moves between memory kinds
# are inside the programs (output shardings in host memory; ``device_put`` to device memory in the
# program), so a batch is one dispatch, not one ``device_put`` per page.
@functools.lru_cache(maxsize=256)
def _rows_to_host(rows: int, host: SingleDeviceSharding):
    """``staged [rows, ...]`` on a device -> its ``rows`` rows, each an array in ``host``'s memory."""
    return jax.jit(lambda x: tuple(x[i] for i in range(rows)), out_shardings=(host,) * rows)


@functools.lru_cache(maxsize=256)
def _rows_to_device(rows: int, device: SingleDeviceSharding):
    """``rows`` page arrays (host memory of ``device``, or on it) -> one ``[rows, ...]`` array on it."""
    return jax.jit(lambda *pages: jnp.stack([jax.device_put(p, device) for p in pages]), out_shardings=device)


@functools.lru_cache(maxsize=64)
def _stack_rows(rows: int):
    return jax.jit(lambda *pages: jnp.stack(pages))
