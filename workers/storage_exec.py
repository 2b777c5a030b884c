"""L3 ops on a host worker: the ``StorageExecutor`` that runs L2->L3 backups and L3->L2 prefetches.

Each host attaches its own ``FsspecStorage`` over its shard of every page (its KV heads, all layers)
and registers its L2 pool with it; storage reads/writes that pool's slots only during a call. The head
sends the same storage op to every host; each host moves its shard and acks. An op succeeds only if
every page of it was stored / loaded (a partial prefetch fails whole: the head frees its slots and the
request recomputes), so no half-loaded slot is ever served.

Runs on the worker's thread, synchronously inside ``submit``: storage calls are bounded by the
storage timeout, so a slow or hung backend fails the op within that bound instead of hanging.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


class StorageExecutor:
    def __init__(self, attachment: StorageAttachment, pool: HostPool) -> None:
        self.attachment = attachment
        self.storage = FsspecStorage(attachment.url, attachment.fingerprint, attachment.config)
        self.storage.register_host_pool(
            pool, shard=host_shard(pool, attachment.fingerprint), pages_per_object=attachment.pages_per_object
        )
        self.slot_bytes = pool.slot_bytes

    def __call__(self, op: TransferOp, pool: HostPool) -> int:
        keys = list(op.storage_keys)
        if op.kind is OpKind.BACKUP_H2S:
            done = self.storage.batch_set(keys, op.host_slots, first_page=op.first_page)
        elif op.kind is OpKind.PREFETCH_S2H:
            done = self.storage.batch_get(keys, op.host_slots, first_page=op.first_page)
        else:
            raise ValueError(f"not a storage op: {op.kind.value}")
        missing = len(done) - sum(done)
        if missing:
            raise RuntimeError(f"{op.kind.value}: {missing} of {len(done)} pages failed (storage stats: "
                               f"{self.storage.stats().corrupt_objects} corrupt, {self.storage.stats().timeouts} timeouts)")
        return len(done) * self.slot_bytes

    def close(self) -> None:
        self.storage.close()
