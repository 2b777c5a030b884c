"""``TierAwareRouter`` on real embedded stacks sharing one L3 directory, and its bounded routing call."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from support.reference_shapes import FWD, MODEL

from hicache.cluster.route_query import RouteAnswer, TierHits
from hicache.cluster.tree import RadixKey
from hicache.reference.serve_types import ServeRequest
from hicache.reference.stack import StackOptions, build_stack
from hicache.routing import (
    HeadProbe,
    ReplicaLoad,
    ReplicaView,
    RouterOptions,
    TierAwareRouter,
    TTFTModel,
    rank,
)

COST = TTFTModel(compute_s_per_token=1e-3, l2_s_per_token=1e-4, l3_s_per_token=2e-4, request_s=0.0, service_s=0.1)


def _view(l1, l2, l3, queued=0, free=64):
    return ReplicaView(RouteAnswer((TierHits(l1, l2, l3),), 8, free, 0), ReplicaLoad(queued, 0))


def test_rank_prefers_l1_and_counts_l3_on_every_replica():
    # Same load: the replica holding the prefix in L1 wins over L2, L2 over nothing.
    order, ests = rank(COST, 100, [_view(0, 0, 0), _view(0, 80, 80), _view(80, 0, 80)], [0, 0, 0], 0.1)
    assert order == (2, 1, 0) and ests[2].computed == 20 and ests[1].l2 == 80
    # Replica 0 reports the prefix stored in L3 only: replica 1 (idle, knows nothing) gets it from L3 too,
    # so the less loaded one wins; an L1 copy on a busy replica loses to L3 on an idle one when the queue costs more.
    order, ests = rank(COST, 100, [_view(0, 0, 80, queued=1), _view(0, 0, 0)], [0, 0], 0.1)
    assert order[0] == 1 and ests[1].l3 == 80 and ests[1].computed == 20
    order, _ = rank(COST, 100, [_view(80, 0, 80, queued=2), _view(0, 0, 0)], [0, 0], 0.1)
    assert order[0] == 1
    # Nobody answered: load alone (the loads the caller knows), ties by free L1 then round robin.
    order, ests = rank(COST, 100, [None, None, None], [2, 0, 1], 0.1)
    assert order == (1, 2, 0) and ests == (None, None, None)
    assert rank(COST, 100, [None, None], [0, 0], 0.1, tiebreak=1)[0] == (1, 0)
    with pytest.raises(ValueError, match="candidate"):
        rank(COST, 100, [], [], 0.1)
    with pytest.raises(ValueError, match="loads"):
        rank(COST, 100, [None], [0, 1], 0.1)


class _Held:
    """A replica whose head answers only when released (a head busy with a long step)."""

    def __init__(self, name, view):
        self.name, self.view, self.release, self.asked = name, view, threading.Event(), threading.Event()

    def probe(self, query):
        self.asked.set()
        assert self.release.wait(30), "never released"
        return self.view


class _Broken:
    name = "broken"

    def probe(self, query):
        raise ConnectionError("head gone")


def test_heads_that_do_not_answer_in_time_fall_back_to_load():
    router = TierAwareRouter(RouterOptions(probe_timeout_s=0.05, cost=COST))
    held = [_Held("a", _view(80, 0, 80)), _Held("b", _view(0, 0, 0))]
    key = RadixKey(np.arange(100, dtype=np.int32))
    try:
        d = router.route(key, held, load_of=[3, 1].__getitem__)
        assert d.fallback and d.answered == 0 and d.index == 1 and d.latency_s > 0
        # One answers, one is gone: the answer counts, the other is scored on its load alone.
        held[0].release.set()
        d = router.route(key, [held[0], _Broken()], load_of=[0, 0].__getitem__)
        assert not d.fallback and d.answered == 1 and d.index == 0 and d.estimates[1] is None
        assert router.stats.summary()["fallbacks"] == 1 and router.stats.summary()["probe_timeouts"] == 3
    finally:
        for h in held:
            h.release.set()
        router.close()
    with pytest.raises(ValueError, match="probe_timeout_s"):
        RouterOptions(probe_timeout_s=0)
    with pytest.raises(TypeError, match="RadixKey"):
        TierAwareRouter().route(np.arange(4), [held[0]])


def test_routes_to_the_replica_that_holds_the_prefix_and_outputs_stay_exact(tmp_path, runner):
    opts = StackOptions(MODEL, FWD, l1_pages=16, l2_slots=32, l3_url=f"file://{tmp_path}/l3", prefetch_min_tokens=8)
    stacks = [build_stack(opts, runner) for _ in range(3)]
    load = [ReplicaLoad(), ReplicaLoad(), ReplicaLoad()]
    probes = [HeadProbe(f"r{i}", s.client, (lambda i=i: load[i])) for i, s in enumerate(stacks)]
    router = TierAwareRouter(RouterOptions(cost=COST, parallel=False))
    rng = np.random.default_rng(7)
    docs = [rng.integers(0, MODEL.vocab_size, 64, dtype=np.int32) for _ in range(3)]
    home = {}
    for turn in range(2):
        for d, doc in enumerate(docs):
            prompt = np.concatenate([doc, rng.integers(0, MODEL.vocab_size, 5, dtype=np.int32)])
            dec = router.route(RadixKey(prompt), probes)
            if turn == 0:
                home[d] = dec.index
            else:
                assert dec.index == home[d] and dec.estimates[dec.index].l1 == 64  # its L1 copy
            res = stacks[dec.index].scheduler.serve(ServeRequest(prompt, max_new_tokens=2))
            assert res.output == runner.generate_no_cache(prompt, 2).tokens
    assert sorted(home.values()) == [0, 1, 2]  # equal ties went round the replicas
    for s in stacks:
        s.client.flush_write_through_acks()
    # The home of doc 0 gets busy: another replica serves it from the shared L3 (exact), not by recompute.
    load[home[0]] = ReplicaLoad(queued=3)
    prompt = np.concatenate([docs[0], rng.integers(0, MODEL.vocab_size, 5, dtype=np.int32)])
    dec = router.route(RadixKey(prompt), probes)
    assert dec.index != home[0] and dec.estimates[dec.index].l3 == 64
    # it enters that replica's queue (its L3 query and fetch start there; settled: no race with the clock)
    req, chosen = ServeRequest(prompt, max_new_tokens=2), stacks[dec.index]
    assert chosen.scheduler.arrive(req) and chosen.head.controller.storage.settle(60.0)
    chosen.client.flush_write_through_acks()
    res = chosen.scheduler.serve(req)
    assert res.output == runner.generate_no_cache(prompt, 2).tokens and res.storage_tokens >= 32
    for s in stacks:
        s.client.flush_write_through_acks()
