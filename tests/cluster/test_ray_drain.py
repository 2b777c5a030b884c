"""A Ray replica drains by itself on a preemption notice (``hicache.cluster.drain``), wired from its
replica file's ``preemption:`` section into the head actor; the drain runs round by round, so
``hicache status`` answers while it runs and shows its progress.

One loopback ``ray.cluster_utils.Cluster`` for the module: a head node (``hicache_head``) and one fake
host (a host worker with 2 fake CPU devices). The forward is stood in for by writing a known KV
pattern into the pages through the worker actor; what the drain stored is read back from L3 through
L2 and L1 and compared bit for bit.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from support.kv_pattern import page_rows  # noqa: E402
from support.ray_cluster import loopback_cluster  # noqa: E402

import hicache  # noqa: E402
from hicache.cli import main as hicache_cli  # noqa: E402
from hicache.cluster.begin import BeginParams  # noqa: E402
from hicache.cluster.controller import LoadBackParams  # noqa: E402
from hicache.cluster.errors import HiCacheDrainingError  # noqa: E402
from hicache.cluster.ray_head import HeadState, get_head, stop_replica, worker_handles  # noqa: E402
from hicache.cluster.storage_tier import PrefetchParams, PrefetchState, StorageParams  # noqa: E402
from hicache.cluster.tree import RadixKey, RequestState  # noqa: E402
from hicache.replica_file import load_replica_file  # noqa: E402
from hicache.storage import ModelFingerprint  # noqa: E402

PS = 4
SEQ_PAGES = 6  # a path of 6 pages: one L2 -> L3 backup of it fits the 8-page in-flight cap, two do not
NUM_SEQS = 5


@pytest.fixture(scope="module")
def cluster():
    with loopback_cluster(num_hosts=1) as c:
        yield c


def replica_file(tmp_path, preemption: str, extra: str = "") -> str:
    path = tmp_path / "d.yaml"
    path.write_text(f"""
