"""The L1 / L2 eviction queue (``EvictionQueue``): one current entry per node, exact policy order, and a
``clear`` that forgets every node (the host tier clears it when all L2 copies go)."""

from __future__ import annotations

import numpy as np

from hicache.cluster.tree import RadixKey, RadixTree, RequestState, TreeConfig, TreeNode
from hicache.cluster.tree.eviction import EvictionPolicy, EvictionQueue


def put(tree: RadixTree, tokens) -> None:
    key = RadixKey(np.asarray(tokens, dtype=np.int32))
    m = tree.match_prefix(key)
    tree.inc_lock_ref(m.last_device_node)
    pages = np.concatenate([m.device_pages, tree.alloc(len(key) - m.device_hit_len)])
    tree.cache_finished_req(RequestState(key, pages, m.device_hit_len, m.last_device_node))


def test_lock_cycles_add_no_entries_and_eviction_stays_lru():
    tree = RadixTree(TreeConfig(1, 64))
    for base in (0, 10, 20):
        put(tree, range(base, base + 6))
    entries = len(tree.full.queue)
    assert entries == 3
    for _ in range(50):
        for base in (20, 0):  # 10.. stays the least recently used
            m = tree.match_prefix(RadixKey(np.arange(base, base + 6)))
            tree.inc_lock_ref(m.last_device_node)
            tree.dec_lock_ref(m.last_device_node)
            put(tree, range(base, base + 6))
    assert len(tree.full.queue) == entries
    assert tree.evict(1).evicted_tokens == 6
    assert tree.match_prefix(RadixKey(np.arange(10, 16))).device_hit_len == 0
    assert tree.evict(1).evicted_tokens == 6  # then 20.. (0.. was touched last)
    assert tree.match_prefix(RadixKey(np.arange(0, 6))).device_hit_len == 6
    tree.check_invariants()


def test_a_locked_node_popped_from_the_queue_is_queued_again_when_unlocked():
    tree = RadixTree(TreeConfig(1, 64))
    put(tree, range(6))
    m = tree.match_prefix(RadixKey(np.arange(6)))
    tree.inc_lock_ref(m.last_device_node)
    assert tree.evict(6).evicted_tokens == 0  # its entry was popped and dropped
    assert len(tree.full.queue) == 0
    tree.dec_lock_ref(m.last_device_node)
    assert len(tree.full.queue) == 1
    assert tree.evict(6).evicted_tokens == 6
    assert tree.num_nodes == 0


def _node(node_id: int, tick: int) -> TreeNode:
    return TreeNode(node_id, None, np.arange(4, dtype=np.int32), np.arange(4, dtype=np.int32), tick)


def test_clear_and_rebuild_forget_every_node():
    alive = set()
    queue = EvictionQueue(EvictionPolicy.LRU, lambda n: n.id in alive)
    a, b = _node(1, 5), _node(2, 3)
    alive |= {1, 2}
    queue.push(a)
    queue.push(a)
    queue.offer(b)
    assert len(queue) == 2 and queue.is_queued(a) and queue.is_queued(b)
    queue.clear()
    assert len(queue) == 0 and not queue.is_queued(a) and not queue.is_queued(b)
    queue.offer(a)  # queued again after the clear
    assert queue.pop() is a and not queue.is_queued(a)
    assert queue.pop() is None
    alive.discard(2)
    queue.offer(b)  # not a candidate: not queued
    assert len(queue) == 0
    queue.push(a)
    queue.rebuild([a, b])  # b is no candidate: stays unqueued, a gets one entry
    assert len(queue) == 1 and queue.is_queued(a) and not queue.is_queued(b)
    a.last_access = 9  # touched since its push: still popped (requeued at its current key first)
    alive.add(2)
    queue.offer(b)
    assert [queue.pop(), queue.pop(), queue.pop()] == [b, a, None]
