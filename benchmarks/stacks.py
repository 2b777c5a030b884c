"""The stacks a benchmark config runs on, and how requests reach them.

Everything runs in one process on the embedded default (``hicache.reference.stack``): each config is a
fresh stack (head + HostWorker + reference engine, L3 in a local directory) that reuses one set of
compiled params; ``BareEngine`` is the engine alone (never caches). Requests go one at a time in a
fixed order every config shares (``run_stack``; the reference run decides the stream), or through the
stack's ``ServingLoop`` in virtual time (``VirtualTimeRun``: the cache configs of the multiturn TTFT
phase): a virtual clock advances by each iteration's measured time; requests are submitted when the
clock passes their send time, so the real execution order follows the clock. ``ttft_*`` is seen from
the client (queue wait + service TTFT); ``service_ttft_*`` is the stack's TTFT alone (its
pre-first-token work).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from benchmarks.oracle import ExactnessError, serve_items, spot_check
from benchmarks.report import jsonable
from benchmarks.workload import FWD, MODEL, Item, Served, Timing
from hicache.reference.engine.config import ModelConfig
from hicache.reference.engine.runner import ModelRunner, pages_needed
from hicache.reference.serve_types import ServePhases, ServeRequest, ServeResult


class BareEngine:
    """A stack that never caches: the engine alone, every prompt prefilled from position 0 into a
    fixed page table (same pool shape as L1, so the same compiled forward). No tree, no transfers."""

    def __init__(self, runner: ModelRunner, l1_pages: int) -> None:
        self.runner = ModelRunner(runner.model, runner.fwd, num_pages=l1_pages, params=runner.params)

    def serve(self, req: ServeRequest, between_steps: Callable[[], None] | None = None) -> ServeResult:
        """As ``Scheduler.serve``: ``between_steps()`` runs between decode steps, the first right after
        the first token."""
        prompt = np.asarray(req.prompt, dtype=np.int32)
        t0 = time.perf_counter()
        table = np.arange(pages_needed(prompt.size + req.max_new_tokens, self.runner.fwd.page_size), dtype=np.int32)
        logits = self.runner.prefill(prompt, table, 0)
        ttft = time.perf_counter() - t0
        gen = self.runner.decode(prompt, logits, table, req.max_new_tokens, between_steps=between_steps)
        latency = time.perf_counter() - t0
        return ServeResult(gen.tokens, logits, ttft, latency, int(prompt.size), 0, 0, int(prompt.size),
                           phases=ServePhases(prefill=ttft, decode=latency - ttft))


class VirtualTimeRun:
    """One config's ``ServingLoop`` run in virtual time: item i is sent at ``ticks[i]``, or when its
    client's previous request finished if later; a clock advances by the measured wall time of each
    loop iteration and of each ``submit`` (the L3 query a request's arrival starts runs on the serving
    thread), and jumps to the next send time when the loop is idle. Before each iteration every item
    sent by then is submitted (in send order), so the execution order, and with it the cache state, is
    the one this clock gives. A request's queue wait runs from its send time to the start of the
    iteration that prefills it, its client TTFT to that iteration's end. ``charge(s)`` adds work done
    outside the loop (a drain of in-flight transfers) to the clock. Every measured time is multiplied
    by ``speed`` (default 1) before it advances the clock: a driver that measures the machine's speed
    now against a reference (the bare engine on the same requests) sets it, so that a busier machine
    does not raise the load the arrivals put on the server. ``clock`` says what is measured: wall time
    (``time.perf_counter``, default) or this process's CPU time, every thread (``time.process_time``:
    the work done, whatever other processes take from a shared machine; background threads' work then
    counts as if it ran on the critical path). Every output must equal ``reference``
    (``ExactnessError``)."""

    def __init__(self, items: Sequence[Item], ticks: np.ndarray, loop, reference: Sequence[tuple[int, ...]],
                 config: str, salt: str | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        if len(ticks) != len(items) or any(it.index != i for i, it in enumerate(items)):
            raise ValueError(f"need one tick per item and items indexed 0..{len(items) - 1} in order")
        self.items, self.ticks, self.loop, self.reference, self.config, self.salt = \
            items, ticks, loop, reference, config, salt
        self._prev: list[int | None] = []  # index of the same client's previous item
        last: dict[int, int] = {}
        for it in items:
            self._prev.append(None if it.client is None else last.get(it.client))
            if it.client is not None:
                last[it.client] = it.index
        self.clock = clock  # what a measured time is: wall (perf_counter) or this process's CPU (process_time)
        self.now = 0.0
        self.speed = 1.0
        self.busy_s = 0.0  # clock time the server worked (iterations, submits, charged drains)
        self._unsent = set(range(len(items)))
        self._item_of: dict[int, int] = {}  # ticket -> item
        self._sent: dict[int, float] = {}
        self._started: dict[int, tuple[float, float]] = {}  # item -> (iteration start, first token)
        self._done: dict[int, Served] = {}
        self._returned = 0  # items before this were returned by serve_until

    def _send_time(self, j: int) -> float | None:
        p = self._prev[j]
        if p is None:
            return float(self.ticks[j])
        return None if p not in self._done else max(float(self.ticks[j]), self._done[p].timing.finish_s)

    def _admit(self) -> None:
        due = sorted((t, j) for j in self._unsent if (t := self._send_time(j)) is not None and t <= self.now)
        if not due:
            return
        t0 = self.clock()
        for t, j in due:
            it = self.items[j]
            self._item_of[self.loop.submit(ServeRequest(it.prompt, it.max_new_tokens, cache_salt=self.salt))] = j
            self._sent[j] = t
            self._unsent.discard(j)
        self._advance(self.clock() - t0)

    def _advance(self, seconds: float) -> None:
        self.now += self.speed * seconds
        self.busy_s += self.speed * seconds

    def charge(self, seconds: float) -> None:
        self._advance(seconds)

    def serve_until(self, end: int) -> list[Served]:
        """Runs the loop until items ``[0, end)`` are done; returns those not returned before, in order."""
        while any(j not in self._done for j in range(self._returned, end)):
            self._admit()
            if self.loop.idle:
                nxt = [t for j in self._unsent if (t := self._send_time(j)) is not None]
                if not nxt:
                    raise RuntimeError(f"[{self.config}] idle with items {sorted(self._unsent)[:5]}... never sent")
                self.now = max(self.now, min(nxt))
                continue
            before, t0 = self.now, self.clock()
            step = self.loop.step()
            self._advance(self.clock() - t0)
            if step.first_token is not None:
                self._started[self._item_of[step.first_token]] = (before, self.now)
            for ticket, res in step.finished:
                self._finish(self._item_of.pop(ticket), res)
        out = [self._done[j] for j in range(self._returned, end)]
        self._returned = max(self._returned, end)
        return out

    def _finish(self, j: int, res: ServeResult) -> None:
        it = self.items[j]
        if tuple(res.output) != tuple(self.reference[j]):
            raise ExactnessError(f"[{self.config}] request {j} (client {it.client}, round {it.round}): output "
                                 f"{res.output} != no-cache output {self.reference[j]}")
        sent, (start, first) = self._sent[j], self._started[j]
        self._done[j] = Served(it, res, Timing(sent, start - sent, first - sent, self.now))


def stack_options(l1_pages: int, l2_slots: int = 0, l3_dir: str | Path | None = None, model: ModelConfig = MODEL):
    from hicache.reference.stack import StackOptions

    url = None if l3_dir is None else f"file://{Path(l3_dir).resolve()}"
    return StackOptions(model, FWD, l1_pages=l1_pages, l2_slots=l2_slots, l3_url=url,
                        prefetch_min_tokens=2 * FWD.page_size)


def run_stack(name: str, options, runner: ModelRunner, items: Sequence[Item],
              reference: Sequence[tuple[int, ...]] | None,
              salt: Callable[[Item], str | None] = lambda it: None, spot: int = 3, keep: bool = False):
    """Fresh stack for ``options``; serves ``items`` one at a time; flushes transfers (L2/L3 writes land)
    outside the timings; spot-checks exactness. Returns (served, spot checks run, cache stats, stack or
    None)."""
    from hicache.reference.stack import build_stack

    stack = build_stack(options, runner)
    t0 = time.perf_counter()
    served = serve_items(stack.scheduler.serve, items, reference, name, salt)
    wall = time.perf_counter() - t0
    drain_stack(stack)
    stats = stack.head.cache_stats()
    stats["wall_s"] = wall
    n_spot = spot_check(stack.runner, served, name, spot) if spot else 0
    if not keep:
        close_stack(stack)
        stack = None
    return served, n_spot, stats, stack


def drain_stack(stack) -> None:
    """Waits (bounded by the head's ack timeout) for every transfer the stack has in flight."""
    if stack.options.l2_slots:
        stack.client.flush_write_through_acks()


def close_stack(stack) -> None:
    if stack.options.l3_url is not None:
        stack.client.flush_write_through_acks()
        stack.head.detach_storage_backend()


def finish_stack(name: str, stack, served: Sequence[Served], spot: int) -> tuple[int, dict]:
    """Flushes transfers (outside timings), spot-checks exactness, closes L3; returns (spots, stats)."""
    drain_stack(stack)
    stats = jsonable(stack.head.cache_stats())
    n = spot_check(stack.runner, served, name, spot)
    close_stack(stack)
    return n, stats


def in_scratch_dir(l3_dir: str | None, prefix: str, run: Callable[[Path], object]):
    """Runs ``run(dir)`` in ``l3_dir`` (kept) or in a fresh temporary directory (removed afterwards)."""
    tmp = Path(l3_dir or tempfile.mkdtemp(prefix=prefix))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        return run(tmp)
    finally:
        if not l3_dir:
            shutil.rmtree(tmp, ignore_errors=True)
