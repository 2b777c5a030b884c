"""Data plane: L1 device pool, L2 host pool, transfer engine and the per-host ``HostWorker``.

Workers execute plans and never decide (no imports of ``hicache.cluster``). Imports: ``kernels``
(and, for L3 ops, ``storage`` through a pluggable executor).
"""

from hicache.workers.device_pool import DevicePool, default_mesh
from hicache.workers.host_pool import HostPool, HostPoolConfig, SlotAllocator, size_host_pool
from hicache.workers.plan import OpKind, PoolCopy, StoragePart, TransferAck, TransferOp, TransferPlan
from hicache.workers.spec import ComponentPool, KVCacheSpec
from hicache.workers.transfer import TransferEngine, TransferHandle
from hicache.workers.worker import HostWorker, StorageOpFn

__all__ = [
    "ComponentPool", "DevicePool", "HostPool", "HostPoolConfig", "HostWorker", "KVCacheSpec", "OpKind", "PoolCopy", "SlotAllocator", "StoragePart",
    "StorageOpFn", "TransferAck", "TransferEngine", "TransferHandle", "TransferOp", "TransferPlan",
    "default_mesh", "size_host_pool",
]
