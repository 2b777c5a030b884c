"""The radix tree's structure: nodes, namespace roots, the key walk, split and leaf removal.

``TreeStructure`` is the base of ``RadixTree`` (radix.py composes it with the request flows, the match and
insert, the L1 eviction and the host-tier merge); it owns the node table and the roots, and declares the
attributes ``RadixTree.__init__`` wires (page size, components, hooks, listeners). Owned by the head (one
tree per replica, DESIGN.md §1); a single thread mutates it.

Keys are page-aligned runs of int32 token ids kept as bytes (``TreeNode.key_bytes``); children are indexed
by the bytes of their first page, and a walk compares a node's key bytes against the request's token bytes
in place (``bytes.startswith`` at an offset), so it neither copies nor calls numpy per node.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from hicache.cluster.tree.key import NamespaceKey
from hicache.cluster.tree.node import TreeNode

if TYPE_CHECKING:
    from hicache.cluster.tree.component import ComponentHooks, TreeComponent
    from hicache.cluster.tree.full import FullComponent
    from hicache.cluster.tree.storage_only import StorageOnlyEntries

EMPTY_PAGES = np.empty(0, dtype=np.int32)
# Namespace roots are kept until there are this many; then roots that nothing hangs below or holds are
# dropped, and the next sweep waits for twice the roots kept (``_drop_idle_roots``).
ROOT_SWEEP_MIN = 1024


def l1_pages(nodes: Sequence[TreeNode]) -> np.ndarray:
    """The L1 pages of ``nodes`` (consecutive, each in L1), in order; AssertionError naming one that is not."""
    parts = []
    for node in nodes:
        pages = node.device_pages
        assert pages is not None, f"{node} is not in L1"
        parts.append(pages)
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else EMPTY_PAGES


class TierListener(Protocol):
    """Told when a node's KV enters or leaves a tier ("device", "host"); the head turns this into events."""

    def on_stored(self, node: TreeNode, tier: str) -> None: ...

    def on_removed(self, node: TreeNode, tier: str) -> None: ...


