"""The head's routing query (``CacheClient.route_query``): a dry run that reports what a real match
would find per tier and changes nothing, on a real embedded L1+L2+L3 stack."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from support.reference_shapes import FWD, MODEL

from hicache.cluster.route_query import RouteQuery, TierHits
from hicache.cluster.tree import RadixKey
from hicache.reference.serve_types import ServeRequest
from hicache.reference.stack import StackOptions, build_stack


def _snapshot(head):
    st = head.tree.stats()
    return st.num_nodes, st.match_calls, st.matched_tokens, st.free_pages, st.evictable_tokens, head.cache_stats()


def test_route_query_reports_each_tier_and_changes_nothing(tmp_path, runner):
    opts = StackOptions(MODEL, FWD, l1_pages=12, l2_slots=64, l3_url=f"file://{tmp_path}/l3", prefetch_min_tokens=8)
    stack = build_stack(opts, runner)
    rng = np.random.default_rng(3)
    a = rng.integers(0, MODEL.vocab_size, 42, dtype=np.int32)  # 5 whole pages + 2 tokens
    b = rng.integers(0, MODEL.vocab_size, 60, dtype=np.int32)
    stack.scheduler.serve(ServeRequest(a, max_new_tokens=2))
    stack.client.flush_write_through_acks()  # A's pages are in L2 and L3 now
    before = _snapshot(stack.head)
    branch = np.concatenate([a[:20], b[:30]])  # shares 2 whole pages + 4 tokens with A
    query = RouteQuery((RadixKey(a), RadixKey(b), RadixKey(branch), RadixKey(a, cache_salt="other")))
    got = stack.client.route_query(query)
    assert _snapshot(stack.head) == before  # no split of A's node, no LRU tick, no counter
    stack.head.tree.check_invariants()
    assert got.page_size == 8
    assert got.hits[0] == TierHits(40, 0, 40) and got.hits[1] == TierHits(0, 0, 0)
    assert got.hits[2] == TierHits(16, 0, 16) and got.hits[3] == TierHits(0, 0, 0)
    st = stack.head.tree.stats()
    assert got.free_l1_tokens == st.free_pages * 8 and got.evictable_l1_tokens == st.evictable_tokens
    # Agrees with what a real match then finds.
    m = stack.client.match_prefix(RadixKey(a))
    assert (m.device_hit_len, m.host_hit_len) == (got.hits[0].l1, got.hits[0].l2)
    # B fills L1: A's pages leave it and stay in L2 (and L3).
    stack.scheduler.serve(ServeRequest(b, max_new_tokens=2))
    stack.client.flush_write_through_acks()
    stack.client.evict(12 * 8)
    again = stack.client.route_query(RouteQuery((RadixKey(a),))).hits[0]
    m = stack.client.match_prefix(RadixKey(a))
    assert again == TierHits(m.device_hit_len, m.host_hit_len, 40) and m.host_hit_len > 0
    # A cold replica on the same L3 knows nothing yet: the router takes L3 from the replica that knows.
    cold = build_stack(dataclasses.replace(opts, l1_pages=8), runner)
    assert cold.client.route_query(RouteQuery((RadixKey(a),))).hits[0] == TierHits(0, 0, 0)
    cold.client.flush_write_through_acks()


def test_route_query_bad_input_is_a_type_error_and_changes_nothing(runner):
    stack = build_stack(StackOptions(MODEL, FWD, l1_pages=12), runner)
    stack.scheduler.serve(ServeRequest(np.arange(20, dtype=np.int32), max_new_tokens=1))
    before = _snapshot(stack.head)
    with pytest.raises(TypeError, match="RouteQuery"):
        stack.client.route_query([RadixKey(np.arange(20, dtype=np.int32))])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="RadixKey"):
        RouteQuery((np.arange(8, dtype=np.int32),))  # type: ignore[arg-type]
    assert _snapshot(stack.head) == before
    # An L1-only head answers too (no host tier, nothing stored).
    assert stack.client.route_query(RouteQuery((RadixKey(np.arange(20, dtype=np.int32)),))).hits[0] == TierHits(16, 0, 0)
