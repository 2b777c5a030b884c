"""HiCache L1<->L2 on a real embedded setup (CacheHead + HostWorker with JAX pools on fake CPU devices).

Every hit checks that the prefix pages hold exactly the KV written for those tokens (``HiCacheEnv.serve``).
"""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest
from support.hicache_env import HiCacheEnv, make_spec

from hicache.cluster import CacheHead, HeadConfig
from hicache.cluster.controller import LoadBackParams
from hicache.cluster.events import EventKind, KVEvent, MissReason, Tier, pack_event, unpack_event
from hicache.cluster.inflight import PendingTransfer
from hicache.cluster.policy import HiCacheConfig
from hicache.cluster.tree import InsertParams, RadixKey, TreeConfig
from hicache.cluster.worker_group import LocalWorkerGroup
from hicache.workers import HostWorker, OpKind, TransferOp, TransferPlan


def seq(start, n):
    return np.arange(start, start + n, dtype=np.int32)


def check(env: HiCacheEnv) -> None:
    env.head.tree.check_invariants()
    env.head.controller.check_invariants()


def test_write_through_evict_then_load_back_is_bit_identical():
    env = HiCacheEnv(page_size=4, device_pages=16, host_slots=32)
    a = seq(0, 24)
    env.serve(a)
    assert env.head.flush_write_through_acks() >= 1
    st = env.head.cache_stats()
    assert st["host_tokens"] == 24 and st["backed_up_tokens"] == 24
    check(env)
    # Push `a` out of L1 with other traffic, then overwrite every free L1 page with garbage.
    env.serve(seq(1000, 60))
    env.head.flush_write_through_acks()
    m = env.head.match_prefix(RadixKey(a))
    assert m.device_hit_len < 24 and m.device_hit_len + m.host_hit_len == 24
    free = env.head.alloc(env.head.stats().free_pages * 4)
    env.worker.device_pool.write_pages(free, np.full((free.size, *env.row_shape), -7, np.float32))
    env.head.free(free)
    r = env.serve(a)  # serve() asserts the loaded pages hold a's KV exactly
    assert r["loaded"] == 24 - r["device_hit"] and r["loaded"] > 0
    check(env)
    assert env.head.cache_stats()["loaded_tokens"] == r["loaded"]


def test_write_through_selective_backs_up_on_second_hit():
    env = HiCacheEnv(write_policy="write_through_selective")
    a = seq(0, 16)
    env.serve(a)
    env.head.flush_write_through_acks()
    assert env.head.cache_stats()["host_tokens"] == 0
    env.serve(a)  # second insert over the same node
    env.head.flush_write_through_acks()
    assert env.head.cache_stats()["host_tokens"] == 16
    check(env)


def test_write_back_backs_up_only_on_eviction_and_keeps_the_data():
    env = HiCacheEnv(page_size=4, device_pages=12, host_slots=32, write_policy="write_back")
    a = seq(0, 20)
    env.serve(a)
    env.head.flush_write_through_acks()
    assert env.head.cache_stats()["host_tokens"] == 0
    env.serve(seq(500, 40))  # needs the L1 pages of `a`: backed up, then demoted
    st = env.head.cache_stats()
    assert st["host_tokens"] >= 20 and st["backed_up_tokens"] >= 20
    m = env.head.match_prefix(RadixKey(a))
    assert m.device_hit_len + m.host_hit_len == 20 and m.host_hit_len > 0
    r = env.serve(a)
    assert r["loaded"] > 0
    check(env)


def test_load_back_threshold_and_quota_are_misses_with_reasons():
    env = HiCacheEnv(page_size=4, device_pages=16, host_slots=32, load_back_threshold=16)
    a = seq(0, 12)
    env.serve(a)
    env.head.flush_write_through_acks()
    env.head.evict(100)
    m = env.head.match_prefix(RadixKey(a))
    assert (m.device_hit_len, m.host_hit_len) == (0, 12)
    r = env.head.init_load_back(LoadBackParams(m.best_match_node, m.host_hit_len))
    assert r.load_id == -1 and r.miss_reason is MissReason.BELOW_THRESHOLD and r.device_hit_len == 0
    env2 = HiCacheEnv(page_size=4, device_pages=16, host_slots=32)
    env2.serve(a)
    env2.head.flush_write_through_acks()
    env2.head.evict(100)
    m = env2.head.match_prefix(RadixKey(a))
    r = env2.head.init_load_back(LoadBackParams(m.best_match_node, m.host_hit_len, mem_quota=8))
    assert r.load_id == -1 and r.miss_reason is MissReason.OVER_QUOTA
    r = env2.head.init_load_back(LoadBackParams(m.best_match_node, m.host_hit_len, mem_quota=12))
    assert r.load_id >= 0 and env2.head.wait_load_back(r.load_id) and r.device_hit_len == 12
    misses = env.head.cache_stats()["miss_tokens"]
    assert misses["below_threshold"] == 12
    assert env2.head.cache_stats()["miss_tokens"]["over_quota"] == 12


