"""Window-aware SWA eviction: which cached SWA pages no hit point needs, and in what order they go.

Runs on the head, inside the replica's radix tree (the SWA component owns one ``WindowTrims`` and calls it
when its pool is short); it only reads node pages and ``swa_of``, the component frees the pages.

A match ends at a node end ``p`` (a split point becomes one) and reads the SWA KV of ``[p - window, p)``:
the end of its own node and, when that node is shorter than the window, the tails of its ancestors. So a
node's SWA pages before its last ``window`` tokens serve no hit at its end, and an ancestor's pages serve
a descendant's hit only within ``window`` tokens of that descendant's end. Hit points (node ends whose
window is live now, ``limit_match``'s rule) come in two ranks:

- primary: a leaf, a branch point (several children), or a node whose one child does not go on in L1
  (a tombstoned leaf, an L2- or L3-only node, a load in flight): where a conversation continues, branches
  or, its deeper windows gone, can still be served from. A
  child outside L1 also counts as a hit point at its own end (an L2 hit there reads the tail of the L1
  node above it when it is shorter than the window), whatever its host tail;
- secondary: a node with one L1 child that goes on (live SWA pages or children of its own): a past
  turn's end inside a chain (a hit there means going back and branching, rarer than continuing).

A node's *keeps* are the pages at its end that the hit points of each rank read (its own end and its
descendants' ends within reach: a bounded walk, ``keeps``). Eviction frees, in LRU order of the nodes,
phase 1: pages no hit point reads (heads of long nodes, tails whose hit points went); phase 2: pages only
secondary hit points read; the component then tombstones whole tails in LRU order (the last hit points
go). Live pages stay a suffix of every node (a trim frees a node's head), so the match rule and the L2
host tails read trimmed nodes as they read trimmed requests' nodes. Nodes a lock covers, nodes being
loaded and nodes with a D->H copy queued keep all their pages (the copy reads them).

Candidates are kept incrementally: the component marks the nodes whose keeps may have dropped (the
structure hooks, unlocks, tombstones, trims, removals), and ``pop`` computes the keeps of marked nodes
only, so an eviction costs the nodes near what changed, not the tree.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import numpy as np

from hicache.cluster.tree.allocator import count_true
from hicache.cluster.tree.node import TreeNode

if TYPE_CHECKING:
    from hicache.cluster.tree.swa import SWAComponent

NO_NEED = -(1 << 62)  # "no hit point reads any of this node" (below any real need)


class WindowTrims:
    """The trim candidates of one SWA component: marked nodes, and a lazy heap of
    ``(phase, last_access, node id)`` whose current entry per node ``keys`` records."""

    def __init__(self, swa: SWAComponent) -> None:
        self.swa = swa
        self.marked: set[int] = set()  # node ids whose keeps may have dropped since they were computed
        self.deferred: set[int] = set()  # nodes skipped while their D->H copy was queued (no hook clears it)
        self.locked: set[int] = set()  # nodes skipped while a lock covered them (their unlock marks them)
        self.keys: dict[int, tuple[int, int, int]] = {}
        self.heap: list[tuple[int, int, int]] = []

    def clear(self) -> None:
        self.marked.clear()
        self.deferred.clear()
        self.locked.clear()
        self.keys.clear()
        self.heap = []

    # -- marking (cheap: the component calls these on its hooks) --------------------------------------
    def mark(self, node: TreeNode) -> None:
        self.marked.add(node.id)

    def unlocked(self, node: TreeNode) -> None:
        """The last lock covering ``node`` went: mark it if a trim skipped it for the lock."""
        locked = self.locked
        if locked and node.id in locked:
            locked.discard(node.id)
            self.marked.add(node.id)

    def forget(self, node: TreeNode) -> None:
        """``node`` leaves the tree: drop its entries, mark the ancestors its hits read."""
        node_id = node.id
        self.marked.discard(node_id)
        self.deferred.discard(node_id)
        self.locked.discard(node_id)
        self.keys.pop(node_id, None)
        parent = node.parent
        if parent is not None and parent.parent is not None:
            self.mark_up(parent)

    def mark_up(self, node: TreeNode) -> None:
        """``node`` and the ancestors a hit at or below it could read (within the window above its start)."""
        self.marked.add(node.id)
        w, d = self.swa.window, 0
        n = node.parent
        while n is not None and n.parent is not None and d < w:
            self.marked.add(n.id)
            d += n.num_tokens
            n = n.parent

    def mark_down(self, node: TreeNode) -> None:
        """The descendants whose window could reach ``node`` (ends within the window below its end)."""
        w = self.swa.window
        stack = [(c, c.num_tokens) for c in node.children.values()]
        while stack:
            c, d = stack.pop()
            self.marked.add(c.id)
            if d < w:
                stack.extend((g, d + g.num_tokens) for g in c.children.values())

    # -- keeps ---------------------------------------------------------------------------------------
    def _live_pages(self, pages: np.ndarray) -> int:
        swa_of = self.swa.mapped.swa_of
        if swa_of.item(pages.item(0)) >= 0:
            return int(pages.shape[0])
        if swa_of.item(pages.item(-1)) < 0:
            return 0
        return int(count_true(swa_of[pages] >= 0))

    def is_primary(self, node: TreeNode) -> bool:
        """Whether ``node``'s end is a primary hit point (see the module docstring): not one L1 child that
        goes on (has live SWA pages, or children: a trim that freed the child's pages whole leaves its
        parent's rank as it was, so trims in any order free the same pages)."""
        kids = node.children
        if len(kids) != 1:
            return True
        (child,) = kids.values()
        pages = child.device_pages
        if pages is None or child.loading:
            return True
        return not child.children and self.swa.mapped.swa_of.item(pages.item(-1)) < 0

    def _run_above(self, node: TreeNode) -> tuple[int, bool]:
        """(live SWA tokens ending at ``node``'s end, capped at the window; live back to the root)."""
        w, ps = self.swa.window, self.swa.page_size
        total, n = 0, node
        while n.parent is not None:
            pages = n.device_pages
            assert pages is not None  # an L1 node's ancestors are in L1
            t = self._live_pages(pages)
            if t < pages.shape[0]:
                return min(total + t * ps, w), False
            total += n.num_tokens
            if total >= w:
                return w, False
            n = n.parent
        return total, True

    def keeps(self, node: TreeNode) -> tuple[int, int, int]:
        """(live pages, pages hit points of any rank read, pages primary hit points read) of an L1 node."""
        pages = node.device_pages
        assert pages is not None, f"{node} is not in L1"
        w, ps = self.swa.window, self.swa.page_size
        swa_of = self.swa.mapped.swa_of
        live = self._live_pages(pages)
        if not live:
            return 0, 0, 0
        run, from_root = self._run_above(node)
        need_all = need_primary = NO_NEED
        if live and (run >= w or from_root):
            need_all = w
            if self.is_primary(node):
                need_primary = w
        if need_primary < w:  # hit points below may read more of it
            stack = [(c, 0) for c in node.children.values()]
            while stack:
                c, above = stack.pop()
                d = above + c.num_tokens  # from ``node``'s end to ``c``'s end
                cp = c.device_pages
                if cp is None or c.loading:  # an L2/L3 hit at its end, a load in flight: may read up to here
                    need_all = max(need_all, w - d)
                    need_primary = max(need_primary, w - d)
                    continue
                if swa_of.item(cp.item(0)) < 0:
                    continue  # a dead head between: no window through it is live
                if run + d >= w or from_root:
                    need_all = max(need_all, w - d)
                    if self.is_primary(c):
                        need_primary = max(need_primary, w - d)
                if d < w:
                    stack.extend((g, d) for g in c.children.values())
        n = pages.shape[0]
        keep_all = min(n, -(-need_all // ps)) if need_all > 0 else 0
        keep_primary = min(n, -(-need_primary // ps)) if need_primary > 0 else 0
        return live, keep_all, keep_primary

    def trim_of(self, node: TreeNode) -> tuple[int, int] | None:
        """(phase, pages to keep) of ``node``'s next trim, or None (nothing to free, or it must stay whole)."""
        if node.parent is None or node.device_pages is None or node.loading:
            return None  # (a load's commit marks it again)
        if self.swa._state(node).lock:
            self.locked.add(node.id)
            return None
        if node.staged_slots is not None:
            self.deferred.add(node.id)
            return None
        live, keep_all, keep_primary = self.keeps(node)
        if live > keep_all:
            return 1, keep_all
        if live > keep_primary:
            return 2, keep_primary
        return None

    # -- candidates ------------------------------------------------------------------------------------
    def _refresh(self) -> None:
        """Computes the trims of the marked (and deferred) nodes into the heap."""
        if self.deferred:
            self.marked |= self.deferred
            self.deferred = set()
        if not self.marked:
            return
        nodes = self.swa.tree._nodes
        keys, heap = self.keys, self.heap
        for node_id in self.marked:
            node = nodes.get(node_id)
            trim = self.trim_of(node) if node is not None else None
            if node is None or trim is None:
                keys.pop(node_id, None)
                continue
            key = (trim[0], node.last_access, node_id)
            if keys.get(node_id) != key:
                keys[node_id] = key
                heapq.heappush(heap, key)
        self.marked = set()
        if len(heap) > 4 * len(keys) + 64:  # stale entries dominate
            self.heap = heap = sorted(keys.values())

    def pop(self, with_secondary: bool) -> tuple[TreeNode, int, int] | None:
        """(node, phase, pages to keep) of the best trim now (phase 1 first, LRU within a phase; phase 2 only
        ``with_secondary``), checked against the node's current keeps; None when there is none."""
        self._refresh()
        heap, keys = self.heap, self.keys
        nodes = self.swa.tree._nodes
        while heap:
            key = heap[0]
            if not with_secondary and key[0] == 2:
                return None
            heapq.heappop(heap)
            node_id = key[2]
            if keys.get(node_id) != key:
                continue  # superseded
            del keys[node_id]
            node = nodes.get(node_id)
            trim = self.trim_of(node) if node is not None else None
            if node is None or trim is None:
                continue
            current = (trim[0], node.last_access, node_id)
            if current != key:  # touched, or its phase changed, since it was queued: requeue in its place
                keys[node_id] = current
                heapq.heappush(heap, current)
                continue
            return node, trim[0], trim[1]
        return None

    def scan(self) -> list[tuple[TreeNode, int, int, int]]:
        """(node, live pages, keep of phase 1, keep of phase 2) of every trimmable L1 node (O(nodes); for
        checks and tests)."""
        out = []
        for node in self.swa.tree.iter_nodes():
            if node.device_pages is None or node.loading or node.staged_slots is not None or self.swa._state(node).lock:
                continue
            live, keep_all, keep_primary = self.keeps(node)
            if live > keep_primary:
                out.append((node, live, keep_all, keep_primary))
        return out
