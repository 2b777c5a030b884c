"""Routing benchmark: 4 replicas, one shared L3, four routers, on the Mooncake trace and on multi-turn chat.

``python -m benchmarks.routing_bench --json PATH [--quick]``

Replicas: 4 embedded stacks (``hicache.reference.stack.build_stack``: head + HostWorker + reference
engine in this process), the same L1/L2 each, one ``file://`` L3 directory shared by all four (fresh
stacks and a fresh L3 per router). Routers, each on the same request stream:

* ``round_robin``;
* ``power_of_two``: Ray Serve's ``PowerOfTwoChoicesRequestRouter`` (Serve's default), the real class;
* ``ray_prefix_affinity``: Ray Serve LLM's ``PrefixCacheAffinityRouter``, the real class with its real
  ``PrefixTreeActor`` (a local Ray instance), fed each prompt's equivalent text;
* ``hicache_tier_aware``: ``hicache.routing.TierAwareRouter`` asking each replica's head
  (``route_query``) and its load, with a ``TTFTModel`` calibrated here.

The Ray routers are driven from Python: ``TraceReplica`` stands for a Serve ``RunningReplica`` (its id,
its queue length) and Serve's own ``_select_from_candidate_replicas`` picks among the ranks they return.

Time is virtual (a discrete-event replay, FCFS per replica): a request is sent at its trace timestamp
(time-scaled so the replicas would be ``--load`` busy if nothing were cached), or for chat after its
conversation's previous answer; it is routed then (loads are the virtual queues: requests queued or
running on each replica at that instant; the backlog in seconds counts each queued one at the replica's
mean service time) and queued on its replica. When that replica is free, at its virtual start, the
request is served for real (one at a time, start to finish, ``Scheduler.serve``, then its backups
flushed), and its time on the clock is the calibrated cost of how it was really served (``--clock``):
client TTFT = queue wait + the routing call + its TTFT. L3 follows the same clock (``VirtualL3``): a page
a request stores becomes visible to every replica's lookups (and to the router's view of the heads) at
that request's virtual finish plus its modelled write time, never earlier, whatever the router; what a
replica holds in L1/L2 is its own state at the request's start.

Trace replay (``traces/README.md``): each hash id becomes ``--block-tokens`` synthetic tokens (a
deterministic function of the id; the trace's 512-token blocks scaled down to fit the reference
engine) and, for text routers, an equivalent 8-character text (two prompts share a text prefix exactly
when they share hash ids); prompts are cut to the engine's context; outputs are scaled like inputs.

JSON: ``{"workload", "routers": [{"name", "prefill_tokens_computed", "hit_rate", "ttft_mean_s",
"ttft_p90_s", "max_over_mean_load", ...}]}`` per workload (``max_over_mean_load``: requests served by
the busiest replica over the mean). Every router's outputs are compared with the first router's
(``outputs_agree``): each is exact.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import heapq
import itertools
import json
import math
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.report import jsonable
from benchmarks.workload import MODEL, log, poisson_ticks
from hicache.cluster.cost_model import CostOptions
from hicache.cluster.route_query import RouteQuery, TierHits
from hicache.cluster.tree import RadixKey
from hicache.reference.engine.config import ForwardConfig
from hicache.reference.engine.runner import ModelRunner
from hicache.reference.serve_types import ServeRequest, ServeResult
from hicache.reference.stack import EmbeddedStack, StackOptions, build_stack, warm_up
from hicache.routing import HeadProbe, ReplicaLoad, ReplicaView, RouterOptions, TierAwareRouter, TTFTModel
from hicache.storage import FsspecStorage, ModelFingerprint, Namespace, PoolKind, PoolTransfer, StorageConfig, page_keys
from hicache.workloads import MultiTurnSpec, multi_turn

TRACE_NAME = Path("shared") / "traces" / "mooncake_synthetic_trace.jsonl"


def default_trace() -> Path:
    """``shared/traces/...`` in the checkout or the nearest folder above it that has one."""
    for d in Path(__file__).resolve().parents[1:]:
        if (d / TRACE_NAME).is_file():
            return d / TRACE_NAME
    return Path("/work") / TRACE_NAME

FWD = ForwardConfig(chunk_size=16, page_size=8, max_pages=128)  # max context 1024 tokens
REPLICAS = 4
_FREE, _SEND = 0, 1  # event kinds, in the order they run at the same virtual time
ROUTERS = ("round_robin", "power_of_two", "ray_prefix_affinity", "hicache_tier_aware", "hicache_tier_aware_counts")


@dataclass(frozen=True)
class Request:
    index: int
    send_s: float  # trace: its arrival; chat: the earliest it may be sent (after its previous turn)
    prompt: np.ndarray  # i32[n]
    text: str  # the equivalent text a text-based router sees
    max_new_tokens: int
    conversation: int | None = None  # chat: the next turn of a conversation waits for this one


@dataclass(frozen=True)
class TextPrompt:
    """A request argument as Ray Serve LLM's routers read it (``.prompt``)."""

    prompt: str


