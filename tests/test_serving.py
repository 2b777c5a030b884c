"""End-to-end exactness on the embedded stacks (L1 only; L1+L2+L3 with the engine inside the host
worker): cached runs equal no-cache runs, bit for bit."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
from support.token_accounting import assert_tokens_accounted

from hicache.cluster import HeadConfig, embedded
from hicache.cluster.client import CacheClient, EmbeddedTransport
from hicache.cluster.tree import RadixKey, TreeConfig
from hicache.reference.engine.config import ForwardConfig, ModelConfig
from hicache.reference.engine.runner import ModelRunner
from hicache.reference.scheduler import Scheduler
from hicache.reference.serve_types import ServeRequest

MODEL = ModelConfig()
FWD = ForwardConfig(chunk_size=16, page_size=8, max_pages=32)


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(MODEL, FWD, num_pages=96)


def test_multi_turn_with_l1_cache_equals_no_cache(runner):
    client = embedded(HeadConfig(tree=TreeConfig(page_size=8, capacity_pages=96)))
    sched = Scheduler(client, runner, prefill_budget=32)
    rng = np.random.default_rng(0)
    system = rng.integers(0, MODEL.vocab_size, 40, dtype=np.int32)
    histories = [system.copy() for _ in range(2)]
    hits = 0
    for turn in range(3):
        for c in range(2):
            prompt = np.concatenate([histories[c], rng.integers(0, MODEL.vocab_size, 9, dtype=np.int32)])
            res = sched.serve(ServeRequest(prompt, max_new_tokens=4))
            assert_tokens_accounted(res)
            ref = runner.generate_no_cache(prompt, 4)
            assert res.output == ref.tokens
            np.testing.assert_array_equal(res.last_logits, ref.logits[0])
            hits += res.device_hit_tokens
            histories[c] = np.concatenate([prompt, np.asarray(res.output, dtype=np.int32)])
    assert hits > 0
    st = client.stats()
    assert st.request_pages == 0 and st.protected_tokens == 0


def test_prefill_asks_the_engine_for_the_last_row_only_and_stays_exact(runner):
    """A prefill (each chunked piece too) is one ``prefill`` call: the engine hands back the last logits
    row, not every row of every forward (which would wait on each forward and copy its logits)."""
    from hicache.reference.engine_adapters import RemoteModelEngine

    class Recording(RemoteModelEngine):
        page_size = FWD.page_size

        def __init__(self) -> None:
            self.calls: list[str] = []

        def call(self, method, *args):
            self.calls.append(method)
            return getattr(runner, method)(*args)

    engine = Recording()
    client = embedded(HeadConfig(tree=TreeConfig(page_size=8, capacity_pages=96)))
    sched = Scheduler(client, engine, prefill_budget=16)
    prompt = np.random.default_rng(3).integers(0, MODEL.vocab_size, 45, dtype=np.int32)
    res = sched.serve(ServeRequest(prompt, max_new_tokens=3))
    assert_tokens_accounted(res)
    ref = runner.generate_no_cache(prompt, 3)
    assert res.output == ref.tokens
    np.testing.assert_array_equal(res.last_logits, ref.logits[0])
    assert engine.calls == ["prefill", "prefill", "prefill", "decode"]  # 16 + 16 + 13 tokens, then decode


def test_l1_l2_l3_stack_equals_no_cache(tmp_path, runner):
    """Tiny L1 forces L2 load-backs; a second stack (cold L1/L2) gets L3 hits; outputs stay exact."""
    from hicache.reference.stack import StackOptions, build_stack

    opts = StackOptions(MODEL, FWD, l1_pages=12, l2_slots=64, l3_url=f"file://{tmp_path}/l3", prefetch_min_tokens=8)
    stack = build_stack(opts, runner)
    rng = np.random.default_rng(1)
    convs = [rng.integers(0, MODEL.vocab_size, 30, dtype=np.int32) for _ in range(3)]
    tiers = {"l1": 0, "l2": 0, "l3": 0}
    refs = {}
    for turn in range(2):
        for c in range(3):
            prompt = np.concatenate([convs[c], rng.integers(0, MODEL.vocab_size, 5, dtype=np.int32)])
            res = stack.scheduler.serve(ServeRequest(prompt, max_new_tokens=3))
            assert_tokens_accounted(res)
            ref = runner.generate_no_cache(prompt, 3)
            assert res.output == ref.tokens
            np.testing.assert_array_equal(res.last_logits, ref.logits[0])
            tiers["l1"] += res.device_hit_tokens
            tiers["l2"] += res.loaded_tokens
            refs[c] = (prompt, ref)
            convs[c] = np.concatenate([prompt, np.asarray(res.output, dtype=np.int32)])
    stack.client.flush_write_through_acks()
    assert tiers["l2"] > 0, tiers
    fresh = stack.scheduler.serve(ServeRequest(prompt, max_new_tokens=3, cache_salt="never-seen"))
    assert_tokens_accounted(fresh)
    assert fresh.output == ref.tokens and fresh.computed_tokens == len(prompt)
    # A cold stack (empty L1/L2) on the same L3 gets L3 hits, exact.
    cold = build_stack(dataclasses.replace(opts, l1_pages=8), runner)
    fetched = []
    for c, (prompt, ref) in refs.items():
        res = cold.scheduler.serve(ServeRequest(prompt, max_new_tokens=3))
        assert_tokens_accounted(res)
        assert res.output == ref.tokens
        np.testing.assert_array_equal(res.last_logits, ref.logits[0])
        assert res.device_hit_tokens + res.loaded_tokens + res.computed_tokens == len(prompt)
        fetched.append(res.storage_tokens)
    assert sum(fetched) > 0, fetched
    cold.client.flush_write_through_acks()

def test_l3_writes_wait_for_the_next_first_token_and_land_exact(tmp_path, runner):
    """The embedded stack holds L2->L3 writes between a request's finish and the next first token
    (``hold_storage_writes``): held after ``serve``, sent by the flush, then a cold stack reads them
    back exact. A bad flag is a TypeError."""
    from hicache.reference.stack import StackOptions, build_stack

    # 4-page objects: the cold query (the prompt less its last token: 4 pages) ends inside the 5-page
    # stored sequence; it cannot name a 16-page chunk's object that holds more pages than it asks for
    opts = StackOptions(MODEL, FWD, l1_pages=24, l2_slots=64, l3_url=f"file://{tmp_path}/l3", prefetch_min_tokens=8,
                        pages_per_object=4)
    stack = build_stack(opts, runner)
    tier = stack.head._hicache().storage
    tier.params = dataclasses.replace(tier.params, write_hold_max_s=60.0)  # no expiry on a slow CI box
    prompt = np.random.default_rng(5).integers(0, MODEL.vocab_size, 40, dtype=np.int32)
    ref = runner.generate_no_cache(prompt, 3)
    assert stack.scheduler.serve(ServeRequest(prompt, max_new_tokens=3)).output == ref.tokens
    deadline = time.monotonic() + 10  # the L1->L2 backups go out after their batching hold; their
    while tier.counters.backup_held_ops == 0 and time.monotonic() < deadline:  # acks queue the L3 writes
        stack.client.check_hicache_events()
        time.sleep(0.01)
    assert tier.writes_paused and tier.counters.backup_held_ops > 0 and tier.counters.backup_pages == 0
    stack.client.flush_write_through_acks()
    assert not tier.writes_paused
    cold = build_stack(dataclasses.replace(opts, l1_pages=8), runner)
    res = cold.scheduler.serve(ServeRequest(prompt, max_new_tokens=3))
    assert_tokens_accounted(res)
    assert res.output == ref.tokens and res.storage_tokens >= 32
    np.testing.assert_array_equal(res.last_logits, ref.logits[0])
    cold.client.flush_write_through_acks()
    with pytest.raises(TypeError, match="hold_storage_writes"):
        Scheduler(stack.client, stack.scheduler.engine, storage=True, hold_storage_writes=1)


def _stack_with_held_writes(tmp_path, runner):
    """An embedded L1+L2+L3 stack (no hold expiry) that served one request whose L2->L3 writes are
    now held on the head; returns (stack, tier, ids of the held ops)."""
    from hicache.reference.stack import StackOptions, build_stack

    opts = StackOptions(MODEL, FWD, l1_pages=24, l2_slots=64, l3_url=f"file://{tmp_path}/l3", prefetch_min_tokens=8)
    stack = build_stack(opts, runner)
    tier = stack.head._hicache().storage
    tier.params = dataclasses.replace(tier.params, write_hold_max_s=60.0)  # no expiry on a slow CI box
    prompt = np.random.default_rng(6).integers(0, MODEL.vocab_size, 40, dtype=np.int32)
    stack.scheduler.serve(ServeRequest(prompt, max_new_tokens=2))
    held = _held_writes(stack, tier)
    assert tier.writes_paused
    return stack, tier, held


def _held_writes(stack, tier) -> set[int]:
    """Ids of the L2->L3 writes held on the head, once the L1->L2 acks of the last request queued them."""
    deadline = time.monotonic() + 10
    while not tier._held and time.monotonic() < deadline:
        stack.client.check_hicache_events()
        time.sleep(0.01)
    held = {op.op_id for op in tier._held}
    assert held
    return held


def test_held_l3_writes_are_sent_after_the_first_token_is_handed_out(tmp_path, runner):
    """With ``between_steps``, the writes held since the previous request stay held through this
    request's prefill and its driver's first-token hook, and go out right after that hook (before the
    second decode step), so neither their sending nor their I/O is in this request's TTFT; exact."""
    stack, tier, held = _stack_with_held_writes(tmp_path, runner)
    seen: list[tuple[bool, bool]] = []  # per hook call: (paused, the earlier request's writes still held)

    def hook() -> None:
        seen.append((tier.writes_paused, bool(held & {op.op_id for op in tier._held})))
    prompt = np.random.default_rng(7).integers(0, MODEL.vocab_size, 33, dtype=np.int32)
    res = stack.scheduler.serve(ServeRequest(prompt, max_new_tokens=3, cache_salt="other"), hook)
    assert_tokens_accounted(res)
    assert seen == [(True, True), (False, False)]
    ref = runner.generate_no_cache(prompt, 3)
    assert res.output == ref.tokens
    np.testing.assert_array_equal(res.logits, ref.logits)
    stack.client.flush_write_through_acks()
    assert not tier._held and tier.counters.backup_held_dropped_pages == 0


