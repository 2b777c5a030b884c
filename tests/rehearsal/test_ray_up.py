"""``ray up`` of ``ray_configs/rehearsal.yaml`` through Ray's local node provider over SSH, on network
namespaces (``hicache.testing.ray_up``): the head comes up over SSH at its own address, the head's
autoscaler starts both TPU hosts over SSH, every node carries hicache's per-host resources, token auth is
on, and nothing is left behind; the kill drill on a rehearsal cluster brought up this way recovers through
the autoscaler (it starts the killed host's node again over SSH). Slow (one and three minutes): not in CI.
Skips without namespaces or openssh-server (``HICACHE_REQUIRE_NETNS=1`` makes a missing namespace a failure)."""

from __future__ import annotations

import os

import pytest

from hicache.testing import drills
from hicache.testing.netns import list_namespaces, namespaces_unavailable_reason
from hicache.testing.ray_up import RayUpCluster, ray_up_unavailable_reason
from hicache.testing.rehearsal import Launcher, RehearsalCluster, RehearsalOptions

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
        # the provider's cluster state went to the client host's folder, not this machine's /tmp/ray
        assert os.path.exists(os.path.join(rc.net.host_dir("client"), "tmp", "ray", f"cluster-{rc.cluster_name}.state"))
        namespaces = [h.namespace for h in rc.net.hosts.values()]
    assert not set(namespaces) & set(list_namespaces())
    assert not os.path.exists(f"/tmp/ray/cluster-{rc.cluster_name}.state")
    assert not os.path.exists(rc.net.workdir)


def test_kill_drill_on_a_ray_up_rehearsal_recovers_through_the_autoscaler():
    """Every process of tpu1 (its sshd too) is SIGKILLed mid-workload; the harness only starts its sshd again
    (the host rebooted), the head's autoscaler restarts its Ray node over SSH, the replica serves hits again,
    every output equals the no-cache reference's."""
    with RehearsalCluster(RehearsalOptions(launcher=Launcher.RAY_UP)) as rc:
        drills.hicache_up(rc, "up", call_timeout_s=10.0)
        result = drills.run_drill(rc, "up", drills.kill_host("tpu1"), timeout_s=12.0, conversations=2)
        tpu1 = rc.address("tpu1")
        alive = [n for n in rc.python("client", _ALIVE_NODES, timeout_s=120).stdout.split() if n == tpu1]
    assert result.wrong_outputs == 0 and result.failures >= 1, result
    assert result.max_blocked_s <= 12.0 + 1.0, result
    assert result.recovery_s is not None and alive == [tpu1], (result, alive)  # one node there, started over SSH


_ALIVE_NODES = ("from hicache.testing.rehearsal import connect_driver\n"
                "ray = connect_driver()\n"
                "print(' '.join(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']))\n")
