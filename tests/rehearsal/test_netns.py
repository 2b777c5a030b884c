"""The namespace network alone (no Ray): addresses, isolation, faults, and that nothing outlives it.

Each test owns a small network in its own subnet; the cleanup tests run the owner in a child process
and end it the ways a run ends badly (SIGTERM, SIGKILL), then look at what is left. Needs root; see
``test_rehearsal_cluster`` for the skip rule (``HICACHE_REQUIRE_NETNS=1`` makes it a failure).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from hicache.testing import netns
from hicache.testing.netns import NamespaceNetwork, list_namespaces, namespace_pids

SUBNET = "10.213.9.0/24"  # not the rehearsal cluster's: the modules may share a session


@pytest.fixture(scope="module", autouse=True)
def need_namespaces():
    reason = netns.namespaces_unavailable_reason()
    if reason is not None:
        if os.environ.get("HICACHE_REQUIRE_NETNS") == "1":
            pytest.fail(f"HICACHE_REQUIRE_NETNS=1 but network namespaces are unavailable: {reason}")
        pytest.skip(f"network namespaces are unavailable: {reason}")


def gone(pid: int) -> bool:
    """Dead: no such process, or a zombie its new parent has not reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def ours(pid: int) -> list[str]:
    return [n for n in list_namespaces() if n.startswith(f"hc-{pid}-")]


def connect(net: NamespaceNetwork, src: str, dst: str, port: int) -> str:
    code = ("import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], int(sys.argv[2])), 2).close()\n"
            "    print('ok')\nexcept OSError as e:\n    print(type(e).__name__, e.errno)\n")
    return net.run(src, [sys.executable, "-c", code, net.address(dst), str(port)], timeout_s=30).stdout.strip()


def test_hosts_reach_each_other_until_partitioned_and_everything_goes_on_close():
    with NamespaceNetwork(["a", "b"], SUBNET) as net:
        assert ours(os.getpid()) and net.address("a") == "10.213.9.10" and net.address("b") == "10.213.9.11"
        server = net.popen("b", [sys.executable, "-c", "import socket, time\ns = socket.create_server(('0.0.0.0', 7000))\n"
                                 "print('up', flush=True)\nwhile True: s.accept()[0].close()"],
                           stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None and server.stdout.readline().strip() == "up"
        assert connect(net, "a", "b", 7000) == "ok"
        net.partition("b")
        assert connect(net, "a", "b", 7000).startswith("TimeoutError")  # silence, not a refusal
        net.heal("b")
        assert connect(net, "a", "b", 7000) == "ok"
        net.kill_host("b")
        assert server.wait(10) == -signal.SIGKILL and namespace_pids(net.host("b").namespace) == []
        with pytest.raises(ValueError, match="unknown host"):
            net.address("c")
    assert ours(os.getpid()) == [] and not os.path.exists(net.workdir)


def test_bad_options_are_refused_before_anything_is_made():
    before = list_namespaces()
    for subnet in ("8.8.8.0/24", "10.213.0.0/16"):
        with pytest.raises(ValueError, match="subnet"):
            NamespaceNetwork(["a"], subnet)
    for names in ([], ["a", "a"], ["sw"], ["Bad"], ["x" * 13]):
        with pytest.raises(ValueError, match="host names"):
            NamespaceNetwork(names, SUBNET)
    assert list_namespaces() == before


OWNER = """
import sys, time
from hicache.testing.netns import NamespaceNetwork
net = NamespaceNetwork(["a"], sys.argv[1]).open()
net.popen("a", [sys.executable, "-c", "import time; time.sleep(600)"])
print("open", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signalled_owner_removes_its_namespaces_and_processes(sig):
    owner = subprocess.Popen([sys.executable, "-c", OWNER, SUBNET], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "open"
        made = ours(owner.pid)
        assert len(made) == 2  # the host and the switch
        sleeper = namespace_pids(f"hc-{owner.pid}-a")
        assert sleeper
        owner.send_signal(sig)
        assert owner.wait(30) != 0
        assert ours(owner.pid) == [] and all(gone(p) for p in sleeper)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        netns.sweep_stale()


def test_what_a_killed_owner_left_is_swept_by_the_next_network():
    owner = subprocess.Popen([sys.executable, "-c", OWNER, SUBNET], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None and owner.stdout.readline().strip() == "open"
    sleeper = namespace_pids(f"hc-{owner.pid}-a")
    owner.kill()  # no handler runs: everything it made stays behind
    owner.wait()
    assert len(ours(owner.pid)) == 2
    swept = netns.sweep_stale()
    assert sorted(swept) == sorted([f"hc-{owner.pid}-a", f"hc-{owner.pid}-sw"])
    assert ours(owner.pid) == [] and all(gone(p) for p in sleeper)
    assert not os.path.exists(f"/tmp/hc-{owner.pid}")
