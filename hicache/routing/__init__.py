"""Request routing over many replicas from what each replica's head really holds (L1/L2/L3) and its load.

``TierAwareRouter`` (plain Python, any ``ReplicaProbe``), ``HeadProbe`` (a replica reached through a
``CacheClient``), ``ProbeServer``/``ChannelProbe`` (a replica in another process, over loopback), and
``hicache.routing.serve_router`` (the Ray Serve request router; needs the ``[serve]`` extra).
"""

from hicache.routing.cost import Estimate, TTFTModel, estimate, split_prompt
from hicache.routing.probes import ChannelProbe, HeadProbe, ProbeServer
from hicache.routing.router import (
    ReplicaLoad,
    ReplicaProbe,
    ReplicaView,
    RouterOptions,
    RoutingDecision,
    RoutingStats,
    TierAwareRouter,
    rank,
)

__all__ = [
    "ChannelProbe",
    "Estimate",
    "HeadProbe",
    "ProbeServer",
    "ReplicaLoad",
    "ReplicaProbe",
    "ReplicaView",
    "RouterOptions",
    "RoutingDecision",
    "RoutingStats",
    "TTFTModel",
    "TierAwareRouter",
    "estimate",
    "rank",
    "split_prompt",
]
