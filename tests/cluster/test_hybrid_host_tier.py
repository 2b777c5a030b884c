"""The SWA pages' L2 on a real embedded head and worker (``HiCacheEnv(swa=...)``): host tails hold only the
window, a lost host tier forgets them too, and every hit keeps exactly the right Full and SWA KV."""

from __future__ import annotations

import numpy as np
from support.hicache_env import HiCacheEnv

from hicache.cluster.builder import SWAConfig
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
