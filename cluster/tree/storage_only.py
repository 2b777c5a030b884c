"""Storage-only tree entries: prefixes known to be in L3 with no L1 pages and no L2 slots (warm restart).

Owned by the radix tree of one replica (the head). A storage-only node has ``device_pages is None``,
``host_slots is None`` (no staged slots either) and ``stored`` set; every descendant of one is
storage-only too (they sit below all L1/L2 nodes of their path). They come from the L3 manifest when a
storage backend is attached (``add_path``), and from a node that loses its last L1/L2 copy while it
still has storage-only children (it stays, as their storage-only ancestor, when it is ``stored``).

They never produce device or host hits: a match reports them only as ``storage_hit_len`` (tokens past
the host hit known to be in L3). A prefetch turns them into host-only nodes (``adopt``); an insert of
computed KV revives them like L1-evicted nodes; a failed read drops them (``drop_path``). They count
against their own token cap (``cap_tokens``) with LRU eviction at storage-only leaves, and never block
L1 or L2 eviction (those look only at children with device pages / host slots).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import numpy as np

from hicache.cluster.tree.node import TreeNode

if TYPE_CHECKING:
    from hicache.cluster.tree.radix import RadixTree


def is_storage_only(node: TreeNode) -> bool:
    return node.parent is not None and node.device_pages is None and node.host_slots is None


class StorageOnlyEntries:
    def __init__(self, tree: RadixTree) -> None:
        self.tree = tree
        self.cap_tokens = 0  # set by the storage tier on attach (0: no storage-only entries)
        self.tokens = 0  # tokens held by storage-only nodes
        self.evicted_tokens = 0  # removed by the cap (LRU)
        self.dropped_tokens = 0  # removed because a read of them failed, or L3 was detached

    def reset(self) -> None:
        """The tree was emptied (the cap stays: it belongs to the attached storage)."""
        self.tokens = 0

    # -- creation ------------------------------------------------------------------------------------
    def add_path(self, root: TreeNode, tokens: np.ndarray, keys: tuple[str, ...] = ()) -> int:
        """Covers ``tokens`` (page-aligned, from ``root``) with tree nodes: what the tree lacks becomes one
        storage-only leaf, cut to the cap's room. ``keys``: the pages' L3 chain keys, if known. Returns the
        tokens added (existing nodes on the path are left as they are)."""
        tree = self.tree
        ps = tree.page_size
        end = tokens.shape[0] - tokens.shape[0] % ps
        tb = np.ascontiguousarray(tokens[:end], dtype=np.int32).tobytes()
        path, partial = tree._walk(root, tb, 0, end)
        pos = sum(n.num_tokens for n in path[:-1]) + (partial or (path[-1].num_tokens if path else 0))
        room = self.cap_tokens - self.tokens
        n = min(end - pos, room - room % ps)
        if n <= 0:
            return 0
        if partial:
            path[-1] = tree._split(path[-1], partial)
        parent = path[-1] if path else root
        tree._tick += 1
        leaf = tree._new_node(parent, tb[4 * pos : 4 * (pos + n)])
        leaf.stored = True
        if keys:
            leaf.chain_key = keys[(pos + n) // ps - 1]
        parent.children[leaf.key_bytes[: tree._ck]] = leaf
        self.tokens += n
        return n

    def keep(self, node: TreeNode) -> bool:
        """``node`` (with children, all storage-only) just lost its last L1/L2 copy. A stored node stays as
        a storage-only node (True); otherwise its storage-only subtree is dropped and the caller removes
        the node as the leaf it now is (False). Children that are not storage-only: left as they are (True)."""
        if not all(is_storage_only(child) for child in node.children.values()):
            return True
        if node.stored:
            self.tokens += node.num_tokens
            self.trim()
            return True
        for child in list(node.children.values()):
            self.dropped_tokens += self._remove_subtree(child)
        return False

    # -- match and prefetch --------------------------------------------------------------------------
    @staticmethod
    def hit_len(path: list[TreeNode], hit_tokens: int) -> int:
        """Tokens of the storage-only suffix of a matched ``path``, when it starts right at ``hit_tokens``."""
        i, stored = len(path), 0
        while i and is_storage_only(path[i - 1]):
            i -= 1
            stored += path[i].num_tokens
        before = 0
        for node in path[:i]:
            before += node.num_tokens
        return stored if before == hit_tokens else 0

    def known_tokens(self, anchor: TreeNode, tokens: np.ndarray) -> int:
        """Leading tokens of ``tokens`` (page-aligned, below ``anchor``) covered by storage-only nodes."""
        end = tokens.shape[0] - tokens.shape[0] % self.tree.page_size
        if not end or not anchor.children:
            return 0
        path, partial = self.tree._walk(anchor, np.ascontiguousarray(tokens[:end], np.int32).tobytes(), 0, end)
        known = 0
        for i, node in enumerate(path):
            if not is_storage_only(node):
                break
            known += partial if (partial and i == len(path) - 1) else node.num_tokens
        return known

    def adopt(self, anchor: TreeNode, tokens: np.ndarray) -> list[TreeNode] | None:
        """Nodes covering ``tokens`` (page-aligned) below ``anchor`` for fetched L2 pages, root first: the
        storage-only nodes on the way (split to fit; they stop being counted here) and a new leaf for the
        rest. The caller gives them host slots at once. None when the way meets a node with L1 or L2 KV
        (the fetched pages are redundant)."""
        tree = self.tree
        end = tokens.shape[0]
        tb = np.ascontiguousarray(tokens, dtype=np.int32).tobytes()
        path, partial = tree._walk(anchor, tb, 0, end)
        for node in path:
            if not is_storage_only(node) or node.staged_slots is not None or node.pending is not None:
                return None
        if partial:
            path[-1] = tree._split(path[-1], partial)
        pos = 0
        for node in path:
            pos += node.num_tokens
        self.tokens -= pos
        tree._tick += 1
        if pos < end:
            parent = path[-1] if path else anchor
            leaf = tree._new_node(parent, tb[4 * pos :])
            leaf.hit_count = 1
            parent.children[leaf.key_bytes[: tree._ck]] = leaf
            path.append(leaf)
        return path

    def fetch_anchor(self, anchor: TreeNode, tokens: np.ndarray, depth: int) -> tuple[TreeNode, int]:
        """Where an L3 fetch of ``tokens`` (page-aligned; ``anchor`` ends at ``depth`` of them) may hang its
        pages in a hybrid tree: the deepest node with Full KV along them, split at the page where they leave
        it (a match a component cut short, e.g. at the last Mamba state in L1, leaves Full nodes below the
        anchor, which a fetch must not cover again). Returns (node, its depth). Nodes in flight are not split."""
        ps = self.tree.page_size
        end = tokens.shape[0] - tokens.shape[0] % ps
        if end <= depth or not anchor.children:
            return anchor, depth
        tb = np.ascontiguousarray(tokens[:end], dtype=np.int32).tobytes()
        path, partial = self.tree._walk(anchor, tb, depth, end)
        for i, node in enumerate(path):
            if is_storage_only(node):  # (in L3 only: a fetch covers it; the fetch hangs above it)
                path, partial = path[:i], 0
                break
        partial -= partial % ps
        if path and (partial or sum(n.num_tokens for n in path) + depth > end):
            last = path.pop()
            if partial and last.pending is None and not last.loading:
                path.append(self.tree._split(last, partial))
        if not path:
            return anchor, depth
        return path[-1], depth + sum(n.num_tokens for n in path)

    def drop_path(self, anchor: TreeNode, tokens: np.ndarray) -> int:
        """A read of ``tokens`` below ``anchor`` failed: drops the storage-only nodes on that way (with
        their subtrees). Returns the tokens dropped."""
        end = tokens.shape[0] - tokens.shape[0] % self.tree.page_size
        if not end or not anchor.children:
            return 0
        path, _ = self.tree._walk(anchor, np.ascontiguousarray(tokens[:end], np.int32).tobytes(), 0, end)
        for node in path:
            if is_storage_only(node):
                dropped = self._remove_subtree(node)
                self.dropped_tokens += dropped
                return dropped
        return 0

    # -- bounds --------------------------------------------------------------------------------------
    def trim(self) -> int:
        """Evicts storage-only leaves (LRU) until the entries fit the cap; returns tokens evicted."""
        if self.tokens <= self.cap_tokens:
            return 0
        heap = [(n.last_access, n.id, n) for n in self.tree.iter_nodes() if self._evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while self.tokens > self.cap_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if node.parent is None or not self._evictable(node):
                continue
            parent = node.parent
            freed += self._remove(node)
            if self._evictable(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        self.evicted_tokens += freed
        return freed

    def drop_all(self) -> int:
        """Removes every storage-only node (L3 detached); returns tokens dropped."""
        tops = [n for n in self.tree.iter_nodes() if is_storage_only(n) and not (n.parent is not None and is_storage_only(n.parent))]
        dropped = sum(self._remove_subtree(n) for n in tops)
        self.dropped_tokens += dropped
        return dropped

    @staticmethod
    def _evictable(node: TreeNode) -> bool:
        return (is_storage_only(node) and not node.children and not node.lock_ref and not node.host_pin
                and node.pending is None and node.staged_slots is None)

    def _remove(self, node: TreeNode) -> int:
        n = node.num_tokens
        self.tree._remove_leaf(node)
        self.tokens -= n
        return n

    def _remove_subtree(self, top: TreeNode) -> int:
        """Removes ``top`` (storage-only) and its descendants (all storage-only), deepest first."""
        order, stack = [], [top]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        return sum(self._remove(node) for node in reversed(order))

    # -- checks --------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        total = 0
        for node in self.tree.iter_nodes():
            if not is_storage_only(node):
                continue
            total += node.num_tokens
            assert node.stored, f"{node}: storage-only but not stored"
            assert node.staged_slots is None and not node.loading, f"{node}: storage-only with a transfer"
            for child in node.children.values():
                assert is_storage_only(child), f"{child}: has L1/L2 KV below storage-only {node}"
        assert total == self.tokens, f"storage-only tokens {self.tokens} != counted {total}"
        assert total <= self.cap_tokens or not total, f"storage-only tokens {total} over cap {self.cap_tokens}"
