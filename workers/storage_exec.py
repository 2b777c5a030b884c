"""L3 ops on a host worker: the ``StorageExecutor`` that runs L2->L3 backups and L3->L2 prefetches.

Each host attaches its own ``FsspecStorage`` over its shard of every page (its KV heads, all layers)
and registers its L2 pool with it; storage reads/writes that pool's slots only during a call. The head
sends the same storage op to every host; each host moves its shard and acks. An op succeeds only if
every page of it was stored / loaded (a partial prefetch fails whole: the head frees its slots and the
request recomputes), so no half-loaded slot is ever served.

Runs on the worker's storage thread (``HostWorker`` submits each op there and acks it through
``poll``/``wait``); storage calls are bounded by the storage timeout, so a slow or hung backend
fails the op within that bound instead of hanging. The storage reads slots of the real pool (H2S)
on that thread and its I/O threads (``read_slots`` only copies the slot arrays out; the head pins a
backup's slots until it is acked). It never writes the pool there: the storage is registered with a
``_DeferredWrites`` view whose ``write_slots`` collects the fetched pages, and an S2H returns
``(bytes, commit)``; ``commit`` (one ``write_slots`` of every collected range) runs on the owner thread
when the op is acked. A failed, partial or timed-out prefetch never touches the pool.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np

from hicache.storage import FsspecStorage, ModelFingerprint, PoolKind, PoolTransfer, ShardCoord, StorageConfig
from hicache.workers.host_pool import HostPool
from hicache.workers.plan import OpKind, StoragePart, TransferOp

# How a host opens its L3 client: ``FsspecStorage`` itself, or (embedded stacks only) a subclass that
# observes it, as a replay that gates what each replica sees of the others' writes by its own clock.
OpenStorage: TypeAlias = Callable[[str, ModelFingerprint, StorageConfig], FsspecStorage]


@dataclass(frozen=True)
class StorageAttachment:
    """Picklable description of an L3 backend; every host builds its own client from it."""

    url: str
    fingerprint: ModelFingerprint
    config: StorageConfig = field(default_factory=StorageConfig)
    pages_per_object: int | None = None


def host_shard(pool: HostPool, fingerprint: ModelFingerprint) -> ShardCoord:
    """This host's slice of a page: its KV-head range, all layers (topology-free coordinate)."""
    a, b = pool.head_range
    return ShardCoord(a, b, fingerprint.num_kv_heads, 0, fingerprint.num_layers, fingerprint.num_layers)


class _DeferredWrites:
    """The host pool as the storage sees it: reads go to the pool, writes made inside ``begin`` /
    ``end`` (the storage thread's prefetch call) are collected per thread for the owner thread to
    apply. ``concurrent_slot_reads``: the storage's I/O threads may call ``read_slots`` during a call
    (it only copies slot arrays out, and the head pins a backup's slots until it is acked); they
    never write."""

    concurrent_slot_reads = True

    def __init__(self, pool: HostPool) -> None:
        self._pool = pool
        self._local = threading.local()
        # The storage's structural pool check reads these statically (Python >= 3.12 uses
        # inspect.getattr_static, which never reaches __getattr__), so they are real attributes.
        self.slot_shape, self.dtype, self.slot_bytes = pool.slot_shape, pool.dtype, pool.slot_bytes

    def begin(self) -> list[tuple[np.ndarray, np.ndarray]]:
        self._local.writes = []
        return self._local.writes

    def end(self) -> None:
        self._local.writes = None

    def read_slots(self, slots: object) -> np.ndarray:
        return self._pool.read_slots(slots)

    def write_slots(self, slots: object, data: np.ndarray) -> None:
        writes = getattr(self._local, "writes", None)
        if writes is None:
            self._pool.write_slots(slots, data)
        else:
            writes.append((np.array(slots, np.int32), data))


def component_shard(pool: HostPool) -> ShardCoord:
    """This host's slice of a component pool's page (its own heads and layers: e.g. a recurrent state's)."""
    a, b = pool.head_range
    spec = pool.device_pool.spec
    return ShardCoord(a, b, spec.num_kv_heads, 0, spec.num_layers, spec.num_layers)


# Pages a component pool's object may hold: the values of one node end (an SWA window's pages, a state) are
# written as pages ``[0, n)`` of a chunk this long, so the storage makes them ONE object named by its last
# key (the end's; ``chunking``): object writes and existence requests go per node end, not per page (GCS
# charges each). The size is in the objects' path (``c{C}``): changing it makes older objects unreadable.
COMPONENT_OBJECT_PAGES = 4096


