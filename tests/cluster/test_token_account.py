"""Every prompt token of a request accounted for once (issue #27): the record's rules, and each hit
tier and miss reason produced by the cause it names, on the embedded reference stack (outputs exact)."""

from __future__ import annotations

import dataclasses
import uuid

import numpy as np
import pytest
from support.token_accounting import assert_tokens_accounted

from benchmarks.faulty_l3 import attach_faulty_l3
from hicache.cli import miss_column
from hicache.cluster.cost_model import CostOptions
from hicache.cluster.events import MissReason
from hicache.cluster.storage_tier import (
    COST_SKIPPED,
    FINGERPRINT_DIFFERS,
    L3_UNAVAILABLE,
    PrefetchPolicy,
    PrefetchProgress,
    PrefetchState,
    StorageParams,
)
from hicache.cluster.token_account import FATES, TokenAccount, account_request, explain_l3, miss_summary
from hicache.reference.engine.config import ForwardConfig, ModelConfig
from hicache.reference.engine.runner import ModelRunner
from hicache.reference.serve_types import ServeRequest
from hicache.reference.stack import StackOptions, build_stack
from hicache.storage import ModelFingerprint
from hicache.storage.fault_injection import FaultPlan, OpFaults

MODEL = ModelConfig()
FWD = ForwardConfig(chunk_size=16, page_size=8, max_pages=32)
N = 41  # prompt tokens: the key (40) is 5 whole pages, the last token is the partial tail
WHOLE, TAIL = 40, 1
NO_COST = CostOptions(enabled=False)


# -- the record -------------------------------------------------------------------------------------
def test_account_splits_whole_pages_refused_rest_and_the_tail():
    t = account_request(45, 8, hit_l1=16, hit_l2=8, refused=(MissReason.BELOW_THRESHOLD, 8),
                        rest=MissReason.EVICTED_L2)
    assert t.as_dict() == {"hit_l1": 16, "hit_l2": 8, "below_threshold": 8, "evicted_l2": 8, "partial_page": 5}
    assert t.hit_tokens == 24 and t.missed_tokens == 21 and t.miss(MissReason.EVICTED_L2) == 8
    assert t.miss(MissReason.COST_SKIPPED) == 0
    # a prompt of exactly whole pages: its last page is the tail (its last token starts decoding)
    assert account_request(16, 8, hit_l1=8).as_dict() == {"hit_l1": 8, "partial_page": 8}
    assert account_request(1, 8, hit_l1=0).as_dict() == {"partial_page": 1}
    assert set(t.as_dict()) <= set(FATES)


@pytest.mark.parametrize("kwargs", [
    dict(prompt_len=10, hit_l1=11),  # more than the prompt
    dict(prompt_len=10, hit_l1=4),  # less
    dict(prompt_len=10, hit_l1=-1, missed=((MissReason.NOT_CACHED, 11),)),
    dict(prompt_len=10, missed=((MissReason.NOT_CACHED, 5), (MissReason.NOT_CACHED, 5))),  # a reason twice
    dict(prompt_len=10, missed=(("not_cached", 10),)),  # not a MissReason
    dict(prompt_len=10, hit_l1=10, missed=((MissReason.NOT_CACHED, 0),)),  # an empty part
])
def test_a_record_that_does_not_sum_to_the_prompt_is_a_value_error(kwargs):
    with pytest.raises(ValueError, match="TokenAccount"):
        TokenAccount(**kwargs)


def test_account_request_rejects_hits_past_the_whole_pages():
    with pytest.raises(ValueError, match="exceed the key's 40"):
        account_request(41, 8, hit_l1=48)
    with pytest.raises(ValueError, match="page_size"):
        account_request(41, 0, hit_l1=0)


