"""Load or recompute (issue #27): the head's cost model, alone and in an embedded stack.

The model alone: its fits recover what they are fed, it never skips on defaults alone, it skips a fetch
slower than recomputing, it cuts a fetch to what is back within the request's wait. In a stack with the
reference engine and L3 (memory:// behind the fault wrapper's latency): with L3 slowed far past the
prefill, requests recompute once the model measured one slow fetch; with fast L3 they load; every
output is bit-identical to the no-cache reference, and the estimates are in ``cache_stats()``."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from benchmarks.faulty_l3 import attach_faulty_l3
from hicache.cluster.cost_model import CostModel, CostOptions, PendingFetch, PrefillReport
from hicache.reference.engine.config import ForwardConfig, ModelConfig
from hicache.reference.engine.runner import ModelRunner
from hicache.reference.serve_types import ServeRequest
from hicache.reference.stack import StackOptions, build_stack
from hicache.storage.fault_injection import FaultPlan, OpFaults

PS = 8


def _measured(fetch_s: float, per_token_s: float, page_bytes: int = 8192) -> CostModel:
    """A model that measured one 5-page fetch taking ``fetch_s`` and prefills at ``per_token_s``."""
    m = CostModel(CostOptions(explore_every=0))
    m.observe_fetch(5, 5 * page_bytes, fetch_s)
    for tokens in (8, 40, 80):
        m.report_prefill(PrefillReport(tokens, 0.001 + tokens * per_token_s))
    return m


def test_fits_recover_latency_bandwidth_and_prefill_rate():
    m = CostModel()
    for _ in range(20):  # two op sizes: 10 ms first byte, 100 MB/s
        m.observe_fetch(1, 1_000_000, 0.01 + 1_000_000 / 100e6)
        m.observe_fetch(4, 4_000_000, 0.01 + 4_000_000 / 100e6)
        m.report_prefill(PrefillReport(10, 0.002 + 10 / 5000))
        m.report_prefill(PrefillReport(100, 0.002 + 100 / 5000))
        m.observe_load(4, 4_000_000, 4_000_000 / 2e9)
    s = m.snapshot()
    assert s["l3_latency_s"] == pytest.approx(0.01, rel=1e-3)
    assert s["l3_bytes_per_s"] == pytest.approx(100e6, rel=1e-3)
    assert s["prefill_tokens_per_s"] == pytest.approx(5000, rel=1e-3)
    assert s["prefill_fixed_s"] == pytest.approx(0.002, rel=1e-3)
    assert s["load_bytes_per_s"] == pytest.approx(2e9, rel=1e-6)
    assert s["page_bytes"] == pytest.approx(1_000_000)
    assert (s["fetch_samples"], s["load_samples"], s["prefill_samples"]) == (40, 20, 40)


def test_defaults_alone_never_skip_and_off_fetches_everything():
    fresh = CostModel(CostOptions(l3_latency_s=10.0))  # defaults that say "recompute"
    assert fresh.choose(5, PS, 1, budget_s=None).pages == 5  # nothing measured: fetch (and measure)
    slow = _measured(fetch_s=2.0, per_token_s=1e-5)
    assert slow.choose(5, PS, 1, budget_s=None).pages == 0
    off = CostModel(CostOptions(enabled=False))
    off.observe_fetch(5, 5 * 8192, 2.0)
    off.report_prefill(PrefillReport(40, 0.001))
    assert off.choose(5, PS, 1, budget_s=None).pages == 5


def test_fetch_when_faster_skip_when_slower_and_cut_to_the_wait():
    fast = _measured(fetch_s=0.001, per_token_s=1e-3)  # 5 pages in 1 ms vs 40 ms to recompute
    plan = fast.choose(5, PS, 1, budget_s=None)
    assert plan.pages == 5 and plan.fetch_s + plan.load_s < plan.recompute_s
    slow = _measured(fetch_s=1.0, per_token_s=1e-3)  # 1 s vs 40 ms
    plan = slow.choose(5, PS, 1, budget_s=None)
    assert plan.pages == 0 and plan.fetch_s > plan.recompute_s
    # 100 ms per page to fetch, 1 s per page to compute: worth it, but only 3 pages are back in 0.35 s
    per_page = CostModel(CostOptions(explore_every=0))
    for n in (1, 4):
        per_page.observe_fetch(n, n * 8192, 0.05 + 0.1 * n)
    for tokens in (8, 80):
        per_page.report_prefill(PrefillReport(tokens, tokens / PS))
    assert per_page.choose(10, PS, 1, budget_s=None).pages == 10
    assert per_page.choose(10, PS, 1, budget_s=0.36).pages == 3
    assert per_page.choose(10, PS, 4, budget_s=0.36).pages == 0  # under the least worth a fetch


def test_an_unacked_fetch_older_than_its_estimate_is_a_lower_bound_on_latency():
    """No fetch measured yet, a prefill measured (1 ms per token: 5 pages recompute in 40 ms): a fetch sent
    1 s ago and still unacked says L3 takes at least ~1 s, so a second request recomputes; one as young as
    its estimate says nothing (fetch, and measure); with the model off it never matters."""
    m = CostModel(CostOptions(explore_every=0))
    for tokens in (8, 80):
        m.report_prefill(PrefillReport(tokens, 0.001 * tokens))
    assert m.choose(5, PS, 1, budget_s=None).pages == 5  # nothing in flight: the defaults alone never skip
    young = PendingFetch(5, m.fetch_s(5) * 0.5)
    assert m.choose(5, PS, 1, budget_s=None, pending=young).pages == 5
    plan = m.choose(5, PS, 1, budget_s=None, pending=PendingFetch(5, 1.0))
    assert plan.pages == 0 and plan.fetch_s >= 1.0 - 5 * 8192 / 400e6 - 1e-9
    # a fast L3 with its bound still under the recompute: the bound alone does not skip
    assert m.choose(5, PS, 1, budget_s=None, pending=PendingFetch(5, 0.025)).pages == 5
    off = CostModel(CostOptions(enabled=False))
    off.report_prefill(PrefillReport(40, 0.001))
    assert off.choose(5, PS, 1, budget_s=None, pending=PendingFetch(5, 10.0)).pages == 5


def test_every_nth_skip_explores():
    m = CostModel(CostOptions(explore_every=3))
    m.observe_fetch(5, 5 * 8192, 1.0)
    m.report_prefill(PrefillReport(40, 0.001))
    plans = [m.choose(5, PS, 1, budget_s=None) for _ in range(6)]
    assert [p.pages for p in plans] == [0, 0, 5, 0, 0, 5]
    assert [p.explored for p in plans] == [False, False, True, False, False, True]


def test_a_request_waits_for_a_fetch_at_most_wait_factor_times_its_recompute():
    m = CostModel(CostOptions(wait_factor=2.0))
    assert m.wait_bound_s(5, PS) is None  # no prefill measured: StorageParams' bounds only
    for tokens in (8, 80):  # 1 ms per token
        m.report_prefill(PrefillReport(tokens, 0.001 * tokens))
    assert m.wait_bound_s(5, PS) == pytest.approx(2.0 * 0.040)
    assert CostModel(CostOptions(wait_factor=0.0)).wait_bound_s(5, PS) is None


@pytest.mark.parametrize("bad", [dict(alpha=0.0), dict(alpha=1.5), dict(l3_latency_s=-1.0),
                                 dict(l3_bytes_per_s=0.0), dict(prefill_tokens_per_s=float("nan")),
                                 dict(margin=-1.0), dict(explore_every=-1), dict(enabled=1),
                                 dict(wait_factor=-1.0)])
def test_bad_options_name_the_value(bad):
    name, value = next(iter(bad.items()))
    with pytest.raises(ValueError, match=name):
        CostOptions(**bad)


@pytest.mark.parametrize("tokens,seconds", [(-1, 0.1), (True, 0.1), (1.5, 0.1), (10, -0.1), (10, float("inf"))])
def test_bad_prefill_report_is_a_value_error(tokens, seconds):
    with pytest.raises(ValueError, match="PrefillReport"):
        PrefillReport(tokens, seconds)


# -- in a stack ------------------------------------------------------------------------------------
MODEL = ModelConfig()
FWD = ForwardConfig(chunk_size=16, page_size=PS, max_pages=32)
NEW_TOKENS = 3
SLOW_S = 0.5  # per L3 read: far past a 41-token prefill of the test model (milliseconds)
# The margins leave room for a loaded box, where a prefill or a fetch's thread hand-offs take 10x their quiet
# time: with slow L3 recompute unless the fetch is expected to take over half the recompute (a 0.5 s read vs a
# prefill of milliseconds); with fast L3 load unless the fetch is expected to take 200x the recompute.
COST_SLOW = CostOptions(margin=0.5, explore_every=0)
COST_FAST = CostOptions(margin=0.005, explore_every=0)


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(MODEL, FWD, num_pages=96)


def _options() -> StackOptions:
    return StackOptions(MODEL, FWD, l1_pages=24, l2_slots=64, l3_url=f"memory://placeholder-{uuid.uuid4().hex[:8]}",
                        prefetch_min_tokens=8, pages_per_object=2, l3_query_wait_s=60.0)  # (answers, then decides)


@pytest.fixture(scope="module")
def stored(runner):
    """Prompts a healthy stack (cost model off) served and stored in memory:// L3."""
    url = f"memory://cost-{uuid.uuid4().hex[:10]}"
    rng = np.random.default_rng(27)
    prompts = [rng.integers(0, MODEL.vocab_size, 41, dtype=np.int32) for _ in range(5)]
    stack = build_stack(_options(), runner)
    attach_faulty_l3(stack, url, FaultPlan(), cost=CostOptions(enabled=False))
    for p in prompts:
        stack.scheduler.serve(ServeRequest(p, NEW_TOKENS))
    stack.client.flush_write_through_acks()
    stack.head.detach_storage_backend()
    return url, prompts


