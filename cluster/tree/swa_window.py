"""Window-aware SWA eviction: which cached SWA pages no hit point needs, and in what order they go.

Runs on the head, inside the replica's radix tree (the SWA component calls it when its pool is short);
it only reads node pages and ``swa_of`` and returns a plan, the component frees the pages.

A match ends at a node end ``p`` (a split point becomes one) and reads the SWA KV of ``[p - window, p)``:
the end of its own node and, when that node is shorter than the window, the tails of its ancestors. So a
node's SWA pages before its last ``window`` tokens serve no hit at its end, and an ancestor's pages serve
a descendant's hit only within ``window`` tokens of that descendant's end. Hit points (node ends whose
window is live now) come in two ranks:

- primary: a leaf, a branch point (several children), or a node whose one child is not live in L1 (a
  tombstone, an L2- or L3-only node, a load in flight): where a conversation continues or branches;
  a child outside L1 counts as a hit point at its start's side too (an L2 hit at its end reads the tail
  of the L1 node above it when it is shorter than the window), whatever its host tail;
- secondary: a node with one live L1 child: a past turn's end inside a chain that went on (a hit there
  means going back and branching, which is rarer than continuing).

``plan_trims`` computes, in one pass over the L1 tree, for every node the suffix that the hit points of
each rank need (a max over its own end and its descendants' ends within reach) and returns the pages
beyond it: phase 1, pages no hit point needs (heads of long nodes, the tails of windows whose hit point
went); phase 2, pages only secondary hit points need. The component frees phase 1, then phase 2, each in
LRU order of the nodes, and only then tombstones whole tails in LRU order (the last hit points go).
Live pages stay a suffix of every node (a trim frees a node's head), so the match rule and the L2 host
tails read partially trimmed nodes as they read the trimmed requests' nodes. Nodes a lock covers, nodes
being loaded and nodes with a D->H copy queued keep all their pages (the copy reads them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hicache.cluster.tree.allocator import count_true
from hicache.cluster.tree.node import TreeNode

if TYPE_CHECKING:
    from hicache.cluster.tree.swa import SWAComponent

NO_NEED = -(1 << 62)  # "no hit point needs any of this node" (below any real need)


@dataclass(frozen=True)
class Trim:
    """Free the SWA pages of ``node`` before its last ``keep`` pages (phase 1: no hit point needs them;
    phase 2: only secondary hit points do)."""

    phase: int
    last_access: int
    node_id: int
    node: TreeNode
    keep: int

    def order(self) -> tuple[int, int, int]:
        return self.phase, self.last_access, self.node_id


def is_primary(node: TreeNode, swa_of: np.ndarray) -> bool:
    """Whether ``node``'s end is a primary hit point (see the module docstring): not one live L1 child."""
    kids = node.children
    if len(kids) != 1:
        return True
    (child,) = kids.values()
    pages = child.device_pages
    return pages is None or child.loading or swa_of.item(pages.item(-1)) < 0


def plan_trims(swa: SWAComponent, with_secondary: bool) -> list[Trim]:
    """The trims of phase 1 (and of phase 2 when ``with_secondary``), in the order they should be applied.

    One pass over the L1 nodes: pre-order for the live run ending at each node end (does its window hold
    live SWA KV: ``limit_match``'s rule), post-order for the need of each rank (tokens before the node's
    end that hit points at or below it read)."""
    tree = swa.tree
    w, ps = swa.window, swa.page_size
    swa_of = swa.mapped.swa_of
    order: list[TreeNode] = []
    parent_of: list[int] = []
    live: list[int] = []  # live tail, pages
    run: list[int] = []  # live tokens ending at the node's end (capped at the window)
    from_root: list[bool] = []
    below: list[int] = []  # tokens the node's children outside L1 (L2/L3 hits to come) may read above them
    for root in tree.roots().values():
        stack = [(c, -1) for c in root.children.values() if c.device_pages is not None]
        while stack:
            node, pi = stack.pop()
            pages = node.device_pages
            assert pages is not None  # only L1 nodes are pushed (an L1 node's parent is in L1)
            n = pages.shape[0]
            if swa_of.item(pages.item(0)) >= 0:
                t = n
            elif swa_of.item(pages.item(-1)) < 0:
                t = 0
            else:
                t = count_true(swa_of[pages] >= 0)
            if t == n:
                r = t * ps + (run[pi] if pi >= 0 else 0)
                fr = from_root[pi] if pi >= 0 else True
            else:
                r, fr = t * ps, False
            i = len(order)
            order.append(node)
            parent_of.append(pi)
            live.append(t)
            run.append(min(r, w))
            from_root.append(fr)
            reach = NO_NEED
            for c in node.children.values():
                if c.device_pages is not None:
                    stack.append((c, i))
                elif w - c.num_tokens > reach:  # a hit at its end (or below) may come back through L2 or L3
                    reach = w - c.num_tokens
            below.append(reach)
    size = len(order)
    need_all = [NO_NEED] * size  # max over the children's hit points of the tokens they read above
    need_primary = [NO_NEED] * size  # the node's end (filled in from the children first)
    out: list[Trim] = []
    for i in range(size - 1, -1, -1):  # children come after their parent in ``order``
        node = order[i]
        t = live[i]
        hit = t > 0 and (run[i] >= w or from_root[i])
        a, b = max(need_all[i], below[i]), max(need_primary[i], below[i])
        if hit:
            a = w
            if is_primary(node, swa_of):
                b = w
        if node.loading:  # its window is being loaded: as if a primary hit point read it
            a = b = w
        pi = parent_of[i]
        n_tokens = node.num_tokens
        if pi >= 0:
            if a - n_tokens > need_all[pi]:
                need_all[pi] = a - n_tokens
            if b - n_tokens > need_primary[pi]:
                need_primary[pi] = b - n_tokens
        if t == 0 or node.loading or node.staged_slots is not None or swa._state(node).lock:
            continue
        n = n_tokens // ps
        keep_all = min(n, -(-a // ps)) if a > 0 else 0
        if t > keep_all:
            out.append(Trim(1, node.last_access, node.id, node, keep_all))
        if with_secondary:
            keep_primary = min(n, -(-b // ps)) if b > 0 else 0
            if min(t, keep_all) > keep_primary:
                out.append(Trim(2, node.last_access, node.id, node, keep_primary))
    out.sort(key=Trim.order)
    return out
