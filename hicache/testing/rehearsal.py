"""The rehearsal cluster: a Ray cluster whose hosts have their own addresses, on one machine (root only).

Hosts (``hicache.testing.netns``, one network namespace each, on a private /24):

* ``head``: the Ray head node (GCS) with the ``hicache_head`` resource: the replicas' head actors;
* ``tpu0``, ``tpu1`` (``RehearsalOptions.tpu_hosts``): TPU-host stand-ins, Ray nodes with one
  ``hicache_host`` each, where a replica's host workers run (fake CPU devices, gloo collectives);
* ``storage``: the GCS emulator (``gcp-storage-emulator``, in memory) on its own address: L3 at ``gs://``;
* ``client``: a Ray node with no CPUs where serving processes and ``hicache up`` run as drivers.

How the Ray nodes start (``RehearsalOptions.launcher``): ``Launcher.RAY_START`` runs ``ray start`` in each
host's namespace; ``Launcher.RAY_UP`` brings the head and TPU hosts up with ``ray up`` of
``ray_configs/rehearsal.yaml`` over SSH (``hicache.testing.ray_up``: token auth on, a TPU host whose node
dies is started again by the head's autoscaler once its sshd is back), the client host joining with
``ray start``. Every Ray node has its own ``--node-ip-address`` and its own temp dir (``RAY_TMPDIR`` too, so no
``/tmp/ray`` file of this machine's other clusters is touched). Ray's loopback-only switch
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``) is removed from every process started in the namespaces:
with it Ray would bind 127.0.0.1 there. Drivers run as subprocesses in a host's namespace
(``driver``/``python``): this machine's own namespace has no route to the cluster.

Ownership: ``RehearsalCluster`` owns its ``NamespaceNetwork`` and through it every process it
started; ``close()`` (``__exit__``) removes all of it (see ``netns``). One cluster per test module or
benchmark run: starting one costs a Ray head plus three nodes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from hicache.testing import ray_up
from hicache.testing.netns import DEFAULT_SUBNET, NamespaceNetwork

RAY_PORT = 6379
EMULATOR_PORT = 9023
BUCKET = "hicache-rehearsal"
# Each host's own address, for its drivers' ``ray.init(_node_ip_address=...)`` (``connect_driver``): the
# namespaces share one process table, so Ray's driver would otherwise join the head's raylet (it
# finds every raylet of the machine with ``ps`` and prefers the head), wherever it runs.
NODE_IP_ENV = "HICACHE_REHEARSAL_NODE_IP"
HEAD, STORAGE, CLIENT = "head", "storage", "client"
# Dropped from the namespaces' environment: each would pin Ray (or a driver) to this machine's own cluster.
_DROPPED_ENV = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS", "RAY_TMPDIR", "TMPDIR",
                "STORAGE_EMULATOR_HOST", "PYTEST_CURRENT_TEST")


class Launcher(str, Enum):
    """How the rehearsal's Ray nodes are started (module docstring)."""

    RAY_START = "ray_start"
    RAY_UP = "ray_up"


@dataclass(frozen=True)
class RehearsalOptions:
    tpu_hosts: int = 2
    devices_per_host: int = 2  # fake CPU devices of each TPU-host stand-in's worker processes
    cpus_per_host: int = 2  # Ray CPUs of each TPU-host node
    subnet: str = DEFAULT_SUBNET
    object_store_bytes: int = 80 * 1024 * 1024  # per node: the drills move KiB, not GiB
    start_timeout_s: float = 120.0  # per ``ray start`` and for the emulator
    extra_env: Mapping[str, str] | None = None  # added to every namespace process's environment
    launcher: Launcher = Launcher.RAY_START  # RAY_UP: tpu_hosts and subnet must be ray_configs/rehearsal.yaml's

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "launcher", Launcher(self.launcher))
        except ValueError:
            raise ValueError(f"launcher must be one of {[m.value for m in Launcher]}, got {self.launcher!r}") from None
        if type(self.tpu_hosts) is not int or not 1 <= self.tpu_hosts <= 8:
            raise ValueError(f"tpu_hosts must be an int in [1, 8], got {self.tpu_hosts!r}")
        if type(self.devices_per_host) is not int or self.devices_per_host < 1:
            raise ValueError(f"devices_per_host must be an int >= 1, got {self.devices_per_host!r}")
        if not self.start_timeout_s > 0:
            raise ValueError(f"start_timeout_s must be > 0, got {self.start_timeout_s}")


def tpu_host_names(n: int) -> list[str]:
    return [f"tpu{i}" for i in range(n)]