# -- workloads -------------------------------------------------------------------------------------
def block_tokens(hash_id: int, n: int) -> np.ndarray:
    return np.random.default_rng([7, hash_id]).integers(0, MODEL.vocab_size, n, dtype=np.int32)


def block_text(hash_id: int) -> str:
    return f"{hash_id:08x}"


def trace_requests(path: Path, limit: int | None, block: int) -> tuple[list[Request], float]:
    """The trace's requests (the first ``limit``) and its duration in seconds."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = rows[:limit] if limit else rows
    max_blocks = (FWD.max_context - 64) // block
    reqs = []
    for i, r in enumerate(rows):
        ids = r["hash_ids"][:max_blocks]
        n = min(max(1, round(r["input_length"] * block / 512)), len(ids) * block)
        prompt = np.concatenate([block_tokens(h, block) for h in ids])[:n]
        text = "".join(block_text(h) for h in ids)[: max(1, n * 8 // block)]
        out = max(1, min(round(r["output_length"] * block / 512), 32))
        reqs.append(Request(i, r["timestamp"] / 1000.0, prompt, text, out))
    return reqs, rows[-1]["timestamp"] / 1000.0


def chat_requests(quick: bool) -> tuple[list[list[Request]], float]:
    """Multi-turn chat (``hicache.workloads.multi_turn``, shapes scaled to the engine): one list of
    turns per conversation; conversation c's first turn is sent at a Poisson tick."""
    spec = MultiTurnSpec(conversations=16 if quick else 48, turns=4 if quick else 6, system_prompts=4,
                         system_tokens=(96, 192), user_tokens=(8, 40), output_tokens=(4, 12),
                         vocab_size=MODEL.vocab_size, seed=3)
    rounds = multi_turn(spec)
    convs: list[list[Request]] = [[] for _ in range(spec.conversations)]
    ticks = poisson_ticks(spec.conversations, 1.0, seed=5)
    k = 0
    for rnd in rounds:
        for t in rnd:
            text = ",".join(map(str, t.prompt.tolist()))
            convs[t.conversation].append(Request(k, float(ticks[t.conversation]) if t.round == 0 else 0.0, t.prompt,
                                                 text, int(len(t.output)), t.conversation))
            k += 1
    return convs, float(ticks[-1])


@dataclass(frozen=True)
class ServiceClock:
    """How long a served request occupies its replica on the virtual clock. ``measured``: the wall
    times ``Scheduler.serve`` took (on a shared CPU, other processes' load is in them); ``model``: the
    calibrated per-token costs applied to how the request was really served (tokens computed, loaded
    from L2, fetched from L3, decoded), so routers are compared on their decisions, not on the noise."""

    mode: str
    cost: TTFTModel
    decode_s: float
    l3_write_s_per_token: float = 0.0  # after its finish, a request's L3 writes take this per token stored

    def times(self, res: ServeResult, max_new_tokens: int) -> tuple[float, float]:
        if self.mode == "measured":
            return res.ttft_s, res.latency_s
        c = self.cost
        l3 = res.storage_tokens
        ttft = (c.request_s + res.computed_tokens * c.compute_s_per_token + (res.loaded_tokens - l3) * c.l2_s_per_token
                + l3 * (c.l3_s_per_token + c.l2_s_per_token))
        return ttft, ttft + (max_new_tokens - 1) * self.decode_s


# -- the Ray routers' view of a replica -------------------------------------------------------------
class TraceReplica:
    """What Serve's request routers read of a ``RunningReplica``: its id, node, queue length (here: the
    requests queued or running on this replica's virtual clock)."""

    def __init__(self, deployment_id: Any, index: int, queue_len: Callable[[], int]) -> None:
        from ray.serve._private.common import ReplicaID

        self.replica_id = ReplicaID(f"replica-{index}", deployment_id)
        self.index = index
        self._queue_len = queue_len
        self.node_id = "node-0"
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()
        self.routing_stats: dict[str, Any] = {}
        self.max_ongoing_requests = 1 << 20
        self.is_cross_language = False

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self._queue_len()