def _l1_prefix_with_host_tail(env: HiCacheEnv, tail: int) -> tuple[np.ndarray, np.ndarray]:
    """Serves ``a`` (8 tokens) and ``b`` = ``a`` + ``tail`` tokens; b's tail ends host-only, ``a`` in L1.
    A one-page branch below ``a``, served before ``b`` (so it leaves L1 first), keeps ``a`` a node of its
    own: a backed-up only child would absorb it (``RadixTree.merge_backed_up``)."""
    a = seq(0, 8)
    b = np.concatenate([a, seq(100, tail)])
    env.serve(a)
    env.serve(np.concatenate([a, seq(900, 4)]))
    env.serve(b)
    env.head.flush_write_through_acks()
    env.head.evict(tail)
    return a, b


def test_load_back_without_l1_room_is_a_no_space_miss_and_releases_everything():
    env = HiCacheEnv(page_size=4, device_pages=8, host_slots=32)
    _, b = _l1_prefix_with_host_tail(env, 16)
    held = env.head.alloc(env.head.stats().free_pages * 4)  # a running request holds every free page
    m = env.head.match_prefix(RadixKey(b))
    assert (m.device_hit_len, m.host_hit_len) == (8, 16)
    env.head.inc_lock_ref(m.last_device_node)
    r = env.head.init_load_back(LoadBackParams(m.best_match_node, m.host_hit_len))
    assert r.load_id == -1 and r.miss_reason is MissReason.NO_SPACE
    assert (r.device_hit_len, r.last_node, r.loaded_tokens) == (8, m.last_device_node, 0)
    assert env.head.cache_stats()["miss_tokens"]["no_space"] == 16
    check(env)
    env.head.dec_lock_ref(m.last_device_node)
    env.head.free(held)
    assert env.head.stats().protected_tokens == 0 and env.head.controller.in_flight == 0
    assert env.serve(b)["loaded"] == 16  # room again: the same prefix loads back exactly
    check(env)


def test_bad_load_back_input_changes_nothing():
    env = HiCacheEnv()
    a = seq(0, 16)
    env.serve(a)
    env.head.flush_write_through_acks()
    m = env.head.match_prefix(RadixKey(a))
    before = env.head.cache_stats()
    with pytest.raises(ValueError, match="unknown node id"):
        env.head.init_load_back(LoadBackParams(10**6, 4))
    with pytest.raises(ValueError, match="mem_quota"):
        env.head.init_load_back(LoadBackParams(m.best_match_node, 0, mem_quota=-1))
    with pytest.raises(ValueError, match="host_hit_len"):
        env.head.init_load_back(LoadBackParams(m.best_match_node, 8))  # a device node: nothing on host only
    with pytest.raises(TypeError, match="lock must be a bool"):
        env.head.init_load_back(LoadBackParams(m.best_match_node, 0, lock="yes"))
    with pytest.raises(TypeError):
        env.head.init_load_back((m.best_match_node, 0))
    with pytest.raises(ValueError, match="unknown load id"):
        env.head.wait_load_back(12345)
    assert env.head.cache_stats() == before
    check(env)


def test_host_tier_is_bounded_and_evicts_lru_host_leaves():
    env = HiCacheEnv(page_size=4, device_pages=8, host_slots=10)
    seqs = [seq(i * 100, 16) for i in range(5)]
    for s in seqs:
        env.serve(s)
        env.head.flush_write_through_acks()
        assert env.head.cache_stats()["host_tokens"] <= 40
        check(env)
    # The most recent sequence is fully cached across L1+L2, the oldest ones were dropped.
    m_new = env.head.match_prefix(RadixKey(seqs[-1]))
    m_old = env.head.match_prefix(RadixKey(seqs[0]))
    assert m_new.device_hit_len + m_new.host_hit_len == 16
    assert m_old.device_hit_len + m_old.host_hit_len == 0
    st = env.head.cache_stats()
    assert st["miss_tokens"].get("evicted_l2", 0) >= 16


