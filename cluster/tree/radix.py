"""The radix tree of one serving replica: ``RadixTree``, composed from one module per concept.

- ``structure.py``: nodes, namespace roots, the key walk, split, leaf removal;
- ``match_insert.py``: ``match_prefix`` and ``insert``;
- ``request_flows.py``: locks and the request calls (``begin_request``, ``trim_request``,
  ``cache_finished_req``, ``cache_unfinished_req``);
- ``device_eviction.py``: L1 ``alloc`` / ``evict``;
- ``host_merge.py``: host-only nodes and the L2 merges (``merge_backed_up``).

This module wires the components and owns the bookkeeping (reset, stats, invariants). Owned by the head
(one per replica, DESIGN.md §1); a single thread mutates it. Every public method validates its input
completely before it mutates anything, so a ValueError/TypeError leaves the tree exactly as it was.

Extra components (SWA, Mamba; see ``component.py``) are called through ``self.hooks`` (per hook, only the
components that define it), so a Full-only tree pays nothing for them. Per-request component values
travel in ``MatchResult.components`` / ``RequestState.components`` (``begin_request`` creates them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hicache.cluster.tree.allocator import PageOwner
from hicache.cluster.tree.component import ComponentHooks, TreeComponent
from hicache.cluster.tree.device_eviction import DeviceEviction
from hicache.cluster.tree.eviction import EvictionPolicy, parse_policy
from hicache.cluster.tree.full import FullComponent
from hicache.cluster.tree.params import TreeStats
from hicache.cluster.tree.request_flows import RequestFlows
from hicache.cluster.tree.storage_only import StorageOnlyEntries
from hicache.cluster.tree.structure import TierListener  # re-exported: listeners implement it

__all__ = ["RadixTree", "TierListener", "TreeConfig"]


@dataclass(frozen=True)
class TreeConfig:
    page_size: int = 1
    capacity_pages: int | None = None  # L1 pages; None = unbounded (grows on demand)
    eviction_policy: EvictionPolicy | str = EvictionPolicy.LRU

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or isinstance(self.page_size, bool) or self.page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {self.page_size!r}")
        if self.capacity_pages is not None and (
            not isinstance(self.capacity_pages, int) or isinstance(self.capacity_pages, bool) or self.capacity_pages <= 0
        ):
            raise ValueError(f"capacity_pages must be a positive int or None, got {self.capacity_pages!r}")
        object.__setattr__(self, "eviction_policy", parse_policy(self.eviction_policy))


class RadixTree(RequestFlows, DeviceEviction):
    """One replica's radix tree: the public face of the modules listed above."""

    def __init__(self, config: TreeConfig, components: Sequence[TreeComponent] = ()) -> None:
        self.config = config
        self.page_size = config.page_size
        self._ck = 4 * config.page_size  # bytes of a child key (the node's first page)
        self.full = FullComponent(config.capacity_pages, parse_policy(config.eviction_policy))  # (parsed: typed)
        self.extra_components = list(components)
        for comp in [self.full, *self.extra_components]:
            comp.attach(self)
        names = [c.name for c in [self.full, *self.extra_components]]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate component names {names}")
        self.component_names = tuple(names)
        self.hooks = ComponentHooks(self.extra_components)
        self._value_types = tuple((c.name, c.value_type) for c in self.extra_components if c.value_type is not None)
        self.before_device_evict = None  # set by a HiCache controller (see TreeStructure)
        self.after_insert = None
        self.listener = None
        self.storage_only = StorageOnlyEntries(self)  # L3-only prefixes (warm restart); empty without L3
        self._init_state()

    def component(self, name: str) -> TreeComponent:
        """The component called ``name`` ("full", "swa", "mamba"); ValueError naming it if absent."""
        for comp in (self.full, *self.extra_components):
            if comp.name == name:
                return comp
        raise ValueError(f"no component {name!r} in this tree (components: {', '.join(self.component_names)})")

    def reset(self) -> None:
        """Empties the tree and frees every L1 page (pages held by running requests become invalid)."""
        for comp in [self.full, *self.extra_components]:
            comp.reset()
        self._init_state()
        self.storage_only.reset()

    def stats(self) -> TreeStats:
        full = self.full
        return TreeStats(
            page_size=self.page_size,
            num_nodes=self.num_nodes,
            cached_tokens=full.evictable_tokens + full.protected_tokens,
            evictable_tokens=full.evictable_tokens,
            protected_tokens=full.protected_tokens,
            free_pages=full.allocator.num_free,
            request_pages=full.allocator.count(PageOwner.REQUEST),
            capacity_pages=full.allocator.capacity,
            match_calls=self._match_calls,
            matched_tokens=self._matched_tokens,
            queried_tokens=self._queried_tokens,
            evicted_tokens=self._evicted_tokens,
            components=self.component_names,
        )

    def check_invariants(self) -> None:
        """Full structural check (O(nodes)); for tests and debugging."""
        ps = self.page_size
        for node in self.iter_nodes():
            parent = node.parent
            assert parent is not None
            assert node.num_tokens > 0 and node.num_tokens % ps == 0, f"{node} not page aligned"
            assert parent.children.get(node.key_bytes[: self._ck]) is node, f"{node} not linked"
            assert node.key.tobytes() == node.key_bytes and node.num_tokens == len(node.key)
            assert self._nodes.get(node.id) is node
            if node.device_pages is not None:
                assert node.device_pages.shape[0] * ps == node.num_tokens, f"{node} pages/tokens mismatch"
                assert parent.parent is None or parent.device_pages is not None, f"{node} in L1 under evicted parent"
            else:
                assert node.host_slots is not None or node.stored, f"{node} is in no tier"
            if parent.parent is not None:
                assert parent.lock_ref >= node.lock_ref, f"{node} locked more than its parent"
        for comp in [self.full, *self.extra_components]:
            comp.check_invariants()
        self.storage_only.check_invariants()
