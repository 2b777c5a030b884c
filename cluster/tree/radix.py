"""The radix tree of one serving replica: structure, match, insert, locks, eviction, request flows.

Owned by the head (one per replica, DESIGN.md §1); a single thread mutates it. Keys are page-aligned
runs of int32 token ids kept as bytes (``TreeNode.key_bytes``); children are indexed by the bytes of their
first page, and a walk compares a node's key bytes against the request's token bytes in place
(``bytes.startswith`` at an offset: no copy, no numpy call per node). Every public method validates its input completely before it mutates anything, so a
ValueError/TypeError leaves the tree exactly as it was.

L1 eviction keeps victims with an L2 copy as host-only nodes and merges a demoted node into its only child
when that child is host-only too and nothing tells them apart (``_merge_host_only``; Full-only trees), and a
node whose L2 copy was just acked absorbs its parent when both are in both tiers (``merge_backed_up``): a
conversation's turns stay one node, so its next match, eviction and load-back handle one node.

Extra components (SWA, Mamba; see ``component.py``) are called through ``self.hooks`` (per hook, only the
components that define it), so a Full-only tree runs the same code as before they existed. Per-request component values
travel in ``MatchResult.components`` / ``RequestState.components`` (``begin_request`` creates them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from hicache.cluster.tree.allocator import CacheCapacityError, PageOwner, as_index, as_page_array, concat
from hicache.cluster.tree.component import NO_VALUES, ComponentHooks, TreeComponent
from hicache.cluster.tree.eviction import EvictionPolicy, parse_policy
from hicache.cluster.tree.full import FullComponent
from hicache.cluster.tree.key import NamespaceKey, RadixKey
from hicache.cluster.tree.node import TreeNode
from hicache.cluster.tree.storage_only import StorageOnlyEntries
from hicache.cluster.tree.params import (
    EvictResult,
    FinishResult,
    InsertParams,
    InsertResult,
    MatchResult,
    RequestState,
    TreeStats,
)

_EMPTY_PAGES = np.empty(0, dtype=np.int32)
# Namespace roots are kept until there are this many; then roots that nothing hangs below or holds are
# dropped, and the next sweep waits for twice the roots kept (``_drop_idle_roots``).
ROOT_SWEEP_MIN = 1024


class TierListener(Protocol):
    """Told when a node's KV enters or leaves a tier ("device", "host"); the head turns this into events."""

    def on_stored(self, node: TreeNode, tier: str) -> None: ...

    def on_removed(self, node: TreeNode, tier: str) -> None: ...


@dataclass(frozen=True)
class TreeConfig:
    page_size: int = 1
    capacity_pages: int | None = None  # L1 pages; None = unbounded (grows on demand)
    eviction_policy: EvictionPolicy | str = EvictionPolicy.LRU

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or isinstance(self.page_size, bool) or self.page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {self.page_size!r}")
        if self.capacity_pages is not None and (
            not isinstance(self.capacity_pages, int) or isinstance(self.capacity_pages, bool) or self.capacity_pages <= 0
        ):
            raise ValueError(f"capacity_pages must be a positive int or None, got {self.capacity_pages!r}")
        object.__setattr__(self, "eviction_policy", parse_policy(self.eviction_policy))