class RayRouterDriver:
    """One of Ray Serve's request routers, driven per request: ``choose_replicas`` then Serve's own
    ``_select_from_candidate_replicas`` (lowest queue among the first rank that has one), then
    ``on_request_routed``."""

    def __init__(self, name: str, replicas: int, queue_len: Callable[[int], int]) -> None:
        from ray.serve._private.common import DeploymentHandleSource, DeploymentID

        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        dep = DeploymentID(name="bench", app_name="routing")
        if name == "power_of_two":
            from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter as cls
            kwargs: dict[str, Any] = {}
        else:
            from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
                PrefixCacheAffinityRouter as cls,
            )
            from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTreeActor

            self.tree = PrefixTreeActor.remote()
            kwargs = {"tree_actor": self.tree}
        self.replicas = [TraceReplica(dep, i, (lambda i=i: queue_len(i))) for i in range(replicas)]

        async def start() -> Any:  # the router binds to the running loop
            router = cls(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN, self_node_id="node-0")
            router.initialize_state(**kwargs)
            router.update_replicas(self.replicas)
            return router

        self.router = self.loop.run_until_complete(start())

    def route(self, req: Request) -> int:
        return self.loop.run_until_complete(self._route(req))

    async def _route(self, req: Request) -> int:
        from ray.serve._private.common import RequestMetadata
        from ray.serve._private.request_router.common import PendingRequest

        pending = PendingRequest([TextPrompt(req.text)], {}, RequestMetadata(str(req.index), str(req.index)))
        ranks = await self.router.choose_replicas(self.replicas, pending)
        chosen = None
        for rank in ranks:
            if rank:
                chosen = await self.router._select_from_candidate_replicas(rank, 0)
                if chosen is not None:
                    break
        if chosen is None:
            raise RuntimeError(f"{type(self.router).__name__} chose no replica for request {req.index}")
        self.router.on_request_routed(pending, chosen.replica_id, None)
        return chosen.index

    def close(self) -> None:
        self.loop.close()


# -- L3 in virtual time -----------------------------------------------------------------------------
class VirtualL3:
    """The replicas' one shared L3 as the replay's virtual clock sees it. Every page a replica stores is
    on disk at once (the replay flushes each request's writes after serving it), but readers see it only
    from the virtual time its write is done: the writing request's finish on its replica's clock plus the
    modelled write time of the pages it stored (``write_s_per_token``). ``now``: the virtual time of the
    lookup being served (a request's start on its replica), or of the routing call. The replay runs on one
    thread; the lock covers the storage threads that call ``wrote``."""

    def __init__(self, write_s_per_token: float, page_size: int) -> None:
        self.write_s_per_token = write_s_per_token
        self.page_size = page_size
        self.now = 0.0
        self.visible_at: dict[str, float] = {}  # page key -> virtual time readers see it from
        self._written: list[str] = []  # pages stored by the request being served, not published yet
        self._lock = threading.Lock()
        self.fingerprint: ModelFingerprint | None = None
        self._memo: tuple[RadixKey | None, list[str]] = (None, [])

    def open(self, url: str, fingerprint: ModelFingerprint, config: StorageConfig) -> FsspecStorage:
        """``StackOptions.open_storage``: each replica's L3 client, gated by this clock."""
        self.fingerprint = fingerprint
        return VirtualTimeStorage(self, url, fingerprint, config)

    def wrote(self, keys: Sequence[str]) -> None:
        with self._lock:
            self._written.extend(keys)

    def publish(self, finish_s: float) -> float:
        """The pages stored since the last call become visible at ``finish_s`` + their write time (a page
        another replica's write made visible earlier keeps its time); returns that time."""
        with self._lock:
            keys, self._written = self._written, []
        at = finish_s + len(keys) * self.page_size * self.write_s_per_token
        for k in keys:
            if self.visible_at.get(k, math.inf) > at:
                self.visible_at[k] = at
        return at

    def visible_pages(self, keys: Sequence[str], found: int) -> int:
        """How many of the first ``found`` pages of ``keys`` a reader sees at ``now`` (a prefix)."""
        for i in range(found):
            if self.visible_at.get(keys[i], math.inf) > self.now:
                return i
        return found

    def visible_tokens(self, key: RadixKey) -> int:
        """The prefix of ``key`` whose pages a reader sees at ``now``, in tokens (what a head reports as
        stored in L3 is capped to it: a head learns of a write when it is done)."""
        if self.fingerprint is None:
            return 0
        if self._memo[0] is not key:
            ns = Namespace(self.fingerprint, key.extra_key, key.cache_salt)
            self._memo = (key, page_keys(ns, np.asarray(key.token_ids, dtype=np.int64)))
        keys = self._memo[1]
        return self.visible_pages(keys, len(keys)) * self.page_size


