"""``ray up`` on hosts with their own addresses: Ray's local node provider over SSH, in network
namespaces (root only; ``python -m hicache.testing.ray_up`` brings one up, prints its nodes, tears it down).

The same launcher path as the TPU configs (``ray up`` -> SSH to the head -> start commands -> the head's
autoscaler SSHes to each worker host and starts its node), driven by the checked-in cluster file
``ray_configs/rehearsal.yaml`` (its addresses must be the ones the network gives: ``check_addresses``;
the harness only sets ``cluster_name``). ``RayUpLauncher`` does it on a ``NamespaceNetwork`` that has the
file's head and TPU hosts and a client host from which ``ray up`` runs (``RayUpCluster``: exactly those;
``RehearsalCluster`` with ``Launcher.RAY_UP``: the rehearsal's hosts). Each head/TPU host runs its own
``sshd`` (Debian's openssh-server) on its own address only, with a host key, one authorized key and a
config written under the network's workdir; token auth is on (``ray get-auth-token --generate`` on the
client host, copied to the nodes by the file's ``file_mounts``).

Why each ``sshd`` runs in a private mount namespace with the host's own directory bound over ``/root``:
``ray up`` copies ``~/ray_bootstrap_config.yaml``, ``~/ray_bootstrap_key.pem`` and the token to the head,
and the head's autoscaler passes ``-i ~/ray_bootstrap_key.pem`` to ``ssh``, which expands ``~`` from the
passwd entry (not ``$HOME``); so what runs over SSH must see a ``/root`` of its own, or it would write into
this machine's. The folder of /root that holds this Python (``.pyenv`` here) is bound back into it. That
``/root`` holds a ``.bashrc`` (Ray's command runner sources it) that puts this venv's ``ray`` first on
PATH and exports the host's environment (``RAY_TMPDIR``: a folder of its own under the workdir, where its
Ray node keeps its files; ``host_env``: e.g. the rehearsal's JAX/L3 settings).

Findings this encodes (Ray 2.60): the local provider refuses ``available_node_types``
(top-level ``min_workers``/``max_workers`` only); its head must run the v1 autoscaler
(``RAY_enable_autoscaler_v2=0``), the v2 one never launches the worker hosts; the start commands never
run ``ray stop`` (it would kill every Ray process on this machine, other clusters' included).

Ownership: the caller owns the network (every namespace, link and process: ``sshd``, every Ray process
started over SSH) and its workdir, where the hosts' homes and temp folders are (the provider's cluster
state too: ``RAY_TMPDIR`` of ``ray up``); the launcher owns what Ray's launcher leaves outside it (the SSH
control directory), removed by ``cleanup()``, also on failure. Everything here runs in the calling
process, once.
"""

from __future__ import annotations

import copy
import hashlib
import ipaddress
import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from getpass import getuser
from pathlib import Path
from typing import Any

import yaml

from hicache.testing.netns import NamespaceNetwork

HEAD, CLIENT = "head", "client"
RAY_PORT = 6379
REHEARSAL_CONFIG = Path(__file__).resolve().parents[2] / "ray_configs" / "rehearsal.yaml"
HostEnv = Callable[[str], Mapping[str, str]]  # a host's environment for what runs there over SSH