def test_held_l3_writes_are_sent_without_a_second_step_or_when_the_decode_fails(tmp_path, runner):
    """A one-token answer never calls ``between_steps``: the held writes go out when its decode ends.
    A hook that raises (a failed decode) still ends the hold and loses no write."""
    stack, tier, held = _stack_with_held_writes(tmp_path, runner)
    calls: list[int] = []
    prompt = np.random.default_rng(8).integers(0, MODEL.vocab_size, 20, dtype=np.int32)
    stack.scheduler.serve(ServeRequest(prompt, max_new_tokens=1, cache_salt="one"), lambda: calls.append(1))
    assert not calls and not held & {op.op_id for op in tier._held}
    held = _held_writes(stack, tier)

    def failing() -> None:
        raise RuntimeError("driver failed")
    with pytest.raises(RuntimeError, match="driver failed"):
        stack.scheduler.serve(ServeRequest(prompt, max_new_tokens=3, cache_salt="two"), failing)
    assert not tier.writes_paused and not held & {op.op_id for op in tier._held}
    stack.client.flush_write_through_acks()
    assert tier.counters.backup_failures == 0 and tier.counters.backup_held_dropped_pages == 0


def test_warm_up_loads_every_transfer_bucket_and_leaves_real_requests_exact(tmp_path, runner):
    from hicache.reference.stack import StackOptions, build_stack, warm_up

    stack = build_stack(StackOptions(MODEL, FWD, l1_pages=12, l2_slots=32, l3_url=f"file://{tmp_path}/l3"), runner)
    assert warm_up(stack, max_pages=6) == [1, 2, 4, 6]  # each bucket's request came back from L2
    st = stack.client.stats()
    assert st.request_pages == 0 and st.protected_tokens == 0
    prompt = np.random.default_rng(5).integers(0, MODEL.vocab_size, 30, dtype=np.int32)
    res = stack.scheduler.serve(ServeRequest(prompt, max_new_tokens=3))
    assert_tokens_accounted(res)
    ref = runner.generate_no_cache(prompt, 3)
    assert res.output == ref.tokens and res.computed_tokens == len(prompt)  # nothing shared with the warm-up
    with pytest.raises(ValueError, match="no request fits"):
        warm_up(build_stack(StackOptions(MODEL, FWD, l1_pages=1), runner))
    stack.client.flush_write_through_acks()
    stack.head.detach_storage_backend()


