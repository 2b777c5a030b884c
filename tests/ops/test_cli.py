"""CLI end to end against a local loopback Ray cluster: up, status, bench (also against a running
replica, whose ``hicache_*`` metrics are then scraped from the head node), down, clear errors; and the
README's plain ``ray job submit --runtime-env ray_configs/runtime_env/local.yaml`` of a benchmark."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from ray.cluster_utils import Cluster
from support.net import free_loopback_port

REPO = Path(__file__).parents[2]




@pytest.fixture(scope="module")
def cluster():
    port, metrics_port = free_loopback_port(), free_loopback_port()
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"hicache_head": 1}, "include_dashboard": True,
        "dashboard_host": "127.0.0.1", "dashboard_port": port, "metrics_export_port": metrics_port,
        # Ray's fixed default (52365) is taken by any other cluster's node on this machine: the job server
        # then finds no agent on the head node to run jobs
        "dashboard_agent_listen_port": free_loopback_port(),
        "_system_config": {"metrics_report_interval_ms": 300},
    })
    # one fake TPU host for a replica's worker
    c.add_node(num_cpus=1, resources={"hicache_host": 1}, dashboard_agent_listen_port=free_loopback_port())
    c.dashboard_url = f"http://127.0.0.1:{port}"
    c.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"  # the head node's (the head actor's) endpoint
    yield c
    c.shutdown()


def _wait_for_job_server(url: str, timeout_s: float = 60) -> None:
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/version", timeout=2).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def hicache(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    return subprocess.run([sys.executable, "-m", "hicache", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def test_up_status_down(cluster, tmp_path):
    cfg = tmp_path / "replica.yaml"
    cfg.write_text("replica: cli-test\npage_size: 16\nl1_pages: 256\n")
    addr = cluster.address
    res = hicache("up", "--address", addr, "--config", str(cfg))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "cli-test" in res.stdout
    res = hicache("status", "--address", addr)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "cli-test" in res.stdout and "ready" in res.stdout and "0/4,096" in res.stdout
    assert "misses" in res.stdout  # the served prompt tokens' miss reasons (none served yet: "-")
    res = hicache("status", "--address", addr, "--replica", "nope")
    assert res.returncode == 1 and "unknown replica 'nope'" in res.stderr and "cli-test" in res.stderr
    res = hicache("down", "--address", addr, "--replica", "cli-test")
    assert res.returncode == 0 and "stopped" in res.stdout, res.stderr[-2000:]
    res = hicache("down", "--address", addr, "--replica", "cli-test")
    assert res.returncode == 1 and "unknown replica 'cli-test'" in res.stderr


def test_bench_submits_a_ray_job_and_follows_it(cluster):
    _wait_for_job_server(cluster.dashboard_url)
    res = hicache("bench", "tree_bench", "--dashboard", cluster.dashboard_url, "--", "--quick", "--page-sizes", "16",
                  "--capacities", "0", "--repeat", "1")
    assert res.returncode == 0, f"stdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-1500:]}"
    assert "SUCCEEDED" in res.stdout and "req/s" in res.stdout


def test_clear_errors_without_cluster_or_with_bad_input(tmp_path):
    res = hicache("status", "--address", "127.0.0.1:1", timeout=60)
    assert res.returncode == 1 and res.stderr.count("\n") == 1 and "no Ray cluster" in res.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("replica: x\npage_size: 16\nl2_slots: 8\nworkers: {platform: gpu}\nmodel: {num_layers: 1, num_kv_heads: 1, head_dim: 8}\n")
    res = hicache("up", "--address", "127.0.0.1:1", "--config", str(bad), timeout=60)
    assert res.returncode == 1 and "platform must be cpu or tpu" in res.stderr
    res = hicache("bench", "no_such_bench", "--dashboard", "http://127.0.0.1:1", timeout=60)
    assert res.returncode == 1 and "unknown benchmark 'no_such_bench'" in res.stderr


def test_plain_ray_job_submit_of_a_benchmark_with_the_local_runtime_env(cluster):
    """The README's command: the job's working dir holds benchmarks/ only, as the folder its imports name."""
    _wait_for_job_server(cluster.dashboard_url)
    ray_cli = "import sys; from ray.scripts.scripts import main; sys.exit(main())"
    res = subprocess.run([sys.executable, "-c", ray_cli, "job", "submit", "--address", cluster.dashboard_url,
                          "--runtime-env", "ray_configs/runtime_env/local.yaml", "--",
                          "python", "benchmarks/engine_bench.py", "--help"],  # its imports are what failed
                         capture_output=True, text=True, timeout=240, cwd=REPO,
                         env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "ModuleNotFoundError" not in out and "usage: engine_bench.py" in out


def _scrape_hicache(url: str, replica: str) -> dict[tuple[str, str], float]:
    """``ray_hicache_*`` samples of ``replica`` on a node's Prometheus endpoint: (name, tier) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, s.labels.get("tier", "")): s.value for fam in text_string_to_metric_families(body)
            for s in fam.samples if s.name.startswith("ray_hicache_") and s.labels.get("replica") == replica}


