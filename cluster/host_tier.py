"""L2 bookkeeping on the head: which host slots hold which node's pages, and host eviction.

The head decides; workers only store. Every L2 slot is in one state: FREE, reserved for an in-flight
backup (REQUEST state of the allocator, referenced by ``node.staged_slots``), or holding a committed copy
(TREE state, ``node.host_slots``). Backups take their slots from a block reserved in bulk (REQUEST state
too, referenced by nobody until handed out; ``take``): one slice per backup instead of an allocator call
(three numpy operations) each. The block only ever holds slots that were free, and goes back to the free
stack before any host eviction (``reserve``), so it never evicts a copy nor hides a slot from a prefetch. Host eviction takes host leaves in LRU order: nodes with an L2 copy,
no pin, no transfer in flight, and no child with an L2 copy (backups stay a contiguous chain from the
root). A host-only victim leaves the tree; a device+host victim just loses its L2 copy.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from hicache.cluster.events import EVENT_CODES, EVENT_ID_SHIFT, EVENT_TOKENS_SHIFT, EventKind, Tier
from hicache.cluster.tree import FullComponent, PageAllocator, PageOwner, RadixTree, TreeNode
from hicache.cluster.tree.allocator import concat
from hicache.cluster.tree.eviction import EvictionPolicy, EvictionQueue

_HOST = Tier.HOST.value
_HOST_STORED = EVENT_CODES[EventKind.STORED, Tier.HOST]
_BLOCK_SLOTS = 1024  # slots reserved per refill of the backups' block (one reservation for many backups)
_NO_SLOTS = np.empty(0, np.int32)
_NO_SLOTS.setflags(write=False)


class HostTier:
    """``events``: the controller's event log (packed ints, events.py); a committed L2 copy is logged there
    directly (no listener call per node on the backup path); a dropped one goes through ``tree.listener``
    (the controller also records why it left, for miss reasons)."""

    def __init__(self, tree: RadixTree, num_slots: int, events: deque[int],
                 policy: EvictionPolicy = EvictionPolicy.LRU) -> None:
        self.tree = tree
        self._events = events
        self.slots = PageAllocator(num_slots)
        # Host leaves in LRU order. Built from the tree on the first eviction (until L2 runs short nobody
        # pops, so pushing every new host leaf would be wasted work); kept up to date from then on.
        self.queue = EvictionQueue(policy, self.is_evictable, version_attr="host_heap_version")
        self._queue_live = False
        # maybe_push(node): offers ``node`` to the queue once it is live; until then ``id``, a builtin that
        # takes one argument and does nothing here (no Python frame on the calls of every request).
        self.maybe_push: Callable[[TreeNode], object] = id
        self.host_tokens = 0  # tokens with a committed L2 copy
        self.evicted_tokens = 0
        # Slots reserved in bulk for backups: ``_block[_block_pos:]`` are not handed out yet.
        self._block: np.ndarray = _NO_SLOTS
        self._block_pos = 0
        self._block_len = 0

    # The host-leaf rule is the Full component's (one definition for the tree's hooks and this tier).
    is_evictable = staticmethod(FullComponent.is_host_leaf)

    def clear_queue(self) -> None:
        """Forgets every candidate (all L2 copies were dropped); the queue stays live."""
        self.queue.clear()

    @property
    def num_slots(self) -> int:
        return self.slots.capacity

    @property
    def num_free(self) -> int:
        """Slots no copy holds or waits for: the free stack and the unused part of the reserved block."""
        return self.slots.num_free + self._block_len - self._block_pos

    def take(self, num_slots: int) -> np.ndarray | None:
        """Slots for a backup from the reserved block (refilled in bulk from free slots only; never evicts):
        a read-only slice of it, or None when the free slots cannot cover ``num_slots`` (then ``reserve``)."""
        pos = self._block_pos
        end = pos + num_slots
        if end > self._block_len:
            slots = self.slots
            self.return_block()
            refill = min(_BLOCK_SLOTS, slots.num_free)
            if refill < num_slots:
                return None
            self._block = slots.alloc(refill)
            self._block.setflags(write=False)
            self._block_len = refill
            pos, end = 0, num_slots
        self._block_pos = end
        return self._block[pos:end]

    def return_block(self) -> None:
        """Gives the unused part of the reserved block back to the free stack."""
        block, pos = self._block, self._block_pos
        if pos < self._block_len:
            self.slots.release(block[pos:])
        self._block, self._block_pos, self._block_len = _NO_SLOTS, 0, 0

    def reserve(self, num_slots: int) -> np.ndarray | None:
        """Reserves slots for a backup or a prefetch, evicting host leaves if short (after giving the reserved
        block back); None when L2 cannot make room."""
        short = num_slots - self.slots.num_free
        if short > 0 and self._block_pos < self._block_len:
            self.return_block()
            short = num_slots - self.slots.num_free
        if short > 0:
            self.evict(short)
            if self.slots.num_free < num_slots:
                return None
        return self.slots.alloc(num_slots)

    def unreserve(self, slots: np.ndarray) -> None:
        self.slots.free(slots, PageOwner.REQUEST)

    def commit(self, node: TreeNode) -> None:
        """The node's staged backup was acked by every host: its L2 copy is now valid."""
        self.commit_many([node])

    def commit_many(self, nodes: list[TreeNode]) -> int:
        """``commit`` for the nodes of one acked backup chain (root to leaf, contiguous): one allocator
        update for all their slots; clears the nodes' ``pending``. Returns the tokens committed."""
        staged: list[np.ndarray] = []
        for n in nodes:
            if n.staged_slots is None:
                raise ValueError(f"{n} has no staged backup to commit")
            staged.append(n.staged_slots)
        slots = staged[0] if len(staged) == 1 else concat(staged)
        self.slots.transfer(slots, PageOwner.TREE)
        return self._committed([nodes])

    def commit_chains(self, chains: list[list[TreeNode]], slots: np.ndarray) -> int:
        """``commit_many`` for the chains of one acked merged backup op; ``slots`` are their staged slots
        in chain order (the op's host ids), committed with ONE allocator update. Returns tokens committed."""
        self.slots.transfer(slots, PageOwner.TREE)
        return self._committed(chains)

    def _committed(self, chains: list[list[TreeNode]]) -> int:
        """The chains' staged slots (already TREE-owned) become their nodes' L2 copies."""
        events = self._events
        maybe_push = self.maybe_push
        tokens = 0
        for nodes in chains:
            for n in nodes:
                assert n.staged_slots is not None and n.host_slots is None, f"{n}: nothing staged to commit"
                n.host_slots, n.staged_slots, n.pending = n.staged_slots, None, None
                k = n.num_tokens
                tokens += k
                events.append(n.id << EVENT_ID_SHIFT | k << EVENT_TOKENS_SHIFT | _HOST_STORED)
            # Only the chain's leaf can be a host leaf: every other node has the next one, now backed up, as
            # a child. (Its parent already had an L2 copy and just got a backed-up child: no longer a leaf.)
            maybe_push(nodes[-1])
        self.host_tokens += tokens
        return tokens

    def drop(self, node: TreeNode) -> int:
        """Releases the node's L2 copy; a host-only node leaves the tree. Returns tokens dropped."""
        n = node.num_tokens
        if node.host_slots is None:
            raise ValueError(f"{node} has no L2 copy to drop")
        self.slots.free(node.host_slots, PageOwner.TREE)
        node.host_slots = None
        self.host_tokens -= n
        if self.tree.listener is not None:
            self.tree.listener.on_removed(node, _HOST)
        parent = node.parent
        if node.device_pages is None:
            self.tree.remove_host_only(node)
        if parent is not None and parent.parent is not None:
            self.maybe_push(parent)
        return n

    def evict(self, num_slots: int) -> int:
        """Frees at least ``num_slots`` slots if possible; returns slots freed."""
        if not self._queue_live:
            self.queue.rebuild(self.tree.iter_nodes())
            self._queue_live = True
            self.maybe_push = self.queue.offer
        ps = self.tree.page_size
        freed = 0
        while freed < num_slots:
            node = self.queue.pop()
            if node is None:
                break
            freed += self.drop(node) // ps
        self.evicted_tokens += freed * ps
        self.queue.maybe_compact(self.tree.iter_nodes(), self.tree.num_nodes)
        return freed

    def check_invariants(self) -> None:
        committed = [n.host_slots for n in self.tree.iter_nodes() if n.host_slots is not None]
        staged = [n.staged_slots for n in self.tree.iter_nodes() if n.staged_slots is not None]
        staged.append(self._block[self._block_pos :])  # reserved, not handed out: REQUEST, no node's
        for arrays, owner in ((committed, PageOwner.TREE), (staged, PageOwner.REQUEST)):
            flat = np.concatenate(arrays) if arrays else np.empty(0, np.int32)
            assert np.unique(flat).size == flat.size, f"an L2 slot is referenced twice ({owner.name})"
            assert flat.size == self.slots.count(owner), f"{owner.name} slots disagree with the allocator"
        assert self.host_tokens == sum(c.size for c in committed) * self.tree.page_size
        for node in self.tree.iter_nodes():
            parent = node.parent
            if node.host_slots is not None and parent is not None and parent.parent is not None:
                assert parent.host_slots is not None, f"{node}: L2 chain broken at its parent"
