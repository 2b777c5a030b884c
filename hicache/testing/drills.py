"""Fault drills on a rehearsal cluster: a served workload from the client host while a host fails.

A drill starts ``hicache.testing.drivers serve --drill`` on the client host (the reference engine in
the replica's host workers, every output compared with the no-cache reference), waits until the
driver has served the warm half, injects its fault, lets the driver go on, reacts to the driver's
first failed request (``on_failure``: e.g. heal a partition) and undoes what is left (``cleanup``,
also when the drill fails). The driver's last line becomes a ``DrillResult``.

Drills (issue #25, item 4): ``kill_host`` (kill -9 every process of one TPU host, which then reboots:
its Ray node starts again), ``partition_host`` (one TPU host's link down until a request failed,
i.e. longer than the call timeouts, then up), ``impair_storage`` (50 ms delay and 1% loss on the
storage host's link), ``storage_down`` (the GCS emulator's host killed), ``partition_client``
(the client host cut off the cluster until its request failed, then back).

Runs in the caller's process and thread (the test or ``benchmarks/drills.py``); one drill at a time
per cluster. Every wait is bounded by ``deadline_s``.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml

from hicache.testing import netns
from hicache.testing.rehearsal import CLIENT, STORAGE, RehearsalCluster

Action = Callable[[RehearsalCluster], object]  # what it returns is ignored


def _nothing(rc: RehearsalCluster) -> None:
    pass


@dataclass(frozen=True)
class Drill:
    name: str
    inject: Action  # right after the driver was told to go on (its next requests meet the fault)
    on_failure: Action = _nothing  # when the driver reports its first failed request
    cleanup: Action = _nothing  # after the driver finished (or the drill failed): undo what is left
    expect_failures: bool = True  # the fault must make at least one request fail (else it did not bite)
    unavailable: Callable[[], str | None] = lambda: None  # why this machine cannot inject it (None: it can)


@dataclass(frozen=True)
class DrillResult:
    name: str
    wrong_outputs: int
    max_blocked_s: float  # the longest request attempt after the fault (each bounded by the call timeouts)
    recomputed_requests: int  # served after the fault without any reuse
    recovery_s: float | None  # fault -> first request served with hits after the last failure
    failures: int  # request attempts that failed (and were redone)
    requests: int
    storage_hit_requests: int = 0  # served after the fault with KV fetched from L3 (on the storage host)
    driver: dict[str, Any] = field(default_factory=dict, compare=False)

    def as_record(self) -> dict[str, Any]:
        return {"name": self.name, "wrong_outputs": self.wrong_outputs, "max_blocked_s": self.max_blocked_s,
                "recomputed_requests": self.recomputed_requests, "recovery_s": self.recovery_s,
                "failures": self.failures, "requests": self.requests, "storage_hit_requests": self.storage_hit_requests}


def kill_host(host: str = "tpu1") -> Drill:
    def inject(rc: RehearsalCluster) -> None:
        rc.net.kill_host(host)
        rc.restart_node(host)  # the host reboots: the replica needs its bundle back to serve again

    return Drill(f"kill_{host}", inject)


def partition_host(host: str = "tpu1") -> Drill:
    return Drill(f"partition_{host}", lambda rc: rc.net.partition(host), lambda rc: rc.net.heal(host),
                 lambda rc: rc.net.heal(host))


def impair_storage(delay_ms: float = 50.0, loss_pct: float = 1.0) -> Drill:
    return Drill("netem_storage", lambda rc: rc.net.impair(STORAGE, delay_ms, loss_pct),
                 cleanup=lambda rc: rc.net.unimpair(STORAGE), expect_failures=False,
                 unavailable=netns.netem_unavailable_reason)


def storage_down() -> Drill:
    def restart(rc: RehearsalCluster) -> None:
        rc.restart_emulator()

    return Drill("storage_down", lambda rc: rc.net.kill_host(STORAGE), cleanup=restart, expect_failures=False)


def partition_client() -> Drill:
    return Drill("partition_client", lambda rc: rc.net.partition(CLIENT), lambda rc: rc.net.heal(CLIENT),
                 lambda rc: rc.net.heal(CLIENT))


ALL = (kill_host, partition_host, impair_storage, storage_down, partition_client)


# -- the replica the drills serve ------------------------------------------------------------------------
def replica_yaml(rc: RehearsalCluster, replica: str, call_timeout_s: float) -> str:
    """A replica file for ``hicache up``: 2 TPU hosts x 2 fake devices, L1 + L2, L3 on the emulator."""
    config = {
        "replica": replica, "page_size": 4, "l1_pages": 96, "l2_slots": 512, "detached": True,
        "model": {"num_layers": 2, "num_kv_heads": 4, "head_dim": 8, "dtype": "float32"},
        "workers": {"platform": "cpu", "num_hosts": len(rc.tpu_hosts), "devices_per_host": rc.options.devices_per_host,
                    "start_timeout_s": 90, "call_timeout_s": call_timeout_s},
        "l3": {"url": f"{rc.gcs_url}/up", "model_id": "rehearsal", "prefetch_min_tokens": 4,
               "storage": {"pages_per_object": 2, "storage_options": {"token": "anon"}}},
    }
    path = os.path.join(rc.net.workdir, f"replica-{replica}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return path


def hicache_up(rc: RehearsalCluster, replica: str, call_timeout_s: float, timeout_s: float = 240.0) -> None:
    """``hicache up`` from the client host, as an operator would run it against the head's address."""
    rc.module(CLIENT, "hicache", ["up", "--address", rc.ray_address, "--config", replica_yaml(rc, replica, call_timeout_s),
                                  "--timeout", str(int(timeout_s - 30))], timeout_s=timeout_s)


