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


def test_multiturn_and_long_doc_qa_tiny(tmp_path):
    from benchmarks import long_doc_qa, multiturn

    mt = tmp_path / "mt.json"
    multiturn.main(["--clients", "3", "--rounds", "2", "--system-tokens", "24", "40", "--request-tokens", "8", "16",
                    "--output-tokens", "4", "--overhead-reps", "1", "--spot-checks", "1", "--l2-fraction", "2",
                    "--json", str(mt), "--png", str(tmp_path / "mt.png")])
    by = _check(mt, tmp_path / "mt.png")
    assert "targets" in by["l1_l2_l3"]["notes"]
    for name in ("bare_engine", "l1_only", "l1_l2", "l1_l2_l3"):  # served one config at a time, accounted
        stats = by[name]["notes"]["cache_stats"]
        assert stats["cpu_ms_per_request"]["serving"] > 0, name
        assert stats["drain_ms_mean"] >= 0 and stats["ttft_reps"]["reps"] == 3, name
    assert stats["requests_announced_before_served"] >= 0
    ld = tmp_path / "ld.json"
    long_doc_qa.main(["--docs", "2", "--questions", "2", "--doc-tokens", "64", "96", "--question-tokens", "8", "12",
                      "--output-tokens", "4", "--overhead-reps", "1", "--spot-checks", "1",
                      "--l2-fraction", "2",  # an L3 prefetch needs L2 room for the whole run it fetches
                      "--json", str(ld), "--png", str(tmp_path / "ld.png")])
    by = _check(ld, tmp_path / "ld.png")
    assert by["l3_prepopulated"]["notes"]["targets"]["cold_round1_hit_rate"] > 0


class _RecordingScheduler:
    """Stands in for ``Scheduler`` (``arrive``/``serve``) with fixed service times: 0.5 s TTFT, 1 s.
    With ``decode_s``, ``serve`` sleeps that long, then runs its ``between_steps`` hook once."""

    def __init__(self, decode_s: float = 0.0) -> None:
        self.arrived: list = []
        self.served: list = []
        self.decode_s = decode_s

    def arrive(self, req) -> bool:
        self.arrived.append(req)
        return True

    def serve(self, req, between_steps=None):
        import time

        import numpy as np

        from hicache.serving import ServeResult

        self.served.append(req)
        if self.decode_s:
            time.sleep(self.decode_s)
            between_steps()
        return ServeResult((1,), np.zeros(1, np.float32), 0.5, 1.0, len(req.prompt), 0, 0, len(req.prompt))


def test_arrival_model_announces_what_the_queue_holds_when_a_request_starts():
    """Item 2 (client 0's next turn, sent when item 0 finished at t=1) is queued when item 1 starts at
    t=1 (the server was busy until then): announced before item 1, served as that same request. Item 3
    (tick 2.5) is not sent before item 2 starts (t=2); item 1 (tick 0.5) not before item 0 starts."""
    import numpy as np

    from benchmarks.common import ArrivalModel, Item
    from hicache.serving import ServeRequest

    items = [Item(i, c, 0, np.arange(4 + i, dtype=np.int32), 1) for i, c in enumerate([0, 1, 0, None])]
    sched = _RecordingScheduler()
    model = ArrivalModel(items, np.array([0.0, 0.5, 0.6, 2.5]), sched)
    results = [model.serve(ServeRequest(it.prompt, 1)) for it in items]
    assert [r.prompt is items[2].prompt for r in sched.arrived] == [True]
    assert sched.served[2] is sched.arrived[0] and model.announced == 1
    assert all(r.ttft_s >= 0.5 and r.latency_s >= 1.0 for r in results)  # announcements are charged
    with pytest.raises(ValueError, match="expected item 0"):
        ArrivalModel(items, np.zeros(4), _RecordingScheduler()).serve(ServeRequest(items[1].prompt, 1))


def test_arrival_model_announces_between_decode_steps_what_arrived_meanwhile():
    """Item 1 (tick 1 ms) is sent while item 0 runs (it started at 0 and ran >= 5 ms before its
    decode-step hook): announced from that hook, not when item 1 starts. Item 2, client 0's next turn,
    is not sent before item 0 finished: announced before item 1 is served (item 1 starts after it)."""
    import numpy as np

    from benchmarks.common import ArrivalModel, Item
    from hicache.serving import ServeRequest

    items = [Item(i, c, 0, np.arange(4 + i, dtype=np.int32), 1) for i, c in enumerate([0, 1, 0])]
    sched = _RecordingScheduler(decode_s=0.005)
    model = ArrivalModel(items, np.array([0.0, 0.001, 0.002]), sched)
    model.serve(ServeRequest(items[0].prompt, 1))
    assert [r.prompt is items[1].prompt for r in sched.arrived] == [True]
    for it in items[1:]:
        model.serve(ServeRequest(it.prompt, 1))
    assert [r.prompt is it.prompt for r, it in zip(sched.arrived, items[1:])] == [True, True]
    assert all(a is b for a, b in zip(sched.served[1:], sched.arrived)) and model.announced == 2


def test_thread_cpu_accounting_names_the_thread_that_burned_it():
    """A Python thread that spins for 50 ms of its own CPU time shows up under its name (index
    stripped), the calling thread's own spin under ``serving``."""
    import threading
    import time

    from benchmarks.common import cpu_by_group, thread_cpu_s

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

    from benchmarks.common import ExactnessError, Item, serve_segments

    items = [Item(i, None, 0, np.arange(3 + i, dtype=np.int32), 1) for i in range(3)]
    log: list[str] = []

    def serve_as(name):
        sched = _RecordingScheduler()

        def serve(req):
            log.append(f"{name}{len(req.prompt) - 3}")
            return sched.serve(req)
        return serve

    def drain_as(name):
        def drain():
            log.append(f"{name}-drain")
            if name == "b":
                time.sleep(0.02)
        return drain

    runs = serve_segments({"a": serve_as("a"), "b": serve_as("b")}, items, [(1,)] * 3,
                          {"a": drain_as("a"), "b": drain_as("b")}, segment=2)
    assert log == ["a0", "a1", "a-drain", "b0", "b1", "b-drain", "b2", "b-drain", "a2", "a-drain"]
    assert [s.item for s in runs["a"].served] == items == [s.item for s in runs["b"].served]
    for run in runs.values():  # only a segment's last request carries the drain
        assert [s.result.latency_s == 1.0 for s in run.served] == [True, False, False]
    assert all(s.result.latency_s >= 1.02 for s in runs["b"].served[1:])  # b's drains sleep 20 ms
    assert len(runs["b"].drain_s) == 2 and runs["b"].cpu_ms_per_request().get("serving", 0.0) >= 0
    with pytest.raises(ExactnessError, match=r"\[b\] request 1"):
        serve_segments({"a": serve_as("a"), "b": serve_as("b")}, items[:2], [(1,), (2,)], segment=1)
    with pytest.raises(ValueError, match="segment"):
        serve_segments({"a": serve_as("a")}, items, [(1,)] * 3, segment=0)
