"""Unit tests of the hybrid components: SWA tombstones/locks/eviction, Mamba copy-on-write, the builder,
the chunk cache, per-component HiCache hooks (with a recording host double) and bad input."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from support.hybrid_model import RecordingHost, RecordingTracker
from support.tree_model import snapshot

from hicache.cluster.builder import (
    ChunkCache,
    ComponentKind,
    KVCacheConfig,
    MambaConfig,
    SWAConfig,
    build_kv_cache,
    parse_components,
)
from hicache.cluster.tree import (
    CacheCapacityError,
    ComponentTransfer,
    HiCachePhase,
    MambaComponent,
    MambaRequest,
    PageOwner,
    RadixKey,
    RadixTree,
    RequestState,
    SWAComponent,
    TreeConfig,
)


def swa_tree(window=4, page_size=1, capacity=None, swa_tokens=None) -> RadixTree:
    return build_kv_cache(KVCacheConfig(TreeConfig(page_size, capacity), "swa", swa=SWAConfig(window, swa_tokens)))


def mamba_tree(slots=None, page_size=1, capacity=None) -> RadixTree:
    return build_kv_cache(KVCacheConfig(TreeConfig(page_size, capacity), "mamba", mamba=MambaConfig(slots)))


def start(tree: RadixTree, tokens, extra=0):
    key = RadixKey(np.asarray(tokens, dtype=np.int32))
    m = tree.match_prefix(key)
    tree.inc_lock_ref(m.last_device_node)
    values = tree.begin_request(m)
    pages = np.r_[m.device_pages, tree.alloc(len(key) + extra - m.device_hit_len)].astype(np.int32)
    return m, RequestState(key, pages, m.device_hit_len, m.last_device_node, 0, values)


def serve(tree: RadixTree, tokens, trim=True):
    """One request; ``trim``: its SWA pages out of the window are trimmed and freed at once (the SWA
    pool reclaiming them before the request is cached), so the cached run has a tombstoned head."""
    m, state = start(tree, tokens)
    if trim:
        tree.trim_request(state)
        if "swa" in tree.component_names:
            tree.component("swa").release_spare()
    tree.cache_finished_req(state)
    tree.check_invariants()
    return m


# -- builder ---------------------------------------------------------------------------------------
def test_builder_compositions_and_chunk_cache():
    assert parse_components("swa") == (ComponentKind.FULL, ComponentKind.SWA)
    assert parse_components(["mamba", "full", "swa"]) == (ComponentKind.FULL, ComponentKind.SWA, ComponentKind.MAMBA)
    assert build_kv_cache(KVCacheConfig()).component_names == ("full",)
    both = build_kv_cache(KVCacheConfig(TreeConfig(2), "swa,mamba", swa=SWAConfig(8), mamba=MambaConfig(4)))
    assert both.component_names == ("full", "swa", "mamba")
    chunk = build_kv_cache(KVCacheConfig(TreeConfig(2, 8), reuse=False))
    assert isinstance(chunk, ChunkCache)
    for _ in range(3):  # same scheduler code; nothing is ever reused, every page comes back
        m = serve(chunk, range(7))
        assert m.device_hit_len == 0
    assert chunk.stats().free_pages == 8 and chunk.num_nodes == 0


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: SWAConfig(0), "window must be a positive int, got 0"),
        (lambda: SWAConfig(-3), "got -3"),
        (lambda: SWAComponent(0), "got 0"),
        (lambda: KVCacheConfig(components="full,lstm"), "unknown cache component 'lstm'"),
        (lambda: KVCacheConfig(components="swa"), "swa config is None"),
        (lambda: KVCacheConfig(components="full,full"), "duplicate"),
        (lambda: MambaComponent(4, state_shapes=((2, 0),)), r"\(2, 0\)"),
        (lambda: MambaComponent(4, dtype="nope"), "'nope'"),
        (lambda: build_kv_cache(KVCacheConfig(TreeConfig(4), "swa", swa=SWAConfig(8, 2))), "less than one page"),
    ],
)
def test_bad_config_names_the_value(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# -- SWA -------------------------------------------------------------------------------------------
def test_swa_trim_makes_tombstones_and_match_needs_the_window():
    tree = swa_tree(window=4)
    swa = tree.component("swa")
    serve(tree, range(12))  # trim frees SWA of tokens [0, 8): one node, tombstoned head [0,8), live tail
    assert tree.num_nodes == 1
    (node,) = tree.iter_nodes()
    np.testing.assert_array_equal(swa.translate(node.device_pages) >= 0, np.arange(12) >= 8)
    # a continuation at 12 has its window [8, 12): full hit
    assert tree.match_prefix(RadixKey(np.arange(13))).device_hit_len == 12
    # ending at 6 would need [2, 6): tombstoned, so nothing is served
    m = tree.match_prefix(RadixKey(np.r_[np.arange(6), 99]))
    assert m.device_hit_len == 0 and tree.num_nodes == 2  # the split stays (structure), the hit does not
    stats = swa.stats()["swa"]
    assert (stats.tombstone_nodes, stats.live_nodes) == (1, 1)  # [0,6) tombstone; [6,12) has a live tail
    # a continuation at 12 still hits through the split: [8, 12) lies in [6,12)'s live tail
    assert tree.match_prefix(RadixKey(np.arange(13))).device_hit_len == 12
    tree.check_invariants()


def test_swa_trim_is_lazy_spare_pages_are_cached_live_until_the_pool_needs_them():
    tree = swa_tree(window=4, swa_tokens=24)
    swa = tree.component("swa")
    m, state = start(tree, range(12))
    assert tree.trim_request(state) == 8  # [0, 8) is out of the window of a continuation at 12
    np.testing.assert_array_equal(np.sort(swa.mapped.spare_pages()), np.sort(state.device_pages[:8]))
    assert swa.allocator.num_free == 12  # nothing freed yet: spare, not free
    tree.cache_finished_req(state)  # cached live: a shared prefix keeps its SWA KV
    tree.check_invariants()
    assert swa.mapped.spare_pages().size == 0
    assert tree.match_prefix(RadixKey(np.r_[np.arange(6), 99])).device_hit_len == 6
    # a second request: its trimmed pages are reclaimed before any cached SWA KV is tombstoned
    m, state = start(tree, np.r_[np.arange(12), 20 + np.arange(10)])
    assert m.device_hit_len == 12 and swa.allocator.num_free == 2
    tree.trim_request(state)  # [12, 18) is spare: out of the window of 22
    own = state.device_pages[12:22]
    assert tree.alloc(4).shape[0] == 4  # the SWA pool is 2 short: 2 spare pages go, no tree node is touched
    assert (swa.translate(own[:6]) == -1).sum() == 2 and (swa.translate(own[6:]) >= 0).all()
    assert all(swa.is_live(n) for n in tree.iter_nodes())
    tree.check_invariants()
    assert tree.evict(0, swa_num_tokens=4).components == {"swa_num_tokens": 4}  # spare first, again
    assert (swa.translate(own[:6]) == -1).all() and swa.mapped.spare_pages().size == 0
    assert all(swa.is_live(n) for n in tree.iter_nodes())
    tree.check_invariants()


def test_swa_tombstoned_head_node_is_one_node_and_eviction_tombstones_its_tail():
    tree = swa_tree(window=4)
    swa = tree.component("swa")
    serve(tree, range(12))
    (node,) = tree.iter_nodes()
    assert swa.has_live(node) and not swa.is_live(node)
    # a window longer than the live tail is refused: 11 needs [7, 11), page 7 is tombstoned
    assert tree.match_prefix(RadixKey(np.r_[np.arange(11), 99])).device_hit_len == 0
    assert tree.num_nodes == 2  # the split: [0,11) with live tail [8,11), and [11,12)
    tree.check_invariants()
    assert tree.evict(0, swa_num_tokens=100).components == {"swa_num_tokens": 4}  # both live tails
    assert tree.num_nodes == 0  # tombstoned leaves are dropped outright (then their tombstoned parent)
    assert swa.allocator.num_free == swa.allocator.capacity
    tree.check_invariants()


def test_swa_recompute_revives_tombstone_by_adopting_request_swa():
    tree = swa_tree(window=4)
    swa = tree.component("swa")
    serve(tree, range(12))
    serve(tree, np.r_[np.arange(6), 99, 98, 97, 96], trim=True)  # recomputes [0,6) with live SWA in [2,6)? no:
    # its own window is [6,10) so [0,6) was trimmed: the tombstone [0,6) stays, nothing to adopt
    assert tree.match_prefix(RadixKey(np.arange(6))).device_hit_len == 0
    m, state = start(tree, np.arange(6))  # no trim: the request keeps SWA for all 6 tokens
    assert m.device_hit_len == 0
    tree.cache_finished_req(state)
    tree.check_invariants()
    assert tree.match_prefix(RadixKey(np.arange(6))).device_hit_len == 6  # adopted: live now
    assert swa.stats()["swa"].request_pages == 0


def test_swa_eviction_tombstones_lru_but_never_a_locked_window():
    tree = swa_tree(window=2, swa_tokens=13)
    swa = tree.component("swa")
    serve(tree, range(0, 6), trim=False)
    serve(tree, range(10, 16), trim=False)
    m, state = start(tree, np.r_[np.arange(6), 50])  # locks the window [4, 6) of the first sequence
    assert m.device_hit_len == 6
    res = tree.evict(0, swa_num_tokens=100)
    assert res.components == {"swa_num_tokens": 6}  # only the second sequence could be tombstoned
    assert tree.match_prefix(RadixKey(np.arange(10, 17))).device_hit_len == 0
    assert tree.match_prefix(RadixKey(np.arange(7))).device_hit_len == 6
    tree.cache_finished_req(state)
    tree.check_invariants()
    # the SWA pool is short: alloc tombstones what it needs, then runs out honestly
    assert swa.allocator.num_free == 13 - 7
    tree.alloc(5)
    with pytest.raises(CacheCapacityError, match="SWA pool"):
        tree.alloc(12)


def test_component_queues_hold_one_entry_per_node_across_lock_cycles():
    """Requests locking and unlocking cached nodes add no queue entries; eviction order stays LRU."""
    tree = build_kv_cache(KVCacheConfig(TreeConfig(1, 64), "swa,mamba", swa=SWAConfig(2, 64), mamba=MambaConfig(8)))
    swa, mamba = tree.component("swa"), tree.component("mamba")
    for base in (0, 10, 20):
        serve(tree, range(base, base + 6), trim=False)
    entries = (len(swa.queue), len(mamba.queue))
    for _ in range(50):
        for base in (20, 0):  # touch 20.. then 0..: 10.. is the least recently used
            m = tree.match_prefix(RadixKey(np.arange(base, base + 6)))
            tree.inc_lock_ref(m.last_device_node)
            tree.dec_lock_ref(m.last_device_node)
    assert (len(swa.queue), len(mamba.queue)) == entries
    assert tree.evict(0, mamba_num=1).components == {"mamba_num": 1}  # 10..'s state
    # SWA: first the heads no hit reads (window 2: 4 of each node's 6 tokens), 10..'s first (LRU)
    assert tree.evict(0, swa_num_tokens=1).components == {"swa_num_tokens": 4}
    assert tree.evict(0, swa_num_tokens=8).components == {"swa_num_tokens": 8}  # the other two heads
    assert tree.evict(0, swa_num_tokens=1).components == {"swa_num_tokens": 2}  # and then 10..'s window
    assert tree.stats().num_nodes == 2  # a tombstoned leaf goes entirely
    assert tree.match_prefix(RadixKey(np.arange(10, 16))).device_hit_len == 0
    for base in (0, 20):
        assert tree.match_prefix(RadixKey(np.arange(base, base + 6))).device_hit_len == 6
    tree.check_invariants()


def test_swa_pool_short_trims_a_head_no_hit_reads_and_keeps_the_lru_window():
    """The old eviction tombstoned the LRU node whole (its window too: a miss); now its head goes first."""
    tree = swa_tree(window=4, swa_tokens=30)
    swa = tree.component("swa")
    serve(tree, range(12), trim=False)  # A: one live node [0, 12), the least recently used
    serve(tree, range(100, 112), trim=False)  # B
    assert swa.allocator.num_free == 6
    m, state = start(tree, range(200, 212))  # 12 SWA pages, 6 free: 6 come from the cache
    (a,) = (n for n in tree.iter_nodes() if n.key[0] == 0)
    np.testing.assert_array_equal(swa.translate(a.device_pages) >= 0, np.arange(12) >= 8)  # A's window stays
    tree.cache_finished_req(state)
    tree.check_invariants()
    for base in (0, 100, 200):  # every conversation still continues from its end
        assert tree.match_prefix(RadixKey(np.arange(base, base + 13))).device_hit_len == 12


def test_swa_eviction_drops_past_turn_ends_before_any_conversation_end():
    """Two chats of two turns, leaf shorter than the window: a short pool frees the pages only the first
    turns' ends read (secondary hit points) of both chats; the old LRU tombstone took chat A's first turn
    whole and with it the window of A's end."""
    tree = swa_tree(window=6, swa_tokens=24)
    swa = tree.component("swa")
    for base in (0, 100):
        serve(tree, range(base, base + 6), trim=False)  # turn 1: [0, 6)
        serve(tree, range(base, base + 10), trim=False)  # turn 2 continues it: [6, 10) reads [4, 6)
    tree.match_prefix(RadixKey(np.arange(100, 111)))  # B used last: A is the least recently used
    assert swa.allocator.num_free == 4
    m, state = start(tree, range(200, 210))  # 10 pages, 4 free
    tree.trim_request(state)  # [200, 204) out of its window: spare, and reclaimed first
    tree.cache_finished_req(state)
    tree.check_invariants()
    for base in (0, 100):
        first, second = sorted((n for n in tree.iter_nodes() if n.key[0] in (base, base + 6)), key=tree.depth)
        np.testing.assert_array_equal(swa.translate(first.device_pages) >= 0, np.arange(6) >= 4)  # [4, 6) kept
        assert swa.is_live(second)
        assert tree.match_prefix(RadixKey(np.arange(base, base + 11))).device_hit_len == 10  # the chat goes on
        assert tree.match_prefix(RadixKey(np.r_[np.arange(base, base + 6), 99])).device_hit_len == 0  # turn 1's end
    # the pool is short again: first the head of the third chat that no hit reads (its spare pages were
    # cached live), then A's end, the LRU hit point: its window goes
    for base in (200, 100):
        tree.match_prefix(RadixKey(np.arange(base, base + 11)))
    assert tree.evict(0, swa_num_tokens=5).components == {"swa_num_tokens": 4 + 4}
    assert tree.match_prefix(RadixKey(np.arange(11))).device_hit_len == 0
    # A's first turn keeps [4, 6), which only A's end read: the first pages the next eviction frees, and the
    # node, a tombstoned leaf then, leaves L1
    assert tree.evict(0, swa_num_tokens=1).components == {"swa_num_tokens": 2}
    assert not any(n.key[0] == 0 for n in tree.iter_nodes())
    assert tree.match_prefix(RadixKey(np.arange(100, 111))).device_hit_len == 10
    assert tree.match_prefix(RadixKey(np.arange(200, 211))).device_hit_len == 10
    tree.check_invariants()


