"""``HiCacheRequestRouter``: the tier-aware router as a Ray Serve custom request router (Ray >= 2.60).

Serve runs one instance per deployment handle (in the proxy, or in the process that holds the handle) on
that handle's event loop. Per request it reads the prompt's token ids from the first request argument
with a ``prompt`` attribute (``GenerateRequest``), probes every candidate replica's head (through the
replica's ``ProbeServer``, whose loopback address the replica publishes in its routing stats), all at
once on a small thread pool, waits at most ``probe_timeout_s``, and ranks the candidates with
``hicache.routing.rank``: the best one alone first, then the others, then those that did not answer.
No answer at all (no prompt, no address yet, every head late or gone): load-only, by Serve's cached
queue lengths. Each decision is recorded (``stats``, ``decisions``) with its latency; completions teach
it the mean service time (``on_request_routed`` .. ``on_request_completed``).

Probes reach 127.0.0.1: a replica on another node than the router is scored on load alone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
from ray.serve._private.common import ReplicaID
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve._private.request_router.request_router import FIFOMixin, RequestRouter

from hicache.cluster.route_query import RouteQuery
from hicache.cluster.step_channel import ChannelAddress
from hicache.cluster.tree import RadixKey
from hicache.routing.cost import TTFTModel
from hicache.routing.probes import ChannelProbe
from hicache.routing.router import ReplicaView, RoutingDecision, RoutingStats, live_routers, rank, register_live

PROBE_STATS_KEY = "hicache_probe"  # a replica's routing stats: where its ProbeServer listens


@dataclass(frozen=True)
class GenerateRequest:
    """What a client sends a hicache Serve replica: token ids, how many to generate, the namespace."""

    prompt: tuple[int, ...]
    max_new_tokens: int = 1
    extra_key: str | None = None
    cache_salt: str | None = None

    def key(self) -> RadixKey:
        return RadixKey(np.asarray(self.prompt, dtype=np.int32), self.extra_key, self.cache_salt)


@dataclass(frozen=True)
class ServeDecision:
    """One routing decision as recorded: the request, the replica ranked first, whether it was load-only."""

    request_id: str
    chosen: str  # the replica's unique id
    fallback: bool
    answered: int
    latency_s: float


def routers_in_this_process() -> list[HiCacheRequestRouter]:
    """The live routers of this process (one per deployment handle), for reports and tests."""
    return [r for r in live_routers() if type(r).__name__ == "HiCacheRequestRouter"]


def probe_address(stats: dict[str, Any]) -> ChannelAddress | None:
    """The ``ProbeServer`` address a replica published in its routing stats (None: not yet / malformed)."""
    raw = stats.get(PROBE_STATS_KEY) if isinstance(stats, dict) else None
    if not isinstance(raw, dict):
        return None
    try:
        return ChannelAddress(str(raw["node_id"]), int(raw["port"]), bytes.fromhex(raw["token"]))
    except (KeyError, TypeError, ValueError):
        return None


class HiCacheRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, probe_timeout_s: float = 0.05, cost: dict[str, float] | None = None,
                         service_ewma: float = 0.1, **_: Any) -> None:
        """Serve's hook for ``RequestRouterConfig.request_router_kwargs``."""
        if not isinstance(probe_timeout_s, (int, float)) or not probe_timeout_s > 0:
            raise ValueError(f"probe_timeout_s must be > 0, got {probe_timeout_s!r}")
        self.probe_timeout_s = float(probe_timeout_s)
        self.cost = TTFTModel(**(cost or {}))
        self.service_ewma = float(service_ewma)
        self.service_s = self.cost.service_s
        self.stats = RoutingStats()
        self.decisions: deque[ServeDecision] = deque(maxlen=1024)
        self._probes: dict[ReplicaID, ChannelProbe] = {}
        self._pool = cf.ThreadPoolExecutor(max_workers=16, thread_name_prefix="hicache-serve-route")
        self._routed_at: dict[str, float] = {}
        self._turn = 0
        # Not in this module's globals nor on the class: Serve ships this module by value (its methods see a
        # copy of its globals, and the class dict is pickled again on every deploy).
        register_live(self)

    def _probe_for(self, replica: RunningReplica) -> ChannelProbe | None:
        address = probe_address(replica.routing_stats)
        if address is None:
            return None
        probe = self._probes.get(replica.replica_id)
        if probe is None or probe.address != address:
            if probe is not None:
                probe.close()
            probe = self._probes[replica.replica_id] = ChannelProbe(replica.replica_id.unique_id, address,
                                                                    self.probe_timeout_s)
        return probe

    async def _views(self, key: RadixKey, replicas: list[RunningReplica]) -> list[ReplicaView | None]:
        loop = asyncio.get_running_loop()
        query = RouteQuery((key,))
        tasks: list[asyncio.Future[ReplicaView] | None] = []
        for r in replicas:
            probe = self._probe_for(r)
            tasks.append(None if probe is None else loop.run_in_executor(self._pool, probe.probe, query))
        live = [t for t in tasks if t is not None]
        if live:
            await asyncio.wait(live, timeout=self.probe_timeout_s)
        views: list[ReplicaView | None] = []
        for t in tasks:
            if t is not None and t.done() and not t.cancelled() and t.exception() is None:
                views.append(t.result())
            else:
                if t is not None and not t.done():
                    t.cancel()  # the thread ends by the probe's own timeout; its answer is dropped
                views.append(None)
        return views

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        t0 = time.perf_counter()
        key = _request_key(pending_request)
        loads = [float(self._replica_queue_len_cache.get(r.replica_id) or 0) for r in candidate_replicas]
        views: list[ReplicaView | None] = [None] * len(candidate_replicas)
        if key is not None:
            views = await self._views(key, candidate_replicas)
        order, ests = rank(self.cost, 0 if key is None else len(key), views, loads, self.service_s, self._turn)
        self._turn += 1
        answered = sum(v is not None for v in views)
        decision = RoutingDecision(order[0], order, ests, answered, answered == 0, time.perf_counter() - t0)
        self.stats.note(decision, len(candidate_replicas))
        if pending_request is not None:
            self.decisions.append(ServeDecision(pending_request.metadata.internal_request_id,
                                                candidate_replicas[order[0]].replica_id.unique_id,
                                                decision.fallback, answered, decision.latency_s))
        ranked = [candidate_replicas[i] for i in order]
        return [ranked[:1], ranked[1:]] if len(ranked) > 1 else [ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        if len(self._routed_at) < 100_000:
            self._routed_at[pending_request.metadata.internal_request_id] = time.perf_counter()

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        t = self._routed_at.pop(internal_request_id, None)
        if t is not None:
            a = self.service_ewma
            self.service_s = (1 - a) * self.service_s + a * (time.perf_counter() - t)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        probe = self._probes.pop(replica_id, None)
        if probe is not None:
            probe.close()


def _request_key(pending: PendingRequest | None) -> RadixKey | None:
    """The prompt of a request whose first argument with a ``prompt`` attribute holds token ids."""
    if pending is None:
        return None
    for arg in pending.args:
        if isinstance(arg, GenerateRequest):
            return arg.key()
    return None
