"""What a benchmark's times are measured on: wall time (``ServePhases``) or this process's CPU time,
every thread (``time.process_time``: the work done, whatever other processes take from a shared
machine), and the CPU each thread group spent (``thread_cpu_s``: serving thread, storage threads, XLA's
native threads).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from benchmarks.workload import Served
from hicache.reference.serve_types import ServeRequest, ServeResult

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def on_cpu_clock(serve: Callable[..., ServeResult]) -> Callable[[ServeRequest], ServeResult]:
    """``serve(req, between_steps)`` (``Scheduler.serve``, ``BareEngine.serve``) with its TTFT and
    latency in this process's CPU time, every thread (``time.process_time``): from the call to the
    first ``between_steps()`` (it runs right after the first token) and to the return. Background
    threads' CPU in that window counts. The phases stay wall time (``on_wall_clock`` reads them)."""
    def serve_on_cpu(req: ServeRequest) -> ServeResult:
        first: list[float] = []

        def after_token() -> None:
            if not first:
                first.append(time.process_time())
        t0 = time.process_time()
        res = serve(req, after_token)
        end = time.process_time()
        return replace(res, ttft_s=(first[0] if first else end) - t0, latency_s=end - t0)
    return serve_on_cpu


def on_wall_clock(served: Sequence[Served], drains: Sequence[float] = (), segment: int = 1) -> list[Served]:
    """``served`` with each TTFT and latency the wall time of its phases (``ServePhases``: the TTFT is
    the phases up to the first token, the latency all of them), and ``drains[j]`` (wall seconds)
    added to the latency of the last request of segment ``j`` (as ``serve_segments`` charges them)."""
    out = []
    for i, s in enumerate(served):
        p = s.result.phases
        ttft = p.match + p.l3 + p.load_back + p.prefill
        drained = drains[i // segment] if drains and (i % segment == segment - 1 or i == len(served) - 1) else 0.0
        out.append(Served(s.item, replace(s.result, ttft_s=ttft, latency_s=ttft + p.decode + p.finish + drained),
                          s.timing))
    return out


def thread_cpu_s() -> dict[int, tuple[str, float]]:
    """CPU seconds each thread of this process has run so far (Linux ``schedstat``, ns resolution),
    by native thread id, with a group name: ``serving`` (the calling thread), a Python thread's name
    without its index (``storage``, ``hicache-manifest``, ...), or ``native`` (threads Python did not
    start: XLA's executor threads, which run every dispatched forward and copy). Empty elsewhere."""
    root = f"/proc/{os.getpid()}/task"
    if not os.path.isdir(root):
        return {}
    me = threading.get_native_id()
    py = {t.native_id: t.name.rstrip("0123456789_-") for t in threading.enumerate() if t.native_id is not None}
    out = {}
    for tid in os.listdir(root):
        try:
            with open(f"{root}/{tid}/schedstat") as f:
                run_ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
        t = int(tid)
        out[t] = ("serving" if t == me else py.get(t, "native"), run_ns / 1e9)
    return out


def cpu_by_group(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per thread group between two ``thread_cpu_s`` snapshots (threads that ended in
    between are not counted)."""
    out: dict[str, float] = {}
    for tid, (group, run) in after.items():
        out[group] = out.get(group, 0.0) + run - before.get(tid, (group, 0.0))[1]
    return out
