"""Worker placement on TPU slices: the one place that talks to ``ray.util.tpu``.

A replica is one SPMD program over the hosts of ONE slice: one bundle per host, asking for all of the
host's chips (``{"TPU": chips_per_host, "hicache_host": 1}``, the resources ``ray_configs/tpu-*.yaml``
give each host), STRICT_SPREAD, and a label selector pinning every bundle to the slice whose head
(worker 0) Ray reserved for us. Describing a placement is pure (parsing a replica file touches no
cluster); the slice is reserved by ``WorkerPlacement.resolved()``, which the head actor calls once, when
it creates the replica's placement group.

Not exercised on this CPU machine (no TPU); the CPU/test path uses ``cpu_placement``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

HOST_RESOURCE = "hicache_host"  # per-host custom resource (ray_configs/)
HEAD_RESOURCE = "hicache_head"  # on the node that runs the head actors
# The node label Ray puts on every host of a TPU slice (its default label; ``ray.util.tpu`` reads it as
# ``ray._raylet.RAY_NODE_TPU_SLICE_NAME_KEY``, which has no public name).
TPU_SLICE_NAME_LABEL = "ray.io/tpu-slice-name"


@dataclass(frozen=True)
class TpuSliceRequest:
    """One multi-host slice to reserve (``ray.util.tpu`` naming: topology ``"4x4"``, accelerator ``"v6e"``)."""

    topology: str
    accelerator_version: str
    timeout_s: float = 100.0

    def reserve(self) -> tuple[str, Any]:
        """Reserves the slice's head (worker 0) -> (slice name, head placement group). Needs a Ray cluster."""
        from ray.util import tpu

        reserved = tpu.reserve_tpu_slice(self.topology, f"TPU-{self.accelerator_version.upper()}",
                                         timeout_s=self.timeout_s)
        if reserved is None:
            raise ValueError(f"no multi-host TPU pod type for topology {self.topology!r} / "
                             f"{self.accelerator_version!r}")
        return reserved


@dataclass(frozen=True)
class WorkerPlacement:
    """Bundles (one per host, in host order) and the placement-group strategy for a replica's workers."""

    bundles: tuple[Mapping[str, float], ...]
    strategy: str = "STRICT_SPREAD"
    bundle_label_selector: tuple[Mapping[str, str], ...] | None = None
    slice_reservation: Any = field(default=None, compare=False)  # the slice head's placement group, kept alive
    tpu_slice: TpuSliceRequest | None = None  # a slice still to reserve (``resolved()``), None once reserved

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

    def resolved(self) -> WorkerPlacement:
        """This placement with its slice reserved (label selectors pin every bundle to it); itself if there is
        nothing to reserve. Talks to the Ray cluster: call it where the placement group is created."""
        if self.tpu_slice is None:
            return self
        slice_name, head_pg = self.tpu_slice.reserve()
        selector = tuple({TPU_SLICE_NAME_LABEL: slice_name} for _ in self.bundles)
        return replace(self, bundle_label_selector=selector, slice_reservation=head_pg, tpu_slice=None)


def cpu_placement(num_hosts: int, cpus_per_host: float = 1.0, host_resource: str = HOST_RESOURCE) -> WorkerPlacement:
    """Fake hosts (tests, ``ray_configs/local-fake.yaml``): one ``host_resource`` per host."""
    if num_hosts < 1:
        raise ValueError(f"num_hosts must be >= 1, got {num_hosts}")
    return WorkerPlacement(tuple({"CPU": cpus_per_host, host_resource: 1} for _ in range(num_hosts)))


def tpu_slice_placement(topology: str, accelerator_version: str, *, timeout_s: float = 100.0) -> WorkerPlacement:
    """One bundle per host of a ``topology`` slice of ``accelerator_version`` chips (``"4x4"``, ``"v6e"``,
    ``ray.util.tpu`` naming). Pure: the slice is reserved later, by ``resolved()``."""
    from ray.util import tpu

    try:
        num_hosts, per_host = tpu.get_tpu_worker_resources(topology, f"TPU-{accelerator_version.upper()}")
    except (ValueError, KeyError, AttributeError) as exc:
        raise ValueError(f"unknown TPU topology {topology!r} / accelerator {accelerator_version!r}: {exc}") from None
    bundles = tuple({"TPU": per_host["TPU"], HOST_RESOURCE: 1} for _ in range(num_hosts))
    return WorkerPlacement(bundles, "STRICT_SPREAD", tpu_slice=TpuSliceRequest(topology, accelerator_version, timeout_s))