def test_swa_lock_is_exact_across_later_splits():
    tree = swa_tree(window=5)
    swa = tree.component("swa")
    serve(tree, range(10), trim=False)
    m, state = start(tree, np.r_[np.arange(10), 77])  # locks window [5, 10) within node [0, 10)
    node = tree.node(m.last_device_node)
    assert swa._state(node).lock == 1 and swa._state(node).bounds == {5: 1}
    serve(tree, np.r_[np.arange(3), 60, 61], trim=False)  # splits at 3: prefix [0,3) is outside the window
    serve(tree, np.r_[np.arange(7), 70, 71], trim=False)  # splits at 7: [3,7) holds the boundary q=5
    locks = {tree.depth(n): swa._state(n).lock for n in tree.iter_nodes()}
    assert locks[3] == 0 and locks[7] == 1 and locks[10] == 1
    tree.cache_finished_req(state)
    assert all(swa._state(n).lock == 0 and swa._state(n).bounds is None for n in tree.iter_nodes())
    tree.check_invariants()


def test_swa_full_eviction_frees_swa_pages_and_paged_insert_cuts_at_page_boundaries():
    tree = swa_tree(window=3, page_size=2, capacity=16)
    swa = tree.component("swa")
    serve(tree, range(11))  # whole pages end at 10; window [7, 10) -> pages 3.. live, pages 0..2 trimmed
    (node,) = tree.iter_nodes()  # one node: tombstoned pages 0..2, live pages 3..4
    np.testing.assert_array_equal(swa.translate(node.device_pages) >= 0, [False] * 3 + [True] * 2)
    tree.evict(100)
    assert tree.num_nodes == 0 and swa.allocator.num_free == swa.allocator.capacity
    tree.check_invariants()


