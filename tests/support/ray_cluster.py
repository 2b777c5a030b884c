"""A loopback Ray cluster for tests: a head node (``hicache_head``) and fake hosts (``hicache_host``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import ray
from ray.cluster_utils import Cluster


@contextlib.contextmanager
def loopback_cluster(num_hosts: int, host_slots: int = 1, host_cpus: int = 2) -> Iterator[Cluster]:
    """Starts the cluster on 127.0.0.1 and connects this process (namespace ``hicache``); ``host_slots``:
    how many replicas' host workers fit on each fake host."""
    for k, v in dict(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled").items():
        os.environ.setdefault(k, v)
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"hicache_head": 1}, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    for _ in range(num_hosts):
        c.add_node(num_cpus=host_cpus, resources={"hicache_host": host_slots}, node_ip_address="127.0.0.1")
    ray.init(address=c.address, namespace="hicache", log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
