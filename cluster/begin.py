"""A request's start on the head in one call: ``CacheHead.begin_request`` (one round trip over Ray).

Serving code starts every request the same way: (hold L2->L3 writes,) check the prefetch its arrival
started, match, ask L3 for what L1+L2 lack, then lock the reused prefix and allocate pages for the
rest. As separate calls that is four round trips and as many client/head layers even for a request
that reuses nothing; ``BeginParams`` carries what the serving code would decide between them, so the
head decides in place and returns what the calls would have returned (``BeginResult``). It stops
where the request must wait: an L3 prefetch started (the caller waits for it and matches again), or an
L2 hit to load back (``init_load_back``). No state is kept between the calls; both types are plain
slotted values, one of each per request (they cross the Ray boundary; ``hicache.cluster.wire`` sends
them compactly).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from hicache.cluster.events import MissReason
from hicache.cluster.storage_tier import PrefetchProgress
from hicache.cluster.tree import MatchResult, RadixKey
from hicache.cluster.tree.params import NO_VALUES

NO_LIMIT = 1 << 62  # ``BeginParams.l3_below`` when any match length may ask L3


@dataclass(slots=True, eq=False)
class BeginParams:
    """What ``begin_request`` does, in this order: ``hold_writes``: ``pause_storage_writes``;
    ``check_prefetch`` (an arrival's prefetch id): ``check_prefetch_progress`` of it (it applies acks,
    waits as the stop policy allows); ``match_prefix(key)``; ``prefetch_id``: start an L3 prefetch
    under that id when the whole pages past the L1+L2 match hold >= ``l3_min_tokens`` tokens and the
    match is shorter than ``l3_below`` (what an arrival's query covered: L3 had nothing past it); then,
    unless a prefetch started or the match has an L2 part, lock the L1 prefix
    (``match.last_device_node``) and allocate pages for ``total_tokens - device_hit_len`` tokens
    (``total_tokens``: the request's prompt and new tokens, >= ``len(key)``). ``l1_only``: the match
    takes no L2 part (the components limit its L1 part as when nothing follows in L2) and is not counted as
    a request's match: a request whose L2 part was just loaded back starts from it (Mamba: its working state
    copies the loaded state; a failed load leaves the deepest L1 node with a state); no L3 with it."""

    key: RadixKey
    total_tokens: int
    hold_writes: bool = False
    check_prefetch: str | None = None
    prefetch_id: str | None = None
    l3_min_tokens: int = 0
    l3_below: int = NO_LIMIT
    l1_only: bool = False

    def __post_init__(self) -> None:
        # checked here, before the head changes anything
        key = self.key
        if type(key) is not RadixKey:
            raise TypeError(f"BeginParams.key must be a RadixKey, got {type(key).__name__}")
        for name in ("total_tokens", "l3_min_tokens", "l3_below"):
            v = getattr(self, name)
            if type(v) is not int or v < 0:
                raise ValueError(f"BeginParams.{name} must be an int >= 0, got {v!r}")
        if self.total_tokens < key.token_ids.shape[0]:
            raise ValueError(
                f"BeginParams.total_tokens {self.total_tokens} < the key's {key.token_ids.shape[0]} tokens")
        if type(self.hold_writes) is not bool:
            raise TypeError(f"BeginParams.hold_writes must be a bool, got {self.hold_writes!r}")
        for name in ("check_prefetch", "prefetch_id"):
            v = getattr(self, name)
            if v is not None and type(v) is not str:
                raise TypeError(f"BeginParams.{name} must be a str or None, got {v!r}")
        if type(self.l1_only) is not bool:
            raise TypeError(f"BeginParams.l1_only must be a bool, got {self.l1_only!r}")
        if self.l1_only and (self.check_prefetch is not None or self.prefetch_id is not None):
            raise ValueError("BeginParams.l1_only takes no L3 prefetch (check_prefetch, prefetch_id must be None)")


@dataclass(slots=True, eq=False)
class BeginResult:
    """``match``: the match (taken after the prefetch check); ``fetched``: tokens the checked prefetch
    brought into L2 (DONE), else 0; ``prefetch``: the progress of the prefetch this call started (None:
    none started); ``pages``: L1 pages for the rest of the request, with ``match.last_device_node``
    locked for it (None: nothing locked or allocated: a prefetch started or an L2 part to load back);
    ``l3_s``/``alloc_s``: the head's seconds in the L3 query and in lock + alloc (for phase timings);
    ``components``: with ``pages``, the request's per-component values (``RadixTree.begin_request``, e.g.
    its Mamba working slot and copy) to pass as ``RequestState.components``; empty for Full-only trees.
``miss_reason``: why the whole pages of the key past the match are missed, as far as the head knows
in this call (the tree's reason, or L3's once asked: ``token_account.explain_l3``); None: none missed."""

    match: MatchResult
    fetched: int
    prefetch: PrefetchProgress | None
    pages: np.ndarray | None  # i32[pages] or None
    l3_s: float = 0.0
    alloc_s: float = 0.0
    components: Mapping[str, Any] = NO_VALUES
    miss_reason: MissReason | None = None