def test_backup_slots_come_from_a_bulk_block_that_never_causes_a_host_eviction():
    env = HiCacheEnv(page_size=4, device_pages=8, host_slots=10)
    host = env.head.controller.host
    a, b = host.take(3), host.take(2)  # one refill reserves every free slot (fewer than a block)
    assert a.tolist() == [0, 1, 2] and b.tolist() == [3, 4]  # the free stack's hand-out order
    assert host.slots.num_free == 0 and host.num_free == 5 and not a.flags.writeable
    assert host.take(6) is None  # more than the free slots: the caller goes through reserve
    assert host.slots.num_free == 5 and host.num_free == 5  # (the unused block went back)
    d = host.take(1)
    c = host.reserve(4)  # short on the free stack: takes the block back first, evicts nothing
    assert d.tolist() == [5] and sorted(c.tolist()) == [6, 7, 8, 9] and host.evicted_tokens == 0
    for slots in (a, b, c, d):
        host.unreserve(slots)
    assert host.num_free == host.slots.num_free == 10
    host.check_invariants()
    # End to end: backups staged from blocks commit exactly and L2 stays bounded.
    for i in range(4):
        env.serve(seq(i * 100, 16))
        env.head.flush_write_through_acks()
        assert env.head.cache_stats()["host_tokens"] <= 40
        check(env)
    m = env.head.match_prefix(RadixKey(seq(300, 16)))
    assert m.device_hit_len + m.host_hit_len == 16
    r = env.serve(seq(300, 16))  # serve() checks the bytes of every hit, loaded ones included
    assert r["device_hit"] + r["loaded"] == 16


def test_failed_backup_frees_slots_and_node_stays_device_only():
    env = HiCacheEnv(faults={"fail_kinds": (OpKind.BACKUP_D2H,), "fail_rate": 1.0})
    env.serve(seq(0, 16))
    env.head.flush_write_through_acks()
    st = env.head.cache_stats()
    assert st["host_tokens"] == 0 and st["transfer_failures"] == 1 and st["in_flight"] == 0
    assert env.head.controller.host.num_free == 64
    assert env.head.stats().protected_tokens == 0
    check(env)


def test_failed_load_rolls_back_and_request_recomputes():
    env = HiCacheEnv(page_size=4, device_pages=16, host_slots=32,
                     faults={"fail_kinds": (OpKind.LOAD_H2D,), "fail_rate": 1.0})
    a = seq(0, 16)
    env.serve(a)
    env.head.flush_write_through_acks()
    env.head.evict(100)
    free_before = env.head.stats().free_pages
    r = env.serve(a)
    assert r["load_failed"] and r["loaded"] == 0 and r["device_hit"] == 0
    st = env.head.cache_stats()
    assert st["miss_tokens"]["load_failed"] == 16
    assert env.head.stats().free_pages == free_before - 4  # only the recomputed request's pages
    check(env)


class RecordingWorkers:
    """The env's real worker group; remembers every plan the head sent."""

    def __init__(self, inner) -> None:
        self.inner, self.plans = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def submit(self, plan) -> None:
        self.plans.append(plan)
        self.inner.submit(plan)


def _host_only_prefixes(env: HiCacheEnv, n: int) -> list[np.ndarray]:
    """``n`` disjoint 16-token prefixes, backed up, evicted from L1, free L1 pages overwritten."""
    prefixes = [seq(i * 1000, 16) for i in range(n)]
    for p in prefixes:
        env.serve(p)
    env.head.flush_write_through_acks()
    env.head.evict(10**6)
    free = env.head.alloc(env.head.stats().free_pages * env.ps)
    env.worker.device_pool.write_pages(free, np.full((free.size, *env.row_shape), -7, np.float32))
    env.head.free(free)
    return prefixes