class RecordingTransport(EmbeddedTransport):
    """The embedded transport, recording the methods of every call (single or in a step) and the round
    trips (a client over it sends as a remote one does: ``in_process`` is False)."""

    def __init__(self, head) -> None:
        super().__init__(head)
        self.methods: list[str] = []
        self.round_trips: list[list[str]] = []

    def call(self, call):
        self.methods.append(call.method.value)
        self.round_trips.append([call.method.value])
        return super().call(call)

    def step(self, calls):
        self.methods.extend(c.method.value for c in calls)
        self.round_trips.append([c.method.value for c in calls])
        return super().step(calls)


class HeadRecorder:
    """What the head did, in order, whichever client call carried it (a request's start is one
    ``begin_request``): the tree's matches ("match_prefix") and request locks ("lock"), the controller's
    prefetch checks ("check_prefetch_progress"), the storage tier's L3 queries ("prefetch_from_storage").
    Each is the real method, called through a recording wrapper on that instance."""

    def __init__(self, head) -> None:
        self.methods: list[str] = []
        ctl = head.controller
        for obj, name, label in ((head.tree, "match_prefix", "match_prefix"), (head.tree, "lock_path", "lock"),
                                 (ctl, "check_prefetch_progress", "check_prefetch_progress"),
                                 (ctl.storage, "prefetch", "prefetch_from_storage"),
                                 (ctl.storage, "prefetch_matched", "prefetch_from_storage")):
            setattr(obj, name, self._recording(getattr(obj, name), label))

    def _recording(self, fn, label):
        def run(*args, **kwargs):
            self.methods.append(label)
            return fn(*args, **kwargs)
        return run


def test_a_request_that_reuses_nothing_starts_with_one_head_call_and_l3_is_still_asked(tmp_path, runner):
    """Full stack, a new cache_salt per request: up to its first token the client sends one call
    (``begin_request``: the write hold, the match, the L3 query, the lock and the alloc); L3 is asked
    every time (another replica may have written the prefix); outputs stay exact."""
    from hicache.reference.stack import StackOptions, build_stack

    stack = build_stack(StackOptions(MODEL, FWD, l1_pages=24, l2_slots=32, l3_url=f"file://{tmp_path}/l3",
                                     prefetch_min_tokens=16), runner)
    transport = RecordingTransport(stack.head)
    stack.scheduler.client = CacheClient(transport, FWD.page_size)
    head = HeadRecorder(stack.head)
    rng = np.random.default_rng(4)
    for i in range(3):
        prompt = rng.integers(0, MODEL.vocab_size, 41, dtype=np.int32)
        transport.methods.clear()
        head.methods.clear()
        first: list[list[str]] = []
        res = stack.scheduler.serve(ServeRequest(prompt, 3, cache_salt=f"s{i}"),
                                    lambda: first.append(list(transport.methods)))
        assert first[0] == ["begin_request"], first
        assert head.methods[:3] == ["match_prefix", "prefetch_from_storage", "lock"], head.methods
        ref = runner.generate_no_cache(prompt, 3)
        assert res.output == ref.tokens and res.computed_tokens == len(prompt)
        np.testing.assert_array_equal(res.last_logits, ref.logits[0])
    # Without the write hold (a remote client's default): two round trips per request, its start and its finish
    sched = Scheduler(stack.scheduler.client, stack.scheduler.engine, hicache=True, storage=True, l3_min_tokens=16)
    transport.round_trips.clear()
    prompt = rng.integers(0, MODEL.vocab_size, 41, dtype=np.int32)
    assert sched.serve(ServeRequest(prompt, 3, cache_salt="t")).output == runner.generate_no_cache(prompt, 3).tokens
    # (the finish's step also carries the prefill's measured time for the L3 cost model)
    assert transport.round_trips == [["begin_request"], ["cache_finished_req", "check_hicache_events", "report_prefill",
                                                                "report_tokens"]]
    stack.client.flush_write_through_acks()
    stack.head.detach_storage_backend()


