"""Unit tests of the radix tree flows: match, insert, split, locks, eviction policies, request flows."""

from __future__ import annotations

import numpy as np
import pytest
from support.tree_model import snapshot

from hicache.cluster.tree import (
    CacheCapacityError,
    EvictionPolicy,
    InsertParams,
    PageAllocator,
    PageOwner,
    RadixKey,
    RadixTree,
    RequestState,
    TreeConfig,
)


def make_tree(page_size=1, capacity=None, policy="lru") -> RadixTree:
    return RadixTree(TreeConfig(page_size=page_size, capacity_pages=capacity, eviction_policy=policy))


def put(tree: RadixTree, tokens, extra_key=None, cache_salt=None, priority=0) -> int:
    """Scheduler sequence for one request: match, lock, alloc, finish. Returns the device hit length."""
    key = RadixKey(np.asarray(tokens, dtype=np.int32), extra_key, cache_salt)
    m = tree.match_prefix(key)
    tree.inc_lock_ref(m.last_device_node)
    pages = np.concatenate([m.device_pages, tree.alloc(len(key) - m.device_hit_len)])
    tree.cache_finished_req(RequestState(key, pages, m.device_hit_len, m.last_device_node, priority))
    return m.device_hit_len


def test_match_insert_split_and_pages_follow_tokens():
    tree = make_tree(page_size=2)
    a = np.arange(10, dtype=np.int32)
    pages_a = tree.alloc(10)
    assert tree.insert(InsertParams(RadixKey(a), pages_a)).prefix_len == 0
    b = np.r_[a[:6], 50, 51, 52, 53].astype(np.int32)
    m = tree.match_prefix(RadixKey(b))
    assert m.device_hit_len == 6
    np.testing.assert_array_equal(m.device_pages, pages_a[:3])  # the split kept pages aligned to tokens
    pages_b = np.r_[m.device_pages, tree.alloc(4)]
    assert tree.insert(InsertParams(RadixKey(b), pages_b)).prefix_len == 6
    tree.free(pages_b[3:3])  # nothing to free: pages 3.. were taken by the tree
    m_a = tree.match_prefix(RadixKey(a))
    np.testing.assert_array_equal(m_a.device_pages, pages_a)
    assert tree.num_nodes == 3
    tree.check_invariants()


def test_partial_tail_stays_with_request_and_is_freed():
    tree = make_tree(page_size=4, capacity=8)
    key = RadixKey(np.arange(10))
    m = tree.match_prefix(key)
    tree.inc_lock_ref(m.last_device_node)
    pages = tree.alloc(10)
    assert pages.size == 3
    res = tree.cache_finished_req(RequestState(key, pages, 0, m.last_device_node))
    assert res.freed_pages == 1
    st = tree.stats()
    assert st.cached_tokens == 8 and st.free_pages == 6 and st.request_pages == 0
    assert tree.match_prefix(RadixKey(np.arange(12))).device_hit_len == 8
    tree.check_invariants()


def test_duplicate_pages_freed_when_another_request_cached_first():
    tree = make_tree(page_size=1, capacity=64)
    key = RadixKey(np.arange(8))
    # Two requests miss at the same time, both compute the same tokens.
    states = []
    for _ in range(2):
        m = tree.match_prefix(key)
        tree.inc_lock_ref(m.last_device_node)
        states.append(RequestState(key, tree.alloc(8), 0, m.last_device_node))
    assert tree.cache_finished_req(states[0]).new_prefix_len == 0
    res = tree.cache_finished_req(states[1])
    assert res.new_prefix_len == 8 and res.freed_pages == 8
    assert tree.stats().free_pages == 64 - 8
    tree.check_invariants()


