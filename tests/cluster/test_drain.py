"""Drain on preemption (``hicache.cluster.drain``): notice sources, and a replica with a warm L2 that
stores what L3 lacks before its deadline, so a fresh replica on the same L3 hits it, exactly."""

from __future__ import annotations

import dataclasses
import http.server
import os
import signal
import threading

import numpy as np
import pytest

from hicache.cli import drain_column
from hicache.cluster.drain import (
    DrainOptions,
    DrainParams,
    DrainState,
    FileSource,
    GceMetadataSource,
    NoticeKind,
    PreemptionConfig,
    PreemptionWatcher,
    drive_drain,
    run_drain,
)
from hicache.cluster.errors import HiCacheDrainingError
from hicache.cluster.storage_tier import StorageParams
from hicache.reference.engine.config import ForwardConfig, ModelConfig
from hicache.reference.engine.runner import ModelRunner
from hicache.reference.serve_types import ServeRequest
from hicache.reference.stack import StackOptions, build_stack, fingerprint_for

MODEL = ModelConfig()
FWD = ForwardConfig(chunk_size=16, page_size=8, max_pages=32)
OPTS = StackOptions(MODEL, FWD, l1_pages=12, l2_slots=96, prefetch_min_tokens=8)  # no L3 while it warms up


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(MODEL, FWD, num_pages=96)


def warm(stack, seed: int, convs: int = 3, turns: int = 2) -> list[np.ndarray]:
    """Multi-turn chats on ``stack``; returns each conversation's next prompt."""
    rng = np.random.default_rng(seed)
    hist = [rng.integers(0, MODEL.vocab_size, 30, dtype=np.int32) for _ in range(convs)]
    for _ in range(turns):
        for c in range(convs):
            prompt = np.concatenate([hist[c], rng.integers(0, MODEL.vocab_size, 5, dtype=np.int32)])
            res = stack.scheduler.serve(ServeRequest(prompt, max_new_tokens=3))
            hist[c] = np.concatenate([prompt, np.asarray(res.output, np.int32)])
    stack.client.flush_write_through_acks()
    return [np.concatenate([h, rng.integers(0, MODEL.vocab_size, 4, dtype=np.int32)]) for h in hist]


def l3_params(stack, url: str, **kw) -> StorageParams:
    mesh = tuple(stack.worker.device_pool.mesh.devices.shape)
    return StorageParams(url, fingerprint_for(MODEL, FWD, mesh), prefetch_policy="wait_complete",
                         prefetch_wait_max_s=30.0, query_wait_max_s=30.0, prefetch_min_tokens=8, pages_per_object=4,
                         **kw)


def served_exactly(stack, runner, prompts: list[np.ndarray]) -> int:
    """Serves ``prompts`` on ``stack`` (outputs and logits equal to the no-cache run); L3 tokens."""
    fetched = 0
    for prompt in prompts:
        res = stack.scheduler.serve(ServeRequest(prompt, max_new_tokens=3))
        ref = runner.generate_no_cache(prompt, 3)
        assert res.output == ref.tokens
        np.testing.assert_array_equal(res.last_logits, ref.logits[0])
        fetched += res.storage_tokens
    return fetched


