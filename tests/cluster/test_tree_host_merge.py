"""A demoted host-only chain merges into its deepest node (one node per chain for later load-backs, lock
walks and demotions), but never across anything that tells two nodes apart: a branch point, a pin, a
transfer in flight, another priority or L3 state (a lock cannot: a demoted node is unlocked, so its
children are). Real HiCache runs stay bit-identical."""

from __future__ import annotations

import numpy as np
import pytest
from support.hicache_env import HiCacheEnv
from support.hybrid_model import RecordingHost

from hicache.cluster.tree import HiCachePhase, RadixKey, RadixTree, RequestState, TreeConfig


def put(tree: RadixTree, tokens, priority: int = 0) -> None:
    key = RadixKey(np.asarray(tokens, dtype=np.int32))
    m = tree.match_prefix(key)
    tree.inc_lock_ref(m.last_device_node)
    pages = np.concatenate([m.device_pages, tree.alloc(len(key) - m.device_hit_len)])
    tree.cache_finished_req(RequestState(key, pages, m.device_hit_len, m.last_device_node, priority))


def backed_up_chain(host: RecordingHost | None = None, page_size=2):
    """a = tokens [0, 4), b = [4, 8) below a, c = [8, 12) below b: device+host (a fresh host: ids 1000..1005)."""
    tree = RadixTree(TreeConfig(page_size))
    for n in (4, 8, 12):
        put(tree, np.arange(n))
    a, b, c = sorted(tree.iter_nodes(), key=tree.depth)
    backup(tree, c, host or RecordingHost())
    return tree, a, b, c


def backup(tree: RadixTree, node, host: RecordingHost) -> None:
    transfers = tree.full.build_hicache_transfers(node, HiCachePhase.BACKUP)
    tree.full.commit_hicache_transfer(node, HiCachePhase.BACKUP, host.place(transfers))


def test_demoted_chain_becomes_its_deepest_node():
    tree, a, b, c = backed_up_chain()
    free_before = tree.full.allocator.num_free
    assert tree.evict(100).evicted_tokens == 12
    assert tree.full.allocator.num_free == free_before + 6
    (only,) = tree.iter_nodes()
    assert only is c and c.parent is tree.default_root  # the deepest id survives, the others are gone
    np.testing.assert_array_equal(c.key, np.arange(12))
    for gone in (a, b):
        with pytest.raises(ValueError, match="unknown node id"):
            tree.node(gone.id)
    m = tree.match_prefix(RadixKey(np.arange(13, dtype=np.int32)))
    assert (m.device_hit_len, m.host_hit_len, m.best_match_node, m.last_host_node) == (0, 12, c.id, c.id)
    # A request diverging inside the merged node splits it at its own page boundary, as for any node.
    m = tree.match_prefix(RadixKey(np.r_[np.arange(6), 99, 99].astype(np.int32)))
    assert m.host_hit_len == 6 and c.num_tokens == 6 and c.parent.num_tokens == 6
    tree.check_invariants()


def test_merge_keeps_the_slots_in_token_order():
    tree, a, b, c = backed_up_chain()
    tree.evict(100)
    np.testing.assert_array_equal(c.host_slots, np.arange(1000, 1006))  # a's, b's, then c's own


def test_merge_takes_the_newest_access_and_most_hits():
    tree, a, b, c = backed_up_chain()
    a.last_access, a.hit_count = 10**6, 50
    created = c.created
    tree.evict(100)
    assert (c.last_access, c.hit_count, c.created) == (10**6, 50, created)


@pytest.mark.parametrize(
    "differ, survivors",
    [
        (lambda a, b, c: setattr(b, "host_pin", 1), "abc"),  # b pinned (an L2->L3 write): merges with neither
        (lambda a, b, c: setattr(c, "host_pin", 1), "bc"),  # c pinned: a merges into b, b stays apart from c
        (lambda a, b, c: setattr(b, "priority", 5), "abc"),  # b's priority differs from both neighbours
        (lambda a, b, c: (setattr(a, "priority", 5), setattr(b, "priority", 5)), "bc"),
        (lambda a, b, c: (setattr(a, "stored", True), setattr(b, "stored", True)), "bc"),  # c not in L3
        (lambda a, b, c: setattr(c, "pending", object()), "bc"),  # a transfer of c in flight
    ],
)
def test_nodes_that_differ_do_not_merge(differ, survivors):
    tree, a, b, c = backed_up_chain()
    differ(a, b, c)
    tree.evict(100)
    assert set(tree.iter_nodes()) == {dict(a=a, b=b, c=c)[x] for x in survivors}
    assert all(n.device_pages is None for n in tree.iter_nodes())
    assert sum(n.num_tokens for n in tree.iter_nodes()) == 12
    c.pending = None
    tree.check_invariants()


def test_branch_points_do_not_merge_but_their_parents_do():
    host = RecordingHost()
    tree, a, b, c = backed_up_chain(host)
    put(tree, np.r_[np.arange(8), 90, 91, 92, 93])  # d below b: b is a branch point
    (d,) = [n for n in b.children.values() if n is not c]
    backup(tree, d, host)
    tree.evict(100)
    assert set(tree.iter_nodes()) == {b, c, d}  # a merged into b; b keeps its two children
    np.testing.assert_array_equal(b.key, np.arange(8))
    tree.check_invariants()


