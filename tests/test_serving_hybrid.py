"""Hybrid models end to end on the embedded L1 stack: SWA+Full and recurrent+Full reference models, the head
built with their components (``StackOptions.head_components``), multi-turn chats under L1 eviction
pressure. Every output equals the no-cache run bit for bit, with L1 hits; the pools leak nothing."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.cluster.builder import MambaConfig, SWAConfig
from hicache.reference.engine.config import ForwardConfig, ModelConfig
from hicache.reference.engine.runner import ModelRunner
from hicache.reference.serve_types import ServeRequest
from hicache.reference.stack import StackOptions, build_stack, check_components

FWD = ForwardConfig(chunk_size=16, page_size=8, max_pages=32)
MODELS = {
    "swa": ModelConfig(num_layers=3, sliding_window=24),  # layers 0, 2 local (24 tokens), 1 global
    "mamba": ModelConfig(num_layers=3, recurrent_layers=(1,)),  # layer 1 recurrent, 0 and 2 attention
}


def chats(runner: ModelRunner, stack, rounds: int = 3, convs: int = 3, seed: int = 0) -> dict[str, int]:
    """Multi-turn chats sharing a system prompt; checks each output against the no-cache run."""
    rng = np.random.default_rng(seed)
    vocab = runner.model.vocab_size
    system = rng.integers(0, vocab, 21, dtype=np.int32)
    histories = [system.copy() for _ in range(convs)]
    hits = requests = loaded = 0
    for _ in range(rounds):
        for c in range(convs):
            prompt = np.concatenate([histories[c], rng.integers(0, vocab, 11, dtype=np.int32)])
            res = stack.scheduler.serve(ServeRequest(prompt, max_new_tokens=5))
            ref = runner.generate_no_cache(prompt, 5)
            assert res.output == ref.tokens
            np.testing.assert_array_equal(res.logits, ref.logits)
            hits += res.device_hit_tokens
            loaded += res.loaded_tokens
            requests += 1
            histories[c] = np.concatenate([prompt, np.asarray(res.output, dtype=np.int32)])
    return {"hits": hits, "requests": requests, "loaded": loaded}


@pytest.mark.parametrize("kind", ["swa", "mamba"])
def test_hybrid_multi_turn_under_eviction_equals_no_cache(kind):
    model = MODELS[kind]
    # L1 (and the state pool) hold about two conversations: the third evicts
    stack = build_stack(StackOptions(model=model, forward=FWD, l1_pages=20, swa_tokens=112, state_slots=6))
    assert stack.head.tree.component_names == ("full", kind)
    out = chats(stack.runner, stack, rounds=4)
    assert out["hits"] > 0
    stats = stack.head.cache_stats()
    assert stats["device_evicted_tokens"] > 0
    tree = stack.head.tree
    tree.check_invariants()
    st = tree.stats()
    assert st.request_pages == 0 and st.protected_tokens == 0  # nothing held past the requests
    if kind == "mamba":  # states evicted too (6 slots), and states cached at page ends served hits
        assert stats["mamba"]["request_slots"] == 0 and stats["mamba"]["evicted_states"] > 0
    else:  # the engine's sliding-window layers live in the SWA pool (14 pages, L1 20): SWA KV was evicted
        assert stack.runner.swa_pool is not None and stack.runner.swa_pool.shape[2] == 14
        assert stats["swa"]["request_pages"] == 0 and stats["swa"]["evicted_tokens"] > 0


def test_swa_pool_a_third_of_l1_keeps_every_hit_and_stays_exact():
    """L1 holds every chat (no Full eviction); the SWA pool a third of it (16 of 48 pages) is short on almost
    every request. The window-aware eviction frees the SWA KV no continuation reads (heads out of every window,
    past turns' ends) and keeps each chat's window: the same L1 hits as an SWA pool as large as L1, outputs
    bit-exact (the whole-node LRU tombstones served 256 of the 464 hit tokens here)."""
    model = MODELS["swa"]
    hits = {}
    for swa_pages in (48, 16):
        stack = build_stack(StackOptions(model=model, forward=FWD, l1_pages=48, swa_tokens=swa_pages * FWD.page_size))
        hits[swa_pages] = chats(stack.runner, stack, rounds=4)["hits"]
        stats = stack.head.cache_stats()
        assert stats["device_evicted_tokens"] == 0
        tree = stack.head.tree
        tree.check_invariants()
        assert tree.stats().request_pages == 0 and stats["swa"]["request_pages"] == 0
        if swa_pages == 16:
            assert stats["swa"]["evicted_tokens"] > 0
            swa = tree.component("swa")  # cached nodes whose head went and whose window stayed
            assert any(swa.has_live(n) and not swa.is_live(n) for n in tree.iter_nodes())
    assert hits[16] == hits[48] > 0


L2_OPTIONS = {  # L1 for about two conversations, component L2s smaller than the Full L2 (64 pages)
    "swa": {"swa_tokens": 112, "swa_host_tokens": 160},
    "mamba": {"state_slots": 6, "state_host_slots": 6},
}




@pytest.mark.parametrize("kind", ["swa", "mamba"])
def test_multi_turn_with_l2_under_eviction_equals_no_cache(kind):
    """L1 holds about two conversations, the component's L2 less than the Full L2 (64 pages; SWA: 20 pages,
    Mamba: 6 states, fewer than its 6 L1 slots hold with requests running): L1 and the component's host copies
    are both evicted, and L2 hits (Full pages plus the window's SWA pages / the state at the hit's end,
    loaded with them) are exact."""
    stack = build_stack(StackOptions(model=MODELS[kind], forward=FWD, l1_pages=20, l2_slots=64, **L2_OPTIONS[kind]))
    host_ids = {"swa": 20, "mamba": 6}[kind]
    assert stack.worker.pools[kind][1].num_slots == host_ids  # the worker's component L2 is the head's
    out = chats(stack.runner, stack, rounds=4)
    assert out["hits"] > 0 and out["loaded"] > 0  # L1 and L2 hits
    stack.client.flush_write_through_acks()
    stats = stack.head.cache_stats()
    assert stats["device_evicted_tokens"] > 0 and stats["loaded_tokens"] > 0
    comp = stats[kind]
    if kind == "swa":
        assert comp["host_evicted_tokens"] > 0 and 0 < comp["host_tokens"] <= comp["host_capacity_tokens"] == 160
    else:
        assert comp["evicted_states"] > 0 and comp["request_slots"] == 0
        assert comp["host_evicted_tokens"] > 0 and 0 < comp["host_states"] <= comp["host_capacity_states"] == 6
    stack.head.tree.check_invariants()
    stack.head.controller.check_invariants()
    assert stack.head.tree.stats().request_pages == 0 and stack.head.tree.stats().protected_tokens == 0


class _FailCopiesWithSWA:
    """The stack's real worker group, but every op of ``kind`` that carries SWA pages is acked as failed (the
    worker did run it: only the head's view of the ack changes, as when a host loses the copy)."""

    def __init__(self, inner, kind: str) -> None:
        self.inner, self.kind, self.failed = inner, kind, set()
        self.num_hosts = inner.num_hosts

    def submit(self, plan) -> None:
        self.failed |= {op.op_id for op in plan.ops if op.kind.value == self.kind and op.pools}
        self.inner.submit(plan)

    def _gate(self, acks):
        from dataclasses import replace

        return [replace(a, ok=False, error="lost the copy") if a.op_id in self.failed else a for a in acks]

    def poll(self):
        return self._gate(self.inner.poll())

    def wait(self, timeout_s, op_ids=None):
        return self._gate(self.inner.wait(timeout_s, op_ids))


