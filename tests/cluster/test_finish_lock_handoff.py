"""cache_finished_req under write-through: the backup the insert starts takes the request's path lock over
(``FullComponent.handoff``); locks and token accounting end exactly as with a lock and an unlock."""

from __future__ import annotations

import numpy as np
import pytest
from support.hicache_env import HiCacheEnv

from hicache.cluster.tree import RadixKey, RequestState


def seq(start, n):
    return np.arange(start, start + n, dtype=np.int32)


def locks(env: HiCacheEnv, tokens) -> list[int]:
    tree = env.head.tree
    node = tree.node(env.head.match_prefix(RadixKey(tokens)).last_device_node)
    return [n.lock_ref for n in tree._ancestors(node)]


@pytest.mark.parametrize("locked_elsewhere", [False, True])
def test_backup_takes_over_the_finishing_request_lock(locked_elsewhere):
    env = HiCacheEnv(page_size=4, device_pages=32, host_slots=64)
    head, tree = env.head, env.head.tree
    a = seq(0, 16)
    env.serve(a)
    head.flush_write_through_acks()
    other = head.match_prefix(RadixKey(a)).last_device_node
    if locked_elsewhere:  # another request holds a's path: counts above the request's node stay > 1
        head.inc_lock_ref(other)
    ab = np.r_[a, seq(100, 8)]
    m = head.match_prefix(RadixKey(ab))
    head.inc_lock_ref(m.last_device_node)
    own = head.alloc(8)
    head.cache_finished_req(RequestState(RadixKey(ab), np.r_[m.device_pages, own], m.device_hit_len, m.last_device_node))
    assert tree.full.handoff is None
    extra = int(locked_elsewhere)
    # The new leaf's backup is in flight: it holds the whole path; the request's lock is gone.
    assert locks(env, ab) == [1 + extra, 1]
    tree.check_invariants()
    head.flush_write_through_acks()
    # Acked: the leaf absorbs ``a`` (both in L1 and L2, equal locks) unless another request holds ``a``.
    assert locks(env, ab) == ([extra, 0] if locked_elsewhere else [0])
    assert tree.stats().protected_tokens == 16 * extra
    if locked_elsewhere:
        head.dec_lock_ref(other)
    assert tree.stats().evictable_tokens == 24
    tree.check_invariants()
    env.head.controller.check_invariants()


def test_a_rejected_finish_leaves_locks_and_handoff_unchanged():
    env = HiCacheEnv(page_size=4, device_pages=32, host_slots=64)
    head, tree = env.head, env.head.tree
    a = seq(0, 16)
    env.serve(a)
    head.flush_write_through_acks()
    ab = np.r_[a, seq(100, 8)]
    m = head.match_prefix(RadixKey(ab))
    head.inc_lock_ref(m.last_device_node)
    own = head.alloc(8)
    bad = RequestState(RadixKey(ab), np.r_[m.device_pages, own[:1], own[:1]], m.device_hit_len, m.last_device_node)
    with pytest.raises(ValueError):
        head.cache_finished_req(bad)
    assert tree.full.handoff is None
    assert locks(env, a) == [1]
    head.cache_finished_req(RequestState(RadixKey(ab), np.r_[m.device_pages, own], m.device_hit_len, m.last_device_node))
    head.flush_write_through_acks()
    assert locks(env, ab) == [0]  # acked: the leaf absorbed ``a`` (RadixTree.merge_backed_up)
    tree.check_invariants()