def _serve_exact(stack, runner, prompt):
    res = stack.scheduler.serve(ServeRequest(prompt, NEW_TOKENS))
    ref = runner.generate_no_cache(prompt, NEW_TOKENS)
    assert res.output == ref.tokens
    np.testing.assert_array_equal(res.last_logits, ref.logits[0])
    stack.client.flush_write_through_acks()  # the fetch's acks are in the model before the next decision
    return res


def test_slow_l3_recomputes_after_one_measured_fetch(runner, stored):
    url, prompts = stored
    stack = build_stack(_options(), runner)
    attach_faulty_l3(stack, url, FaultPlan(read=OpFaults(latency_s=SLOW_S)), cost=COST_SLOW)
    _serve_exact(stack, runner, prompts[0])  # nothing measured yet: fetched (slowly), and measured
    est = stack.head.cache_stats()["storage"]["cost_model"]
    assert est["fetch_samples"] >= 1 and est["prefill_samples"] == 1
    assert est["l3_latency_s"] >= 0.9 * SLOW_S
    for p in prompts[1:]:
        res = _serve_exact(stack, runner, p)
        assert res.storage_tokens == 0 and res.computed_tokens == len(p)
    st = stack.head.cache_stats()["storage"]
    assert st["cost_skips"] == len(prompts) - 1 and st["cost_skipped_pages"] == 5 * (len(prompts) - 1)
    assert st["prefetch_started"] == 1
    stack.head.detach_storage_backend()