@pytest.mark.parametrize("kind, model_kind", [("d2h", "swa"), ("h2d", "swa"), pytest.param("d2h", "mamba", marks=pytest.mark.slow),
                                              ("h2d", "mamba")])
def test_failed_copies_with_component_parts_roll_back_and_serving_stays_exact(kind, model_kind):
    """A D2H / H2D op whose SWA pages or Mamba states are lost fails as a whole: backups leave no host copy
    (their component ids freed), loads fall back to recompute from what L1 serves; outputs stay bit-exact and
    nothing leaks."""
    from hicache.cluster.tree import PageOwner

    stack = build_stack(StackOptions(model=MODELS[model_kind], forward=FWD, l1_pages=20, l2_slots=64,
                                     **L2_OPTIONS[model_kind]))
    ctl = stack.head.controller
    ctl.workers = wrapper = _FailCopiesWithSWA(ctl.workers, kind)
    chats(stack.runner, stack, rounds=4)
    stack.client.flush_write_through_acks()
    assert wrapper.failed and stack.head.cache_stats()["transfer_failures"] > 0
    pool = ctl.component_hosts[model_kind]
    assert pool.slots.count(PageOwner.REQUEST) == 0  # no component host id left reserved
    if kind == "d2h":  # no backup with component parts ever committed: no component host copy, no load
        assert pool.slots.count(PageOwner.TREE) == 0 and stack.head.cache_stats()["loaded_tokens"] == 0
    stack.head.tree.check_invariants()
    ctl.check_invariants()
    assert stack.head.tree.stats().request_pages == 0 and stack.head.tree.stats().protected_tokens == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"swa_host_tokens": 16}, r"swa host_tokens=16 cannot hold one window \(window=24\)"),
        ({"l2_slots": 2}, r"swa host_tokens=16 cannot hold one window"),  # default: as many as the Full L2
        ({"swa_host_tokens": 0}, "swa host_tokens must be a positive int or None, got 0"),
    ],
)
def test_swa_l2_too_small_for_a_window_is_refused(kwargs, match):
    options = {"model": MODELS["swa"], "forward": FWD, "l1_pages": 20, "swa_tokens": 112, "l2_slots": 64, **kwargs}
    with pytest.raises(ValueError, match=match):
        build_stack(StackOptions(**options))


