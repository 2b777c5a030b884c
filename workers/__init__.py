"""Data plane: L1 device pool, L2 host pool, transfer engine and the per-host ``HostWorker``.

Workers execute plans and never decide (no imports of ``hicache.cluster``). Imports: ``kernels``
(and, for L3 ops, ``storage`` through a pluggable executor).
"""

from hicache.workers.device_pool import DevicePool, default_mesh
from hicache.workers.host_pool import (
    HostPool,
    HostPoolConfig,
    HostPoolKind,
    NumpySlabHostPool,
    PinnedPagesHostPool,
    SlotAllocator,
    make_host_pool,
    select_host_pool_kind,
    size_host_pool,
)
from hicache.workers.plan import OpKind, TransferAck, TransferOp, TransferPlan
from hicache.workers.spec import KVCacheSpec
from hicache.workers.transfer import DataPath, TransferEngine, TransferHandle
from hicache.workers.worker import HostWorker, StorageExecutor

__all__ = [
    "DataPath", "DevicePool", "HostPool", "HostPoolConfig", "HostPoolKind", "HostWorker", "KVCacheSpec",
    "NumpySlabHostPool", "OpKind", "PinnedPagesHostPool", "SlotAllocator", "StorageExecutor",
    "TransferAck", "TransferEngine", "TransferHandle", "TransferOp", "TransferPlan", "default_mesh",
    "make_host_pool", "select_host_pool_kind", "size_host_pool",
]
