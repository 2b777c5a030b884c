"""``ray up`` of ``ray_configs/rehearsal.yaml`` through Ray's local node provider over SSH, on network
namespaces (``hicache.testing.ray_up``): the head comes up over SSH at its own address, the head's
autoscaler starts both TPU hosts over SSH, every node carries hicache's per-host resources, token auth is
on, and nothing is left behind. Slow (one to two minutes): not in CI. Skips without namespaces or
openssh-server (``HICACHE_REQUIRE_NETNS=1`` makes a missing namespace a failure)."""

from __future__ import annotations

import os

import pytest

from hicache.testing.netns import list_namespaces, namespaces_unavailable_reason
from hicache.testing.ray_up import RayUpCluster, ray_up_unavailable_reason

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


def test_ray_up_of_the_rehearsal_file_brings_up_head_and_tpu_hosts_at_their_addresses():
    rc = RayUpCluster()
    with rc:
        nodes = {n["ip"]: n["resources"] for n in rc.nodes()}
        head, tpus = rc.net.address("head"), [rc.net.address(t) for t in rc.tpus]
        assert rc.tpus == ["tpu0", "tpu1"]
        assert set(nodes) == {head, *tpus}, nodes
        assert nodes[head].get("hicache_head") == 1 and all(nodes[t].get("hicache_host") == 1 for t in tpus)
        # the launcher's files (key, token) went to the hosts' own /root, not this machine's
        head_home = os.path.join(rc.net.host_dir("head"), "home")
        assert os.path.exists(os.path.join(head_home, "ray_bootstrap_key.pem"))
        assert os.path.exists(os.path.join(head_home, ".ray", "auth_token"))
        assert not os.path.exists("/root/ray_bootstrap_key.pem")
        namespaces = [h.namespace for h in rc.net.hosts.values()]
    assert not set(namespaces) & set(list_namespaces())
    assert not os.path.exists(f"/tmp/ray/cluster-{rc.cluster_name}.state")
    assert not os.path.exists(rc.net.workdir)