def test_recurrent_states_move_through_a_workers_l2_bit_exactly():
    """The state pool is paged like KV (one slot a page): a HostWorker keeps it as a component pool, lends it
    to the model, and moves a state to L2 and back into another slot with the KV transfer programs; the
    request continues from the restored slot exactly as from the original."""
    import jax

    from hicache.reference.engine import recurrent
    from hicache.workers import ComponentPool, HostWorker, KVCacheSpec, OpKind, PoolCopy, TransferOp, TransferPlan

    model = MODELS["mamba"]
    shape = recurrent.state_shape(model, 4)  # [R, 2, slots, 1, H, d]
    spec = KVCacheSpec(model.num_layers, model.num_kv_heads, model.head_dim, FWD.page_size, "float32")
    states = ComponentPool("mamba", KVCacheSpec(shape[0], shape[4], shape[5], 1, "float32"), 4, 3)
    worker = HostWorker(spec, 16, 8, devices=[jax.devices()[0]], component_pools=(states,))
    runner = worker.attach_model(lambda kv: ModelRunner(model, FWD, pool=kv, state_slots=4))
    prompt = np.arange(1, 30, dtype=np.int32)
    worker.run_model(lambda m: m.zero_states([1]))
    worker.run_model(lambda m: m.prefill(prompt, [0, 1, 2, 3], 0, 1))
    ops = [TransferOp(1, OpKind.BACKUP_D2H, [0], [0], pools=(PoolCopy("mamba", [1], [2]),)),
           TransferOp(2, OpKind.LOAD_H2D, [5], [0], pools=(PoolCopy("mamba", [3], [2]),))]
    for seq, op in enumerate(ops, 1):
        worker.submit(TransferPlan(seq, (op,)))
        assert [a.ok for a in worker.wait(60)] == [True]
    pool = np.asarray(worker.pools["mamba"][0].kv)
    np.testing.assert_array_equal(pool[:, :, 3], pool[:, :, 1])
    nxt = np.r_[prompt, 7].astype(np.int32)
    from_restored = worker.run_model(lambda m: m.decode_step(nxt, [0, 1, 2, 3], 3))
    from_original = worker.run_model(lambda m: m.decode_step(nxt, [0, 1, 2, 3], 1))
    np.testing.assert_array_equal(from_restored, from_original)
    assert runner.state_pool is worker.pools["mamba"][0].kv
    worker.close()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"state_host_slots": 0}, "mamba host_slots must be a positive int or None, got 0"),
        ({"state_slots": 1}, r"mamba num_slots=1: a request needs 2"),
    ],
)
def test_mamba_l2_bad_sizes_are_refused(kwargs, match):
    options = {"model": MODELS["mamba"], "forward": FWD, "l1_pages": 20, "state_slots": 6, "l2_slots": 32, **kwargs}
    with pytest.raises(ValueError, match=match):
        build_stack(StackOptions(**options))