def test_bench_against_a_running_replica_shows_in_status_and_metrics(cluster, tmp_path):
    """``hicache up`` a replica with a host worker, ``hicache bench replica_chat --replica`` serves through
    it (exact outputs), then ``hicache status`` and the head node's metrics endpoint show its hits."""
    cfg = tmp_path / "replica.yaml"
    cfg.write_text("replica: bench-test\npage_size: 4\nl1_pages: 16\nl2_slots: 128\nwrite_policy: write_through\n"
                   "model: {num_layers: 1, num_kv_heads: 2, head_dim: 8, dtype: float32}\n"
                   "workers: {platform: cpu, num_hosts: 1, devices_per_host: 1}\n")
    addr = cluster.address
    res = hicache("up", "--address", addr, "--config", str(cfg))
    assert res.returncode == 0, res.stderr[-2000:]
    try:
        _wait_for_job_server(cluster.dashboard_url)
        out_json = tmp_path / "bench.json"
        res = hicache("bench", "replica_chat", "--replica", "bench-test", "--dashboard", cluster.dashboard_url,
                      "--", "--quick", "--json", str(out_json), "--timeout", "120")  # per call: a loaded CI box
        assert res.returncode == 0, f"stdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-1500:]}"
        out = json.loads(out_json.read_text())
        assert out["requests"] == 6 and out["wrong_outputs"] == 0
        assert out["hit_tokens"]["l1"] > 0 and out["hit_tokens"]["l2"] > 0  # L1 of 16 pages: turns come back from L2
        after, before = out["head_hits_after"], out["head_hits_before"]
        assert after["device_hit_tokens"] - before["device_hit_tokens"] >= out["hit_tokens"]["l1"]
        res = hicache("status", "--address", addr, "--replica", "bench-test")
        assert res.returncode == 0, res.stderr[-2000:]
        row = next(line.split() for line in res.stdout.splitlines() if line.strip().startswith("bench-test"))
        hit_l1 = round(100 * after["device_hit_tokens"] / after["queried_tokens"])
        assert f"{hit_l1}%" == row[5] and row[5] != "0%", res.stdout
        # The head publishes its counters once the replica is idle too; Ray's agent exports them.
        want = {("ray_hicache_hit_tokens_total", "l1"): after["device_hit_tokens"],
                ("ray_hicache_hit_tokens_total", "l2"): after["host_hit_tokens"],
                ("ray_hicache_queried_tokens_total", ""): after["queried_tokens"]}
        deadline = time.monotonic() + 60
        while True:
            got = _scrape_hicache(cluster.metrics_url, "bench-test")
            if all(got.get(k) == v for k, v in want.items()) or time.monotonic() > deadline:
                break
            time.sleep(0.5)  # Ray's metrics agent reports every 300 ms (bounded by the deadline)
        assert {k: got.get(k) for k in want} == want, got
    finally:
        hicache("down", "--address", addr, "--replica", "bench-test")


def test_bench_replica_flag_needs_a_benchmark_that_serves_one():
    res = hicache("bench", "tree_bench", "--replica", "x", "--dashboard", "http://127.0.0.1:1", timeout=60)
    assert res.returncode == 1 and "does not drive a running replica" in res.stderr and "replica_chat" in res.stderr
