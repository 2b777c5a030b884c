"""hicache: a multi-level KV cache (device HBM / host DRAM / object storage) for JAX LLM serving.

Public API re-exports. The control plane lives in ``hicache.cluster``, the data plane in
``hicache.workers`` and ``hicache.kernels``, L3 in ``hicache.storage`` (see DESIGN.md §2).
"""

__version__ = "0.1.0"

# Ray cluster entry points, imported lazily so ``import hicache`` stays light (no Ray, no JAX).
_LAZY = {
    "connect": "hicache.cluster.ray_client",
    "start_replica": "hicache.cluster.ray_head",
    "stop_replica": "hicache.cluster.ray_head",
    "ReplicaConfig": "hicache.cluster.ray_head",
    "WorkerGroupOptions": "hicache.cluster.ray_workers",
    "HiCacheError": "hicache.cluster.errors",
    "HiCacheTimeoutError": "hicache.cluster.errors",
    "HiCacheUnavailableError": "hicache.cluster.errors",
    "HiCacheReplicaResetError": "hicache.cluster.errors",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hicache' has no attribute {name!r}")