class TreeStructure:
    """Nodes and roots of one tree; see the module docstring."""

    # Wired by ``RadixTree.__init__``.
    page_size: int
    _ck: int  # bytes of a child key (a node's first page)
    full: FullComponent
    extra_components: list[TreeComponent]
    component_names: tuple[str, ...]
    hooks: ComponentHooks
    _value_types: tuple[tuple[str, type], ...]
    # Set by the HiCache controller: called with a batch of L1 victims before their pages are freed
    # (write_back backs them up there), and told about tier changes (events, metrics).
    before_device_evict: Callable[[list[TreeNode]], None] | None
    after_insert: Callable[[list[TreeNode]], None] | None  # path + new leaf, root first
    listener: TierListener | None
    storage_only: StorageOnlyEntries

    def _init_state(self) -> None:
        self._next_id = 0
        self._tick = 0
        self._nodes: dict[int, TreeNode] = {}
        self._roots: dict[NamespaceKey, TreeNode] = {}
        self._root_namespace: dict[int, NamespaceKey] = {}  # root node id -> its namespace (the reverse map)
        self._match_calls = 0
        self._matched_tokens = 0
        self._queried_tokens = 0
        self._evicted_tokens = 0
        self._root_sweep_at = ROOT_SWEEP_MIN
        self.default_root = self._root_for((None, None))

    def _new_node(self, parent: TreeNode | None, key: np.ndarray | bytes, priority: int = 0) -> TreeNode:
        node = TreeNode(self._next_id, parent, key, None, self._tick, priority)
        if self._value_types:
            node.component_data = {name: value_type() for name, value_type in self._value_types}
        self._next_id += 1
        self._nodes[node.id] = node
        return node

    def _root_for(self, namespace: NamespaceKey) -> TreeNode:
        """The namespace's root, created on first use (then, past ``_root_sweep_at`` roots, idle roots go:
        ``_drop_idle_roots``)."""
        root = self._roots.get(namespace)
        if root is None:
            if len(self._roots) >= self._root_sweep_at:
                self._drop_idle_roots()
            root = self._new_node(None, b"")  # no tokens (as bytes: no array to convert)
            root.lock_ref = 1  # roots are never evicted; each request whose last node is the root adds one
            self._roots[namespace] = root
            self._root_namespace[root.id] = namespace
        return root

    def _drop_idle_roots(self) -> None:
        """Forgets the namespace roots that nothing hangs below or holds: no child, no request's lock (a
        request that matched nothing holds its root: ``lock_path``), no pin (an L3 prefetch anchored
        there). A server that sees a new ``cache_salt`` per request would otherwise keep a root per
        request. The next sweep waits until the roots double (amortized O(1) per new root). A dropped
        root's id is unknown from then on, as an evicted node's; its namespace gets a new root on use."""
        for namespace, root in list(self._roots.items()):
            if root is not self.default_root and not root.children and root.lock_ref == 1 and not root.host_pin:
                del self._roots[namespace]
                del self._root_namespace[root.id]
                del self._nodes[root.id]
        self._root_sweep_at = max(ROOT_SWEEP_MIN, 2 * len(self._roots))

    def node(self, node_id: int) -> TreeNode:
        if not isinstance(node_id, (int, np.integer)) or isinstance(node_id, bool):
            raise TypeError(f"node id must be an int, got {node_id!r}")
        node = self._nodes.get(int(node_id))
        if node is None:
            raise ValueError(f"unknown node id {node_id!r}")
        return node

    def roots(self) -> dict[NamespaceKey, TreeNode]:
        """NamespaceKey -> root node (read-only view for checks and dumps)."""
        return dict(self._roots)

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every non-root node."""
        return (n for n in self._nodes.values() if n.parent is not None)

    @property
    def num_nodes(self) -> int:
        return len(self._nodes) - len(self._roots)

    def namespace_of(self, node: TreeNode) -> NamespaceKey:
        """The namespace of ``node``'s root: O(depth), whatever the number of namespaces."""
        root = self._root_of(node)
        ns = self._root_namespace.get(root.id)
        if ns is None or self._roots[ns] is not root:
            raise ValueError(f"node {node.id} is not in this tree")
        return ns

    def in_namespace(self, node: TreeNode, namespace: NamespaceKey) -> bool:
        """Whether ``node`` hangs below ``namespace``'s root (O(depth))."""
        return self._roots.get(namespace) is self._root_of(node)

    def is_root(self, node: TreeNode) -> bool:
        """Whether ``node`` is one of this tree's namespace roots."""
        ns = self._root_namespace.get(node.id)
        return ns is not None and self._roots[ns] is node

    def _common_len(self, node_key: np.ndarray, tb: bytes, pos: int, end: int) -> int:
        """Page-aligned length of the common prefix of ``node_key`` and tokens [pos, end) of ``tb``."""
        n = min(node_key.shape[0], end - pos)
        seg = np.frombuffer(tb, dtype=np.int32, count=n, offset=4 * pos)
        diff = np.flatnonzero(node_key[:n] != seg)
        m = int(diff[0]) if diff.size else n
        return m - m % self.page_size

    def _walk(self, node: TreeNode, tb: bytes, pos: int, end: int) -> tuple[list[TreeNode], int]:
        """Follows tokens [pos, end) of ``tb`` (int32 token bytes) down from ``node`` (which ends at ``pos``).

        Returns (the matched nodes below ``node``, partial len). When the match stops inside a child, that
        child is the last node returned and the partial length (> 0, < its key length) says where.
        """
        ck = self._ck
        b, bend = 4 * pos, 4 * end
        path: list[TreeNode] = []
        children = node.children
        while b < bend:
            child = children.get(tb[b : b + ck])
            if child is None:
                break
            kb = child.key_bytes
            if tb.startswith(kb, b, bend):  # the common case: the whole node matches
                path.append(child)
                b += len(kb)
                children = child.children
                continue
            m = self._common_len(child.key, tb, b >> 2, end)  # >= one page: the first page matched
            path.append(child)
            return path, m
        return path, 0

    @staticmethod
    def _ancestors(node: TreeNode) -> list[TreeNode]:
        """The path root..node (root excluded, ``node`` included), root first."""
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    @staticmethod
    def _root_of(node: TreeNode) -> TreeNode:
        while node.parent is not None:
            node = node.parent
        return node

    @staticmethod
    def depth(node: TreeNode) -> int:
        """Tokens from the namespace root to the end of ``node``."""
        total = 0
        while node.parent is not None:
            total += node.num_tokens
            node = node.parent
        return total

    def _path_pages(self, node: TreeNode) -> np.ndarray:
        """The L1 pages of root..node (every node of the path in L1), in order."""
        return l1_pages(self._ancestors(node))

    def _split(self, node: TreeNode, split_len: int) -> TreeNode:
        """Splits ``node`` after ``split_len`` tokens; returns the new prefix node (parent of ``node``)."""
        ps = self.page_size
        parent = node.parent
        assert parent is not None and 0 < split_len < node.num_tokens and split_len % ps == 0
        kb = node.key_bytes
        prefix = self._new_node(parent, kb[: 4 * split_len], node.priority)
        prefix.lock_ref = node.lock_ref
        prefix.host_pin = node.host_pin
        prefix.hit_count = node.hit_count
        prefix.last_access = node.last_access
        prefix.created = node.created
        k = split_len // ps
        if node.host_slots is not None:
            prefix.host_slots = node.host_slots[:k].copy()
            node.host_slots = node.host_slots[k:].copy()
        if node.staged_slots is not None:
            prefix.staged_slots = node.staged_slots[:k].copy()
            node.staged_slots = node.staged_slots[k:].copy()
        prefix.loading = node.loading
        prefix.stored = node.stored  # chain_key stays None for the prefix: computed again on demand
        if node.pending is not None:
            prefix.pending = node.pending
            node.pending.on_split(prefix, node)
        self.full.on_split(prefix, node)
        for on_split in self.hooks.on_split:
            on_split(prefix, node)
        node.set_key(kb[4 * split_len :])
        node.parent = prefix
        prefix.children[node.key_bytes[: self._ck]] = node
        parent.children[kb[: self._ck]] = prefix
        return prefix

    def _remove_leaf(self, node: TreeNode) -> None:
        """Drops a childless node from the structure (its L1 pages must already be released)."""
        for on_remove in self.hooks.on_remove:
            on_remove(node)
        self.full.on_remove(node)
        parent = node.parent
        assert parent is not None and not node.children
        del parent.children[node.key_bytes[: self._ck]]
        del self._nodes[node.id]
        node.parent = None
