"""L3 ops on a host worker: the ``StorageExecutor`` that runs L2->L3 backups and L3->L2 prefetches.

Each host attaches its own ``FsspecStorage`` over its shard of every page (its KV heads, all layers)
and registers its L2 pool with it; storage reads/writes that pool's slots only during a call. The head
sends the same storage op to every host; each host moves its shard and acks. An op succeeds only if
every page of it was stored / loaded (a partial prefetch fails whole: the head frees its slots and the
request recomputes), so no half-loaded slot is ever served.

Runs on the worker's storage thread (``HostWorker`` submits each op there and acks it through
``poll``/``wait``); storage calls are bounded by the storage timeout, so a slow or hung backend
fails the op within that bound instead of hanging. The storage reads slots of the real pool (H2S) on
that thread. Writes (S2H) depend on the pool:

* a pool of pinned device-side pages (TPU) is never written there: the storage is registered with a
  ``_DeferredWrites`` view whose ``write_slots`` only collects the fetched pages, and an S2H returns
  ``(bytes, commit)``; ``commit`` (one ``write_slots`` per collected range) runs on the owner thread
  when the op is acked. A failed, partial or timed-out prefetch never touches that pool.
* a pool that is one numpy slab (``slot_view``) is written in place: the storage reads each object
  straight into the prefetch's slots (one ``preadv`` per object, verified as it lands; a failure
  zeroes them), and the op is acked with nothing to commit. Those slots are the head's reservation
  for this prefetch alone (no tree node holds them, nothing reads or writes them until the ack: the
  worker acks an S2H before any later op that reads its slots, ``HostWorker._settle_writers``), the
  storage stops touching the pool when its call returns, also on a timeout (``_CallGuard``), and the
  slab's other rows are written by the owner thread only (disjoint memory). A failed prefetch's
  slots are freed by the head unused. This saves the copy of every fetched page on the owner
  thread, where the request waits for it (``check_prefetch_progress``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hicache.storage import FsspecStorage, ModelFingerprint, ShardCoord, StorageConfig
from hicache.workers.host_pool import HostPool
from hicache.workers.plan import OpKind, TransferOp


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
    """The host pool as the storage sees it on the storage thread: reads go to the pool, writes are
    collected (per thread) and applied later by the owner thread; over one numpy slab
    (``concurrent_slot_io``) the storage writes a prefetch's reserved slots in place instead
    (module docstring), else it scatters on the calling thread. ``concurrent_slot_reads``: its I/O threads may read
    the slots of a backup during the call (they are pinned by the head until it is acked, and reads
    of pool memory need no owner thread), so with the pool's ``slot_view`` an L2->L3 write goes
    straight from the slab to the file (no gathered copy)."""

    concurrent_slot_reads = True

    def __init__(self, pool: HostPool) -> None:
        self._pool = pool
        self._local = threading.local()
        # The storage's structural HostPool check reads these statically (Python >= 3.12 uses
        # inspect.getattr_static, which never reaches __getattr__), so they are real attributes.
        self.slot_shape, self.dtype, self.slot_bytes = pool.slot_shape, pool.dtype, pool.slot_bytes
        # One numpy slab (``slot_view``): prefetches land in place (module docstring); else collected.
        view = getattr(pool, "slot_view", None)
        self.concurrent_slot_io = view is not None and view(0, 1) is not None

    def __getattr__(self, name: str):
        return getattr(self._pool, name)

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


HostPool.register(_DeferredWrites)


class StorageExecutor:
    def __init__(self, attachment: StorageAttachment, pool: HostPool) -> None:
        self.attachment = attachment
        self.storage = FsspecStorage(attachment.url, attachment.fingerprint, attachment.config)
        self._view = _DeferredWrites(pool)
        self.storage.register_host_pool(
            self._view, shard=host_shard(pool, attachment.fingerprint), pages_per_object=attachment.pages_per_object
        )
        self.pool = pool
        self.slot_bytes = pool.slot_bytes

    def __call__(self, op: TransferOp, pool: HostPool) -> int | tuple[int, Callable[[], None]]:
        keys = list(op.storage_keys)
        if pool is not self.pool:
            raise ValueError("storage executor was built for another host pool")
        commit = None
        if op.kind is OpKind.BACKUP_H2S:
            done = self.storage.batch_set(keys, op.host_slots, first_page=op.first_page)
        elif op.kind is OpKind.PREFETCH_S2H and self._view.concurrent_slot_io:  # into the slab, in place
            done = self.storage.batch_get(keys, op.host_slots, first_page=op.first_page)
        elif op.kind is OpKind.PREFETCH_S2H:
            writes = self._view.begin()
            try:
                done = self.storage.batch_get(keys, op.host_slots, first_page=op.first_page)
            finally:
                self._view.end()

            def commit() -> None:
                for slots, data in writes:
                    pool.write_slots(slots, data)
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
