"""Request flows: what a scheduler calls around one running request (locks, component values, caching).

A request matches, locks the matched node (``inc_lock_ref``/``lock_path``), gets its per-component values
(``begin_request``; Mamba: a working state slot), trims them between steps (``trim_request``; SWA: pages
outside the window) and is cached when it finishes (``cache_finished_req``: insert, free duplicates and
the tail, unlock) or at a chunk boundary (``cache_unfinished_req``: insert and move the lock to the new
end). Both validate the whole ``RequestState`` before they mutate anything. Runs on the head.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from hicache.cluster.tree.allocator import PageOwner, as_page_array
from hicache.cluster.tree.component import NO_VALUES
from hicache.cluster.tree.key import RadixKey
from hicache.cluster.tree.match_insert import MatchInsert
from hicache.cluster.tree.node import TreeNode
from hicache.cluster.tree.params import FinishResult, MatchResult, RequestState


class RequestFlows(MatchInsert):
    """The request calls of ``RadixTree``; see the module docstring."""

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

    def begin_request(self, match: MatchResult, decode_positions: range | None = None) -> Mapping[str, Any]:
        """Per-component resources of a request that continues from ``match`` (lock its node first).

        Returns the mapping to pass as ``RequestState.components``; empty for Full-only and SWA trees.
        Mamba: a fresh working state slot plus the copy-on-write instruction from the cached state, and a
        track slot when ``decode_positions`` (the positions its decode steps compute at most; None: unknown)
        cross a page end.
        """
        if not isinstance(match, MatchResult):
            raise TypeError(f"begin_request expects a MatchResult, got {type(match).__name__}")
        if decode_positions is not None and (type(decode_positions) is not range or decode_positions.step != 1
                                             or decode_positions.start < 0):
            raise ValueError(f"decode_positions must be a range of positions >= 0 with step 1 or None, got "
                             f"{decode_positions!r}")
        if not self.hooks.begin_request:
            return NO_VALUES
        values = {}
        for name, begin_request in self.hooks.begin_request:
            value = begin_request(match, decode_positions)
            if value is not None:
                values[name] = value
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
        for _, on_request_cached in hooks.on_request_cached:
            on_request_cached(state, end, True)
        return FinishResult(new_prefix, d - k + pages.shape[0] - whole)

    def abandon_request(self, state: RequestState) -> int:
        """A request that failed after its start (a forward raised): frees its own pages and per-component
        values (its Mamba working slot) and unlocks its path, caching nothing. Returns the pages freed."""
        last, pages, k, _, own = self._check_request(state)
        self.full.allocator.release(pages[k:], own)
        self.unlock_path(last)
        for comp in self.extra_components:
            comp.release_request(state)
        return int(pages.shape[0] - k)

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
        for name, on_request_cached in hooks.on_request_cached:
            value = on_request_cached(state, end, False)
            if value is not None:
                values[name] = value
        new_pages = np.concatenate([prefix, pages[prefix.shape[0] :]])
        return RequestState(state.key, new_pages, prefix.shape[0] * self.page_size, end.id, state.priority, values)