def test_a_start_that_cannot_get_its_pages_keeps_no_lock_and_no_write_hold(tmp_path, runner):
    """A request longer than L1: ``begin_request`` raises ``CacheCapacityError`` after it held writes,
    matched and locked: the lock is released (the namespace root's count, the prefix's path) and the
    hold ended; the next request is served exact."""
    from hicache.cluster.tree import CacheCapacityError
    from hicache.reference.stack import StackOptions, build_stack

    stack = build_stack(StackOptions(MODEL, FWD, l1_pages=8, l2_slots=32, l3_url=f"file://{tmp_path}/l3",
                                     prefetch_min_tokens=16), runner)
    tier = stack.head._hicache().storage
    rng = np.random.default_rng(8)
    prompt = rng.integers(0, MODEL.vocab_size, 41, dtype=np.int32)
    stack.scheduler.serve(ServeRequest(prompt, 2))  # its 5 pages in L1, unlocked
    stack.client.flush_write_through_acks()
    for salt, tokens in ((None, np.r_[prompt, rng.integers(0, MODEL.vocab_size, 40, dtype=np.int32)]),
                         ("other", rng.integers(0, MODEL.vocab_size, 81, dtype=np.int32))):
        with pytest.raises(CacheCapacityError):
            stack.scheduler.serve(ServeRequest(tokens, 2, cache_salt=salt))
        assert stack.client.stats().protected_tokens == 0
        assert all(root.lock_ref == 1 for root in stack.head.tree.roots().values())
        assert not tier.writes_paused
    res = stack.scheduler.serve(ServeRequest(prompt, 2))
    assert_tokens_accounted(res)
    assert res.output == runner.generate_no_cache(prompt, 2).tokens and res.device_hit_tokens == 40
    stack.client.flush_write_through_acks()
    stack.head.detach_storage_backend()


def test_a_bad_request_raises_before_any_head_call(runner):
    """A prompt or max_new_tokens the engine would refuse is refused before the request's head call:
    nothing matched, locked or allocated."""
    client = embedded(HeadConfig(tree=TreeConfig(page_size=8, capacity_pages=96)))
    sched = Scheduler(client, runner)
    before = client.stats()
    for req, text in ((ServeRequest(np.arange(9, dtype=np.int32), np.int64(2)), "max_new_tokens must be an int >= 1, got np.int64"),
                      (ServeRequest(np.arange(9, dtype=np.int32), 0), "got 0"),
                      (ServeRequest(np.zeros((2, 2), np.int32), 2), "1-D")):
        with pytest.raises(ValueError, match=text):
            sched.serve(req)
    assert client.stats() == before


def test_l3_is_asked_only_for_a_remainder_of_at_least_l3_min_tokens(tmp_path, runner):
    """The scheduler does not send a prefetch the head would skip (below prefetch_min_tokens)."""
    from hicache.reference.stack import StackOptions, build_stack

    stack = build_stack(StackOptions(MODEL, FWD, l1_pages=24, l2_slots=32, l3_url=f"file://{tmp_path}/l3",
                                     prefetch_min_tokens=24), runner)
    assert stack.scheduler.l3_min_tokens == 24
    transport = HeadRecorder(stack.head)
    rng = np.random.default_rng(3)
    asked = []
    for n in (17, 25, 33):  # whole pages of prompt[:-1]: 16, 24, 32 tokens, nothing cached
        prompt = rng.integers(0, MODEL.vocab_size, n, dtype=np.int32)
        transport.methods.clear()
        res = stack.scheduler.serve(ServeRequest(prompt, max_new_tokens=2))
        assert_tokens_accounted(res)
        assert res.output == runner.generate_no_cache(prompt, 2).tokens
        asked.append(transport.methods.count("prefetch_from_storage"))
    assert asked == [0, 1, 1]
    with pytest.raises(ValueError, match="l3_min_tokens"):
        Scheduler(stack.client, stack.scheduler.engine, storage=True, l3_min_tokens=-1)
    stack.client.flush_write_through_acks()
    stack.head.detach_storage_backend()


def test_prefetch_started_at_arrival_is_picked_up_by_serve_and_exact(tmp_path, runner):
    """``arrive`` runs the L3 query and starts the fetch while the request waits; ``serve`` checks it and
    does not ask L3 again while the match kept what the arrival query covered; outputs stay exact; bad
    arrivals raise and change nothing."""
    from hicache.reference.stack import StackOptions, build_stack

    opts = StackOptions(MODEL, FWD, l1_pages=24, l2_slots=64, l3_url=f"file://{tmp_path}/l3", prefetch_min_tokens=8)
    warm = build_stack(opts, runner)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, MODEL.vocab_size, 41, dtype=np.int32) for _ in range(3)]
    for p in prompts:
        warm.scheduler.serve(ServeRequest(p, max_new_tokens=2))
    warm.client.flush_write_through_acks()
    warm.head.detach_storage_backend()

    cold = build_stack(opts, runner)  # empty L1/L2, same L3
    transport = HeadRecorder(cold.head)
    reqs = [ServeRequest(p, max_new_tokens=2) for p in prompts]
    miss = ServeRequest(rng.integers(0, MODEL.vocab_size, 41, dtype=np.int32), max_new_tokens=2)
    # L3 asked for each; a local disk answers in the arrival's own head call: three fetches run, one miss
    assert [cold.scheduler.arrive(r) for r in reqs + [miss]] == [True, True, True, False]
    assert transport.methods.count("prefetch_from_storage") == 4
    with pytest.raises(ValueError, match="already arrived"):
        cold.scheduler.arrive(reqs[0])
    with pytest.raises(ValueError, match="non-empty"):
        cold.scheduler.arrive(ServeRequest(np.zeros(0, np.int32), 2))
    assert len(cold.scheduler._arrived) == 4
    transport.methods.clear()
    for r in reqs + [miss]:
        res = cold.scheduler.serve(r)
        assert_tokens_accounted(res)
        ref = runner.generate_no_cache(r.prompt, 2)
        assert res.output == ref.tokens
        np.testing.assert_array_equal(res.last_logits, ref.logits[0])
        assert res.device_hit_tokens + res.loaded_tokens + res.computed_tokens == len(r.prompt)
        assert res.storage_tokens == (0 if r is miss else 40)
    # each request had its one L3 query at arrival: the hits were fetched whole, the miss is not asked again
    assert transport.methods.count("prefetch_from_storage") == 0
    assert transport.methods.count("check_prefetch_progress") == 3  # the fetches (the miss was answered)
    st = cold.head.cache_stats()["storage"]
    assert st["prefetch_started"] == 3 and st["l3_queries"] == 4
    assert cold.scheduler._arrived == {}
    cold.client.flush_write_through_acks()
    cold.head.detach_storage_backend()


