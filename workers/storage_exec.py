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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np

from hicache.storage import FsspecStorage, ModelFingerprint, ShardCoord, StorageConfig
from hicache.workers.host_pool import HostPool
from hicache.workers.plan import OpKind, TransferOp

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


class StorageExecutor:
    def __init__(self, attachment: StorageAttachment, pool: HostPool, open_storage: OpenStorage = FsspecStorage) -> None:
        self.attachment = attachment
        self.storage = open_storage(attachment.url, attachment.fingerprint, attachment.config)
        self._view = _DeferredWrites(pool)
        self.storage.register_host_pool(
            self._view, shard=host_shard(pool, attachment.fingerprint), pages_per_object=attachment.pages_per_object
        )
        self.pool = pool
        self.slot_bytes = pool.slot_bytes

    @property
    def inline_reads(self) -> bool:
        """A prefetch may run on the calling thread: the storage reads a local disk (``runs_inline``), in
        less time than a hand-off to the storage thread takes, while a request may be waiting for it."""
        return self.storage.runs_inline

    def __call__(self, op: TransferOp, pool: HostPool) -> int | tuple[int, Callable[[], None]]:
        keys = list(op.storage_keys)
        if pool is not self.pool:
            raise ValueError("storage executor was built for another host pool")
        commit: Callable[[], None] | None = None
        if op.kind is OpKind.BACKUP_H2S:
            done = self.storage.batch_set(keys, op.host_slots, first_page=op.first_page)
        elif op.kind is OpKind.PREFETCH_S2H:
            writes = self._view.begin()
            try:
                done = self.storage.batch_get(keys, op.host_slots, first_page=op.first_page,
                                              chunk_start_key=op.chunk_start_key)
            finally:
                self._view.end()

            def commit() -> None:
                if writes:  # one pool write for the whole op: its cost is mostly per call
                    pool.write_slots(np.concatenate([slots for slots, _ in writes]),
                                     np.concatenate([data for _, data in writes]))
        else:
            raise ValueError(f"not a storage op: {op.kind.value}")
        missing = len(done) - sum(done)
        if missing:
            raise RuntimeError(f"{op.kind.value}: {missing} of {len(done)} pages failed (storage stats: "
                               f"{self.storage.stats().corrupt_objects} corrupt, {self.storage.stats().timeouts} timeouts)")
        moved = len(done) * self.slot_bytes
        return moved if commit is None else (moved, commit)

    def close(self) -> None:
        self.storage.close()
