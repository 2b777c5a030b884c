"""``TierAwareRouter``: picks, per request, the replica with the lowest expected time to first token.

It asks every candidate's head what it holds for the prompt (``RouteQuery``: L1/L2/L3 hit lengths, one
dry-run call per head, all candidates at once) and each replica's load (queued and running requests),
then scores them with a ``TTFTModel``. The routing call is bounded: candidates that do not answer within
``probe_timeout_s`` are scored on load alone (and the shared L3 the others report); when none answers
the choice is load-only. Each decision carries its probe latency; ``stats`` sums them.

Usable from plain Python (``route``, over any ``ReplicaProbe``); ``serve_router`` wraps the same scoring
(``rank``) in a Ray Serve request router. Owned by the serving front end; not thread-safe (one routing
thread, as Serve's router loop).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from hicache.cluster.route_query import RouteAnswer, RouteQuery
from hicache.cluster.tree import RadixKey
from hicache.routing.cost import Estimate, TTFTModel, estimate


@dataclass(frozen=True)
class ReplicaLoad:
    """Requests queued and running on a replica; ``backlog_s``: the replica's own estimate of the time
    until they are done (None: unknown, the router counts each as one mean service time)."""

    queued: int = 0
    running: int = 0
    backlog_s: float | None = None

    @property
    def outstanding(self) -> int:
        return self.queued + self.running


@dataclass(frozen=True)
class ReplicaView:
    """What one replica answered: its head's ``RouteAnswer`` and its serving loop's load."""

    answer: RouteAnswer
    load: ReplicaLoad


class ReplicaProbe(Protocol):
    """One replica as the router sees it: ``probe`` asks its head (and its loop) about some prompts."""

    name: str

    def probe(self, query: RouteQuery) -> ReplicaView: ...


@dataclass(frozen=True)
class RouterOptions:
    """``probe_timeout_s``: how long a routing call waits for the heads; ``service_ewma``: weight of a new
    completion in the mean service time; ``parallel``: probe candidates on threads (False: one after the
    other on the caller's thread, for in-process heads, which answer at once)."""

    probe_timeout_s: float = 0.05
    cost: TTFTModel = field(default_factory=TTFTModel)
    service_ewma: float = 0.1
    parallel: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.probe_timeout_s, (int, float)) or not self.probe_timeout_s > 0:
            raise ValueError(f"probe_timeout_s must be > 0, got {self.probe_timeout_s!r}")
        if not isinstance(self.cost, TTFTModel):
            raise TypeError(f"cost must be a TTFTModel, got {type(self.cost).__name__}")
        if not isinstance(self.service_ewma, (int, float)) or not 0 < self.service_ewma <= 1:
            raise ValueError(f"service_ewma must be in (0, 1], got {self.service_ewma!r}")


@dataclass(frozen=True)
class RoutingDecision:
    """``index``: the chosen candidate; ``ranking``: every candidate, best first; ``estimates[i]``: the
    score of candidate i (None when it was scored on load alone); ``answered``: candidates whose head
    answered in time; ``fallback``: none did (load-only choice); ``latency_s``: the routing call."""

    index: int
    ranking: tuple[int, ...]
    estimates: tuple[Estimate | None, ...]
    answered: int
    fallback: bool
    latency_s: float


class RoutingStats:
    """Decisions, load-only fallbacks, candidates that missed the deadline, and probe latencies (the
    last ``window``), for reports."""

    def __init__(self, window: int = 10_000) -> None:
        self.decisions = 0
        self.fallbacks = 0
        self.timeouts = 0
        self.latencies: deque[float] = deque(maxlen=window)

    def note(self, decision: RoutingDecision, candidates: int) -> None:
        self.decisions += 1
        self.fallbacks += decision.fallback
        self.timeouts += candidates - decision.answered
        self.latencies.append(decision.latency_s)

    def summary(self) -> dict[str, float]:
        lat = np.asarray(self.latencies, dtype=np.float64)
        return {"decisions": self.decisions, "fallbacks": self.fallbacks, "probe_timeouts": self.timeouts,
                "latency_mean_s": float(lat.mean()) if lat.size else 0.0,
                "latency_p50_s": float(np.percentile(lat, 50)) if lat.size else 0.0,
                "latency_p99_s": float(np.percentile(lat, 99)) if lat.size else 0.0}


