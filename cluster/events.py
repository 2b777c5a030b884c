"""KV events (what entered or left which tier) and hit/miss counters, drained by ``take_events``.

Produced by the head only. Routers use the events to know where prefixes live; metrics use the
counters. Node ids identify entries; token counts size them.

The head logs an event as ONE packed int (``pack_event``), not an object: it logs thousands per second,
and a tuple or dataclass per event that lives until ``take_events`` would feed the garbage collector
(tracked objects that survive trigger collections; ints are not tracked). ``take_events`` unpacks them.
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
    L3_UNAVAILABLE = "l3_unavailable"  # L3 not asked (breaker open) or its answer/fetch came too late; recomputed
    EVICTED_L3 = "evicted_l3"  # was in L2 and stored in L3, dropped by L2 eviction, and L3 no longer holds it
    NAMESPACE_DIFFERS = "namespace_differs"  # the same tokens are cached under another extra_key / cache_salt
    L3_UNREADABLE = "l3_unreadable"  # L3 had the object but its fetch failed (corrupt, short read, gone)
    COST_SKIPPED = "cost_skipped"  # L3 had the pages; the cost model chose recomputing them
    FINGERPRINT_DIFFERS = "fingerprint_differs"  # L3 holds them under a previous model fingerprint only
    PARTIAL_PAGE = "partial_page"  # past the key's last whole page (the last prompt token included): never cached


@dataclass(frozen=True)
class KVEvent:
    kind: EventKind
    tier: Tier
    node_id: int
    num_tokens: int


# Packed event: node_id << EVENT_ID_SHIFT | num_tokens << EVENT_TOKENS_SHIFT | code (kind and tier).
EVENT_TOKENS_SHIFT = 3  # 6 codes (2 kinds x 3 tiers) fit in 3 bits
EVENT_ID_SHIFT = 43  # num_tokens < 2**40
_CODES = tuple((kind, tier) for kind in EventKind for tier in Tier)
EVENT_CODES: dict[tuple[EventKind, Tier], int] = {kt: code for code, kt in enumerate(_CODES)}
_MAX_TOKENS = 1 << (EVENT_ID_SHIFT - EVENT_TOKENS_SHIFT)


def pack_event(kind: EventKind, tier: Tier, node_id: int, num_tokens: int) -> int:
    """One event as an int (the hot paths inline the same expression with a precomputed code)."""
    if not 0 <= num_tokens < _MAX_TOKENS or node_id < 0:
        raise ValueError(f"event out of range: node {node_id}, {num_tokens} tokens")
    return node_id << EVENT_ID_SHIFT | num_tokens << EVENT_TOKENS_SHIFT | EVENT_CODES[kind, tier]


def unpack_event(packed: int) -> KVEvent:
    kind, tier = _CODES[packed & 7]
    return KVEvent(kind, tier, packed >> EVENT_ID_SHIFT, (packed >> EVENT_TOKENS_SHIFT) & (_MAX_TOKENS - 1))


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
