"""Many hosts for real: the rehearsal cluster (``hicache.testing.rehearsal``), one per module.

Hosts are network namespaces with their own addresses on a private /24 (head, two TPU-host stand-ins,
the GCS emulator's storage host, a client host). The replica is started with ``hicache up`` from the
client host; its host workers run on tpu0/tpu1 and must coordinate ``jax.distributed`` on tpu0's own
address (a loopback coordinator, yesterday's default, never comes up here: tpu1 would dial itself).
The drills serve the reference engine from the client host, compare every output with the no-cache
reference, and inject (a) kill -9 of every process of one TPU host, (b) a partition of one TPU host
longer than the call timeouts, then heal. ``benchmarks/drills.py`` runs these and the others.

Needs root (namespaces): without it the module skips with the reason, unless ``HICACHE_REQUIRE_NETNS=1``
(``.ci/run`` sets it), which turns the skip into a failure.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from hicache.testing import drills
from hicache.testing.netns import namespaces_unavailable_reason
from hicache.testing.rehearsal import CLIENT, HEAD, RehearsalCluster, last_json_line

REQUIRE_ENV = "HICACHE_REQUIRE_NETNS"
REPLICA = "rh"
CALL_TIMEOUT_S = 10.0  # the workers' ping/poll bound (above a first forward's compile on a loaded box)
DRIVER_TIMEOUT_S = 12.0  # the driver's per-call bound (engine and client)


@pytest.fixture(scope="module")
def rc():
    reason = namespaces_unavailable_reason()
    if reason is not None:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but network namespaces are unavailable: {reason}")
        pytest.skip(f"network namespaces are unavailable: {reason}")
    with RehearsalCluster() as cluster:
        yield cluster


@pytest.fixture(scope="module")
def replica(rc):
    """``hicache up`` from the client host, as an operator would run it against the head's address."""
    drills.hicache_up(rc, REPLICA, CALL_TIMEOUT_S)
    return REPLICA


def test_every_host_has_its_own_address_and_no_way_out(rc):
    for name, host in rc.net.hosts.items():
        addrs = subprocess.run(["ip", "-n", host.namespace, "-4", "-o", "addr"], capture_output=True, text=True,
                               check=True).stdout
        assert f"inet {host.address}/24" in addrs and addrs.count("inet ") == 2, (name, addrs)  # + 127.0.0.1
        routes = subprocess.run(["ip", "-n", host.namespace, "-4", "route"], capture_output=True, text=True,
                                check=True).stdout
        assert "default" not in routes and routes.count("\n") == 1, (name, routes)  # only the /24
    # nothing outside the namespaces answers: this machine's own gateway is unreachable from the client
    out = rc.python(CLIENT, "import socket\ntry:\n    socket.create_connection(('192.0.2.1', 80), 2)\n"
                            "    print('reached')\nexcept OSError as e:\n    print(e.errno)\n").stdout
    assert out.strip() == "101"  # ENETUNREACH
    probe = last_json_line(rc.module(CLIENT, "hicache.testing.drivers", ["probe"], timeout_s=120).stdout)
    assert probe["driver_ip"] == rc.address(CLIENT)
    nodes = {n["ip"]: n for n in probe["nodes"] if n["alive"]}
    assert set(nodes) == {rc.address(h) for h in (HEAD, *rc.tpu_hosts, CLIENT)}
    assert nodes[rc.address(HEAD)]["resources"].get("hicache_head") == 1
    assert all(nodes[rc.address(h)]["resources"].get("hicache_host") == 1 for h in rc.tpu_hosts)


def test_replica_from_the_client_host_coordinates_jax_on_host0_and_steps_over_the_channel(rc, replica):
    probe = last_json_line(rc.module(CLIENT, "hicache.testing.drivers", ["probe", "--replica", replica, "--steps", "6"],
                                     timeout_s=120).stdout)
    workers = sorted(probe["workers"], key=lambda w: w["host"])
    assert {w["node_ip"] for w in workers} == {rc.address(h) for h in rc.tpu_hosts}  # one per TPU host
    coordinator = {w["jax"] for w in workers}  # one jax.distributed session, on host 0's own address
    assert len(coordinator) == 1 and coordinator.pop().rpartition(":")[0] == workers[0]["node_ip"]
    # the serving client is on another host than the head: its steps reach the head over the channel,
    # bound to the head's node address (not loopback), none as Ray calls
    assert probe["channel"]["host"] == rc.address(HEAD)
    assert probe["steps"] == {"channel": 6, "ray": 0}


def check_drill(result: drills.DrillResult) -> None:
    assert result.wrong_outputs == 0, result  # every output equals the no-cache reference's, bit for bit
    assert result.failures >= 1, result  # the fault met a request: the drill tested something
    assert result.max_blocked_s <= DRIVER_TIMEOUT_S + 1.0, result  # no call blocked past its timeout
    assert result.recovery_s is not None, result  # served with hits again after the fault


def test_drill_kill_9_a_tpu_host_mid_workload(rc, replica):
    """Every process of tpu1 (raylet, host worker) is SIGKILLed while the client serves; the host then
    reboots (its Ray node starts again). The replica rebuilds its gang and serves hits again (from L3
    on the storage host, then L1/L2), never a wrong token."""
    result = drills.run_drill(rc, replica, drills.kill_host("tpu1"), timeout_s=DRIVER_TIMEOUT_S, conversations=2,
                              wait_for_l3=True)  # (else a fetch slower than recompute on a busy box is skipped)
    check_drill(result)
    assert result.storage_hit_requests >= 1, result  # the new gang's L1/L2 start empty: L3 over the network


def test_drill_partition_a_tpu_host_then_heal(rc, replica):
    """tpu1's link goes down until a request failed (so for longer than the call timeouts), then up."""
    check_drill(drills.run_drill(rc, replica, drills.partition_host("tpu1"), timeout_s=DRIVER_TIMEOUT_S,
                                 conversations=2, seed=1))
