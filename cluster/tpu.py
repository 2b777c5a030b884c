"""Worker placement on TPU slices: the one place that talks to ``ray.util.tpu``.

A replica is one SPMD program over the hosts of ONE slice: one bundle per host, asking for all of the
host's chips (``{"TPU": chips_per_host, "hicache_host": 1}``, the resources ``ray_configs/tpu-*.yaml``
give each host), STRICT_SPREAD, and a label selector pinning every bundle to the slice whose head
(worker 0) Ray reserved for us. Runs once, on the head actor, when it places its workers.

Not exercised on this CPU machine (no TPU); the CPU/test path uses ``cpu_placement``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

HOST_RESOURCE = "hicache_host"  # per-host custom resource (ray_configs/)
HEAD_RESOURCE = "hicache_head"  # on the node that runs the head actors


@dataclass(frozen=True)
class WorkerPlacement:
    """Bundles (one per host, in host order) and the placement-group strategy for a replica's workers."""

    bundles: tuple[Mapping[str, float], ...]
    strategy: str = "STRICT_SPREAD"
    bundle_label_selector: tuple[Mapping[str, str], ...] | None = None
    slice_reservation: Any = field(default=None, compare=False)  # the slice head's placement group, kept alive

    def __post_init__(self) -> None:
        if not self.bundles:
            raise ValueError("a placement needs at least one bundle (one per host)")
        object.__setattr__(self, "bundles", tuple(dict(b) for b in self.bundles))
        if self.strategy not in ("STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK"):
            raise ValueError(f"unknown placement strategy {self.strategy!r}")
        if self.bundle_label_selector is not None and len(self.bundle_label_selector) != len(self.bundles):
            raise ValueError("bundle_label_selector needs one selector per bundle")

    @property
    def num_hosts(self) -> int:
        return len(self.bundles)


def cpu_placement(num_hosts: int, cpus_per_host: float = 1.0, host_resource: str = HOST_RESOURCE) -> WorkerPlacement:
    """Fake hosts (tests, ``ray_configs/local-fake.yaml``): one ``host_resource`` per host."""
    if num_hosts < 1:
        raise ValueError(f"num_hosts must be >= 1, got {num_hosts}")
    return WorkerPlacement(tuple({"CPU": cpus_per_host, host_resource: 1} for _ in range(num_hosts)))


def tpu_slice_placement(topology: str, accelerator_version: str, *, timeout_s: float = 100.0) -> WorkerPlacement:
    """Reserves one slice (its worker-0 head resource) and returns one bundle per host of it.

    ``topology`` like ``"4x4"``, ``accelerator_version`` like ``"v6e"`` (``ray.util.tpu`` naming).
    """
    from ray._raylet import RAY_NODE_TPU_SLICE_NAME_KEY
    from ray.util import tpu

    chips_per_host = tpu.get_chips_per_host(topology, accelerator_version)
    num_hosts = max(1, tpu.get_num_chips_from_topology(topology) // chips_per_host)
    reserved = tpu.reserve_tpu_slice(topology, f"TPU-{accelerator_version.upper()}", timeout_s=timeout_s)
    if reserved is None:
        raise ValueError(f"no multi-host TPU pod type for topology {topology!r} / {accelerator_version!r}")
    slice_name, head_pg = reserved
    bundles = tuple({"TPU": chips_per_host, HOST_RESOURCE: 1} for _ in range(num_hosts))
    selector = tuple({RAY_NODE_TPU_SLICE_NAME_KEY: slice_name} for _ in range(num_hosts))
    return WorkerPlacement(bundles, "STRICT_SPREAD", selector, slice_reservation=head_pg)