def test_serve_asks_l3_again_when_the_match_shrank_since_arrival(tmp_path, runner):
    """A request arrives while its prefix is in L1 (nothing to ask L3 then); the prefix is evicted from
    L1 and L2 before it is served: ``serve`` asks L3 again and gets it from there, exact. A request whose
    match kept what its arrival covered is not asked again."""
    from hicache.reference.stack import StackOptions, build_stack

    opts = StackOptions(MODEL, FWD, l1_pages=12, l2_slots=12, l3_url=f"file://{tmp_path}/l3", prefetch_min_tokens=8)
    stack = build_stack(opts, runner)
    transport = HeadRecorder(stack.head)
    rng = np.random.default_rng(11)
    first = rng.integers(0, MODEL.vocab_size, 41, dtype=np.int32)
    out = stack.scheduler.serve(ServeRequest(first, max_new_tokens=2)).output
    stack.client.flush_write_through_acks()  # its 5 pages are in L1, L2 and L3
    turn = ServeRequest(np.concatenate([first, np.asarray(out, np.int32), rng.integers(0, MODEL.vocab_size, 3,
                                                                                        dtype=np.int32)]), 2)
    kept = ServeRequest(rng.integers(0, MODEL.vocab_size, 9, dtype=np.int32), 2)
    assert not stack.scheduler.arrive(turn)  # L1 holds its prefix: L3 not asked
    assert not stack.scheduler.arrive(kept)  # asked (its one page is new): a miss, answered at once
    for _ in range(3):  # other prompts push the first one out of L1 and L2
        stack.scheduler.serve(ServeRequest(rng.integers(0, MODEL.vocab_size, 41, dtype=np.int32), 2))
        stack.client.flush_write_through_acks()
    assert stack.client.match_prefix(RadixKey(first[:40])).device_hit_len + \
        stack.client.match_prefix(RadixKey(first[:40])).host_hit_len < 40
    transport.methods.clear()
    res = stack.scheduler.serve(turn)
    assert_tokens_accounted(res)
    assert transport.methods.count("prefetch_from_storage") == 1
    assert res.storage_tokens == 40 and res.computed_tokens == len(turn.prompt) - 40
    ref = runner.generate_no_cache(turn.prompt, 2)
    assert res.output == ref.tokens
    np.testing.assert_array_equal(res.last_logits, ref.logits[0])
    transport.methods.clear()
    stack.scheduler.serve(kept)
    assert transport.methods.count("prefetch_from_storage") == 0
    stack.client.flush_write_through_acks()
    stack.head.detach_storage_backend()


def test_hook_between_decode_steps_may_call_the_cache_and_outputs_stay_exact(tmp_path, runner):
    """``serve(req, between_steps)`` runs the hook before each decode step, outside the model calls:
    there a driver takes in an arrival (its match, L3 query and fetch start over the worker's L1/L2
    while the served request holds its pages). Both requests' outputs equal the no-cache ones; the L1
    only stack (the runner itself as the engine) runs the hook the same way."""
    from hicache.reference.stack import StackOptions, build_stack

    opts = StackOptions(MODEL, FWD, l1_pages=24, l2_slots=64, l3_url=f"file://{tmp_path}/l3", prefetch_min_tokens=8)
    rng = np.random.default_rng(13)
    stored = rng.integers(0, MODEL.vocab_size, 41, dtype=np.int32)
    warm = build_stack(opts, runner)
    warm.scheduler.serve(ServeRequest(stored, max_new_tokens=2))
    warm.client.flush_write_through_acks()
    warm.head.detach_storage_backend()

    for stack in (build_stack(opts, runner), build_stack(StackOptions(MODEL, FWD, l1_pages=24), runner)):
        first = ServeRequest(rng.integers(0, MODEL.vocab_size, 20, dtype=np.int32), max_new_tokens=5)
        later = ServeRequest(stored, max_new_tokens=2)
        calls = []

        def hook():
            if not calls:
                calls.append(stack.scheduler.arrive(later))  # True: its L3 fetch started mid-decode
            else:
                calls.append(None)

        res = stack.scheduler.serve(first, hook)
        assert_tokens_accounted(res)
        assert len(calls) == first.max_new_tokens - 1
        assert calls[0] is (stack.options.l3_url is not None)
        ref = runner.generate_no_cache(first.prompt, first.max_new_tokens)
        assert res.output == ref.tokens
        np.testing.assert_array_equal(res.last_logits, ref.logits[0])
        res = stack.scheduler.serve(later)
        assert_tokens_accounted(res)
        assert res.output == runner.generate_no_cache(stored, 2).tokens
        assert res.storage_tokens == (40 if stack.options.l3_url else 0)
        if stack.options.l3_url:
            stack.client.flush_write_through_acks()
            stack.head.detach_storage_backend()


