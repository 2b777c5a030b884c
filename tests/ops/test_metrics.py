"""Metrics end to end: a scripted workload on an embedded head, exported through Ray's metrics agent,
scraped from the metrics export port on 127.0.0.1 and parsed with prometheus_client."""

from __future__ import annotations

import time
import urllib.request

import numpy as np
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from support.hicache_env import HiCacheEnv
from support.net import free_loopback_port

from hicache.cluster.metrics import HeadMetrics
from hicache.cluster.storage_tier import StorageParams
from hicache.cluster.token_account import TokenAccount
from hicache.cluster.tree import RadixKey


@pytest.fixture(scope="module")
def ray_metrics_port():
    port = free_loopback_port()
    ray.init(num_cpus=1, include_dashboard=False, _metrics_export_port=port,
             _system_config={"metrics_report_interval_ms": 300})
    yield port
    ray.shutdown()


def _scrape(port: int) -> dict[tuple[str, frozenset], float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if "hicache" in sample.name:
                out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def _value(samples, name: str, **labels) -> float | None:
    for (n, lbls), v in samples.items():
        if n.endswith(name) and all((k, val) in lbls for k, val in labels.items()):
            return v
    return None


def test_metrics_values_after_scripted_workload(ray_metrics_port):
    env = HiCacheEnv(page_size=4, device_pages=16, host_slots=32)
    metrics = HeadMetrics("metrics-test")
    env.head.attach_metrics(metrics)
    a = np.arange(24, dtype=np.int32)
    env.serve(a)  # 24 tokens computed, backed up
    env.head.flush_write_through_acks()
    env.head.evict(100)  # all of L1 dropped; a is host-only
    env.serve(a)  # 24 tokens loaded back from L2
    env.head.flush_write_through_acks()
    env.head.match_prefix(RadixKey(np.arange(500, 520, dtype=np.int32)))  # 20 tokens not cached
    env.head.report_tokens(TokenAccount(24, hit_l2=24))  # the second request's record, as a scheduler reports it
    env.head.publish_metrics()
    stats = env.head.cache_stats()
    want = {
        ("hicache_hit_tokens_total", "l2"): stats["host_hit_tokens"],
        ("hicache_bytes_moved_total", "l1_to_l2"): stats["bytes_moved"]["d2h"],
        ("hicache_bytes_moved_total", "l2_to_l1"): stats["bytes_moved"]["h2d"],
    }
    deadline = time.monotonic() + 30
    samples = {}
    while time.monotonic() < deadline:
        samples = _scrape(ray_metrics_port)
        got_hits = _value(samples, "hicache_hit_tokens_total", tier="l2", replica="metrics-test")
        if got_hits is not None and got_hits >= want[("hicache_hit_tokens_total", "l2")]:
            break
        time.sleep(0.5)
    assert stats["host_hit_tokens"] == 24
    for (name, label), value in want.items():
        key = "tier" if "hit" in name else "direction"
        assert _value(samples, name, replica="metrics-test", **{key: label}) == value, (name, label, samples)
    assert _value(samples, "hicache_miss_tokens_total", reason="not_cached", replica="metrics-test") == 44
    assert _value(samples, "hicache_prompt_tokens_total", fate="hit_l2", replica="metrics-test") == 24
    assert _value(samples, "hicache_pool_tokens", tier="l1", replica="metrics-test") == stats["device_tokens"]
    assert _value(samples, "hicache_pool_capacity_tokens", tier="l2", replica="metrics-test") == 128
    count = _value(samples, "hicache_transfer_latency_seconds_count", direction="l2_to_l1", replica="metrics-test",
                   host="0")
    assert count is not None and count >= 1


def _wait_for(port: int, name: str, timeout_s: float = 30, **labels) -> float | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = _value(_scrape(port), name, **labels)
        if value:
            return value
        time.sleep(0.5)
    return None


def test_corrupt_l3_object_is_counted_as_an_l3_error(ray_metrics_port, tmp_path):
    url = f"file://{tmp_path}/l3"
    writer = HiCacheEnv(page_size=4, device_pages=16, host_slots=32, storage_url=url)
    a = np.arange(16, dtype=np.int32)
    writer.serve(a)
    writer.head.flush_write_through_acks()
    objects = [p for p in (tmp_path / "l3").rglob("*") if p.is_file() and "/kv/" in str(p)]
    assert objects
    for obj in objects:  # flip the last payload byte of every stored object
        raw = bytearray(obj.read_bytes())
        raw[-1] ^= 0xFF
        obj.write_bytes(bytes(raw))
    reader = HiCacheEnv(page_size=4, device_pages=16, host_slots=32, storage_url=url)
    reader.head.attach_metrics(HeadMetrics("metrics-l3"))
    r = reader.serve(a)  # the prefetch fails verification: recomputed (serve() checks the bytes)
    assert r["prefetched"] == 0 and r["loaded"] == 0
    reader.head.publish_metrics()
    assert reader.head.cache_stats()["storage_errors"]["corrupt_at_rest"] >= 1
    got = _wait_for(ray_metrics_port, "hicache_l3_errors_total", replica="metrics-l3", kind="corrupt_at_rest")
    assert got is not None and got >= 1


def test_grafana_dashboard_references_only_exported_metrics():
    import json
    import re
    from pathlib import Path

    dash = json.loads((Path(__file__).parents[2] / "ray_configs" / "grafana" / "hicache_dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"ray_(hicache_[a-z0-9_]+)", e)}
    exported = {"hicache_hit_tokens_total", "hicache_queried_tokens_total", "hicache_miss_tokens_total",
                "hicache_bytes_moved_total", "hicache_transfer_failures_total", "hicache_evicted_tokens_total",
                "hicache_prefetch_total", "hicache_l3_backup_pages_total", "hicache_pool_tokens",
                "hicache_pool_capacity_tokens", "hicache_transfers_in_flight",
                "hicache_transfer_latency_seconds_bucket", "hicache_l3_errors_total"}
    assert used and used <= exported, used - exported
    assert len(dash["panels"]) >= 6


def _wait_for_value(port: int, name: str, want: float, timeout_s: float = 30, **labels) -> float | None:
    """The exported value once it equals ``want`` (the agent exports every 300 ms), else the last one seen."""
    deadline, got = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        got = _value(_scrape(port), name, **labels)
        if got == want:
            break
        time.sleep(0.3)
    return got


def test_drain_progress_is_exported_while_it_runs_and_when_it_ends(ray_metrics_port, tmp_path):
    """``hicache_drain_pages``: between two rounds of a drain the gauge shows what is stored and what is
    left (published every round); at its end nothing is left and nothing did not fit."""
    from hicache.cluster.drain import DrainParams, drive_drain

    env = HiCacheEnv(page_size=4, device_pages=64, host_slots=128)
    for i in range(4):
        env.serve(np.arange(1000 * i, 1000 * i + 24, dtype=np.int32))  # 6 pages each, no L3 yet
    env.head.flush_write_through_acks()
    env.head.attach_storage_backend(StorageParams(f"file://{tmp_path}/l3", env.fingerprint, pages_per_object=2,
                                                  max_inflight_backup_pages=8))
    env.head.attach_metrics(HeadMetrics("metrics-drain"))
    live: dict[str, float | None] = {}

    def between_rounds(prog):
        if not live and prog.drained_pages > 0 and prog.left_pages > 0:
            for kind in ("left", "drained"):
                want = getattr(prog, f"{kind}_pages")
                live[kind] = want
                live[f"seen_{kind}"] = _wait_for_value(ray_metrics_port, "hicache_drain_pages", want,
                                                       replica="metrics-drain", kind=kind)

    prog = drive_drain(lambda fn: fn(env.head), DrainParams(60.0), between_rounds=between_rounds)
    assert live["seen_left"] == live["left"] > 0 and live["seen_drained"] == live["drained"] > 0
    assert prog.left_pages == prog.not_fitted_pages == 0 and prog.candidate_pages == 24
    for kind, want in (("left", 0), ("not_fitted", 0), ("candidate", 24), ("drained", prog.drained_pages)):
        assert _wait_for_value(ray_metrics_port, "hicache_drain_pages", want, replica="metrics-drain", kind=kind) == want
