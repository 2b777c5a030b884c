"""``CacheClient``: what serving code holds; the same API whether the head is in-process or a Ray actor.

Every method turns into one ``Call`` handed to a transport. ``EmbeddedTransport`` calls a ``CacheHead`` in
this process (the embedded default); the cluster adds a Ray transport (every remote call with a timeout)
behind the same interface. Serving code never touches the tree directly.

``submit_step`` sends a batched step without waiting for it (an overlap scheduler prepares its next
batch while the head works on this one): the head runs steps in submission order, ``result()`` waits.
Embedded, the step has already run when ``submit_step`` returns.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from hicache.cluster.controller import LoadBackParams, LoadBackResult
from hicache.cluster.events import KVEvent
from hicache.cluster.head import Call, CacheHead, CallResult, HeadConfig, Method
from hicache.cluster.storage_tier import PrefetchParams, PrefetchProgress, StorageParams
from hicache.cluster.transfers import WorkerGroup
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

    def resolve(self, results: Sequence[CallResult]) -> Any:
        """The value for the call that follows ``results`` (the step's results so far)."""
        if self.index >= len(results):
            raise ValueError(f"ResultRef({self.index}) must name an earlier call of the step (this is call {len(results)})")
        res = results[self.index]
        if not res.ok:
            raise ValueError(f"call {self.index} of the step failed: {res.error!r}")
        value = res.value if self.field is None else getattr(res.value, self.field, _MISSING)
        if value is _MISSING:
            raise ValueError(f"result of call {self.index} ({type(res.value).__name__}) has no field {self.field!r}")
        if self.scale == 1 and self.offset == 0:
            return value
        if not isinstance(value, (int, np.integer)):
            raise ValueError(f"ResultRef with scale/offset needs an int, call {self.index} gave {value!r}")
        return self.offset + self.scale * int(value)


_MISSING = object()


def run_with_refs(head: CacheHead, calls: Iterable[Call]) -> list[CallResult]:
    """``head.step`` for a step whose calls may carry ``ResultRef`` arguments (resolved in order)."""
    results: list[CallResult] = []
    for call in calls:
        if type(call.arg) is ResultRef:
            try:
                call = Call(call.method, call.arg.resolve(results))
            except ValueError as e:
                results.append(CallResult(False, error=e))
                continue
        results.extend(head.step([call]))
    return results


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
        if any(type(c.arg) is ResultRef for c in calls):
            return run_with_refs(self.head, calls)
        return self.head.step(calls)

    def submit(self, calls: Sequence[Call]) -> DoneStep:
        return DoneStep(self.step(calls))


class CacheClient:
    def __init__(self, transport: Transport, page_size: int) -> None:
        self._transport = transport
        self.page_size = page_size

    def _call(self, method: Method, arg: Any = None) -> Any:
        return self._transport.call(Call(method, arg))

    def match_prefix(self, params: MatchPrefixParams | RadixKey) -> MatchResult:
        return self._call(Method.MATCH_PREFIX, params)

    def insert(self, params: InsertParams) -> InsertResult:
        return self._call(Method.INSERT, params)

    def cache_finished_req(self, state: RequestState) -> FinishResult:
        return self._call(Method.CACHE_FINISHED_REQ, state)

    def cache_unfinished_req(self, state: RequestState) -> RequestState:
        return self._call(Method.CACHE_UNFINISHED_REQ, state)

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
