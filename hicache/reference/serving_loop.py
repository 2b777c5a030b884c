"""The iteration-level serving loop (``ServingLoop``, SGLang's event loop) over a ``Scheduler``.

A waiting queue and a running set; each iteration either runs the next waiting request's work up to its first token (``prefill_first``,
the default) or one decode step of the running requests (``engine.decode_step``), then
``cache_finished_req`` for those done; ``fcfs_whole_request`` serves one request start to finish like
``Scheduler.serve``. Every forward is the engine's fixed-shape chunk program, so outputs and logits
do not depend on the interleaving. One thread: the loop, its scheduler and the engine's model calls.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np

from hicache.reference.engine import batched
from hicache.reference.engine.runner import Generation, ModelRunner
from hicache.reference.engine_adapters import RemoteModelEngine
from hicache.reference.scheduler import Begun, Scheduler
from hicache.reference.serve_types import ServeRequest, ServeResult


class SchedulePolicy(str, Enum):
    """What a ``ServingLoop`` iteration runs while requests wait and others decode."""

    PREFILL_FIRST = "prefill_first"  # SGLang: admit a waiting request (its whole pre-first-token work) first
    FCFS_WHOLE_REQUEST = "fcfs_whole_request"  # one request at a time, start to finish (``Scheduler.serve``)


@dataclass(frozen=True)
class LoopOptions:
    """``ServingLoop`` options. ``max_running``: requests decoding at once (hard bound); ``max_waiting``:
    queued requests (``submit`` refuses more); ``decode_batch``: running requests one decode iteration
    advances by one step each, round-robin (0: all of them, as SGLang's decode batch);
    ``batched_decode``: those steps in one dispatch (``hicache.reference.engine.batched``: bit-identical on the
    platforms it was checked on, ``ValueError`` elsewhere; only where the model runs in this process:
    ``ModelRunner``, ``WorkerEngine``; a remote engine still calls once per request)."""

    policy: SchedulePolicy = SchedulePolicy.PREFILL_FIRST
    max_running: int = 32
    max_waiting: int = 1024
    decode_batch: int = 0
    batched_decode: bool = False  # a decode iteration in one dispatch where the model runs in this process

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "policy", SchedulePolicy(self.policy))
        except ValueError:
            raise ValueError(f"policy must be one of {[p.value for p in SchedulePolicy]}, got {self.policy!r}") from None
        for name, low in (("max_running", 1), ("max_waiting", 1), ("decode_batch", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        if not isinstance(self.batched_decode, bool):
            raise ValueError(f"batched_decode must be a bool, got {self.batched_decode!r}")
        if self.max_waiting > Scheduler.MAX_ARRIVED:
            raise ValueError(f"max_waiting {self.max_waiting} > Scheduler.MAX_ARRIVED {Scheduler.MAX_ARRIVED}")


class StepKind(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    IDLE = "idle"


@dataclass(frozen=True)
class LoopStep:
    """What one ``ServingLoop.step`` ran: a prefill (``first_token``: the ticket that got its first
    token) or a decode iteration, and the requests it finished (ticket, result)."""

    kind: StepKind
    first_token: int | None = None
    finished: tuple[tuple[int, ServeResult], ...] = ()


class _Running:
    """A decoding request (the loop's own state; mutable, one thread)."""

    def __init__(self, ticket: int, begun: Begun, pages: int) -> None:
        self.ticket, self.begun, self.pages = ticket, begun, pages  # pages: counted against the L1 capacity
        prompt = begun.prompt
        # the sequence so far (prompt + tokens taken) in one buffer filled up to ``_n``: a decode step reads a
        # view of its first ``_n`` ids (positions below ``_n`` are never written again), no per-step copy
        self._buf = np.empty(prompt.size + begun.req.max_new_tokens, np.int32)
        self._buf[: prompt.size] = prompt
        self._n = prompt.size
        self.tokens: list[int] = []
        self.logits = [begun.logits]
        self.decode_s = 0.0

    @property
    def seq(self) -> np.ndarray:
        """i32[prompt + tokens taken] (a view: read it, don't keep it past the next ``take``'s use)."""
        return self._buf[: self._n]

    def take(self) -> bool:
        """Takes the argmax of the last logits as the next token; True when the request is done."""
        nxt = int(np.argmax(self.logits[-1]))
        self.tokens.append(nxt)
        self._buf[self._n] = nxt
        self._n += 1
        return len(self.tokens) == self.begun.req.max_new_tokens

    def generation(self) -> Generation:
        return Generation(tuple(self.tokens), np.stack(self.logits))


class ServingLoop:
    """An iteration-level scheduler over a ``Scheduler`` (SGLang's event loop, one request per prefill).

    ``submit`` puts a request in the waiting queue (``Scheduler.arrive``: its L3 prefetch starts now).
    Each ``step`` is one iteration: with ``PREFILL_FIRST``, the next waiting request's pre-first-token
    work (match, L3 prefetch check, load-back, alloc, chunked prefill; then its prompt's whole pages go
    into the tree, ``Scheduler.cache_prompt``, for the requests that start while it decodes) if one
    waits and may start, else one decode step for each of up to ``decode_batch`` running requests
    (round-robin), then ``cache_finished_req`` for those done. A request may start when fewer than
    ``max_running`` run and the pages of the running ones plus its own (prompt + new tokens, counted
    whole, shared prefixes twice) fit the L1 capacity, or when nothing runs (its alloc may then evict
    all but itself).
    ``FCFS_WHOLE_REQUEST`` starts a request only when nothing runs. Every forward is the engine's
    fixed-shape chunk program, so outputs do not depend on the interleaving.

    Owns: the waiting queue and the running set (their page tables; the pages belong to the tree and
    the requests as in ``Scheduler.serve``). One thread; the engine's model calls run on it."""

    def __init__(self, scheduler: Scheduler, options: LoopOptions = LoopOptions()) -> None:
        if not isinstance(options, LoopOptions):
            raise TypeError(f"options must be LoopOptions, got {type(options).__name__}")
        self.scheduler = scheduler
        self.options = options
        self.capacity_pages = int(scheduler.client.stats().capacity_pages)
        self._tickets = itertools.count()
        self.waiting: deque[tuple[int, ServeRequest]] = deque()
        self.running: deque[_Running] = deque()
        self._running_pages = 0
        self._decode = self._decode_fn()

    def _decode_fn(self) -> Callable[[list[np.ndarray], list[np.ndarray]], list[np.ndarray]]:
        """One decode step per request: one dispatch with ``batched_decode`` (its programs compiled now,
        for up to ``max_running`` requests), else one ``decode_step`` each."""
        engine = self.scheduler.engine
        if not self.options.batched_decode:
            return lambda seqs, tables: [engine.decode_step(s, t) for s, t in zip(seqs, tables)]
        if isinstance(engine, ModelRunner):
            batched.compile_batches(engine, self.options.max_running)
            return lambda seqs, tables: batched.decode_steps(engine, seqs, tables)
        if isinstance(engine, RemoteModelEngine):
            engine.compile_decode_batches(self.options.max_running)
            return engine.decode_steps
        raise TypeError(f"batched_decode needs a ModelRunner or a RemoteModelEngine, got {type(engine).__name__}")

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def submit(self, req: ServeRequest) -> int:
        """Queues ``req``; returns its ticket. ``ValueError`` (nothing queued) on a bad request or a full
        queue."""
        if len(self.waiting) >= self.options.max_waiting:
            raise ValueError(f"{len(self.waiting)} requests wait (max_waiting): step the loop first")
        self.scheduler.arrive(req)
        ticket = next(self._tickets)
        self.waiting.append((ticket, req))
        return ticket

    def _pages(self, req: ServeRequest) -> int:
        return -(-(len(req.prompt) + req.max_new_tokens) // self.scheduler.client.page_size)

    def _may_start(self) -> bool:
        if not self.waiting:
            return False
        if not self.running:
            return True
        if self.options.policy is SchedulePolicy.FCFS_WHOLE_REQUEST or len(self.running) >= self.options.max_running:
            return False
        return self._running_pages + self._pages(self.waiting[0][1]) <= self.capacity_pages

    def step(self) -> LoopStep:
        """Runs one iteration (see the class docstring)."""
        if self._may_start():
            ticket, req = self.waiting.popleft()
            r = _Running(ticket, self.scheduler.begin(req), self._pages(req))
            self._running_pages += r.pages
            if r.take():
                return LoopStep(StepKind.PREFILL, ticket, (self._finish(r),))
            try:  # its prompt is reused by the requests that start while it decodes
                r.begun = self.scheduler.cache_prompt(r.begun)
            except BaseException:
                self._running_pages -= r.pages
                raise
            self.running.append(r)
            return LoopStep(StepKind.PREFILL, ticket)
        if not self.running:
            return LoopStep(StepKind.IDLE)
        n = self.options.decode_batch or len(self.running)
        batch = [self.running.popleft() for _ in range(min(n, len(self.running)))]
        t = time.perf_counter()
        if not batch[0].begun.engine_args:
            logits = self._decode([r.seq for r in batch], [r.begun.table for r in batch])
        else:  # recurrent layers / an SWA pool: each step with its request's slot and SWA table (no batched program)
            engine = self.scheduler.engine
            logits = [engine.decode_step(r.seq, r.begun.table, **r.begun.decode_args) for r in batch]
        share = (time.perf_counter() - t) / len(batch)
        done = []
        for r, row in zip(batch, logits):
            r.logits.append(row)
            r.decode_s += share
            if r.take():
                done.append(r)
            else:
                self.running.append(r)
        return LoopStep(StepKind.DECODE, None, tuple(self._finish(r) for r in done))

    def _finish(self, r: _Running) -> tuple[int, ServeResult]:
        self._running_pages -= r.pages
        return r.ticket, self.scheduler.finish(r.begun, r.generation(), r.decode_s)

    def run(self, requests: Sequence[ServeRequest]) -> list[ServeResult]:
        """Submits ``requests`` (as the queue takes them) and steps until every one is done; results in
        request order."""
        out: dict[int, ServeResult] = {}
        tickets: list[int] = []
        pending = deque(requests)
        while pending or not self.idle:
            while pending and len(self.waiting) < self.options.max_waiting:
                tickets.append(self.submit(pending.popleft()))
            out.update(self.step().finished)
        return [out[t] for t in tickets]
