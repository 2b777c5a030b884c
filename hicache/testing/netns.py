"""Hosts with their own addresses on one machine: network namespaces on a private bridge (root only).

``NamespaceNetwork`` makes one network namespace per host (``hc-<owner pid>-<host>``) and a "switch"
namespace (``hc-<owner pid>-sw``) holding a bridge; each host has a veth pair to the bridge, its own
address in a private /24, loopback up, and nothing else: no default route, no forwarding, no NAT, no
link to the machine's own namespace, so traffic never leaves the namespaces it made. Processes run
in a host's namespace through ``ip netns exec`` (``popen``/``run``); faults act on the host's port
of the switch (``partition``/``heal``: link down/up; ``impair``: ``tc netem`` both ways) or on its
processes (``kill_host``: SIGKILL to every process in the namespace).

Name resolution: each host gets ``/etc/netns/<namespace>/hosts`` (``ip netns exec`` mounts it over
``/etc/hosts`` for what runs there), where this machine's hostname and the host names resolve to the
hosts' own addresses, as on real hosts (gloo, JAX's CPU collectives, binds the address its hostname
resolves to: 127.0.0.1 from this machine's own ``/etc/hosts``).

Ownership: the network owns every namespace, link and process it made; ``close()`` (also on
``__exit__``, an exception, SIGTERM/SIGINT while open, and interpreter exit) kills every process in
its namespaces and deletes them, which deletes their links. ``sweep_stale()`` (run by ``open()``)
removes what a killed run left: ``hc-<pid>-*`` namespaces whose owner pid is gone, with their processes.
Everything here runs in the calling process, once; nothing is shared between networks.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

PREFIX = "hc-"
DEFAULT_SUBNET = "10.213.7.0/24"
_NAME = re.compile(r"^hc-(\d+)-[a-z0-9]+$")
_HOST = re.compile(r"^[a-z][a-z0-9]{0,11}$")  # veth names ("p-" + host) must fit IFNAMSIZ (15)
_KILL_WAIT_S = 10.0


class NamespacesUnavailable(RuntimeError):
    """This process cannot make network namespaces (not root, no ``ip``, a sandbox that forbids it)."""


def _ip(*args: str, check: bool = True, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=timeout_s)


def namespaces_unavailable_reason() -> str | None:
    """Why namespaces cannot be used here (None: they can): tried by making and deleting one."""
    if os.geteuid() != 0:
        return "network namespaces need root (not root here)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool!r} (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"'ip netns add' failed: {made.stderr.strip()}"
        veth = _ip("-n", probe, "link", "add", "p-probe", "type", "veth", "peer", "name", "q-probe", check=False)
        if veth.returncode != 0:
            return f"veth pairs cannot be made: {veth.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def netem_unavailable_reason() -> str | None:
    """Why ``tc netem`` (``NamespaceNetwork.impair``) cannot be used here (None: it can)."""
    probe = f"{PREFIX}{os.getpid()}-netem"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", "name", "p-a", "type", "veth", "peer", "name", "p-b")
        done = subprocess.run(["tc", "-n", probe, "qdisc", "add", "dev", "p-a", "root", "netem", "delay", "1ms"],
                              capture_output=True, text=True, timeout=30)
        return None if done.returncode == 0 else f"tc netem: {done.stderr.strip() or done.returncode}"
    except (subprocess.CalledProcessError, OSError) as e:
        return f"tc netem probe failed: {e}"
    finally:
        _ip("netns", "del", probe, check=False)


def list_namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(name: str) -> list[int]:
    out = _ip("netns", "pids", name, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace(name: str) -> list[int]:
    """SIGKILLs every process in namespace ``name`` until none is left (bounded); returns the pids it killed."""
    killed: list[int] = []
    deadline = time.monotonic() + _KILL_WAIT_S
    while True:
        pids = namespace_pids(name)
        if not pids:
            return killed
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} in namespace {name} survive SIGKILL")
        time.sleep(0.05)  # a process forked between the listing and the kill shows up next round


ETC_NETNS = "/etc/netns"


def _delete_namespace(name: str) -> None:
    _kill_namespace(name)
    _ip("netns", "del", name, check=False)
    shutil.rmtree(os.path.join(ETC_NETNS, name), ignore_errors=True)


def sweep_stale() -> list[str]:
    """Deletes ``hc-<pid>-*`` namespaces (and their processes) whose owner ``pid`` no longer runs."""
    swept = []
    for name in list_namespaces():
        m = _NAME.match(name)
        if m and not _alive(int(m.group(1))):
            _delete_namespace(name)
            swept.append(name)
    for path in _stale_dirs():
        shutil.rmtree(path, ignore_errors=True)
    if os.path.isdir(ETC_NETNS):
        for entry in os.listdir(ETC_NETNS):
            m = _NAME.match(entry)
            if m and not _alive(int(m.group(1))):
                shutil.rmtree(os.path.join(ETC_NETNS, entry), ignore_errors=True)
    return swept


def _stale_dirs() -> list[str]:
    root = "/tmp"
    out = []
    for entry in os.listdir(root):
        m = re.match(r"^hc-(\d+)$", entry)
        if m and not _alive(int(m.group(1))):
            out.append(os.path.join(root, entry))
    return out


@dataclass(frozen=True)
class Host:
    name: str  # short host name, e.g. "head"
    namespace: str  # hc-<pid>-<name>
    address: str  # its address on the bridge
    port: str  # its port on the switch (veth in the switch namespace)


class NamespaceNetwork:
    """Hosts ``names`` on a bridge in ``subnet`` (see the module docstring). Use as a context manager."""

    def __init__(self, names: Sequence[str], subnet: str = DEFAULT_SUBNET) -> None:
        net = ipaddress.ip_network(subnet)
        if net.version != 4 or net.prefixlen != 24 or not net.is_private:
            raise ValueError(f"subnet must be a private IPv4 /24, got {subnet!r}")
        names = list(names)
        bad = [n for n in names if not _HOST.match(n) or n == "sw"]
        if not names or bad or len(set(names)) != len(names):
            raise ValueError(f"host names must be unique, [a-z][a-z0-9]{{0,11}} and not 'sw'; got {names!r}")
        self.subnet = net
        self.owner = os.getpid()
        self.switch = f"{PREFIX}{self.owner}-sw"
        base = int(net.network_address)
        self.hosts: dict[str, Host] = {
            n: Host(n, f"{PREFIX}{self.owner}-{n}", str(ipaddress.ip_address(base + 10 + i)), f"p-{n}")
            for i, n in enumerate(names)
        }
        self.workdir = f"/tmp/{PREFIX}{self.owner}"  # per-host scratch (Ray temp dirs): /tmp/hc-<pid>/<host>
        self._procs: list[subprocess.Popen[Any]] = []
        self._opened = False
        self._closed = threading.Event()
        self._old_handlers: dict[int, Any] = {}

    # -- lifecycle ----------------------------------------------------------------------------------------
    def open(self) -> NamespaceNetwork:
        reason = namespaces_unavailable_reason()
        if reason is not None:
            raise NamespacesUnavailable(reason)
        sweep_stale()
        self._check_subnet_unused()
        self._opened = True
        self._install_handlers()
        atexit.register(self.close)
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for h in self.hosts.values():
                _ip("netns", "add", h.namespace)
                _ip("-n", self.switch, "link", "add", h.port, "type", "veth", "peer", "name", "eth0",
                    "netns", h.namespace)
                _ip("-n", self.switch, "link", "set", h.port, "master", "br0", "up")
                _ip("-n", h.namespace, "addr", "add", f"{h.address}/24", "dev", "eth0")
                _ip("-n", h.namespace, "link", "set", "eth0", "up")
                _ip("-n", h.namespace, "link", "set", "lo", "up")
                self._write_hosts_file(h)
                os.makedirs(self.host_dir(h.name), exist_ok=True)
        except BaseException:
            self.close()
            raise
        return self

    def _write_hosts_file(self, h: Host) -> None:
        lines = ["127.0.0.1 localhost", "::1 localhost", f"{h.address} {socket.gethostname()}"]
        lines += [f"{o.address} {o.name}" for o in self.hosts.values()]
        folder = os.path.join(ETC_NETNS, h.namespace)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "hosts"), "w") as f:
            f.write("\n".join(lines) + "\n")

    def _check_subnet_unused(self) -> None:
        """The /24 must not overlap an address or route of this machine (they would shadow each other
        for anything that ever joins both)."""
        for cmd in (("-4", "-o", "addr"), ("-4", "route")):
            for token in re.findall(r"\d+\.\d+\.\d+\.\d+(?:/\d+)?", _ip(*cmd).stdout):
                other = ipaddress.ip_network(token, strict=False)
                if other.prefixlen > 0 and other.overlaps(self.subnet) and not other.is_loopback:
                    raise ValueError(f"subnet {self.subnet} overlaps {other} in use on this machine")

    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers are the main thread's; atexit and __exit__ still clean up
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self._old_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.close()
        old = self._old_handlers.get(signum)
        if callable(old):
            old(signum, frame)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            raise SystemExit(128 + signum)

    def close(self) -> None:
        """Kills every process in the namespaces and deletes them (idempotent)."""
        if self._closed.is_set() or not self._opened:
            return
        self._closed.set()
        for sig, old in self._old_handlers.items():
            try:
                signal.signal(sig, old)
            except (ValueError, TypeError):  # not the main thread / a handler set from C
                pass
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        for h in self.hosts.values():
            _delete_namespace(h.namespace)
        _delete_namespace(self.switch)
        for p in self._procs:
            try:
                p.wait(timeout=_KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.workdir, ignore_errors=True)
        try:
            os.rmdir(ETC_NETNS)  # only when empty: made for these hosts files, or left by no one else
        except OSError:
            pass
        atexit.unregister(self.close)

    def __enter__(self) -> NamespaceNetwork:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- hosts ----------------------------------------------------------------------------------------------
    def host(self, name: str) -> Host:
        try:
            return self.hosts[name]
        except KeyError:
            raise ValueError(f"unknown host {name!r}; hosts: {sorted(self.hosts)}") from None

    def address(self, name: str) -> str:
        return self.host(name).address

    def host_dir(self, name: str) -> str:
        return os.path.join(self.workdir, self.host(name).name)

    def argv(self, name: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.host(name).namespace, *argv]

    def popen(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None, **kw: Any) -> subprocess.Popen[Any]:
        """Starts ``argv`` in host ``name``'s namespace (killed by ``close``)."""
        if self._closed.is_set() or not self._opened:
            raise RuntimeError("the network is not open")
        proc = subprocess.Popen(self.argv(name, argv), env=None if env is None else dict(env), **kw)
        self._procs.append(proc)
        return proc

    def run(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None, *,
            timeout_s: float, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Runs ``argv`` in host ``name``'s namespace to completion (killed after ``timeout_s``)."""
        proc = self.popen(name, argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise TimeoutError(f"{argv!r} on {name} did not finish within {timeout_s}s\n{err[-4000:]}") from None
        finally:
            self._procs.remove(proc)
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{argv!r} on {name} exited {proc.returncode}\n--- stdout\n{out[-4000:]}\n"
                               f"--- stderr\n{err[-4000:]}")
        return done

    # -- faults -----------------------------------------------------------------------------------------------
    def partition(self, name: str) -> None:
        """Cuts host ``name`` off the bridge (its own link stays up: its processes see silence, not an error)."""
        _ip("-n", self.switch, "link", "set", self.host(name).port, "down")

    def heal(self, name: str) -> None:
        _ip("-n", self.switch, "link", "set", self.host(name).port, "up")

    def impair(self, name: str, delay_ms: float = 0.0, loss_pct: float = 0.0) -> None:
        """``tc netem`` on both directions of host ``name``'s link (half the delay each way)."""
        if delay_ms < 0 or not 0 <= loss_pct <= 100:
            raise ValueError(f"delay_ms must be >= 0 and loss_pct in [0, 100], got {delay_ms}, {loss_pct}")
        h = self.host(name)
        netem = ["netem", "delay", f"{delay_ms / 2:g}ms", "loss", f"{loss_pct / 2:g}%"]
        for ns, dev in ((self.switch, h.port), (h.namespace, "eth0")):
            subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *netem], check=True,
                           capture_output=True, timeout=30)

    def unimpair(self, name: str) -> None:
        h = self.host(name)
        for ns, dev in ((self.switch, h.port), (h.namespace, "eth0")):
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False, capture_output=True,
                           timeout=30)

    def kill_host(self, name: str) -> list[int]:
        """SIGKILL to every process in host ``name``'s namespace (a host that dies); returns their pids."""
        return _kill_namespace(self.host(name).namespace)
