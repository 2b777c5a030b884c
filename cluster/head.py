"""``CacheHead``: the single decision point of one replica (DESIGN.md §1).

The head owns the replica's radix tree and its L1 page allocator (and, with HiCache, the L2 slot
allocator and the transfer plans). In embedded mode it is a plain object in the serving process; the
cluster wraps the same class in a Ray actor. Exactly one thread calls into a head at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from hicache.cluster.tree import (
    EvictResult,
    FinishResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
    RadixKey,
    RadixTree,
    RequestState,
    TreeConfig,
    TreeStats,
)


@dataclass(frozen=True)
class HeadConfig:
    replica: str = "default"
    tree: TreeConfig = field(default_factory=TreeConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.replica, str) or not self.replica or "/" in self.replica:
            raise ValueError(f"replica must be a non-empty name without '/', got {self.replica!r}")


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


_NO_ARG = frozenset({Method.RESET, Method.STATS})


@dataclass(frozen=True)
class Call:
    method: Method | str
    arg: Any = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "method", Method(self.method))
        except ValueError:
            raise ValueError(f"unknown method {self.method!r}; choose one of {[m.value for m in Method]}") from None


@dataclass(frozen=True)
class CallResult:
    ok: bool
    value: Any = None
    error: BaseException | None = None

    def unwrap(self) -> Any:
        if not self.ok:
            raise self.error  # type: ignore[misc]
        return self.value


class CacheHead:
    def __init__(self, config: HeadConfig | None = None) -> None:
        self.config = config or HeadConfig()
        self.tree = RadixTree(self.config.tree)

    @property
    def page_size(self) -> int:
        return self.tree.page_size

    # -- control API (DESIGN.md §3) ----------------------------------------------------------------
    def match_prefix(self, params: MatchPrefixParams | RadixKey) -> MatchResult:
        key = params.key if isinstance(params, MatchPrefixParams) else params
        return self.tree.match_prefix(key)

    def insert(self, params: InsertParams) -> InsertResult:
        return self.tree.insert(params)

    def cache_finished_req(self, state: RequestState) -> FinishResult:
        return self.tree.cache_finished_req(state)

    def cache_unfinished_req(self, state: RequestState) -> RequestState:
        return self.tree.cache_unfinished_req(state)

    def evict(self, num_tokens: int) -> EvictResult:
        return self.tree.evict(num_tokens)

    def inc_lock_ref(self, node_id: int) -> int:
        return self.tree.inc_lock_ref(node_id)

    def dec_lock_ref(self, node_id: int) -> int:
        return self.tree.dec_lock_ref(node_id)

    def alloc(self, num_tokens: int) -> np.ndarray:
        return self.tree.alloc(num_tokens)

    def free(self, pages: np.ndarray | Sequence[int]) -> None:
        self.tree.free(pages)

    def reset(self) -> None:
        self.tree.reset()

    def stats(self) -> TreeStats:
        return self.tree.stats()

    def call(self, call: Call) -> Any:
        """Dispatches one ``Call`` (the single entry point a transport needs)."""
        if not isinstance(call, Call):
            raise TypeError(f"expected a Call, got {call!r}")
        method = getattr(self, call.method.value)
        return method() if call.method in _NO_ARG else method(call.arg)

    def step(self, calls: Sequence[Call]) -> list[CallResult]:
        """Runs a batch of calls in order; one call's error does not stop the others."""
        results = []
        for call in calls:
            try:
                results.append(CallResult(True, self.call(call)))
            except (ValueError, TypeError, RuntimeError) as exc:
                results.append(CallResult(False, error=exc))
        return results