def test_namespaces_never_share_nodes():
    tree = make_tree()
    toks = np.arange(16)
    put(tree, toks)
    assert tree.match_prefix(RadixKey(toks)).device_hit_len == 16
    assert tree.match_prefix(RadixKey(toks, extra_key="lora-a")).device_hit_len == 0
    assert tree.match_prefix(RadixKey(toks, cache_salt="tenant-1")).device_hit_len == 0
    put(tree, toks, extra_key="lora-a")
    assert tree.match_prefix(RadixKey(toks, extra_key="lora-a")).device_hit_len == 16
    assert tree.match_prefix(RadixKey(toks, extra_key="lora-a", cache_salt="s")).device_hit_len == 0
    assert tree.stats().cached_tokens == 32
    tree.check_invariants()


def test_namespace_lookups_find_each_node_its_root():
    """namespace_of / in_namespace / is_root, over many namespaces (O(depth) each), and a node of
    another tree is refused."""
    tree = make_tree()
    toks = np.arange(12)
    for salt in (None, "a", "b", "c"):
        put(tree, toks, cache_salt=salt)
    for salt in (None, "a", "b", "c"):
        node = tree.match_prefix(RadixKey(toks, cache_salt=salt)).last_device_node
        leaf = tree.node(node)
        assert tree.namespace_of(leaf) == (None, salt)
        assert tree.in_namespace(leaf, (None, salt)) and not tree.in_namespace(leaf, ("x", salt))
        assert not tree.is_root(leaf) and tree.is_root(tree.roots()[(None, salt)])
    other = make_tree()
    put(other, toks)
    stranger = other.node(other.match_prefix(RadixKey(toks)).last_device_node)
    with pytest.raises(ValueError, match="not in this tree"):
        tree.namespace_of(stranger)
    assert not tree.is_root(other.roots()[(None, None)])  # same id as a root here, another object


def test_token_inputs_lists_and_numpy_dtypes_agree():
    tree = make_tree()
    put(tree, [5, 6, 7, 8])
    for toks in ([5, 6, 7, 8], np.array([5, 6, 7, 8], dtype=np.int64), np.array([5, 6, 7, 8], dtype=np.uint16)):
        assert tree.match_prefix(RadixKey(toks)).device_hit_len == 4


@pytest.mark.parametrize(
    "bad, exc",
    [([1, -2, 3], ValueError), ([1.5, 2.0], TypeError), (["a", "b"], TypeError), (np.array([1.0]), TypeError),
     (np.array([[1, 2]]), ValueError), ([2**40], ValueError), ("123", TypeError), ([True, False], TypeError)],
)
def test_bad_token_ids_rejected(bad, exc):
    with pytest.raises(exc):
        RadixKey(bad)


def test_locked_nodes_survive_eviction_and_accounting():
    tree = make_tree(capacity=32)
    put(tree, np.arange(10))
    put(tree, np.arange(100, 110))
    m = tree.match_prefix(RadixKey(np.arange(10)))
    assert tree.inc_lock_ref(m.last_device_node) == -10
    st = tree.stats()
    assert (st.evictable_tokens, st.protected_tokens) == (10, 10)
    assert tree.evict(100).evicted_tokens == 10
    assert tree.match_prefix(RadixKey(np.arange(10))).device_hit_len == 10
    assert tree.match_prefix(RadixKey(np.arange(100, 110))).device_hit_len == 0
    assert tree.dec_lock_ref(m.last_device_node) == 10
    with pytest.raises(ValueError, match="not locked"):
        tree.dec_lock_ref(m.last_device_node)
    assert tree.evict(100).evicted_tokens == 10
    st = tree.stats()
    assert st.cached_tokens == 0 and st.free_pages == 32 and st.num_nodes == 0
    tree.check_invariants()


def test_lock_on_a_split_path_keeps_both_halves_locked():
    tree = make_tree(capacity=64)
    put(tree, np.arange(20))
    m = tree.match_prefix(RadixKey(np.arange(20)))
    tree.inc_lock_ref(m.last_device_node)
    tree.match_prefix(RadixKey(np.r_[np.arange(7), 99]))  # splits the locked node at 7
    assert tree.num_nodes == 2
    assert tree.evict(100).evicted_tokens == 0
    assert tree.stats().protected_tokens == 20
    tree.dec_lock_ref(m.last_device_node)
    assert tree.stats().evictable_tokens == 20
    tree.check_invariants()


