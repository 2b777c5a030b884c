"""The routing query: what a request router asks one replica's head, in one call for many prompts.

A dry run: for each prompt, the L1 / L2 / L3 hit lengths the head's tree would give it now (no split,
no LRU tick, no lock, no prefetch started, no L3 I/O: ``RadixTree.peek_prefix``), plus the head's L1
room. Runs on the head (once per replica), as one ``Method.ROUTE_QUERY`` call; it touches nothing a
request's own calls depend on, so a router may send it as often as it routes.

L3 is what this head knows is stored (its own backups and fetches, manifest entries): the router takes
the longest L3 prefix any replica reports, because every replica reads the same L3.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hicache.cluster.tree import RadixKey, RadixTree


@dataclass(frozen=True)
class TierHits:
    """Tokens of one prompt's prefix per tier: ``l1`` from position 0, ``l2`` right after it (to load
    back), ``l3`` the stored prefix from position 0 (it may overlap L1/L2)."""

    l1: int
    l2: int
    l3: int


@dataclass(frozen=True)
class RouteQuery:
    keys: tuple[RadixKey, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.keys, tuple) or not all(isinstance(k, RadixKey) for k in self.keys):
            raise TypeError(f"RouteQuery.keys must be a tuple of RadixKey, got {self.keys!r:.200}")


@dataclass(frozen=True)
class RouteAnswer:
    """One head's answer: ``hits[i]`` for ``keys[i]``; ``free_l1_tokens`` free now, ``evictable_l1_tokens``
    more that eviction can free (unlocked cached KV); ``in_flight``: its transfers not yet acked."""

    hits: tuple[TierHits, ...]
    page_size: int
    free_l1_tokens: int
    evictable_l1_tokens: int
    in_flight: int = 0


def answer(tree: RadixTree, keys: Sequence[RadixKey], in_flight: int = 0) -> RouteAnswer:
    """The dry run over ``keys`` on ``tree`` (validates every key before it reads the tree)."""
    for k in keys:
        if not isinstance(k, RadixKey):
            raise TypeError(f"route_query expects RadixKey entries, got {type(k).__name__}")
    hits = tuple(TierHits(*tree.peek_prefix(k)) for k in keys)
    full = tree.full
    ps = tree.page_size
    return RouteAnswer(hits, ps, full.allocator.num_free * ps, full.evictable_tokens, in_flight)
