"""hicache: a multi-level KV cache (device HBM / host DRAM / object storage) for JAX LLM serving.

Serving code needs this one import: ``hicache.connect`` (a running Ray replica) or
``hicache.embedded`` (a head in this process) gives a ``CacheClient``; the configs, the request and
result types its calls take and return, and the errors they raise are all here (``__all__``).
The control plane lives in ``hicache.cluster``, the data plane in ``hicache.workers`` and
``hicache.kernels``, L3 in ``hicache.storage`` (DESIGN.md §2); ``hicache.reference`` is a reference
engine and serving loop built on this API.

Every name is imported on first use, so ``import hicache`` stays light (no Ray, no JAX).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# module -> the names it gives; a TYPE_CHECKING import below mirrors each line for type checkers
_SOURCES: dict[str, tuple[str, ...]] = {
    # clients
    "hicache.cluster": ("CacheClient", "Call", "CallResult", "HeadConfig", "Method", "embedded"),
    "hicache.cluster.client": ("ResultRef",),
    "hicache.cluster.ray_client": ("connect",),
    "hicache.cluster.ray_head": ("ReplicaConfig", "start_replica", "stop_replica"),
    "hicache.cluster.ray_workers": ("WorkerGroupOptions",),
    "hicache.replica_file": ("load_replica_file",),
    # configs
    "hicache.cluster.policy": ("HiCacheConfig", "WritePolicy"),
    "hicache.cluster.builder": ("ComponentKind", "MambaConfig", "SWAConfig"),
    "hicache.cluster.cost_model": ("CostOptions", "PrefillReport"),
    "hicache.cluster.storage_tier": ("PrefetchParams", "PrefetchPolicy", "PrefetchProgress", "PrefetchState",
                                     "StorageParams"),
    "hicache.storage": ("ModelFingerprint", "StorageConfig"),
    "hicache.workers": ("HostWorker", "KVCacheSpec"),
    "hicache.cluster.worker_group": ("LocalWorkerGroup",),
    # requests and results
    "hicache.cluster.tree": ("CacheCapacityError", "EvictResult", "EvictionPolicy", "FinishResult", "InsertParams",
                             "InsertResult", "MatchPrefixParams", "MatchResult", "RadixKey", "RequestState",
                             "TreeConfig", "TreeStats"),
    "hicache.cluster.begin": ("BeginParams", "BeginResult"),
    "hicache.cluster.controller": ("LoadBackParams", "LoadBackResult"),
    "hicache.cluster.drain": ("DrainOptions", "DrainParams", "DrainProgress", "FileSource", "GceMetadataSource",
                              "Notice", "PreemptionConfig", "PreemptionWatcher", "SignalSource"),
    "hicache.cluster.events": ("EventKind", "KVEvent", "MissReason", "Tier"),
    "hicache.cluster.token_account": ("TokenAccount", "account_request"),
    # errors
    "hicache.cluster.errors": ("HiCacheDrainingError", "HiCacheError", "HiCacheReplicaResetError",
                               "HiCacheTimeoutError", "HiCacheUnavailableError"),
}
_LAZY = {name: module for module, names in _SOURCES.items() for name in names}

__all__ = [  # every name resolves (tests/test_public_api.py)
    "BeginParams", "BeginResult", "CacheCapacityError", "CacheClient", "Call", "CallResult", "ComponentKind",
    "CostOptions", "DrainOptions", "DrainParams", "DrainProgress", "EventKind", "EvictResult", "EvictionPolicy",
    "FileSource", "FinishResult", "GceMetadataSource", "HeadConfig", "HiCacheConfig", "HiCacheDrainingError",
    "HiCacheError", "Notice", "PreemptionConfig", "PreemptionWatcher", "SignalSource",
    "HiCacheReplicaResetError", "HiCacheTimeoutError", "HiCacheUnavailableError", "HostWorker", "InsertParams",
    "InsertResult", "KVCacheSpec", "KVEvent", "LoadBackParams", "LoadBackResult", "LocalWorkerGroup",
    "MambaConfig", "MatchPrefixParams", "MatchResult", "Method", "ModelFingerprint", "PrefetchParams", "PrefetchPolicy",
    "PrefetchProgress", "PrefetchState", "PrefillReport", "RadixKey", "ReplicaConfig", "RequestState", "ResultRef", "SWAConfig", "StorageConfig",
    "StorageParams", "Tier", "TreeConfig", "TreeStats", "WorkerGroupOptions", "WritePolicy", "connect", "embedded",
    "load_replica_file", "start_replica", "stop_replica", "MissReason", "TokenAccount", "account_request",
]

if TYPE_CHECKING:
    from hicache.cluster import CacheClient, Call, CallResult, HeadConfig, Method, embedded
    from hicache.cluster.begin import BeginParams, BeginResult
    from hicache.cluster.builder import ComponentKind, MambaConfig, SWAConfig
    from hicache.cluster.client import ResultRef
    from hicache.cluster.controller import LoadBackParams, LoadBackResult
    from hicache.cluster.cost_model import CostOptions, PrefillReport
    from hicache.cluster.drain import (
        DrainOptions,
        DrainParams,
        DrainProgress,
        FileSource,
        GceMetadataSource,
        Notice,
        PreemptionConfig,
        PreemptionWatcher,
        SignalSource,
    )
    from hicache.cluster.errors import (
        HiCacheDrainingError,
        HiCacheError,
        HiCacheReplicaResetError,
        HiCacheTimeoutError,
        HiCacheUnavailableError,
    )
    from hicache.cluster.events import EventKind, KVEvent, MissReason, Tier
    from hicache.cluster.policy import HiCacheConfig, WritePolicy
    from hicache.cluster.ray_client import connect
    from hicache.cluster.ray_head import ReplicaConfig, start_replica, stop_replica
    from hicache.cluster.ray_workers import WorkerGroupOptions
    from hicache.cluster.storage_tier import (
        PrefetchParams,
        PrefetchPolicy,
        PrefetchProgress,
        PrefetchState,
        StorageParams,
    )
    from hicache.cluster.token_account import TokenAccount, account_request
    from hicache.cluster.tree import (
        CacheCapacityError,
        EvictionPolicy,
        EvictResult,
        FinishResult,
        InsertParams,
        InsertResult,
        MatchPrefixParams,
        MatchResult,
        RadixKey,
        RequestState,
        TreeConfig,
        TreeStats,
    )
    from hicache.cluster.worker_group import LocalWorkerGroup
    from hicache.replica_file import load_replica_file
    from hicache.storage import ModelFingerprint, StorageConfig
    from hicache.workers import HostWorker, KVCacheSpec


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hicache' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