def test_l3_reasons_replace_the_trees_only_when_l3_says_why():
    tree = MissReason.EVICTED_L2

    def p(state, reason=""):
        return PrefetchProgress("r", state, 0, True, reason)

    assert explain_l3(tree, None) is tree
    assert explain_l3(None, p(PrefetchState.FAILED)) is None  # nothing missed: nothing to explain
    assert explain_l3(tree, p(PrefetchState.FAILED, "fetch failed")) is MissReason.L3_UNREADABLE
    assert explain_l3(tree, p(PrefetchState.FAILED, L3_UNAVAILABLE)) is MissReason.L3_UNAVAILABLE  # went down
    assert explain_l3(tree, p(PrefetchState.NOT_STARTED, L3_UNAVAILABLE)) is MissReason.L3_UNAVAILABLE
    assert explain_l3(tree, p(PrefetchState.RUNNING, "timed out")) is MissReason.L3_UNAVAILABLE
    assert explain_l3(tree, p(PrefetchState.NOT_STARTED, COST_SKIPPED)) is MissReason.COST_SKIPPED
    assert explain_l3(tree, p(PrefetchState.NOT_STARTED, "not enough pages in L3")) is tree
    assert explain_l3(tree, p(PrefetchState.DONE)) is tree
    # held under a previous fingerprint: explains what the tree never saw, not what it remembers losing
    assert explain_l3(MissReason.NOT_CACHED, p(PrefetchState.NOT_STARTED, FINGERPRINT_DIFFERS)) is \
        MissReason.FINGERPRINT_DIFFERS
    assert explain_l3(tree, p(PrefetchState.NOT_STARTED, FINGERPRINT_DIFFERS)) is tree


def test_summary_lists_the_largest_misses_as_shares_of_the_prompt_tokens():
    totals = {"hit_l1": 50, "not_cached": 40, "partial_page": 10}
    assert miss_summary(totals) == "not_cached 40% partial_page 10%"
    assert miss_summary({}) == "-" and miss_summary({"hit_l1": 5}) == "0"
    assert miss_column({"prompt_tokens": totals}) == "not_cached 40% partial_page 10%"
    assert miss_column({}) == "-"


# -- each fate caused on the reference stack --------------------------------------------------------
@pytest.fixture(scope="module")
def runner():
    return ModelRunner(MODEL, FWD, num_pages=96)


def _prompt(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, MODEL.vocab_size, N, dtype=np.int32)


def _serve(stack, runner, prompt, **kw):
    """Serves ``prompt`` exactly; returns its token record (checked against the result)."""
    res = stack.scheduler.serve(ServeRequest(prompt, 2, **kw))
    assert res.output == runner.generate_no_cache(prompt, 2).tokens
    (t,) = assert_tokens_accounted(res)
    return t


def _only(t: TokenAccount, fate: str) -> None:
    assert t.as_dict() == {fate: WHOLE, "partial_page": TAIL}, t


def test_l1_hits_and_misses_never_cached_evicted_from_l1_and_of_another_namespace(runner):
    stack = build_stack(StackOptions(MODEL, FWD, l1_pages=24), runner)
    a = _prompt(1)
    _only(_serve(stack, runner, a), "not_cached")
    _only(_serve(stack, runner, a), "hit_l1")
    _only(_serve(stack, runner, a, cache_salt="tenant-b"), "namespace_differs")
    stack.client.evict(10_000)
    _only(_serve(stack, runner, a), "evicted_l1")
    st = stack.head.cache_stats()["prompt_tokens"]  # the replica's sums: each served token once
    assert st == {"not_cached": WHOLE, "hit_l1": WHOLE, "namespace_differs": WHOLE, "evicted_l1": WHOLE,
                  "partial_page": 4 * TAIL}


def test_l2_hits_evicted_from_l2_and_a_load_back_below_threshold(runner):
    stack = build_stack(StackOptions(MODEL, FWD, l1_pages=24, l2_slots=64), runner)
    a, b = _prompt(2), _prompt(3)
    _serve(stack, runner, a)
    _serve(stack, runner, b)
    stack.client.flush_write_through_acks()  # both backed up to L2
    stack.client.evict(10_000)  # L1 empty: both in L2 only
    _only(_serve(stack, runner, a), "hit_l2")
    ctl = stack.head.controller
    ctl.config = dataclasses.replace(ctl.config, load_back_threshold=10_000)
    _only(_serve(stack, runner, b), "below_threshold")  # b's L2 copy was not worth loading back
    stack.client.flush_write_through_acks()
    stack.client.evict(10_000)
    assert ctl.host.evict(64) > 0  # L2 empty too
    _only(_serve(stack, runner, a), "evicted_l2")