class VirtualTimeStorage(FsspecStorage):
    """A replica's L3 client in the replay: the real ``FsspecStorage``, whose answers (existence, reads)
    end at the first page ``VirtualL3`` does not show yet, and whose stored pages it reports."""

    def __init__(self, l3: VirtualL3, url: str, fingerprint: ModelFingerprint, config: StorageConfig) -> None:
        super().__init__(url, fingerprint, config)
        self.l3 = l3

    def batch_exists(self, keys: Sequence[str], *, first_page: int = 0, pool: PoolKind = PoolKind.KV,
                     timeout_s: float | None = None, min_pages: int = 1,
                     fingerprint: ModelFingerprint | None = None, chunk_start_key: str | None = None) -> int:
        found = super().batch_exists(keys, first_page=first_page, pool=pool, timeout_s=timeout_s,
                                     min_pages=min_pages, fingerprint=fingerprint, chunk_start_key=chunk_start_key)
        seen = self.l3.visible_pages(keys, found)
        if seen == found or seen < min_pages:
            return seen
        # Asked again up to what is visible: a fetch of fewer pages than an object holds cannot name that
        # object (it is named by its last page), so the answer ends where the readable objects end.
        return super().batch_exists(keys[:seen], first_page=first_page, pool=pool, timeout_s=timeout_s,
                                    min_pages=min_pages, fingerprint=fingerprint, chunk_start_key=chunk_start_key)

    def batch_get_pools(self, transfers: Sequence[PoolTransfer], *,
                        timeout_s: float | None = None) -> list[list[bool]]:
        out = super().batch_get_pools(transfers, timeout_s=timeout_s)
        for t, got in zip(transfers, out):
            seen = self.l3.visible_pages(t.keys, len(got))
            got[seen:] = [False] * (len(got) - seen)
        return out

    def batch_set_pools(self, transfers: Sequence[PoolTransfer], *,
                        timeout_s: float | None = None) -> list[list[bool]]:
        out = super().batch_set_pools(transfers, timeout_s=timeout_s)
        self.l3.wrote([k for t, ok in zip(transfers, out) for k, o in zip(t.keys, ok) if o])
        return out


class VirtualProbe:
    """A replica's head as the router sees it in the replay: its answer with the L3 prefix capped to
    what ``VirtualL3`` shows at the routing call (a head marks a prefix stored when its write is done)."""

    def __init__(self, probe: HeadProbe, l3: VirtualL3 | None) -> None:
        self.name = probe.name
        self._probe = probe
        self._l3 = l3

    def probe(self, query: RouteQuery) -> ReplicaView:
        view = self._probe.probe(query)
        if self._l3 is None:
            return view
        hits = tuple(TierHits(h.l1, h.l2, min(h.l3, self._l3.visible_tokens(k)))
                     for h, k in zip(view.answer.hits, query.keys))
        return ReplicaView(dataclasses.replace(view.answer, hits=hits), view.load)


# -- replay ---------------------------------------------------------------------------------------
class Replicas:
    """4 fresh stacks on one fresh L3 directory, with their virtual clocks: per replica one request runs at
    a time, the others wait in its FCFS queue."""

    def __init__(self, options: StackOptions, runner: ModelRunner, l3_dir: Path | None, l3: VirtualL3 | None,
                 service_s: float) -> None:
        opts = dataclasses.replace(options, l3_url=None if l3_dir is None else f"file://{l3_dir}",
                                   open_storage=None if l3 is None else l3.open)
        self.stacks: list[EmbeddedStack] = [build_stack(opts, runner) for _ in range(REPLICAS)]
        self.l3 = l3
        self.queues: list[deque[tuple[int, int, float]]] = [deque() for _ in range(REPLICAS)]  # (stream, turn, arrival)
        self.busy_until = [0.0] * REPLICAS  # the running request's finish (<= now: idle)
        self.mean_service = [service_s] * REPLICAS  # what the replica's loop expects of a queued request
        self.now = 0.0

    def load(self, r: int, backlog: bool = True) -> ReplicaLoad:
        """Requests queued and running on replica r now; with ``backlog``, its time until they are done as
        its loop estimates it (the running one's rest, each queued one at the replica's mean service)."""
        running = int(self.busy_until[r] > self.now)
        queued = len(self.queues[r])
        rest = max(0.0, self.busy_until[r] - self.now) + queued * self.mean_service[r]
        return ReplicaLoad(queued, running, rest if backlog else None)

    def outstanding(self, r: int) -> int:
        return self.load(r).outstanding

    def idle(self, r: int, t: float) -> bool:
        return self.busy_until[r] <= t and not self.queues[r]

    def serve(self, r: int, req: Request, start: float, clock: ServiceClock) -> tuple[ServeResult, float, float]:
        """Serves ``req`` on replica ``r`` from virtual time ``start`` (for real, now: L3 answers as at
        ``start``), publishes what it stored in L3; (result, its TTFT from ``start``, its finish)."""
        if self.l3 is not None:
            self.l3.now = start
        stack = self.stacks[r]
        res = stack.scheduler.serve(ServeRequest(req.prompt, req.max_new_tokens))
        stack.client.flush_write_through_acks()  # its L3 writes are on disk before any later request's lookup
        ttft_s, latency_s = clock.times(res, req.max_new_tokens)
        finish = start + latency_s
        if self.l3 is not None:
            self.l3.publish(finish)
        self.busy_until[r] = finish
        self.mean_service[r] = 0.9 * self.mean_service[r] + 0.1 * latency_s
        return res, ttft_s, finish

    def negative_cache_hits(self) -> int:
        """L3 lookups the heads skipped for a recent miss (a real-time TTL: the replay wants none)."""
        return sum(int(s.client.cache_stats().get("storage", {}).get("prefetch_negative_hits", 0))
                   for s in self.stacks)