def test_a_prefetch_started_in_the_queue_fetches_even_when_slow(runner, stored):
    """Once the model knows L3 is slower than recompute, a request starting now recomputes; one that
    entered the queue first (``arrive``) still fetches: the queue wait hides the fetch. Exact."""
    url, prompts = stored
    stack = build_stack(_options(), runner)
    attach_faulty_l3(stack, url, FaultPlan(read=OpFaults(latency_s=SLOW_S)), cost=COST_SLOW)
    _serve_exact(stack, runner, prompts[0])  # measured: slow
    tier = stack.head.controller.storage
    req = ServeRequest(prompts[1], NEW_TOKENS)
    assert stack.scheduler.arrive(req)
    assert tier.settle(60.0)  # the query answered: the fetch went out, not skipped
    assert tier.counters.cost_skips == 0 and tier.counters.prefetch_started == 2
    stack.client.flush_write_through_acks()  # (the queue wait: the fetch is back)
    res = stack.scheduler.serve(req)
    ref = runner.generate_no_cache(prompts[1], NEW_TOKENS)
    assert res.output == ref.tokens and res.storage_tokens == 40
    stack.head.detach_storage_backend()


def test_fast_l3_loads(runner, stored):
    url, prompts = stored
    stack = build_stack(_options(), runner)
    attach_faulty_l3(stack, url, FaultPlan(), cost=COST_FAST)
    for p in prompts:
        res = _serve_exact(stack, runner, p)
        assert res.storage_tokens == 40
    st = stack.head.cache_stats()["storage"]
    assert st["cost_skips"] == 0 and st["prefetch_pages"] == 5 * len(prompts)
    est = st["cost_model"]
    assert est["fetch_samples"] >= len(prompts) and est["prefill_samples"] == len(prompts)
    assert est["l3_latency_s"] < SLOW_S / 5  # (the slow test measures >= 0.9 x SLOW_S)
    stack.head.detach_storage_backend()


@pytest.mark.slow
def test_slow_storage_benchmark_quick(tmp_path):
    """``benchmarks/slow_storage.py --quick``: the JSON schema of issue #27 and exact outputs everywhere."""
    import json

    from benchmarks import slow_storage

    out = tmp_path / "slow.json"
    slow_storage.main(["--quick", "--json", str(out)])
    points = json.loads(out.read_text())["points"]
    assert [p["latency_s"] for p in points] == list(slow_storage.QUICK_LATENCIES_S)
    for p in points:
        for key in ("no_cache_ttft_mean_s", "always_load_ttft_mean_s", "cost_aware_ttft_mean_s"):
            assert isinstance(p[key], float) and p[key] > 0, (key, p)
        assert p["wrong_outputs"] == 0, p