class RehearsalCluster:
    """See the module docstring. ``with RehearsalCluster() as rc: rc.python(CLIENT, code)``."""

    def __init__(self, options: RehearsalOptions = RehearsalOptions()) -> None:
        self.options = options
        self.tpu_hosts = tpu_host_names(options.tpu_hosts)
        self.net = NamespaceNetwork([HEAD, *self.tpu_hosts, STORAGE, CLIENT], options.subnet)
        self.start_s: dict[str, float] = {}  # what each start step took (benchmarks report it)
        self._up: ray_up.RayUpLauncher | None = None
        if options.launcher is Launcher.RAY_UP:
            config = ray_up.load_config()
            if ray_up.tpu_hosts(config) != self.tpu_hosts:
                raise ValueError(f"launcher ray_up brings up the TPU hosts of {ray_up.REHEARSAL_CONFIG} "
                                 f"({ray_up.tpu_hosts(config)}), not {self.tpu_hosts}")
            self._up = ray_up.RayUpLauncher(self.net, config, host_env=self._node_env)  # checks the addresses

    # -- addresses -------------------------------------------------------------------------------------------
    def address(self, host: str) -> str:
        return self.net.address(host)

    @property
    def ray_address(self) -> str:
        return f"{self.address(HEAD)}:{RAY_PORT}"

    @property
    def gcs_url(self) -> str:
        return f"gs://{BUCKET}"

    @property
    def emulator_url(self) -> str:
        return f"http://{self.address(STORAGE)}:{EMULATOR_PORT}"

    def env(self, host: str, **extra: str) -> dict[str, str]:
        """The environment of a process on ``host``: this one's, minus what pins it to this machine's
        Ray, plus the rehearsal's Ray address, L3 emulator and JAX settings."""
        env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
        scratch = os.path.join(self.net.host_dir(host), "tmp")
        os.makedirs(scratch, exist_ok=True)
        env.update({
            "RAY_TMPDIR": scratch, "TMPDIR": scratch, "RAY_ADDRESS": self.ray_address,
            "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": env.get("RAY_AUTH_MODE", "disabled"),
            "STORAGE_EMULATOR_HOST": self.emulator_url, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={self.options.devices_per_host}",
            "PYTHONUNBUFFERED": "1", NODE_IP_ENV: self.address(host),
            # a rebuilt gang compiles what the lost one did: JAX's persistent cache (as on TPU hosts) keeps
            # that short, so a first forward does not outlast the workers' call timeouts
            "JAX_COMPILATION_CACHE_DIR": os.path.join(self.net.workdir, "jax-cache"),
        })
        if self._up is not None:
            env.update(self._up.auth_env())
        env.update(self.options.extra_env or {})
        env.update(extra)
        return env

    def _node_env(self, host: str) -> dict[str, str]:
        """What ``env`` adds to this process's environment: a ray-up host's login environment (``ray_up``)."""
        return {k: v for k, v in self.env(host).items() if os.environ.get(k) != v}

    # -- lifecycle -------------------------------------------------------------------------------------------
    def __enter__(self) -> RehearsalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.net.close()
        if self._up is not None:
            self._up.cleanup()

    def start(self) -> RehearsalCluster:
        t0 = time.monotonic()
        self.net.open()
        try:
            self.start_s["network"] = time.monotonic() - t0
            emulator = self._start_emulator()
            if self._up is not None:
                self._start_with_ray_up()
            else:
                self._start_with_ray_start()
            self._wait_emulator(emulator)
            self.start_s["total"] = time.monotonic() - t0
        except BaseException:
            self.close()
            raise
        return self

    def _start_with_ray_up(self) -> None:
        assert self._up is not None
        t = time.monotonic()
        self._up.start()  # the head and TPU hosts, until every TPU host joined
        self.start_s["ray_up"] = time.monotonic() - t
        t = time.monotonic()
        self._ray_start(CLIENT)
        self.start_s["ray_nodes"] = time.monotonic() - t

    def _start_with_ray_start(self) -> None:
        t = time.monotonic()
        self._ray_start(HEAD, head=True)
        self.start_s["ray_head"] = time.monotonic() - t
        t = time.monotonic()
        joins = [self._ray_start_async(h) for h in [*self.tpu_hosts, CLIENT]]
        failed = []
        for host, proc in joins:
            try:
                self._wait_ray_start(host, proc)
            except RuntimeError:  # Ray waits 30 s (fixed) for a raylet to register: a loaded box misses it
                failed.append(host)
        for host in failed:  # once more, one at a time, from a clean namespace
            self.net.kill_host(host)
            self._ray_start(host)
        self.start_s["ray_nodes"] = time.monotonic() - t

    def _ray_argv(self, host: str, head: bool) -> list[str]:
        a = self.address(host)
        argv = [sys.executable, "-m", "ray.scripts.scripts", "start", f"--node-ip-address={a}",
                f"--temp-dir={os.path.join(self.net.host_dir(host), 'ray')}",
                f"--object-store-memory={self.options.object_store_bytes}", "--disable-usage-stats"]
        if head:
            return argv + ["--head", f"--port={RAY_PORT}", "--num-cpus=1", "--include-dashboard=false",
                           '--resources={"hicache_head": 1}']
        argv.append(f"--address={self.ray_address}")
        if host == CLIENT:
            return argv + ["--num-cpus=0"]
        return argv + [f"--num-cpus={self.options.cpus_per_host}", '--resources={"hicache_host": 1}']

    def _ray_start_async(self, host: str) -> tuple[str, subprocess.Popen[str]]:
        proc = self.net.popen(host, self._ray_argv(host, head=False), self.env(host), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        return host, proc

    def _wait_ray_start(self, host: str, proc: subprocess.Popen[str]) -> None:
        try:
            out, _ = proc.communicate(timeout=self.options.start_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise TimeoutError(f"ray start on {host} did not finish within {self.options.start_timeout_s}s") from None
        if proc.returncode != 0:
            raise RuntimeError(f"ray start on {host} exited {proc.returncode}:\n{out[-4000:]}")

    def _ray_start(self, host: str, head: bool = False, attempts: int = 2) -> None:
        for attempt in range(attempts):
            proc = self.net.popen(host, self._ray_argv(host, head), self.env(host), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
            try:
                self._wait_ray_start(host, proc)
                return
            except RuntimeError:  # see start(): a raylet that did not register in Ray's fixed 30 s
                if attempt == attempts - 1:
                    raise
                self.net.kill_host(host)

    def restart_node(self, host: str) -> None:
        """Starts ``host``'s Ray node again (after ``kill_host``): a TPU host that rebooted. Launched by
        ``ray up``: its sshd starts again and the head's autoscaler starts its node over SSH (returns at once)."""
        if self._up is not None and host in self.tpu_hosts:
            self._up.start_sshd(host)
        elif self._up is not None and host == HEAD:
            raise ValueError("the head of a ray-up rehearsal starts through `ray up` only")
        else:
            self._ray_start(host)

    def restart_emulator(self) -> None:
        """Starts the GCS emulator again (after ``kill_host(STORAGE)``); it starts empty (in memory)."""
        self._wait_emulator(self._start_emulator())

    def _start_emulator(self) -> subprocess.Popen[bytes]:
        code = "import sys; from gcp_storage_emulator.__main__ import main; sys.exit(main())"
        log = open(os.path.join(self.net.host_dir(STORAGE), "emulator.log"), "ab")
        try:
            return self.net.popen(STORAGE, [sys.executable, "-c", code, "start", "--host", self.address(STORAGE),
                                            "--port", str(EMULATOR_PORT), "--in-memory", "--default-bucket", BUCKET],
                                  self.env(STORAGE), stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()

    def _wait_emulator(self, proc: subprocess.Popen[bytes]) -> None:
        """Setup, not synchronisation of code under test: waits (bounded) until the emulator accepts."""
        probe = (f"import socket, time\nd = time.monotonic() + {self.options.start_timeout_s}\n"
                 "while True:\n"
                 f"    try: socket.create_connection(({self.address(STORAGE)!r}, {EMULATOR_PORT}), 1).close(); break\n"
                 "    except OSError:\n"
                 "        if time.monotonic() > d: raise\n"
                 "        time.sleep(0.1)\n")
        self.net.run(CLIENT, [sys.executable, "-c", probe], self.env(CLIENT), timeout_s=self.options.start_timeout_s + 5)
        if proc.poll() is not None:
            raise RuntimeError(f"the GCS emulator exited {proc.returncode}")

    # -- drivers ---------------------------------------------------------------------------------------------
    def python(self, host: str, code: str, *, timeout_s: float = 300.0, env: Mapping[str, str] | None = None,
               args: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
        """Runs ``python -c code args`` on ``host`` (raises with its output when it fails)."""
        return self.net.run(host, [sys.executable, "-c", code, *args], self.env(host, **(env or {})),
                            timeout_s=timeout_s)

    def module(self, host: str, module: str, args: Sequence[str] = (), *, timeout_s: float = 300.0,
               env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Runs ``python -m module args`` on ``host``."""
        return self.net.run(host, [sys.executable, "-m", module, *args], self.env(host, **(env or {})),
                            timeout_s=timeout_s)

    def driver_popen(self, host: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
                     stdin: int | None = None) -> subprocess.Popen[str]:
        """Starts ``python argv`` on ``host`` without waiting: stdout piped (text), stderr to
        ``stderr_path`` (a file: nobody has to drain it while the driver runs)."""
        path = self.stderr_path(host)
        with open(path, "a") as err:
            return self.net.popen(host, [sys.executable, *argv], self.env(host, **(env or {})), stdin=stdin,
                                  stdout=subprocess.PIPE, stderr=err, text=True)

    def stderr_path(self, host: str) -> str:
        return os.path.join(self.net.host_dir(host), "drivers.stderr")


def last_json_line(out: str) -> Any:
    """The last line of ``out`` that parses as JSON (drivers print their result last)."""
    for line in reversed(out.splitlines()):
        line = line.strip()
        if line.startswith(("{", "[")):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    raise ValueError(f"no JSON line in the driver's output:\n{out[-2000:]}")


def reachable(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether a TCP connection to ``host:port`` opens from the calling namespace."""
    try:
        socket.create_connection((host, port), timeout_s).close()
        return True
    except OSError:
        return False


def connect_driver(namespace: str = "hicache") -> Any:
    """``ray.init`` for a driver started by ``RehearsalCluster`` (its host's raylet: ``NODE_IP_ENV``)."""
    import ray

    if not ray.is_initialized():
        ray.init(address="auto", namespace=namespace, log_to_driver=False,
                 _node_ip_address=os.environ.get(NODE_IP_ENV))
    return ray
