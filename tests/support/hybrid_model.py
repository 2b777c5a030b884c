"""Brute-force checks for hybrid trees (SWA, Mamba) and a recording HiCache tracker (a real test double)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hicache.cluster.tree import RadixTree, TreeNode


def path_ends(tree: RadixTree, ns, tokens, limit: int) -> list[tuple[int, TreeNode]]:
    """(end position, node) of every L1 node fully on ``tokens``'s path with end <= ``limit``, root first."""
    root = tree.roots().get(ns)
    out: list[tuple[int, TreeNode]] = []
    if root is None:
        return out
    toks = np.asarray(tokens, dtype=np.int32)
    node, pos = root, 0
    while True:
        nxt = None
        for child in node.children.values():
            n = child.key.shape[0]
            if pos + n <= limit and np.array_equal(child.key, toks[pos : pos + n]):
                nxt = child
                break
        if nxt is None or nxt.device_pages is None:
            return out
        pos += nxt.key.shape[0]
        out.append((pos, nxt))
        node = nxt


def node_pages(path: list[tuple[int, TreeNode]]) -> np.ndarray:
    parts = [n.device_pages for _, n in path]
    return np.concatenate(parts) if parts else np.empty(0, np.int32)


def window_live(swa, pages: np.ndarray, end: int, page_size: int) -> bool:
    """Page-level truth: every page intersecting [end - window, end) has its SWA page."""
    first = max(0, (end - swa.window) // page_size)
    window = pages[first : end // page_size]
    return bool((swa.translate(window) >= 0).all())


def node_prefix(node: TreeNode) -> tuple:
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return tuple(int(t) for t in (np.concatenate(parts[::-1]) if parts else []))


def root_ns(tree: RadixTree, node: TreeNode):
    while node.parent is not None:
        node = node.parent
    return next(ns for ns, r in tree.roots().items() if r is node)


@dataclass
class RecordingTracker:
    """Host-eviction tracker that records what components release; ``pinned_ids`` are never dropped."""

    pinned_ids: set[int] = field(default_factory=set)
    released: list[tuple[str, int, tuple[int, ...], int]] = field(default_factory=list)

    def release(self, component: str, node_id: int, host_ids: np.ndarray, num_tokens: int) -> None:
        self.released.append((component, node_id, tuple(int(x) for x in host_ids), num_tokens))

    def pinned(self, node_id: int) -> bool:
        return node_id in self.pinned_ids


@dataclass
class RecordingHost:
    """A host side for component transfers: hands out host ids, records every executed transfer."""

    next_id: int = 1000
    executed: list = field(default_factory=list)

    def place(self, transfers):
        """BACKUP: fills in destination host ids (what the host tier does), 'executes', returns them."""
        from dataclasses import replace

        out = []
        for t in transfers:
            dst = np.arange(self.next_id, self.next_id + t.src.shape[0], dtype=np.int32)
            self.next_id += t.src.shape[0]
            out.append(replace(t, dst=dst))
        self.executed.extend(out)
        return tuple(out)

    def run(self, transfers):
        self.executed.extend(transfers)
        return tuple(transfers)
