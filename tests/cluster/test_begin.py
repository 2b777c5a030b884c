"""``CacheHead.begin_request``: a request's start in one call gives what the separate calls give."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.cluster import CacheHead, Call, HeadConfig, Method
from hicache.cluster.begin import BeginParams
from hicache.cluster.tree import RadixKey, RequestState, TreeConfig


def _head() -> CacheHead:
    return CacheHead(HeadConfig(tree=TreeConfig(page_size=4, capacity_pages=32)))


def test_begin_locks_and_allocates_as_match_lock_and_alloc_do():
    """Twin L1-only heads: one gets begin_request, the other match + inc_lock_ref + alloc; pages, locks
    and the tree's state stay equal over a request, its finish and the next turn's (L1 hit) start."""
    one, separate = _head(), _head()
    seq = np.arange(100, 160, dtype=np.int32)
    for prompt_len, hit in ((37, 0), (53, 36)):
        key = RadixKey(seq[:prompt_len])
        r = one.begin_request(BeginParams(key, prompt_len + 4))
        m = separate.match_prefix(key)
        separate.inc_lock_ref(m.last_device_node)
        pages = separate.alloc(prompt_len + 4 - m.device_hit_len)
        assert r.match.device_hit_len == m.device_hit_len == hit and r.prefetch is None and r.fetched == 0
        np.testing.assert_array_equal(r.match.device_pages, m.device_pages)
        np.testing.assert_array_equal(r.pages, pages)
        assert one.stats() == separate.stats() and one.stats().protected_tokens == hit
        table = np.r_[m.device_pages, pages]
        for head in (one, separate):
            head.cache_finished_req(RequestState(key, table, hit, m.last_device_node))
        assert one.stats() == separate.stats() and one.stats().protected_tokens == 0


def test_bad_params_raise_naming_the_value_and_change_nothing():
    head = _head()
    key = RadixKey(np.arange(10, dtype=np.int32))
    before = head.stats()
    for args, error, text in (((key, 9), ValueError, "total_tokens 9"),
                              ((key, -1), ValueError, "-1"),
                              ((np.arange(10), 12), TypeError, "ndarray"),
                              ((key, 12, 1), TypeError, "hold_writes"),
                              ((key, 12, False, 7), TypeError, "check_prefetch"),
                              ((key, 12, False, None, "r", 2.5), ValueError, "l3_min_tokens")):
        with pytest.raises(error, match=text):
            BeginParams(*args)
    with pytest.raises(TypeError, match="BeginParams"):
        head.begin_request(key)
    for params in (BeginParams(key, 12, hold_writes=True), BeginParams(key, 12, prefetch_id="r")):
        with pytest.raises(RuntimeError, match="host tier"):  # an L1-only head: no write hold, no L3
            head.begin_request(params)
        assert head.step([Call(Method.BEGIN_REQUEST, params)])[0].ok is False
    assert head.stats() == before
