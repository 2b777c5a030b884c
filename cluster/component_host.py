"""L2 of a hybrid model's component pools on the head: the host ids of one component (SWA pages, Mamba
states), its capacity.

The head decides, the workers store: every host worker keeps a ``ComponentPool`` of the same name whose L2
slots these ids name. One ``ComponentHostPool`` per component with a host tier, owned by the replica's
``HiCacheController`` (the head's one thread). An id is FREE, reserved for an in-flight copy (REQUEST: it
lives only in that copy's ``ComponentTransfer``) or holds a committed copy (TREE: the component records it
on its node value). The component owns its node values and its host-eviction order
(``TreeComponent.drive_host_eviction``); this pool frees what it drops (``release``, the eviction tracker)
and what removed nodes left behind (``take_released_host_copies``, reclaimed before each reservation).
A node with an L1<->L2 copy in flight, a pin or a load is never a host-eviction victim (``pinned``).
"""

from __future__ import annotations

import sys

import numpy as np

from hicache.cluster.tree import CacheCapacityError, PageAllocator, PageOwner, RadixTree, TreeComponent

__all__ = ["ComponentHostPool"]


class ComponentHostPool:
    """The L2 ids of ``component`` (``num_slots`` of them, one page of the component's pool each)."""

    def __init__(self, tree: RadixTree, component: TreeComponent, num_slots: int) -> None:
        if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots <= 0:
            raise ValueError(f"{component.name} host slots must be a positive int, got {num_slots!r}")
        self.tree = tree
        self.component = component
        self.name = component.name
        self.slots = PageAllocator(num_slots)
        self.evicted_tokens = 0

    @property
    def num_slots(self) -> int:
        return self.slots.capacity

    # -- the eviction tracker (``HostEvictionTracker``) ---------------------------------------------------
    def release(self, component: str, node_id: int, host_ids: np.ndarray, num_tokens: int) -> None:
        self.slots.free(np.asarray(host_ids, dtype=np.int32), PageOwner.TREE)

    def pinned(self, node_id: int) -> bool:
        node = self.tree.node(node_id)
        return bool(node.host_pin) or node.pending is not None or node.loading

    # -- reservations -------------------------------------------------------------------------------------
    def reclaim(self) -> None:
        """Frees the host copies of nodes that left the tree since the last call."""
        for _, _, ids in self.component.take_released_host_copies():
            self.slots.free(np.asarray(ids, dtype=np.int32), PageOwner.TREE)

    def reserve(self, num_slots: int) -> np.ndarray | None:
        """``num_slots`` ids for a copy (REQUEST until ``commit``), evicting the component's LRU host copies
        if short; None when it cannot make room (the copy is skipped: its node gets no component copy)."""
        self.reclaim()
        while self.slots.num_free < num_slots:  # (a copy's tokens per id differ by component: ask again)
            freed = self.component.drive_host_eviction((num_slots - self.slots.num_free) * self.tree.page_size, self)
            if not freed:
                return None
            self.evicted_tokens += freed
        try:
            return self.slots.alloc(num_slots)
        except CacheCapacityError:  # (cannot happen after the check above; kept as a miss, never an error)
            return None

    def unreserve(self, ids: np.ndarray) -> None:
        self.slots.free(np.asarray(ids, dtype=np.int32), PageOwner.REQUEST)

    def commit(self, ids: np.ndarray) -> None:
        """The copy into ``ids`` was acked by every host: they hold the component's copy now."""
        self.slots.transfer(np.asarray(ids, dtype=np.int32), PageOwner.TREE)

    def drop_all(self) -> int:
        """Forgets every committed copy (the workers' L2 is gone); in-flight copies were failed before.
        Returns the tokens dropped."""
        self.reclaim()
        return self.component.drive_host_eviction(sys.maxsize, _Unpinned(self))

    # -- checks and reporting -----------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        used = self.slots.count(PageOwner.TREE)
        if not self.component.host_id_is_page:  # (Mamba: an id holds one state, whatever its node's length)
            return {"host_states": used, "host_capacity_states": self.num_slots,
                    "host_evicted_tokens": self.evicted_tokens}
        ps = self.tree.page_size
        return {
            "host_tokens": used * ps,
            "host_capacity_tokens": self.num_slots * ps,
            "host_evicted_tokens": self.evicted_tokens,
        }

    def check_invariants(self) -> None:
        self.reclaim()
        copies = self.component.host_copies()
        flat = np.concatenate(copies) if copies else np.empty(0, np.int32)
        assert np.unique(flat).size == flat.size, f"a {self.name} host id is held by two copies"
        assert flat.size == self.slots.count(PageOwner.TREE), f"{self.name} host copies disagree with the pool"
        assert (self.slots.owners(flat) == PageOwner.TREE).all()


class _Unpinned:
    """A tracker that frees every copy (``drop_all``: nothing on the workers is left to protect)."""

    def __init__(self, pool: ComponentHostPool) -> None:
        self.pool = pool

    def release(self, component: str, node_id: int, host_ids: np.ndarray, num_tokens: int) -> None:
        self.pool.release(component, node_id, host_ids, num_tokens)

    def pinned(self, node_id: int) -> bool:
        return False