@pytest.mark.parametrize("policy", list(EvictionPolicy))
def test_eviction_order_per_policy(policy):
    tree = make_tree(capacity=64, policy=policy)
    seqs = [np.arange(i * 100, i * 100 + 8) for i in range(4)]
    for i, s in enumerate(seqs):
        put(tree, s, priority=[3, 0, 2, 1][i])
    for _ in range(3):
        put(tree, seqs[3])  # seq 3: most hits (an insert over cached tokens is a hit) ...
    for s in seqs[:3]:
        put(tree, s)  # ... but least recently used once 0, 1, 2 are used again
    tree.evict(8)
    alive = [tree.match_prefix(RadixKey(s)).device_hit_len == 8 for s in seqs]
    # lfu: 0, 1, 2 tie on one hit, 0 is the least recent of them; fifo: 0 was created first;
    # priority: seq 1 has the lowest priority.
    expected_victim = {"lru": 3, "lfu": 0, "fifo": 0, "priority": 1}[policy.value]
    assert alive == [i != expected_victim for i in range(4)], (policy, alive)


def test_lru_victim_is_least_recently_matched():
    tree = make_tree(capacity=64)
    seqs = [np.arange(i * 100, i * 100 + 8) for i in range(3)]
    for s in seqs:
        put(tree, s)
    tree.match_prefix(RadixKey(seqs[0]))  # 0 is now the most recent; 1 is the oldest
    tree.evict(1)
    assert tree.match_prefix(RadixKey(seqs[1])).device_hit_len == 0
    assert tree.match_prefix(RadixKey(seqs[0])).device_hit_len == 8


def test_eviction_goes_leaf_first_and_parent_follows():
    tree = make_tree(capacity=64)
    put(tree, np.arange(10))
    put(tree, np.r_[np.arange(10), np.arange(50, 55)])
    assert tree.num_nodes == 2
    assert tree.evict(1).evicted_tokens == 5  # the leaf
    assert tree.match_prefix(RadixKey(np.arange(10))).device_hit_len == 10
    assert tree.evict(1).evicted_tokens == 10  # then its parent, now a leaf
    assert tree.num_nodes == 0


def test_alloc_evicts_on_demand_and_fails_cleanly():
    tree = make_tree(page_size=2, capacity=10)
    put(tree, np.arange(12))  # 6 pages cached
    m = tree.match_prefix(RadixKey(np.arange(4)))
    tree.inc_lock_ref(m.last_device_node)  # first 4 tokens (2 pages) locked
    pages = tree.alloc(16)  # 8 pages: 4 free + 4 evicted
    assert pages.size == 8 and tree.stats().cached_tokens == 4
    before = snapshot(tree)
    with pytest.raises(CacheCapacityError):
        tree.alloc(8)  # 0 free, 0 evictable
    assert snapshot(tree) == before
    tree.free(pages)
    tree.check_invariants()


def test_cache_unfinished_req_chunked_prefill():
    tree = make_tree(page_size=4, capacity=64)
    full = np.arange(30, dtype=np.int32)
    key1 = RadixKey(full[:10])
    m = tree.match_prefix(key1)
    tree.inc_lock_ref(m.last_device_node)
    pages = tree.alloc(10)
    st = tree.cache_unfinished_req(RequestState(key1, pages, 0, m.last_device_node))
    assert st.prefix_len == 8 and st.device_pages.size == 3
    np.testing.assert_array_equal(st.device_pages, pages)  # nothing duplicated: same pages
    assert tree.stats().protected_tokens == 8
    # Next chunk: extend the same request to 30 tokens.
    more = tree.alloc(30 - 12)
    key2 = RadixKey(full)
    st2 = tree.cache_unfinished_req(RequestState(key2, np.r_[st.device_pages, more], st.prefix_len, st.last_node))
    assert st2.prefix_len == 28
    fin = tree.cache_finished_req(st2)
    assert fin.new_prefix_len == 28 and fin.freed_pages == 1
    st_ = tree.stats()
    assert st_.protected_tokens == 0 and st_.cached_tokens == 28 and st_.request_pages == 0
    tree.check_invariants()


