"""Smoke test of the end-to-end benchmarks with tiny settings: JSON schema and exactness checks ran."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIGS = ["bare_engine", "no_cache", "l1_only", "l1_l2", "l1_l2_l3", "l3_prepopulated"]
REQUIRED = {"config": str, "prefill_tokens_computed": int, "ttft_mean_s": float, "ttft_p90_s": float,
            "service_ttft_mean_s": float, "throughput_requests_per_s": float, "throughput_tokens_per_s": float,
            "hit_rate_by_tier": dict, "exact_outputs_checked": int, "exact_spot_checks": int}


def _check(path: Path, png: Path) -> dict:
    records = json.loads(path.read_text())
    assert isinstance(records, list) and [r["config"] for r in records] == CONFIGS
    for r in records:
        for key, typ in REQUIRED.items():
            assert isinstance(r[key], typ), (r["config"], key, r[key])
        assert set(r["hit_rate_by_tier"]) == {"l1", "l2", "l3"}
        assert 0 <= sum(r["hit_rate_by_tier"].values()) <= 1
        assert r["exact_outputs_checked"] == r["requests"] > 0  # every output equals the no-cache output
        assert r["exact_spot_checks"] >= 1  # and some were compared with generate_no_cache, logits too
        assert r["prefill_tokens_computed"] + sum(r["hit_tokens_by_tier"].values()) == r["prompt_tokens"]
    by = {r["config"]: r for r in records}
    assert by["no_cache"]["hit_rate_total"] == 0 and by["no_cache"]["optimal_hit_rate"] == 0
    assert by["l3_prepopulated"]["hit_rate_by_tier"]["l3"] > 0
    for r in records:
        if r["optimal_hit_rate"] is not None:
            assert r["hit_rate_total"] <= r["optimal_hit_rate"] + 1e-9, r["config"]
    assert png.stat().st_size > 0
    return by


def _check_no_reuse_pair(by: dict, requests: int, segment: int, reps: int) -> None:
    """The no-reuse pair's summary: the segments protocol on the cpu clock is the target's figure, both
    clocks are there (the records' TTFTs are the wall ones), every drain of no_cache is counted and
    reported per request, each config's thread CPU and phases are there, and the interleaved protocol
    is kept beside it (one no-op "drain" per request: nothing was drained)."""
    ov = by["no_cache"]["notes"]["overhead_vs_bare"]
    assert ov == by["bare_engine"]["notes"]["overhead_vs_bare"]
    targets = by["no_cache"]["notes"]["targets"]
    assert ov["clock"] == "cpu" and ov["overhead_mean_ttft"] == ov["by_clock"]["cpu"]["overhead_mean_ttft"]
    assert targets["no_reuse_overhead_service_ttft"] == ov["overhead_mean_ttft"]
    assert targets["no_reuse_overhead_service_ttft_wall"] == ov["by_clock"]["wall"]["overhead_mean_ttft"]
    assert targets["no_reuse_overhead_interleaved"] == ov["interleaved"]["overhead_mean_ttft"]
    wall = ov["by_clock"]["wall"]
    assert by["no_cache"]["service_ttft_mean_s"] == pytest.approx(wall["no_cache_best_of_n_ttft_mean_s"], rel=1e-9)
    inter = ov["interleaved"]
    for pair, mode, seg, drains in ((ov, "segments", segment, reps * -(-requests // segment)),
                                    (inter, "interleaved", 1, reps * requests)):
        assert (pair["mode"], pair["segment"], pair["reps"], pair["no_cache_drains"]) == (mode, seg, reps, drains)
        for clock, fig in pair["by_clock"].items():
            assert fig["overhead_best_of_n_mean_ttft"] == pytest.approx(
                fig["no_cache_best_of_n_ttft_mean_s"] / fig["bare_engine_best_of_n_ttft_mean_s"] - 1, rel=1e-9)
            assert fig["paired_block"] == 16 and fig["bare_engine_paired_ttft_mean_s"] > 0  # paired_overhead's
            assert fig["no_cache_drain_ms_per_request"] >= 0 and len(fig["per_rep_service_ttft_mean_s"]) == reps
            assert fig["overhead_mean_ttft_drain_charged"] >= fig["overhead_mean_ttft"], (mode, clock)
        for name in ("bare_engine", "no_cache"):
            assert pair["cpu_ms_per_request"][name]["serving"] > 0, (mode, name)
            assert pair["service_phases_mean_ms"][name]["prefill"] > 0, (mode, name)
        assert pair["service_phases_mean_ms"]["bare_engine"]["match"] == 0  # the bare engine has no cache
        assert pair["service_phases_mean_ms"]["no_cache"]["match"] > 0
    assert inter["by_clock"]["wall"]["no_cache_drain_ms_per_request"] == 0  # nothing drained between its requests


def test_clock_views_of_a_served_request():
    """on_cpu_clock: TTFT = the process CPU up to the first between_steps() call (30 ms spun before it),
    latency = up to the return (20 ms more), phases kept; on_wall_clock: TTFT and latency from the
    phases, each drain added to the last request of its segment."""
    import numpy as np

    from benchmarks.clocks import on_cpu_clock, on_wall_clock
    from benchmarks.workload import Item, Served
    from hicache.reference.serve_types import ServePhases, ServeResult

    phases = ServePhases(match=0.001, l3=0.002, load_back=0.003, prefill=0.004, decode=0.005, finish=0.006)

    def serve(req, between_steps):
        _spin_cpu(0.03)
        between_steps()
        _spin_cpu(0.01)
        between_steps()  # only the first call marks the first token
        _spin_cpu(0.01)
        return ServeResult((1, 2), np.zeros(1, np.float32), 9.0, 9.0, 3, 0, 0, 3, phases=phases)

    res = on_cpu_clock(serve)(None)
    assert 0.03 <= res.ttft_s and res.ttft_s + 0.02 <= res.latency_s and res.phases == phases
    items = [Item(i, None, 0, np.arange(3, dtype=np.int32), 2) for i in range(5)]
    walls = on_wall_clock([Served(it, res) for it in items], drains=[0.5, 0.25], segment=3)
    assert [s.result.ttft_s for s in walls] == [pytest.approx(0.01)] * 5
    assert [s.result.latency_s for s in walls] == [pytest.approx(x) for x in (0.021, 0.021, 0.521, 0.021, 0.271)]


def _paired(ttfts: dict[str, list[list[float]]], **kw) -> tuple[float, float]:
    """paired_overhead over reps whose TTFTs per config are ``ttfts[config][rep]`` (ms), stream order."""
    import numpy as np

    from benchmarks.pairing import paired_overhead
    from benchmarks.workload import Item, Served
    from hicache.reference.serve_types import ServeResult

    def served(ms: list[float]) -> list[Served]:
        return [Served(Item(i, None, 0, np.arange(3, dtype=np.int32), 1),
                       ServeResult((1,), np.zeros(1, np.float32), t / 1e3, t / 1e3, 3, 0, 0, 3)) for i, t in enumerate(ms)]
    reps = len(ttfts["bare_engine"])
    return paired_overhead([{c: served(ttfts[c][r]) for c in ttfts} for r in range(reps)], **kw)


def test_paired_overhead_outvotes_a_loaded_rep_keeps_recurring_costs_and_weighs_by_ttft():
    """Blocks of 2 requests: block 0 (bare 10+10 ms) costs 10% more with the stack, block 1 (bare 30+30
    ms) 20% more, of which a 6 ms cost on request 3 recurs in every rep: the overhead is the ratio of
    mean TTFTs, (22+72)/(20+60) - 1 = 17.5% (not the mean of the block ratios, 15%). A rep whose
    stack windows met a load burst (x2) in block 0, and another whose bare windows did in block 1,
    are outvoted by the other reps. The bare mean: the blocks' median bare TTFTs, 80 ms / 4."""
    bare = [[10, 10, 30, 30]] * 3
    stack = [[11, 11, 33, 39]] * 3
    overhead, bare_mean = _paired({"bare_engine": bare, "no_cache": stack}, block=2)
    assert overhead == pytest.approx(94 / 80 - 1) and bare_mean == pytest.approx(0.020)
    loaded_bare = [[10, 10, 30, 30], [10, 10, 60, 60], [10, 10, 30, 30]]
    loaded_stack = [[22, 22, 33, 39], [11, 11, 33, 39], [11, 11, 33, 39]]
    overhead, bare_mean = _paired({"bare_engine": loaded_bare, "no_cache": loaded_stack}, block=2)
    assert overhead == pytest.approx(94 / 80 - 1) and bare_mean == pytest.approx(0.020)
    one_block, _ = _paired({"bare_engine": bare, "no_cache": stack}, block=16)  # the whole stream in one block
    assert one_block == pytest.approx(94 / 80 - 1)


def test_paired_overhead_rejects_bad_blocks_and_mismatched_reps():
    bare, stack = [[10, 10, 30]], [[11, 11, 33]]
    for bad in (0, -1, 2.0, None):
        with pytest.raises(ValueError, match=f"block must be an int >= 1, got {bad!r}"):
            _paired({"bare_engine": bare, "no_cache": stack}, block=bad)
    with pytest.raises(ValueError, match="same items in the same order"):
        _paired({"bare_engine": bare, "no_cache": [[11, 11]]})
    from benchmarks.pairing import paired_overhead

    with pytest.raises(ValueError, match="at least one rep"):
        paired_overhead([])


def test_multiturn_and_long_doc_qa_tiny(tmp_path):
    from benchmarks import long_doc_qa, multiturn

    mt = tmp_path / "mt.json"
    multiturn.main(["--clients", "3", "--rounds", "2", "--system-tokens", "24", "40", "--request-tokens", "8", "16",
                    "--output-tokens", "4", "--overhead-reps", "2", "--segment", "3", "--pair-segment", "4",
                    "--spot-checks", "1",
                    "--l2-fraction", "2", "--json", str(mt), "--png", str(tmp_path / "mt.png")])
    by = _check(mt, tmp_path / "mt.png")
    _check_no_reuse_pair(by, requests=6, segment=4, reps=2)
    assert "targets" in by["l1_l2_l3"]["notes"]
    assert {r["notes"]["model"] for r in by.values()} == {"small"}  # the default model
    for name in ("bare_engine", "l1_only", "l1_l2", "l1_l2_l3"):  # served one config at a time, accounted
        stats = by[name]["notes"]["cache_stats"]
        assert stats["cpu_ms_per_request"]["serving"] > 0, name
        assert stats["drain_ms_mean"] >= 0 and stats["ttft_reps"]["reps"] == 3, name
        if name != "bare_engine":
            assert by[name]["notes"]["queue_model"] == "iteration_loop" and by[name]["notes"]["decode_step_ms"] > 0
    ld = tmp_path / "ld.json"
    long_doc_qa.main(["--docs", "2", "--questions", "2", "--doc-tokens", "64", "96", "--question-tokens", "8", "12",
                      "--output-tokens", "4", "--overhead-reps", "1", "--segment", "3", "--spot-checks", "1",
                      "--l2-fraction", "2",  # an L3 prefetch needs L2 room for the whole run it fetches
                      "--json", str(ld), "--png", str(tmp_path / "ld.png")])
    by = _check(ld, tmp_path / "ld.png")
    _check_no_reuse_pair(by, requests=4, segment=3, reps=1)
    assert by["l3_prepopulated"]["notes"]["targets"]["cold_round1_hit_rate"] > 0


class _RecordingScheduler:
    """Stands in for ``Scheduler.serve`` with fixed service times: 0.5 s TTFT, 1 s."""

    def serve(self, req):
        import numpy as np

        from hicache.reference.serve_types import ServeResult

        return ServeResult((1,), np.zeros(1, np.float32), 0.5, 1.0, len(req.prompt), 0, 0, len(req.prompt))


def _virtual_run(policy: str, ticks, reference=None, **clock):
    """Three items on an L1-only stack's loop: client 0's turn at ticks[0], client 1's at ticks[1] and
    client 0's next turn (its history + the answer + 5 tokens) at ticks[2] or when its first finished."""
    import numpy as np

    from benchmarks.stacks import VirtualTimeRun, stack_options
    from benchmarks.workload import FWD, MODEL, Item
    from hicache.reference.engine.runner import ModelRunner
    from hicache.reference.serving_loop import LoopOptions, ServingLoop
    from hicache.reference.stack import build_stack

    runner = ModelRunner(MODEL, FWD, num_pages=64)
    rng = np.random.default_rng(31)
    first = rng.integers(0, MODEL.vocab_size, 40, dtype=np.int32)
    out0 = runner.generate_no_cache(first, 6).tokens
    prompts = [first, rng.integers(0, MODEL.vocab_size, 30, dtype=np.int32),
               np.concatenate([first, np.asarray(out0, np.int32), rng.integers(0, MODEL.vocab_size, 5, dtype=np.int32)])]
    items = [Item(i, c, r, p, 6) for i, (c, r, p) in enumerate(zip([0, 1, 0], [0, 0, 1], prompts))]
    ref = reference or [runner.generate_no_cache(p, 6).tokens for p in prompts]
    loop = ServingLoop(build_stack(stack_options(64), runner).scheduler, LoopOptions(policy=policy))
    return items, VirtualTimeRun(items, np.asarray(ticks, float), loop, ref, policy, **clock)


def test_virtual_time_run_follows_the_clock_and_prefill_first_serves_an_arrival_mid_decode():
    """Client 1's request, sent 1 us after client 0's, waits only for the iteration in progress and gets
    its first token while client 0's still decodes (prefill_first); client 0's next turn is sent when
    its answer is done, with a hit on it; under fcfs_whole_request client 1 waits for client 0's whole
    request. serve_until returns items in order, each once; the loop jumps idle time to the next send."""
    done = {}
    for policy in ("prefill_first", "fcfs_whole_request"):
        items, run = _virtual_run(policy, [0.0, 1e-6, 0.0])
        got = run.serve_until(2) + run.serve_until(3)
        assert [s.item.index for s in got] == [0, 1, 2]
        t = [s.timing for s in got]
        assert t[0].sent_s == 0.0 and t[0].queue_wait_s < 0.05  # only its own submit ran before it
        assert t[2].sent_s == t[0].finish_s and got[2].result.device_hit_tokens >= 40
        for x, s in zip(t, got):
            assert 0 <= x.queue_wait_s < x.client_ttft_s and s.result.ttft_s <= x.client_ttft_s - x.queue_wait_s + 1e-9
        done[policy] = t
    pf, fcfs = done["prefill_first"], done["fcfs_whole_request"]
    assert pf[1].sent_s + pf[1].client_ttft_s < pf[0].finish_s  # first token before the running one ends
    assert fcfs[1].sent_s + fcfs[1].queue_wait_s >= fcfs[0].finish_s  # started only after it
    items, run = _virtual_run("prefill_first", [0.0, 100.0, 0.0])
    late = run.serve_until(3)[1].timing
    assert late.sent_s == 100.0 and run.now >= 100.0 and late.queue_wait_s < 0.05  # idle until it was sent


def test_virtual_time_run_advances_by_the_measured_time_times_speed():
    """A clock that moves 1 s per reading and speed 2: each measured piece (a submit, an iteration, a
    charged drain) advances the virtual clock by 2 s; an idle loop jumps to the next send time."""
    import itertools

    items, run = _virtual_run("prefill_first", [0.0, 50.0, 100.0], clock=itertools.count(0.0, 1.0).__next__)
    run.speed = 2.0
    first = run.serve_until(1)[0].timing  # submit (2 s), prefill (2 s), 5 decode iterations (2 s each)
    assert (first.sent_s, first.queue_wait_s, first.client_ttft_s, first.finish_s) == (0.0, 2.0, 4.0, 14.0)
    run.charge(1.5)
    assert run.now == 17.0 and run.busy_s == 17.0
    second = run.serve_until(2)[0].timing  # item 1 only (item 0 was returned); idle until 50
    assert (second.sent_s, second.queue_wait_s, second.client_ttft_s, second.finish_s) == (50.0, 2.0, 4.0, 64.0)
    assert run.busy_s == 31.0


def test_virtual_time_run_checks_outputs_and_inputs():
    from benchmarks.oracle import ExactnessError

    with pytest.raises(ExactnessError, match=r"\[prefill_first\] request 0"):
        _virtual_run("prefill_first", [0.0, 0.0, 0.0], reference=[(1,), (1,), (1,)])[1].serve_until(1)
    with pytest.raises(ValueError, match="one tick per item"):
        _virtual_run("prefill_first", [0.0, 0.0])


def test_thread_cpu_accounting_names_the_thread_that_burned_it():
    """A Python thread that spins for 50 ms of its own CPU time shows up under its name (index
    stripped), the calling thread's own spin under ``serving``."""
    import threading
    import time

    from benchmarks.clocks import cpu_by_group, thread_cpu_s

    done = threading.Event()
    before = thread_cpu_s()
    holder = threading.Thread(target=lambda: (_spin_cpu(0.05), done.wait(30)), name="holder_7")
    holder.start()
    try:
        _spin_cpu(0.02)
        deadline = time.monotonic() + 30
        while (got := cpu_by_group(before, thread_cpu_s())).get("holder", 0.0) < 0.045:
            assert time.monotonic() < deadline, got
            time.sleep(0.01)
        assert got["serving"] >= 0.019 and "holder_7" not in got
    finally:
        done.set()
        holder.join(timeout=30)


def _spin_cpu(seconds: float) -> None:
    import time

    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_serve_segments_keeps_each_config_apart_and_charges_its_drain():
    """Segments of 2 over 3 items, configs a and b: each serves a segment in stream order, its drain runs
    right after its own segment (before the other config's), the first config rotates per segment,
    and the drain's time lands on the latency of the segment's last request. A wrong output raises."""
    import time

    import numpy as np

    from benchmarks.oracle import ExactnessError
    from benchmarks.pairing import one_at_a_time, serve_segments
    from benchmarks.workload import Item

    items = [Item(i, None, 0, np.arange(3 + i, dtype=np.int32), 1) for i in range(3)]
    log: list[str] = []

    def serve_as(name, reference=((1,),) * 3):
        sched = _RecordingScheduler()

        def serve(req):
            log.append(f"{name}{len(req.prompt) - 3}")
            return sched.serve(req)
        return one_at_a_time(serve, reference, name)

    def drain_as(name):
        def drain():
            log.append(f"{name}-drain")
            if name == "b":
                time.sleep(0.02)
        return drain

    runs = serve_segments({"a": serve_as("a"), "b": serve_as("b")}, items,
                          {"a": drain_as("a"), "b": drain_as("b")}, segment=2)
    assert log == ["a0", "a1", "a-drain", "b0", "b1", "b-drain", "b2", "b-drain", "a2", "a-drain"]
    assert [s.item for s in runs["a"].served] == items == [s.item for s in runs["b"].served]
    for run in runs.values():  # only a segment's last request carries the drain
        assert [s.result.latency_s == 1.0 for s in run.served] == [True, False, False]
    assert all(s.result.latency_s >= 1.02 for s in runs["b"].served[1:])  # b's drains sleep 20 ms
    assert len(runs["b"].drain_s) == 2 and runs["b"].cpu_ms_per_request().get("serving", 0.0) >= 0
    with pytest.raises(ExactnessError, match=r"\[b\] request 1"):
        serve_segments({"a": serve_as("a", [(1,), (2,)]), "b": serve_as("b", [(1,), (2,)])}, items[:2], segment=1)
    with pytest.raises(ValueError, match="segment"):
        serve_segments({"a": serve_as("a")}, items, segment=0)
    log.clear()  # a lead config serves every segment first; the others rotate after it
    serve_segments({"a": serve_as("a"), "b": serve_as("b"), "c": serve_as("c")}, items, segment=2, lead="c")
    assert log == ["c0", "c1", "a0", "a1", "b0", "b1", "c2", "b2", "a2"]
    with pytest.raises(ValueError, match="lead 'd'"):
        serve_segments({"a": serve_as("a")}, items, lead="d")


def test_l3_faults_quick(tmp_path):
    """Every fault of issue #23 on the tiny stream: the JSON schema, exact outputs and no intact object
    deleted anywhere, L3 hits under none of the faults that leave reads working, and none while refused."""
    from benchmarks import l3_faults

    out = tmp_path / "l3f.json"
    l3_faults.main(["--quick", "--json", str(out)])
    faults = json.loads(out.read_text())["faults"]
    assert [f["name"] for f in faults] == [f.name for f in l3_faults.FAULTS]
    for f in faults:
        for key, typ in (("wrong_outputs", int), ("intact_objects_deleted", int), ("ttft_mean_s", float),
                         ("ttft_max_s", float), ("no_cache_ttft_mean_s", float), ("l3_hit_tokens", int)):
            assert isinstance(f[key], typ), (f["name"], key, f[key])
        assert f["wrong_outputs"] == 0 and f["intact_objects_deleted"] == 0, f
    by = {f["name"]: f for f in faults}
    assert by["none"]["l3_hit_tokens"] > 0 and by["none"]["objects_stored"] > 0
    assert by["refused"]["l3_hit_tokens"] == 0 and by["bucket_deleted"]["l3_hit_tokens"] == 0
    assert by["bucket_deleted"]["storage_errors"]["missing_bucket"] > 0
    assert by["flips_30pct"]["injected"]["corrupt"] > 0 and by["flips_30pct"]["corrupt_deleted"] == 0


@pytest.mark.parametrize("kind", [pytest.param("swa", marks=pytest.mark.slow), "mamba"])  # (swa: its pool sweep compiles)
def test_multiturn_hybrid_model_kinds_tiny(tmp_path, kind):
    """``--model-kind swa|mamba``: every config served exactly (it raises otherwise), L1+L2+L3 included (L3
    objects per pool), the targets and (swa) the pool sweep in the JSON."""
    from benchmarks import multiturn

    out = tmp_path / f"mt-{kind}.json"
    assert multiturn.main(["--model-kind", kind, "--clients", "3", "--rounds", "2", "--system-prompts", "1",
                           "--system-tokens", "24", "40", "--request-tokens", "8", "16", "--output-tokens", "4",
                           "--window", "16", "--swa-fractions", "0.5", "--json", str(out)]) == []
    rec = json.loads(out.read_text())
    assert rec["model_kind"] == kind and rec["l1_l2_l3"]["served"] is True
    for name in ("l1_only", "l1_l2", "l1_l2_l3", "l1_l2_unbounded"):
        c = rec["configs"][name]
        assert c["exact"] and c["requests"] == 6
        assert c["prefill_tokens_computed"] + c["l1_hit_tokens"] + c["l2_hit_tokens"] == c["prompt_tokens"]
    assert rec["configs"]["l1_only"]["l2_hit_tokens"] == 0
    assert set(rec["targets"]["met"]) == {"prefill_2_5x_l1_l2_l3", "prefill_2_5x_with_l1_l2_only",
                                          "prefill_2_5x_bound_for_l3"}
    assert rec["targets"]["prefill_reduction_l1_l2_l3_vs_l1_only"] > 0
    assert rec["full_model_same_path"]["configs"]["l1_l2"]["exact"]
    if kind == "swa":
        sweep = rec["swa_pool_sweep"]
        assert [r["swa_fraction"] for r in sweep["rows"]] == [1.0, 0.5]
        assert sweep["same_hit_rate"]["swa_pool_pages"] <= sweep["same_hit_rate"]["full_pool_pages"]
        assert sweep["within_2pct"]["swa_pool_pages"] <= sweep["same_hit_rate"]["swa_pool_pages"]
