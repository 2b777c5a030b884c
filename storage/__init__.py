"""hicache.storage: L3 (object storage) for the KV cache — ``HiCacheStorage`` ABC, the fsspec
backend (file://, memory://, gs://), the key scheme and the object format (DESIGN.md §5).

Storage knows neither the radix tree nor the device/host pools' internals: the host pool is
reached through the small ``HostPool`` protocol; keys are computed by ``page_keys`` (or lazily,
``ChainKeys``).
"""

from hicache.storage.base import (
    HiCacheStorage,
    HostPool,
    PoolKind,
    PoolTransfer,
    StorageStats,
    StoredPrefix,
)
from hicache.storage.format import FORMAT_VERSION, CorruptObjectError, CorruptReason
from hicache.storage.fsspec_store import (
    DEFAULT_TARGET_OBJECT_BYTES,
    FsspecStorage,
    StorageConfig,
)
from hicache.storage.keys import (
    ChainKeys,
    ModelFingerprint,
    Namespace,
    ShardCoord,
    page_keys,
)

__all__ = [
    "ChainKeys",
    "DEFAULT_TARGET_OBJECT_BYTES",
    "FORMAT_VERSION",
    "CorruptObjectError",
    "CorruptReason",
    "FsspecStorage",
    "HiCacheStorage",
    "HostPool",
    "ModelFingerprint",
    "Namespace",
    "PoolKind",
    "PoolTransfer",
    "ShardCoord",
    "StorageConfig",
    "StorageStats",
    "StoredPrefix",
    "page_keys",
]