def test_load_back_with_lock_holds_the_callers_lock_through_the_load():
    env = HiCacheEnv(page_size=4, device_pages=32, host_slots=64)
    a = _host_only_prefixes(env, 1)[0]
    m = env.head.match_prefix(RadixKey(a))
    r = env.head.init_load_back(LoadBackParams(m.best_match_node, m.host_hit_len, lock=True))
    node = env.head.tree.node(r.last_node)
    assert r.load_id >= 0 and node.lock_ref == 1  # ONE lock: the load holds the caller's
    check(env)
    assert env.head.wait_load_back(r.load_id)
    assert node.lock_ref == 1 and env.head.stats().protected_tokens == 16  # the ack leaves it to the caller
    np.testing.assert_array_equal(env.worker.device_pool.read_pages(r.device_pages), env.rows(a, 0, 4))
    check(env)
    env.head.dec_lock_ref(r.last_node)
    assert node.lock_ref == 0 and env.head.stats().protected_tokens == 0
    check(env)


def test_load_back_with_lock_locks_the_l1_prefix_when_nothing_loads():
    env = HiCacheEnv(page_size=4, device_pages=8, host_slots=32, load_back_threshold=12)
    _, b = _l1_prefix_with_host_tail(env, 8)
    m = env.head.match_prefix(RadixKey(b))
    assert (m.device_hit_len, m.host_hit_len) == (8, 8)
    r = env.head.init_load_back(LoadBackParams(m.best_match_node, m.host_hit_len, lock=True))
    assert r.load_id == -1 and r.miss_reason is MissReason.BELOW_THRESHOLD and r.last_node == m.last_device_node
    assert env.head.tree.node(r.last_node).lock_ref == 1 and env.head.stats().protected_tokens == 8
    env.head.dec_lock_ref(r.last_node)
    # No L1 room: the lock the load took moves to the L1 prefix the caller gets.
    env2 = HiCacheEnv(page_size=4, device_pages=8, host_slots=32)
    _l1_prefix_with_host_tail(env2, 8)
    held = env2.head.alloc(env2.head.stats().free_pages * 4)
    m = env2.head.match_prefix(RadixKey(b))
    r = env2.head.init_load_back(LoadBackParams(m.best_match_node, m.host_hit_len, lock=True))
    assert r.load_id == -1 and r.miss_reason is MissReason.NO_SPACE and r.last_node == m.last_device_node
    assert env2.head.tree.node(r.last_node).lock_ref == 1 and env2.head.tree.node(m.best_match_node).lock_ref == 0
    check(env2)
    env2.head.dec_lock_ref(r.last_node)
    env2.head.free(held)
    assert env2.head.stats().protected_tokens == 0 and env2.head.controller.in_flight == 0
    check(env2)


def test_failed_load_with_lock_leaves_the_lock_to_the_caller():
    env = HiCacheEnv(page_size=4, device_pages=32, host_slots=64, load_lock=True,
                     faults={"fail_kinds": (OpKind.LOAD_H2D,), "fail_rate": 1.0})
    prefixes = _host_only_prefixes(env, 3)
    m = env.head.match_prefix(RadixKey(prefixes[0]))
    r = env.head.init_load_back(LoadBackParams(m.best_match_node, m.host_hit_len, lock=True))
    assert not env.head.wait_load_back(r.load_id)
    node = env.head.tree.node(r.last_node)
    assert node.lock_ref == 1 and node.device_pages is None and node.host_slots is not None  # host-only, held
    check(env)
    env.head.dec_lock_ref(r.last_node)
    out = env.serve_step(prefixes)  # serve_step recomputes each request (checks its KV) and moves its lock
    assert [(o["load_failed"], o["loaded"]) for o in out] == [(True, 0)] * 3
    assert env.head.stats().protected_tokens == 0 and env.head.controller.in_flight == 0
    check(env)


def test_acked_transfers_are_freed_at_once_not_left_to_the_garbage_collector():
    # A transfer record in a reference cycle (e.g. one that is its own op) outlives its ack until a GC pass.
    env = HiCacheEnv(page_size=4, device_pages=32, host_slots=64)
    prefixes = _host_only_prefixes(env, 3)
    gc.collect()
    gc.disable()
    try:
        assert [o["loaded"] for o in env.serve_step(prefixes)] == [16] * 3
        env.serve(seq(5000, 12))  # a new backup
        env.head.flush_write_through_acks()
        ctl = env.head.controller
        assert ctl.in_flight == 0
        # The controller keeps one open (empty, unsent) batch per copy kind; nothing else may be left.
        open_batches = (ctl.outbox.open_loads, ctl.outbox.open_backups)
        assert all(not b.chains and b.op is None for b in open_batches)
        alive = [o for o in gc.get_objects() if isinstance(o, PendingTransfer) and o not in open_batches]
    finally:
        gc.enable()
    assert alive == []