def make_router(name: str, reps: Replicas, cost: TTFTModel) -> tuple[Callable[[Request], int], Callable[[float], None], Any]:
    """(route(request) -> replica, observe(service seconds), the router object)."""
    if name == "round_robin":
        turn = iter(range(1 << 62))
        return (lambda req: next(turn) % REPLICAS), (lambda s: None), None
    if name in ("power_of_two", "ray_prefix_affinity"):
        drv = RayRouterDriver(name, REPLICAS, reps.outstanding)
        return drv.route, (lambda s: None), drv
    if name in ("hicache_tier_aware", "hicache_tier_aware_counts"):
        router = TierAwareRouter(RouterOptions(cost=cost, parallel=False))
        backlog = name == "hicache_tier_aware"
        probes = [VirtualProbe(HeadProbe(f"replica-{i}", s.client, (lambda i=i: reps.load(i, backlog))), reps.l3)
                  for i, s in enumerate(reps.stacks)]
        return (lambda req: router.route(RadixKey(req.prompt), probes).index), router.observe_service, router
    raise ValueError(f"unknown router {name!r}; choose from {ROUTERS}")


def replay(name: str, streams: Sequence[Sequence[Request]], scale: float, options: StackOptions,
           runner: ModelRunner, clock: ServiceClock, tmp: Path, shared_l3: bool = True) -> dict[str, Any]:
    """Routes and serves ``streams`` (each a chain: a request is sent after the previous one finished,
    or a single request) with router ``name``; returns its record (and outputs, for the exactness check).

    Events in virtual time: a send routes the request and queues it on its replica; a replica that
    frees (or an idle one that gets a request) serves the next of its queue then, for real, with L3
    showing what is written by that time (``VirtualL3``), and frees again at the request's finish."""
    l3_dir = tmp / f"l3-{name}" if shared_l3 else None
    l3 = VirtualL3(clock.l3_write_s_per_token, options.forward.page_size) if shared_l3 else None
    reps = Replicas(options, runner, l3_dir, l3, clock.cost.service_s)
    route, observe, router = make_router(name, reps, clock.cost)
    # (virtual time, kind: 0 a replica frees / 1 a request is sent, order, stream or replica, turn)
    events = [(s[0].send_s * scale, _SEND, s[0].index, k, 0) for k, s in enumerate(streams) if s]
    heapq.heapify(events)
    sent_at: dict[int, float] = {}
    ttft_of: dict[int, float] = {}  # by request index: client TTFT, its routing call
    route_of: dict[int, float] = {}
    computed, prompt_tokens, served = 0, 0, [0] * REPLICAS
    tiers = {"l1": 0, "l2_loaded": 0, "l3_fetched": 0}
    missed: dict[str, int] = {}  # computed prompt tokens by why they were not reused
    outputs: dict[int, tuple[int, ...]] = {}

    def start(r: int, k: int, j: int, at: float) -> None:
        req = streams[k][j]
        res, ttft, finish = reps.serve(r, req, at, clock)
        nonlocal computed, prompt_tokens
        observe(finish - at)
        ttft_of[req.index] = at - sent_at[req.index] + ttft  # queue wait (and the routing call) + its own TTFT
        computed += res.computed_tokens
        prompt_tokens += res.prompt_len
        tiers["l1"] += res.device_hit_tokens
        tiers["l2_loaded"] += res.loaded_tokens - res.storage_tokens
        tiers["l3_fetched"] += res.storage_tokens
        for reason, n in res.tokens.missed if res.tokens is not None else ():
            missed[reason.value] = missed.get(reason.value, 0) + n
        served[r] += 1
        outputs[req.index] = res.output
        heapq.heappush(events, (finish, _FREE, req.index, r, 0))
        if j + 1 < len(streams[k]):
            nxt = streams[k][j + 1]
            heapq.heappush(events, (max(finish, nxt.send_s * scale), _SEND, nxt.index, k, j + 1))

    while events:
        t, kind, _, a, j = heapq.heappop(events)
        reps.now = t
        if kind == _FREE:
            if reps.busy_until[a] <= t and reps.queues[a]:
                k, jj, arrival = reps.queues[a].popleft()
                start(a, k, jj, max(t, arrival))
            continue
        req = streams[a][j]
        sent_at[req.index] = t
        if l3 is not None:
            l3.now = t
        w = time.perf_counter()
        r = route(req)
        route_of[req.index] = time.perf_counter() - w
        arrival = t + route_of[req.index]  # the routing call delays the request
        if reps.idle(r, t):
            start(r, a, j, arrival)
        else:
            reps.queues[r].append((a, j, arrival))
    negative = reps.negative_cache_hits()
    for s in reps.stacks:
        s.client.flush_write_through_acks()
    if router is not None and hasattr(router, "close"):
        router.close()
    if l3_dir is not None:
        shutil.rmtree(l3_dir, ignore_errors=True)
    order = sorted(ttft_of)
    tt = np.asarray([ttft_of[i] for i in order])
    lat = np.asarray([route_of[i] for i in order])
    bare = tt - lat
    rec: dict[str, Any] = {
        "name": name,
        "prefill_tokens_computed": int(computed),
        "hit_rate": 1.0 - computed / prompt_tokens,
        "ttft_mean_s": float(tt.mean()),
        "ttft_p90_s": float(np.percentile(tt, 90)),
        "max_over_mean_load": max(served) / (sum(served) / REPLICAS),
        "requests": len(order),
        "prompt_tokens": int(prompt_tokens),
        "reused_tokens": tiers,
        "requests_per_replica": served,
        "route_latency_mean_s": float(lat.mean()),
        "route_latency_p99_s": float(np.percentile(lat, 99)),
        "ttft_mean_excl_route_s": float(bare.mean()),  # the same requests, the routing call not counted
        "ttft_p90_excl_route_s": float(np.percentile(bare, 90)),
        "missed_tokens": missed,
        "l3_negative_cache_hits": negative,
    }
    if isinstance(router, TierAwareRouter):
        rec["router_stats"] = router.stats.summary()
    return {"record": rec, "outputs": outputs}


