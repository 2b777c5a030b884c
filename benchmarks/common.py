"""Shared pieces of the end-to-end benchmarks (``multiturn.py``, ``long_doc_qa.py``).

Everything runs in one process on the embedded default (``hicache.reference.stack``): each config is a fresh
stack (head + HostWorker + reference engine, L3 in a local directory) that reuses one set of compiled
params. Requests are served one at a time, in a fixed order that every config shares, so the configs
see the same request stream (the reference run decides it; see ``Stream``).

Arrivals: request i is sent at a Poisson tick ``t_i`` (rate ``request_rate``), or later if the same
client's previous request has not finished yet (a chat client sends its next turn after the answer).
Two queue models. ``VirtualTimeRun`` (the cache configs of the multiturn TTFT phase): the stack's
``ServingLoop`` (iteration-level, prefill-first as SGLang) runs on a virtual clock advanced by each
iteration's measured wall time; requests are submitted when the clock passes their send time, so the
real execution order follows the clock. ``simulate_arrivals`` (requests served one at a time: the bare
engine, the no-reuse pair, long_doc_qa): one FCFS server, a request starts at ``max(sent, server
free)`` and its service time is what the stack really took. ``ttft_*`` is seen from the client (queue
wait + service TTFT); ``service_ttft_*`` is the stack's TTFT alone (its pre-first-token work).

Offline-optimal hit rate (``belady_hit_tokens``): pages are the chain keys of full pages (key of page
k = hash of every token up to the end of page k, namespaced by ``cache_salt``), the same unit as the
radix tree. Request i *reads* the full pages of ``prompt[:-1]`` (hits = its leading pages that are
cached) and then *writes* the full pages of ``prompt + output[:-1]`` (what ``cache_finished_req``
inserts). A cache of C pages keeps, after each request, the C pages with the nearest next read among
what it held plus what the request wrote (Belady/MIN with bypass; pages never read again are dropped).
A page's next read is never later than its children's (a read of a child reads the whole chain), and
ties evict the deeper page first, so the cache stays prefix-closed and page hits are prefix hits:
MIN is optimal for this model. It is an upper bound: it ignores the L1 room a running request needs
and that the real tiers hold disjoint copies or duplicates (L1 + L2 is modelled as one cache of their
summed size).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from enum import Enum
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from hicache.reference.engine.config import ForwardConfig, ModelConfig  # noqa: E402
from hicache.reference.engine.runner import ModelRunner, pages_needed  # noqa: E402
from hicache.reference.serve_types import ServePhases, ServeRequest, ServeResult  # noqa: E402

MODEL = ModelConfig()
FWD = ForwardConfig(chunk_size=16, page_size=8, max_pages=64)  # max context 512 tokens


_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {msg}", flush=True)  # plain lines: no TTY (ray job submit)


# --- the request stream -------------------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    """One request of the stream: ``client`` is ``None`` when it depends on no earlier request."""

    index: int
    client: int | None
    round: int
    prompt: np.ndarray  # i32[n]
    max_new_tokens: int


@dataclass(frozen=True)
class Stream:
    items: tuple[Item, ...]
    outputs: tuple[tuple[int, ...], ...]  # reference (no cache) output of each item

    @property
    def prompt_tokens(self) -> int:
        return sum(len(it.prompt) for it in self.items)


@dataclass(frozen=True)
class Timing:
    """One request seen from its client in a ``VirtualTimeRun`` (seconds on its virtual clock)."""

    sent_s: float
    queue_wait_s: float  # sent -> its pre-first-token work started
    client_ttft_s: float  # sent -> first token (queue wait + service TTFT)
    finish_s: float


@dataclass
class Served:
    item: Item
    result: ServeResult
    timing: Timing | None = None  # None: served one at a time, no clock (``simulate_arrivals`` models the queue)


# --- serving --------------------------------------------------------------------------------------


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


class ExactnessError(AssertionError):
    pass


def serve_items(serve: Callable[[ServeRequest], ServeResult], items: Sequence[Item],
                reference: Sequence[tuple[int, ...]] | None, config: str,
                salt: Callable[[Item], str | None] = lambda it: None) -> list[Served]:
    """Serves ``items`` in order; with ``reference``, every output must equal the no-cache output."""
    out = []
    for it in items:
        res = serve(ServeRequest(it.prompt, it.max_new_tokens, cache_salt=salt(it)))
        if reference is not None and tuple(res.output) != tuple(reference[it.index]):
            raise ExactnessError(f"[{config}] request {it.index} (client {it.client}, round {it.round}): output "
                                 f"{res.output} != no-cache output {reference[it.index]}")
        out.append(Served(it, res))
    return out


def spot_check(runner: ModelRunner, served: Sequence[Served], config: str, k: int = 3) -> int:
    """Compares output tokens and last logits, bit for bit, with ``generate_no_cache`` on up to ``k``
    requests (those with the most L3, L2 and L1 hit tokens first). Raises ``ExactnessError``."""
    picks: list[Served] = []
    for key in (lambda s: s.result.storage_tokens, lambda s: s.result.loaded_tokens - s.result.storage_tokens,
                lambda s: s.result.device_hit_tokens, lambda s: s.result.computed_tokens):
        for s in sorted(served, key=key, reverse=True):
            if key(s) > 0 and all(s is not p for p in picks):
                picks.append(s)
                break
        if len(picks) >= k:
            break
    for s in picks:
        ref = runner.generate_no_cache(s.item.prompt, s.item.max_new_tokens)
        if tuple(s.result.output) != tuple(ref.tokens) or not np.array_equal(s.result.last_logits, ref.logits[0]):
            raise ExactnessError(f"[{config}] request {s.item.index}: cached output/logits differ from "
                                 f"generate_no_cache (tokens {s.result.output} vs {ref.tokens})")
    return len(picks)


# --- arrivals -------------------------------------------------------------------------------------


def poisson_ticks(n: int, rate: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1.0 / rate, size=n))


def simulate_arrivals(served: Sequence[Served], ticks: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """(client-seen TTFT per request, queue wait per request, makespan) under the module's model."""
    free = 0.0
    last_finish: dict[int, float] = {}
    ttft, wait = np.zeros(len(served)), np.zeros(len(served))
    first_sent, end = None, 0.0
    for i, s in enumerate(served):
        sent = float(ticks[i])
        if s.item.client is not None:
            sent = max(sent, last_finish.get(s.item.client, 0.0))
        start = max(sent, free)
        finish = start + s.result.latency_s
        wait[i] = start - sent
        ttft[i] = wait[i] + s.result.ttft_s
        free = finish
        if s.item.client is not None:
            last_finish[s.item.client] = finish
        first_sent = sent if first_sent is None else min(first_sent, sent)
        end = max(end, finish)
    return ttft, wait, end - (first_sent or 0.0)


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


