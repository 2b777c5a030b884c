"""``HostKVPoolAdapter``: sgl-jax's ``LRUHostKVPool`` interface over hicache's host pool (L2).

sgl-jax's own HiCache (``UnifiedRadixCache`` + ``HiCacheController``) talks to its host tier through
``LRUHostKVPool``'s public methods: a page-slot free list (``alloc``/``free``, ``reserve``/``release``,
``available_size``/``total_size``), slot pins (``inc_lock_ref``/``dec_lock_ref``) and two-phase
transfers, split by which thread may touch the device pool (its forward donates the layer arrays):

    D2H: ``stage_backup`` (gather pages, the KV-owning thread) -> ``flush_backup`` (to host memory, any thread)
    H2D: ``stage_load`` (host slots to device, any thread) -> ``flush_load`` (scatter, the KV-owning thread)

This class keeps that interface and its contract (the errors it raises, a slot's data living until it is
freed, a transfer into a slot freed and reallocated meanwhile being dropped: each slot carries an
allocation epoch) and moves the bytes with hicache's code: ``FusedLayerPool``'s jitted gather/scatter over
sgl-jax's layer arrays and ``HostPool``'s ``pinned_host`` page arrays (``hicache.workers``), the very
programs ``hicache.sgl_jax``'s own L2 runs. ``hicache.sgl_jax.pytest_plugin`` binds it in place of
sgl-jax's class, so sgl-jax's own tests check that hicache's host pool can stand in for it.

Who owns what: sgl-jax's ``MHATokenToKVPool`` owns the layer arrays (read through ``kv_buffer``, a scatter's
result handed back through ``replace_buffer``); this object owns the ``HostPool`` (one host: every call runs in
the one process that owns the device pool) and the slot bookkeeping. ``_lock`` guards the bookkeeping and the
staged transfers, ``_pool_lock`` the ``HostPool`` (the controller's worker thread and the scheduler thread both
reach it); lock order ``_lock`` -> ``_pool_lock``. A freed slot's bytes stay in the ``HostPool`` until the slot
is written again (it keeps at most one array per slot, so its byte cap holds), but read as empty.

The constructor takes sgl-jax's arguments; the slot layout comes from ``device_pool`` (what the slots really
hold), so ``per_layer_shape``, ``dtype``, ``mesh`` and ``partition_spec`` are accepted and not used (sgl-jax's
own tests pass a ``per_layer_shape`` that is not its pool's, which its class ignores as well).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from sgl_jax.srt.mem_cache.host_kv_pool import HostKVPool

from hicache.sgl_jax.tiers import fused_pool, kv_spec
from hicache.workers.host_pool import HostPool, PendingBackup, SlotAllocator
from hicache.workers.transfer import MAX_BATCH_PAGES, bucket, chunks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Staged:
    """One slot's rows staged for the second phase of a transfer: row ``row`` of ``batch`` (device, sharded
    like the pool's staging rows), valid while the slot's epoch is still ``epoch``."""

    epoch: int
    batch: jax.Array  # [bucket, L, 2, S, H, D]
    row: int


class HostKVPoolAdapter(HostKVPool):
    """sgl-jax's ``LRUHostKVPool`` interface over hicache's ``HostPool`` (module docstring)."""

    def __init__(self, device_pool: Any, pool_size: int, page_size: int, layer_num: int,
                 per_layer_shape: tuple[int, ...], dtype: Any, mesh: Any, partition_spec: Any, *,
                 pool_name: str = "hicache") -> None:
        if isinstance(pool_size, bool) or not isinstance(pool_size, (int, np.integer)) or pool_size <= 0:
            raise ValueError(f"pool_size must be a positive int, got {pool_size!r}")
        if page_size != device_pool.page_size:
            raise ValueError(f"page_size={page_size} but the device pool has pages of {device_pool.page_size} tokens")
        if layer_num != device_pool.layer_num:
            raise ValueError(f"layer_num={layer_num} but the device pool has {device_pool.layer_num} layers")
        self.pool_name = pool_name
        self.device_pool = device_pool
        self.layers = fused_pool(device_pool, kv_spec(device_pool, page_size))
        self.host = HostPool(self.layers, int(pool_size))
        # pages per compiled transfer program (a power of two): larger batches run as several programs
        self.max_batch_pages = MAX_BATCH_PAGES
        self._gather, self._scatter = self.layers.transfer_fns()
        self._lock = threading.Lock()
        self._pool_lock = threading.Lock()
        self._free_list = SlotAllocator(int(pool_size))
        size = int(pool_size)
        self._allocated = [False] * size
        self._filled = [False] * size  # holds data written since its allocation
        self._pins = [0] * size
        self._epoch = [0] * size  # bumped on every allocation: a transfer staged before it is stale
        self._staged_backup: dict[int, _Staged] = {}
        self._staged_load: dict[int, _Staged] = {}

    # -- sizes ------------------------------------------------------------------------------------------
    def available_size(self) -> int:
        """Free page slots."""
        with self._lock:
            return self._free_list.num_free

    def total_size(self) -> int:
        return self.host.num_slots

    # -- slot allocation (sgl-jax's tree picks victims; this pool never evicts) ---------------------------
    def alloc(self, need_pages: int) -> np.ndarray | None:
        """``need_pages`` free slot ids, or None (nothing taken) when fewer are free."""
        if isinstance(need_pages, bool) or not isinstance(need_pages, (int, np.integer)) or need_pages <= 0:
            raise ValueError(f"need_pages must be a positive int, got {need_pages!r}")
        with self._lock:
            if self._free_list.num_free < need_pages:
                return None
            ids = self._free_list.alloc(int(need_pages))
            for slot in ids.tolist():
                self._allocated[slot] = True
                self._filled[slot] = False
                self._epoch[slot] += 1
        return ids.astype(np.int64)

    def reserve(self) -> int | None:
        ids = self.alloc(1)
        return None if ids is None else int(ids[0])

    def free(self, host_page_ids: Iterable[int]) -> None:
        """Returns slots (duplicates counted once); all are checked before any is freed."""
        ids = list(dict.fromkeys(int(s) for s in host_page_ids))
        with self._lock:
            for slot in ids:
                self._check_range(slot)
                if not self._allocated[slot]:
                    raise RuntimeError(f"double free of host page id={slot}")
                if self._pins[slot]:
                    raise RuntimeError(f"free of locked host page id={slot} (lock_ref={self._pins[slot]})")
            for slot in ids:
                self._staged_backup.pop(slot, None)
                self._staged_load.pop(slot, None)
                self._allocated[slot] = self._filled[slot] = False
            if ids:
                self._free_list.free(np.asarray(ids, np.int32))

    def release(self, buffer_id: int) -> None:
        self.free([buffer_id])

    def inc_lock_ref(self, buffer_id: int) -> None:
        with self._lock:
            self._check_allocated(buffer_id)
            self._pins[buffer_id] += 1

    def dec_lock_ref(self, buffer_id: int) -> None:
        with self._lock:
            self._check_allocated(buffer_id)
            if self._pins[buffer_id] <= 0:
                raise RuntimeError(f"dec_lock_ref underflow on host page id={buffer_id}")
            self._pins[buffer_id] -= 1

    # -- D2H ----------------------------------------------------------------------------------------------
    def stage_backup(self, device_indices: Sequence[int], host_buffer_ids: Sequence[int]) -> None:
        """Gathers device pages ``device_indices`` for slots ``host_buffer_ids`` (pairwise); on the thread that
        owns the device pool, between forwards."""
        pages, slots = self._pairs(device_indices, host_buffer_ids)
        if not slots:
            return
        with self._lock:
            epochs = [self._check_allocated(s) for s in slots]
        staged = self._gather_rows(pages)
        with self._lock:
            for slot, epoch, (batch, row) in zip(slots, epochs, staged):
                if self._allocated[slot] and self._epoch[slot] == epoch:
                    self._staged_backup[slot] = _Staged(epoch, batch, row)

    def flush_backup(self, host_buffer_ids: Sequence[int]) -> None:
        """Moves the staged pages of ``host_buffer_ids`` into their slots (host memory); any thread. A slot freed
        since it was staged keeps nothing."""
        slots = [int(s) for s in host_buffer_ids]
        if not slots:
            return
        with self._lock:
            missing = [s for s in slots if s not in self._staged_backup]
            if missing:
                raise RuntimeError(f"flush_backup of host page id(s) {missing} with nothing staged; "
                                   f"stage_backup must run first")
            staged = [self._staged_backup.pop(s) for s in slots]
        for batch, group in _by_batch(slots, staged, self.max_batch_pages):
            rows = _staging_rows([entry for _, entry in group])
            ids = np.asarray([slot for slot, _ in group], np.int32)
            with self._pool_lock:
                moving = self.host.begin_backup(ids, rows, len(group))
            moving.block()
            with self._lock:
                fresh = [i for i, (slot, entry) in enumerate(group)
                         if self._allocated[slot] and self._epoch[slot] == entry.epoch]
                with self._pool_lock:
                    PendingBackup(self.host, ids[fresh], [[arrays[i] for i in fresh] for arrays in moving.moved]).commit()
                for i in fresh:
                    self._filled[group[i][0]] = True

    def copy_into(self, device_indices: Sequence[int], host_buffer_ids: Sequence[int]) -> None:
        """Both D2H phases on the calling thread (the device pool's owner)."""
        self.stage_backup(device_indices, host_buffer_ids)
        self.flush_backup(host_buffer_ids)

    # -- H2D ----------------------------------------------------------------------------------------------
    def stage_load(self, host_buffer_ids: Sequence[int]) -> None:
        """Moves slots ``host_buffer_ids`` to the device (staging rows, not the pool); any thread."""
        slots = [int(s) for s in host_buffer_ids]
        if not slots:
            return
        with self._lock:
            epochs = [self._check_allocated(s) for s in slots]
            empty = [s for s in slots if not self._filled[s]]
        if empty:
            raise RuntimeError(f"stage_load from empty host page id(s) {empty}")
        staged: list[tuple[jax.Array, int]] = []
        for part in chunks(len(slots), self.max_batch_pages):
            ids = np.asarray(slots[part], np.int32)
            with self._pool_lock:
                batch, done = self.host.stage_load(ids, bucket(ids.size))
            batch.block_until_ready()
            done()
            staged += [(batch, row) for row in range(ids.size)]
        with self._lock:
            for slot, epoch, (batch, row) in zip(slots, epochs, staged):
                if self._allocated[slot] and self._epoch[slot] == epoch:
                    self._staged_load[slot] = _Staged(epoch, batch, row)

    def flush_load(self, host_buffer_ids: Sequence[int], device_indices: Sequence[int]) -> None:
        """Scatters the staged slots into device pages ``device_indices`` (pairwise); on the thread that owns the
        device pool, between forwards. A slot freed since it was staged is skipped: its page keeps its data."""
        pages, slots = self._pairs(device_indices, host_buffer_ids)
        if not slots:
            return
        with self._lock:
            for slot in slots:
                self._check_range(slot)
            missing = [s for s in slots if s not in self._staged_load]
            if missing:
                raise RuntimeError(f"flush_load of host page id(s) {missing} with nothing staged; "
                                   f"stage_load must run first")
            staged = [self._staged_load.pop(s) for s in slots]
            fresh = [i for i, (slot, entry) in enumerate(zip(slots, staged))
                     if self._allocated[slot] and self._epoch[slot] == entry.epoch]
        targets = [pages[i] for i in fresh]
        entries = [staged[i] for i in fresh]
        for part in chunks(len(targets), self.max_batch_pages):
            self._scatter_rows(targets[part], entries[part])

    def copy_to_device(self, host_buffer_ids: Sequence[int], device_indices: Sequence[int]) -> None:
        """Both H2D phases on the calling thread (the device pool's owner)."""
        self.stage_load(host_buffer_ids)
        self.flush_load(host_buffer_ids, device_indices)

    def precompile_transfers(self, max_pages: int | None = None) -> None:
        """Compiles every transfer program serving can run (one per row bucket up to the largest batch), by
        round trips of device pages ``[0, r)`` through free slots: each page gets its own bytes back, so this is
        safe at any time the scheduler thread calls it. Stops at the first bucket it cannot run (not enough
        free slots, or a failure, logged); never raises."""
        largest = min(self.total_size(), self.layers.num_pages, self.max_batch_pages)
        if max_pages is not None:
            largest = min(largest, int(max_pages))
        rows = 1
        while rows <= largest:
            slots = self.alloc(rows)
            if slots is None:
                logger.warning("host pool %s: %d free slots, cannot compile the %d-page transfers",
                               self.pool_name, self.available_size(), rows)
                return
            ids, pages = slots.tolist(), list(range(rows))
            try:
                self.copy_into(pages, ids)
                self.copy_to_device(ids, pages)
            except Exception:
                logger.warning("host pool %s: compiling the %d-page transfers failed", self.pool_name, rows,
                               exc_info=True)
                return
            finally:
                self.free(ids)
            rows *= 2

    # -- helpers ------------------------------------------------------------------------------------------
    def _check_range(self, slot: int) -> None:
        if not 0 <= slot < self.host.num_slots:
            raise ValueError(f"host page id={slot} outside the pool's range [0, {self.host.num_slots})")

    def _check_allocated(self, slot: int) -> int:
        """The slot's epoch; ValueError out of range, RuntimeError when it is free (under ``_lock``)."""
        self._check_range(slot)
        if not self._allocated[slot]:
            raise RuntimeError(f"host page id={slot} is not allocated")
        return self._epoch[slot]

    def _pairs(self, device_indices: Sequence[int], host_buffer_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        pages, slots = [int(p) for p in device_indices], [int(s) for s in host_buffer_ids]
        if len(pages) != len(slots):
            raise ValueError(f"{len(pages)} device pages for {len(slots)} host pages: they go pairwise")
        bad = [p for p in pages if not 0 <= p < self.layers.num_pages]
        if bad:
            raise ValueError(f"device page id(s) {bad} outside the device pool's range [0, {self.layers.num_pages})")
        return pages, slots

    def _gather_rows(self, pages: list[int]) -> list[tuple[jax.Array, int]]:
        """Each page's (staging batch, row): pages in batches of at most ``max_batch_pages``."""
        out: list[tuple[jax.Array, int]] = []
        for part in chunks(len(pages), self.max_batch_pages):
            batch = self._gather(self.layers.kv, _packed_ids(pages[part]), None)
            out += [(batch, row) for row in range(part.stop - part.start)]
        return out

    def _scatter_rows(self, pages: list[int], entries: list[_Staged]) -> None:
        new_layers, _token = self._scatter(self.layers.kv, _packed_ids(pages), _staging_rows(entries))
        self.layers.adopt_kv(new_layers)


def _by_batch(slots: list[int], staged: list[_Staged],
              max_pages: int) -> list[tuple[jax.Array, list[tuple[int, _Staged]]]]:
    """The (slot, staged) pairs grouped by the batch their rows are in, in first-seen order."""
    groups: dict[int, tuple[jax.Array, list[tuple[int, _Staged]]]] = {}
    for slot, entry in zip(slots, staged):
        groups.setdefault(id(entry.batch), (entry.batch, []))[1].append((slot, entry))
    out = []
    for batch, group in groups.values():  # HostPool programs take at most a bucket of rows
        out += [(batch, group[part]) for part in chunks(len(group), max_pages)]
    return out


def _packed_ids(pages: list[int]) -> np.ndarray:
    """``[count, *pages]`` padded to the row bucket (FusedLayerPool's transfer programs' id argument)."""
    return np.asarray([len(pages), *_padded(pages, bucket(len(pages)))], np.int32)


def _padded(ids: list[int], rows: int) -> list[int]:
    return ids + [ids[0]] * (rows - len(ids))


def _staging_rows(entries: list[_Staged]) -> jax.Array:
    """A staging batch (``bucket(len(entries))`` rows) whose first rows are the entries' rows, in order: the
    entries' own batch when it already is one (the usual case: a flush of what one stage call staged)."""
    rows = bucket(len(entries))
    first = entries[0].batch
    if all(e.batch is first for e in entries):
        if first.shape[0] == rows and [e.row for e in entries] == list(range(len(entries))):
            return first
        return _take_rows(first, np.asarray(_padded([e.row for e in entries], rows), np.int32))
    batches = list({id(e.batch): e.batch for e in entries}.values())
    offsets, total = {}, 0
    for b in batches:
        offsets[id(b)] = total
        total += b.shape[0]
    picked = [offsets[id(e.batch)] + e.row for e in entries]
    return _take_rows(jax.numpy.concatenate(batches, axis=0), np.asarray(_padded(picked, rows), np.int32))


@jax.jit
def _take_rows(batch: jax.Array, rows: Any) -> jax.Array:
    return batch[rows]