# -- calibration ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Calibration:
    cost: TTFTModel
    decode_s_per_token: float
    l3_write_s_per_token: float  # a served prompt's L1->L2->L3 backup, until L3 holds it


def calibrate(options: StackOptions, runner: ModelRunner, tmp: Path, reps: int = 5) -> Calibration:
    """The router's ``TTFTModel`` from this machine: per-token TTFT of a prompt computed, loaded back
    from L2 and fetched from L3, a request's fixed cost; the decode time per output token; the time per
    token until a served prompt is stored in L3. The fastest of ``reps`` runs each (other processes on a
    shared CPU only ever add time)."""
    rng = np.random.default_rng(11)
    n = 256
    rows: dict[str, list[float]] = {"compute": [], "l2": [], "l3": [], "fixed": [], "decode": [], "write": []}
    for i in range(reps):
        l3_dir = tmp / f"calib-{i}"
        opts = dataclasses.replace(options, l3_url=f"file://{l3_dir}")
        a, b = build_stack(opts, runner), build_stack(opts, runner)
        small = ServeRequest(rng.integers(0, MODEL.vocab_size, 9, dtype=np.int32), 1)
        rows["fixed"].append(a.scheduler.serve(small).ttft_s)
        p = ServeRequest(rng.integers(0, MODEL.vocab_size, n + 1, dtype=np.int32), 9)
        first = a.scheduler.serve(p)
        rows["compute"].append(first.ttft_s / n)
        rows["decode"].append((first.latency_s - first.ttft_s) / 8)
        t = time.perf_counter()
        a.client.flush_write_through_acks()
        rows["write"].append((time.perf_counter() - t) / n)
        a.client.evict(options.l1_pages * FWD.page_size)
        rows["l2"].append(a.scheduler.serve(p).ttft_s / n)
        a.client.flush_write_through_acks()
        rows["l3"].append(b.scheduler.serve(p).ttft_s / n)
        b.client.flush_write_through_acks()
        shutil.rmtree(l3_dir, ignore_errors=True)
    med = {k: float(np.min(v)) for k, v in rows.items()}
    l2 = max(0.0, med["l2"] - med["fixed"] / n)
    l3 = max(0.0, med["l3"] - med["fixed"] / n - l2)
    cost = TTFTModel(compute_s_per_token=med["compute"], l2_s_per_token=l2, l3_s_per_token=l3,
                     request_s=med["fixed"], service_s=med["compute"] * n)
    return Calibration(cost, med["decode"], med["write"])


def time_scale(streams: Sequence[Sequence[Request]], duration_s: float, cost: TTFTModel, decode_s: float,
               load: float) -> float:
    """The factor on send times that keeps the replicas ``load`` busy if nothing were cached."""
    work = sum(cost.request_s + len(r.prompt) * cost.compute_s_per_token + (r.max_new_tokens - 1) * decode_s
               for s in streams for r in s)
    return work / (REPLICAS * load) / max(duration_s, 1e-9)


