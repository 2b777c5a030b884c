"""Test helpers: a brute-force prefix model and a snapshot of tree state for 'unchanged' checks."""

from __future__ import annotations

import numpy as np

from hicache.cluster.tree import PageOwner, RadixTree


def tree_prefixes(tree: RadixTree) -> dict[tuple, int]:
    """Every cached whole-page prefix as (namespace, tokens...) -> L1 page id of its last page."""
    out: dict[tuple, int] = {}
    ps = tree.page_size
    for ns, root in tree.roots().items():
        stack = [(root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                toks = prefix
                for p in range(child.key.shape[0] // ps):
                    toks = toks + tuple(int(t) for t in child.key[p * ps : (p + 1) * ps])
                    if child.device_pages is not None:
                        out[(ns, *toks)] = int(child.device_pages[p])
                stack.append((child, toks))
    return out


def model_hit(prefixes, ns, tokens, page_size: int) -> int:
    """Longest cached whole-page prefix of ``tokens`` according to the model."""
    n = 0
    toks = tuple(int(t) for t in tokens)
    while n + page_size <= len(toks) and (ns, *toks[: n + page_size]) in prefixes:
        n += page_size
    return n


def snapshot(tree: RadixTree):
    """Everything observable about the tree and its allocator (for 'state unchanged' assertions)."""
    nodes = []
    for node in sorted(tree.iter_nodes(), key=lambda n: n.id):
        nodes.append((
            node.id,
            node.parent.id,
            node.key.tobytes(),
            None if node.device_pages is None else node.device_pages.tobytes(),
            None if node.host_slots is None else node.host_slots.tobytes(),
            node.lock_ref,
            node.hit_count,
            node.stored,
        ))
    alloc = tree.full.allocator
    owners = alloc.owners(np.arange(alloc.capacity)).tobytes()
    free = tuple(sorted(np.flatnonzero(alloc.owners(np.arange(alloc.capacity)) == PageOwner.FREE).tolist()))
    return (tuple(nodes), owners, free, alloc.num_free, tree.full.evictable_tokens, tree.full.protected_tokens,
            tree.storage_only.tokens)