def test_a_steps_load_backs_travel_as_one_op_and_are_exact():
    env = HiCacheEnv(page_size=4, device_pages=32, host_slots=64)
    prefixes = _host_only_prefixes(env, 4)
    rec = RecordingWorkers(env.head.controller.workers)
    env.head.controller.workers = rec
    out = env.serve_step([np.concatenate([p, seq(5000 + 100 * i, 8)]) for i, p in enumerate(prefixes[:3])])
    assert [o["loaded"] for o in out] == [16, 16, 16]  # serve_step checked every loaded page's KV
    loads = [op for plan in rec.plans for op in plan.ops if op.kind is OpKind.LOAD_H2D]
    assert len(loads) == 1 and loads[0].num_pages == 12
    check(env)
    # The step's backups (the 8 new tokens of each request) are held; the next plan with loads leaves
    # them held (no D2H on a request's critical path); a flush sends them as one op.
    rec.plans.clear()
    env.head.check_hicache_events()
    assert rec.plans == []
    env.serve_step([prefixes[3]])
    assert [sorted(op.kind.value for op in plan.ops) for plan in rec.plans] == [["h2d"]]
    env.head.flush_write_through_acks()
    assert [sorted(op.kind.value for op in plan.ops) for plan in rec.plans][1] == ["d2h"]
    assert env.head.cache_stats()["backed_up_tokens"] == 4 * 16 + 3 * 8
    check(env)


def test_a_node_split_while_its_backup_is_held_commits_both_halves_in_order():
    """The tree splits a node whose backup waits in the open batch: the new prefix node joins that copy's
    chain in front of the rest, both halves get their slots of the one op, and loading them back is exact."""
    env = HiCacheEnv(page_size=4, device_pages=16, host_slots=32)
    a = seq(0, 16)
    env.serve(a)  # a's backup (4 pages) is held in the open batch
    ctl = env.head.controller
    (chain,) = ctl.outbox.open_backups.chains
    assert [n.num_tokens for n in chain] == [16]
    env.serve(np.concatenate([a[:8], seq(900, 8)]))  # splits a's node after 8 tokens
    assert [n.num_tokens for n in chain] == [8, 8] and all(n.pending is ctl.outbox.open_backups for n in chain)
    check(env)
    env.head.flush_write_through_acks()
    assert env.head.cache_stats()["host_tokens"] == 24  # a's two halves, then the deferred new leaf
    check(env)
    env.head.evict(100)
    r = env.serve(a)  # serve checks the loaded pages hold a's KV
    assert r["loaded"] == 16 and r["device_hit"] == 0
    check(env)


def test_a_failed_step_load_fails_each_request_which_recomputes():
    env = HiCacheEnv(page_size=4, device_pages=32, host_slots=64,
                     faults={"fail_kinds": (OpKind.LOAD_H2D,), "fail_rate": 1.0})
    prefixes = _host_only_prefixes(env, 3)
    free_before = env.head.stats().free_pages
    out = env.serve_step(prefixes)  # serve_step checks the recomputed pages' KV
    assert [(o["load_failed"], o["loaded"], o["device_hit"]) for o in out] == [(True, 0, 0)] * 3
    st = env.head.cache_stats()
    assert st["miss_tokens"]["load_failed"] == 48 and st["transfer_failures"] == 3 and st["in_flight"] == 0
    assert env.head.stats().free_pages == free_before - 12  # the recomputed requests' pages, nothing leaked
    assert env.head.stats().protected_tokens == 0
    check(env)


def test_events_report_tiers():
    env = HiCacheEnv(page_size=4, device_pages=16, host_slots=32)
    env.serve(seq(0, 8))
    env.head.flush_write_through_acks()
    env.head.evict(100)
    node = env.head.match_prefix(RadixKey(seq(0, 8))).best_match_node
    events = env.head.take_events()
    assert [(e.kind, e.tier, e.node_id, e.num_tokens) for e in events] == [
        (EventKind.STORED, Tier.DEVICE, node, 8), (EventKind.STORED, Tier.HOST, node, 8),
        (EventKind.REMOVED, Tier.DEVICE, node, 8)]
    assert env.head.take_events() == []