class RadixTree:
    def __init__(self, config: TreeConfig, components: Sequence[TreeComponent] = ()) -> None:
        self.config = config
        self.page_size = config.page_size
        self._ck = 4 * config.page_size  # bytes of a child key (the node's first page)
        self.full = FullComponent(config.capacity_pages, config.eviction_policy)
        self.extra_components = list(components)
        for comp in [self.full, *self.extra_components]:
            comp.attach(self)
        names = [c.name for c in [self.full, *self.extra_components]]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate component names {names}")
        self.component_names = tuple(names)
        self.hooks = ComponentHooks(self.extra_components)
        self._value_types = tuple((c.name, c.value_type) for c in self.extra_components if c.value_type is not None)
        # Set by the HiCache controller: called with a batch of L1 victims before their pages are freed
        # (write_back backs them up there), and told about tier changes (events, metrics).
        self.before_device_evict: Callable[[list[TreeNode]], None] | None = None
        self.after_insert: Callable[[list[TreeNode]], None] | None = None  # path + new leaf, root first
        self.listener: TierListener | None = None
        self.storage_only = StorageOnlyEntries(self)  # L3-only prefixes (warm restart); empty without L3
        self._init_state()

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

    # -- nodes -------------------------------------------------------------------------------------
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

    def component(self, name: str) -> TreeComponent:
        """The component called ``name`` ("full", "swa", "mamba"); ValueError naming it if absent."""
        for comp in (self.full, *self.extra_components):
            if comp.name == name:
                return comp
        raise ValueError(f"no component {name!r} in this tree (components: {', '.join(self.component_names)})")

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every non-root node."""
        return (n for n in self._nodes.values() if n.parent is not None)

    @property
    def num_nodes(self) -> int:
        return len(self._nodes) - len(self._roots)

    def _common_len(self, node_key: np.ndarray, tb: bytes, pos: int, end: int) -> int:
        """Page-aligned length of the common prefix of ``node_key`` and tokens [pos, end) of ``tb``."""
        n = min(node_key.shape[0], end - pos)
        seg = np.frombuffer(tb, dtype=np.int32, count=n, offset=4 * pos)
        diff = np.flatnonzero(node_key[:n] != seg)
        m = int(diff[0]) if diff.size else n
        return m - m % self.page_size

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

    # -- match -------------------------------------------------------------------------------------
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

    def match_prefix(self, key: RadixKey) -> MatchResult:
        if not isinstance(key, RadixKey):
            raise TypeError(f"match_prefix expects a RadixKey, got {type(key).__name__}")
        ps = self.page_size
        tokens = key.token_ids
        n = tokens.shape[0]
        end = n - n % ps
        self._match_calls += 1
        self._queried_tokens += end
        namespace = (key.extra_key, key.cache_salt)
        root = self._roots.get(namespace) or self._root_for(namespace)
        if not root.children and not self.extra_components:  # nothing cached in it (a new cache_salt)
            self._tick += 1
            return MatchResult(_EMPTY_PAGES, 0, 0, root.id, root.id, root.id)
        path, partial = self._walk(root, tokens.tobytes(), 0, end)
        if partial:
            path[-1] = self._split(path[-1], partial)
        self._tick += 1
        tick = self._tick
        device_nodes, counting = 0, True
        for node in path:
            node.last_access = tick
            if counting and node.device_pages is not None and not node.loading:
                device_nodes += 1
            else:
                counting = False
        device_path = path[:device_nodes]
        values = NO_VALUES
        if self.extra_components:
            device_path, path, values = self._component_match(device_path, path)
        if device_path:
            last_device = device_path[-1]
            self.full.maybe_push(last_device)
            pages = (
                device_path[0].device_pages
                if len(device_path) == 1
                else np.concatenate([n.device_pages for n in device_path])
            )
        else:
            last_device, pages = root, _EMPTY_PAGES
        device_len = pages.shape[0] * ps
        host_len = 0
        last_host = root
        for node in device_path:
            if node.host_slots is not None:
                last_host = node
        for node in path[len(device_path) :]:
            if node.host_slots is None or node.loading:
                break  # a load already in flight: usable once acked, not loadable again
            host_len += node.num_tokens
            last_host = node
        best = last_host if host_len else last_device
        self._matched_tokens += device_len + host_len
        stored_len = 0
        if path and path[-1].device_pages is None and path[-1].host_slots is None:  # storage-only suffix
            stored_len = self.storage_only.hit_len(path, device_len + host_len)
        return MatchResult(pages, device_len, host_len, last_device.id, last_host.id, best.id, values, stored_len)

    def _component_match(
        self, device_path: list[TreeNode], path: list[TreeNode]
    ) -> tuple[list[TreeNode], list[TreeNode], Any]:
        """Lets every extra component shorten the L1 and L2 parts of a match and add its own result."""
        hooks = self.hooks
        branch_len = sum(n.num_tokens for n in device_path) if hooks.match_value else 0
        for limit_match in hooks.limit_match:
            allowed = limit_match(device_path)
            if allowed < len(device_path):
                device_path = device_path[:allowed]
                path = device_path  # a component that cannot serve L1 cannot serve L2 beyond it either
        host_path = []
        for node in path[len(device_path) :]:
            if node.host_slots is None or node.loading:
                break
            host_path.append(node)
        if host_path:
            for limit_host_match in hooks.limit_host_match:
                allowed = limit_host_match(device_path, host_path)
                if allowed < len(host_path):
                    host_path = host_path[:allowed]
            path = device_path + host_path
        else:
            path = device_path
        if not hooks.match_value:
            return device_path, path, NO_VALUES
        values = {}
        for match_value in hooks.match_value:
            value = match_value(device_path, branch_len)
            if value is not None:
                values[match_value.__self__.name] = value
        return device_path, path, values

    # -- insert ------------------------------------------------------------------------------------
    def insert(self, params: InsertParams) -> InsertResult:
        if not isinstance(params, InsertParams):
            raise TypeError(f"insert expects InsertParams, got {type(params).__name__}")
        key = params.key
        if not isinstance(key, RadixKey):
            raise TypeError(f"InsertParams.key must be a RadixKey, got {type(key).__name__}")
        pages = as_page_array(params.device_pages, "device_pages")
        ps = self.page_size
        end = len(key) - len(key) % ps
        if pages.shape[0] < end // ps:
            raise ValueError(
                f"device_pages has {pages.shape[0]} pages but the key has {end // ps} whole pages "
                f"({len(key)} tokens, page_size {ps})"
            )
        root = self._root_for(key.namespace)
        return InsertResult(self._insert(key, end, pages, params.priority, root, [], 0, None)[0])

    def _insert(
        self, key: RadixKey, end: int, pages: np.ndarray, priority: int, start: TreeNode,
        ancestors: list[TreeNode], start_pos: int, checked: np.ndarray | None,
    ) -> tuple[int, TreeNode]:
        """Inserts the first ``end`` tokens of ``key`` (page-aligned) with their L1 ``pages`` (validated shape).

        ``start`` is the key's namespace root or a node known to match its first ``start_pos`` tokens (a
        request's locked node), ``ancestors`` the path root..start (root excluded, ``start`` last).
        ``checked``: None, or the ``intp`` index of ``pages[start_pos // page_size:]`` that the caller
        already checked to be REQUEST pages (the pages the tree may take all lie there).
        Returns (tokens already cached in L1, the node ending at ``end`` or the root).
        """
        extra = self.extra_components
        ps = self.page_size
        tb = key.token_ids.tobytes()
        below, partial = self._walk(start, tb, start_pos, end)
        path = ancestors + below if ancestors else below
        # Ranges whose pages the tree takes: L1-evicted nodes being revived, and the new leaf.
        new_ranges: list[tuple[int, int]] = []
        pos, prefix_len, in_device_prefix = 0, 0, True
        last_i = len(path) - 1
        for i, node in enumerate(path):
            span = partial if (partial and i == last_i) else node.num_tokens
            if node.device_pages is None:
                in_device_prefix = False
                new_ranges.append((pos // ps, (pos + span) // ps))
            elif in_device_prefix:
                prefix_len += span
            pos += span
        if pos < end:
            new_ranges.append((pos // ps, end // ps))
        full = self.full
        base = start_pos // ps
        if checked is None or (new_ranges and new_ranges[0][0] < base):
            full.check_new_pages(pages, new_ranges)
            checked = None
        params = InsertParams(key, pages, priority) if extra else None
        hooks = self.hooks
        for validate_insert in hooks.validate_insert:
            validate_insert(params, new_ranges)
        # -- mutation starts here; nothing below raises on valid state --
        if partial:
            path[-1] = self._split(path[-1], partial)
        # Nodes below ``start`` already in L1 (``start``'s path holds the request's own prefix pages: the
        # tree's pages, nothing for a component to take over there).
        existing = (
            self._existing_below(path[len(ancestors) :], start_pos)
            if hooks.on_insert_existing and len(path) > len(ancestors) else None
        )
        self._tick += 1
        tick = self._tick
        listener = self.listener
        pos = 0
        for node in path:
            n = node.num_tokens
            node.last_access = tick
            node.hit_count += 1
            if node.device_pages is None:
                if node.host_slots is None:  # a storage-only node gets computed KV
                    self.storage_only.tokens -= n
                full.take_pages(node, pages, pos // ps, (pos + n) // ps, checked, base)
                for on_revive in hooks.on_revive:
                    on_revive(node, params, pos // ps, (pos + n) // ps)
                if listener is not None:
                    listener.on_stored(node, "device")
            pos += n
        if existing:
            for on_insert_existing in hooks.on_insert_existing:
                on_insert_existing(params, existing)
        parent = path[-1] if path else start
        ck = self._ck
        if pos < end and hooks.insert_boundaries:
            first, stop = pos // ps, end // ps
            index = checked[first - base : stop - base] if checked is not None else as_index(pages[first:stop])
            boundaries = hooks.insert_boundaries  # each returns sorted cuts; merge only when several do
            cuts = (
                boundaries[0](params, first, stop, index) if len(boundaries) == 1
                else sorted({c for f in boundaries for c in f(params, first, stop, index)})
            )
            for cut in cuts:  # components need the new run in several nodes (SWA: tombstone | live)
                node = self._new_node(parent, tb[4 * pos : 4 * cut * ps], priority)
                parent.children[node.key_bytes[:ck]] = node
                full.take_pages(node, pages, pos // ps, cut, checked, base)
                for on_create in hooks.on_create:
                    on_create(node, params, pos // ps, cut)
                if listener is not None:
                    listener.on_stored(node, "device")
                path.append(node)
                parent, pos = node, cut * ps
        if pos < end:
            leaf = self._new_node(parent, tb[4 * pos : 4 * end], priority)
            leaf.hit_count = 1  # its first insert counts as its first hit (write-through thresholds)
            parent.children[leaf.key_bytes[:ck]] = leaf
            full.take_pages(leaf, pages, pos // ps, end // ps, checked, base)
            for on_create in hooks.on_create:
                on_create(leaf, params, pos // ps, end // ps)
            full.queue.push(leaf)
            if listener is not None:
                listener.on_stored(leaf, "device")
            path.append(leaf)
        elif path:
            full.maybe_push(path[-1])
        if self.after_insert is not None and path:
            self.after_insert(path)
        return prefix_len, (path[-1] if path else start)

    def _existing_below(self, nodes: list[TreeNode], pos: int) -> list[tuple[TreeNode, int, int]]:
        """(node, first page, end page) of each of ``nodes`` (consecutive, the first starting at token
        ``pos``) that is in L1."""
        ps, out = self.page_size, []
        for node in nodes:
            n = node.num_tokens
            if node.device_pages is not None:
                out.append((node, pos // ps, (pos + n) // ps))
            pos += n
        return out

    # -- locks -------------------------------------------------------------------------------------
    def inc_lock_ref(self, node_id: int) -> int:
        return self.lock_path(self.node(node_id))

    def lock_path(self, node: TreeNode) -> int:
        """``inc_lock_ref`` of a node the caller holds (no id lookup): locks root..node in every component.
        A root's lock only keeps the root (a request that matched nothing in its namespace)."""
        if node.parent is None:
            node.lock_ref += 1
            return 0
        delta = self.full.lock(node)
        for on_lock in self.hooks.on_lock:
            on_lock(node)
        return delta

    def dec_lock_ref(self, node_id: int) -> int:
        node = self.node(node_id)
        if node.parent is not None and node.lock_ref <= 0:
            raise ValueError(f"lock underflow: node {node_id} is not locked")
        return self.unlock_path(node)

    def unlock_path(self, node: TreeNode) -> int:
        """Releases a ``lock_path`` lock of a node the caller holds (checked): root..node in every component,
        or a root's own count (its base stays)."""
        if node.parent is None:
            if node.lock_ref > 1:
                node.lock_ref -= 1
            return 0
        delta = self.full.unlock(node)
        for on_unlock in self.hooks.on_unlock:
            on_unlock(node)
        return delta

    # -- eviction and allocation ---------------------------------------------------------------------
    def evict(self, num_tokens: int = 0, **component_amounts: int) -> EvictResult:
        """Frees at least ``num_tokens`` L1 tokens if possible, leaf-first in policy order.

        Victims with an L2 copy stay in the tree as host-only nodes; others are removed. With a
        ``before_device_evict`` hook (write_back), each batch of victims is offered to it first.
        ``component_amounts`` drive the extra components' own eviction by their ``evict_param``
        (``swa_num_tokens=...``: SWA tombstones, ``mamba_num=...``: Mamba states).
        """
        if not isinstance(num_tokens, (int, np.integer)) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        if component_amounts:
            params = {c.evict_param: c for c in self.extra_components if c.evict_param}
            for name, amount in component_amounts.items():
                if name not in params:
                    raise ValueError(f"unknown eviction amount {name!r}; this tree takes {sorted(params)}")
                if not isinstance(amount, (int, np.integer)) or isinstance(amount, bool) or amount < 0:
                    raise ValueError(f"{name} must be an int >= 0, got {amount!r}")
        freed = self._evict_full(num_tokens) if num_tokens else 0
        if not component_amounts:
            return EvictResult(freed)
        done = {name: params[name].evict_component(int(amount)) for name, amount in component_amounts.items()}
        return EvictResult(freed, done)

    def _evict_full(self, num_tokens: int) -> int:
        """Evicts L1 victims in batches; each batch's pages go back to the allocator in ONE release."""
        freed = 0
        hooks = self.hooks
        full = self.full
        queue = full.queue
        listener = self.listener
        merge = not self.extra_components  # host-only chains merge in Full-only trees
        while freed < num_tokens:
            batch, batch_tokens = [], 0
            while freed + batch_tokens < num_tokens:
                node = queue.pop()
                if node is None:
                    break
                batch.append(node)
                batch_tokens += node.num_tokens
            if not batch:
                break
            if self.before_device_evict is not None:
                self.before_device_evict(batch)
            dropped = []  # the victims' page arrays, deepest-popped first at release
            for node in batch:
                if node.parent is None or node.device_pages is None or node.lock_ref:
                    continue  # changed while the hook ran (it may process transfer acks)
                dropped.append(node.device_pages)  # unlocked: its tokens were evictable
                node.device_pages = None
                freed += node.num_tokens
                full.evictable_tokens -= node.num_tokens
                for on_device_drop in hooks.on_device_drop:
                    on_device_drop(node)
                if listener is not None:
                    listener.on_removed(node, "device")
                parent = node.parent
                if node.host_slots is not None:  # demoted: host-only now
                    if merge and len(node.children) == 1:
                        self._merge_host_only(node)
                elif not node.children or not self.storage_only.keep(node):
                    self._remove_leaf(node)  # (a node kept for its storage-only children stays)
                if parent.parent is not None:
                    full.maybe_push(parent)
                    for after_device_evict in hooks.after_device_evict:
                        freed += after_device_evict(parent)
            if dropped:
                # Victims in reverse pop order: the free stack ends up as with one release per victim.
                dropped.reverse()
                full.allocator.release(dropped[0] if len(dropped) == 1 else np.concatenate(dropped))
        self._evicted_tokens += freed
        if queue.needs_compact(len(self._nodes)):  # (no node generator per eviction)
            queue.rebuild(self.iter_nodes())
        return freed

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
            parent.parent is None or len(parent.children) != 1 or parent.lock_ref != node.lock_ref
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
        parent = node.parent
        kb = node.key_bytes
        child.set_key(kb + child.key_bytes)
        child.host_slots = concat((node.host_slots, child.host_slots))
        if child.device_pages is not None:
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

    def remove_host_only(self, node: TreeNode) -> None:
        """Deletes a host-only leaf (host eviction); its slots must already be released by the caller."""
        assert node.device_pages is None and node.parent is not None
        if node.children and self.storage_only.keep(node):  # stays as its storage-only children's ancestor
            return
        assert not node.children
        parent = node.parent
        self._remove_leaf(node)
        if parent.parent is not None:
            self.full.maybe_push(parent)

    def alloc(self, num_tokens: int) -> np.ndarray:
        """L1 pages for ``num_tokens`` tokens (rounded up to pages), evicting unlocked leaves if needed."""
        if not isinstance(num_tokens, (int, np.integer)) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        need = -(-int(num_tokens) // self.page_size)
        alloc = self.full.allocator
        if need > alloc.num_free and alloc.bounded:
            self.make_room(need, num_tokens)
        return alloc.alloc(need)

    def make_room(self, num_pages: int, num_tokens: int) -> None:
        """Evicts L1 victims until ``num_pages`` pages are free (``alloc`` of ``num_tokens`` tokens; a load-back
        allocates its chain's pages after it). CacheCapacityError, evicting nothing, when free plus evictable
        pages cannot cover them; also (after evicting) when evictable tokens were locked behind children."""
        alloc = self.full.allocator
        short = num_pages - alloc.num_free
        if short <= 0 or not alloc.bounded:
            return
        ps = self.page_size
        if short * ps > self.full.evictable_tokens:
            raise CacheCapacityError(
                f"alloc({num_tokens}) needs {num_pages} pages: {alloc.num_free} free and "
                f"{self.full.evictable_tokens // ps} evictable"
            )
        self._evict_full(short * ps)
        if alloc.num_free < num_pages:  # evictable tokens were locked behind children; report honestly
            raise CacheCapacityError(f"alloc({num_tokens}) needs {num_pages} pages, only {alloc.num_free} free")

    def free(self, pages: np.ndarray | Sequence[int]) -> None:
        """Returns request-held pages to the free list (never pages the tree owns)."""
        self.full.allocator.free(as_page_array(pages), PageOwner.REQUEST)

    # -- request flows (what a scheduler calls) --------------------------------------------------------
    def _check_request(
        self, state: RequestState
    ) -> tuple[TreeNode, np.ndarray, int, list[TreeNode], np.ndarray]:
        """Validates a request. Returns its locked node, its pages, its prefix pages ``k``, the locked path
        (root first) and the ``intp`` index of ``pages[k:]``, checked to be the request's own pages."""
        if type(state) is not RequestState and not isinstance(state, RequestState):
            raise TypeError(f"expected RequestState, got {type(state).__name__}")
        key = state.key
        if type(key) is not RadixKey and not isinstance(key, RadixKey):
            raise TypeError(f"RequestState.key must be a RadixKey, got {type(key).__name__}")
        ps = self.page_size
        pages = as_page_array(state.device_pages, "device_pages")
        n_tokens = key.token_ids.shape[0]
        if pages.shape[0] * ps < n_tokens:
            raise ValueError(f"{pages.shape[0]} pages cannot hold {n_tokens} tokens at page_size {ps}")
        prefix_len = state.prefix_len
        if prefix_len < 0 or prefix_len % ps or prefix_len > n_tokens:
            raise ValueError(f"prefix_len {prefix_len} must be a page multiple within [0, {n_tokens}]")
        node = self.node(state.last_node)
        if node.parent is not None and node.lock_ref <= 0:
            raise ValueError(f"request's last_node {state.last_node} is not locked")
        path, depth, root = [], 0, node  # one walk: the path, its length and its root
        while root.parent is not None:
            path.append(root)
            depth += root.num_tokens
            root = root.parent
        path.reverse()
        if root is not self._roots.get((key.extra_key, key.cache_salt)):
            raise ValueError(f"last_node {state.last_node} belongs to another namespace than the key")
        if depth != prefix_len:
            raise ValueError(f"prefix_len {prefix_len} does not end at last_node {state.last_node} (depth {depth})")
        # The prefix pages belong to the locked path and are never touched here; the rest must be ours.
        k = prefix_len // ps
        own = self.full.allocator.check(pages[k:], PageOwner.REQUEST, "request pages")
        if state.components or self.hooks.validate_request:
            self._check_request_components(state)
        return node, pages, k, path, own

    def _check_request_components(self, state: RequestState) -> None:
        unknown = set(state.components) - set(self.component_names)
        if unknown:
            raise ValueError(
                f"RequestState.components has unknown component(s) {sorted(unknown)}; "
                f"this tree has {list(self.component_names)}"
            )
        for validate_request in self.hooks.validate_request:
            validate_request(state)

    # -- per-request component values (no-ops for Full-only trees) ------------------------------------
    def begin_request(self, match: MatchResult) -> Mapping[str, Any]:
        """Per-component resources of a request that continues from ``match`` (lock its node first).

        Returns the mapping to pass as ``RequestState.components``; empty for Full-only and SWA trees.
        Mamba: a fresh working state slot plus the copy-on-write instruction from the cached state.
        """
        if not isinstance(match, MatchResult):
            raise TypeError(f"begin_request expects a MatchResult, got {type(match).__name__}")
        if not self.hooks.begin_request:
            return NO_VALUES
        values = {}
        for begin_request in self.hooks.begin_request:
            value = begin_request(match)
            if value is not None:
                values[begin_request.__self__.name] = value
        return values

    def trim_request(self, state: RequestState) -> int:
        """Releases per-request values that no later step needs (SWA pages outside the window).

        Call it between forward steps of a running request; returns how many values were released.
        A tree whose components trim nothing (Full, Mamba) returns 0 at once, as a Full-only tree always did.
        """
        if not self.hooks.trim_request:
            return 0
        # Light checks only (this runs every step): components validate exactly the values they release.
        if not isinstance(state, RequestState):
            raise TypeError(f"expected RequestState, got {type(state).__name__}")
        if not isinstance(state.key, RadixKey):
            raise TypeError(f"RequestState.key must be a RadixKey, got {type(state.key).__name__}")
        as_page_array(state.device_pages, "device_pages")
        n_tokens, ps = len(state.key), self.page_size
        if state.prefix_len < 0 or state.prefix_len % ps or state.prefix_len > n_tokens:
            raise ValueError(f"prefix_len {state.prefix_len} must be a page multiple within [0, {n_tokens}]")
        if state.components or self.hooks.validate_request:
            self._check_request_components(state)
        released = 0
        for trim_request in self.hooks.trim_request:
            released += trim_request(state)
        return released

    def _path_pages(self, node: TreeNode) -> np.ndarray:
        parts = []
        while node.parent is not None:
            parts.append(node.device_pages)
            node = node.parent
        if not parts:
            return _EMPTY_PAGES
        return parts[0] if len(parts) == 1 else np.concatenate(parts[::-1])

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

    def cache_finished_req(self, state: RequestState) -> FinishResult:
        """Inserts the finished request's whole pages, frees duplicates and the tail, unlocks its path."""
        last, pages, k, path, own = self._check_request(state)
        ps = self.page_size
        whole = len(state.key) // ps
        full = self.full
        # A backup the insert starts (write-through) locks its chain's path: it takes the request's lock
        # over where the paths meet instead of locking and then unlocking the shared prefix.
        handoff = last.parent is not None and self.after_insert is not None
        if handoff:
            full.handoff = last
        try:
            new_prefix, end = self._insert(state.key, whole * ps, pages, state.priority, last, path, k * ps, own)
        finally:
            handed_over = handoff and full.handoff is None
            full.handoff = None
        # Free what the tree did not take: duplicates of what it already had, and the partial tail.
        d = max(k, new_prefix // ps)
        alloc = full.allocator
        if d > k:
            alloc.release(pages[k:d], own[: d - k])
        if whole < pages.shape[0]:
            alloc.release(pages[whole:], own[whole - k :])
        hooks = self.hooks
        if handed_over:  # the backup's walk took over the request's lock: only the components release theirs
            for on_unlock in hooks.on_unlock:
                on_unlock(last)
        else:
            self.unlock_path(last)
        for on_request_cached in hooks.on_request_cached:
            on_request_cached(state, end, True)
        return FinishResult(new_prefix, d - k + pages.shape[0] - whole)

    def cache_unfinished_req(self, state: RequestState) -> RequestState:
        """Chunked prefill: caches what the request computed so far and moves its lock to the new end.

        Returns the request's new state: its pages now start with the tree's pages for every whole page
        (duplicates were freed), followed by the request's own pages for the partial tail.
        """
        last, pages, k, path, own = self._check_request(state)
        ps = self.page_size
        whole = len(state.key) // ps
        prefix_key = state.key.prefix(whole * ps)
        new_prefix, end = self._insert(state.key, whole * ps, pages, state.priority, last, path, k * ps, own)
        d = max(k, new_prefix // ps)
        if d > k:
            self.full.allocator.release(pages[k:d], own[: d - k])
        if self.extra_components:
            return self._continue_request(state, last, end, pages)
        match = self.match_prefix(prefix_key)
        new_last = self.node(match.last_device_node)
        self.lock_path(new_last)
        self.unlock_path(last)
        new_pages = np.concatenate([match.device_pages, pages[match.device_pages.shape[0] :]])
        return RequestState(state.key, new_pages, match.device_hit_len, new_last.id, state.priority)

    def _continue_request(self, state: RequestState, last: TreeNode, end: TreeNode, pages: np.ndarray) -> RequestState:
        """cache_unfinished_req with extra components: the lock moves to ``end`` itself (not to what a
        component would let a *match* use: the request holds its own KV there), then components hand the
        request its continuing values."""
        hooks = self.hooks
        self.lock_path(end)
        self.unlock_path(last)
        prefix = self._path_pages(end)
        values = {}
        for on_request_cached in hooks.on_request_cached:
            value = on_request_cached(state, end, False)
            if value is not None:
                values[on_request_cached.__self__.name] = value
        new_pages = np.concatenate([prefix, pages[prefix.shape[0] :]])
        return RequestState(state.key, new_pages, prefix.shape[0] * self.page_size, end.id, state.priority, values)

    # -- bookkeeping -----------------------------------------------------------------------------------
    def reset(self) -> None:
        """Empties the tree and frees every L1 page (pages held by running requests become invalid)."""
        for comp in [self.full, *self.extra_components]:
            comp.reset()
        self._init_state()
        self.storage_only.reset()

    def stats(self) -> TreeStats:
        full = self.full
        return TreeStats(
            page_size=self.page_size,
            num_nodes=self.num_nodes,
            cached_tokens=full.evictable_tokens + full.protected_tokens,
            evictable_tokens=full.evictable_tokens,
            protected_tokens=full.protected_tokens,
            free_pages=full.allocator.num_free,
            request_pages=full.allocator.count(PageOwner.REQUEST),
            capacity_pages=full.allocator.capacity,
            match_calls=self._match_calls,
            matched_tokens=self._matched_tokens,
            queried_tokens=self._queried_tokens,
            evicted_tokens=self._evicted_tokens,
            components=self.component_names,
        )

    def check_invariants(self) -> None:
        """Full structural check (O(nodes)); for tests and debugging."""
        ps = self.page_size
        for node in self.iter_nodes():
            parent = node.parent
            assert node.num_tokens > 0 and node.num_tokens % ps == 0, f"{node} not page aligned"
            assert parent.children.get(node.key_bytes[: self._ck]) is node, f"{node} not linked"
            assert node.key.tobytes() == node.key_bytes and node.num_tokens == len(node.key)
            assert self._nodes.get(node.id) is node
            if node.device_pages is not None:
                assert node.device_pages.shape[0] * ps == node.num_tokens, f"{node} pages/tokens mismatch"
                assert parent.parent is None or parent.device_pages is not None, f"{node} in L1 under evicted parent"
            else:
                assert node.host_slots is not None or node.stored, f"{node} is in no tier"
            if parent.parent is not None:
                assert parent.lock_ref >= node.lock_ref, f"{node} locked more than its parent"
        for comp in [self.full, *self.extra_components]:
            comp.check_invariants()
        self.storage_only.check_invariants()
