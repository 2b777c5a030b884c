"""``ray up`` on hosts with their own addresses: Ray's local node provider over SSH, in network
namespaces (root only; ``python -m hicache.testing.ray_up`` brings one up, prints its nodes, tears it down).

The same launcher path as the TPU configs (``ray up`` -> SSH to the head -> setup and start commands ->
the head's autoscaler SSHes to each worker host and starts its node), on a ``NamespaceNetwork``: a head,
``tpu_hosts`` TPU-host stand-ins and a client host from which ``ray up`` runs. Each head/TPU host runs its
own ``sshd`` (Debian's openssh-server) on its own address only, with a host key, one authorized key and
a config that this object writes under the network's workdir.

Why each ``sshd`` runs in a private mount namespace with the host's own directory bound over ``/root``:
``ray up`` copies ``~/ray_bootstrap_config.yaml`` and ``~/ray_bootstrap_key.pem`` to the head, and the
head's autoscaler passes ``-i ~/ray_bootstrap_key.pem`` to ``ssh``, which expands ``~`` from the passwd
entry (not ``$HOME``); so what runs over SSH must see a ``/root`` of its own, or it would write into this
machine's. The folder of /root that holds this Python (``.pyenv`` here) is bound back into it.

Findings this encodes (Ray 2.60): the local provider refuses ``available_node_types``
(top-level ``min_workers``/``max_workers`` only); its head must run the v1 autoscaler
(``RAY_enable_autoscaler_v2=0``), the v2 one never launches the worker hosts; the start commands never
run ``ray stop`` (it would kill every Ray process on this machine, other clusters' included).

Ownership: this object owns the network (every namespace, link and process: ``sshd``, every Ray process
started over SSH) and the files Ray's launcher leaves outside the workdir (the provider's
``/tmp/ray/cluster-<name>.{state,lock}``, the SSH control directory); ``close()`` removes them all, also
on failure. Everything here runs in the calling process, once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from getpass import getuser
from typing import Any

import yaml

from hicache.testing.netns import NamespaceNetwork

HEAD, CLIENT = "head", "client"
RAY_PORT = 6379


@dataclass(frozen=True)
class RayUpOptions:
    tpu_hosts: int = 1
    subnet: str = "10.213.8.0/24"
    up_timeout_s: float = 300.0  # `ray up` (the head over SSH)
    join_timeout_s: float = 240.0  # until the autoscaler has started every TPU host's node over SSH

    def __post_init__(self) -> None:
        if self.tpu_hosts < 1:
            raise ValueError(f"tpu_hosts must be >= 1, got {self.tpu_hosts}")
        for name in ("up_timeout_s", "join_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def ray_up_unavailable_reason() -> str | None:
    """Why ``RayUpCluster`` cannot run here (None: it can), besides namespaces themselves."""
    for tool in ("sshd", "ssh", "ssh-keygen", "rsync", "unshare", "mount"):
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            return f"{tool} not installed (apt-get install openssh-server rsync)"
    return None


def _python_dir_under_root() -> str | None:
    """The top folder of /root holding this Python's real executable (``.pyenv`` here), if any: what runs
    over SSH sees a /root of its own (module docstring), with only this folder bound back into it."""
    real = os.path.realpath(sys.executable)
    if not real.startswith("/root/"):
        return None
    return real[len("/root/"):].split("/", 1)[0]


class RayUpCluster:
    """See the module docstring. Use as a context manager; ``nodes()`` lists the live Ray nodes."""

    def __init__(self, options: RayUpOptions = RayUpOptions()) -> None:
        self.options = options
        self.tpus = [f"tpu{i}" for i in range(options.tpu_hosts)]
        self.net = NamespaceNetwork([HEAD, *self.tpus, CLIENT], options.subnet)
        self.cluster_name = f"hc-{self.net.owner}"
        self.up_output = ""

    # -- lifecycle -------------------------------------------------------------------------------------
    def __enter__(self) -> RayUpCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> RayUpCluster:
        self.net.open()
        try:
            self._keys()
            for host in [HEAD, *self.tpus]:
                self._start_sshd(host)
            self._ray_up()
            self._wait_joined()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        self.net.close()  # kills sshd and every Ray process started over SSH, deletes the workdir
        for suffix in ("state", "lock"):
            try:
                os.remove(f"/tmp/ray/cluster-{self.cluster_name}.{suffix}")
            except FileNotFoundError:
                pass
        control = self._ssh_control_dir()
        shutil.rmtree(control, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(control))  # only when no other cluster's is there
        except OSError:
            pass

    # -- pieces ----------------------------------------------------------------------------------------
    @property
    def key(self) -> str:
        return os.path.join(self.net.workdir, "id_ed25519")

    def _keys(self) -> None:
        os.makedirs(self.net.workdir, exist_ok=True)
        for path in (self.key, os.path.join(self.net.workdir, "host_ed25519")):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", path], check=True, timeout=30)

    def _start_sshd(self, host: str) -> None:
        home = os.path.join(self.net.host_dir(host), "home")  # this host's /root (module docstring)
        os.makedirs(home, exist_ok=True)
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
        keep = _python_dir_under_root()
        script = (f"mkdir -p {home}/{keep} && mount --bind /root/{keep} {home}/{keep} && " if keep else "") + \
            f"mount --rbind {home} /root && exec {sshd} -D -e -f {config}"
        log = open(os.path.join(self.net.host_dir(host), "sshd.log"), "w")
        self.net.popen(host, ["unshare", "--mount", "sh", "-c", script], stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def cluster_config(self) -> dict[str, Any]:
        """The ``ray up`` file: local provider, this network's addresses, hicache's per-host resources."""
        start = f"RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled {sys.executable} -m ray.scripts.scripts start"
        head = self.net.address(HEAD)
        return {
            "cluster_name": self.cluster_name,
            "min_workers": len(self.tpus), "max_workers": len(self.tpus),
            "upscaling_speed": 1.0, "idle_timeout_minutes": 5,
            "provider": {"type": "local", "head_ip": head, "worker_ips": [self.net.address(t) for t in self.tpus]},
            "auth": {"ssh_user": "root", "ssh_private_key": self.key},
            "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
            "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [], "setup_commands": [],
            "head_setup_commands": [], "worker_setup_commands": [],
            # no `ray stop` (module docstring); each node its own temp dir (the hosts share this filesystem)
            "head_start_ray_commands": [
                f"RAY_enable_autoscaler_v2=0 {start} --head --node-ip-address={head} --port={RAY_PORT} --num-cpus=1 "
                f"--resources='{json.dumps({'hicache_head': 1})}' --include-dashboard=false "
                f"--temp-dir={self.net.host_dir(HEAD)}/ray --autoscaling-config=~/ray_bootstrap_config.yaml"],
            "worker_start_ray_commands": [
                f"{start} --address={head}:{RAY_PORT} --num-cpus=1 --resources='{json.dumps({'hicache_host': 1})}' "
                f"--temp-dir=$(mktemp -d {self.net.workdir}/worker-ray-XXXX)"],
        }

    def _client_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
        scratch = os.path.join(self.net.host_dir(CLIENT), "tmp")
        os.makedirs(scratch, exist_ok=True)
        env.update({"HOME": os.path.join(self.net.host_dir(CLIENT), "home"), "TMPDIR": scratch,
                    "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"})
        os.makedirs(env["HOME"], exist_ok=True)
        return env

    def _ray_up(self) -> None:
        path = os.path.join(self.net.workdir, "rehearsal.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(self.cluster_config(), f, sort_keys=False)
        res = self.net.run(CLIENT, [sys.executable, "-m", "ray.scripts.scripts", "up", "-y", "--no-config-cache", path],
                           self._client_env(), timeout_s=self.options.up_timeout_s, check=False)
        self.up_output = res.stdout + res.stderr
        if res.returncode != 0:
            raise RuntimeError(f"ray up exited {res.returncode}:\n{self.up_output[-4000:]}")

    def nodes(self) -> list[dict[str, Any]]:
        """The live Ray nodes, asked by a driver on the client host: address and resources."""
        code = ("import json, ray\n"
                f"ray.init(address='{self.net.address(HEAD)}:{RAY_PORT}', log_to_driver=False)\n"
                "print(json.dumps([{'ip': n['NodeManagerAddress'], 'resources': n['Resources']} "
                "for n in ray.nodes() if n['Alive']]))\n")
        res = self.net.run(CLIENT, [sys.executable, "-c", code], self._client_env(), timeout_s=120)
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
                                   f"{self.net.host_dir(HEAD)}/ray/session_latest/logs/monitor.*")
            time.sleep(2.0)  # the head's autoscaler starts the hosts over SSH on its own schedule

    def _ssh_control_dir(self) -> str:
        """Where Ray's SSH command runner keeps this cluster's control sockets (its own naming)."""
        user = hashlib.sha256(getuser().encode()).hexdigest()[:10]
        return f"/tmp/ray_ssh_{user}/{hashlib.sha256(self.cluster_name.encode()).hexdigest()[:10]}"


def main() -> int:
    with RayUpCluster() as rc:
        print(json.dumps({"nodes": rc.nodes()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