def test_failed_load_back_falls_back_to_the_l1_prefix_exact_and_leaks_nothing(runner):
    """A request with 2 pages in L1 and 3 in L2 whose load fails (a host that failed its copy):
    it recomputes the L2 part after its L1 prefix, in pages of its own, and its output equals the
    no-cache output; afterwards no page stays locked or held by a request."""
    import jax
    from support.hicache_env import FaultyWorkers

    from hicache.cluster import CacheHead
    from hicache.cluster.policy import HiCacheConfig
    from hicache.cluster.worker_group import LocalWorkerGroup
    from hicache.reference.engine_adapters import WorkerEngine
    from hicache.workers import HostWorker, KVCacheSpec, OpKind

    spec = KVCacheSpec(MODEL.num_layers, MODEL.num_kv_heads, MODEL.head_dim, FWD.page_size, MODEL.dtype)
    worker = HostWorker(spec, 12, 32, devices=jax.devices()[:1])
    worker.attach_model(lambda kv: ModelRunner(MODEL, FWD, pool=kv, params=runner.params))
    faulty = FaultyWorkers(LocalWorkerGroup([worker]), fail_kinds=(OpKind.LOAD_H2D,), fail_rate=0.0)
    head = CacheHead(HeadConfig(tree=TreeConfig(page_size=8, capacity_pages=12), hicache=HiCacheConfig(host_slots=32)),
                     faulty)
    client = CacheClient(EmbeddedTransport(head), FWD.page_size)
    sched = Scheduler(client, WorkerEngine(worker), hicache=True)
    rng = np.random.default_rng(17)
    first = rng.integers(0, MODEL.vocab_size, 41, dtype=np.int32)
    sched.serve(ServeRequest(first, max_new_tokens=2))
    client.flush_write_through_acks()
    client.evict(12 * FWD.page_size)  # the first prompt's pages are in L2 only now
    assert sched.serve(ServeRequest(first[:17], max_new_tokens=1)).loaded_tokens == 16  # 2 pages back in L1
    client.flush_write_through_acks()
    m = client.match_prefix(RadixKey(first[:40]))
    assert (m.device_hit_len, m.host_hit_len) == (16, 24)
    faulty.fail_rate = 1.0
    prompt = np.concatenate([first, rng.integers(0, MODEL.vocab_size, 4, dtype=np.int32)])
    res = sched.serve(ServeRequest(prompt, max_new_tokens=3))
    assert_tokens_accounted(res)
    ref = runner.generate_no_cache(prompt, 3)
    assert res.load_failed and res.loaded_tokens == 0 and res.device_hit_tokens == 16
    assert res.computed_tokens == len(prompt) - 16
    assert res.tokens.as_dict() == {"hit_l1": 16, "load_failed": 24, "partial_page": 5}
    assert res.output == ref.tokens
    np.testing.assert_array_equal(res.last_logits, ref.logits[0])
    client.flush_write_through_acks()
    st = client.stats()
    assert st.request_pages == 0 and st.protected_tokens == 0


class _FailingCall:
    """The runner as an engine; once ``arm``ed, its ``method`` raises at its ``nth`` call (0: the next), once."""

    def __init__(self, runner) -> None:
        self.runner, self.method, self.left = runner, None, 0

    def arm(self, method: str, nth: int) -> None:
        self.method, self.left = method, nth

    def __getattr__(self, name):
        attr = getattr(self.runner, name)
        if name != self.method:
            return attr

        def call(*args, **kwargs):
            self.left -= 1
            if self.left == -1:
                raise RuntimeError(f"{name} failed")
            return attr(*args, **kwargs)
        return call


@pytest.mark.parametrize("method,nth", [("prefill", 0), ("prefill", 1), ("decode", 0)])
def test_a_request_whose_forward_fails_keeps_no_lock_and_no_page(runner, method, nth):
    """A forward that raises (the prefill, its second chunked piece after the first was cached, or the
    decode) fails its request, and the request keeps nothing: its reused prefix is unlocked and its own
    pages are free again. The same request served afterwards is exact and reuses the shared prefix."""
    client = embedded(HeadConfig(tree=TreeConfig(page_size=8, capacity_pages=96)))
    engine = _FailingCall(runner)
    sched = Scheduler(client, engine, prefill_budget=16)
    rng = np.random.default_rng(23)
    shared = rng.integers(0, MODEL.vocab_size, 24, dtype=np.int32)
    sched.serve(ServeRequest(shared, max_new_tokens=2))
    free = client.stats().free_pages
    prompt = np.concatenate([shared, rng.integers(0, MODEL.vocab_size, 30, dtype=np.int32)])
    engine.arm(method, nth)
    with pytest.raises(RuntimeError, match=f"{method} failed"):
        sched.serve(ServeRequest(prompt, max_new_tokens=3))
    st = client.stats()
    assert st.request_pages == 0 and st.protected_tokens == 0
    assert st.free_pages + st.evictable_tokens // 8 >= free  # its pages are back (a cached piece is evictable)
    res = sched.serve(ServeRequest(prompt, max_new_tokens=3))
    assert_tokens_accounted(res)
    ref = runner.generate_no_cache(prompt, 3)
    assert res.output == ref.tokens and res.device_hit_tokens >= 16
    np.testing.assert_array_equal(res.last_logits, ref.logits[0])


# --- the iteration-level loop ---------------------------------------------------------------------


def _assert_exact(runner, req, res):
    assert_tokens_accounted(res)
    ref = runner.generate_no_cache(req.prompt, req.max_new_tokens)
    assert res.output == ref.tokens
    np.testing.assert_array_equal(res.last_logits, ref.logits[0])
    np.testing.assert_array_equal(res.logits, ref.logits)