def test_merged_conversation_loads_back_bit_identical():
    """Three turns of a conversation leave L1 (one merged host-only node), come back in one load, then a
    second conversation diverges in the middle of the merged node: every hit is checked byte for byte
    (``HiCacheEnv.serve``)."""
    env = HiCacheEnv(page_size=4, device_pages=24, host_slots=64)
    rng = np.random.default_rng(3)
    turns = [rng.integers(0, 1000, size=n, dtype=np.int32) for n in (16, 12, 12)]
    conv = np.concatenate(turns)
    for end in (16, 28, 40):
        env.serve(conv[:end])
        env.head.flush_write_through_acks()
    env.serve(np.arange(5000, 5000 + 96, dtype=np.int32))  # other traffic pushes the conversation out of L1
    env.head.flush_write_through_acks()
    tree = env.head.tree
    m = env.head.match_prefix(RadixKey(conv))
    assert m.device_hit_len == 0 and m.host_hit_len == 40
    node = tree.node(m.best_match_node)
    assert node.num_tokens == 40 and node.parent is tree.default_root  # the three turns are one node
    stats = env.serve(np.r_[conv, 1, 2, 3, 4])
    assert stats["loaded"] == 40
    env.head.flush_write_through_acks()
    env.serve(np.arange(6000, 6000 + 96, dtype=np.int32))
    env.head.flush_write_through_acks()
    stats = env.serve(np.r_[conv[:20], 9, 9, 9, 9])  # diverges inside the merged node (a split)
    assert stats["device_hit"] + stats["loaded"] == 20
    tree.check_invariants()
    env.head.controller.check_invariants()


# -- merges as a backup lands (RadixTree.merge_backed_up) -----------------------------------------------


def _turns(env: HiCacheEnv, first: np.ndarray, second: np.ndarray, before_ack=None):
    """Serves ``first``, then ``first + second`` (write-through: the new leaf's backup is queued), runs
    ``before_ack(head, first_node)``, then applies every ack. Returns (first's node, second's node)."""
    head, tree = env.head, env.head.tree
    env.serve(first)
    head.flush_write_through_acks()
    first_node = tree.node(head.match_prefix(RadixKey(first)).last_device_node)
    env.serve(np.r_[first, second])
    leaf = tree.node(head.match_prefix(RadixKey(np.r_[first, second])).last_device_node)
    assert leaf.parent is first_node and leaf.staged_slots is not None  # the backup is in flight
    if before_ack is not None:
        before_ack(head, first_node)
    head.flush_write_through_acks()
    return first_node, leaf


def test_acked_leaf_absorbs_its_backed_up_parent():
    env = HiCacheEnv(page_size=4, device_pages=32, host_slots=64)
    first, second = np.arange(16, dtype=np.int32), np.arange(100, 112, dtype=np.int32)
    a, leaf = _turns(env, first, second)
    tree = env.head.tree
    assert a.parent is None and leaf.parent is tree.default_root  # one node, the leaf's id
    with pytest.raises(ValueError, match="unknown node id"):
        tree.node(a.id)
    np.testing.assert_array_equal(leaf.key, np.r_[first, second])
    assert leaf.device_pages.shape == (7,) and leaf.host_slots.shape == (7,)
    assert a.device_pages is None and a.host_slots is None  # the absorbed node holds nothing any more
    tree.check_invariants()
    env.head.controller.check_invariants()
    # Its L1 pages and L2 slots are in token order: an L1 hit and, after L1 eviction, a load-back both
    # return exactly the bytes written for these tokens (HiCacheEnv.serve checks every hit).
    assert env.serve(np.r_[first, second, 7, 7, 7, 7])["device_hit"] == 28
    env.head.flush_write_through_acks()
    env.head.evict(10**6)
    stats = env.serve(np.r_[first, second, 7, 7, 7, 7])
    assert stats["loaded"] == 32 and stats["device_hit"] == 0
    env.head.flush_write_through_acks()
    tree.check_invariants()
    env.head.controller.check_invariants()


@pytest.mark.parametrize(
    "before_ack",
    [
        lambda head, a: head.inc_lock_ref(a.id),  # another request holds ``a`` alone: locks differ
        lambda head, a: setattr(a, "priority", 3),  # another priority
        lambda head, a: setattr(a, "host_pin", 1),  # an L2->L3 write of ``a`` in flight
    ],
    ids=["locked", "priority", "pinned"],
)
def test_parent_that_differs_is_not_absorbed(before_ack):
    env = HiCacheEnv(page_size=4, device_pages=32, host_slots=64)
    a, leaf = _turns(env, np.arange(16, dtype=np.int32), np.arange(100, 112, dtype=np.int32), before_ack)
    assert leaf.parent is a and a.parent is env.head.tree.default_root
    assert (a.num_tokens, leaf.num_tokens) == (16, 12)
    a.host_pin = 0
    env.head.tree.check_invariants()
    env.head.controller.check_invariants()


def test_branch_point_is_not_absorbed():
    env = HiCacheEnv(page_size=4, device_pages=32, host_slots=64)
    first = np.arange(16, dtype=np.int32)
    a, leaf = _turns(env, first, np.arange(100, 112, dtype=np.int32),
                     lambda head, a: env.serve(np.r_[first, 500, 501, 502, 503]))
    assert leaf.parent is a and len(a.children) == 2
    env.head.tree.check_invariants()
    env.head.controller.check_invariants()
