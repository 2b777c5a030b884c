"""More L3 hits where they are free (issue #27 item 3): L3 is asked whatever the L2 state of the L1 match.

A request whose L1 match ends on a node with no L2 copy yet still gets its L3 extension: the fetch starts
that node's L1->L2 copy and hangs the fetched pages below it once the copy is acked. Every served request's
KV is checked exactly by ``HiCacheEnv.serve``. The stop policy waits for completion (a bound of seconds, not
the policy's judgment) and the cost model is off, so the outcome does not depend on timing."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from support.hicache_env import HiCacheEnv

from hicache.cluster.cost_model import CostOptions
from hicache.cluster.tree import RadixKey
from hicache.storage import StorageConfig
from hicache.workers import OpKind

_DETERMINED = {"prefetch_policy": "wait_complete", "prefetch_wait_max_s": 30.0, "query_wait_max_s": 30.0,
               "cost": CostOptions(enabled=False)}


def seq(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def check(env: HiCacheEnv) -> None:
    env.head.tree.check_invariants()
    env.head.controller.check_invariants()


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_l1_match_without_l2_copy_still_gets_its_l3_extension(scheme, tmp_path):
    """memory:// asks L3 on a query thread, file:// (a local disk) in the head's call: both fetch."""
    url = f"memory://l3ask-l1only-{uuid.uuid4().hex[:8]}" if scheme == "memory" else f"file://{tmp_path}/l3"
    writer = HiCacheEnv(page_size=4, device_pages=32, host_slots=64, storage_url=url, storage_kwargs=_DETERMINED)
    a = seq(0, 40)
    writer.serve(a)
    writer.head.flush_write_through_acks()
    assert writer.head.cache_stats()["storage"]["backup_pages"] == 10
    # write_through_selective backs a node up at its second hit: the first serve leaves it in L1 only
    env = HiCacheEnv(page_size=4, device_pages=32, host_slots=64, write_policy="write_through_selective",
                     storage_url=url, storage_kwargs=_DETERMINED)
    env.storage = False  # no L3 for this one: its 16 tokens are computed into L1
    env.serve(a[:16])
    env.storage = True
    m = env.head.match_prefix(RadixKey(a))
    anchor = env.head.tree.node(m.best_match_node)
    assert m.device_hit_len == 16 and m.host_hit_len == 0
    assert anchor.host_slots is None and anchor.staged_slots is None  # no L2 copy, none on its way
    r = env.serve(a)
    assert (r["device_hit"], r["prefetched"], r["loaded"]) == (16, 24, 24)
    assert anchor.host_slots is not None  # the fetch had the match copied to L2 to hang below it
    env.head.flush_write_through_acks()
    check(env)


def test_failed_l1_to_l2_copy_under_a_fetch_frees_its_slots_and_recomputes():
    """The fetch below an L1-only match is back, but the match's L1->L2 copy fails on the host: the fetched
    pages have nothing to hang below, so their L2 slots are freed and the request computes them (exactly);
    nothing stays pinned or reserved."""
    url = f"memory://l3ask-l1fail-{uuid.uuid4().hex[:8]}"
    writer = HiCacheEnv(page_size=4, device_pages=32, host_slots=64, storage_url=url, storage_kwargs=_DETERMINED)
    a = seq(0, 40)
    writer.serve(a)
    writer.head.flush_write_through_acks()
    env = HiCacheEnv(page_size=4, device_pages=32, host_slots=64, write_policy="write_through_selective",
                     storage_url=url, storage_kwargs=_DETERMINED,
                     faults={"fail_kinds": (OpKind.BACKUP_D2H,), "fail_rate": 1.0})
    env.storage = False
    env.serve(a[:16])
    env.storage = True
    free = env.head.controller.host.num_free
    r = env.serve(a)
    assert (r["device_hit"], r["prefetched"], r["loaded"]) == (16, 0, 0)
    st = env.head.cache_stats()["storage"]
    assert st["prefetch_redundant_pages"] == 6 and st["prefetch_pages"] == 0
    env.head.flush_write_through_acks()
    assert env.head.controller.host.num_free == free  # the fetch's slots went back (the copies failed too)
    assert not any(n.host_pin for n in env.head.tree.iter_nodes())
    check(env)


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_prompt_ending_or_diverging_inside_an_object_gets_its_leading_pages(scheme, tmp_path):
    """#27 item 3b, by default: with 4 pages per object, a replica with an empty L1/L2 serving a prompt that
    ends inside a stored object, or diverges from the stored chain inside it, loads the object's matching
    leading pages from L3 (without the leading-page index: only the whole objects before it)."""
    url = f"memory://objfmt-{uuid.uuid4().hex[:8]}" if scheme == "memory" else f"file://{tmp_path}/l3"
    kw = {**_DETERMINED, "pages_per_object": 4}
    writer = HiCacheEnv(page_size=4, device_pages=32, host_slots=64, storage_url=url, storage_kwargs=kw)
    a = seq(0, 40)  # 10 pages: objects [0, 4), [4, 8), partial [8, 10)
    writer.serve(a)
    writer.head.flush_write_through_acks()
    assert writer.head.cache_stats()["storage"]["backup_pages"] == 10
    diverged = np.concatenate([a[:26], seq(1000, 14)])  # page 6 differs from its token 26 on
    for prompt in (a[:24], diverged):  # both share pages 0..5 (24 tokens) with a, then end or differ
        env = HiCacheEnv(page_size=4, device_pages=32, host_slots=64, storage_url=url, storage_kwargs=kw)
        r = env.serve(prompt)
        assert (r["device_hit"], r["prefetched"], r["loaded"]) == (0, 24, 24)
        check(env)
        off = HiCacheEnv(page_size=4, device_pages=32, host_slots=64, storage_url=url,
                         storage_kwargs={**kw, "storage": StorageConfig(leading_page_index=False)})
        r = off.serve(prompt)
        assert (r["device_hit"], r["prefetched"], r["loaded"]) == (0, 16, 16)  # object [0, 4) only
        check(off)


@pytest.mark.parametrize("index", [True, False], ids=["default", "no_index"])
def test_an_l3_query_from_inside_an_object_gets_its_leading_pages(index):
    """The head's L1 match ends inside a stored object's chunk (page 5 of [4, 8)): its L3 query starts
    there, and the head passes the key of the chunk's first page (page 4) with the query and the fetch,
    so L3 finds the object by it and the prompt's pages 5 and 6 come from L3 (exact KV). Without the
    index they are recomputed."""
    url = f"memory://objfmt-mid-{uuid.uuid4().hex[:8]}"
    kw = {**_DETERMINED, "pages_per_object": 4, "storage": StorageConfig(leading_page_index=index)}
    writer = HiCacheEnv(page_size=4, device_pages=32, host_slots=64, storage_url=url, storage_kwargs=kw)
    a = seq(0, 40)
    writer.serve(a)
    writer.head.flush_write_through_acks()
    env = HiCacheEnv(page_size=4, device_pages=32, host_slots=64, storage_url=url, storage_kwargs=kw)
    r = env.serve(a[:20])  # pages 0..3 from L3's object [0, 4), page 4 from [4, 8) or computed
    assert r["prefetched"] == (20 if index else 16)
    r = env.serve(a[:28])  # L1 holds pages 0..4; L3 asked for pages 5, 6 from inside object [4, 8)
    assert r["device_hit"] == 20
    assert (r["prefetched"], r["loaded"]) == ((8, 8) if index else (0, 0))
    check(env)
