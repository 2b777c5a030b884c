"""Hybrid models through L3 (issue #26 item 3): SWA pages and Mamba states stored as objects of their own pool
beside the Full pages, fetched back with them. A fresh stack (new head, new worker: empty L1 and L2) on the L3
that another stack filled serves the same requests from L3, bit for bit as the no-cache run; a missing or
corrupt component object makes the hit shorter or a miss, never wrong KV."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest

from hicache.cluster.cost_model import CostOptions
from hicache.reference.engine.config import ForwardConfig, ModelConfig
from hicache.reference.serve_types import ServeRequest
from hicache.reference.stack import StackOptions, build_stack

FWD = ForwardConfig(chunk_size=16, page_size=8, max_pages=32)
MODELS = {
    "swa": ModelConfig(num_layers=3, sliding_window=24),  # layers 0, 2 local (24 tokens = 3 pages), 1 global
    "mamba": ModelConfig(num_layers=3, recurrent_layers=(1,)),  # layer 1 recurrent
}


def options(kind: str, root: Path) -> StackOptions:
    # the cost model off, wait_complete and a long query wait: what L3 holds is fetched and waited for,
    # whatever this box's speed
    return StackOptions(model=MODELS[kind], forward=FWD, l1_pages=24, l2_slots=48, l3_url=f"file://{root}",
                        prefetch_min_tokens=16, l3_cost=CostOptions(enabled=False), pages_per_object=2,
                        l3_query_wait_s=60.0)


def prompts(vocab: int, seed: int = 0) -> list[np.ndarray]:
    """Two conversations of two turns on a shared system prompt; prompts of 6-12 pages (longer than the window)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, 21, dtype=np.int32)
    return [np.concatenate([system, rng.integers(0, vocab, n, dtype=np.int32)]) for n in (27, 35, 60, 75)]


def serve_all(stack, reqs: list[np.ndarray]) -> dict[str, int]:
    """Serves ``reqs`` in order, each output checked against the no-cache run (tokens and logits)."""
    loaded = 0
    for prompt in reqs:
        res = stack.scheduler.serve(ServeRequest(prompt, max_new_tokens=4))
        ref = stack.runner.generate_no_cache(prompt, 4)
        assert res.output == ref.tokens
        np.testing.assert_array_equal(res.logits, ref.logits)
        loaded += res.loaded_tokens
    stack.client.flush_write_through_acks()
    stack.head.tree.check_invariants()
    stack.head.controller.check_invariants()
    return {"loaded": loaded, **stack.head.cache_stats()["storage"]}


def fill(kind: str, root: Path) -> list[np.ndarray]:
    """A first stack serves the requests: L3 gets their Full pages and component values."""
    stack = build_stack(options(kind, root))
    reqs = prompts(stack.runner.model.vocab_size)
    out = serve_all(stack, reqs)
    stack.head.controller.storage.flush_manifest()
    assert out["backup_pages"] > 0 and out["component_values"]["values_stored"] > 0
    return reqs


def component_objects(root: Path, kind: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and f"/{kind}/" in str(p) and "/i/" not in str(p)]


@pytest.mark.parametrize("kind", ["swa", "mamba"])
def test_a_fresh_stack_serves_hybrid_requests_from_l3_exactly(tmp_path, kind):
    reqs = fill(kind, tmp_path)
    assert component_objects(tmp_path, kind)  # the pool's own folder
    fresh = build_stack(options(kind, tmp_path))  # new head and worker: nothing in L1 or L2
    # longest first: its fetch hangs below the root (the others' below what it left in L1 and L2)
    out = serve_all(fresh, reqs[::-1])
    values = out["component_values"]
    assert out["prefetch_pages"] > 0 and out["prefetch_failures"] == 0 and out["loaded"] > 0
    assert values["values_fetched"] > 0
    comp = fresh.head.cache_stats()[kind]
    assert (comp["host_states"] if kind == "mamba" else comp["host_tokens"]) > 0  # fetched into the component's L2


@pytest.mark.parametrize("kind, damage", [("mamba", "deleted"), ("mamba", "corrupt"), ("swa", "corrupt"),
                                         ("swa", "short")])
