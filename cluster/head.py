"""``CacheHead``: the single decision point of one replica (DESIGN.md §1).

The head owns the replica's radix tree and its L1 page allocator (and, with HiCache, the L2 slot
allocator and the transfer plans). In embedded mode it is a plain object in the serving process; the
cluster wraps the same class in a Ray actor. Exactly one thread calls into a head at a time.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from hicache.cluster.begin import BeginParams, BeginResult
from hicache.cluster.builder import (
    ComponentConfig,
    ComponentKind,
    KVCacheConfig,
    MambaConfig,
    SWAConfig,
    build_kv_cache,
    cache_config,
    components_of,
)
from hicache.cluster.controller import HiCacheController, LoadBackParams, LoadBackResult
from hicache.cluster.cost_model import PrefillReport
from hicache.cluster.drain import DrainParams, DrainProgress, run_drain
from hicache.cluster.errors import HiCacheDrainingError
from hicache.cluster.events import CacheCounters, KVEvent
from hicache.cluster.metrics import HeadMetrics
from hicache.cluster.policy import HiCacheConfig
from hicache.cluster.route_query import RouteAnswer, RouteQuery, answer
from hicache.cluster.storage_tier import PrefetchParams, PrefetchProgress, PrefetchState, StorageParams
from hicache.cluster.tier_events import TierEvents
from hicache.cluster.token_account import TokenAccount, add_to, explain_l3
from hicache.cluster.tree import (
    CacheCapacityError,
    EvictResult,
    FinishResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
    RadixKey,
    RadixTree,
    RequestState,
    SWAComponent,
    TreeConfig,
    TreeStats,
)
from hicache.cluster.tree.params import NO_VALUES
from hicache.cluster.worker_group import WorkerGroup
from hicache.workers import ComponentPool, KVCacheSpec


@dataclass(frozen=True)
class HeadConfig:
    """One replica's cache. ``components``: the model's extra cache components besides Full attention KV
    (always there), one config each (``SWAConfig``, ``MambaConfig``; a list is stored as a tuple); the head
    builds its tree from them with ``build_kv_cache``."""

    replica: str = "default"
    tree: TreeConfig = field(default_factory=TreeConfig)
    hicache: HiCacheConfig | None = None  # None: L1 only (no host tier, no workers needed)
    components: tuple[ComponentConfig, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.replica, str) or not self.replica or "/" in self.replica:
            raise ValueError(f"replica must be a non-empty name without '/', got {self.replica!r}")
        by_kind = components_of(self.components)
        object.__setattr__(self, "components", tuple(by_kind[k] for k in ComponentKind if k in by_kind))
        self.cache_config()  # the composition is valid (ValueError naming the value)
        for c in self.components:  # pools too small for one request
            if isinstance(c, SWAConfig) and c.num_tokens is not None and c.num_tokens < c.window:
                raise ValueError(f"swa num_tokens={c.num_tokens} is smaller than one request's window "
                                 f"(window={c.window})")
            if isinstance(c, MambaConfig) and c.num_slots is not None and c.num_slots < 2:
                raise ValueError(f"mamba num_slots={c.num_slots}: a request needs 2 (its working state and "
                                 "the cached state it continues from)")
        if self.hicache is not None:
            host_slots = self.component_host_slots()
            for c in self.components:
                if isinstance(c, MambaConfig):
                    continue  # (one state is all an L2 hit needs: any positive host_slots holds it)
                host_tokens = host_slots[c.kind.value] * self.tree.page_size
                if host_tokens < c.window:  # an L2 hit needs the window's SWA pages there
                    raise ValueError(f"swa host_tokens={host_tokens} cannot hold one window (window={c.window})")

    def cache_config(self) -> KVCacheConfig:
        """What ``build_kv_cache`` builds this head's tree from."""
        return cache_config(self.tree, self.components)

    def component_pools(self, specs: Mapping[str, KVCacheSpec]) -> tuple[ComponentPool, ...]:
        """The component pools every host worker keeps for this head (with a host tier): per component with
        an L2, its layout ``specs[name]`` (the engine's), its L1 pages (the head's pool ids) and L2 slots.
        ValueError naming what is missing."""
        out = []
        for name, slots in self.component_host_slots().items():
            c = next(c for c in self.components if c.kind.value == name)
            spec = specs.get(name)
            if spec is None:
                raise ValueError(f"the {name} component has a host tier: its workers need a pool layout "
                                 f"(component_specs[{name!r}], a KVCacheSpec of its layers)")
            if isinstance(c, MambaConfig):
                if c.num_slots is None:
                    raise ValueError(f"workers hold the {name} pool: its config needs num_slots, got {c!r}")
                out.append(ComponentPool(name, spec, c.num_slots, slots))  # (a state is one page of its pool)
                continue
            if c.num_tokens is None:
                raise ValueError(f"workers hold the {name} pool: its config needs num_tokens, got {c!r}")
            out.append(ComponentPool(name, spec, c.num_tokens // self.tree.page_size, slots))
        return tuple(out)

    def component_host_slots(self) -> dict[str, int]:
        """L2 ids of each component pool with a host tier (none without ``hicache``; SWA: pages, Mamba:
        states): what the head's controller allocates and every worker's ``ComponentPool`` of that name must
        hold."""
        if self.hicache is None:
            return {}
        out = {}
        for c in self.components:
            if isinstance(c, SWAConfig):
                out[c.kind.value] = (self.hicache.host_slots if c.host_tokens is None
                                     else c.host_tokens // self.tree.page_size)
            else:
                out[c.kind.value] = self.hicache.host_slots if c.host_slots is None else c.host_slots
        return out

    @property
    def component_kinds(self) -> tuple[ComponentKind, ...]:
        """Full first, then the extra components (``ComponentKind`` order)."""
        kinds = self.cache_config().components
        assert isinstance(kinds, tuple)  # KVCacheConfig parses its components into kinds
        return kinds


class Method(str, Enum):
    """Calls that may travel in a batched ``step``."""

    MATCH_PREFIX = "match_prefix"
    INSERT = "insert"
    CACHE_FINISHED_REQ = "cache_finished_req"
    CACHE_UNFINISHED_REQ = "cache_unfinished_req"
    EVICT = "evict"
    INC_LOCK_REF = "inc_lock_ref"
    DEC_LOCK_REF = "dec_lock_ref"
    ALLOC = "alloc"
    FREE = "free"
    RESET = "reset"
    STATS = "stats"
    CACHE_STATS = "cache_stats"
    INIT_LOAD_BACK = "init_load_back"
    WAIT_LOAD_BACK = "wait_load_back"
    READY_TO_LOAD_HOST_CACHE = "ready_to_load_host_cache"
    CHECK_HICACHE_EVENTS = "check_hicache_events"
    FLUSH_WRITE_THROUGH_ACKS = "flush_write_through_acks"
    TAKE_EVENTS = "take_events"
    ATTACH_STORAGE_BACKEND = "attach_storage_backend"
    DETACH_STORAGE_BACKEND = "detach_storage_backend"
    PREFETCH_FROM_STORAGE = "prefetch_from_storage"
    CHECK_PREFETCH_PROGRESS = "check_prefetch_progress"
    PAUSE_STORAGE_WRITES = "pause_storage_writes"
    RESUME_STORAGE_WRITES = "resume_storage_writes"
    BEGIN_REQUEST = "begin_request"
    ROUTE_QUERY = "route_query"
    DRAIN = "drain"
    ABANDON_REQUEST = "abandon_request"
    SWA_PAGES = "swa_pages"
    TRIM_REQUEST = "trim_request"
    REPORT_PREFILL = "report_prefill"
    REPORT_TOKENS = "report_tokens"  # (last: wire codes follow this order)


NO_ARG_METHODS = frozenset({  # called without an argument
    Method.RESET, Method.STATS, Method.CACHE_STATS, Method.READY_TO_LOAD_HOST_CACHE,
    Method.CHECK_HICACHE_EVENTS, Method.FLUSH_WRITE_THROUGH_ACKS, Method.TAKE_EVENTS, Method.DETACH_STORAGE_BACKEND,
    Method.PAUSE_STORAGE_WRITES, Method.RESUME_STORAGE_WRITES,
})


CALL_ERRORS = (ValueError, TypeError, RuntimeError)  # what fails one call of a step, not the step


# One Call and one CallResult per call of a step: slotted, not frozen (see ``LoadBackParams``).


@dataclass(slots=True)
class Call:
    method: Method
    arg: Any = None

    def __post_init__(self) -> None:
        if type(self.method) is not Method:  # the usual case is a Method already
            try:
                self.method = Method(self.method)
            except ValueError:
                raise ValueError(f"unknown method {self.method!r}; choose one of {[m.value for m in Method]}") from None


@dataclass(slots=True)
class CallResult:
    ok: bool
    value: Any = None
    error: BaseException | None = None

    def unwrap(self) -> Any:
        if not self.ok:
            raise self.error  # type: ignore[misc]
        return self.value


class CacheHead:
    def __init__(self, config: HeadConfig | None = None, workers: WorkerGroup | None = None) -> None:
        self.config = config or HeadConfig()
        if not isinstance(self.config, HeadConfig):
            raise TypeError(f"config must be a HeadConfig, got {type(self.config).__name__}")
        self.tree: RadixTree = build_kv_cache(self.config.cache_config())
        self.controller: HiCacheController | None = None
        self.metrics: HeadMetrics | None = None
        self.drain_progress: DrainProgress | None = None  # set by a drain: no new request is admitted
        if self.config.hicache is not None:
            if workers is None:
                raise ValueError("a head with a host tier (HeadConfig.hicache) needs its workers")
            self.controller = HiCacheController(self.tree, self.config.hicache, workers,
                                                self.config.component_host_slots())
        self.prompt_tokens: dict[str, int] = {}  # served requests' prompt tokens by fate (``report_tokens``)
        self._events = self._tier_events()

    def _tier_events(self) -> TierEvents:
        """The tree's tier listener: the controller's, or (L1 only) one that just tells misses apart."""
        if self.controller is not None:
            return self.controller.events
        events = TierEvents(self.tree.page_size, CacheCounters(), self.tree.cached_elsewhere, keep_events=False)
        self.tree.listener = events
        return events

    @property
    def page_size(self) -> int:
        return self.tree.page_size

    def _hicache(self) -> HiCacheController:
        if self.controller is None:
            raise RuntimeError("this head has no host tier (HeadConfig.hicache is None)")
        return self.controller

    def _sent(self, result: Any) -> Any:
        """Sends the transfers a call queued (one plan per call) and returns its result."""
        ctl = self.controller
        if ctl is not None and ctl.send_due:  # most calls queue nothing due (no call into submit then)
            ctl.submit()
        return result

    # -- control API (DESIGN.md §3) ----------------------------------------------------------------
    def match_prefix(self, params: MatchPrefixParams | RadixKey) -> MatchResult:
        key = params.key if isinstance(params, MatchPrefixParams) else params
        result = self.tree.match_prefix(key)
        self._events.record_match(key, result)
        return result

    def insert(self, params: InsertParams) -> InsertResult:
        return self._sent(self.tree.insert(params))

    def cache_finished_req(self, state: RequestState) -> FinishResult:
        return self._sent(self.tree.cache_finished_req(state))

    def cache_unfinished_req(self, state: RequestState) -> RequestState:
        return self._sent(self.tree.cache_unfinished_req(state))

    def abandon_request(self, state: RequestState) -> int:
        """A failed request: frees its pages and component values, unlocks its prefix, caches nothing."""
        return self.tree.abandon_request(state)

    def trim_request(self, state: RequestState) -> int:
        """Marks a running request's SWA pages out of its window spare (reclaimed first when the SWA pool is
        short); returns how many (``RadixTree.trim_request``; 0 for trees without SWA)."""
        return self.tree.trim_request(state)

    def swa_pages(self, pages: np.ndarray | Sequence[int]) -> np.ndarray:
        """SWA page ids of L1 pages a request or the tree holds (-1: SWA KV dropped), for an engine that keeps
        sliding-window KV in the SWA pool (``SWAComponent.translate``)."""
        swa = self.tree.component("swa")  # ValueError naming the components when there is none
        arr = np.asarray(pages)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(f"pages must be a 1-D int array, got {pages!r:.80}")
        cap = self.tree.full.allocator.capacity
        if arr.size and (arr.min() < 0 or arr.max() >= cap):
            raise ValueError(f"page ids {arr.tolist()[:8]} are outside L1 [0, {cap})")
        assert isinstance(swa, SWAComponent)
        return swa.translate(arr).astype(np.int32)

    def evict(self, num_tokens: int) -> EvictResult:
        return self._sent(self.tree.evict(num_tokens))

    def inc_lock_ref(self, node_id: int) -> int:
        return self.tree.inc_lock_ref(node_id)

    def dec_lock_ref(self, node_id: int) -> int:
        return self.tree.dec_lock_ref(node_id)

    def alloc(self, num_tokens: int) -> np.ndarray:
        """L1 pages, evicting as needed. Nodes locked only by in-flight backups become evictable once
        acked, so when short the head applies the acks that came and retries, then (bounded) waits for the
        rest and retries once (only the L1->L2 copies: L2->L3 writes free no L1 page; ``relieve_l1``). The
        controller notes the size (``note_alloc``: held backups go before they would make one wait)."""
        ctl = self.controller
        if ctl is not None and type(num_tokens) is int:  # (a bad value: the tree raises naming it)
            ctl.note_alloc(-(-num_tokens // self.tree.page_size))
        try:
            return self._sent(self.tree.alloc(num_tokens))
        except CacheCapacityError:
            if ctl is None or not ctl.in_flight:
                raise
            return self._sent(ctl.relieve_l1(lambda: self.tree.alloc(num_tokens)))

    def free(self, pages: np.ndarray | Sequence[int]) -> None:
        self.tree.free(pages)

    def reset(self) -> None:
        """Empties the tree, L1 and L2 (a cold replica); keeps the configuration, and with it an attached L3:
        its content is persistent and shared, so the new state is attached to the same backend (same
        params; the workers' clients are reopened) and gets L3 hits right away. Queued manifest entries
        are written before. If re-attaching fails, the reset still happened, L3 is detached on the head
        and on the workers (one consistent view) and the error is raised."""
        ctl = self.controller
        if ctl is not None and ctl.in_flight:
            raise RuntimeError(f"cannot reset with {ctl.in_flight} transfers in flight")
        storage = None if ctl is None or ctl.storage is None else ctl.storage.params
        if ctl is not None and storage is not None:
            ctl.detach_storage_backend()  # nothing in flight: writes the queued manifest, closes the clients
        self.tree.reset()
        self.drain_progress = None  # a cold replica admits requests again
        if ctl is None:
            self._events = self._tier_events()
        else:
            self.controller = HiCacheController(self.tree, ctl.config, ctl.workers, ctl.component_host_slots)
            self._events = self.controller.events
            if self.metrics is not None:
                self.controller.on_transfer = self.metrics.observe_transfer
            if storage is not None:
                try:
                    self.controller.attach_storage_backend(storage)
                except Exception as e:
                    try:
                        self.controller.workers.attach_storage(None)  # workers drop any client they opened
                    except Exception:  # a lost worker: the cluster head rebuilds its gang anyway
                        pass
                    raise RuntimeError(f"reset done, but L3 {storage.url} could not be re-attached "
                                       f"(now detached): {type(e).__name__}: {e}") from e

    def stats(self) -> TreeStats:
        return self.tree.stats()

    def cache_stats(self) -> dict[str, Any]:
        """Tier occupancy and hit/miss counters (L1 always; L2 with a host tier)."""
        st = self.tree.stats()
        out: dict[str, Any] = {
            "page_size": st.page_size,
            "device_tokens": st.cached_tokens,
            "device_capacity_tokens": st.capacity_pages * st.page_size,
            "device_evicted_tokens": st.evicted_tokens,
            # by fate (hit tier or miss reason), each served prompt token once; plain str keys
            "prompt_tokens": dict(self.prompt_tokens),
        }
        for comp in self.tree.extra_components:  # per pool: {"swa": SWAStats, "mamba": MambaStats} as dicts
            out.update((name, dataclasses.asdict(value)) for name, value in comp.stats().items())
        if self.controller is not None:
            ctl = self.controller
            out.update(
                host_tokens=ctl.host.host_tokens,
                host_capacity_tokens=ctl.host.num_slots * st.page_size,
                host_evicted_tokens=ctl.host.evicted_tokens,
                in_flight=ctl.in_flight,
                **ctl.counters.snapshot(),
            )
            for name, pool in ctl.component_hosts.items():  # the component's L2 beside its L1 figures
                out[name].update(pool.stats())
            if ctl.storage is not None:
                out["storage"] = ctl.storage.counters.snapshot()
                out["storage"]["cost_model"] = ctl.storage.cost.snapshot()  # the load-or-recompute estimates
                if ctl.storage.values:  # a hybrid tree's component values in L3
                    out["storage"]["component_values"] = dataclasses.asdict(ctl.storage.values.counters)
                out["storage_errors"] = ctl.workers.storage_errors()  # by kind (transfers.L3_ERROR_KINDS)
                out["storage_breaker"] = ctl.workers.storage_breaker_state()  # closed / half_open / open
        if self.drain_progress is not None:
            out["drain"] = self.drain_progress.snapshot()
        return out

    def drain(self, params: DrainParams) -> DrainProgress:
        """A preemption notice came: stop admitting, store what L3 lacks within the deadline, flush
        the manifest (``hicache.cluster.drain``). Returns what it did (also in ``cache_stats``)."""
        if type(params) is not DrainParams:
            raise TypeError(f"drain expects DrainParams, got {type(params).__name__}")
        try:  # (run_drain refuses new requests from its start on: drain_progress)
            return run_drain(self, params)
        finally:
            self.publish_metrics()

    # -- metrics ---------------------------------------------------------------------------------------
    def attach_metrics(self, metrics: HeadMetrics) -> None:
        """Exports this head's counters through ``metrics`` (call ``publish_metrics`` to push a snapshot)."""
        self.metrics = metrics
        if self.controller is not None:
            self.controller.on_transfer = metrics.observe_transfer

    def publish_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.update(self.cache_stats())

    # -- HiCache hooks (scheduler loop) --------------------------------------------------------------
    def init_load_back(self, params: LoadBackParams) -> LoadBackResult:
        return self._hicache().init_load_back(params)

    def wait_load_back(self, load_id: int) -> bool:
        return self._hicache().wait_load_back(load_id)

    def ready_to_load_host_cache(self) -> int:
        return self._hicache().submit()

    def check_hicache_events(self) -> int:
        return self._hicache().check_events()

    def flush_write_through_acks(self) -> int:
        return self._hicache().flush_write_through_acks()

    def take_events(self) -> list[KVEvent]:
        return self._hicache().take_events()

    # -- L3 ------------------------------------------------------------------------------------------
    def attach_storage_backend(self, params: StorageParams) -> None:
        self._hicache().attach_storage_backend(params)

    def detach_storage_backend(self) -> None:
        self._hicache().detach_storage_backend()

    def prefetch_from_storage(self, params: PrefetchParams) -> PrefetchProgress:
        return self._hicache().prefetch_from_storage(params)

    def check_prefetch_progress(self, req_id: str) -> PrefetchProgress:
        return self._hicache().check_prefetch_progress(req_id)

    def pause_storage_writes(self) -> None:
        self._hicache().pause_storage_writes()

    def resume_storage_writes(self) -> int:
        return self._hicache().resume_storage_writes()

    def report_prefill(self, report: PrefillReport) -> None:
        """The serving side's measured prefill, for the L3 cost model (dropped without L3 attached)."""
        if type(report) is not PrefillReport:
            raise TypeError(f"report_prefill expects PrefillReport, got {type(report).__name__}")
        storage = self.controller.storage if self.controller is not None else None
        if storage is not None:
            storage.cost.report_prefill(report)

    def report_tokens(self, account: TokenAccount) -> None:
        """A served request's prompt tokens by fate (``hicache.cluster.token_account``), summed per replica."""
        if type(account) is not TokenAccount:
            raise TypeError(f"report_tokens expects TokenAccount, got {type(account).__name__}")
        add_to(self.prompt_tokens, account)

    # -- a request's start in one call ---------------------------------------------------------------
    def begin_request(self, params: BeginParams) -> BeginResult:
        """Hold writes, check the arrival's prefetch, match, ask L3, lock + alloc: the calls
        ``BeginParams`` lists, in one (see ``hicache.cluster.begin``). The L3 query goes to storage as
        ``prefetch_from_storage`` of the match's deepest node would (negative cache, stop policy, bounds).
        A failed alloc (``CacheCapacityError``) releases the lock it took before it raises."""
        if type(params) is not BeginParams:
            raise TypeError(f"begin_request expects BeginParams, got {type(params).__name__}")
        if self.drain_progress is not None:
            raise HiCacheDrainingError(f"replica {self.config.replica!r} is draining (preemption notice): "
                                       "admit this request elsewhere")
        ctl = self.controller
        l3 = params.check_prefetch is not None or params.prefetch_id is not None
        if params.hold_writes or l3:
            ctl = self._hicache()  # raises without a host tier
            if params.hold_writes:
                ctl.pause_storage_writes()
        fetched = 0
        checked = None
        # (no L3 attached: no prefetch ran, and ``prefetch_matched`` answers "L3 unavailable")
        if params.check_prefetch is not None and ctl is not None and ctl.storage is not None:
            checked = ctl.check_prefetch_progress(params.check_prefetch)
            if checked.state is PrefetchState.DONE:
                fetched = checked.tokens
        key = params.key
        if params.l1_only:  # (a request's start after its load-back: its match was recorded before the load)
            m = self.tree.match_prefix(key, use_host=False)
            why = None
        else:
            m = self.match_prefix(key)
            why = self._events.last_miss_reason
        if checked is not None and checked.state is not PrefetchState.DONE:
            why = explain_l3(why, checked)
        l3_s = 0.0
        if params.prefetch_id is not None:
            hit, n = m.device_hit_len + m.host_hit_len, key.token_ids.shape[0]
            if hit < params.l3_below and n - n % self.tree.page_size - hit >= params.l3_min_tokens:
                t = time.perf_counter()
                assert ctl is not None  # checked above
                started = ctl.prefetch_matched(params.prefetch_id, key, m)
                l3_s = time.perf_counter() - t
                why = explain_l3(why, started)
                if started.state is not PrefetchState.NOT_STARTED:
                    return BeginResult(m, fetched, started, None, l3_s, miss_reason=why)
        if m.host_hit_len:
            return BeginResult(m, fetched, None, None, l3_s, miss_reason=why)
        t = time.perf_counter()
        node = self.tree.node(m.last_device_node)
        self.tree.lock_path(node)
        try:
            pages = self.alloc(params.total_tokens - m.device_hit_len)
        except BaseException:
            self.tree.unlock_path(node)
            raise
        values = NO_VALUES
        if self.tree.hooks.begin_request:  # hybrid trees only: the request's component values (Mamba slot)
            try:
                # its decode computes positions [prompt, total - 1) at most: the last new token is never fed
                values = self.tree.begin_request(m, range(len(key), params.total_tokens - 1))
            except BaseException:
                self.tree.free(pages)
                self.tree.unlock_path(node)
                raise
        return BeginResult(m, fetched, None, pages, l3_s, time.perf_counter() - t, values, why)

    def route_query(self, query: RouteQuery) -> RouteAnswer:
        """A router's dry run (``hicache.cluster.route_query``): hit lengths per tier, L1 room; no effects."""
        if type(query) is not RouteQuery:
            raise TypeError(f"route_query expects RouteQuery, got {type(query).__name__}")
        ctl = self.controller
        return answer(self.tree, query.keys, 0 if ctl is None else ctl.in_flight)

    def call(self, call: Call) -> Any:
        """Dispatches one ``Call`` (the single entry point a transport needs)."""
        if not isinstance(call, Call):
            raise TypeError(f"expected a Call, got {call!r}")
        return self.dispatch(call.method, call.arg)

    def dispatch(self, method: Method, arg: Any = None) -> Any:
        """Runs one call given as its ``Method`` and argument (``call`` without building a ``Call``)."""
        fn = getattr(self, method.value)
        return fn() if method in NO_ARG_METHODS else fn(arg)

    def step(self, calls: Sequence[Call]) -> list[CallResult]:
        """Runs a batch of calls in order; one call's error does not stop the others."""
        results = []
        for call in calls:
            try:
                if not isinstance(call, Call):
                    raise TypeError(f"expected a Call, got {call!r}")
                results.append(CallResult(True, self.dispatch(call.method, call.arg)))
            except CALL_ERRORS as exc:
                results.append(CallResult(False, error=exc))
        return results
