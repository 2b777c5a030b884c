"""Full component HiCache hooks with a recording host: one KV transfer along the chain, host eviction at
host leaves in LRU order (the HiCache controller drives the same moves with real transfers)."""

from __future__ import annotations

import numpy as np
import pytest
from support.hybrid_model import RecordingHost, RecordingTracker
from support.tree_model import snapshot

from hicache.cluster.tree import ComponentTransfer, HiCachePhase, RadixKey, RadixTree, RequestState, TreeConfig


def chain_tree(page_size=2):
    """Nodes a = tokens [0, 4), b = [4, 8) below a, c = [8, 12) below b; all device-only."""
    tree = RadixTree(TreeConfig(page_size))
    for n in (4, 8, 12):
        key = RadixKey(np.arange(n, dtype=np.int32))
        m = tree.match_prefix(key)
        tree.inc_lock_ref(m.last_device_node)
        pages = np.concatenate([m.device_pages, tree.alloc(n - m.device_hit_len)])
        tree.cache_finished_req(RequestState(key, pages, m.device_hit_len, m.last_device_node))
    a, b, c = sorted(tree.iter_nodes(), key=tree.depth)
    return tree, a, b, c


def backup(full, node, host):
    transfers = full.build_hicache_transfers(node, HiCachePhase.BACKUP)
    full.commit_hicache_transfer(node, HiCachePhase.BACKUP, host.place(transfers))
    return transfers


def test_backup_is_one_transfer_along_the_ancestors_without_a_host_copy():
    tree, a, b, c = chain_tree()
    full, host = tree.full, RecordingHost()
    (t,) = backup(full, b, host)
    assert (t.component, t.node_id, t.num_tokens, t.dst) == ("full", b.id, 8, None)
    np.testing.assert_array_equal(t.src, np.r_[a.device_pages, b.device_pages])
    np.testing.assert_array_equal(a.host_slots, [1000, 1001])
    np.testing.assert_array_equal(b.host_slots, [1002, 1003])
    assert c.host_slots is None
    assert full.build_hicache_transfers(b, HiCachePhase.BACKUP) == ()  # already on the host
    (t,) = backup(full, c, host)  # only c is missing: the chain starts below b
    np.testing.assert_array_equal(t.src, c.device_pages)
    np.testing.assert_array_equal(c.host_slots, [1004, 1005])
    tree.check_invariants()


def test_backup_commit_survives_a_split_and_failure_records_nothing():
    tree, a, b, c = chain_tree()
    full, host = tree.full, RecordingHost()
    transfers = full.build_hicache_transfers(b, HiCachePhase.BACKUP)
    full.commit_hicache_transfer(b, HiCachePhase.BACKUP, transfers, ok=False)
    assert a.host_slots is None and b.host_slots is None
    # A match splits b while the backup is in flight: the commit spreads the ids over the new nodes.
    tree.match_prefix(RadixKey(np.r_[np.arange(6), 99, 99].astype(np.int32)))
    prefix = b.parent
    assert prefix is not a and prefix.num_tokens == 2
    full.commit_hicache_transfer(b, HiCachePhase.BACKUP, host.place(transfers))
    np.testing.assert_array_equal(np.r_[a.host_slots, prefix.host_slots, b.host_slots], np.arange(1000, 1004))
    tree.check_invariants()


def test_no_backup_while_an_ancestor_backup_is_in_flight():
    tree, a, b, c = chain_tree()
    a.staged_slots = np.array([7, 8], dtype=np.int32)  # the controller staged a's copy
    assert tree.full.build_hicache_transfers(c, HiCachePhase.BACKUP) == ()


def test_load_back_moves_the_loading_chain_in_one_transfer():
    tree, a, b, c = chain_tree()
    full, host = tree.full, RecordingHost()
    backup(full, c, host)
    b.host_pin = 1  # an L2->L3 write of b in flight: the host-only chain cannot merge into one node
    tree.evict(100)
    b.host_pin = 0
    assert tree.num_nodes == 3 and all(n.device_pages is None for n in (a, b, c))
    pages = tree.alloc(12)  # the controller's side: pages attached, chain marked loading
    for i, n in enumerate((a, b, c)):
        full.attach_pages(n, pages[2 * i : 2 * i + 2])
        n.loading = True
    (t,) = full.build_hicache_transfers(c, HiCachePhase.LOAD_BACK)
    assert (t.node_id, t.num_tokens) == (c.id, 12)
    np.testing.assert_array_equal(t.src, np.arange(1000, 1006))
    np.testing.assert_array_equal(t.dst, pages)
    before = snapshot(tree)
    full.commit_hicache_transfer(c, HiCachePhase.LOAD_BACK, host.run((t,)))
    assert snapshot(tree) == before  # nothing to record: the controller clears ``loading``
    for n in (a, b, c):
        n.loading = False
    tree.check_invariants()
    assert tree.match_prefix(RadixKey(np.arange(12, dtype=np.int32))).device_hit_len == 12
    assert host.executed[-1] is t


def test_host_eviction_takes_host_leaves_in_lru_order_and_removes_host_only_nodes():
    tree, a, b, c = chain_tree()
    full, host = tree.full, RecordingHost()
    backup(full, c, host)
    tree.evict(4)  # c leaves L1 (host-only now); a and b stay device+host
    assert c.device_pages is None and b.device_pages is not None
    tracker = RecordingTracker(pinned_ids={a.id})
    assert full.drive_host_eviction(5, tracker) == 8  # c (host leaf), then b (a leaf once c is gone)
    assert tracker.released == [("full", c.id, (1004, 1005), 4), ("full", b.id, (1002, 1003), 4)]
    assert c.id not in {n.id for n in tree.iter_nodes()}  # host-only: it left the tree
    assert b.host_slots is None and b.device_pages is not None  # device+host: only the copy went
    assert full.drive_host_eviction(100, tracker) == 0  # a is pinned
    tree.check_invariants()


def test_bad_hook_input_raises_and_changes_nothing():
    tree, a, b, c = chain_tree()
    full, host = tree.full, RecordingHost()
    with pytest.raises(TypeError, match="HiCachePhase"):
        full.build_hicache_transfers(b, "backup")
    with pytest.raises(ValueError, match="num_tokens"):
        full.drive_host_eviction(-1, RecordingTracker())
    (t,) = host.place(full.build_hicache_transfers(b, HiCachePhase.BACKUP))
    before = snapshot(tree)
    short = ComponentTransfer("full", HiCachePhase.BACKUP, b.id, t.src[:3], t.dst[:3], 6)
    with pytest.raises(ValueError, match="3 host ids"):
        full.commit_hicache_transfer(b, HiCachePhase.BACKUP, (short,))
    other = ComponentTransfer("swa", HiCachePhase.BACKUP, b.id, t.src, t.dst, 8)
    with pytest.raises(ValueError, match="swa/backup given to full"):
        full.commit_hicache_transfer(b, HiCachePhase.BACKUP, (other,))
    with pytest.raises(ValueError, match=f"node {b.id} given to the commit of node {c.id}"):
        full.commit_hicache_transfer(c, HiCachePhase.BACKUP, (t,))
    assert snapshot(tree) == before and a.host_slots is None
