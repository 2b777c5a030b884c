"""``CacheClient``: what serving code holds; the same API whether the head is in-process or a Ray actor.

Every method turns into one ``Call`` handed to a transport. ``EmbeddedTransport`` calls a ``CacheHead`` in
this process (the embedded default); the cluster adds a Ray transport (every remote call with a timeout)
behind the same interface. Serving code never touches the tree directly.

``submit_step`` sends a batched step without waiting for it (an overlap scheduler prepares its next
batch while the head works on this one): the head runs steps in submission order, ``result()`` waits.
Embedded, the step has already run when ``submit_step`` returns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from hicache.cluster.begin import BeginParams, BeginResult
from hicache.cluster.controller import LoadBackParams, LoadBackResult
from hicache.cluster.cost_model import PrefillReport
from hicache.cluster.drain import DrainParams, DrainProgress
from hicache.cluster.events import KVEvent
from hicache.cluster.head import CALL_ERRORS, CacheHead, Call, CallResult, HeadConfig, Method
from hicache.cluster.route_query import RouteAnswer, RouteQuery
from hicache.cluster.storage_tier import PrefetchParams, PrefetchProgress, StorageParams
from hicache.cluster.token_account import TokenAccount
from hicache.cluster.tree import (
    EvictResult,
    FinishResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
    RadixKey,
    RequestState,
    TreeStats,
)
from hicache.cluster.worker_group import WorkerGroup


@dataclass(frozen=True)
class ResultRef:
    """A ``step`` argument taken from the result of an earlier call of the same step, so dependent
    calls share one round trip: ``offset + scale * result.field`` (``field=None``: the result itself;
    ``scale=1, offset=0``: the value as is). E.g. lock what call 3 matched and allocate the rest of a
    request: ``Call("inc_lock_ref", ResultRef(3, "last_device_node"))``,
    ``Call("alloc", ResultRef(3, "device_hit_len", scale=-1, offset=len(tokens)))``. A reference to a
    call that failed, or to a later one, fails its own call with ``ValueError``."""

    index: int
    field: str | None = None
    scale: int = 1
    offset: int = 0

    def __post_init__(self) -> None:
        for name in ("index", "scale", "offset"):
            if type(getattr(self, name)) is not int:
                raise TypeError(f"ResultRef.{name} must be an int, got {getattr(self, name)!r}")
        if self.index < 0:
            raise ValueError(f"ResultRef.index must be >= 0, got {self.index}")
        if self.field is not None and (not isinstance(self.field, str) or not self.field.isidentifier()):
            raise ValueError(f"ResultRef.field must be an attribute name or None, got {self.field!r}")



_MISSING = object()


class StepRun:
    """The results of a step while it runs, as parallel lists (``errors[i]`` is None when call ``i``
    succeeded): ``ResultRef`` arguments resolve against them, and a runner builds no ``CallResult``
    per call (the wire encodes straight from the lists)."""

    __slots__ = ("values", "errors")

    def __init__(self) -> None:
        self.values: list[Any] = []
        self.errors: list[BaseException | None] = []

    def resolve(self, index: int, field: str | None, scale: int, offset: int) -> Any:
        """The value ``ResultRef(index, field, scale, offset)`` gives the next call; ``ValueError`` when it
        names no earlier call, a failed one, a missing field, or scales a non-int."""
        if type(index) is not int or not 0 <= index < len(self.values):
            raise ValueError(f"ResultRef({index!r}) must name an earlier call of the step (this is call {len(self.values)})")
        error = self.errors[index]
        if error is not None:
            raise ValueError(f"call {index} of the step failed: {error!r}")
        result = self.values[index]
        value = result if field is None else getattr(result, field, _MISSING)
        if value is _MISSING:
            raise ValueError(f"result of call {index} ({type(result).__name__}) has no field {field!r}")
        if scale == 1 and offset == 0:
            return value
        if not isinstance(value, (int, np.integer)):
            raise ValueError(f"ResultRef with scale/offset needs an int, call {index} gave {value!r}")
        return offset + scale * int(value)

    def run(self, head: CacheHead, method: Method, arg: Any) -> None:
        """Runs one call on ``head`` and records its value, or the error that fails it alone."""
        try:
            value = head.dispatch(method, arg)
        except CALL_ERRORS as e:
            self.fail(e)
            return
        self.values.append(value)
        self.errors.append(None)

    def fail(self, error: BaseException) -> None:
        self.values.append(None)
        self.errors.append(error)

    def results(self) -> list[CallResult]:
        return [CallResult(True, v) if e is None else CallResult(False, error=e) for v, e in zip(self.values, self.errors)]


def run_with_refs(head: CacheHead, calls: Iterable[Call]) -> list[CallResult]:
    """``head.step`` for a step whose calls may carry ``ResultRef`` arguments (resolved in order)."""
    run = StepRun()
    for call in calls:
        arg = call.arg
        if type(arg) is ResultRef:
            try:
                arg = run.resolve(arg.index, arg.field, arg.scale, arg.offset)
            except ValueError as e:
                run.fail(e)
                continue
        run.run(head, call.method, arg)
    return run.results()


class PendingStep(Protocol):
    """A submitted step; ``result()`` waits for (or returns) its results, in call order."""

    def result(self) -> list[CallResult]: ...


class DoneStep:
    """A step that has already run (what an in-process transport returns from ``submit``)."""

    def __init__(self, results: list[CallResult]) -> None:
        self._results = results

    def result(self) -> list[CallResult]:
        return self._results


class Transport(Protocol):
    def call(self, call: Call) -> Any: ...

    def step(self, calls: Sequence[Call]) -> list[CallResult]: ...

    def submit(self, calls: Sequence[Call]) -> PendingStep: ...


class EmbeddedTransport:
    """Direct calls into a head living in this process."""

    def __init__(self, head: CacheHead) -> None:
        if not isinstance(head, CacheHead):
            raise TypeError(f"EmbeddedTransport needs a CacheHead, got {type(head).__name__}")
        self.head = head

    def call(self, call: Call) -> Any:
        return self.head.call(call)

    def step(self, calls: Sequence[Call]) -> list[CallResult]:
        for c in calls:
            if type(c.arg) is ResultRef:
                return run_with_refs(self.head, calls)
        return self.head.step(calls)

    def submit(self, calls: Sequence[Call]) -> DoneStep:
        return DoneStep(self.step(calls))


class CacheClient:
    def __init__(self, transport: Transport, page_size: int) -> None:
        self._transport = transport
        self.page_size = page_size
        # A head in this process: each call is its ``dispatch`` (no ``Call`` object, no transport hop);
        # else calls that go together go as one step.
        self.in_process = False
        self._call: Callable[..., Any] = self._send  # (method, arg=None)
        if type(transport) is EmbeddedTransport:
            self.in_process = True
            self._call = transport.head.dispatch

    def _send(self, method: Method, arg: Any = None) -> Any:
        return self._transport.call(Call(method, arg))

    def match_prefix(self, params: MatchPrefixParams | RadixKey) -> MatchResult:
        return self._call(Method.MATCH_PREFIX, params)

    def begin_request(self, params: BeginParams) -> BeginResult:
        """A request's start in one call (``hicache.cluster.begin``): hold writes, check its arrival's
        prefetch, match, ask L3, lock + alloc, as ``params`` says."""
        return self._call(Method.BEGIN_REQUEST, params)

    def route_query(self, query: RouteQuery) -> RouteAnswer:
        """A router's dry run: per prompt, the L1/L2/L3 hit lengths this head would give it now, and its L1
        room (``hicache.cluster.route_query``); takes no lock, starts no prefetch."""
        return self._call(Method.ROUTE_QUERY, query)

    def insert(self, params: InsertParams) -> InsertResult:
        return self._call(Method.INSERT, params)

    def cache_finished_req(self, state: RequestState) -> FinishResult:
        return self._call(Method.CACHE_FINISHED_REQ, state)

    def cache_unfinished_req(self, state: RequestState) -> RequestState:
        return self._call(Method.CACHE_UNFINISHED_REQ, state)

    def abandon_request(self, state: RequestState) -> int:
        return self._call(Method.ABANDON_REQUEST, state)

    def trim_request(self, state: RequestState) -> int:
        return self._call(Method.TRIM_REQUEST, state)

    def swa_pages(self, pages: np.ndarray) -> np.ndarray:
        return self._call(Method.SWA_PAGES, pages)

    def evict(self, num_tokens: int) -> EvictResult:
        return self._call(Method.EVICT, num_tokens)

    def inc_lock_ref(self, node_id: int) -> int:
        return self._call(Method.INC_LOCK_REF, node_id)

    def dec_lock_ref(self, node_id: int) -> int:
        return self._call(Method.DEC_LOCK_REF, node_id)

    def alloc(self, num_tokens: int) -> np.ndarray:
        return self._call(Method.ALLOC, num_tokens)

    def free(self, pages: np.ndarray | Sequence[int]) -> None:
        self._call(Method.FREE, pages)

    def reset(self) -> None:
        self._call(Method.RESET)

    def stats(self) -> TreeStats:
        return self._call(Method.STATS)

    def cache_stats(self) -> dict[str, Any]:
        return self._call(Method.CACHE_STATS)

    # -- HiCache hooks ---------------------------------------------------------------------------
    def init_load_back(self, params: LoadBackParams) -> LoadBackResult:
        return self._call(Method.INIT_LOAD_BACK, params)

    def wait_load_back(self, load_id: int) -> bool:
        return self._call(Method.WAIT_LOAD_BACK, load_id)

    def ready_to_load_host_cache(self) -> int:
        return self._call(Method.READY_TO_LOAD_HOST_CACHE)

    def check_hicache_events(self) -> int:
        return self._call(Method.CHECK_HICACHE_EVENTS)

    def flush_write_through_acks(self) -> int:
        return self._call(Method.FLUSH_WRITE_THROUGH_ACKS)

    def drain(self, params: DrainParams) -> DrainProgress:
        """Preemption notice: stop admitting, store what L3 lacks by the deadline (``CacheHead.drain``)."""
        return self._call(Method.DRAIN, params)

    def take_events(self) -> list[KVEvent]:
        return self._call(Method.TAKE_EVENTS)

    # -- L3 ----------------------------------------------------------------------------------------
    def attach_storage_backend(self, params: StorageParams) -> None:
        self._call(Method.ATTACH_STORAGE_BACKEND, params)

    def detach_storage_backend(self) -> None:
        self._call(Method.DETACH_STORAGE_BACKEND)

    def prefetch_from_storage(self, params: PrefetchParams) -> PrefetchProgress:
        return self._call(Method.PREFETCH_FROM_STORAGE, params)

    def check_prefetch_progress(self, req_id: str) -> PrefetchProgress:
        return self._call(Method.CHECK_PREFETCH_PROGRESS, req_id)

    def pause_storage_writes(self) -> None:
        self._call(Method.PAUSE_STORAGE_WRITES)

    def resume_storage_writes(self) -> int:
        return self._call(Method.RESUME_STORAGE_WRITES)

    def report_prefill(self, report: PrefillReport) -> None:
        self._call(Method.REPORT_PREFILL, report)

    def report_tokens(self, account: TokenAccount) -> None:
        self._call(Method.REPORT_TOKENS, account)

    def step(self, calls: Sequence[Call]) -> list[CallResult]:
        """Many calls in one round trip; results in order, errors per call. A call's argument may be a
        ``ResultRef`` to an earlier call's result (dependent calls in the same round trip)."""
        return self._transport.step(calls)

    def submit_step(self, calls: Sequence[Call]) -> PendingStep:
        """``step`` without waiting: steps run in submission order, ``result()`` of the returned step
        waits for its results. A remote transport keeps a bounded number of steps in flight (submitting
        one more waits for the oldest first)."""
        return self._transport.submit(calls)


def embedded(config: HeadConfig | None = None, workers: WorkerGroup | None = None) -> CacheClient:
    """A client bound to a fresh in-process head (the embedded default)."""
    head = CacheHead(config, workers)
    return CacheClient(EmbeddedTransport(head), head.page_size)
