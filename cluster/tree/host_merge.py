"""Host-tier merges and host-only nodes: the structure changes the L2 tier makes in the tree.

L1 eviction keeps victims with an L2 copy as host-only nodes and merges a demoted node into its only child
when that child is host-only too and nothing tells them apart (``_merge_host_only``; Full-only trees), and
a node whose L2 copy was just acked absorbs its parent when both are in both tiers (``merge_backed_up``):
a conversation's turns stay one node, so its next match, eviction and load-back handle one node. The
host tier (the HiCache controller, on the head) also adds host-only leaves (prefetched from L3) and
removes them (host eviction) here.
"""

from __future__ import annotations

import numpy as np

from hicache.cluster.tree.allocator import concat
from hicache.cluster.tree.node import TreeNode
from hicache.cluster.tree.structure import TreeStructure


class HostMerge(TreeStructure):
    """The host-tier structure changes of ``RadixTree``; see the module docstring."""

    def _merge_host_only(self, node: TreeNode) -> None:
        """``node`` just became host-only: when its only child is host-only too and nothing tells them
        apart (pin, transfer, priority, L3 state), the child absorbs it (``_absorb_parent``). No event:
        the tokens stay in L2.

        HiCache keeps every turn of a conversation as its own node; once a chain has left L1 it is one
        node for the load-back, lock walks and demotions that follow. An unlocked node's id may go on any
        call that evicts, as in the bare tree."""
        (child,) = node.children.values()
        # (No lock test: a demoted node is unlocked, so are its children; a host-only child has no staged
        # backup either: that needs L1 pages.)
        if (
            child.host_slots is None or child.device_pages is not None or child.host_pin or node.host_pin
            or child.pending is not None or node.pending is not None or child.priority != node.priority
            or child.stored != node.stored
        ):
            return
        self._absorb_parent(child)

    def merge_backed_up(self, node: TreeNode) -> None:
        """``node``'s L1->L2 copy was just acked (so it is in L1 and L2, with nothing in flight: the caller's
        guarantee, not tested here): when its parent is in both tiers as well, has no other child, and
        nothing tells the two apart (locks, pins, a transfer, priority, L3 state), ``node`` absorbs it
        (``_absorb_parent``; Full-only trees). No event: the tokens stay where they are, in both tiers.

        Under write-through every turn of a conversation is a new leaf below the previous one; merged as
        its copy lands, a conversation stays one node for the matches, lock walks, evictions (one victim,
        no host-only merge after) and load-backs that follow. Equal locks mean no request holds the parent
        without ``node``: every id a request holds survives. An unlocked node's id may go on a call that
        applies acks, as it may on one that evicts."""
        parent = node.parent
        if (
            parent is None or parent.parent is None or len(parent.children) != 1 or parent.lock_ref != node.lock_ref
            or parent.device_pages is None or parent.host_slots is None or parent.pending is not None
            or parent.loading or parent.host_pin or node.host_pin or parent.priority != node.priority
            or parent.stored != node.stored or self.extra_components
        ):
            return
        self._absorb_parent(node)

    def _absorb_parent(self, child: TreeNode) -> None:
        """``child`` takes its parent's tokens, L2 slots and (when in L1) L1 pages in front of its own, and
        its place in the tree; it keeps its own id (the one a request or load-back holds: the deepest). The
        parent leaves the tree. Page and slot owners do not change (both stay the tree's), nor do the L1
        token counts (the caller checked equal locks). The child's access time and hit count become the
        larger of the two (eviction keys only grow, as the queues assume)."""
        node = child.parent
        assert node is not None and node.parent is not None, f"{child} has no parent to absorb"
        parent = node.parent
        kb = node.key_bytes
        child.set_key(kb + child.key_bytes)
        assert node.host_slots is not None and child.host_slots is not None, "both must be in L2"
        child.host_slots = concat((node.host_slots, child.host_slots))
        if child.device_pages is not None:
            assert node.device_pages is not None, f"{node} not in L1 above {child}"
            child.device_pages = concat((node.device_pages, child.device_pages))
        child.parent = parent
        parent.children[kb[: self._ck]] = child
        if node.last_access > child.last_access:
            child.last_access = node.last_access
        if node.hit_count > child.hit_count:
            child.hit_count = node.hit_count
        del self._nodes[node.id]
        node.parent = None
        node.children = {}
        node.host_slots = None
        node.device_pages = None  # a queue entry left for it is dropped when it surfaces

    def add_host_only_leaf(self, parent: TreeNode, tokens: np.ndarray) -> TreeNode | None:
        """A new childless node below ``parent`` whose KV is in no tier yet (the caller gives it host
        slots at once). None if ``parent`` already has a child starting with the same page."""
        ps = self.page_size
        assert tokens.shape[0] > 0 and tokens.shape[0] % ps == 0
        kb = np.ascontiguousarray(tokens, dtype=np.int32).tobytes()
        ck = kb[: self._ck]
        if ck in parent.children:
            return None
        self._tick += 1
        leaf = self._new_node(parent, kb)
        leaf.hit_count = 1
        parent.children[ck] = leaf
        return leaf

    def remove_host_only(self, node: TreeNode) -> None:
        """Deletes a host-only leaf (host eviction); its slots must already be released by the caller."""
        parent = node.parent
        assert node.device_pages is None and parent is not None
        if node.children and self.storage_only.keep(node):  # stays as its storage-only children's ancestor
            return
        assert not node.children
        self._remove_leaf(node)
        if parent.parent is not None:
            self.full.maybe_push(parent)
