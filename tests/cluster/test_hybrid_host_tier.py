"""The SWA pages' and Mamba states' L2 on a real embedded head and worker (``HiCacheEnv(swa=...)``,
``HiCacheEnv(mamba=...)``): host tails hold only the window, a lost host tier forgets them too, a state cached
at a node already in L2 follows it there, and every hit keeps exactly the right Full and SWA KV and state."""

from __future__ import annotations

import numpy as np
from support.hicache_env import HiCacheEnv

from hicache.cluster.builder import MambaConfig, SWAConfig
from hicache.cluster.tree import PageOwner, RadixKey

PS = 4


def seq(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def test_host_tails_hold_the_window_and_a_lost_host_tier_forgets_them():
    env = HiCacheEnv(page_size=PS, device_pages=32, host_slots=32, swa=SWAConfig(6, 24 * PS, host_tokens=16 * PS))
    head = env.head
    pool = head.controller.component_hosts["swa"]
    a = seq(0, 24)  # one node of 6 pages: its host tail is the window's 2 pages
    env.serve(a)
    head.flush_write_through_acks()
    (node,) = head.tree.iter_nodes()
    assert node.host_slots is not None and len(node.component_data["swa"].host_slots) == 2
    assert head.cache_stats()["swa"]["host_tokens"] == 2 * PS
    head.evict(10**6)  # L1 empties; the L2 hit needs (and loads) only the window's SWA pages
    m = head.match_prefix(RadixKey(np.r_[a, 99]))
    assert (m.device_hit_len, m.host_hit_len) == (0, 24)
    out = env.serve(np.r_[a, 99, 98].astype(np.int32))  # checks the Full KV and the window's SWA KV
    assert out["loaded"] == 24
    head.flush_write_through_acks()
    dropped = head.controller.drop_host_tier()
    assert dropped > 0 and head.cache_stats()["swa"]["host_tokens"] == 0
    assert pool.slots.num_free == pool.num_slots and pool.slots.count(PageOwner.TREE) == 0
    head.tree.check_invariants()
    head.controller.check_invariants()
    assert env.serve(np.r_[a, 99, 98, 97].astype(np.int32))["device_hit"] == 24  # L1 still serves, exactly


def test_a_branch_state_cached_after_its_nodes_backup_follows_them_to_l2():
    """Two chats share a 16-token system prompt: the second caches a state at the branch point, on a node whose
    Full KV is already in L2 (no backup chain carries it); the next D2H op takes it alone. With L1 emptied, a
    third chat's L2 hit ends there and brings the state back with the pages (checked against the pattern)."""
    env = HiCacheEnv(page_size=PS, device_pages=32, host_slots=32, mamba=MambaConfig(num_slots=8, host_slots=8))
    head = env.head
    system = seq(0, 16)
    env.serve(np.r_[system, seq(100, 9)])  # state at its last whole page (24)
    head.flush_write_through_acks()
    env.serve(np.r_[system, seq(200, 9)])  # branches at 16: the split node [0, 16) takes a state there
    head.flush_write_through_acks()
    (split,) = [n for n in head.tree.iter_nodes() if n.parent is not None and n.parent.parent is None]
    assert split.num_tokens == 16 and split.host_slots is not None
    assert split.component_data["mamba"].host_slot >= 0  # the state went to L2 after its node's Full KV
    head.evict(10**6)
    m = head.match_prefix(RadixKey(np.r_[system, seq(300, 9)]))
    assert (m.device_hit_len, m.host_hit_len) == (0, 16)
    out = env.serve(np.r_[system, seq(300, 9)].astype(np.int32))  # checks the Full KV and the loaded state
    assert out["loaded"] == 16 and out["device_hit"] == 0
    head.flush_write_through_acks()
    head.tree.check_invariants()
    head.controller.check_invariants()
    assert head.stats().protected_tokens == 0