# -- Mamba -----------------------------------------------------------------------------------------
def test_mamba_copy_on_write_two_branches_never_share_a_slot():
    tree = mamba_tree(slots=8)
    mamba = tree.component("mamba")
    serve(tree, range(8))
    m1, r1 = start(tree, np.r_[np.arange(8), 1, 2])
    m2, r2 = start(tree, np.r_[np.arange(8), 3, 4])
    cached = m1.components["mamba"].state_slot
    assert cached >= 0 and m2.components["mamba"].state_slot == cached and m1.device_hit_len == 8
    a, b = r1.components["mamba"], r2.components["mamba"]
    assert a.slot != b.slot and cached not in (a.slot, b.slot)
    assert a.copies == ((cached, a.slot),) and b.copies == ((cached, b.slot),)
    tree.cache_finished_req(r1)
    tree.cache_finished_req(r2)
    tree.check_invariants()
    assert mamba.stats()["mamba"].request_slots == 0 and mamba.stats()["mamba"].tree_slots == 3


def test_mamba_match_truncates_to_a_state_and_reports_branching_seqlen():
    tree = mamba_tree()
    serve(tree, range(10))
    m = tree.match_prefix(RadixKey(np.r_[np.arange(6), 50]))  # splits at 6: the prefix has no state
    assert m.device_hit_len == 0 and m.components["mamba"].branching_seqlen == 6
    assert m.components["mamba"].state_slot == -1
    # a scheduler ending a prefill chunk at the branch point gives it a state
    _, state = start(tree, np.arange(6))
    new = tree.cache_unfinished_req(state)
    value = new.components["mamba"]
    assert value.slot != state.components["mamba"].slot
    assert value.copies == ((state.components["mamba"].slot, value.slot),)  # the tree kept the old slot
    assert tree.match_prefix(RadixKey(np.r_[np.arange(6), 51])).device_hit_len == 6
    tree.cache_finished_req(new)
    tree.check_invariants()