replica: d
page_size: {PS}
l1_pages: 64
l2_slots: 256
model: {{num_layers: 2, num_kv_heads: 2, head_dim: 4, dtype: float32}}
workers: {{platform: cpu, num_hosts: 1, devices_per_host: 2}}
preemption: {preemption}
{extra}""")
    return str(path)


def seqs() -> list[np.ndarray]:
    return [np.arange(1000 * i, 1000 * i + SEQ_PAGES * PS, dtype=np.int32) for i in range(1, NUM_SEQS + 1)]


class Forward:
    """Stands in for the forward: the worker writes (and reads) a known KV pattern of each sequence."""

    def __init__(self, spec_shape: tuple[int, ...]) -> None:
        _, workers, _ = worker_handles("d")
        self.worker, self.shape = workers[0], spec_shape

    def rows(self, tokens: np.ndarray, first_page: int, num_pages: int) -> np.ndarray:
        return page_rows(tokens, first_page, num_pages, self.shape, PS)

    def write(self, pages: np.ndarray, tokens: np.ndarray, first_page: int) -> None:
        ray.get(self.worker.write_pages.remote(pages, self.rows(tokens, first_page, pages.size)), timeout=60)

    def read(self, pages: np.ndarray) -> np.ndarray:
        return ray.get(self.worker.read_pages.remote(pages), timeout=60)


def test_a_file_notice_drains_a_ray_replica_and_status_shows_it_while_it_runs(cluster, tmp_path, capsys):
    notice = tmp_path / "preempt"
    path = replica_file(tmp_path, f"{{kind: file, location: '{notice}', deadline_s: 60, poll_s: 0.05}}")
    config = dataclasses.replace(load_replica_file(path), detached=False, test_hooks=True)
    assert config.preemption is not None and config.preemption.location == str(notice)
    handle = hicache.start_replica(config, timeout_s=180)
    try:
        head, client = get_head("d"), hicache.connect("d", timeout_s=60)
        fwd = Forward(config.workers.spec.page_shape)
        for tokens in seqs():  # warm: L1 and (write-through) L2, no L3 attached yet
            key = RadixKey(tokens)
            m = client.match_prefix(key)
            client.inc_lock_ref(m.last_device_node)
            own = client.alloc(len(tokens))
            fwd.write(own, tokens, 0)
            client.cache_finished_req(RequestState(key, own, 0, m.last_device_node))
        client.flush_write_through_acks()
        fp = ModelFingerprint("ray-drain", "float32", PS, 2, 2, 4)
        client.attach_storage_backend(StorageParams(f"file://{tmp_path}/l3", fp, prefetch_min_tokens=PS,
                                                    pages_per_object=2, max_inflight_backup_pages=8))

        ray.get(head.hold_drain_for_test.remote(), timeout=30)
        notice.write_text("60")  # the notice: the head's watcher sees the file
        assert ray.get(head.wait_drain_for_test.remote("held", 120.0), timeout=150)
        d = client.cache_stats()["drain"]  # answered between two rounds, while the drain runs
        assert d["state"] == "draining" and d["candidate_pages"] == NUM_SEQS * SEQ_PAGES
        assert 0 < d["drained_pages"] and 0 < d["left_pages"] < d["candidate_pages"]
        assert hicache_cli(["status", "--replica", "d"]) == 0
        assert "draining" in capsys.readouterr().out
        with pytest.raises(HiCacheDrainingError):  # nothing is admitted after the notice
            client.begin_request(BeginParams(RadixKey(seqs()[0]), SEQ_PAGES * PS))
        ray.get(head.release_drain_for_test.remote(), timeout=30)
        assert ray.get(head.wait_drain_for_test.remote("ended", 120.0), timeout=150)

        done = client.cache_stats()["drain"]
        assert done["state"] == "done" and done["manifest_flushed"] and done["rounds"] > d["rounds"]
        assert done["not_fitted_pages"] == 0 and done["drained_pages"] >= done["candidate_pages"]

        client.reset()  # a cold state on the same L3 (admits again): what the drain stored reads back exactly
        for i, tokens in enumerate(seqs()):
            key = RadixKey(tokens)
            m = client.match_prefix(key)
            assert m.device_hit_len == m.host_hit_len == 0
            client.prefetch_from_storage(PrefetchParams(f"after-drain-{i}", key, m.best_match_node))
            progress = client.check_prefetch_progress(f"after-drain-{i}")
            assert progress.state is PrefetchState.DONE and progress.tokens == len(tokens)
            m = client.match_prefix(key)
            r = client.init_load_back(LoadBackParams(m.best_match_node, m.host_hit_len))
            assert r.load_id >= 0 and client.wait_load_back(r.load_id) and r.loaded_tokens == len(tokens)
            np.testing.assert_array_equal(fwd.read(r.device_pages), fwd.rows(tokens, 0, SEQ_PAGES))
    finally:
        stop_replica("d")
        del handle


@pytest.mark.slow
def test_a_signal_notice_drains_a_ray_replica(cluster, tmp_path):
    """``preemption: {kind: signal, location: SIGUSR1}``: the signal to the head actor's process is the
    notice (its handler is installed in the actor's constructor, on the process's main thread); a state
    rebuilt after the notice (its host lost) admits no request either."""
    path = replica_file(tmp_path, "{kind: signal, location: SIGUSR1, deadline_s: 30}",
                        f"l3: {{url: 'file://{tmp_path}/l3', model_id: ray-drain}}")
    config = dataclasses.replace(load_replica_file(path), detached=False, test_hooks=True)
    handle = hicache.start_replica(config, timeout_s=180)
    try:
        head, client = get_head("d"), hicache.connect("d", timeout_s=60)
        pid = ray.get(head.__ray_call__.remote(lambda actor: os.getpid()), timeout=30)
        os.kill(pid, signal.SIGUSR1)
        assert ray.get(head.wait_drain_for_test.remote("ended", 120.0), timeout=150)
        d = client.cache_stats()["drain"]
        assert d["state"] == "done" and d["manifest_flushed"] and d["not_fitted_pages"] == 0
        with pytest.raises(HiCacheDrainingError):
            client.begin_request(BeginParams(RadixKey(seqs()[0]), SEQ_PAGES * PS))
        # the host is lost after the notice: the rebuilt state (a new gang, empty) admits nothing either
        ray.kill(worker_handles("d")[1][0])
        end = time.monotonic() + 120
        while not ((h := ray.get(head.health.remote(), timeout=30)).resets == 1 and h.state is HeadState.READY):
            assert time.monotonic() < end, h
            time.sleep(0.2)
        client = hicache.connect("d", timeout_s=60)
        with pytest.raises(HiCacheDrainingError):
            client.begin_request(BeginParams(RadixKey(seqs()[0]), SEQ_PAGES * PS))
        assert client.cache_stats()["drain"]["state"] == "done"
    finally:
        stop_replica("d")
        del handle