def test_packed_events_round_trip_and_reject_out_of_range():
    for kind in EventKind:
        for tier in Tier:
            for node_id, tokens in ((0, 0), (7, 16), (2**40, 2**40 - 1)):
                assert unpack_event(pack_event(kind, tier, node_id, tokens)) == KVEvent(kind, tier, node_id, tokens)
    for node_id, tokens in ((-1, 4), (3, -1), (3, 2**40)):
        with pytest.raises(ValueError, match="out of range"):
            pack_event(EventKind.STORED, Tier.HOST, node_id, tokens)


def test_config_validation():
    for bad in (dict(host_slots=0), dict(host_slots=4, write_policy="sometimes"), dict(host_slots=4, load_back_threshold=-1),
                dict(host_slots=4, ack_timeout_s=0), dict(host_slots=4, backup_hold_calls=0),
                dict(host_slots=4, backup_hold_calls=1.5)):
        with pytest.raises(ValueError):
            HiCacheConfig(**bad)


def test_a_head_without_host_tier_refuses_every_hicache_hook():
    head = CacheHead(HeadConfig(tree=TreeConfig(4, 8)))
    hooks = [lambda: head.init_load_back(LoadBackParams(0, 0)), lambda: head.wait_load_back(0),
             head.ready_to_load_host_cache, head.check_hicache_events, head.flush_write_through_acks,
             head.take_events, head.detach_storage_backend]
    for hook in hooks:
        with pytest.raises(RuntimeError, match="no host tier"):
            hook()
    assert "host_tokens" not in head.cache_stats()


def test_drop_host_tier_keeps_l1_and_forgets_l2():
    env = HiCacheEnv(page_size=4, device_pages=16, host_slots=32)
    a, b = seq(0, 16), seq(500, 16)
    env.serve(a)
    env.head.flush_write_through_acks()
    env.head.evict(100)  # a: host-only
    env.serve(b)  # b: device + backup queued / in flight
    dropped = env.head.controller.drop_host_tier()
    assert dropped == 16
    st = env.head.cache_stats()
    assert st["host_tokens"] == 0 and st["in_flight"] == 0
    assert env.head.controller.host.num_free == 32
    ma, mb = env.head.match_prefix(RadixKey(a)), env.head.match_prefix(RadixKey(b))
    assert (ma.device_hit_len, ma.host_hit_len) == (0, 0)
    assert (mb.device_hit_len, mb.host_hit_len) == (16, 0)
    env.head.flush_write_through_acks()  # late acks of the dropped transfers change nothing
    check(env)
    env.serve(b)
    env.head.flush_write_through_acks()
    assert env.head.cache_stats()["host_tokens"] == 16  # L2 fills again
    check(env)


class _HeldHost:
    """Two real host workers; host 1's acks are held back (or failed) until ``release``."""

    def __init__(self, spec, device_pages: int, host_slots: int) -> None:
        from hicache.cluster.worker_group import LocalWorkerGroup
        from hicache.workers import HostWorker

        self.inner = LocalWorkerGroup([HostWorker(spec, device_pages, host_slots, host_index=i) for i in (0, 1)])
        self.held: list = []
        self.release_ok: bool | None = None  # None: hold host 1's acks; True/False: let them through (ok/failed)

    @property
    def num_hosts(self) -> int:
        return 2

    def submit(self, plan) -> None:
        self.inner.submit(plan)

    def _gate(self, acks):
        from dataclasses import replace

        self.held += [a for a in acks if a.host == 1]
        out = [a for a in acks if a.host != 1]
        if self.release_ok is not None:
            out += [a if self.release_ok else replace(a, ok=False, error="host 1 lost the copy") for a in self.held]
            self.held = []
        return out

    def poll(self):
        return self._gate(self.inner.poll())

    def wait(self, timeout_s: float, op_ids=None):
        return self._gate(self.inner.wait(min(timeout_s, 0.2), op_ids))


