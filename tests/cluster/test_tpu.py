"""TPU slice placement, as far as a CPU machine can check it: the label hicache pins bundles with."""

from __future__ import annotations

import pytest

from hicache.cluster.tpu import HOST_RESOURCE, TPU_SLICE_NAME_LABEL, cpu_placement, tpu_slice_placement

ray = pytest.importorskip("ray")


def test_the_slice_label_is_the_one_ray_puts_on_tpu_hosts():
    from ray import _raylet  # (private: the label has no public name; this pins our copy of it)

    assert TPU_SLICE_NAME_LABEL == _raylet.RAY_NODE_TPU_SLICE_NAME_KEY


def test_a_cpu_placement_has_nothing_to_reserve():
    placement = cpu_placement(2)
    assert placement.num_hosts == 2 and placement.resolved() is placement
    with pytest.raises(ValueError, match="num_hosts"):
        cpu_placement(0)


@pytest.mark.parametrize("topology, accelerator, hosts, chips", [
    ("4x4", "v6e", 4, 4), ("2x4", "v6e", 1, 8), ("2x2x2", "v5p", 2, 4), ("8x8", "v5litepod", 16, 4)])
def test_a_slice_placement_has_one_bundle_per_host_with_its_chips(topology, accelerator, hosts, chips):
    placement = tpu_slice_placement(topology, accelerator)  # pure: nothing reserved yet
    assert placement.num_hosts == hosts and placement.strategy == "STRICT_SPREAD"
    assert all(dict(b) == {"TPU": chips, HOST_RESOURCE: 1} for b in placement.bundles)
    assert placement.tpu_slice is not None and placement.tpu_slice.topology == topology


@pytest.mark.parametrize("topology, accelerator", [("4x4", "bogus"), ("9x9", "v6e")])
def test_an_unknown_slice_is_a_value_error_naming_it(topology, accelerator):
    with pytest.raises(ValueError, match=topology):
        tpu_slice_placement(topology, accelerator)
