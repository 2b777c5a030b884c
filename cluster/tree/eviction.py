"""Eviction policies and the lazy priority queues of eviction candidates (Full, extra components).

A candidate is a node that may leave a tier now (for L1: unlocked, device-resident, no device-resident
children). Instead of re-heapifying all leaves on every eviction (O(n) per call), the tree pushes a node
whenever it becomes a candidate; a node has at most one current entry (a version field per queue says
whether it is in the heap), and a popped entry whose node is no longer a candidate is dropped. Priorities
only grow (access ticks, hit counts) or never change, so an entry whose node was touched since its push
is simply requeued with its current priority when it surfaces: the order stays exact without a push on
every touch. The heap is rebuilt when stale entries dominate.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from enum import Enum
from operator import attrgetter
from typing import TYPE_CHECKING

from hicache.cluster.tree.node import TreeNode

if TYPE_CHECKING:
    from hicache.cluster.tree.radix import RadixTree


class EvictionPolicy(str, Enum):
    LRU = "lru"  # least recently used first
    LFU = "lfu"  # fewest hits first, then least recently used
    FIFO = "fifo"  # oldest insertion first
    PRIORITY = "priority"  # lowest request priority first, then least recently used


def priority_key(policy: EvictionPolicy) -> Callable[[TreeNode], int | tuple[int, ...]]:
    """The node's priority under ``policy`` (smaller leaves first): an ``attrgetter`` (no Python frame per
    call), a plain int for one field (cheaper heap compares than a 1-tuple)."""
    if policy is EvictionPolicy.LRU:
        return attrgetter("last_access")
    if policy is EvictionPolicy.LFU:
        return attrgetter("hit_count", "last_access")
    if policy is EvictionPolicy.FIFO:
        return attrgetter("created")
    if policy is EvictionPolicy.PRIORITY:
        return attrgetter("priority", "last_access")
    raise ValueError(f"unknown eviction policy {policy!r}")


def parse_policy(policy: EvictionPolicy | str) -> EvictionPolicy:
    try:
        return EvictionPolicy(policy)
    except ValueError:
        choices = ", ".join(p.value for p in EvictionPolicy)
        raise ValueError(f"unknown eviction policy {policy!r}; choose one of {choices}") from None


def outgrew(heap_entries: int, num_live: int) -> bool:
    """Whether a lazy-deletion heap's stale entries outgrew the live nodes (both queues rebuild then)."""
    return heap_entries > 4 * num_live + 4096


class EvictionQueue:
    """Min-heap of (priority, node id, version, node), at most one current entry per node.

    A node's version field (``version_attr``, one per queue) says whether its current entry is in the heap:
    it is when the version is above ``_floor`` (versions come from one counter per queue, so ``clear`` and
    ``rebuild`` forget every node at once by raising the floor). Pushing a queued node costs nothing (a
    request's lock/unlock cycle does no heap work); a popped entry whose node is no longer a candidate is
    dropped and the node unqueued (its next push adds it again).
    """

    def __init__(
        self, policy: EvictionPolicy, is_candidate: Callable[[TreeNode], bool], version_attr: str = "heap_version"
    ) -> None:
        """``version_attr`` names the node field that versions this queue's entries (one per queue)."""
        self.policy = policy
        self._version_attr = version_attr
        self._key = priority_key(policy)
        self._is_candidate = is_candidate
        self._heap: list[tuple[int | tuple[int, ...], int, int, TreeNode]] = []
        self._counter = 0  # last version handed out
        self._floor = 0  # versions <= floor are not in the heap

    def is_queued(self, node: TreeNode) -> bool:
        return getattr(node, self._version_attr) > self._floor

    def push(self, node: TreeNode) -> None:
        """Queues a candidate (no-op when its entry is already in the heap)."""
        if getattr(node, self._version_attr) > self._floor:
            return
        self._counter += 1
        setattr(node, self._version_attr, self._counter)
        heapq.heappush(self._heap, (self._key(node), node.id, self._counter, node))

    def offer(self, node: TreeNode) -> None:
        """``push`` if the node is a candidate now; a queued node is not tested (its pop tests it)."""
        if getattr(node, self._version_attr) <= self._floor and self._is_candidate(node):
            self.push(node)

    def pop(self) -> TreeNode | None:
        """Removes and returns the best current candidate, or None when there is none."""
        heap, attr = self._heap, self._version_attr
        while heap:
            key, _, version, node = heapq.heappop(heap)
            if version != getattr(node, attr):
                continue
            if not self._is_candidate(node):
                setattr(node, attr, 0)  # unqueued: the next push adds it again
                continue
            current = self._key(node)
            if current != key:  # touched since it was pushed (keys only grow): requeue in its place
                heapq.heappush(heap, (current, node.id, version, node))
                continue
            setattr(node, attr, 0)  # consumed
            return node
        return None

    def maybe_compact(self, live_nodes: Iterable[TreeNode], num_live: int) -> None:
        if self.needs_compact(num_live):
            self.rebuild(live_nodes)

    def needs_compact(self, num_live: int) -> bool:
        """Whether stale entries outgrew the live nodes (``maybe_compact`` would rebuild): a caller on a
        hot path tests this before it makes the live-node iterable."""
        return outgrew(len(self._heap), num_live)

    def rebuild(self, live_nodes: Iterable[TreeNode]) -> None:
        self.clear()
        attr = self._version_attr
        for node in live_nodes:
            if self._is_candidate(node):
                self._counter += 1
                setattr(node, attr, self._counter)
                self._heap.append((self._key(node), node.id, self._counter, node))
        heapq.heapify(self._heap)

    def clear(self) -> None:
        """Drops every entry and unqueues every node."""
        self._heap = []
        self._floor = self._counter

    def __len__(self) -> int:
        return len(self._heap)