# -- main -------------------------------------------------------------------------------------------
def run_workload(label: str, streams: Sequence[Sequence[Request]], scale: float, options: StackOptions,
                 runner: ModelRunner, clock: ServiceClock, routers: Sequence[str], tmp: Path,
                 shared_l3: bool) -> dict[str, Any]:
    records, first_outputs, agree = [], None, True
    for name in routers:
        t = time.perf_counter()
        out = replay(name, streams, scale, options, runner, clock, tmp, shared_l3)
        rec = out["record"]
        if first_outputs is None:
            first_outputs = out["outputs"]
        else:
            agree = agree and out["outputs"] == first_outputs
        log(f"{label} {name}: computed {rec['prefill_tokens_computed']} hit {rec['hit_rate']:.3f} "
            f"ttft mean {rec['ttft_mean_s'] * 1e3:.1f} ms p90 {rec['ttft_p90_s'] * 1e3:.1f} ms "
            f"load max/mean {rec['max_over_mean_load']:.2f} ({time.perf_counter() - t:.0f} s)")
        records.append(rec)
    floor = prefill_floor(streams, first_outputs or {}, options.forward.page_size)
    # all replicas' L1+L2 as one LRU cache (write-through: a replica holds max(L1, L2) distinct pages)
    pooled = prefill_floor(streams, first_outputs or {}, options.forward.page_size,
                           REPLICAS * max(options.l1_pages, options.l2_slots))
    log(f"{label}: prefill floor (one unbounded cache, instant sharing) {floor}; the replicas' L1+L2 "
        f"pooled as one LRU cache: {pooled}")
    return {"workload": label, "time_scale": scale, "outputs_agree": agree, "prefill_floor_tokens": floor,
            "prefill_pooled_lru_tokens": pooled, "routers": records}