def _part_transfer(kind: PoolKind, part: StoragePart) -> PoolTransfer:
    """``part`` as a storage transfer of one object: the chunk position is 0 for every node end (the key alone
    names the object and fixes its page count: ``StoragePart``); only the last key of the run is ever read."""
    if part.num_pages > COMPONENT_OBJECT_PAGES:
        raise ValueError(f"pool {part.pool!r}: a part of {part.num_pages} pages is longer than one object "
                         f"({COMPONENT_OBJECT_PAGES} pages)")
    return PoolTransfer(kind, [part.key] * part.num_pages, part.host_slots, 0)


class StorageExecutor:
    def __init__(self, attachment: StorageAttachment, pool: HostPool, open_storage: OpenStorage = FsspecStorage,
                 component_pools: Mapping[str, HostPool] | None = None) -> None:
        """``component_pools``: a hybrid model's other L2 pools by name (``PoolKind`` values: "swa", "mamba"),
        registered with the storage as pools of their own, moved by the ops' ``StoragePart``s: the values of
        one node end are one object (``_part_transfer``)."""
        self.attachment = attachment
        self.storage = open_storage(attachment.url, attachment.fingerprint, attachment.config)
        self._view = _DeferredWrites(pool)
        self.storage.register_host_pool(
            self._view, shard=host_shard(pool, attachment.fingerprint), pages_per_object=attachment.pages_per_object
        )
        self.pool = pool
        self.slot_bytes = pool.slot_bytes
        # name -> (its pool, the storage's view of it, its PoolKind)
        self.parts: dict[str, tuple[HostPool, _DeferredWrites, PoolKind]] = {}
        for name, cpool in (component_pools or {}).items():
            view = _DeferredWrites(cpool)
            kind = PoolKind(name)
            self.storage.register_host_pool(view, shard=component_shard(cpool), kind=kind,
                                            pages_per_object=COMPONENT_OBJECT_PAGES, named_objects=True)
            self.parts[name] = (cpool, view, kind)

    @property
    def inline_reads(self) -> bool:
        """A prefetch may run on the calling thread: the storage reads a local disk (``runs_inline``), in
        less time than a hand-off to the storage thread takes, while a request may be waiting for it."""
        return self.storage.runs_inline

    def _transfers(self, op: TransferOp) -> list[PoolTransfer]:
        """The op's pages as storage transfers: the Full pages (if any), then each component part."""
        out = []
        if op.storage_keys:
            out.append(PoolTransfer(PoolKind.KV, list(op.storage_keys), op.host_slots, op.first_page,
                                    op.chunk_start_key if op.kind is OpKind.PREFETCH_S2H else None))
        for part in op.storage_parts:
            entry = self.parts.get(part.pool)
            if entry is None:
                raise ValueError(f"storage executor has no component pool {part.pool!r} (has {sorted(self.parts)})")
            out.append(_part_transfer(entry[2], part))
        return out

    def __call__(self, op: TransferOp, pool: HostPool) -> int | tuple[int, Callable[[], None]]:
        if pool is not self.pool:
            raise ValueError("storage executor was built for another host pool")
        commit: Callable[[], None] | None = None
        # (an op of Full pages only, the usual one, goes through the one-pool calls)
        transfers = self._transfers(op) if op.storage_parts else None
        if op.kind is OpKind.BACKUP_H2S:
            if transfers is None:
                done = [self.storage.batch_set(list(op.storage_keys), op.host_slots, first_page=op.first_page)]
            else:
                done = self.storage.batch_set_pools(transfers)
        elif op.kind is OpKind.PREFETCH_S2H:
            targets = [(pool, self._view)] + [(self.parts[p.pool][0], self.parts[p.pool][1]) for p in op.storage_parts]
            collected = [view.begin() for _, view in targets]
            try:
                if transfers is None:
                    done = [self.storage.batch_get(list(op.storage_keys), op.host_slots, first_page=op.first_page,
                                                   chunk_start_key=op.chunk_start_key)]
                else:
                    done = self.storage.batch_get_pools(transfers)
            finally:
                for _, view in targets:
                    view.end()

            def commit() -> None:
                for (target, _), writes in zip(targets, collected):
                    if writes:  # one pool write per pool for the whole op: its cost is mostly per call
                        target.write_slots(np.concatenate([slots for slots, _ in writes]),
                                           np.concatenate([data for _, data in writes]))
        else:
            raise ValueError(f"not a storage op: {op.kind.value}")
        pages = [flag for flags in done for flag in flags]
        missing = len(pages) - sum(pages)
        if missing:
            raise RuntimeError(f"{op.kind.value}: {missing} of {len(pages)} pages failed (storage stats: "
                               f"{self.storage.stats().corrupt_objects} corrupt, {self.storage.stats().timeouts} timeouts)")
        moved = len(op.storage_keys) * self.slot_bytes + sum(
            p.num_pages * self.parts[p.pool][0].slot_bytes for p in op.storage_parts)
        return moved if commit is None else (moved, commit)

    def close(self) -> None:
        self.storage.close()