@pytest.mark.parametrize("kind", ["swa", "mamba"])
def test_a_hybrid_request_whose_decode_fails_keeps_no_lock_page_or_component_value(monkeypatch, kind):
    stack = build_stack(StackOptions(model=MODELS[kind], forward=FWD, l1_pages=28, swa_tokens=160, state_slots=4))
    prompt = np.arange(40, dtype=np.int32)
    stack.scheduler.serve(ServeRequest(prompt, 3))

    def boom(*args, **kwargs):
        raise RuntimeError("forward failed")

    monkeypatch.setattr(stack.runner, "decode", boom)
    with pytest.raises(RuntimeError, match="forward failed"):  # (after the prefill and the SWA trim)
        stack.scheduler.serve(ServeRequest(np.r_[prompt, 7, 8, 9].astype(np.int32), 3))
    stats = stack.head.cache_stats()
    assert stats[kind]["request_slots" if kind == "mamba" else "request_pages"] == 0
    assert stack.head.tree.stats().request_pages == 0 and stack.head.tree.stats().protected_tokens == 0
    stack.head.tree.check_invariants()
    monkeypatch.undo()
    res = stack.scheduler.serve(ServeRequest(np.r_[prompt, 7, 8, 9].astype(np.int32), 3))  # still serves, exact
    assert res.device_hit_tokens > 0
    assert res.output == stack.runner.generate_no_cache(np.r_[prompt, 7, 8, 9], 3).tokens


@pytest.mark.parametrize(
    "model, components, match",
    [
        (MODELS["swa"], (), r"sliding-window layers \(0, 2\) read 24 tokens back.*got None"),
        (MODELS["swa"], (SWAConfig(16),), r"read 24 tokens back.*got SWAConfig\(window=16"),
        (MODELS["swa"], (SWAConfig(24),), "needs num_tokens"),
        (MODELS["mamba"], (), r"recurrent layers \(1,\) need a mamba component.*got None"),
        (MODELS["mamba"], (MambaConfig(4, ((1, 64),)),), r"state_shapes=\(\(1, 128\),\)"),
        (MODELS["mamba"], (MambaConfig(None, ((1, 128),)),), "needs num_slots"),
        (ModelConfig(), (SWAConfig(16),), "without sliding-window layers"),
        (ModelConfig(), (MambaConfig(4),), "without recurrent layers"),
    ],
)
def test_components_that_do_not_match_the_model_are_refused(model, components, match):
    with pytest.raises(ValueError, match=match):
        check_components(model, components)
    with pytest.raises(ValueError, match=match):
        StackOptions(model=model, forward=FWD, components=components)


def test_recurrent_model_config_and_runner_bad_input():
    with pytest.raises(ValueError, match="recurrent_layers entry 3 not in"):
        ModelConfig(num_layers=3, recurrent_layers=(3,))
    with pytest.raises(ValueError, match="leave no attention layer"):
        ModelConfig(num_layers=1, recurrent_layers=(0,))
    with pytest.raises(ValueError, match=r"layers \[1\] are both"):
        ModelConfig(num_layers=3, recurrent_layers=(1,), sliding_window=8, sliding_window_layers=(1,))
    with pytest.raises(ValueError, match="needs state slots"):
        ModelRunner(MODELS["mamba"], FWD, num_pages=8)
    runner = ModelRunner(MODELS["mamba"], FWD, num_pages=8, state_slots=2)
    with pytest.raises(ValueError, match="needs an int state_slot, got None"):
        runner.prefill(np.arange(5), [0])
    with pytest.raises(ValueError, match=r"state_slot 2 is outside the state pool \[0, 2\)"):
        runner.prefill(np.arange(5), [0], 0, 2)
    with pytest.raises(ValueError, match=r"copy destination slot 5 is outside"):
        runner.copy_states([(0, 5)])
    with pytest.raises(ValueError, match="batched decode"):
        runner.decode_step_input(np.arange(5), [0])
    with pytest.raises(ValueError, match="swa_pages=4 given for a model without sliding-window layers"):
        ModelRunner(MODELS["mamba"], FWD, num_pages=8, state_slots=2, swa_pages=4)
    swa = ModelRunner(MODELS["swa"], FWD, num_pages=8, swa_pages=4)
    with pytest.raises(ValueError, match="needs each request's swa_table"):
        swa.prefill(np.arange(5), [0])
    with pytest.raises(ValueError, match=r"swa page id 4 at index 0 is outside \[-1, 4\)"):
        swa.prefill(np.arange(5), [0], swa_table=[4])
    with pytest.raises(ValueError, match="keeps no SWA pool"):
        ModelRunner(MODELS["swa"], FWD, num_pages=8).prefill(np.arange(5), [0], swa_table=[0])


