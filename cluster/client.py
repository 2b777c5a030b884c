"""``CacheClient``: what serving code holds; the same API whether the head is in-process or a Ray actor.

Every method turns into one ``Call`` handed to a transport. ``EmbeddedTransport`` calls a ``CacheHead`` in
this process (the embedded default); the cluster adds a Ray transport (every remote call with a timeout)
behind the same interface. Serving code never touches the tree directly.
"""

from __future__ import annotations

from collections.abc import Sequence
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


class Transport(Protocol):
    def call(self, call: Call) -> Any: ...

    def step(self, calls: Sequence[Call]) -> list[CallResult]: ...


class EmbeddedTransport:
    """Direct calls into a head living in this process."""

    def __init__(self, head: CacheHead) -> None:
        if not isinstance(head, CacheHead):
            raise TypeError(f"EmbeddedTransport needs a CacheHead, got {type(head).__name__}")
        self.head = head

    def call(self, call: Call) -> Any:
        return self.head.call(call)

    def step(self, calls: Sequence[Call]) -> list[CallResult]:
        return self.head.step(calls)


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
        """Many calls in one round trip; results in order, errors per call."""
        return self._transport.step(calls)


def embedded(config: HeadConfig | None = None, workers: WorkerGroup | None = None) -> CacheClient:
    """A client bound to a fresh in-process head (the embedded default)."""
    head = CacheHead(config, workers)
    return CacheClient(EmbeddedTransport(head), head.page_size)