@pytest.mark.parametrize("host1_ok", [True, False])
def test_merged_backups_apply_only_when_every_host_acked(host1_ok):
    """Backups of several requests travel as one D2H op. Host 0's ack alone changes nothing; host 1's ack
    commits every chain at once (ok) or rolls every chain back (failed): slots freed, nodes device-only."""
    from support.hicache_env import make_spec

    from hicache.cluster import CacheHead, HeadConfig
    from hicache.cluster.tree import RequestState, TreeConfig

    ps = 4
    workers = _HeldHost(make_spec(ps), 32, 16)
    head = CacheHead(HeadConfig(tree=TreeConfig(ps, 32), hicache=HiCacheConfig(16, ack_timeout_s=0.5)), workers)
    for start in (0, 100, 200):
        key = RadixKey(seq(start, 8))
        m = head.match_prefix(key)
        head.inc_lock_ref(m.last_device_node)
        head.cache_finished_req(RequestState(key, head.alloc(8), 0, m.last_device_node))
    ctl = head.controller
    assert ctl.submit(force=True) == 3 and len(ctl.outbox.pending) == 1  # three chains, one op
    head.flush_write_through_acks()  # host 0 acks; host 1 holds: nothing may change (bounded wait)
    assert head.cache_stats()["host_tokens"] == 0 and ctl.in_flight == 3
    assert head.stats().protected_tokens == 24 and ctl.host.num_free == 10  # locked, slots reserved
    head.tree.check_invariants()
    ctl.check_invariants()
    workers.release_ok = host1_ok
    head.flush_write_through_acks()
    st = head.cache_stats()
    assert ctl.in_flight == 0 and head.stats().protected_tokens == 0
    if host1_ok:
        assert st["host_tokens"] == st["backed_up_tokens"] == 24 and ctl.host.num_free == 10
        assert all(n.host_slots is not None for n in head.tree.iter_nodes())
    else:
        assert st["host_tokens"] == 0 and st["transfer_failures"] == 3 and ctl.host.num_free == 16
        assert all(n.host_slots is None and n.staged_slots is None for n in head.tree.iter_nodes())
    head.tree.check_invariants()
    ctl.check_invariants()


class GatedWorkers(RecordingWorkers):
    """``RecordingWorkers`` whose acks reach the head only once ``open``; counts the head's ``wait`` calls."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.is_open, self.held, self.waits = False, [], 0

    def collect(self, op_id: int, timeout_s: float = 10.0) -> None:
        """Takes acks from the worker (kept from the head) until op ``op_id``'s came."""
        deadline = time.monotonic() + timeout_s
        while all(a.op_id != op_id for a in self.held):
            left = deadline - time.monotonic()
            assert left > 0, f"op {op_id} never acked"
            self.held += self.inner.wait(left, [op_id])  # blocks until the worker acks (or the time is up)

    def poll(self):
        acks = self.inner.poll()
        if not self.is_open:
            self.held += acks
            return []
        acks, self.held = self.held + acks, []
        return acks

    def wait(self, timeout_s, op_ids=None):
        self.waits += 1
        return self.held and self.poll() or self.inner.wait(timeout_s, op_ids)


def test_held_backups_go_before_they_would_make_an_alloc_wait_and_a_short_alloc_takes_acks_that_came():
    """Held L1->L2 backups lock their nodes: ``check_events`` sends them once L1's free + evictable pages are
    fewer than the last alloc took (a next request like it would wait for them on its critical path). An
    alloc short of pages first applies the acks that already came and retries, before it sends held backups
    and waits for them."""
    env = HiCacheEnv(page_size=4, device_pages=32, host_slots=64)
    ctl = env.head.controller
    gate = GatedWorkers(ctl.workers)
    ctl.workers = gate
    a, b, c = seq(0, 72), seq(1000, 8), seq(2000, 8)  # 18, 2, 2 pages
    env.serve(c)
    env.head.check_hicache_events()
    assert gate.plans == []  # 30 pages free: c's backup is held
    env.serve(a)
    env.head.check_hicache_events()  # 12 free, none evictable < 18 (a's alloc, the last): c + a go now
    assert [[(op.kind, op.num_pages) for op in p.ops] for p in gate.plans] == [[(OpKind.BACKUP_D2H, 20)]]
    env.serve(b)  # b's backup: held (no check_events)
    assert [n.num_tokens for n in ctl.outbox.open_backups.chains[0]] == [8]
    gate.collect(gate.plans[0].ops[0].op_id)
    gate.is_open = True
    st = env.head.stats()
    assert st.free_pages == 10 and st.evictable_tokens == 0  # a, b, c locked by their backups
    pages = env.head.alloc(24 * 4)  # c's and a's ack (already there) make them evictable: no send, no wait
    assert len(pages) == 24 and gate.waits == 0 and len(gate.plans) == 1 and ctl.outbox.open_backups.chains
    env.head.free(pages)
    check(env)
    env.head.flush_write_through_acks()
    assert env.serve(a)["loaded"] == 72  # a's L2 copy is intact (serve() checks the bytes)
    check(env)


