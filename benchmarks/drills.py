"""Fault drills on the rehearsal cluster (root: network namespaces), issue #25 item 4.

One rehearsal cluster (``hicache.testing.rehearsal``: head, two TPU-host stand-ins, the GCS emulator's
storage host, a client host), one replica started with ``hicache up`` from the client host, then each
drill of ``hicache.testing.drills`` in turn: the reference engine serves a multi-turn workload from the
client host, every output compared with the no-cache reference, while one fault hits:

  kill_tpu1         kill -9 every process of TPU host 1, which then reboots (its Ray node starts again)
  partition_tpu1    TPU host 1's link down until a request failed (longer than the call timeouts), then up
  netem_storage     50 ms delay and 1% loss on the storage host's link (both ways, half each way)
  storage_down      the storage host's processes killed (L3 gone; started again, empty, afterwards)
  partition_client  the client host cut off until its request failed, then back

    sudo python benchmarks/drills.py --json drills.json [--only kill_tpu1 partition_tpu1] [--launcher ray_up]

``--launcher ray_up``: the head and TPU hosts come up through ``ray up ray_configs/rehearsal.yaml`` over SSH
(openssh-server needed), as a TPU slice does; a killed TPU host's node is then started again by the head's
autoscaler over SSH once the host's sshd is back (its recovery path), not by the harness.

The JSON: ``{"drills": [{"name", "wrong_outputs", "max_blocked_s", "recomputed_requests", "recovery_s",
"failures", "requests", "storage_hit_requests"}], "call_timeout_s", "driver_timeout_s", "rehearsal_start_s", "launcher"}``
(a drill this machine cannot inject, e.g. netem without the sch_netem qdisc, is ``{"name", "skipped": why}``); targets: 0 wrong
outputs, ``max_blocked_s`` <= the driver's per-call timeout + 1 s, a recovery after every fault.
"""

from __future__ import annotations

import argparse
import json
import time

from hicache.testing import drills
from hicache.testing.ray_up import ray_up_unavailable_reason
from hicache.testing.rehearsal import Launcher, RehearsalCluster, RehearsalOptions

REPLICA = "drills"
CALL_TIMEOUT_S = 10.0  # the head's bound on a host worker's ping/poll answer (a first forward compiles: seconds)
DRIVER_TIMEOUT_S = 12.0  # the serving client's bound on any call (engine and head)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--only", nargs="*", help="drill names (default: all)")
    parser.add_argument("--quick", action="store_true", help="2 conversations x 4 turns per drill")
    parser.add_argument("--launcher", choices=[m.value for m in Launcher], default=Launcher.RAY_START.value,
                        help="how the Ray nodes start: `ray start` per host, or `ray up` of ray_configs/rehearsal.yaml")
    args = parser.parse_args()
    launcher = Launcher(args.launcher)
    if launcher is Launcher.RAY_UP and (why := ray_up_unavailable_reason()) is not None:
        parser.error(f"--launcher ray_up: {why}")
    chosen = [make() for make in drills.ALL]
    if args.only:
        unknown = set(args.only) - {d.name for d in chosen}
        if unknown:
            parser.error(f"unknown drill(s) {sorted(unknown)}; known: {[d.name for d in chosen]}")
        chosen = [d for d in chosen if d.name in args.only]
    conversations = 2 if args.quick else 3
    records = []
    with RehearsalCluster(RehearsalOptions(launcher=launcher)) as rc:
        drills.hicache_up(rc, REPLICA, CALL_TIMEOUT_S)
        for i, drill in enumerate(chosen):
            reason = drill.unavailable()
            if reason is not None:
                print(json.dumps(rec := {"name": drill.name, "skipped": reason}), flush=True)
                records.append(rec)
                continue
            t = time.monotonic()
            res = drills.run_drill(rc, REPLICA, drill, timeout_s=DRIVER_TIMEOUT_S, conversations=conversations, seed=i)
            rec = res.as_record() | {"wall_s": round(time.monotonic() - t, 1)}
            print(json.dumps(rec), flush=True)
            records.append(rec)
        start_s = rc.start_s["total"]
    out = {"drills": records, "call_timeout_s": CALL_TIMEOUT_S, "driver_timeout_s": DRIVER_TIMEOUT_S,
           "rehearsal_start_s": round(start_s, 1), "launcher": launcher.value}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
