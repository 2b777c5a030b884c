"""hicache.storage: L3 (object storage) for the KV cache — ``HiCacheStorage`` ABC, the fsspec
implementation (file://, memory://, gs://), the key scheme and the object format (DESIGN.md §5).

Storage knows neither the radix tree nor the device/host pools' internals: a host pool is reached
through the small ``HostSlots`` protocol; keys are computed by ``page_keys`` (or lazily,
``ChainKeys``).

Modules: ``base`` (interface, stats, argument checks), ``keys`` (key scheme), ``format`` (object
header), ``config`` (``StorageConfig``), ``object_store`` (per-scheme primitives), ``batch_io``
(batches under a deadline), ``chunking`` (pages <-> objects), ``shard_cover`` (topology-free reads), ``slot_access`` (host slot copies),
``lru`` (file:// byte cap), ``manifest`` (warm restart), ``fsspec_store`` (``FsspecStorage``),
``errors`` (error kinds), ``breaker`` (per-location breaker), ``corruption`` (in transit vs at
rest), ``fault_injection`` (a seeded fault-injecting fsspec wrapper), ``testing`` (a numpy host
pool and a manual clock for tests).
"""

from hicache.storage.base import (
    HiCacheStorage,
    HostSlots,
    PoolKind,
    PoolTransfer,
    StorageStats,
    StoredPrefix,
)
from hicache.storage.breaker import BreakerState
from hicache.storage.config import DEFAULT_TARGET_OBJECT_BYTES, LocalIO, StorageConfig
from hicache.storage.errors import ErrorKind, StorageUnavailableError
from hicache.storage.format import FORMAT_VERSION, CorruptObjectError, CorruptReason
from hicache.storage.fsspec_store import FsspecStorage
from hicache.storage.keys import (
    ChainKeys,
    ModelFingerprint,
    Namespace,
    ShardCoord,
    page_keys,
)

__all__ = [
    "BreakerState",
    "ChainKeys",
    "DEFAULT_TARGET_OBJECT_BYTES",
    "FORMAT_VERSION",
    "CorruptObjectError",
    "CorruptReason",
    "ErrorKind",
    "FsspecStorage",
    "HiCacheStorage",
    "HostSlots",
    "ModelFingerprint",
    "LocalIO",
    "Namespace",
    "PoolKind",
    "PoolTransfer",
    "ShardCoord",
    "StorageConfig",
    "StorageStats",
    "StorageUnavailableError",
    "StoredPrefix",
    "page_keys",
]
