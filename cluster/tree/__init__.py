"""The radix tree of one replica: keys, nodes, components, allocator, eviction (no bytes, no I/O)."""

from hicache.cluster.tree.allocator import CacheCapacityError, PageAllocator, PageOwner
from hicache.cluster.tree.component import ComponentTransfer, HiCachePhase, HostEvictionTracker, TreeComponent
from hicache.cluster.tree.eviction import EvictionPolicy
from hicache.cluster.tree.full import FullComponent
from hicache.cluster.tree.key import RadixKey, as_token_array
from hicache.cluster.tree.mamba import MambaComponent, MambaMatch, MambaRequest
from hicache.cluster.tree.node import TreeNode
from hicache.cluster.tree.params import (
    EvictResult,
    FinishResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
    RequestState,
    TreeStats,
)
from hicache.cluster.tree.radix import RadixTree, TreeConfig
from hicache.cluster.tree.swa import SWAComponent

__all__ = [
    "CacheCapacityError",
    "ComponentTransfer",
    "HiCachePhase",
    "HostEvictionTracker",
    "MambaComponent",
    "MambaMatch",
    "MambaRequest",
    "SWAComponent",
    "EvictResult",
    "EvictionPolicy",
    "FinishResult",
    "FullComponent",
    "InsertParams",
    "InsertResult",
    "MatchPrefixParams",
    "MatchResult",
    "PageAllocator",
    "PageOwner",
    "RadixKey",
    "RadixTree",
    "RequestState",
    "TreeComponent",
    "TreeConfig",
    "TreeNode",
    "TreeStats",
    "as_token_array",
]