def _bad_calls(tree, held, locked_node):
    key = RadixKey(np.arange(200, 208))  # not cached: every page of an insert would be taken
    return [
        (lambda: tree.insert(InsertParams(key, held[:2])), ValueError),  # too few pages
        (lambda: tree.insert(InsertParams(key, np.r_[held[:7], held[0]])), ValueError),  # duplicate page
        (lambda: tree.insert(InsertParams(key, np.arange(8) + 1000)), ValueError),  # out of range
        (lambda: tree.insert(InsertParams(key, np.r_[held[:7], -1])), ValueError),  # negative
        (lambda: tree.insert(InsertParams(key, np.zeros(8, np.float32))), TypeError),
        (lambda: tree.insert(InsertParams(np.arange(8), held)), TypeError),
        (lambda: tree.inc_lock_ref(10**6), ValueError),
        (lambda: tree.dec_lock_ref(10**6), ValueError),
        (lambda: tree.dec_lock_ref("3"), TypeError),
        (lambda: tree.free(held[:1].tolist() * 2), ValueError),  # duplicate in one call
        (lambda: tree.free([10**6]), ValueError),
        (lambda: tree.evict(-1), ValueError),
        (lambda: tree.alloc(-5), ValueError),
        (lambda: tree.alloc(1.5), ValueError),
        (lambda: tree.cache_finished_req(RequestState(key, held[:8], 0, 10**6)), ValueError),
        (lambda: tree.cache_finished_req(RequestState(key, held[:3], 0, locked_node)), ValueError),
        (lambda: tree.cache_finished_req(RequestState(key, held[:8], 3, locked_node)), ValueError),
        (lambda: tree.cache_finished_req(RequestState(key, held[:8], 4, locked_node)), ValueError),  # wrong depth
    ]


def test_bad_input_leaves_tree_exactly_as_it_was():
    tree = make_tree(capacity=64)
    put(tree, np.arange(4))
    put(tree, np.arange(50, 60))
    m = tree.match_prefix(RadixKey(np.arange(50, 60)))
    tree.inc_lock_ref(m.last_device_node)
    held = tree.alloc(10)
    tree_page = tree.match_prefix(RadixKey(np.arange(4))).device_pages[0]
    before = snapshot(tree)
    calls = _bad_calls(tree, held, m.last_device_node)
    calls += [
        (lambda: tree.free([int(tree_page)]), ValueError),  # a page the tree owns
        (lambda: tree.insert(InsertParams(RadixKey(np.arange(90, 98)), np.r_[held[:7], tree_page])), ValueError),
    ]
    for fn, exc in calls:
        with pytest.raises(exc):
            fn()
        assert snapshot(tree) == before, fn
    tree.free(held)
    with pytest.raises(ValueError, match="double free"):
        tree.free(held[:1])
    tree.check_invariants()


def test_reset_and_stats():
    tree = make_tree(capacity=16)
    put(tree, np.arange(8))
    tree.match_prefix(RadixKey(np.arange(12)))
    st = tree.stats()
    assert st.cached_tokens == 8 and st.match_calls == 2 and st.num_nodes == 1
    tree.reset()
    st = tree.stats()
    assert st.cached_tokens == 0 and st.free_pages == 16 and st.num_nodes == 0 and st.match_calls == 0
    tree.check_invariants()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_config(bad):
    with pytest.raises(ValueError):
        TreeConfig(page_size=bad)
    with pytest.raises(ValueError):
        TreeConfig(capacity_pages=bad)


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        TreeConfig(eviction_policy="mru")