@dataclass(frozen=True)
class RayUpOptions:
    config_path: str = str(REHEARSAL_CONFIG)
    up_timeout_s: float = 300.0  # `ray up` (the head over SSH)
    join_timeout_s: float = 240.0  # until the autoscaler has started every TPU host's node over SSH

    def __post_init__(self) -> None:
        for name in ("up_timeout_s", "join_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def ray_up_unavailable_reason() -> str | None:
    """Why ``RayUpLauncher`` cannot run here (None: it can), besides namespaces themselves."""
    for tool in ("sshd", "ssh", "ssh-keygen", "rsync", "unshare", "mount", "hostname"):
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            return f"{tool} not installed (apt-get install openssh-server rsync)"
    return None


def load_config(path: str | os.PathLike[str] = REHEARSAL_CONFIG) -> dict[str, Any]:
    """The cluster file at ``path``; ``ValueError`` naming what is missing when it is not a local-provider
    file with a head address, worker addresses and an SSH key."""
    with open(path) as f:
        config = yaml.safe_load(f)
    provider = config.get("provider") if isinstance(config, dict) else None
    if not isinstance(provider, dict) or provider.get("type") != "local":
        raise ValueError(f"{path}: not a cluster file of Ray's local provider (provider.type: local)")
    ips = provider.get("worker_ips")
    if not isinstance(provider.get("head_ip"), str) or not isinstance(ips, list) or not ips:
        raise ValueError(f"{path}: provider.head_ip and a non-empty provider.worker_ips are required")
    key = (config.get("auth") or {}).get("ssh_private_key")
    if not isinstance(key, str) or not key.startswith("~/"):
        raise ValueError(f"{path}: auth.ssh_private_key must be a path under ~ (the client host's home), got {key!r}")
    return config


def tpu_hosts(config: Mapping[str, Any]) -> list[str]:
    """The TPU-host stand-ins of a cluster file: one per worker address, in order."""
    return [f"tpu{i}" for i in range(len(config["provider"]["worker_ips"]))]


def subnet(config: Mapping[str, Any]) -> str:
    """The /24 the file's head address is in (the network the harness builds)."""
    return str(ipaddress.ip_network(f"{config['provider']['head_ip']}/24", strict=False))


def check_addresses(config: Mapping[str, Any], net: NamespaceNetwork) -> None:
    """``ValueError`` unless ``net`` gives the file's head and TPU hosts exactly the file's addresses."""
    provider = config["provider"]
    want = {HEAD: provider["head_ip"], **dict(zip(tpu_hosts(config), provider["worker_ips"]))}
    got = {host: net.address(host) if host in net.hosts else None for host in want}
    if got != want:
        raise ValueError(f"the cluster file's addresses {want} are not the network's {got} "
                         f"(hosts in order: head, tpu0, tpu1, ...; subnet {net.subnet})")


def _python_dir_under_root() -> str | None:
    """The top folder of /root holding this Python's real executable (``.pyenv`` here), if any: what runs
    over SSH sees a /root of its own (module docstring), with only this folder bound back into it."""
    real = os.path.realpath(sys.executable)
    if not real.startswith("/root/"):
        return None
    return real[len("/root/"):].split("/", 1)[0]


class RayUpLauncher:
    """``ray up`` of ``config``'s head and TPU hosts on ``net`` (opened by the caller; see the module docstring)."""

    def __init__(self, net: NamespaceNetwork, config: Mapping[str, Any], host_env: HostEnv | None = None,
                 options: RayUpOptions = RayUpOptions()) -> None:
        check_addresses(config, net)
        if CLIENT not in net.hosts:
            raise ValueError(f"the network needs a {CLIENT!r} host to run `ray up` from; it has {sorted(net.hosts)}")
        self.net, self.config, self.options = net, config, options
        self.tpus = tpu_hosts(config)
        self.cluster_name = f"hc-{net.owner}"
        self.host_env: HostEnv = host_env or (lambda host: {})
        self.up_output = ""
        self.client_home = os.path.join(net.host_dir(CLIENT), "home")
        self.key = os.path.join(self.client_home, config["auth"]["ssh_private_key"][2:])
        self.token = os.path.join(self.client_home, ".ray", "auth_token")

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        """sshd on the head and TPU hosts, the token, ``ray up``, then waits until every TPU host joined."""
        self._keys()
        self._ray_shim()
        self._token()
        for host in [HEAD, *self.tpus]:
            self.start_sshd(host)
        self._ray_up()
        self._wait_joined()

    def cleanup(self) -> None:
        """Removes what Ray's launcher left outside the network's workdir (call after closing the network)."""
        control = self._ssh_control_dir()
        shutil.rmtree(control, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(control))  # only when no other cluster's is there
        except OSError:
            pass

    def auth_env(self) -> dict[str, str]:
        """What a process on any host needs to talk to this cluster (token auth)."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": self.token}

    # -- pieces ----------------------------------------------------------------------------------------
    def _keys(self) -> None:
        os.makedirs(os.path.dirname(self.key), exist_ok=True)
        for path in (self.key, os.path.join(self.net.workdir, "host_ed25519")):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", path], check=True, timeout=30)

    @property
    def _bin(self) -> str:
        return os.path.join(self.net.workdir, "bin")

    def _ray_shim(self) -> None:
        """``ray`` for the hosts' PATH: this venv's Python (its Ray and this worktree's hicache)."""
        os.makedirs(self._bin, exist_ok=True)
        path = os.path.join(self._bin, "ray")
        with open(path, "w") as f:
            f.write(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m ray.scripts.scripts \"$@\"\n")
        os.chmod(path, 0o755)

    def client_env(self) -> dict[str, str]:
        """``ray up`` and its drivers on the client host: its own HOME (the key, the token) and scratch."""
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
        scratch = os.path.join(self.net.host_dir(CLIENT), "tmp")
        os.makedirs(scratch, exist_ok=True)
        os.makedirs(self.client_home, exist_ok=True)
        # RAY_TMPDIR: `ray up` keeps the provider's cluster state there (not in this machine's /tmp/ray)
        env.update({"HOME": self.client_home, "TMPDIR": scratch, "RAY_TMPDIR": scratch, "RAY_USAGE_STATS_ENABLED": "0"})
        env.update(self.auth_env())
        return env

    def _token(self) -> None:
        # without RAY_AUTH_TOKEN_PATH (Ray refuses one that does not exist yet): it writes ~/.ray/auth_token
        env = {k: v for k, v in self.client_env().items() if k != "RAY_AUTH_TOKEN_PATH"}
        self.net.run(CLIENT, [sys.executable, "-m", "ray.scripts.scripts", "get-auth-token", "--generate"], env,
                     timeout_s=120)
        if not os.path.isfile(self.token):
            raise RuntimeError(f"`ray get-auth-token --generate` wrote no {self.token}")

    def _bashrc(self, host: str) -> str:
        """The host's login environment: this venv's ``ray`` first on PATH, a temp folder of its own (Ray's
        files of each host apart, at paths every namespace sees), then ``host_env``."""
        scratch = os.path.join(self.net.host_dir(host), "tmp")
        os.makedirs(scratch, exist_ok=True)
        env = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": scratch, **self.host_env(host)}
        lines = [f"export PATH={shlex.quote(self._bin)}:\"$PATH\""]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items() if k not in ("PATH", "HOME")]
        return "\n".join(lines) + "\n"

    def start_sshd(self, host: str) -> None:
        """Starts ``host``'s sshd (also after ``kill_host``: the host rebooted; the head's autoscaler then
        starts its Ray node again over SSH)."""
        home = os.path.join(self.net.host_dir(host), "home")  # this host's /root (module docstring)
        os.makedirs(home, exist_ok=True)
        with open(os.path.join(home, ".bashrc"), "w") as f:
            f.write(self._bashrc(host))
        config = os.path.join(self.net.host_dir(host), "sshd_config")
        with open(config, "w") as f:
            f.write(textwrap.dedent(f"""\
                ListenAddress {self.net.address(host)}
                Port 22
                HostKey {self.net.workdir}/host_ed25519
                PidFile {self.net.host_dir(host)}/sshd.pid
                AuthorizedKeysFile {self.key}.pub
                PermitRootLogin prohibit-password
                PasswordAuthentication no
                KbdInteractiveAuthentication no
                UsePAM no
                StrictModes no
                """))
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        with open(os.path.join(self.net.host_dir(host), "sshd.log"), "a") as log:
            self.net.popen(host, self._with_own_root(host, [sshd, "-D", "-e", "-f", config]), stdout=log,
                           stderr=subprocess.STDOUT)

    def _with_own_root(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` in a private mount namespace where ``/root`` is ``host``'s own home (module docstring)."""
        home = os.path.join(self.net.host_dir(host), "home")
        os.makedirs(home, exist_ok=True)
        keep = _python_dir_under_root()
        script = (f"mkdir -p {home}/{keep} && mount --bind /root/{keep} {home}/{keep} && " if keep else "") + \
            f'mount --rbind {home} /root && exec "$@"'
        return ["unshare", "--mount", "sh", "-c", script, "sh", *argv]

    def cluster_config(self) -> dict[str, Any]:
        """The file as ``ray up`` gets it: ``cluster_name`` set to this run's (module docstring)."""
        config = copy.deepcopy(dict(self.config))
        config["cluster_name"] = self.cluster_name
        return config

    def _ray_up(self) -> None:
        path = os.path.join(self.net.workdir, "rehearsal.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(self.cluster_config(), f, sort_keys=False)
        # the client's own /root: ssh expands the file's ``-i ~/...`` from the passwd entry, not $HOME
        argv = self._with_own_root(CLIENT, [sys.executable, "-m", "ray.scripts.scripts", "up", "-y", "--no-config-cache", path])
        res = self.net.run(CLIENT, argv, self.client_env(), timeout_s=self.options.up_timeout_s, check=False)
        self.up_output = res.stdout + res.stderr
        if res.returncode != 0:
            raise RuntimeError(f"ray up exited {res.returncode}:\n{self.up_output[-4000:]}")

    def nodes(self) -> list[dict[str, Any]]:
        """The live Ray nodes, asked by a driver on the client host: address and resources."""
        code = ("import json, ray\n"
                f"ray.init(address='{self.net.address(HEAD)}:{RAY_PORT}', log_to_driver=False)\n"
                "print(json.dumps([{'ip': n['NodeManagerAddress'], 'resources': n['Resources']} "
                "for n in ray.nodes() if n['Alive']]))\n")
        res = self.net.run(CLIENT, [sys.executable, "-c", code], self.client_env(), timeout_s=120)
        out: list[dict[str, Any]] = json.loads(res.stdout.strip().splitlines()[-1])
        return out

    def _wait_joined(self) -> None:
        want = {self.net.address(h) for h in [HEAD, *self.tpus]}
        deadline = time.monotonic() + self.options.join_timeout_s
        while True:
            got = {n["ip"] for n in self.nodes()}
            if want <= got:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"nodes {sorted(want - got)} did not join within {self.options.join_timeout_s}s "
                                   f"(live: {sorted(got)}); the head's autoscaler log: "
                                   f"{self.net.host_dir(HEAD)}/tmp/ray/session_latest/logs/monitor.*")
            time.sleep(2.0)  # the head's autoscaler starts the hosts over SSH on its own schedule

    def _ssh_control_dir(self) -> str:
        """Where Ray's SSH command runner keeps this cluster's control sockets (its own naming)."""
        user = hashlib.sha256(getuser().encode()).hexdigest()[:10]
        return f"/tmp/ray_ssh_{user}/{hashlib.sha256(self.cluster_name.encode()).hexdigest()[:10]}"


class RayUpCluster:
    """The file's head and TPU hosts plus a client host, brought up with ``ray up``. Use as a context
    manager; ``nodes()`` lists the live Ray nodes. Owns its network and launcher."""

    def __init__(self, options: RayUpOptions = RayUpOptions()) -> None:
        self.options = options
        self.config = load_config(options.config_path)
        self.tpus = tpu_hosts(self.config)
        self.net = NamespaceNetwork([HEAD, *self.tpus, CLIENT], subnet(self.config))
        self.launcher = RayUpLauncher(self.net, self.config, options=options)
        self.cluster_name = self.launcher.cluster_name

    def __enter__(self) -> RayUpCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> RayUpCluster:
        self.net.open()
        try:
            self.launcher.start()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        self.net.close()  # kills sshd and every Ray process started over SSH, deletes the workdir
        self.launcher.cleanup()

    def nodes(self) -> list[dict[str, Any]]:
        return self.launcher.nodes()


def main() -> int:
    with RayUpCluster() as rc:
        print(json.dumps({"nodes": rc.nodes()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