def prefill_floor(streams: Sequence[Sequence[Request]], outputs: dict[int, tuple[int, ...]], page_size: int,
                  capacity_pages: int | None = None) -> int:
    """Prefill tokens of one cache that every request reaches and that holds everything sent before it
    the instant it was sent (requests in index order: the trace's time order, chat's rounds): with
    ``capacity_pages`` None, unbounded, what no router over any tiers can beat; else that many pages,
    least recently used evicted first (all replicas' caches pooled into one). As the engine: a request
    reuses whole pages of all its prompt tokens but the last; it leaves its prompt and its output (but
    the last token) cached."""
    children: dict[tuple[int, bytes], int] = {}
    parent: dict[int, tuple[int, bytes]] = {}
    lru: OrderedDict[int, None] = OrderedDict()  # node ids, least recently used first (leaves before parents)
    ids = itertools.count(1)  # (0: the root)
    computed = 0

    def touch(path: list[int]) -> None:
        for n in reversed(path):  # a parent ends up more recent than its children: leaves go first
            lru[n] = None
            lru.move_to_end(n)
        while capacity_pages is not None and len(lru) > capacity_pages:
            n, _ = lru.popitem(last=False)
            del children[parent.pop(n)]  # (a leaf: its children, less recent, went before it)

    for req in sorted((r for s in streams for r in s), key=lambda r: r.index):
        node = hit = 0
        path: list[int] = []
        key = np.asarray(req.prompt[:-1], dtype=np.int32)
        for i in range(len(key) // page_size):
            nxt = children.get((node, key[i * page_size:(i + 1) * page_size].tobytes()))
            if nxt is None:
                break
            node, hit = nxt, hit + page_size
            path.append(node)
        computed += len(req.prompt) - hit
        seq = np.concatenate([np.asarray(req.prompt, np.int32), np.asarray(outputs[req.index], np.int32)])[:-1]
        node, path = 0, []
        for i in range(len(seq) // page_size):
            edge = (node, seq[i * page_size:(i + 1) * page_size].tobytes())
            if edge not in children:
                children[edge] = next(ids)
                parent[children[edge]] = edge
            node = children[edge]
            path.append(node)
        touch(path)
    return computed


def targets(wl: dict[str, Any]) -> dict[str, Any]:
    recs = {r["name"]: r for r in wl["routers"]}
    ours = recs.get("hicache_tier_aware")
    others = [r for n, r in recs.items() if not n.startswith("hicache_")]
    if ours is None or not others:
        return {}
    best = min(others, key=lambda r: r["prefill_tokens_computed"])
    return {
        "best_other": best["name"],
        "prefill_ratio": best["prefill_tokens_computed"] / max(1, ours["prefill_tokens_computed"]),
        "ttft_mean_vs_best_other": ours["ttft_mean_s"] / min(r["ttft_mean_s"] for r in others),
        "ttft_p90_vs_best_other": ours["ttft_p90_s"] / min(r["ttft_p90_s"] for r in others),
        # the most any router could compute fewer than the best other one (1.3 is the target)
        "best_other_over_floor": best["prefill_tokens_computed"] / max(1, wl.get("prefill_floor_tokens", 0)),
        "best_other_over_pooled_lru": best["prefill_tokens_computed"] / max(1, wl.get("prefill_pooled_lru_tokens", 0)),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="the first 1000 trace requests, a small chat")
    ap.add_argument("--trace", type=Path, default=None, help="default: shared/traces/ above the checkout")
    ap.add_argument("--requests", type=int, default=0, help="trace requests (0: all; --quick: 1000)")
    ap.add_argument("--block-tokens", type=int, default=8, help="tokens per trace hash id")
    ap.add_argument("--load", type=float, default=0.9, help="replica utilization if nothing were cached")
    ap.add_argument("--l1-pages", type=int, default=256)
    ap.add_argument("--l2-slots", type=int, default=1024)
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--clock", choices=("model", "measured"), default="model",
                    help="service times on the virtual clock: calibrated per-token costs, or the wall times")
    ap.add_argument("--l3", choices=("shared", "none"), default="shared",
                    help="one file:// L3 shared by the replicas, or none (L1+L2 per replica only)")
    ap.add_argument("--workloads", default="trace,chat")
    args = ap.parse_args(argv)
    routers = [r for r in args.routers.split(",") if r]
    for r in routers:
        if r not in ROUTERS:
            raise SystemExit(f"unknown router {r!r}; choose from {ROUTERS}")
    import ray

    if "ray_prefix_affinity" in routers and not ray.is_initialized():
        # The prefix router's tree actor: in a Ray job, on the job's cluster (a private instance would lack
        # the job's runtime env package, kept in that cluster's GCS); else a private local instance (never
        # a cluster already running here).
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        else:
            ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    runner = ModelRunner(MODEL, FWD, num_pages=args.l1_pages)
    # On the model clock the head's load-or-recompute choice for L3 hits is off (always load: what that
    # clock's costs say); on, it would decide by this shared box's wall times, differently per router.
    options = StackOptions(MODEL, FWD, l1_pages=args.l1_pages, l2_slots=args.l2_slots, prefetch_min_tokens=8,
                           l3_cost=CostOptions(enabled=False) if args.clock == "model" else None)
    tmp = Path(tempfile.mkdtemp(prefix="routing-bench-"))
    try:
        log("warm-up (compiles)")
        warm = build_stack(dataclasses.replace(options, l3_url=f"file://{tmp}/warm"), runner)
        warm_up(warm)
        warm.client.flush_write_through_acks()
        cal = calibrate(options, runner, tmp)
        cost, decode_s = cal.cost, cal.decode_s_per_token
        log(f"calibrated: {cost}, decode {decode_s * 1e3:.2f} ms/token, "
            f"L3 write {cal.l3_write_s_per_token * 1e6:.1f} us/token")
        clock = ServiceClock(args.clock, cost, decode_s, cal.l3_write_s_per_token)
        result: dict[str, Any] = {"replicas": REPLICAS, "replica_kind": "embedded stacks in one process",
                                  "l3": "one file:// directory shared by the replicas" if args.l3 == "shared" else "none",
                                  "l1_pages": args.l1_pages, "l2_slots": args.l2_slots, "page_size": FWD.page_size,
                                  "block_tokens": args.block_tokens, "load": args.load, "clock": args.clock,
                                  "cost_model": dataclasses.asdict(cost), "decode_s_per_token": decode_s,
                                  "l3_write_s_per_token": cal.l3_write_s_per_token,
                                  "workloads": []}
        wls = [w for w in args.workloads.split(",") if w]
        if "trace" in wls:
            limit = args.requests or (1000 if args.quick else None)
            reqs, duration = trace_requests(args.trace or default_trace(), limit, args.block_tokens)
            streams = [[r] for r in reqs]
            scale = time_scale(streams, duration, cost, decode_s, args.load)
            wl = run_workload("mooncake_trace", streams, scale, options, runner, clock, routers, tmp,
                              args.l3 == "shared")
            wl["requests"] = len(reqs)
            wl["targets"] = targets(wl)
            result["workloads"].append(wl)
        if "chat" in wls:
            convs, duration = chat_requests(args.quick)
            scale = time_scale(convs, duration, cost, decode_s, args.load)
            wl = run_workload("multi_turn_chat", convs, scale, options, runner, clock, routers, tmp,
                              args.l3 == "shared")
            wl["requests"] = sum(len(c) for c in convs)
            wl["targets"] = targets(wl)
            result["workloads"].append(wl)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(jsonable(result), indent=1))
        for wl in result["workloads"]:
            log(f"{wl['workload']}: {wl['targets']} outputs agree: {wl['outputs_agree']}")
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if ray.is_initialized():
            ray.shutdown()


if __name__ == "__main__":
    main()
