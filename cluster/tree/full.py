"""Full-attention KV component: L1 page values of nodes, their allocator, locks and eviction order.

Owned by the head. Every L1 page is owned exactly once: by the allocator's free stack, by a running
request (``alloc``), or by exactly one tree node (``node.device_pages``). ``evictable_tokens`` counts
tree tokens in L1 with no lock, ``protected_tokens`` the locked ones; their sum is the tree's L1 usage.

HiCache hooks (see ``component.py``; the controller drives the same moves itself today, this is the
per-component statement of them). Host copies form a contiguous chain from the root, so Full moves one KV
transfer along a chain: BACKUP of a node covers it and every ancestor without an L2 copy (root first);
LOAD_BACK covers it and every ancestor the controller is loading (``node.loading``: device pages already
attached). Host eviction drops Full copies at host leaves (no child with an L2 copy or staged backup, no
pin, nothing pending) in LRU order; a host-only victim leaves the tree, which may make its parent a leaf.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import numpy as np

from hicache.cluster.tree.allocator import PageAllocator, PageOwner, concat
from hicache.cluster.tree.component import ComponentTransfer, HiCachePhase, HostEvictionTracker, TreeComponent
from hicache.cluster.tree.eviction import EvictionPolicy, EvictionQueue
from hicache.cluster.tree.node import TreeNode
from hicache.cluster.tree.params import InsertParams


class FullComponent(TreeComponent):
    name = "full"

    def __init__(self, capacity_pages: int | None, policy: EvictionPolicy) -> None:
        self.allocator = PageAllocator(capacity_pages)
        self.queue = EvictionQueue(policy, self.is_evictable)
        # maybe_push(node): queues ``node`` if it is an L1 candidate now (a node already queued is not
        # tested again). The queue's bound method itself: no extra frame on this hot call.
        self.maybe_push = self.queue.offer
        self.evictable_tokens = 0
        self.protected_tokens = 0
        # A finishing request's locked node while its insert runs (``RadixTree.cache_finished_req``): a lock
        # taken then whose path passes through it takes the request's lock over (``lock``).
        self.handoff: TreeNode | None = None

    @staticmethod
    def is_evictable(node: TreeNode) -> bool:
        """Unlocked, alive, in L1, and no child in L1 (eviction goes leaf-first). Roots hold a lock for
        life, and a removed node has no pages (``on_remove``): neither needs its own test."""
        if node.lock_ref or node.device_pages is None:
            return False
        for child in node.children.values():
            if child.device_pages is not None:
                return False
        return True

    # -- structure hooks ---------------------------------------------------------------------------
    def validate_insert(self, params: InsertParams, new_page_ranges: list[tuple[int, int]]) -> None:
        self.check_new_pages(params.device_pages, new_page_ranges)

    def check_new_pages(self, pages: np.ndarray, new_page_ranges: list[tuple[int, int]]) -> None:
        """The pages an insert would take (``pages[s:e]`` per range) must be the caller's own."""
        if not new_page_ranges:
            return
        taken = pages[new_page_ranges[0][0] : new_page_ranges[0][1]] if len(new_page_ranges) == 1 else (
            np.concatenate([pages[s:e] for s, e in new_page_ranges])
        )
        self.allocator.check(taken, PageOwner.REQUEST, "insert device_pages")

    def take_pages(
        self, node: TreeNode, pages: np.ndarray, page_start: int, page_end: int, checked: np.ndarray | None,
        base: int,
    ) -> None:
        """The node takes ``pages[page_start:page_end]``; ``checked`` is the ``intp`` index of
        ``pages[base:]`` when the caller has one (saves a cast), else None."""
        idx = None if checked is None else checked[page_start - base : page_end - base]
        self.attach_pages(node, pages[page_start:page_end].copy(), idx)

    def attach_pages(self, node: TreeNode, pages: np.ndarray, index: np.ndarray | None = None) -> None:
        """Gives an L1-evicted (or new) node request-held pages (``index``: the same ids as ``intp``)."""
        n = node.num_tokens
        assert node.device_pages is None and pages.shape[0] * self.tree.page_size == n
        self.allocator.transfer(pages, PageOwner.TREE, index)
        node.device_pages = pages
        if node.lock_ref:
            self.protected_tokens += n
        else:
            self.evictable_tokens += n

    def attach_loading_chain(self, chain: list[TreeNode], pages: np.ndarray) -> np.ndarray:
        """A load-back starts: the host-only ``chain`` (root first; the caller locked its deepest node, so
        the whole path) takes ``pages`` in order and is marked ``loading`` until the controller applies the
        ack. The pages were allocated straight to the tree (``allocator.alloc(n, TREE)``: no allocator update
        here); each node's pages are a slice of ``pages`` (node page arrays are never written in place).
        Returns the chain's host ids in the same order (the load's source: ``pages[i]`` gets the KV of slot
        ``i``)."""
        ps = self.tree.page_size
        if len(chain) == 1:
            node = chain[0]
            assert node.device_pages is None and node.lock_ref and len(pages) * ps == node.num_tokens
            node.device_pages = pages
            node.loading = True
            slots = node.host_slots
            assert slots is not None, f"{node} has no L2 copy to load"
        else:
            start = 0
            parts = []
            for node in chain:
                end = start + node.num_tokens // ps
                node.device_pages = pages[start:end]
                node.loading = True
                assert node.host_slots is not None, f"{node} has no L2 copy to load"
                parts.append(node.host_slots)
                start = end
            assert start == len(pages), f"{len(pages)} pages for a chain of {start}"
            slots = concat(parts)
        self.protected_tokens += len(pages) * ps
        return slots

    def on_create(self, node: TreeNode, params: InsertParams, page_start: int, page_end: int) -> None:
        self.attach_pages(node, params.device_pages[page_start:page_end].copy())

    def on_revive(self, node: TreeNode, params: InsertParams, page_start: int, page_end: int) -> None:
        self.attach_pages(node, params.device_pages[page_start:page_end].copy())

    def on_split(self, prefix: TreeNode, suffix: TreeNode) -> None:
        if suffix.device_pages is not None:
            k = prefix.num_tokens // self.tree.page_size
            prefix.device_pages = suffix.device_pages[:k].copy()
            suffix.device_pages = suffix.device_pages[k:].copy()

    def on_remove(self, node: TreeNode) -> None:
        if node.device_pages is not None:
            self.drop_device(node)

    def drop_device(self, node: TreeNode) -> int:
        """Frees the node's L1 pages; returns the tokens freed. The node itself stays (caller decides)."""
        n = node.num_tokens
        assert node.device_pages is not None, f"{node} is not in L1"
        self.allocator.release(node.device_pages)
        node.device_pages = None
        if node.lock_ref:
            self.protected_tokens -= n
        else:
            self.evictable_tokens -= n
        return n

    # -- locks -----------------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> int:
        """Locks the path root..node; returns the change in evictable tokens (<= 0).

        Counts never grow towards the leaves (``parent.lock_ref >= child.lock_ref``), so above the first
        node that was locked already every count only goes up by one: no accounting there.

        While a finishing request hands over its lock on ``self.handoff``, a walk that reaches that node
        stops there and consumes the handoff (the request's lock on root..handoff becomes this one; the
        request skips its unlock), so the shared prefix is walked by neither."""
        delta = 0
        held = self.handoff
        if held is not None:
            while node.parent is not None:
                if node is held:
                    self.handoff = None
                    break
                ref = node.lock_ref
                node.lock_ref = ref + 1
                if not ref and node.device_pages is not None:
                    delta -= node.num_tokens
                node = node.parent
        else:
            parent = node.parent
            while parent is not None:
                ref = node.lock_ref
                node.lock_ref = ref + 1
                if ref:
                    node = parent
                    parent = node.parent
                    while parent is not None:
                        node.lock_ref += 1
                        node = parent
                        parent = node.parent
                    break
                if node.device_pages is not None:
                    delta -= node.num_tokens
                node = parent
                parent = node.parent
        if delta:
            self.evictable_tokens += delta
            self.protected_tokens -= delta
        return delta

    def unlock(self, node: TreeNode) -> int:
        """Unlocks the path root..node (caller checked lock_ref > 0); returns the evictable change.

        Above the first node that stays locked every count stays >= 1: no accounting there."""
        delta = 0
        leaf = node
        parent = node.parent
        while parent is not None:
            ref = node.lock_ref - 1
            node.lock_ref = ref
            if ref:
                node = parent
                parent = node.parent
                while parent is not None:
                    node.lock_ref -= 1
                    node = parent
                    parent = node.parent
                break
            if node.device_pages is not None:
                delta += node.num_tokens
            node = parent
            parent = node.parent
        if delta:
            self.evictable_tokens += delta
            self.protected_tokens -= delta
        if not leaf.lock_ref:
            self.maybe_push(leaf)
        return delta

    # -- HiCache -----------------------------------------------------------------------------------
    @staticmethod
    def backup_chain(node: TreeNode) -> tuple[list[TreeNode], TreeNode | None]:
        """``node`` and its ancestors without an L2 copy, root first (backups stay a contiguous chain from
        the root), and the node that blocks copying them now (a backup in flight, no device KV, loading) or
        None. The one definition of the rule: the controller's backups and ``build_hicache_transfers``."""
        chain = []
        while node.parent is not None and node.host_slots is None:
            if node.staged_slots is not None or node.device_pages is None or node.loading:
                return [], node
            chain.append(node)
            node = node.parent
        chain.reverse()
        return chain, None

    @staticmethod
    def _loading_chain(node: TreeNode) -> list[TreeNode]:
        chain = []
        while node.parent is not None and node.loading:
            chain.append(node)
            node = node.parent
        chain.reverse()
        return chain

    def build_hicache_transfers(self, node: TreeNode, phase: HiCachePhase) -> tuple[ComponentTransfer, ...]:
        if not isinstance(phase, HiCachePhase):
            raise TypeError(f"phase must be a HiCachePhase, got {phase!r}")
        if phase is HiCachePhase.BACKUP:
            chain, _ = self.backup_chain(node)
            if not chain:
                return ()
            src = np.concatenate([n.device_pages for n in chain])
            return (ComponentTransfer(self.name, phase, node.id, src, None, sum(n.num_tokens for n in chain)),)
        chain = self._loading_chain(node)
        if not chain:
            return ()
        missing = [n.id for n in chain if n.host_slots is None]
        if missing:
            raise ValueError(f"load-back chain of node {node.id}: nodes {missing} have no host copy")
        src = np.concatenate([n.host_slots for n in chain])
        dst = np.concatenate([n.device_pages for n in chain])
        return (ComponentTransfer(self.name, phase, node.id, src, dst, sum(n.num_tokens for n in chain)),)

    def commit_hicache_transfer(
        self, node: TreeNode, phase: HiCachePhase, transfers: Sequence[ComponentTransfer], ok: bool = True
    ) -> None:
        """BACKUP ok: the chain's nodes take their host ids (split by node). LOAD_BACK: the KV landed in
        the pages the controller attached; nothing to record here (the controller clears ``loading``).
        ``ok=False``: Full reserved nothing in ``build``, so nothing changes."""
        for t in transfers:
            if t.component != self.name or t.phase is not phase:
                raise ValueError(f"transfer for {t.component}/{t.phase.value} given to full/{phase.value}")
            if t.node_id != node.id:
                raise ValueError(f"transfer for node {t.node_id} given to the commit of node {node.id}")
            if ok and t.dst is None:
                raise ValueError(f"full transfer for node {t.node_id} has no destination ids")
        if not ok or phase is HiCachePhase.LOAD_BACK:
            return
        for t in transfers:
            assert t.dst is not None  # checked above
            dst = np.asarray(t.dst, dtype=np.int32)
            # Walk up by pages, not by the build-time chain: a split in between leaves the same pages.
            chain: list[tuple[TreeNode, int]] = []  # (node, its page count), deepest first
            pages, n = 0, node
            while n.parent is not None and n.host_slots is None and pages < dst.shape[0]:
                if n.device_pages is None:
                    break
                chain.append((n, n.device_pages.shape[0]))
                pages += n.device_pages.shape[0]
                n = n.parent
            if pages != dst.shape[0]:
                raise ValueError(f"full backup of node {node.id}: {dst.shape[0]} host ids for a chain of {pages} pages")
            end = pages
            for c, k in chain:
                c.host_slots = dst[end - k : end].copy()
                end -= k

    @staticmethod
    def is_host_leaf(node: TreeNode) -> bool:
        if node.parent is None or node.host_slots is None or node.host_pin or node.pending is not None:
            return False
        for child in node.children.values():
            if child.host_slots is not None or child.staged_slots is not None:
                return False
        return True

    def drive_host_eviction(self, num_tokens: int, tracker: HostEvictionTracker) -> int:
        if not isinstance(num_tokens, (int, np.integer)) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        tree = self.tree
        heap = [(n.last_access, n.id, n) for n in tree.iter_nodes() if self.is_host_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if node.parent is None or not self.is_host_leaf(node) or tracker.pinned(node.id):
                continue
            assert node.host_slots is not None  # is_host_leaf
            tracker.release(self.name, node.id, node.host_slots, node.num_tokens)
            node.host_slots = None
            freed += node.num_tokens
            if tree.listener is not None:
                tree.listener.on_removed(node, "host")
            parent = node.parent
            if node.device_pages is None:
                tree.remove_host_only(node)
            if self.is_host_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    # -- checks ----------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        alloc = self.allocator
        tree_pages = [n.device_pages for n in self.tree.iter_nodes() if n.device_pages is not None]
        owned = np.concatenate(tree_pages) if tree_pages else np.empty(0, np.int32)
        assert np.unique(owned).size == owned.size, "an L1 page is referenced by two nodes"
        assert owned.size == alloc.count(PageOwner.TREE), "tree pages disagree with the allocator"
        assert np.all(alloc.owners(owned) == PageOwner.TREE), "a node references a non-TREE page"
        ps = self.tree.page_size
        assert (self.evictable_tokens + self.protected_tokens) == owned.size * ps, "token accounting drifted"
        locked = sum(n.num_tokens for n in self.tree.iter_nodes() if n.lock_ref and n.device_pages is not None)
        assert locked == self.protected_tokens, f"protected {self.protected_tokens} != locked {locked}"
        assert alloc.num_free == alloc.count(PageOwner.FREE), "free stack disagrees with owners"

    def stats(self) -> dict[str, Any]:
        return {
            "evictable_tokens": self.evictable_tokens,
            "protected_tokens": self.protected_tokens,
            "free_pages": self.allocator.num_free,
            "capacity_pages": self.allocator.capacity,
        }

    def reset(self) -> None:
        self.allocator.reset()
        self.queue.clear()
        self.handoff = None
        self.evictable_tokens = 0
        self.protected_tokens = 0
