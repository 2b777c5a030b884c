"""Parameter and result types of the tree's control API (DESIGN.md §3).

Nodes are referred to by integer id because these cross process boundaries (the head is a Ray actor,
serving code holds a client). Page arrays are int32 numpy arrays. Options and rare results are frozen
dataclasses; the ones made for every request (``MatchResult``, ``InsertParams``, ``RequestState``,
``FinishResult``) are ``@dataclass(slots=True)`` without ``frozen``, because a frozen dataclass's ``__init__`` stores each field
through ``object.__setattr__``: treat them as read-only all the same.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache.cluster.tree.key import RadixKey


class _NoValues(Mapping):
    """The shared, immutable, hashable empty mapping (a dataclass default needs a hashable value)."""

    __slots__ = ()

    def __getitem__(self, key: str) -> Any:
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "{}"


NO_VALUES: Mapping[str, Any] = _NoValues()
_NO_VALUES = NO_VALUES


@dataclass(frozen=True, eq=False)
class MatchPrefixParams:
    key: RadixKey


@dataclass(slots=True, eq=False)
class MatchResult:
    """Longest cached prefix of a key, in whole pages.

    ``device_pages`` are the L1 pages of the first ``device_hit_len`` tokens. ``host_hit_len`` more tokens
    follow in L2 only (load them back with ``init_load_back``). ``last_device_node`` is the deepest node
    whose KV is in L1 (lock it while using the pages), ``last_host_node`` the deepest matched node with an
    L2 copy, ``best_match_node`` the deepest matched node on any tier. The namespace root's id stands for
    "nothing matched". ``components`` holds per-component results by component name (Mamba: the
    state slot of exactly ``device_hit_len`` tokens and the branching seqlen); empty for Full-only trees.
    ``storage_hit_len``: tokens right after the host hit that the tree knows are in L3 (storage-only
    entries, e.g. rebuilt from the L3 manifest): a prefetch of them is likely to hit, never a device or
    host hit; 0 when unknown.
    """

    device_pages: np.ndarray  # i32[device_hit_len // page_size]
    device_hit_len: int
    host_hit_len: int
    last_device_node: int
    last_host_node: int
    best_match_node: int
    components: Mapping[str, Any] = _NO_VALUES
    storage_hit_len: int = 0


@dataclass(slots=True, eq=False)
class InsertParams:
    key: RadixKey
    device_pages: np.ndarray  # i32[>= len(key) // page_size]: L1 pages holding the key's KV, in order
    priority: int = 0


@dataclass(frozen=True)
class InsertResult:
    prefix_len: int  # tokens of the key that were already cached in L1 (their pages were not taken)


@dataclass(slots=True, eq=False)
class RequestState:
    """What the tree needs to know about a running request to cache it.

    ``device_pages`` cover the request's tokens in order (the first ``prefix_len // page_size`` pages came
    from the tree at match time, the rest were allocated for the request; extra pages past the last token
    are allowed). ``last_node`` is the node locked at match time. ``components`` carries the request's
    per-component values from ``RadixTree.begin_request`` (Mamba: its working state slot); empty for
    Full-only and SWA trees.
    """

    key: RadixKey
    device_pages: np.ndarray  # i32[>= ceil(len(key) / page_size)]
    prefix_len: int
    last_node: int
    priority: int = 0
    components: Mapping[str, Any] = _NO_VALUES


@dataclass(slots=True)
class FinishResult:
    new_prefix_len: int  # tokens that were already cached when the request was inserted
    freed_pages: int  # duplicate pages and the partial tail returned to the free list


@dataclass(frozen=True)
class EvictResult:
    evicted_tokens: int
    components: Mapping[str, int] = _NO_VALUES  # evict_param -> amount freed (SWA tokens, Mamba states)


@dataclass(frozen=True)
class TreeStats:
    page_size: int
    num_nodes: int
    cached_tokens: int  # tokens with KV in L1 held by the tree
    evictable_tokens: int
    protected_tokens: int
    free_pages: int
    request_pages: int
    capacity_pages: int
    match_calls: int
    matched_tokens: int
    queried_tokens: int
    evicted_tokens: int
    components: tuple[str, ...] = field(default=("full",))

    @property
    def hit_rate(self) -> float:
        return self.matched_tokens / self.queried_tokens if self.queried_tokens else 0.0