@pytest.mark.parametrize("kind", ["swa", "mamba"])
def test_serving_loop_interleaves_hybrid_requests_exactly(kind):
    from hicache.reference.serving_loop import LoopOptions, ServingLoop

    stack = build_stack(StackOptions(model=MODELS[kind], forward=FWD, l1_pages=40, state_slots=8))
    loop = ServingLoop(stack.scheduler, LoopOptions(max_running=3))
    rng = np.random.default_rng(1)
    system = rng.integers(0, 512, 19, dtype=np.int32)
    prompts = [np.r_[system, rng.integers(0, 512, 6 + i)].astype(np.int32) for i in range(5)]
    results = loop.run([ServeRequest(p, 4) for p in prompts])
    for p, res in zip(prompts, results):
        ref = stack.runner.generate_no_cache(p, 4)
        assert res.output == ref.tokens
        np.testing.assert_array_equal(res.logits, ref.logits)
    assert sum(r.device_hit_tokens for r in results) > 0
    st = stack.head.tree.stats()
    assert st.request_pages == 0 and st.protected_tokens == 0


@pytest.mark.parametrize("path", ["serve", "serve_hook", "loop", "worker", "worker_hook", "l2"])
def test_the_next_turn_hits_the_previous_answers_whole_pages(path):
    """A recurrent request's decode leaves the state at its last whole page in its track slot, which the tree
    caches at finish: the next turn (history + answer + new text) hits up to the answer's last whole page,
    not only the previous prompt's, exact, through every decode path (the runner's decode, its per-step
    decoder, the serving loop's decode steps, a worker's engine; from L2 after L1 was emptied)."""
    from hicache.reference.serving_loop import LoopOptions, ServingLoop

    host = path.startswith("worker") or path == "l2"
    stack = build_stack(StackOptions(model=MODELS["mamba"], forward=FWD, l1_pages=40, state_slots=8,
                                     l2_slots=64 if host else 0))
    rng = np.random.default_rng(3)
    first = rng.integers(0, 512, 21, dtype=np.int32)  # key after 23 new tokens: 43, last whole page 40 (page 8)

    def serve(prompt, n):
        if path == "loop":
            return ServingLoop(stack.scheduler, LoopOptions(max_running=2)).run([ServeRequest(prompt, n)])[0]
        hook = (lambda: None) if path.endswith("hook") else None
        return stack.scheduler.serve(ServeRequest(prompt, n), between_steps=hook)

    answer = serve(first, 23).output
    if path == "l2":
        stack.client.flush_write_through_acks()  # the state adopted at finish went to L2 (late backup)
        stack.head.evict(10**6)
    second = np.r_[first, np.asarray(answer, np.int32), rng.integers(0, 512, 5)].astype(np.int32)
    res = serve(second, 4)
    ref = stack.runner.generate_no_cache(second, 4)
    assert res.output == ref.tokens
    np.testing.assert_array_equal(res.logits, ref.logits)
    assert res.device_hit_tokens + res.loaded_tokens == 40  # (the previous prompt's last whole page: 16)
    if path == "l2":
        assert res.loaded_tokens == 40
    stats = stack.head.cache_stats()["mamba"]
    assert stats["request_slots"] == 0
    stack.head.tree.check_invariants()