def test_missing_or_corrupt_component_objects_give_a_miss_and_exact_outputs(tmp_path, kind, damage):
    """A Mamba state, or an SWA window's object (several pages), deleted, with a payload byte flipped or cut
    short: no fetch uses it, every output stays exact."""
    reqs = fill(kind, tmp_path)
    objects = component_objects(tmp_path, kind)
    assert objects
    for p in objects:
        if damage == "deleted":
            p.unlink()
        elif damage == "corrupt":  # the last payload byte flipped: the checksum fails
            data = bytearray(p.read_bytes())
            data[-1] ^= 0xFF
            p.write_bytes(bytes(data))
        else:  # its last page's bytes cut off: shorter than its header says
            data = p.read_bytes()
            p.write_bytes(data[: len(data) - len(data) // 4])
    fresh = build_stack(options(kind, tmp_path))
    out = serve_all(fresh, reqs[::-1])  # exact all the same (checked per request)
    assert out["component_values"]["values_fetched"] == 0
    if damage == "deleted":  # no end has a state: no fetch is sent at all
        assert out["prefetch_started"] == 0 and out["l3_queries"] > 0  # (the query found Full pages only)
    else:  # found, fetched, failed verification: the whole fetch fails (no Full page of it is used either)
        assert out["prefetch_failures"] > 0 and out["prefetch_pages"] == 0


def test_the_swa_window_before_a_node_end_is_one_object(tmp_path):
    """Each SWA object holds the window's pages before one node end (``min(window, end)`` pages), named by the
    key of the end's last page: one object write and one existence request per node end, not one per page."""
    from hicache.storage import ChainKeys, Namespace
    from hicache.storage.format import declared_num_pages

    reqs = fill("swa", tmp_path)
    stack = build_stack(options("swa", tmp_path))
    ns = Namespace(stack.head.controller.storage.params.fingerprint)
    end_of: dict[str, int] = {}  # chain key -> the page end it names (prompts and their outputs: the cached paths)
    for prompt in reqs:
        gen = stack.runner.generate_no_cache(prompt, 4)
        tokens = np.concatenate([prompt, np.asarray(gen.tokens, np.int32)])
        end_of.update({k: i + 1 for i, k in enumerate(ChainKeys(ns, tokens))})
    window = stack.head.controller.storage.values.value_pages["swa"]
    objects = component_objects(tmp_path, "swa")
    assert window == 3 and objects and all(p.name in end_of for p in objects)
    pages = [declared_num_pages(p.read_bytes()) for p in objects]
    assert pages == [min(window, end_of[p.name]) for p in objects]
    assert sum(pages) > len(objects)  # (several pages an object: the one-page layout fails here)


@pytest.mark.parametrize("kind", ["swa", "mamba"])
def test_a_deleted_component_object_shortens_the_l3_hit(tmp_path, kind):
    """The object of the last page before the deepest end L3 could serve is deleted (a state, an SWA page):
    the fetch ends at an earlier end where every component's objects are there."""
    from hicache.cluster.storage_components import servable_end
    from hicache.storage import ChainKeys, Namespace, PoolKind

    intact, damaged = tmp_path / "intact", tmp_path / "damaged"
    reqs = fill(kind, intact)
    shutil.copytree(intact, damaged)
    probe = build_stack(options(kind, intact))
    storage = probe.worker.storage_executor.storage
    # the next turn of the last request: L3 holds its whole pages (with the values at their end) as candidates
    gen = probe.runner.generate_no_cache(reqs[-1], 4)
    prompt = np.concatenate([reqs[-1], np.asarray(gen.tokens, np.int32), np.arange(8, dtype=np.int32)])
    keys = list(ChainKeys(Namespace(probe.head.controller.storage.params.fingerprint), prompt))
    flags = storage.exists_each(keys, pool=PoolKind(kind))
    n = probe.head.controller.storage.values.value_pages[kind]
    end = servable_end({kind: flags}, len(keys), 2)
    assert end > n  # (an earlier end exists for the damaged copy to fall back to, or a miss)
    (damaged / Path(storage.object_path(keys[end - 1], pool=PoolKind(kind))).relative_to(intact)).unlink()
    got = {}
    for name, root in (("intact", intact), ("damaged", damaged)):
        got[name] = serve_all(build_stack(options(kind, root)), [prompt])
    assert got["intact"]["prefetch_pages"] == end
    assert got["damaged"]["prefetch_pages"] < end


@pytest.mark.parametrize("kind", ["swa", "mamba"])
def test_a_restarted_hybrid_head_reads_the_manifest_and_its_l3_hits_stay_exact(tmp_path, kind):
    """Warm restart as for a Full head: the manifest's stored prefixes become storage-only tree entries (reported
    as L3 hits by a match), and a fetch over them still asks which component values are stored."""
    from hicache.cluster.tree import RadixKey

    reqs = fill(kind, tmp_path)
    fresh = build_stack(options(kind, tmp_path))
    assert fresh.head.controller.storage.settle(60.0)  # the background manifest listing, applied
    storage = fresh.head.cache_stats()["storage"]
    assert storage["warm_restart_prefixes"] > 0 and storage["warm_restart_tokens"] > 0
    assert fresh.head.match_prefix(RadixKey(reqs[-1])).storage_hit_len > 0
    fresh.head.tree.check_invariants()
    out = serve_all(fresh, reqs[::-1])
    assert out["prefetch_pages"] > 0 and out["component_values"]["values_fetched"] > 0
    assert out["prefetch_known_stored"] == 0  # (never sized by the manifest alone in a hybrid tree)


@pytest.mark.parametrize("kind", ["swa", "mamba"])
def test_one_stack_under_eviction_serves_hits_from_l1_l2_and_l3_exactly(tmp_path, kind):
    """Six conversations of three turns, served round robin on one stack whose L1 (16 pages) and L2 (24 slots)
    hold less than the conversations: later turns find their history in L1, in L2 or (evicted from both) in
    L3 only; each tier serves some, every output equals the no-cache run."""
    opts = dataclasses.replace(options(kind, tmp_path), l1_pages=16, l2_slots=24)
    stack = build_stack(opts)
    runner = stack.runner
    rng = np.random.default_rng(7)
    vocab = runner.model.vocab_size
    system = rng.integers(0, vocab, 13, dtype=np.int32)
    history = [system.copy() for _ in range(6)]
    hits = {"l1": 0, "l2": 0, "l3": 0}
    for _turn in range(3):
        for c in range(6):
            prompt = np.concatenate([history[c], rng.integers(0, vocab, 11, dtype=np.int32)])
            res = stack.scheduler.serve(ServeRequest(prompt, max_new_tokens=4))
            ref = runner.generate_no_cache(prompt, 4)
            assert res.output == ref.tokens
            np.testing.assert_array_equal(res.logits, ref.logits)
            hits["l1"] += res.device_hit_tokens
            hits["l2"] += res.loaded_tokens - res.storage_tokens
            hits["l3"] += res.storage_tokens
            history[c] = np.concatenate([prompt, np.asarray(res.output, dtype=np.int32)])
            stack.client.flush_write_through_acks()  # (each request's copies land before the next: deterministic)
    stats = stack.head.cache_stats()
    assert stats["device_evicted_tokens"] > 0 and stats["host_evicted_tokens"] > 0  # both tiers overflowed
    assert hits["l1"] > 0 and hits["l2"] > 0 and hits["l3"] > 0, hits
    assert stats["storage"]["component_values"]["values_fetched"] > 0
    stack.head.tree.check_invariants()
    stack.head.controller.check_invariants()


def test_the_answers_page_end_state_a_decode_tracked_reaches_l3(tmp_path):
    """The state a recurrent request's track slot cached at finish (its answer's last whole page) is backed up
    like any node end's: L2, then an L3 object of the Mamba pool. A fresh stack (empty L1 and L2) serves the
    conversation's next turn from L3 up to that page end, exactly."""
    rng = np.random.default_rng(11)
    first = rng.integers(0, 512, 21, dtype=np.int32)  # key after 23 new tokens: 43, last whole page 40 (page 8)
    stack = build_stack(options("mamba", tmp_path))
    answer = stack.scheduler.serve(ServeRequest(first, max_new_tokens=23)).output
    stack.client.flush_write_through_acks()
    stack.head.controller.storage.flush_manifest()
    second = np.r_[first, np.asarray(answer, np.int32), rng.integers(0, 512, 5)].astype(np.int32)
    fresh = build_stack(options("mamba", tmp_path))
    res = fresh.scheduler.serve(ServeRequest(second, max_new_tokens=4))
    ref = fresh.runner.generate_no_cache(second, 4)
    assert res.output == ref.tokens
    np.testing.assert_array_equal(res.logits, ref.logits)
    assert res.storage_tokens == 40  # (without the track: the first prompt's last whole page, 16)
    fresh.head.tree.check_invariants()