def test_single_slot_allocator_ops_match_the_array_ops_and_reject_bad_ids():
    a = PageAllocator(3)
    slots = [a.alloc_one() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and a.num_free == 0 and a.count(PageOwner.REQUEST) == 3
    with pytest.raises(CacheCapacityError):
        a.alloc_one()
    a.check_one(slots[0], PageOwner.REQUEST)
    a.transfer_one(slots[0], PageOwner.TREE)
    for bad, match in ((slots[0], "is TREE, expected REQUEST"), (-1, "out of range"), (3, "out of range")):
        with pytest.raises(ValueError, match=match):
            a.check_one(bad, PageOwner.REQUEST)
    a.release_one(slots[1])
    with pytest.raises(ValueError, match="double free"):
        a.check_one(slots[1], PageOwner.REQUEST)
    assert a.alloc_one() == slots[1] and a.owners(np.array(slots)).tolist() == [PageOwner.TREE, 1, 1]
    grown = PageAllocator(None, initial=1)
    assert [grown.alloc_one() for _ in range(3)] == [0, 1, 2] and grown.capacity >= 3


def test_namespace_roots_stay_bounded_with_a_new_cache_salt_per_request():
    """A new cache_salt per request (every namespace used once) keeps at most about twice the live roots,
    not one root per request: roots nothing hangs below or holds are dropped at a sweep. The tree still
    caches and evicts as before, and its invariants hold."""
    from hicache.cluster.tree.structure import ROOT_SWEEP_MIN

    tree = make_tree(page_size=1, capacity=256)
    requests = 3 * ROOT_SWEEP_MIN + 7
    for i in range(requests):
        assert put(tree, np.arange(i % 5, i % 5 + 12), cache_salt=f"request-{i}") == 0
    assert len(tree.roots()) <= 2 * ROOT_SWEEP_MIN + 1
    assert len(tree.roots()) < requests // 2
    assert tree.num_nodes <= 256  # every node holds L1 pages: the capacity bounds them
    tree.check_invariants()
    last = (requests - 1) % 5
    assert put(tree, np.arange(last, last + 12), cache_salt=f"request-{requests - 1}") == 12  # still cached


def test_a_root_held_by_a_request_or_a_pin_survives_the_sweep_and_an_idle_one_goes():
    """A request that matched nothing holds its namespace root (its lock, taken on the root): a sweep keeps
    it, and the request's finish inserts below it. A pinned root (an L3 prefetch anchored there) is kept
    too. A root that nothing holds is dropped: its id is then unknown, as an evicted node's."""
    from hicache.cluster.tree.structure import ROOT_SWEEP_MIN

    tree = make_tree(page_size=1, capacity=64)
    held_key = RadixKey(np.arange(8, dtype=np.int32), cache_salt="held")
    m = tree.match_prefix(held_key)
    held = m.last_device_node
    tree.inc_lock_ref(held)
    pages = tree.alloc(8)
    pinned = tree.node(tree.match_prefix(RadixKey([1], cache_salt="pinned")).last_device_node)
    pinned.host_pin += 1
    idle = tree.match_prefix(RadixKey([1], cache_salt="idle")).last_device_node
    for i in range(ROOT_SWEEP_MIN + 1):  # enough new namespaces for a sweep
        tree.match_prefix(RadixKey([1], cache_salt=f"other-{i}"))
    assert tree.node(held) is tree.roots()[(None, "held")]
    assert tree.roots()[(None, "pinned")] is pinned
    assert (None, "idle") not in tree.roots()
    with pytest.raises(ValueError, match="unknown node id"):
        tree.node(idle)
    tree.cache_finished_req(RequestState(held_key, pages, 0, held))
    assert tree.match_prefix(held_key).device_hit_len == 8
    tree.check_invariants()
    # the finish released the root's lock: with its pages evicted, the next sweep drops it
    tree.evict(64)
    pinned.host_pin -= 1
    for i in range(2 * ROOT_SWEEP_MIN + 1):
        tree.match_prefix(RadixKey([1], cache_salt=f"again-{i}"))
    assert (None, "held") not in tree.roots() and (None, "pinned") not in tree.roots()
    tree.check_invariants()