# -- running one ----------------------------------------------------------------------------------------
class _Lines:
    """The driver's stdout, line by line, read by a thread so every wait here has a timeout."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self._q: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(proc,), daemon=True).start()

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._q.put(line)
        self._q.put(None)

    def next_json(self, deadline: float) -> dict[str, Any] | None:
        """The driver's next JSON line; None at its end. ``TimeoutError`` past ``deadline``."""
        while True:
            try:
                line = self._q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError("the drill driver said nothing before the deadline") from None
            if line is None:
                return None
            self.seen.append(line)
            if line.startswith("{"):
                return json.loads(line)


def _tail(rc: RehearsalCluster) -> str:
    with open(rc.stderr_path(CLIENT)) as f:
        return f.read()[-4000:]


def run_drill(rc: RehearsalCluster, replica: str, drill: Drill, *, timeout_s: float = 10.0,
              deadline_s: float = 240.0, conversations: int = 3, turns: int = 4, seed: int = 0,
              wait_for_l3: bool = False) -> DrillResult:
    """Runs ``drill`` against ``replica`` (see the module docstring); raises if the driver fails.
    ``wait_for_l3``: the driver's requests wait for L3 (see ``ServedReplica``), for a drill that asserts
    L3 hits on a box where the cost model might rightly prefer recompute."""
    argv = ["-m", "hicache.testing.drivers", "serve", "--replica", replica, "--gs-url", rc.gcs_url, "--drill",
            "--timeout", str(timeout_s), "--deadline", str(deadline_s * 0.8), "--conversations", str(conversations),
            "--turns", str(turns), "--seed", str(seed), *(["--wait-for-l3"] if wait_for_l3 else [])]
    proc = rc.driver_popen(CLIENT, argv, stdin=subprocess.PIPE)
    lines = _Lines(proc)
    deadline = time.monotonic() + deadline_s
    result: dict[str, Any] | None = None
    try:
        first = lines.next_json(deadline)
        if first is None or first.get("event") != "warm":
            raise RuntimeError(f"drill {drill.name}: the driver did not get warm: {first}\n{_tail(rc)}")
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        drill.inject(rc)
        while (msg := lines.next_json(deadline)) is not None:
            if msg.get("event") == "failed":
                drill.on_failure(rc)
            elif "event" not in msg:
                result = msg
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        drill.cleanup(rc)
    if result is None or proc.returncode != 0:
        raise RuntimeError(f"drill {drill.name}: driver exited {proc.returncode}\n{''.join(lines.seen)[-2000:]}\n{_tail(rc)}")
    return DrillResult(drill.name, result["wrong_outputs"], result["max_blocked_s"], result["recomputed_requests"],
                       result["recovery_s"], result["failures"], result["requests"],
                       result.get("storage_hit_requests", 0), result)