def rank(model: TTFTModel, prompt_len: int, views: Sequence[ReplicaView | None], loads: Sequence[float],
         service_s: float, tiebreak: int = 0) -> tuple[tuple[int, ...], tuple[Estimate | None, ...]]:
    """Candidates best first by expected TTFT. ``views[i]``: candidate i's answer (None: it did not
    answer; its load is ``loads[i]``, its hits unknown; it comes after every candidate that answered). With
    no answer at all: by load alone. Ties go to more free L1, then round the candidates from ``tiebreak``
    (so equal ones share the work)."""
    n = len(views)
    if n == 0:
        raise ValueError("rank needs at least one candidate")
    if len(loads) != n:
        raise ValueError(f"{n} views but {len(loads)} loads")
    l3_shared = max((v.answer.hits[0].l3 for v in views if v is not None and v.answer.hits), default=0)
    ests: list[Estimate | None] = []
    keys: list[tuple[Any, ...]] = []
    for i, v in enumerate(views):
        hits = v.answer.hits[0] if v is not None and v.answer.hits else None
        if v is not None and v.load.backlog_s is not None:
            est = estimate(model, prompt_len, hits, l3_shared, 1.0, v.load.backlog_s)
        else:
            est = estimate(model, prompt_len, hits, l3_shared, v.load.outstanding if v is not None else loads[i],
                           service_s)
        ests.append(est if v is not None else None)
        room = (v.answer.free_l1_tokens + v.answer.evictable_l1_tokens) if v is not None else 0
        keys.append((est.ttft_s, -room, (i - tiebreak) % n))
    if any(v is not None for v in views):  # a replica that did not answer (dead, stuck) only after the others
        keys = [(v is None, *k) for v, k in zip(views, keys)]
    order = tuple(sorted(range(n), key=keys.__getitem__))
    return order, tuple(ests)


class TierAwareRouter:
    def __init__(self, options: RouterOptions | None = None) -> None:
        self.options = options or RouterOptions()
        self.service_s = self.options.cost.service_s
        self.stats = RoutingStats()
        self._turn = 0
        self._pool: cf.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def observe_service(self, seconds: float) -> None:
        """A request's measured service time (what one queue slot ahead of a prompt costs)."""
        if seconds >= 0:
            a = self.options.service_ewma
            self.service_s = (1 - a) * self.service_s + a * seconds

    def _probe_all(self, query: RouteQuery, replicas: Sequence[ReplicaProbe]) -> list[ReplicaView | None]:
        if not self.options.parallel:
            out: list[ReplicaView | None] = []
            for r in replicas:
                try:
                    out.append(r.probe(query))
                except Exception:  # a replica that cannot answer is scored on load alone
                    out.append(None)
            return out
        with self._pool_lock:
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(max_workers=16, thread_name_prefix="hicache-route")
        futures = [self._pool.submit(r.probe, query) for r in replicas]
        cf.wait(futures, timeout=self.options.probe_timeout_s)
        views: list[ReplicaView | None] = []
        for f in futures:
            if f.done() and f.exception() is None:
                views.append(f.result())
            else:
                f.cancel()  # a late answer is dropped
                views.append(None)
        return views

    def route(self, key: RadixKey, replicas: Sequence[ReplicaProbe],
              load_of: Callable[[int], float] | None = None) -> RoutingDecision:
        """Picks one of ``replicas`` for the prompt ``key``. ``load_of(i)``: candidate i's load when its
        head does not answer (default 0: then it is ranked by the shared L3 and round robin)."""
        if not replicas:
            raise ValueError("route needs at least one replica")
        if not isinstance(key, RadixKey):
            raise TypeError(f"route expects a RadixKey, got {type(key).__name__}")
        t0 = time.perf_counter()
        views = self._probe_all(RouteQuery((key,)), replicas)
        loads = [float(load_of(i)) if load_of is not None else 0.0 for i in range(len(replicas))]
        order, ests = rank(self.options.cost, len(key), views, loads, self.service_s, self._turn)
        self._turn += 1
        answered = sum(v is not None for v in views)
        decision = RoutingDecision(order[0], order, ests, answered, answered == 0, time.perf_counter() - t0)
        self.stats.note(decision, len(replicas))
        return decision

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def register_live(router: Any) -> None:
    """Lists ``router`` in ``live_routers`` while it lives (routers Serve creates inside its handles)."""
    _LIVE.add(router)


def live_routers() -> list[Any]:
    return list(_LIVE)