def test_mamba_unaligned_key_caches_no_state_and_eviction_skips_locked():
    tree = mamba_tree(slots=4, page_size=4)
    mamba = tree.component("mamba")
    serve(tree, range(10))  # 10 tokens, page 4: the state after 10 is not a page boundary's (no track_len given)
    assert tree.match_prefix(RadixKey(np.arange(10))).device_hit_len == 0
    serve(tree, range(100, 108))
    serve(tree, range(200, 208))
    m, state = start(tree, np.r_[np.arange(100, 108), 5])
    assert m.device_hit_len == 8  # pool: 2 cached + 2 request slots; the locked state survives eviction
    assert state.components["mamba"].track >= 0 and mamba.stats()["mamba"].request_slots == 2
    assert tree.evict(0, mamba_num=5).components == {"mamba_num": 1}
    assert mamba.state_slot(tree.node(m.last_device_node)) >= 0
    tree.cache_finished_req(state)
    tree.check_invariants()
    assert mamba.stats()["mamba"].request_slots == 0


def _with_track_len(state: RequestState, track_len: int) -> RequestState:
    value = dataclasses.replace(state.components["mamba"], track_len=track_len)
    return dataclasses.replace(state, components={"mamba": value})


def _grow(tree: RadixTree, state: RequestState, tokens) -> RequestState:
    """The request decodes ``tokens`` more (pages for them allocated)."""
    key = RadixKey(np.r_[state.key.token_ids, tokens].astype(np.int32))
    have = state.device_pages.shape[0]
    more = tree.alloc(max(0, -(-len(key) // tree.page_size) - have) * tree.page_size)
    return dataclasses.replace(state, key=key, device_pages=np.r_[state.device_pages, more].astype(np.int32))


def test_mamba_finished_unaligned_key_caches_the_track_slot_at_its_last_whole_page():
    """A finished request whose key is not page-aligned gives the node ending at its last whole page the track
    slot (the state its decode copied there), not the working slot; the next turn hits that page end."""
    tree = mamba_tree(slots=6, page_size=4)
    mamba = tree.component("mamba")
    _, state = start(tree, np.arange(6), extra=8)
    value = state.components["mamba"]
    assert value.track >= 0 and value.track != value.slot and value.track_len == 0
    state = tree.cache_unfinished_req(state)  # the prefill's cut at 4 (the key's last whole page then)
    assert state.components["mamba"].track == value.track  # the track slot stays with the request
    state = _grow(tree, state, np.arange(6, 11))  # decoded to 11 tokens: the track holds the state after 8
    working, track = state.components["mamba"].slot, value.track
    tree.cache_finished_req(_with_track_len(state, 8))
    m = tree.match_prefix(RadixKey(np.r_[np.arange(11), 50]))
    assert m.device_hit_len == 8 and m.components["mamba"].state_slot == track
    assert mamba.allocator.owners(np.array([working]))[0] == PageOwner.FREE
    assert mamba.stats()["mamba"].request_slots == 0
    tree.check_invariants()


@pytest.mark.parametrize("key_len, track_len, why", [
    (11, 4, "the track is not at the key's last whole page"),
    (11, 0, "the decode crossed no page end"),
    (12, 8, "an aligned key: the working slot holds the end's state"),
])
def test_mamba_finish_adopts_the_track_only_at_the_last_whole_page(key_len, track_len, why):
    tree = mamba_tree(slots=6, page_size=4)
    mamba = tree.component("mamba")
    _, state = start(tree, np.arange(key_len))
    value = state.components["mamba"]
    tree.cache_finished_req(_with_track_len(state, track_len))
    end = tree.node(tree.match_prefix(RadixKey(np.arange(key_len))).best_match_node)
    want = value.slot if key_len % 4 == 0 else -1
    assert mamba.state_slot(end) == want, why
    assert mamba.stats()["mamba"].request_slots == 0 and mamba.stats()["mamba"].tree_slots == (want >= 0)
    tree.check_invariants()


def test_mamba_track_slot_of_a_node_that_has_a_state_is_freed():
    tree = mamba_tree(slots=6, page_size=4)
    mamba = tree.component("mamba")
    serve(tree, range(8))
    cached = mamba.state_slot(tree.node(tree.match_prefix(RadixKey(np.arange(8))).last_device_node))
    _, state = start(tree, np.arange(10))
    tree.cache_finished_req(_with_track_len(state, 8))
    assert mamba.stats()["mamba"].tree_slots == 1 and mamba.stats()["mamba"].request_slots == 0
    assert mamba.state_slot(tree.node(tree.match_prefix(RadixKey(np.arange(8))).last_device_node)) == cached
    tree.check_invariants()


def test_mamba_chunk_cached_on_a_full_pool_continues_in_the_track_slot():
    """cache_unfinished_req at a page end on a full pool (nothing evictable): the node takes the working slot
    and the request continues in its track slot (no track from then on) rather than leaving the node stateless."""
    tree = mamba_tree(slots=2, page_size=4)
    mamba = tree.component("mamba")
    _, state = start(tree, np.arange(8), extra=4)
    value = state.components["mamba"]
    assert value.track >= 0 and mamba.allocator.num_free == 0
    new = tree.cache_unfinished_req(state)
    moved = new.components["mamba"]
    assert (moved.slot, moved.track, moved.copies) == (value.track, -1, ((value.slot, value.track),))
    assert mamba.state_slot(tree.node(new.last_node)) == value.slot
    tree.cache_finished_req(_grow(tree, new, [1, 2, 3]))
    assert mamba.stats()["mamba"].request_slots == 0 and mamba.stats()["mamba"].tree_slots == 1
    tree.check_invariants()


def test_mamba_no_track_slot_when_the_pool_has_none_to_spare():
    tree = mamba_tree(slots=2, page_size=4)
    mamba = tree.component("mamba")
    serve(tree, range(8))
    m, state = start(tree, np.r_[np.arange(8), 9, 10])
    assert m.device_hit_len == 8 and state.components["mamba"].track == -1  # the locked state is not evicted
    tree.cache_finished_req(state)
    assert mamba.stats()["mamba"].request_slots == 0
    tree.check_invariants()


@pytest.mark.parametrize("decode, track", [
    (range(10, 12), False),  # 10 and 11: no page end (page 4), the decode would never write a track
    (range(10, 13), True),  # reaches 12
    (range(12, 13), True),  # starts on a page end (the prompt's end, 12 tokens)
    (range(10, 10), False),  # no decode step (one new token)
    (None, True),  # unknown: a track when the pool has one
])
def test_mamba_track_slot_only_for_a_decode_that_crosses_a_page_end(decode, track):
    tree = mamba_tree(slots=8, page_size=4)
    mamba = tree.component("mamba")
    key = RadixKey(np.arange(10, dtype=np.int32))
    m = tree.match_prefix(key)
    tree.inc_lock_ref(m.last_device_node)
    value = tree.begin_request(m, decode)["mamba"]
    assert (value.track >= 0) is track and mamba.stats()["mamba"].request_slots == 1 + track
    state = RequestState(key, tree.alloc(12), 0, m.last_device_node, 0, {"mamba": value})
    tree.abandon_request(state)
    assert mamba.stats()["mamba"].request_slots == 0
    tree.check_invariants()


@pytest.mark.parametrize("decode", [range(0, 8, 2), range(-1, 4), [10, 11], (10, 12)])
def test_mamba_bad_decode_positions_are_refused_and_change_nothing(decode):
    tree = mamba_tree(slots=8, page_size=4)
    m = tree.match_prefix(RadixKey(np.arange(10, dtype=np.int32)))
    with pytest.raises(ValueError, match="decode_positions must be a range"):
        tree.begin_request(m, decode)
    assert tree.component("mamba").stats()["mamba"].request_slots == 0


@pytest.mark.parametrize("track_len, match", [
    (3, "track_len must be a page multiple"),
    (16, r"track_len must be a page multiple in \[0, 10\]"),
    (-4, "track_len must be"),
    (True, "track_len must be"),
])
def test_mamba_bad_track_len_is_refused_and_changes_nothing(track_len, match):
    tree = mamba_tree(slots=6, page_size=4)
    mamba = tree.component("mamba")
    _, state = start(tree, np.arange(10))
    before = mamba.allocator.owners(np.arange(6)).copy()
    for call in (tree.cache_finished_req, tree.cache_unfinished_req, tree.abandon_request):
        with pytest.raises(ValueError, match=match):
            call(_with_track_len(state, track_len))
        np.testing.assert_array_equal(mamba.allocator.owners(np.arange(6)), before)
    no_track = dataclasses.replace(state.components["mamba"], track=-1, track_len=4)
    with pytest.raises(ValueError, match="0 without a track slot"):
        tree.cache_finished_req(dataclasses.replace(state, components={"mamba": no_track}))
    same = dataclasses.replace(state.components["mamba"], track=state.components["mamba"].slot)
    with pytest.raises(ValueError, match="is the request's working slot"):
        tree.cache_finished_req(dataclasses.replace(state, components={"mamba": same}))
    np.testing.assert_array_equal(mamba.allocator.owners(np.arange(6)), before)
    tree.abandon_request(state)  # frees the working and the track slot
    assert mamba.stats()["mamba"].request_slots == 0
    tree.check_invariants()


# -- HiCache hooks with a recording host ---------------------------------------------------------------
def _host_only(tree: RadixTree, node_ids):
    """What the Full host tier would have done: committed L2 copies, so eviction keeps the nodes."""
    for nid in node_ids:
        node = tree.node(nid)
        node.host_slots = np.arange(node.device_pages.shape[0], dtype=np.int32) + 500 + 50 * nid


def _load(tree: RadixTree, node):
    """Controller side of a load-back: pages attached to the host-only chain, chain marked loading."""
    chain = []
    n = node
    while n.parent is not None and n.device_pages is None:
        chain.append(n)
        n = n.parent
    pages = tree.alloc(sum(c.num_tokens for c in chain))
    start_ = 0
    for c in reversed(chain):
        k = c.num_tokens // tree.page_size
        tree.full.attach_pages(c, pages[start_ : start_ + k])
        c.loading = True
        start_ += k
    return chain


def test_swa_hicache_backup_loads_only_the_window_and_host_eviction_records():
    tree = swa_tree(window=3)
    swa = tree.component("swa")
    serve(tree, range(4), trim=False)
    serve(tree, range(8), trim=False)  # nodes [0,4) and [4,8), both live
    a, b = sorted(tree.iter_nodes(), key=tree.depth)
    host = RecordingHost()
    for node in (a, b):  # host tails: the last window_pages (3) of each node, what a hit at its end reads
        t = swa.build_hicache_transfers(node, HiCachePhase.BACKUP)
        assert len(t) == 1 and t[0].dst is None and t[0].num_tokens == 3
        np.testing.assert_array_equal(t[0].src, swa.translate(node.device_pages[1:]))
        swa.commit_hicache_transfer(node, HiCachePhase.BACKUP, host.place(t))
    assert swa.build_hicache_transfers(a, HiCachePhase.BACKUP) == ()  # already on the host
    _host_only(tree, [a.id, b.id])
    tree.evict(100)
    assert a.device_pages is None and b.device_pages is None
    m = tree.match_prefix(RadixKey(np.arange(9)))
    assert m.host_hit_len == 8
    # a hit at a's end (4) needs [1, 4): a's tail; a hit at 3 is not a node end, so [0, 4) + 9 stops at a
    assert tree.match_prefix(RadixKey(np.r_[np.arange(4), 9])).host_hit_len == 4
    chain = _load(tree, b)
    transfers = swa.build_hicache_transfers(b, HiCachePhase.LOAD_BACK)
    assert [t.node_id for t in transfers] == [b.id]  # window [5, 8) lies in b: a (ends at 4) needs no SWA
    np.testing.assert_array_equal(transfers[0].src, np.arange(1003, 1006))
    np.testing.assert_array_equal(transfers[0].dst, swa.translate(b.device_pages[1:]))
    swa.commit_hicache_transfer(b, HiCachePhase.LOAD_BACK, host.run(transfers))
    for c in chain:
        c.loading = False
    tree.check_invariants()
    assert not swa.has_live(a)  # a came back as a tombstone: full KV only
    assert swa.has_live(b) and not swa.is_live(b)  # b: a tombstoned head (page 4), the window live
    assert tree.match_prefix(RadixKey(np.arange(9))).device_hit_len == 8
    assert tree.match_prefix(RadixKey(np.r_[np.arange(4), 9])).device_hit_len == 0
    tracker = RecordingTracker(pinned_ids={b.id})
    assert swa.drive_host_eviction(100, tracker) == 3
    assert tracker.released == [("swa", a.id, tuple(range(1000, 1003)), 3)]


def test_swa_trim_keeps_the_l1_tail_an_l2_hit_below_reads():
    """A node whose own end is no hit (its window broken) keeps the tail that the window of its L2-only child
    reads: trimming frees only the rest, and the L2 hit stays."""
    tree = swa_tree(window=6)
    swa = tree.component("swa")
    serve(tree, range(8), trim=False)
    serve(tree, range(12), trim=False)  # a = [0, 8), b = [8, 12): b's window [6, 12) reads a's last 2 tokens
    a, b = sorted(tree.iter_nodes(), key=tree.depth)
    (t,) = swa.build_hicache_transfers(b, HiCachePhase.BACKUP)
    swa.commit_hicache_transfer(b, HiCachePhase.BACKUP, RecordingHost().place((t,)))
    _host_only(tree, [b.id])
    tree.evict(4)
    assert b.device_pages is None and a.device_pages is not None
    swa.mapped.unmap(a.device_pages[:4].astype(np.intp))  # a's live tail [4, 8): a's own end is no hit now
    assert tree.match_prefix(RadixKey(np.r_[np.arange(8), 99])).device_hit_len == 0
    assert tree.match_prefix(RadixKey(np.arange(13))).host_hit_len == 4
    assert tree.evict(0, swa_num_tokens=1).components == {"swa_num_tokens": 2}  # [4, 6): no hit reads them
    np.testing.assert_array_equal(swa.translate(a.device_pages) >= 0, np.arange(8) >= 6)
    assert tree.match_prefix(RadixKey(np.arange(13))).host_hit_len == 4
    tree.check_invariants()


def test_swa_host_tail_splits_with_its_node():
    tree = swa_tree(window=3)
    swa = tree.component("swa")
    serve(tree, range(8), trim=False)
    (a,) = tree.iter_nodes()
    host = RecordingHost()
    swa.commit_hicache_transfer(a, HiCachePhase.BACKUP, host.place(swa.build_hicache_transfers(a, HiCachePhase.BACKUP)))
    np.testing.assert_array_equal(a.component_data["swa"].host_slots, [1000, 1001, 1002])  # pages 5, 6, 7
    tree.match_prefix(RadixKey(np.r_[np.arange(6), 99]))  # splits a at 6: the tail reaches 1 page into [0, 6)
    prefix = a.parent
    np.testing.assert_array_equal(prefix.component_data["swa"].host_slots, [1000])
    np.testing.assert_array_equal(a.component_data["swa"].host_slots, [1001, 1002])
    tree.match_prefix(RadixKey(np.r_[np.arange(3), 99]))  # splits [0, 6) at 3: nothing of the tail above 5
    assert prefix.parent.component_data["swa"].host_slots is None
    np.testing.assert_array_equal(prefix.component_data["swa"].host_slots, [1000])
    tree.check_invariants()


def test_mamba_hicache_single_state_restore_then_copy_on_write():
    tree = mamba_tree(slots=6)
    mamba = tree.component("mamba")
    serve(tree, range(4))
    serve(tree, range(8))
    a, b = sorted(tree.iter_nodes(), key=tree.depth)
    host = RecordingHost()
    for node in (a, b):
        t = mamba.build_hicache_transfers(node, HiCachePhase.BACKUP)
        mamba.commit_hicache_transfer(node, HiCachePhase.BACKUP, host.place(t))
    _host_only(tree, [a.id, b.id])
    tree.evict(100)
    assert mamba.state_slot(b) == -1 and mamba.stats()["mamba"].tree_slots == 0
    assert tree.match_prefix(RadixKey(np.arange(9))).host_hit_len == 8
    _load(tree, b)
    transfers = mamba.build_hicache_transfers(b, HiCachePhase.LOAD_BACK)
    assert len(transfers) == 1 and transfers[0].node_id == b.id  # the single state of the end node
    before = mamba.allocator.owners(np.arange(mamba.allocator.capacity)).copy()
    with pytest.raises(ValueError, match="shape"):
        mamba.commit_hicache_transfer(b, HiCachePhase.LOAD_BACK, (ComponentTransfer(
            "mamba", HiCachePhase.LOAD_BACK, b.id, np.r_[transfers[0].src, 1], np.r_[transfers[0].dst, 2], 4),))
    np.testing.assert_array_equal(mamba.allocator.owners(np.arange(mamba.allocator.capacity)), before)
    mamba.commit_hicache_transfer(b, HiCachePhase.LOAD_BACK, host.run(transfers))
    for n in (a, b):
        n.loading = False
    m, state = start(tree, np.r_[np.arange(8), 9])
    assert m.device_hit_len == 8 and m.components["mamba"].state_slot == int(transfers[0].dst[0])
    assert state.components["mamba"].copies == ((int(transfers[0].dst[0]), state.components["mamba"].slot),)
    tree.cache_finished_req(state)
    tree.check_invariants()
    tracker = RecordingTracker()
    assert mamba.drive_host_eviction(1, tracker) == 4 and tracker.released[0][:2] == ("mamba", a.id)


def test_failed_mamba_load_releases_the_reserved_slot():
    tree = mamba_tree(slots=4)
    mamba = tree.component("mamba")
    serve(tree, range(4))
    (a,) = tree.iter_nodes()
    host = RecordingHost()
    mamba.commit_hicache_transfer(a, HiCachePhase.BACKUP, host.place(mamba.build_hicache_transfers(a, HiCachePhase.BACKUP)))
    _host_only(tree, [a.id])
    tree.evict(100)
    _load(tree, a)
    t = mamba.build_hicache_transfers(a, HiCachePhase.LOAD_BACK)
    assert mamba.allocator.num_free == 3
    mamba.commit_hicache_transfer(a, HiCachePhase.LOAD_BACK, t, ok=False)
    assert mamba.allocator.num_free == 4 and mamba.state_slot(a) == -1


# -- bad input changes nothing -------------------------------------------------------------------------
def test_bad_request_values_change_nothing():
    tree = build_kv_cache(KVCacheConfig(TreeConfig(1, 32), "swa,mamba", swa=SWAConfig(4), mamba=MambaConfig(4)))
    serve(tree, range(8))
    _, state = start(tree, np.r_[np.arange(8), 3])
    before = snapshot(tree)
    bad_values = [
        {},  # no mamba value
        {"mamba": 3},
        {"mamba": MambaRequest(np.array([1, 2]))},
        {"mamba": state.components["mamba"], "lstm": 1},
    ]
    for values in bad_values:
        bad = RequestState(state.key, state.device_pages, state.prefix_len, state.last_node, 0, values)
        for call in (tree.cache_finished_req, tree.cache_unfinished_req, tree.trim_request):
            with pytest.raises((ValueError, TypeError)):
                call(bad)
        assert snapshot(tree) == before
    with pytest.raises(ValueError, match="'swa_tokens'"):
        tree.evict(1, swa_tokens=3)
    with pytest.raises(ValueError, match="no component 'lstm'"):
        tree.component("lstm")
    with pytest.raises(TypeError, match="HiCachePhase"):
        tree.component("swa").build_hicache_transfers(tree.node(state.last_node), "backup")
    assert snapshot(tree) == before
    tree.cache_finished_req(state)
    tree.check_invariants()