def _l3_stack(runner, url: str, plan: FaultPlan | None = None, cost: CostOptions = NO_COST):
    opts = StackOptions(MODEL, FWD, l1_pages=24, l2_slots=64, l3_url=f"memory://placeholder-{uuid.uuid4().hex[:8]}",
                        prefetch_min_tokens=8, pages_per_object=1)
    stack = build_stack(opts, runner)
    fs = attach_faulty_l3(stack, url, plan, cost=cost)
    return stack, fs


@pytest.fixture
def stored(runner):
    """(url, prompts): prompts a healthy stack served and stored in a fresh memory:// L3."""
    url = f"memory://acct-{uuid.uuid4().hex[:10]}"
    prompts = [_prompt(10 + i) for i in range(2)]
    stack, _ = _l3_stack(runner, url)
    for p in prompts:
        _serve(stack, runner, p)
    stack.client.flush_write_through_acks()
    stack.head.detach_storage_backend()
    return url, prompts


def test_l3_hits_and_objects_unreadable(runner, stored):
    url, (a, b) = stored
    stack, _ = _l3_stack(runner, url)
    _only(_serve(stack, runner, a), "hit_l3")
    stack.head.detach_storage_backend()
    stack, fs = _l3_stack(runner, url, FaultPlan(read=OpFaults(corrupt_p=1.0)))
    _only(_serve(stack, runner, b), "l3_unreadable")  # found, fetched, every page failed its checksum
    stack.head.detach_storage_backend()


def test_l3_hits_of_an_objects_leading_pages_are_accounted(runner):
    """#27 item 3b (the leading-page index, on by default): a prompt diverging inside a stored 4-page
    object loads the object's 2 matching leading pages from L3 (exact output, every token accounted)."""
    url = f"memory://acct-lead-{uuid.uuid4().hex[:10]}"
    kw = {"pages_per_object": 4, "cost": NO_COST,
          "prefetch_policy": PrefetchPolicy.WAIT_COMPLETE, "prefetch_wait_max_s": 30.0, "query_wait_max_s": 30.0}
    a = _prompt(30)
    b = np.concatenate([a[:20], _prompt(31)[20:]])  # pages 0-1 (16 tokens) shared, page 2 differs
    writer, _ = _l3_stack(runner, url)
    attach_faulty_l3(writer, url, **kw)
    _serve(writer, runner, a)
    writer.client.flush_write_through_acks()
    writer.head.detach_storage_backend()
    reader, _ = _l3_stack(runner, url)
    attach_faulty_l3(reader, url, **kw)
    t = _serve(reader, runner, b)
    assert t.hit_l3 == 16 and t.hit_l1 == t.hit_l2 == 0, t
    reader.head.detach_storage_backend()


def test_skipped_by_the_cost_model(runner, stored):
    url, (a, b) = stored
    slow = FaultPlan(read=OpFaults(latency_s=0.5))
    stack, _ = _l3_stack(runner, url, slow, CostOptions(margin=0.05, explore_every=0))
    _serve(stack, runner, a)  # nothing measured yet: fetched (slowly: past the request's wait), and measured
    stack.client.flush_write_through_acks()
    _only(_serve(stack, runner, b), "cost_skipped")
    stack.head.detach_storage_backend()


def test_fingerprint_differs(runner, stored):
    """The prompts were stored by this model under its fingerprint F; a head serving "the next version"
    (fingerprint F') that lists F among its previous fingerprints misses them for fingerprint_differs;
    without that list, or for a prompt L3 never held under F, they are not_cached."""
    url, (a, b) = stored
    stack, _ = _l3_stack(runner, url)
    old = stack.head.controller.storage.params.fingerprint
    new = dataclasses.replace(old, model_id=old.model_id + "-v2")
    attach_faulty_l3(stack, url, fingerprint=new, previous_fingerprints=(old,), cost=NO_COST)
    _only(_serve(stack, runner, a), "fingerprint_differs")
    _only(_serve(stack, runner, _prompt(99)), "not_cached")  # nowhere in L3
    attach_faulty_l3(stack, url, fingerprint=dataclasses.replace(old, model_id=old.model_id + "-v3"),
                     previous_fingerprints=(), cost=NO_COST)
    _only(_serve(stack, runner, b), "not_cached")  # no previous fingerprints listed: not asked
    stack.head.detach_storage_backend()


