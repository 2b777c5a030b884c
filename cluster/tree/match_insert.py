"""Match and insert: the two walks every request makes through the tree (no locks, no request state).

``match_prefix`` finds the longest cached prefix of a key in whole pages per tier (L1, then L2, then what
is known to be in L3) and lets the extra components (SWA, Mamba) shorten it and add their values;
``insert`` stores a key's L1 pages, reviving evicted nodes on the way and cutting the new run where a
component needs node boundaries. Both validate their input completely before they mutate anything, so a
ValueError/TypeError leaves the tree exactly as it was. Runs on the head, once per replica.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hicache.cluster.tree.allocator import as_index, as_page_array
from hicache.cluster.tree.component import NO_VALUES
from hicache.cluster.tree.key import RadixKey
from hicache.cluster.tree.node import TreeNode
from hicache.cluster.tree.params import InsertParams, InsertResult, MatchResult
from hicache.cluster.tree.structure import EMPTY_PAGES, TreeStructure, l1_pages


class MatchInsert(TreeStructure):
    """``match_prefix`` and ``insert`` of ``RadixTree``; see the module docstring."""

    def match_prefix(self, key: RadixKey, use_host: bool = True) -> MatchResult:
        """``use_host=False``: the L1 part only (no L2 part; the components limit it as when nothing follows
        in L2), e.g. a request's start right after its load-back, which must not be offered the load again."""
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
            return MatchResult(EMPTY_PAGES, 0, 0, root.id, root.id, root.id)
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
        if not use_host:
            path = device_path
        values = NO_VALUES
        walked = path
        if self.extra_components:  # (a cut path loses its storage-only suffix: counted on the walked one below)
            device_path, path, values = self._component_match(device_path, path)
        if device_path:
            last_device = device_path[-1]
            self.full.maybe_push(last_device)
            pages = l1_pages(device_path)
        else:
            last_device, pages = root, EMPTY_PAGES
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
        if walked and walked[-1].device_pages is None and walked[-1].host_slots is None:  # storage-only suffix
            stored_len = self.storage_only.hit_len(walked, device_len + host_len)
        return MatchResult(pages, device_len, host_len, last_device.id, last_host.id, best.id, values, stored_len)

    def peek_prefix(self, key: RadixKey) -> tuple[int, int, int]:
        """(L1, L2, L3) hit lengths ``match_prefix`` would see, without its effects: no split, no LRU tick,
        no counters, no lock (a router's dry run). L1 and L2 as ``match_prefix`` counts them (L2: tokens
        past the L1 hit); L3: the leading tokens whose nodes are all ``stored``, counted from position 0
        (L3 is shared, so a caller compares it across replicas). Extra components (SWA, Mamba) may shorten
        a real match below what this reports."""
        if not isinstance(key, RadixKey):
            raise TypeError(f"peek_prefix expects a RadixKey, got {type(key).__name__}")
        ps = self.page_size
        tokens = key.token_ids
        end = tokens.shape[0] - tokens.shape[0] % ps
        root = self._roots.get((key.extra_key, key.cache_salt))
        if root is None or not root.children or not end:
            return 0, 0, 0
        path, partial = self._walk(root, tokens.tobytes(), 0, end)
        l1 = l2 = l3 = 0
        in_l1, in_l2, in_l3 = True, True, True
        last = len(path) - 1
        for i, node in enumerate(path):
            n = partial if (partial and i == last) else node.num_tokens
            if in_l1 and node.device_pages is not None and not node.loading:
                l1 += n
            else:
                in_l1 = False
                if in_l2 and node.host_slots is not None and not node.loading:
                    l2 += n
                else:
                    in_l2 = False
            if in_l3 and node.stored:
                l3 += n
            else:
                in_l3 = False
        return l1, l2, l3

    MAX_NAMESPACE_SCAN = 64  # ``cached_elsewhere`` looks below at most this many other namespaces' roots

    def cached_elsewhere(self, key: RadixKey) -> bool:
        """Whether ``key``'s first page starts a cached prefix in another namespace (another ``extra_key`` or
        ``cache_salt``): the miss reason ``namespace_differs``. O(1) per namespace, at most
        ``MAX_NAMESPACE_SCAN`` of them; no effects."""
        tokens = key.token_ids
        if len(self._roots) < 2 or tokens.shape[0] < self.page_size:  # the usual head: one namespace
            return False
        first = tokens[: self.page_size].tobytes()
        own = (key.extra_key, key.cache_salt)
        for i, (ns, root) in enumerate(self._roots.items()):
            if i >= self.MAX_NAMESPACE_SCAN:
                return False
            if ns != own and first in root.children:
                return True
        return False

    def servable_end(self, node: TreeNode) -> TreeNode:
        """The deepest node of the L1 path root..``node`` every extra component can serve a request from (as
        a match of L1 only ends: Mamba, a node whose state is in L1; SWA, a live window), or the namespace
        root. ``node`` itself for Full-only trees."""
        limits = self.hooks.limit_match
        if not limits or node.parent is None:
            return node
        path = []
        n = node
        while n.parent is not None:
            path.append(n)
            n = n.parent
        root = n
        path.reverse()
        for limit_match in limits:
            path = path[: limit_match(path)]
        return path[-1] if path else root

    def _component_match(
        self, device_path: list[TreeNode], path: list[TreeNode]
    ) -> tuple[list[TreeNode], list[TreeNode], Any]:
        """Lets every extra component shorten the L1 and L2 parts of a match and add its own result.

        A match with an L2 part ends at the deepest L2 node every component can serve from there
        (``limit_host_match``: e.g. Mamba, a node whose state is in L2); the L1 part before it stays whole
        (the load-back continues it). Only when no L2 node qualifies do the components cut the L1 part
        (``limit_match``: e.g. Mamba, the deepest node whose state is in L1)."""
        hooks = self.hooks
        # where the key leaves the tree, any tier: a request that caches a state there serves its siblings
        branch_len = sum(n.num_tokens for n in path) if hooks.match_value else 0
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
        if host_path:
            path = device_path + host_path
        else:
            for limit_match in hooks.limit_match:
                allowed = limit_match(device_path)
                if allowed < len(device_path):
                    device_path = device_path[:allowed]
            path = device_path
        if not hooks.match_value:
            return device_path, path, NO_VALUES
        values = {}
        for name, match_value in hooks.match_value:
            value = match_value(device_path, branch_len)
            if value is not None:
                values[name] = value
        return device_path, path, values

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
        params = InsertParams(key, pages, priority)  # what the components' insert hooks read
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
