"""``ray up`` through Ray's local node provider over SSH, on network namespaces (``hicache.testing.ray_up``):
the head comes up over SSH at its own address, the head's autoscaler starts the TPU host over SSH, every
node carries hicache's per-host resources, and nothing is left behind. Slow (about a minute): not in CI.
Skips without namespaces or openssh-server (``HICACHE_REQUIRE_NETNS=1`` makes a missing namespace a failure)."""

from __future__ import annotations

import os

import pytest

from hicache.testing.netns import list_namespaces, namespaces_unavailable_reason
from hicache.testing.ray_up import RayUpCluster, RayUpOptions, ray_up_unavailable_reason

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _needs_namespaces_and_sshd():
    reason = namespaces_unavailable_reason()
    if reason is not None:
        if os.environ.get("HICACHE_REQUIRE_NETNS") == "1":
            pytest.fail(f"HICACHE_REQUIRE_NETNS=1 but network namespaces are unavailable: {reason}")
        pytest.skip(f"network namespaces are unavailable: {reason}")
    reason = ray_up_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def test_ray_up_over_ssh_brings_up_head_and_tpu_host_at_their_addresses():
    rc = RayUpCluster(RayUpOptions(tpu_hosts=1))
    with rc:
        nodes = {n["ip"]: n["resources"] for n in rc.nodes()}
        head, tpu = rc.net.address("head"), rc.net.address("tpu0")
        assert set(nodes) == {head, tpu}, nodes
        assert nodes[head].get("hicache_head") == 1 and nodes[tpu].get("hicache_host") == 1
        # the launcher's files went to the hosts' own /root, not this machine's
        assert os.path.exists(os.path.join(rc.net.host_dir("head"), "home", "ray_bootstrap_key.pem"))
        assert not os.path.exists("/root/ray_bootstrap_key.pem")
        namespaces = [h.namespace for h in rc.net.hosts.values()]
    assert not set(namespaces) & set(list_namespaces())
    assert not os.path.exists(f"/tmp/ray/cluster-{rc.cluster_name}.state")
    assert not os.path.exists(rc.net.workdir)
