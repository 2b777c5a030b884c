"""CLI end to end against a local loopback Ray cluster: up, status, bench, down, and clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ray.cluster_utils import Cluster
from support.net import free_loopback_port

REPO = Path(__file__).parents[2]




@pytest.fixture(scope="module")
def cluster():
    port = free_loopback_port()
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"hicache_head": 1}, "include_dashboard": True,
        "dashboard_host": "127.0.0.1", "dashboard_port": port,
    })
    c.dashboard_url = f"http://127.0.0.1:{port}"
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
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-2000:])
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