# --- offline optimal ------------------------------------------------------------------------------


def page_chain(tokens: np.ndarray, page_size: int, salt: str | None) -> list[bytes]:
    h = hashlib.blake2b(f"ns:{salt}".encode(), digest_size=16).digest()
    toks = np.asarray(tokens, dtype=np.int32)
    keys = []
    for p in range(len(toks) // page_size):
        h = hashlib.blake2b(h + toks[p * page_size:(p + 1) * page_size].tobytes(), digest_size=16).digest()
        keys.append(h)
    return keys


@dataclass(frozen=True)
class Access:
    reads: list[bytes]  # chain of prompt[:-1] full pages
    writes: list[bytes]  # chain of prompt + output[:-1] full pages


def accesses(served_or_items: Sequence[tuple[np.ndarray, Sequence[int]]], page_size: int,
             salts: Sequence[str | None]) -> list[Access]:
    out = []
    for (prompt, output), salt in zip(served_or_items, salts):
        seq = np.concatenate([prompt, np.asarray(output[:-1], dtype=np.int32)])
        out.append(Access(page_chain(prompt[:-1], page_size, salt), page_chain(seq, page_size, salt)))
    return out


def belady_hit_tokens(stream: Sequence[Access], capacity_pages: float, page_size: int,
                      preload: Sequence[Access] = ()) -> list[int]:
    """Optimal hit tokens per request of ``stream`` for a cache of ``capacity_pages`` (``inf`` allowed),
    starting with every page ``preload`` wrote (a warm replica's L3)."""
    uses: dict[bytes, list[int]] = {}
    for i, a in enumerate(stream):
        for k in a.reads:
            uses.setdefault(k, []).append(i)
    inf = float("inf")

    def next_use(k: bytes, i: int) -> float:
        u = uses.get(k)
        if not u:
            return inf
        j = bisect_right(u, i)
        return u[j] if j < len(u) else inf

    cache: dict[bytes, float] = {}  # key -> next read
    heap: list[tuple[float, int, bytes]] = []  # (-next read, -depth, key), lazy

    def put(k: bytes, depth: int, i: int) -> None:
        nu = next_use(k, i)
        if nu == inf:
            cache.pop(k, None)
            return
        cache[k] = nu
        heapq.heappush(heap, (-nu, -depth, k))

    def shrink() -> None:
        while len(cache) > capacity_pages:
            nnu, _, k = heapq.heappop(heap)
            if cache.get(k) == -nnu:
                del cache[k]

    for a in preload:
        for d, k in enumerate(a.writes):
            put(k, d, -1)
    shrink()
    hits = []
    for i, a in enumerate(stream):
        n = 0
        for k in a.reads:
            if k not in cache:
                break
            n += 1
        hits.append(n * page_size)
        for d, k in enumerate(a.writes):
            put(k, d, i)
        shrink()
    return hits


# --- records --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigRecord:
    config: str
    requests: int
    prompt_tokens: int
    output_tokens: int
    prefill_tokens_computed: int
    ttft_mean_s: float  # client view: queue wait (Poisson arrivals) + service TTFT
    ttft_p90_s: float
    service_ttft_mean_s: float  # the stack alone, no queueing
    service_ttft_p90_s: float
    queue_wait_mean_s: float
    throughput_requests_per_s: float  # over the simulated makespan (arrivals at request_rate)
    throughput_tokens_per_s: float  # (prompt + output tokens) over the makespan
    capacity_requests_per_s: float  # requests / summed service latency (server never idle)
    capacity_tokens_per_s: float
    request_rate: float
    hit_rate_by_tier: dict[str, float]  # share of prompt tokens served by each tier
    hit_tokens_by_tier: dict[str, int]
    hit_rate_total: float
    optimal_hit_rate: float | None  # Belady/MIN with the same capacity (None: not applicable)
    optimal_capacity_tokens: float | None
    l1_tokens: int
    l2_tokens: int
    l3: bool
    load_failed: int
    exact_outputs_checked: int  # requests whose output tokens were compared with the no-cache run
    exact_spot_checks: int  # requests also compared (tokens + logits) with generate_no_cache
    hit_rate_by_round: list[float]
    service_ttft_mean_by_round_s: list[float]
    notes: dict = field(default_factory=dict)


def make_record(config: str, served: Sequence[Served], ticks: np.ndarray, rate: float, *, l1_tokens: int,
                l2_tokens: int, l3: bool, optimal_hits: Sequence[int] | None, optimal_capacity: float | None,
                exact_checked: int, spot: int, notes: dict | None = None) -> ConfigRecord:
    res = [s.result for s in served]
    if all(s.timing is not None for s in served):  # a VirtualTimeRun: the loop's own queue
        ttft = np.array([s.timing.client_ttft_s for s in served])
        wait = np.array([s.timing.queue_wait_s for s in served])
        svc = ttft - wait  # the prefill iteration on the clock (scaled by its speed)
        makespan = max(s.timing.finish_s for s in served) - min(s.timing.sent_s for s in served)
        queue_model = "iteration_loop"
    else:
        ttft, wait, makespan = simulate_arrivals(served, ticks)
        queue_model = "fcfs_whole_request"
    steps = sum(len(r.output) - 1 for r in res)
    prompt = sum(r.prompt_len for r in res)
    outputs = sum(len(r.output) for r in res)
    l3t = sum(r.storage_tokens for r in res)
    tiers = {"l1": sum(r.device_hit_tokens for r in res), "l2": sum(r.loaded_tokens for r in res) - l3t, "l3": l3t}
    busy = sum(r.latency_s for r in res)
    rounds = sorted({s.item.round for s in served})
    by_round_hit, by_round_ttft = [], []
    for rd in rounds:
        rs = [s.result for s in served if s.item.round == rd]
        by_round_hit.append(sum(r.prompt_len - r.computed_tokens for r in rs) / sum(r.prompt_len for r in rs))
        by_round_ttft.append(statistics.fmean(r.ttft_s for r in rs))
    if queue_model != "iteration_loop":
        svc = np.array([r.ttft_s for r in res])
    return ConfigRecord(
        config=config, requests=len(res), prompt_tokens=prompt, output_tokens=outputs,
        prefill_tokens_computed=sum(r.computed_tokens for r in res),
        ttft_mean_s=float(ttft.mean()), ttft_p90_s=float(np.percentile(ttft, 90)),
        service_ttft_mean_s=float(svc.mean()), service_ttft_p90_s=float(np.percentile(svc, 90)),
        queue_wait_mean_s=float(wait.mean()),
        throughput_requests_per_s=len(res) / makespan, throughput_tokens_per_s=(prompt + outputs) / makespan,
        capacity_requests_per_s=len(res) / busy, capacity_tokens_per_s=(prompt + outputs) / busy,
        request_rate=rate,
        hit_rate_by_tier={k: v / prompt for k, v in tiers.items()}, hit_tokens_by_tier=tiers,
        hit_rate_total=sum(tiers.values()) / prompt,
        optimal_hit_rate=None if optimal_hits is None else sum(optimal_hits) / prompt,
        optimal_capacity_tokens=optimal_capacity,
        l1_tokens=l1_tokens, l2_tokens=l2_tokens, l3=l3, load_failed=sum(r.load_failed for r in res),
        exact_outputs_checked=exact_checked, exact_spot_checks=spot,
        hit_rate_by_round=by_round_hit, service_ttft_mean_by_round_s=by_round_ttft,
        notes={"service_phases_mean_ms": phase_means_ms(res), "queue_model": queue_model,
               "decode_step_ms": 1e3 * sum(r.phases.decode for r in res) / max(1, steps), **(notes or {})})


def phase_means_ms(results: Sequence[ServeResult]) -> dict[str, float]:
    """Mean time per request in each ``ServePhases`` phase, in ms (the phases of one run: best-of-N
    replaces only the TTFT and latency)."""
    return {f.name: 1e3 * statistics.fmean(getattr(r.phases, f.name) for r in results) for f in fields(ServePhases)}


def print_records(records: Sequence[ConfigRecord]) -> None:
    cols = ("config", "reqs", "computed", "hit", "l1", "l2", "l3", "optimal", "ttft ms", "p90", "wait ms",
            "svc ms", "svc p90", "decode ms", "req/s cap")
    log(" ".join(f"{c:>15}" if i == 0 else f"{c:>9}" for i, c in enumerate(cols)))
    for r in records:
        opt = "-" if r.optimal_hit_rate is None else f"{r.optimal_hit_rate:.1%}"
        vals = (r.config, r.requests, r.prefill_tokens_computed, f"{r.hit_rate_total:.1%}",
                f"{r.hit_rate_by_tier['l1']:.1%}", f"{r.hit_rate_by_tier['l2']:.1%}",
                f"{r.hit_rate_by_tier['l3']:.1%}", opt, f"{r.ttft_mean_s * 1e3:.1f}", f"{r.ttft_p90_s * 1e3:.1f}",
                f"{r.queue_wait_mean_s * 1e3:.1f}", f"{r.service_ttft_mean_s * 1e3:.1f}",
                f"{r.service_ttft_p90_s * 1e3:.1f}", f"{r.notes.get('decode_step_ms', 0.0):.2f}",
                f"{r.capacity_requests_per_s:.1f}")
        log(" ".join(f"{v:>15}" if i == 0 else f"{v!s:>9}" for i, v in enumerate(vals)))
    names = [f.name for f in fields(ServePhases)]
    log("service phases, mean ms per request: " + " ".join(f"{n:>9}" for n in names))
    for r in records:
        phases = r.notes.get("service_phases_mean_ms", {})
        log(f"{r.config:>15}" + " " * 22 + " ".join(f"{phases.get(n, 0.0):9.2f}" for n in names))


def write_json(records: Sequence[ConfigRecord], path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps([asdict(r) for r in records], indent=1))
        log(f"json: {Path(path).resolve()}")


def plot(records: Sequence[ConfigRecord], path: str | None, title: str) -> None:
    if not path:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.config for r in records]
    x = np.arange(len(records))
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5))
    bottom = np.zeros(len(records))
    for tier, color in (("l1", "#2b8cbe"), ("l2", "#7bccc4"), ("l3", "#fdae61")):
        vals = np.array([r.hit_rate_by_tier[tier] for r in records])
        ax1.bar(x, vals, bottom=bottom, label=tier.upper(), color=color)
        bottom += vals
    opt = [r.optimal_hit_rate for r in records]
    ax1.scatter([i for i, o in enumerate(opt) if o is not None], [o for o in opt if o is not None], marker="_",
                s=600, color="k", label="offline optimal", zorder=3)
    ax1.set_xticks(x, names, rotation=30, ha="right")
    ax1.set_ylim(0, 1.05)
    ax1.set_ylabel("share of prompt tokens served from cache")
    ax1.legend(fontsize=8)
    w = 0.2
    for k, (attr, label) in enumerate((("service_ttft_mean_s", "service mean"), ("service_ttft_p90_s", "service p90"),
                                       ("ttft_mean_s", "with queue mean"), ("ttft_p90_s", "with queue p90"))):
        ax2.bar(x + (k - 1.5) * w, [getattr(r, attr) * 1e3 for r in records], w, label=label)
    ax2.set_xticks(x, names, rotation=30, ha="right")
    ax2.set_ylabel("TTFT (ms)")
    ax2.set_yscale("log")
    ax2.legend(fontsize=8)
    ax3.bar(x, [r.prefill_tokens_computed for r in records], color="#636363")
    ax3.set_xticks(x, names, rotation=30, ha="right")
    ax3.set_ylabel("prefill tokens computed")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    log(f"png: {Path(path).resolve()}")


