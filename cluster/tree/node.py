"""Tree nodes. Owned by the radix tree of one replica (the head); never shared across processes.

A node holds a page-aligned run of tokens (``key_bytes``, with ``key`` a read-only int32 view of the same
memory, made on first read: the tree compares and indexes keys as bytes, everything else reads the array)
and, per tier, where their KV lives: ``device_pages`` (L1 page ids, one per page; ``None`` once evicted from
L1) and ``host_slots`` (L2 slot ids; ``None`` when not backed up). Components (SWA, Mamba) keep their
per-node values in ``component_data``. Nodes cross process boundaries only as their integer ``id``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from hicache.cluster.tree.params import NO_VALUES


class TreeNode:
    __slots__ = (
        "id",
        "parent",
        "children",
        "_key",
        "key_bytes",
        "num_tokens",
        "device_pages",
        "host_slots",
        "lock_ref",
        "host_pin",
        "hit_count",
        "last_access",
        "created",
        "priority",
        "heap_version",
        "host_heap_version",
        "component_data",
        "pending",
        "staged_slots",
        "loading",
        "chain_key",
        "stored",
    )

    def __init__(
        self,
        node_id: int,
        parent: TreeNode | None,
        key: np.ndarray | bytes,
        device_pages: np.ndarray | None,
        tick: int,
        priority: int = 0,
    ) -> None:
        self.id = node_id
        self.parent = parent
        self.children: dict[Any, TreeNode] = {}
        self.set_key(key)
        self.device_pages = device_pages  # i32[num_tokens // page_size] or None (evicted from L1)
        self.host_slots: np.ndarray | None = None  # i32[num_tokens // page_size] or None (no L2 copy)
        self.lock_ref = 0  # requests (and in-flight transfers) that need the device KV of this node
        self.host_pin = 0  # in-flight work that needs the host copy (L2->L3 backup, load-back)
        self.hit_count = 0
        self.last_access = tick
        self.created = tick
        self.priority = priority
        self.heap_version = 0  # bumped on every push into the L1 eviction queue; older entries are stale
        self.host_heap_version = 0  # the same for the L2 (host) eviction queue
        # Component name -> its value (the tree gives every node of a tree with SWA/Mamba a dict of fresh
        # values); the shared empty mapping otherwise, so a Full-only tree allocates nothing per node.
        self.component_data: Mapping[str, Any] = NO_VALUES
        self.pending: Any = None  # the in-flight transfer this node waits on (HiCache), if any
        self.staged_slots: np.ndarray | None = None  # L2 slots reserved for an in-flight D->H backup
        self.loading = False  # device_pages are allocated but the H->D load is not acked yet
        self.chain_key: str | None = None  # L3 chain key of the node's last page, once computed
        self.stored = False  # every page of the node is in L3 (acked by every host)

    def set_key(self, key: np.ndarray | bytes) -> None:
        """Sets the node's tokens (int32 ids, or their bytes); ``num_tokens % page_size == 0``."""
        kb = key if type(key) is bytes else np.ascontiguousarray(key, dtype=np.int32).tobytes()
        self.key_bytes = kb
        self._key: np.ndarray | None = None  # ``key``, once read
        self.num_tokens = len(kb) >> 2

    @property
    def key(self) -> np.ndarray:
        """i32[num_tokens], a read-only view of ``key_bytes``; made on first read (the tree's walks, splits and
        merges use the bytes only: no numpy view is built per new, split or merged node)."""
        k = self._key
        if k is None:
            k = self._key = np.frombuffer(self.key_bytes, dtype=np.int32)
        return k

    @property
    def evicted(self) -> bool:
        """True when the node's KV is no longer in L1 (it may still be on the host)."""
        return self.device_pages is None

    @property
    def backed_up(self) -> bool:
        return self.host_slots is not None

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, tokens={self.num_tokens}, lock_ref={self.lock_ref}, "
            f"device={'no' if self.evicted else 'yes'}, host={'yes' if self.backed_up else 'no'})"
        )