@pytest.mark.parametrize("batched_decode", [False, True])
def test_loop_interleaves_requests_with_l1_l2_l3_hits_and_every_output_equals_no_cache(tmp_path, runner,
                                                                                        batched_decode):
    """Prefill-first loop: requests are prefilled while others decode, with hits from L1, L2 (loaded
    back) and L3 (a warm stack's, fetched while queued); every request's tokens and every logit row
    equal ``generate_no_cache`` (decode steps one call each, or one dispatch per iteration inside the
    host worker); nothing stays locked or held afterwards."""
    from hicache.reference.serving_loop import LoopOptions, ServingLoop, StepKind
    from hicache.reference.stack import StackOptions, build_stack

    opts = StackOptions(MODEL, FWD, l1_pages=24, l2_slots=64, l3_url=f"file://{tmp_path}/l3", prefetch_min_tokens=8)
    rng = np.random.default_rng(19)
    stored = [rng.integers(0, MODEL.vocab_size, 41, dtype=np.int32) for _ in range(2)]
    warm = build_stack(opts, runner)
    for p in stored:
        warm.scheduler.serve(ServeRequest(p, max_new_tokens=2))
    warm.client.flush_write_through_acks()
    warm.head.detach_storage_backend()

    stack = build_stack(opts, runner)
    shared = rng.integers(0, MODEL.vocab_size, 33, dtype=np.int32)
    stack.scheduler.serve(ServeRequest(shared, max_new_tokens=1))
    stack.client.flush_write_through_acks()
    stack.client.evict(24 * FWD.page_size)  # its 4 pages are in L2 only now
    loop = ServingLoop(stack.scheduler, LoopOptions(max_running=8, batched_decode=batched_decode))

    def turn(prefix, n, new):
        return ServeRequest(np.concatenate([prefix, rng.integers(0, MODEL.vocab_size, n, dtype=np.int32)]), new)

    waves = [[turn(shared, 9, 5), turn(stored[0], 3, 5)],  # L2 load-back, L3 fetch
             [turn(shared, 4, 4), turn(rng.integers(0, MODEL.vocab_size, 20, dtype=np.int32), 5, 3)],  # L1, cold
             [turn(stored[1], 2, 4)]]  # L3
    results, kinds = {}, []

    def step():
        s = loop.step()
        kinds.append(s.kind)
        results.update(s.finished)

    for wave in waves:  # each wave arrives while the previous one decodes
        for r in wave:
            loop.submit(r)
        for _ in range(len(wave) + 1):
            step()
    while not loop.idle:
        step()
    reqs = [r for wave in waves for r in wave]
    assert sorted(results) == list(range(len(reqs)))
    tiers = {"l1": 0, "l2": 0, "l3": 0}
    for ticket, req in enumerate(reqs):
        res = results[ticket]
        _assert_exact(runner, req, res)
        tiers["l1"] += res.device_hit_tokens
        tiers["l2"] += res.loaded_tokens - res.storage_tokens
        tiers["l3"] += res.storage_tokens
    assert all(v > 0 for v in tiers.values()), tiers
    seq = "".join("p" if k is StepKind.PREFILL else "d" for k in kinds if k is not StepKind.IDLE)
    # each wave is prefilled between the decodes of the one before (the last once L1 has room for it)
    assert seq.startswith("ppdppd") and "dpd" in seq[5:], seq
    stack.client.flush_write_through_acks()
    st = stack.client.stats()
    assert st.request_pages == 0 and st.protected_tokens == 0
    stack.head.detach_storage_backend()


def _l1_loop(runner, l1_pages=96, **options):
    from hicache.reference.serving_loop import LoopOptions, ServingLoop

    client = embedded(HeadConfig(tree=TreeConfig(page_size=8, capacity_pages=l1_pages)))
    return ServingLoop(Scheduler(client, runner), LoopOptions(**options))


def test_prefill_first_gives_a_request_arriving_mid_decode_its_first_token_before_the_running_finish(runner):
    """A arrives and decodes; B arrives during A's decode: with prefill_first the next iteration is B's
    prefill (B's first token comes while A still runs); with fcfs_whole_request A decodes to the end
    first. Both orders give the no-cache outputs."""
    from hicache.reference.serving_loop import StepKind

    rng = np.random.default_rng(23)
    a = ServeRequest(rng.integers(0, MODEL.vocab_size, 30, dtype=np.int32), 6)
    b = ServeRequest(rng.integers(0, MODEL.vocab_size, 20, dtype=np.int32), 3)
    for policy, batched in (("prefill_first", False), ("prefill_first", True), ("fcfs_whole_request", False)):
        loop = _l1_loop(runner, policy=policy, batched_decode=batched, max_running=4)
        ta = loop.submit(a)
        assert loop.step().first_token == ta
        assert loop.step().kind is StepKind.DECODE
        tb = loop.submit(b)
        done, trace = {}, []
        while not loop.idle:
            s = loop.step()
            trace.append((s.kind, s.first_token, tuple(t for t, _ in s.finished)))
            done.update(s.finished)
        first_b = next(i for i, (_, first, _) in enumerate(trace) if first == tb)
        finish_a = next(i for i, (_, _, fin) in enumerate(trace) if ta in fin)
        if policy == "prefill_first":
            assert first_b == 0 and finish_a > first_b, trace
            assert trace[1][0] is StepKind.DECODE  # then A and B decode
        else:
            assert finish_a < first_b, trace
        _assert_exact(runner, a, done[ta])
        _assert_exact(runner, b, done[tb])
        st = loop.scheduler.client.stats()
        assert st.request_pages == 0 and st.protected_tokens == 0


def test_loop_starts_a_request_only_when_l1_holds_the_running_ones_and_it(runner):
    """L1 of 12 pages, requests of 5 pages: at most two run at once (no alloc fails); decode_batch=1
    advances one running request per decode iteration, round-robin; ``run`` returns results in order."""
    from hicache.reference.serving_loop import StepKind

    loop = _l1_loop(runner, l1_pages=12, decode_batch=1)
    rng = np.random.default_rng(29)
    reqs = [ServeRequest(rng.integers(0, MODEL.vocab_size, 33, dtype=np.int32), 4) for _ in range(4)]
    for r in reqs:
        loop.submit(r)
    most, decode_finishes = 0, []
    while not loop.idle:
        s = loop.step()
        most = max(most, len(loop.running))
        if s.kind is StepKind.DECODE:
            decode_finishes.append(len(s.finished))
    assert most == 2
    assert max(decode_finishes) == 1
    results = loop.run(reqs[2:])
    for r, res in zip(reqs[2:], results):
        _assert_exact(runner, r, res)
    assert [res.device_hit_tokens for res in results] == [32, 32]  # the last two of the first pass stayed in L1