def test_previous_fingerprints_must_be_other_fingerprints_of_the_same_page_size():
    fp = ModelFingerprint("m", "float32", 8, 2, 2, 4)
    with pytest.raises(ValueError, match="previous_fingerprints"):
        StorageParams("memory://x", fp, previous_fingerprints=(fp,))
    with pytest.raises(ValueError, match="previous_fingerprints"):
        StorageParams("memory://x", fp, previous_fingerprints=(dataclasses.replace(fp, page_size=16),))
    with pytest.raises(TypeError, match="previous_fingerprints"):
        StorageParams("memory://x", fp, previous_fingerprints=fp)
    other = dataclasses.replace(fp, dtype="bfloat16")
    assert StorageParams("memory://x", fp, previous_fingerprints=[other]).previous_fingerprints == (other,)


def test_evicted_from_l3(runner):
    """Stored in L2 and L3, dropped from L2, then gone from L3 too (its capacity eviction, here a delete)."""
    url = f"memory://acct-{uuid.uuid4().hex[:10]}"
    stack, fs = _l3_stack(runner, url)
    a = _prompt(20)
    _serve(stack, runner, a)
    stack.client.flush_write_through_acks()  # in L2 and L3
    stack.client.evict(10_000)
    assert stack.head.controller.host.evict(64) > 0
    stack.head.controller.storage.flush_manifest()  # its background write would land in the middle of the rm
    fs.rm(url, recursive=True)
    _only(_serve(stack, runner, a), "evicted_l3")
    stack.head.detach_storage_backend()


def test_l3_unavailable_when_asked_at_arrival_and_at_the_start(runner, stored):
    """L3 refuses every call: once the hosts' breaker is open, a request asking L3 at its start and one
    asking at arrival (``arrive``) both miss for l3_unavailable, never "not cached"."""
    from benchmarks.faulty_l3 import worker_storage
    from hicache.storage.testing import ManualClock

    url, (a, b) = stored
    stack = build_stack(StackOptions(MODEL, FWD, l1_pages=24, l2_slots=64, prefetch_min_tokens=8,
                                     l3_url=f"memory://placeholder-{uuid.uuid4().hex[:8]}"), runner)
    attach_faulty_l3(stack, url, FaultPlan.every(OpFaults(refuse_p=1.0)), clock=ManualClock(), settle=False,
                     cost=NO_COST)
    breaker, tier = worker_storage(stack).breaker, stack.head.controller.storage
    for i in range(8):  # refused calls open the breaker (attach's warm-restart listing is one of them)
        if breaker.state.value == "open":
            break
        _only(_serve(stack, runner, _prompt(30 + i)), "l3_unavailable")
        tier.settle(30.0)
    assert breaker.state.value == "open"
    _only(_serve(stack, runner, a), "l3_unavailable")
    req = ServeRequest(b, 2)
    assert not stack.scheduler.arrive(req)  # not asked: down
    res = stack.scheduler.serve(req)
    assert res.output == runner.generate_no_cache(b, 2).tokens
    (t,) = assert_tokens_accounted(res)
    _only(t, "l3_unavailable")
    stack.head.detach_storage_backend()


def test_l3_unavailable_when_no_l3_is_attached(runner, stored):
    """A replica whose L3 is not attached (its attach failed at start or rebuild, or it was detached)
    serves a client that asks L3 from L1/L2: exact outputs, L3's part missed as l3_unavailable, at the
    request's start and at arrival alike (never an error)."""
    url, (a, b) = stored
    stack, _ = _l3_stack(runner, url)
    stack.head.detach_storage_backend()
    _only(_serve(stack, runner, a), "l3_unavailable")
    req = ServeRequest(b, 2)
    assert not stack.scheduler.arrive(req)
    res = stack.scheduler.serve(req)
    assert res.output == runner.generate_no_cache(b, 2).tokens
    (t,) = assert_tokens_accounted(res)
    _only(t, "l3_unavailable")
    _only(_serve(stack, runner, a), "hit_l1")  # what it computed is cached as usual
    assert stack.head.cache_stats()["prompt_tokens"]["l3_unavailable"] == 2 * WHOLE