class QueuedValue:
    """Bookkeeping a ``ComponentQueue`` keeps in each node's component value (component values subclass it)."""

    __slots__ = ("version", "queued")

    def __init__(self) -> None:
        self.version = 0  # entries with another version are stale
        self.queued = False  # the heap holds this node's current entry


class ComponentQueue:
    """Lazy LRU heap of one extra component's eviction candidates, at most one current entry per node.

    Same scheme as the Full queue: entries ``(last_access, node id, version)``; an entry whose node was
    touched since is requeued with its access time when it surfaces, so the order stays exact. A node's
    value (``node.component_data[name]``, a ``QueuedValue``) records whether its current entry is in the
    heap: pushing a node that has one costs nothing (a request's lock/unlock cycle does no heap work). A
    popped entry whose node is no longer a candidate is dropped (the next push adds it again). Entries
    hold node ids (resolved through the tree), so stale entries never keep removed nodes alive; the heap
    is rebuilt from the tree when they dominate.
    """

    tree: RadixTree  # set by the owning component's attach, before any push or pop

    def __init__(self, name: str, is_candidate: Callable[[TreeNode], bool]) -> None:
        self.name = name  # the component whose node values carry the bookkeeping
        self._is_candidate = is_candidate
        self._heap: list[tuple[int, int, int]] = []
        self._limit = 64

    def push(self, node: TreeNode) -> None:
        st = node.component_data[self.name]
        if st.queued:
            return
        st.queued = True
        st.version += 1
        heapq.heappush(self._heap, (node.last_access, node.id, st.version))
        if len(self._heap) > self._limit:
            self.rebuild(self.tree)  # stale entries dominate: O(nodes), amortised over the pushes

    def pop(self) -> TreeNode | None:
        heap, name = self._heap, self.name
        nodes = self.tree._nodes
        while heap:
            key, node_id, version = heapq.heappop(heap)
            node = nodes.get(node_id)
            if node is None:
                continue
            st = node.component_data[name]
            if version != st.version:
                continue
            if not self._is_candidate(node):
                st.queued = False
                continue
            if node.last_access != key:
                heapq.heappush(heap, (node.last_access, node_id, version))
                continue
            st.queued = False
            return node
        return None

    def maybe_compact(self, tree: RadixTree) -> None:
        if outgrew(len(self._heap), tree.num_nodes):
            self.rebuild(tree)

    def rebuild(self, tree: RadixTree) -> None:
        heap, name = [], self.name
        for node in tree.iter_nodes():
            st = node.component_data[name]
            st.queued = self._is_candidate(node)
            if st.queued:
                st.version += 1
                heap.append((node.last_access, node.id, st.version))
        heapq.heapify(heap)
        self._heap = heap
        self._limit = 2 * len(heap) + 4 * tree.num_nodes + 64  # stale entries pin removed nodes: keep few

    def clear(self) -> None:
        """Drops every entry; only for a tree being emptied (its nodes and their values go too)."""
        self._heap = []

    def __len__(self) -> int:
        return len(self._heap)