def test_a_drained_replica_hands_its_hot_prefixes_to_a_fresh_one_exactly(tmp_path, runner):
    url = f"file://{tmp_path}/l3"
    stack = build_stack(OPTS, runner)
    prompts = warm(stack, 1)
    stack.client.attach_storage_backend(l3_params(stack, url))  # L3 holds none of it yet
    prog = stack.client.drain(DrainParams(60.0))
    assert prog.state is DrainState.DONE and prog.manifest_flushed
    assert prog.candidate_pages >= 3 * 4 and prog.not_fitted_pages == 0
    assert prog.drained_pages >= prog.candidate_pages
    stats = stack.client.cache_stats()
    assert stats["drain"]["drained_pages"] == prog.drained_pages and stats["drain"]["state"] == "done"
    assert drain_column(stats) == f"done {prog.drained_pages}/{prog.candidate_pages}p, 0p not fitted"  # hicache status
    assert drain_column({}) == "-"
    with pytest.raises(HiCacheDrainingError, match="draining"):  # it admits nothing new
        stack.scheduler.serve(ServeRequest(prompts[0], max_new_tokens=3))
    fresh = build_stack(dataclasses.replace(OPTS, l3_url=url), runner)
    hist_tokens = sum((len(p) - 4) // FWD.page_size * FWD.page_size for p in prompts)
    assert served_exactly(fresh, runner, prompts) >= hist_tokens - 3 * 4 * FWD.page_size  # (a chunk each at most)
    assert fresh.client.cache_stats()["storage_errors"].get("corrupt_in_transit", 0) == 0


def test_what_did_not_fit_the_deadline_is_counted_and_never_read_half_written(tmp_path, runner):
    url = f"file://{tmp_path}/l3"
    stack = build_stack(OPTS, runner)
    prompts = warm(stack, 2)
    stack.client.attach_storage_backend(l3_params(stack, url, max_inflight_backup_pages=8))
    ticks = iter(range(10_000))
    prog = run_drain(stack.head, DrainParams(2.0, DrainOptions(reserve_s=0.0, ack_wait_s=0.0)),
                     clock=lambda: float(next(ticks)))  # the deadline passes during the first round
    assert prog.state is DrainState.DONE
    assert 0 < prog.sent_pages <= 8 < prog.candidate_pages
    assert prog.not_fitted_pages >= prog.candidate_pages - prog.sent_pages > 0
    assert prog.oversized_pages == 0  # the deadline, not the size, kept them out
    stack.client.flush_write_through_acks()  # writes in flight land (or not): either way whole objects
    fresh = build_stack(dataclasses.replace(OPTS, l3_url=url), runner)
    served_exactly(fresh, runner, prompts)


def test_a_drain_in_rounds_shows_its_progress_to_calls_between_them(tmp_path, runner):
    """``drive_drain`` (the Ray head's way): each round is one call under the owner's lock, so a
    ``cache_stats`` between two rounds answers before the drain ends and shows what is stored and what
    is left; no request is admitted meanwhile; the drain then completes."""
    stack = build_stack(OPTS, runner)
    prompts = warm(stack, 3, convs=4)
    stack.client.attach_storage_backend(l3_params(stack, f"file://{tmp_path}/l3", max_inflight_backup_pages=8))
    lock = threading.Lock()  # the head's owner: one call at a time

    def on_head(fn):
        with lock:
            return fn(stack.head)

    held, go, out = threading.Event(), threading.Event(), {}

    def between_rounds(prog):
        if not held.is_set() and prog.drained_pages > 0 and prog.left_pages > 0:
            held.set()
            go.wait(60.0)

    def drain():
        try:
            out["progress"] = drive_drain(on_head, DrainParams(120.0), between_rounds=between_rounds)
        finally:
            held.set()  # (a failed drain does not leave the test waiting)

    t = threading.Thread(target=drain)
    t.start()
    try:
        assert held.wait(60.0)
        with lock:
            stats = stack.client.cache_stats()
            with pytest.raises(HiCacheDrainingError):
                stack.scheduler.serve(ServeRequest(prompts[0], max_new_tokens=3))
    finally:
        go.set()
        t.join(120.0)
    d = stats["drain"]
    assert d["state"] == "draining" and 0 < d["drained_pages"] and 0 < d["left_pages"] < d["candidate_pages"]
    assert drain_column(stats) == f"draining {d['drained_pages']}/{d['candidate_pages']}p, {d['left_pages']}p left"
    prog = out["progress"]
    assert prog.state is DrainState.DONE and prog.manifest_flushed and prog.rounds > d["rounds"]
    assert prog.not_fitted_pages == prog.left_pages == 0 and prog.drained_pages >= prog.candidate_pages


def test_l3_detached_between_rounds_ends_the_drain_with_what_is_left_counted(tmp_path, runner):
    """Another call detaches L3 between two rounds: the next round ends the drain (no error, no
    manifest), what is left counted as not fitted; admission stays closed."""
    stack = build_stack(OPTS, runner)
    prompts = warm(stack, 6, convs=4)
    stack.client.attach_storage_backend(l3_params(stack, f"file://{tmp_path}/l3", max_inflight_backup_pages=8))

    def between_rounds(prog):
        if stack.head.controller.storage is not None and prog.drained_pages > 0:
            stack.client.detach_storage_backend()

    prog = drive_drain(lambda fn: fn(stack.head), DrainParams(60.0), between_rounds=between_rounds)
    assert prog.state is DrainState.DONE and not prog.manifest_flushed
    assert 0 < prog.drained_pages < prog.candidate_pages and prog.not_fitted_pages == prog.left_pages > 0
    with pytest.raises(HiCacheDrainingError):
        stack.scheduler.serve(ServeRequest(prompts[0], max_new_tokens=3))


def test_l1_only_prefixes_go_through_l2_within_the_in_flight_cap(tmp_path, runner):
    """write_back with a large L1: nothing is in L2 when the notice comes; the drain backs L1 up to L2
    and stores it at the acks, never over the storage tier's in-flight cap (nothing skipped), all of
    it, and a fresh replica reads it exactly."""
    url = f"file://{tmp_path}/l3"
    stack = build_stack(dataclasses.replace(OPTS, l1_pages=64, write_policy="write_back"), runner)
    prompts = warm(stack, 5)
    assert stack.client.cache_stats()["host_tokens"] == 0
    stack.client.attach_storage_backend(l3_params(stack, url, max_inflight_backup_pages=8))
    prog = stack.client.drain(DrainParams(60.0))
    assert prog.state is DrainState.DONE and prog.not_fitted_pages == 0 < prog.candidate_pages <= prog.drained_pages
    assert stack.client.cache_stats()["storage"]["backup_skipped_pages"] == 0
    fresh = build_stack(dataclasses.replace(OPTS, l3_url=url), runner)
    assert served_exactly(fresh, runner, prompts) > 0


def test_a_path_longer_than_one_backup_is_counted_as_oversized(tmp_path, runner):
    """Conversations of 5 pages never fit a 4-page in-flight cap: nothing is sent, all of it is counted
    as not fitted and oversized, in the progress and in ``hicache status``."""
    stack = build_stack(OPTS, runner)
    warm(stack, 4, convs=2)
    stack.client.attach_storage_backend(l3_params(stack, f"file://{tmp_path}/l3", max_inflight_backup_pages=4))
    prog = stack.client.drain(DrainParams(60.0))
    assert prog.sent_pages == prog.drained_pages == 0 < prog.candidate_pages
    assert prog.not_fitted_pages == prog.oversized_pages == prog.candidate_pages
    n = prog.candidate_pages
    assert drain_column(stack.client.cache_stats()) == f"done 0/{n}p, {n}p not fitted ({n}p oversized)"


def test_bad_drain_input_is_refused(runner):
    with pytest.raises(ValueError, match="unknown notice source 'aws'"):
        PreemptionConfig("aws")
    with pytest.raises(ValueError, match="needs its path"):
        PreemptionConfig("file")
    with pytest.raises(ValueError, match="unknown signal 'SIGNOPE'"):
        PreemptionConfig("signal", "SIGNOPE")
    assert isinstance(PreemptionConfig("gce", "http://127.0.0.1:9/x").build(), GceMetadataSource)
    with pytest.raises(ValueError, match="deadline_s must be a number > 0, got 0"):
        DrainParams(0)
    with pytest.raises(ValueError, match="reserve_s must be a number >= 0, got -1"):
        DrainOptions(reserve_s=-1)
    stack = build_stack(OPTS, runner)
    with pytest.raises(RuntimeError, match="attached L3"):
        stack.client.drain(DrainParams(5.0))
    assert "drain" not in stack.client.cache_stats()  # nothing changed: it still admits requests
    stack.scheduler.serve(ServeRequest(np.arange(20, dtype=np.int32), max_new_tokens=2))


class _Metadata(http.server.BaseHTTPRequestHandler):
    values: dict[str, str] = {}

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        name = self.path.rsplit("/", 1)[-1]
        ok = self.headers.get("Metadata-Flavor") == "Google" and name in self.values
        body = self.values.get(name, "").encode() if ok else b""
        self.send_response(200 if ok else 403)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def metadata_server():
    """A GCE metadata server stand-in on 127.0.0.1 (``instance/preempted``, ``maintenance-event``)."""
    _Metadata.values = {"preempted": "FALSE", "maintenance-event": "NONE"}
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metadata)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/computeMetadata/v1/instance", _Metadata.values
    srv.shutdown()
    srv.server_close()


