"""TPU slice placement, as far as a CPU machine can check it: the label hicache pins bundles with."""

from __future__ import annotations

import pytest

from hicache.cluster.tpu import TPU_SLICE_NAME_LABEL, cpu_placement

ray = pytest.importorskip("ray")


def test_the_slice_label_is_the_one_ray_puts_on_tpu_hosts():
    from ray import _raylet  # (private: the label has no public name; this pins our copy of it)

    assert TPU_SLICE_NAME_LABEL == _raylet.RAY_NODE_TPU_SLICE_NAME_KEY


def test_a_cpu_placement_has_nothing_to_reserve():
    placement = cpu_placement(2)
    assert placement.num_hosts == 2 and placement.resolved() is placement
    with pytest.raises(ValueError, match="num_hosts"):
        cpu_placement(0)
