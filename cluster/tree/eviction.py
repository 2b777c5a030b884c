"""Eviction policies and the lazy priority queue of eviction candidates.

A candidate is a node that may leave a tier now (for L1: unlocked, device-resident, no device-resident
children). Instead of re-heapifying all leaves on every eviction (O(n) per call), the tree pushes a node
whenever it becomes a candidate; each push bumps the node's version field for that queue so older entries go stale and are
skipped when popped. Priorities only grow (access ticks, hit counts) or never change, so an entry whose
node was touched since its push is simply requeued with its current priority when it surfaces: the
order stays exact without a push on every touch. The heap is rebuilt when stale entries dominate.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from enum import Enum

from hicache.cluster.tree.node import TreeNode


class EvictionPolicy(str, Enum):
    LRU = "lru"  # least recently used first
    LFU = "lfu"  # fewest hits first, then least recently used
    FIFO = "fifo"  # oldest insertion first
    PRIORITY = "priority"  # lowest request priority first, then least recently used


def priority_key(policy: EvictionPolicy) -> Callable[[TreeNode], tuple[int, ...]]:
    if policy is EvictionPolicy.LRU:
        return lambda n: (n.last_access,)
    if policy is EvictionPolicy.LFU:
        return lambda n: (n.hit_count, n.last_access)
    if policy is EvictionPolicy.FIFO:
        return lambda n: (n.created,)
    if policy is EvictionPolicy.PRIORITY:
        return lambda n: (n.priority, n.last_access)
    raise ValueError(f"unknown eviction policy {policy!r}")


def parse_policy(policy: EvictionPolicy | str) -> EvictionPolicy:
    try:
        return EvictionPolicy(policy)
    except ValueError:
        choices = ", ".join(p.value for p in EvictionPolicy)
        raise ValueError(f"unknown eviction policy {policy!r}; choose one of {choices}") from None


class EvictionQueue:
    """Min-heap of (priority, node id, version, node); stale entries are dropped lazily."""

    def __init__(
        self, policy: EvictionPolicy, is_candidate: Callable[[TreeNode], bool], version_attr: str = "heap_version"
    ) -> None:
        """``version_attr`` names the node field that versions this queue's entries (one per queue)."""
        self.policy = policy
        self._version_attr = version_attr
        self._key = priority_key(policy)
        self._is_candidate = is_candidate
        self._heap: list[tuple[tuple[int, ...], int, int, TreeNode]] = []

    def push(self, node: TreeNode) -> None:
        version = getattr(node, self._version_attr) + 1
        setattr(node, self._version_attr, version)
        heapq.heappush(self._heap, (self._key(node), node.id, version, node))

    def pop(self) -> TreeNode | None:
        """Removes and returns the best current candidate, or None when there is none."""
        heap = self._heap
        while heap:
            key, _, version, node = heapq.heappop(heap)
            if version != getattr(node, self._version_attr) or not self._is_candidate(node):
                continue
            current = self._key(node)
            if current != key:  # touched since it was pushed (keys only grow): requeue in its place
                heapq.heappush(heap, (current, node.id, version, node))
                continue
            setattr(node, self._version_attr, version + 1)  # consumed: remaining entries are stale
            return node
        return None

    def maybe_compact(self, live_nodes: Iterable[TreeNode], num_live: int) -> None:
        if len(self._heap) > 4 * num_live + 4096:
            self.rebuild(live_nodes)

    def rebuild(self, live_nodes: Iterable[TreeNode]) -> None:
        self._heap = []
        for node in live_nodes:
            if self._is_candidate(node):
                version = getattr(node, self._version_attr) + 1
                setattr(node, self._version_attr, version)
                self._heap.append((self._key(node), node.id, version, node))
        heapq.heapify(self._heap)

    def clear(self) -> None:
        self._heap = []

    def __len__(self) -> int:
        return len(self._heap)