# --- stacks ---------------------------------------------------------------------------------------


def report(records: Sequence[ConfigRecord], targets: dict, attach_to: Sequence[str], rate: float,
           json_path: str | None, png_path: str | None, title: str, t_start: float) -> None:
    """The end of a serving benchmark: targets into the named records' notes, the table, the target line,
    JSON, PNG and the wall time."""
    by = {r.config: r for r in records}
    for name in attach_to:
        by[name].notes["targets"] = targets
    print_records(records)
    log(f"request rate {rate:.2f} req/s (Poisson); targets: " + ", ".join(
        f"{k} {v:.3f}" for k, v in targets.items() if k != "met") + f"; met {targets['met']}")
    write_json(records, json_path)
    plot(records, png_path, title)
    log(f"wall time {time.perf_counter() - t_start:.1f} s")


def tier_sizes(est_pages: int, longest_tokens: int, l1_fraction: float, l2_fraction: float) -> tuple[int, int]:
    """L1 pages (a fraction of the estimated working set, but room for the longest request, its prefix
    locked + its new pages, with some to spare) and L2 slots."""
    ps = FWD.page_size
    return max(-(-longest_tokens // ps) + 4, round(est_pages * l1_fraction)), max(1, round(est_pages * l2_fraction))


def working_set(items: Sequence[Item], outputs: Sequence[Sequence[int]]) -> tuple[list[Access], int]:
    """The page accesses of the served stream and its working set in pages."""
    acc = accesses([(it.prompt, o) for it, o in zip(items, outputs)], FWD.page_size, [None] * len(items))
    return acc, len({k for a in acc for k in a.writes})


def stack_options(l1_pages: int, l2_slots: int = 0, l3_dir: str | Path | None = None):
    from hicache.reference.stack import StackOptions

    url = None if l3_dir is None else f"file://{Path(l3_dir).resolve()}"
    return StackOptions(MODEL, FWD, l1_pages=l1_pages, l2_slots=l2_slots, l3_url=url,
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


def close_stack(stack) -> None:
    if stack.options.l3_url is not None:
        stack.client.flush_write_through_acks()
        stack.head.detach_storage_backend()


def jsonable(obj):
    return json.loads(json.dumps(obj, default=str))


class PairMode(str, Enum):
    """How ``overhead_pair`` alternates the bare engine and the no-reuse stack."""

    SEGMENTS = "segments"  # ``segment`` requests in a row per config, the stack drained after each of its segments
    INTERLEAVED = "interleaved"  # request by request, nothing drained in between (the figure before segments)


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


def overhead_pair(bare: BareEngine, runner: ModelRunner, options: Callable[[str], object], items: Sequence[Item],
                  reference: Sequence[tuple[int, ...]], reps: int, segment: int = 1, clock: str = "cpu"):
    """The no-reuse workload through the full stack (``no_cache``: every request in its own cache_salt)
    and through ``bare`` (never caches), as a server serves its own requests: in segments of
    ``segment`` requests (``serve_segments``: the configs alternate per segment, the first one rotated
    per rep), the stack's background work (L1->L2 copies, L3 writes and their acks) drained at the
    end of each of its segments. That work so lands in the stack's own requests or in its drains,
    never in the bare engine's; the drains are reported per request (wall and CPU ms, and as a bound
    the overhead with every drain charged to a TTFT), and so is each config's thread CPU per request
    (``cpu_ms_per_request``, ``thread_cpu_s`` groups). ``options(tag)`` gives a fresh stack's options
    (its own L3 directory per tag). A shorter segment drains more often: the background work left by
    each segment's last request goes to its drain (the stack's latency) rather than into the next
    request. The stack keeps that work out of TTFT windows itself (its L3 writes wait past the next
    request's first token, ``Scheduler`` ``hold_storage_writes``; L1->L2 backups go in batches at a
    finish), and the drain figures bound what is left (here segments of 1, 4 and 16 measured the
    same overhead within their noise).

    Every request is timed on both clocks (``by_clock``): wall time (``ServePhases``) and this
    process's CPU time, every thread (``on_cpu_clock``: what the work took, whatever other processes
    on a shared machine take; background threads count as if on the critical path); ``clock`` says
    which one the top-level figures (the target) use. Robust to a noisy machine (``paired_overhead``):
    the overhead is a ratio of mean TTFTs over blocks of ``PAIR_BLOCK`` requests, each block's ratio
    the median over ``reps`` (fresh stack per rep) of the two configs' summed TTFTs on it, served
    within seconds of each other. On this 2-CPU machine the CPU time of the same work swings by
    tens of % with the other processes' load, on the scale of seconds, so short segments (default
    1) pair the configs closely in time; a block holds several of them (the spread of the figure
    over runs here: a few tenths of a point in segments of 1, points in segments of 4 or 16).
    Beside it: the ratio of the mean best-of-N TTFTs (each request's best of ``reps``,
    ``best_of_reps``; noisier: a request's minimum comes from whichever rep met a quiet moment) and
    the median of the per-request best-of-N ratios. Each rep also serves the pair interleaved request by request with nothing drained
    (``PairMode.INTERLEAVED``, another fresh stack; the summary's ``interleaved``), so that both
    protocols meet the same machine state. Returns (bare served, no_cache served: best-of-N wall
    timings of the segments; no_cache stats and spot checks of rep 0; summary)."""
    from hicache.reference.stack import build_stack

    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}")
    plans = {PairMode.SEGMENTS: segment, PairMode.INTERLEAVED: 1}
    cpu_served: dict[PairMode, list[dict[str, list[Served]]]] = {m: [] for m in plans}
    wall_served: dict[PairMode, list[dict[str, list[Served]]]] = {m: [] for m in plans}
    runs: dict[PairMode, list[dict[str, ConfigRun]]] = {m: [] for m in plans}
    wall_drain_s: dict[PairMode, list[float]] = {m: [] for m in plans}
    first = None
    for rep in range(reps):
        for mode in (list(plans) if rep % 2 == 0 else list(plans)[::-1]):
            stack = build_stack(options(f"{mode.value}-{rep}"), runner)
            salt = lambda it, tag=f"nc-{mode.value}-{rep}": f"{tag}-{it.index}"  # noqa: E731
            serves = {"bare_engine": one_at_a_time(on_cpu_clock(bare.serve), reference, "bare_engine"),
                      "no_cache": one_at_a_time(on_cpu_clock(stack.scheduler.serve), reference, "no_cache", salt)}
            wall_drains: list[float] = []

            def drain(st=stack, out=wall_drains) -> None:
                t0 = time.perf_counter()
                drain_stack(st)
                out.append(time.perf_counter() - t0)
            drains = {"no_cache": drain} if mode is PairMode.SEGMENTS else {}
            run = serve_segments(serves, items, drains, plans[mode], rotate=rep, clock=time.process_time)
            drain_stack(stack)  # the interleaved pair's writes land here, outside its timings
            runs[mode].append(run)
            wall_drain_s[mode] += wall_drains
            cpu_served[mode].append({n: r.served for n, r in run.items()})
            wall_served[mode].append({n: on_wall_clock(r.served, wall_drains if n == "no_cache" else (), plans[mode])
                                      for n, r in run.items()})
            if first is None and mode is PairMode.SEGMENTS:
                stats = jsonable(stack.head.cache_stats())
                spots = (spot_check(bare.runner, run["bare_engine"].served, "bare_engine", 1),
                         spot_check(stack.runner, run["no_cache"].served, "no_cache", 1))
                first = (stats, spots)
            close_stack(stack)
    summaries = {m: _pair_summary(m, plans[m], clock, {"cpu": cpu_served[m], "wall": wall_served[m]}, runs[m],
                                  wall_drain_s[m]) for m in plans}
    best, summary = summaries[PairMode.SEGMENTS]
    summary["interleaved"] = summaries[PairMode.INTERLEAVED][1]
    return (best["bare_engine"], best["no_cache"], *first, summary)


def no_reuse_targets(overhead: dict) -> dict[str, float]:
    """The no-reuse pair's figures for a benchmark's targets: the overhead on the pair's clock (the
    target, ``paired_overhead``), its median per request, the other clock's and the interleaved pair's."""
    out = {"no_reuse_overhead_service_ttft": overhead["overhead_mean_ttft"],
           "no_reuse_overhead_median_request": overhead["overhead_median_request_ratio"]}
    for clock, seg in overhead["by_clock"].items():
        out[f"no_reuse_overhead_service_ttft_{clock}"] = seg["overhead_mean_ttft"]
    out["no_reuse_overhead_interleaved"] = overhead["interleaved"]["overhead_mean_ttft"]
    return out


PAIR_BLOCK = 16  # requests per block of ``paired_overhead``


def paired_overhead(reps: Sequence[dict[str, list[Served]]], block: int = PAIR_BLOCK, base: str = "bare_engine",
                    other: str = "no_cache") -> tuple[float, float]:
    """(overhead of ``other`` over ``base``, ``base``'s mean TTFT) from reps that each served the same
    stream with both configs (results in stream order), robust to a shared machine's load: the
    stream is cut into blocks of ``block`` requests; in each rep a block's ratio is ``other``'s summed
    TTFT over ``base``'s (both served it within seconds, so load drift largely cancels); a block's
    ratio is its median over the reps (a rep whose windows of one config met a burst of load is
    outvoted, a cost that recurs in every rep stays, as a deterministic one does); the overhead is
    the blocks' ratios weighted by ``base``'s block TTFT (median over the reps), minus 1: a ratio of
    mean TTFTs. ``base``'s mean TTFT: those weights summed over the requests."""
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be an int >= 1, got {block!r}")
    if not reps:
        raise ValueError("need at least one rep")
    order = [s.item.index for s in reps[0][base]]
    for rep in reps:
        for name in (base, other):
            if [s.item.index for s in rep[name]] != order:
                raise ValueError(f"every rep must serve the same items in the same order with {base!r} and "
                                 f"{other!r}; {name!r} served {[s.item.index for s in rep[name]][:8]}... vs "
                                 f"{order[:8]}...")
    ratios, weights = [], []
    for lo in range(0, len(order), block):
        b = np.array([sum(s.result.ttft_s for s in rep[base][lo:lo + block]) for rep in reps])
        o = np.array([sum(s.result.ttft_s for s in rep[other][lo:lo + block]) for rep in reps])
        ratios.append(float(np.median(o / b)))
        weights.append(float(np.median(b)))
    w = np.array(weights)
    return float((np.array(ratios) * w).sum() / w.sum() - 1), float(w.sum() / len(order))


def _pair_summary(mode: PairMode, segment: int, clock: str, served: dict[str, Sequence[dict[str, list[Served]]]],
                  runs: Sequence[dict[str, ConfigRun]], wall_drain_s: Sequence[float]
                  ) -> tuple[dict[str, list[Served]], dict]:
    """(best-of-reps wall results, the summary ``overhead_pair`` reports) of one protocol's reps;
    ``served[clock]``: the reps timed on that clock; the no_cache drains: CPU in ``runs``, wall given."""
    requests = sum(len(run["no_cache"].served) for run in runs)
    drains = {"cpu": [d for run in runs for d in run["no_cache"].drain_s], "wall": wall_drain_s}
    by_clock, best_wall = {}, None
    for name, reps in served.items():
        best, _ = best_of_reps(reps)
        best_wall = best if name == "wall" else best_wall
        ttft = {c: np.array([s.result.ttft_s for s in best[c]]) for c in best}
        latency = {c: np.array([s.result.latency_s for s in best[c]]) for c in best}
        b, n = ttft["bare_engine"], ttft["no_cache"]
        drain_s = sum(drains[name]) / requests
        overhead, bare_mean = paired_overhead(reps)
        by_clock[name] = {
            "bare_engine_best_of_n_ttft_mean_s": float(b.mean()), "no_cache_best_of_n_ttft_mean_s": float(n.mean()),
            "overhead_mean_ttft": overhead, "paired_block": PAIR_BLOCK, "bare_engine_paired_ttft_mean_s": bare_mean,
            "overhead_best_of_n_mean_ttft": float(n.mean() / b.mean() - 1),
            "overhead_median_request_ratio": float(np.median(n / b)) - 1,
            "overhead_mean_latency": float(latency["no_cache"].mean() / latency["bare_engine"].mean() - 1),
            "no_cache_drain_ms_per_request": round(1e3 * drain_s, 3),
            "overhead_mean_ttft_drain_charged": overhead + drain_s / bare_mean,
            "per_rep_service_ttft_mean_s": [{c: statistics.fmean(s.result.ttft_s for s in rep[c]) for c in rep}
                                            for rep in reps]}
    return best_wall, {
        "mode": mode.value, "segment": segment, "reps": len(runs), "clock": clock, **by_clock[clock],
        "by_clock": by_clock, "no_cache_drains": len(drains["cpu"]),
        "cpu_ms_per_request": {c: cpu_ms_per_request([run[c] for run in runs]) for c in runs[0]},
        "service_phases_mean_ms": {c: phase_means_ms([s.result for rep in served["wall"] for s in rep[c]])
                                   for c in runs[0]}}


# --- blocks: one config at a time, its background work on its own account -------------------------


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


@dataclass
class ConfigRun:
    """One config's part of ``serve_segments``: its results (in stream order; each segment's drain
    added to the latency of its last request), the CPU its process spent while it served or drained,
    by thread group (``thread_cpu_s``), and each drain's duration."""

    served: list[Served] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)
    drain_s: list[float] = field(default_factory=list)

    def cpu_ms_per_request(self) -> dict[str, float]:
        return cpu_ms_per_request([self])


def cpu_ms_per_request(runs: Sequence[ConfigRun]) -> dict[str, float]:
    """CPU ms per request served, by thread group, over ``runs`` (one config's reps)."""
    served = sum(len(r.served) for r in runs)
    groups = sorted({g for r in runs for g in r.cpu_s})
    return {g: round(1e3 * sum(r.cpu_s.get(g, 0.0) for r in runs) / max(1, served), 3) for g in groups}


def one_at_a_time(serve: Callable[[ServeRequest], ServeResult], reference: Sequence[tuple[int, ...]],
                  config: str, salt: Callable[[Item], str | None] = lambda it: None
                  ) -> Callable[[Sequence[Item]], list[Served]]:
    """A ``serve_segments`` server that serves a segment's items one at a time (``serve_items``, each
    request in the cache_salt ``salt(item)``)."""
    return lambda part: serve_items(serve, part, reference, config, salt)


def in_virtual_time(run: VirtualTimeRun) -> Callable[[Sequence[Item]], list[Served]]:
    """A ``serve_segments`` server that runs ``run``'s loop until a segment's items are done (later items
    sent meanwhile are in its queue or running: they stay there until the config's next segment)."""
    return lambda part: run.serve_until(part[-1].index + 1)


def drain_charged(stack, run: VirtualTimeRun) -> Callable[[], None]:
    """A drain of ``stack`` whose time (on ``run``'s clock) advances ``run``'s clock (the server is busy)."""
    def drain() -> None:
        t0 = run.clock()
        drain_stack(stack)
        run.charge(run.clock() - t0)
    return drain


def serve_segments(serves: dict[str, Callable[[Sequence[Item]], list[Served]]], items: Sequence[Item],
                   drains: dict[str, Callable[[], object]] | None = None,
                   segment: int = 16, rotate: int = 0, lead: str | None = None,
                   clock: Callable[[], float] = time.perf_counter) -> dict[str, ConfigRun]:
    """Every config serves the stream, ``segment`` consecutive items at a time (``serves[config](part)``
    returns their results, checked against the reference: ``one_at_a_time``, ``in_virtual_time``): one
    config serves a segment, then ``drains[config]()`` waits for its in-flight transfers (L1->L2 copies, L3 writes),
    then the next config serves the same items (the first config rotates per segment, shifted by
    ``rotate``). A config's background work so runs inside its own requests or its drain, never inside
    another config's, and the drain's time is charged to the latency of the segment's last request
    (the server was busy with it). Segments short on a noisy machine keep the configs close in time
    (load drift hits all alike). ``lead``, if given, serves every segment first (the others rotate
    after it): its results may set up the others' (``VirtualTimeRun.speed``). ``clock`` measures the
    drains (wall time by default; ``time.process_time``: the CPU the process spent meanwhile)."""
    if segment < 1:
        raise ValueError(f"segment must be >= 1, got {segment}")
    if lead is not None and lead not in serves:
        raise ValueError(f"lead {lead!r} is not one of the configs {list(serves)}")
    names = [n for n in serves if n != lead]
    drains = drains or {}
    runs = {n: ConfigRun() for n in serves}
    for s, lo in enumerate(range(0, len(items), segment)):
        part = items[lo:lo + segment]
        k = (s + rotate) % max(1, len(names))
        for name in ([lead] if lead is not None else []) + names[k:] + names[:k]:
            run = runs[name]
            before = thread_cpu_s()
            done = serves[name](part)
            t0 = clock()
            drains.get(name, lambda: None)()
            drained = clock() - t0
            for group, cpu in cpu_by_group(before, thread_cpu_s()).items():
                run.cpu_s[group] = run.cpu_s.get(group, 0.0) + cpu
            last = done[-1]
            done[-1] = replace(last, result=replace(last.result, latency_s=last.result.latency_s + drained))
            run.served += done
            run.drain_s.append(drained)
    return runs


def drain_stack(stack) -> None:
    """Waits (bounded by the head's ack timeout) for every transfer the stack has in flight."""
    if stack.options.l2_slots:
        stack.client.flush_write_through_acks()


def serve_interleaved(serves: dict[str, Callable[[ServeRequest], ServeResult]], items: Sequence[Item],
                      reference: Sequence[tuple[int, ...]], rotate: int = 0) -> dict[str, list[Served]]:
    """Each item is served by every config in turn (the first config rotates, shifted by ``rotate``),
    so that load drift on a shared machine falls on all configs alike; each config has its own stack
    and state."""
    names = list(serves)
    out: dict[str, list[Served]] = {n: [] for n in names}
    for i, it in enumerate(items):
        k = (i + rotate) % len(names)
        for name in names[k:] + names[:k]:
            out[name] += serve_items(serves[name], [it], reference, name)
    return out


def best_of_reps(reps: Sequence[dict[str, list[Served]]]) -> tuple[dict[str, list[Served]], dict[str, int]]:
    """Rep 0's results, each request's ``ttft_s`` and ``latency_s`` (and, served in virtual time, its
    queue wait and client TTFT) replaced by its best (minimum) over the reps that served it with the
    same hits and computed tokens (one at a time the cache state is deterministic; in virtual time the
    schedule follows the measured step times, so reps may disagree). Returns (served, per config the
    requests whose reps disagreed on hits)."""
    def shape(r: ServeResult) -> tuple:
        return r.device_hit_tokens, r.loaded_tokens, r.storage_tokens, r.computed_tokens

    out, disagreed = {}, {}
    for name, first in reps[0].items():
        out[name], disagreed[name] = [], 0
        for i, s in enumerate(first):
            same = [rep[name][i] for rep in reps if shape(rep[name][i].result) == shape(s.result)]
            disagreed[name] += len(same) < len(reps)
            timing = s.timing and replace(s.timing, queue_wait_s=min(x.timing.queue_wait_s for x in same),
                                          client_ttft_s=min(x.timing.client_ttft_s for x in same))
            out[name].append(Served(s.item, replace(s.result, ttft_s=min(x.result.ttft_s for x in same),
                                                    latency_s=min(x.result.latency_s for x in same)), timing))
    return out, disagreed


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


def warm_up_and_baselines(args, items: Sequence[Item], ref, base: ModelRunner, bare: BareEngine,
                          full: Callable[[str], object]):
    """Compile pass (full stack, then a cold stack on its L3, own namespace), then the no-reuse pair
    (bare engine vs a stack that never reuses; ``overhead_pair``: in segments of ``args.pair_segment``,
    and interleaved per request for comparison).

    Returns (served, spot checks, stats, overhead) keyed by config name, for the two baseline configs.
    """
    log("  warm-up pass (full stack then a cold stack on its L3, own namespace; compiles transfers) ...")
    run_stack("warm-up", full("l3-warm-up"), base, items, ref, salt=lambda it: "warm-up", spot=1)
    run_stack("warm-up cold", full("l3-warm-up"), base, items, ref, salt=lambda it: "warm-up", spot=0)
    log(f"  bare_engine + no_cache in segments of {args.pair_segment} requests (no_cache drained after each of its "
        f"segments), and interleaved per request, {args.overhead_reps} rep(s) ...")
    b, n, nc_stats, (sp_b, sp_n), overhead = overhead_pair(
        bare, base, lambda tag: full(f"l3-nc-{tag}"), items, ref, args.overhead_reps, args.pair_segment, args.clock)
    for clock, seg in overhead["by_clock"].items():
        interleaved = overhead["interleaved"]["by_clock"][clock]
        log(f"  no-reuse overhead on the {clock} clock (mean service TTFT, blocks of {PAIR_BLOCK} requests, median "
            f"of {args.overhead_reps} rep(s)): {seg['overhead_mean_ttft']:+.1%} in segments of {args.pair_segment} "
            f"(best-of-N {seg['overhead_best_of_n_mean_ttft']:+.1%}; drain {seg['no_cache_drain_ms_per_request']:.2f} "
            f"ms per request; {seg['overhead_mean_ttft_drain_charged']:+.1%} with every drain on a TTFT), "
            f"{interleaved['overhead_mean_ttft']:+.1%} interleaved per request")
    return ({"bare_engine": b, "no_cache": n}, {"bare_engine": sp_b, "no_cache": sp_n},
            {"bare_engine": {}, "no_cache": nc_stats}, overhead)