def test_gce_metadata_notices_preemption_and_maintenance(metadata_server):
    url, values = metadata_server
    src = GceMetadataSource(url, deadline_s=30.0)
    assert src.check() is None
    values["maintenance-event"] = "TERMINATE_ON_HOST_MAINTENANCE"
    n = src.check()
    assert n is not None and n.kind is NoticeKind.MAINTENANCE and "TERMINATE" in n.detail
    values["preempted"] = "TRUE"
    n = src.wait(5.0)
    assert n is not None and n.kind is NoticeKind.PREEMPTED and n.deadline_s == 30.0
    assert GceMetadataSource("http://127.0.0.1:9/none", request_timeout_s=0.2).check() is None  # unreachable: no notice
    with pytest.raises(ValueError, match="base_url must be an http"):
        GceMetadataSource("metadata.google.internal")


def test_a_file_notice_reaches_the_watcher_once_with_its_deadline(tmp_path):
    path = tmp_path / "preempt"
    got = []
    watcher = PreemptionWatcher(FileSource(path, poll_s=0.01), got.append, poll_s=0.05)
    try:
        assert watcher.source.wait(0.0) is None
        path.write_text("12.5")
        assert watcher.done.wait(30.0)
        assert len(got) == 1 and got[0].kind is NoticeKind.FILE and got[0].deadline_s == 12.5
    finally:
        watcher.close()


def test_a_signal_notice_reaches_the_watcher(tmp_path):
    """``preemption: {kind: signal, location: SIGUSR1}``: the signal to this process is the notice."""
    got = []
    watcher = PreemptionWatcher(PreemptionConfig("signal", "SIGUSR1", deadline_s=7).build(), got.append, poll_s=0.05)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert watcher.done.wait(30.0)
        assert len(got) == 1 and got[0].kind is NoticeKind.SIGNAL and got[0].detail == "SIGUSR1"
        assert got[0].deadline_s == 7
    finally:
        watcher.close()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the old handler is back