def test_loop_options_and_submit_reject_bad_values_and_change_nothing(runner):
    from hicache.reference.serving_loop import LoopOptions, SchedulePolicy, ServingLoop

    assert LoopOptions().policy is SchedulePolicy.PREFILL_FIRST
    assert LoopOptions(policy="fcfs_whole_request").policy is SchedulePolicy.FCFS_WHOLE_REQUEST
    for bad, match in (({"policy": "lifo"}, "lifo"), ({"max_running": 0}, "max_running"),
                       ({"max_waiting": True}, "max_waiting"), ({"decode_batch": -1}, "decode_batch"),
                       ({"batched_decode": 1}, "batched_decode"),
                       ({"max_waiting": 10**9}, "MAX_ARRIVED")):
        with pytest.raises(ValueError, match=match):
            LoopOptions(**bad)
    loop = _l1_loop(runner, max_waiting=1)
    with pytest.raises(TypeError, match="LoopOptions"):
        ServingLoop(loop.scheduler, {"policy": "prefill_first"})
    with pytest.raises(ValueError, match="non-empty"):
        loop.submit(ServeRequest(np.zeros(0, np.int32), 2))
    with pytest.raises(ValueError, match="max_new_tokens"):
        loop.submit(ServeRequest(np.ones(4, np.int32), 0))
    assert loop.idle and loop.scheduler._arrived == {}
    loop.submit(ServeRequest(np.ones(4, np.int32), 1))
    with pytest.raises(ValueError, match="max_waiting"):
        loop.submit(ServeRequest(np.ones(5, np.int32), 1))
    assert len(loop.waiting) == 1 and len(loop.scheduler._arrived) == 1


def test_a_failed_prefetch_is_followed_by_a_fresh_match_and_a_recompute(tmp_path, runner):
    """L3 holds the prompt's objects, corrupted after they were written: the existence check finds them,
    the read fails its checksum, the prefetch ends FAILED. The request is then computed (exact to no
    cache), and what it locks comes from a match taken after the prefetch check: the check applies
    acks, and an acked backup may merge unlocked nodes of an earlier match (``merge_backed_up``)."""
    from pathlib import Path

    from hicache.reference.stack import StackOptions, build_stack

    opts = StackOptions(MODEL, FWD, l1_pages=24, l2_slots=64, l3_url=f"file://{tmp_path}/l3", prefetch_min_tokens=8)
    prompt = np.random.default_rng(5).integers(0, MODEL.vocab_size, 41, dtype=np.int32)
    warm = build_stack(opts, runner)
    warm.scheduler.serve(ServeRequest(prompt, max_new_tokens=2))
    warm.client.flush_write_through_acks()
    warm.head.detach_storage_backend()
    inodes = {p.stat().st_ino: p for p in Path(tmp_path, "l3").rglob("*") if p.is_file() and p.stat().st_size > 64}
    assert inodes
    for p in inodes.values():  # per object (link names share it): one payload byte flipped, checksum off
        raw = bytearray(p.read_bytes())
        raw[-1] ^= 0xFF
        p.write_bytes(bytes(raw))

    cold = build_stack(opts, runner)
    transport = HeadRecorder(cold.head)
    res = cold.scheduler.serve(ServeRequest(prompt, max_new_tokens=2))
    assert_tokens_accounted(res)
    ref = runner.generate_no_cache(prompt, 2)
    assert res.output == ref.tokens
    np.testing.assert_array_equal(res.last_logits, ref.logits[0])
    assert res.storage_tokens == 0 and res.computed_tokens == len(prompt)
    methods = transport.methods
    assert methods.count("prefetch_from_storage") == 1 and methods.count("check_prefetch_progress") == 1
    check = methods.index("check_prefetch_progress")
    after = methods[check:]
    assert "match_prefix" in after and after.index("match_prefix") < after.index("lock"), after
    assert cold.head.cache_stats()["storage"]["prefetch_failures"] >= 1
    cold.head.detach_storage_backend()


def test_loop_caches_a_prompt_after_its_prefill_so_a_request_starting_mid_decode_reuses_it(runner):
    """A (shared 40-token system prompt + its own question) prefills and decodes; B (same system prompt,
    another question) arrives while A still decodes: B's match covers the system prompt's whole pages
    from L1 (A's prompt was cached right after its prefill, not at its finish). Outputs exact; after
    both finish, no request page or lock is left."""
    rng = np.random.default_rng(31)
    system = rng.integers(0, MODEL.vocab_size, 40, dtype=np.int32)
    a = ServeRequest(np.concatenate([system, rng.integers(0, MODEL.vocab_size, 9, dtype=np.int32)]), 6)
    b = ServeRequest(np.concatenate([system, rng.integers(0, MODEL.vocab_size, 13, dtype=np.int32)]), 3)
    loop = _l1_loop(runner, max_running=4)
    ta = loop.submit(a)
    assert loop.step().first_token == ta
    tb = loop.submit(b)
    assert loop.step().first_token == tb and len(loop.running) == 2  # B started while A decodes
    done = {}
    while not loop.idle:
        done.update(loop.step().finished)
    assert done[tb].device_hit_tokens == 40  # the system prompt's 5 whole pages, from A's prefill
    _assert_exact(runner, a, done[ta])
    _assert_exact(runner, b, done[tb])
    st = loop.scheduler.client.stats()
    assert st.request_pages == 0 and st.protected_tokens == 0