def test_the_head_sends_after_a_call_only_what_is_due():
    # The head sends after every call only when the controller says a send is due (``send_due``): a backup
    # batch below ``backup_batch_pages`` stays queued, the call that fills it sends it, a queued load is due.
    rec = RecordingWorkers(LocalWorkerGroup([HostWorker(make_spec(4), 32, 64)]))
    config = HeadConfig(tree=TreeConfig(page_size=4, capacity_pages=32),
                        hicache=HiCacheConfig(host_slots=64, backup_batch_pages=3, ack_timeout_s=10.0))
    head = CacheHead(config, rec)
    ctl = head.controller
    a, b = seq(0, 8), seq(100, 4)
    head.insert(InsertParams(RadixKey(a), head.alloc(8)))  # 2 pages queued: below the batch
    assert rec.plans == [] and not ctl.send_due and ctl.in_flight == 1
    head.insert(InsertParams(RadixKey(b), head.alloc(4)))  # 3 pages: this call sends the batch, merged
    assert [[(op.kind, op.num_pages) for op in p.ops] for p in rec.plans] == [[(OpKind.BACKUP_D2H, 3)]]
    assert not ctl.send_due
    head.flush_write_through_acks()
    head.evict(10**6)  # both host-only now
    m = head.match_prefix(RadixKey(a))
    r = head.init_load_back(LoadBackParams(m.best_match_node, m.host_hit_len))
    assert r.load_id >= 0 and ctl.send_due and len(rec.plans) == 1  # queued, due, not sent yet
    head.free(head.alloc(4))  # any call that sends does it now
    assert [op.kind for op in rec.plans[-1].ops] == [OpKind.LOAD_H2D] and not ctl.send_due
    assert head.wait_load_back(r.load_id)
    assert ctl.in_flight == 0 and ctl.submit() == 0
    head.tree.check_invariants()
    ctl.check_invariants()


@pytest.mark.parametrize("hold_calls", [1, 3])
def test_held_backups_go_after_backup_hold_calls_check_events_calls(hold_calls):
    # The hold is a count of check_hicache_events calls (no clock): the batch below backup_batch_pages
    # stays queued for hold_calls - 1 calls and goes, as one op, in the hold_calls-th.
    rec = RecordingWorkers(LocalWorkerGroup([HostWorker(make_spec(4), 32, 64)]))
    config = HeadConfig(tree=TreeConfig(page_size=4, capacity_pages=32),
                        hicache=HiCacheConfig(host_slots=64, backup_hold_calls=hold_calls, ack_timeout_s=10.0))
    head = CacheHead(config, rec)
    head.insert(InsertParams(RadixKey(seq(0, 8)), head.alloc(8)))
    for _ in range(hold_calls - 1):
        head.check_hicache_events()
    assert rec.plans == []
    head.check_hicache_events()
    assert [[(op.kind, op.num_pages) for op in p.ops] for p in rec.plans] == [[(OpKind.BACKUP_D2H, 2)]]
    head.flush_write_through_acks()
    assert head.cache_stats()["backed_up_tokens"] == 8
    head.controller.check_invariants()


def test_head_built_copy_op_is_the_checked_op_and_the_worker_still_checks_it():
    """``TransferOp.copy_op`` (the head's sent batches) skips the constructor's checks and copies only: it
    equals the checked op, and a worker rejects a bad id in it before touching anything."""
    pages, slots = np.array([3, 1], np.int32), np.array([0, 5], np.int32)
    op = TransferOp.copy_op(7, OpKind.LOAD_H2D, pages, slots)
    assert op == TransferOp(7, OpKind.LOAD_H2D, pages, slots) and op.num_pages == 2
    env = HiCacheEnv(page_size=4, device_pages=8, host_slots=8)
    before = env.worker.device_pool.read_pages(np.arange(8, dtype=np.int32))
    for bad_pages, bad_slots in (([99], [0]), ([1, 1], [0, 2]), ([1], [77])):
        bad = TransferOp.copy_op(8, OpKind.LOAD_H2D, np.array(bad_pages, np.int32), np.array(bad_slots, np.int32))
        with pytest.raises(ValueError):
            env.worker.submit(TransferPlan(1000, (bad,)))
    np.testing.assert_array_equal(env.worker.device_pool.read_pages(np.arange(8, dtype=np.int32)), before)
