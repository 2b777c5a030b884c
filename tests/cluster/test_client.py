"""The embedded client: same answers as the head, batched step with per-call errors and chained calls."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.cluster import CacheClient, CacheHead, Call, EmbeddedTransport, HeadConfig, Method, embedded
from hicache.cluster.client import ResultRef
from hicache.cluster.tree import CacheCapacityError, RadixKey, RequestState, TreeConfig


def test_step_batches_calls_and_keeps_going_after_an_error():
    client = embedded(HeadConfig(tree=TreeConfig(page_size=2, capacity_pages=8)))
    key = RadixKey([1, 2, 3, 4, 5])
    res = client.step([
        Call(Method.MATCH_PREFIX, key),
        Call("alloc", 5),
        Call("free", [7]),  # never allocated
        Call("alloc", 100),  # over capacity
        Call(Method.STATS),
    ])
    assert [r.ok for r in res] == [True, True, False, False, True]
    assert res[0].value.device_hit_len == 0
    assert res[1].value.size == 3
    assert isinstance(res[2].error, ValueError) and "page 7" in str(res[2].error)
    assert isinstance(res[3].error, CacheCapacityError)
    assert res[4].value.request_pages == 3
    with pytest.raises(ValueError):
        res[2].unwrap()


def test_full_request_cycle_through_client():
    client = embedded(HeadConfig(tree=TreeConfig(page_size=4, capacity_pages=32)))
    seq = np.arange(40, dtype=np.int32)
    for expected_hit in (0, 36):
        key = RadixKey(seq[:37])
        m = client.match_prefix(key)
        assert m.device_hit_len == expected_hit
        client.inc_lock_ref(m.last_device_node)
        pages = np.r_[m.device_pages, client.alloc(40 - m.device_hit_len)]
        client.cache_finished_req(RequestState(RadixKey(seq), pages, m.device_hit_len, m.last_device_node))
    st = client.stats()
    assert st.cached_tokens == 40 and st.request_pages == 0 and st.protected_tokens == 0


def test_bad_construction():
    with pytest.raises(TypeError):
        EmbeddedTransport(object())
    with pytest.raises(ValueError):
        Call("no_such_method", None)
    with pytest.raises(ValueError):
        HeadConfig(replica="a/b")
    head = CacheHead()
    assert CacheClient(EmbeddedTransport(head), head.page_size).stats().num_nodes == 0


def test_a_step_chains_calls_on_earlier_results():
    client = embedded(HeadConfig(tree=TreeConfig(page_size=4, capacity_pages=32)))
    seq = np.arange(20, dtype=np.int32)
    m = client.match_prefix(RadixKey(seq[:16]))
    client.inc_lock_ref(m.last_device_node)
    client.cache_finished_req(RequestState(RadixKey(seq[:16]), client.alloc(16), 0, m.last_device_node))
    res = client.step([
        Call(Method.MATCH_PREFIX, RadixKey(seq)),
        Call(Method.INC_LOCK_REF, ResultRef(0, "last_device_node")),
        Call(Method.ALLOC, ResultRef(0, "device_hit_len", scale=-1, offset=20)),
        Call(Method.FREE, ResultRef(2)),  # the result itself
        Call(Method.ALLOC, ResultRef(0, "no_such_field")),
        Call(Method.ALLOC, ResultRef(7)),  # a later call
        Call(Method.FREE, [12345]),
        Call(Method.ALLOC, ResultRef(6)),  # a failed call
        Call(Method.DEC_LOCK_REF, ResultRef(0, "last_device_node")),
    ])
    assert [r.ok for r in res] == [True, True, True, True, False, False, False, False, True]
    assert res[0].value.device_hit_len == 16 and res[2].value.size == 1  # 20 - 16 tokens: one page
    for r in res[4:8]:
        assert isinstance(r.error, ValueError)
    assert "no_such_field" in str(res[4].error) and "earlier call" in str(res[5].error)
    st = client.stats()
    assert st.request_pages == 0 and st.protected_tokens == 0  # allocated, freed, locked, unlocked
    for bad, exc in (((-1,), ValueError), ((1.0,), TypeError), ((0, "a b"), ValueError), ((0, None, 2.0), TypeError)):
        with pytest.raises(exc):
            ResultRef(*bad)


def test_submit_step_embedded_has_run_when_it_returns():
    client = embedded(HeadConfig(tree=TreeConfig(page_size=4, capacity_pages=8)))
    pending = client.submit_step([Call(Method.ALLOC, 8)])
    assert client.stats().request_pages == 2  # ran already
    pages = pending.result()[0].unwrap()
    assert pages.size == 2 and pending.result()[0].value is pages
