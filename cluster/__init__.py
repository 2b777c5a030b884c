"""Control plane: the radix tree, the head that owns it, and the client serving code holds."""

from hicache.cluster.client import CacheClient, EmbeddedTransport, embedded
from hicache.cluster.head import CacheHead, Call, CallResult, HeadConfig, Method

__all__ = ["Call", "CacheClient", "CacheHead", "CallResult", "EmbeddedTransport", "HeadConfig", "Method", "embedded"]

# The Ray layer (head actor, host worker actors, Ray client) is imported lazily: it needs Ray.
_LAZY = {
    "connect": "hicache.cluster.ray_client",
    "RayTransport": "hicache.cluster.ray_client",
    "start_replica": "hicache.cluster.ray_head",
    "stop_replica": "hicache.cluster.ray_head",
    "ReplicaConfig": "hicache.cluster.ray_head",
    "RayWorkerGroup": "hicache.cluster.ray_workers",
    "WorkerGroupOptions": "hicache.cluster.ray_workers",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hicache.cluster' has no attribute {name!r}")
