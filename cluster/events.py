"""KV events (what entered or left which tier) and hit/miss counters, drained by ``take_events``.

Produced by the head only. Routers use the events to know where prefixes live; metrics use the
counters. Node ids identify entries; token counts size them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum


class Tier(str, Enum):
    DEVICE = "device"  # L1
    HOST = "host"  # L2
    STORAGE = "storage"  # L3


class EventKind(str, Enum):
    STORED = "stored"
    REMOVED = "removed"


class MissReason(str, Enum):
    NOT_CACHED = "not_cached"  # never seen (as far as the head remembers)
    EVICTED_L1 = "evicted_l1"  # was in L1, dropped without an L2 copy
    EVICTED_L2 = "evicted_l2"  # was in L2, dropped by host eviction
    BELOW_THRESHOLD = "below_threshold"  # host hit shorter than load_back_threshold: recomputed
    OVER_QUOTA = "over_quota"  # load-back needed more L1 than the caller's quota
    NO_SPACE = "no_space"  # L1 could not make room for the load-back
    LOAD_FAILED = "load_failed"  # the H->D transfer failed; recomputed


@dataclass(frozen=True)
class KVEvent:
    kind: EventKind
    tier: Tier
    node_id: int
    num_tokens: int


@dataclass
class CacheCounters:
    """Token counts since start (monotonic)."""

    queried_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0  # found in L2 at match time
    loaded_tokens: int = 0  # actually loaded back L2 -> L1
    backed_up_tokens: int = 0  # L1 -> L2 acked
    miss_tokens: Counter = field(default_factory=Counter)  # MissReason -> tokens
    transfer_failures: int = 0
    bytes_moved: Counter = field(default_factory=Counter)  # op kind -> bytes (all hosts)

    def snapshot(self) -> dict:
        return {
            "queried_tokens": self.queried_tokens,
            "device_hit_tokens": self.device_hit_tokens,
            "host_hit_tokens": self.host_hit_tokens,
            "loaded_tokens": self.loaded_tokens,
            "backed_up_tokens": self.backed_up_tokens,
            "miss_tokens": {str(k.value): v for k, v in self.miss_tokens.items()},
            "transfer_failures": self.transfer_failures,
            "bytes_moved": dict(self.bytes_moved),
        }
