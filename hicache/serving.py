"""A serving loop over the cache and the reference engine, in the order SGLang's scheduler uses its tree.

Per request: match (all prompt tokens but the last, whose logits start decoding) -> load-back of an
L2 hit (waited for, bounded) -> lock -> alloc pages for the rest -> chunked prefill (each chunk but
the last cached with ``cache_unfinished_req``) -> greedy decode -> ``cache_finished_req``.

Where the model runs (DESIGN.md §1): the ``Scheduler`` drives an ``Engine``; every engine call
forwards over the replica's L1 pool, wherever that pool lives:

* ``ModelRunner`` itself (L1 only, embedded): the runner owns its pool; nothing else touches it.
* ``WorkerEngine`` (embedded HiCache): the model sits inside the ``HostWorker``, which owns the L1
  array and lends it to the model for each call (``HostWorker.run_model``), on this one thread; any
  transfer a cache call dispatches therefore reads or writes the array the last forward produced.
* ``hicache.ray_engine.RayEngine`` (a Ray replica): the model sits inside every host's
  ``HostWorkerActor`` and runs SPMD over the replica's sharded L1 pool; each call goes to every host.
"""

from __future__ import annotations

import itertools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from hicache.cluster.client import CacheClient
from hicache.cluster.controller import LoadBackParams
from hicache.cluster.storage_tier import PrefetchParams, PrefetchState
from hicache.cluster.tree import RadixKey, RequestState
from hicache.engine.runner import Generation


class Engine(Protocol):
    """The model as the scheduler sees it (``ModelRunner`` methods of the same names and meaning)."""

    @property
    def page_size(self) -> int: ...

    def extend(self, tokens: np.ndarray, page_table: np.ndarray, start_pos: int) -> np.ndarray: ...

    def decode(self, tokens: np.ndarray, last_logits: np.ndarray, page_table: np.ndarray,
               max_new_tokens: int) -> Generation: ...

    def generate_no_cache(self, tokens: np.ndarray, max_new_tokens: int) -> Generation: ...


class RemoteModelEngine(ABC):
    """An ``Engine`` whose model lives elsewhere (a worker) and is reached by ``call(method, *args)``."""

    page_size: int

    @abstractmethod
    def call(self, method: str, *args: Any) -> Any:
        """``model.<method>(*args)`` where the model lives, over the L1 array; returns its result."""

    def extend(self, tokens: np.ndarray, page_table: np.ndarray, start_pos: int) -> np.ndarray:
        return self.call("extend", tokens, page_table, start_pos)

    def decode(self, tokens: np.ndarray, last_logits: np.ndarray, page_table: np.ndarray,
               max_new_tokens: int) -> Generation:
        return self.call("decode", tokens, last_logits, page_table, max_new_tokens)

    def generate_no_cache(self, tokens: np.ndarray, max_new_tokens: int) -> Generation:
        """The reference: the same model, same pool shape and sharding, nothing reused."""
        return self.call("generate_no_cache", tokens, max_new_tokens)


class WorkerEngine(RemoteModelEngine):
    """The model inside an in-process ``HostWorker`` (its ``attach_model``): each call borrows the
    worker's L1 array on this thread (``run_model``)."""

    def __init__(self, worker) -> None:  # hicache.workers.HostWorker with a model attached
        if worker.model is None:
            raise ValueError(f"host worker {worker.host_index} has no model attached")
        self.worker = worker
        self.page_size = int(worker.model.fwd.page_size)

    def call(self, method: str, *args: Any) -> Any:
        fn: Callable = lambda model: getattr(model, method)(*args)  # noqa: E731
        return self.worker.run_model(fn)


@dataclass(frozen=True)
class ServeRequest:
    prompt: np.ndarray  # i32[n], n >= 1
    max_new_tokens: int
    extra_key: str | None = None
    cache_salt: str | None = None


@dataclass(frozen=True, eq=False)
class ServeResult:
    output: tuple[int, ...]
    last_logits: np.ndarray  # f32[vocab]: logits of the last prompt token
    ttft_s: float
    latency_s: float
    prompt_len: int
    device_hit_tokens: int  # prefix found in L1
    loaded_tokens: int  # prefix brought back from L2 (including what L3 prefetched into L2)
    computed_tokens: int  # prompt tokens prefilled
    storage_tokens: int = 0  # of loaded_tokens, fetched from L3 for this request
    load_failed: bool = False


class Scheduler:
    def __init__(self, client: CacheClient, engine: Engine, *, hicache: bool = False, storage: bool = False,
                 prefill_budget: int = 0) -> None:
        """``prefill_budget`` > 0 splits long prefills into pieces of that many tokens (a page multiple),
        caching each finished piece with ``cache_unfinished_req`` as a chunked-prefill scheduler does."""
        ps = client.page_size
        if ps != engine.page_size:
            raise ValueError(f"cache page_size {ps} != engine page_size {engine.page_size}")
        if prefill_budget < 0 or prefill_budget % ps:
            raise ValueError(f"prefill_budget must be a multiple of page_size {ps}, got {prefill_budget}")
        self.client = client
        self.engine = engine
        self.hicache = hicache
        self.storage = storage
        self.prefill_budget = prefill_budget
        self._req_ids = itertools.count()

    def _prefetch(self, key: RadixKey, m):  # -> (MatchResult, tokens fetched from L3)
        """Asks L3 for what L1+L2 lack; waits as the prefetch stop policy allows; matches again."""
        ps = self.client.page_size
        if m.device_hit_len + m.host_hit_len >= len(key) - len(key) % ps:
            return m, 0
        req_id = f"req-{next(self._req_ids)}"
        started = self.client.prefetch_from_storage(PrefetchParams(req_id, key, m.best_match_node))
        if started.state is PrefetchState.NOT_STARTED:
            return m, 0
        progress = self.client.check_prefetch_progress(req_id)
        if progress.state is PrefetchState.DONE and progress.tokens:
            return self.client.match_prefix(key), progress.tokens
        return m, 0

    def _match(self, req: ServeRequest) -> tuple[np.ndarray, int, int, int, int, bool]:
        """(prefix pages, hit len, locked node, loaded, from L3, load failed) — the node comes back locked."""
        key = RadixKey(req.prompt[:-1], req.extra_key, req.cache_salt)
        m = self.client.match_prefix(key)
        fetched = 0
        if self.storage:
            m, fetched = self._prefetch(key, m)
        pages, hit, node, loaded, failed = m.device_pages, m.device_hit_len, m.last_device_node, 0, False
        if self.hicache and m.host_hit_len > 0:
            r = self.client.init_load_back(LoadBackParams(m.best_match_node, m.host_hit_len))
            if r.load_id >= 0:
                if self.client.wait_load_back(r.load_id):
                    pages, hit, node, loaded = r.device_pages, r.device_hit_len, r.last_node, r.loaded_tokens
                else:
                    failed = True  # the L2 copy could not be loaded: recompute from the L1 prefix
                    m = self.client.match_prefix(key)
                    pages, hit, node = m.device_pages, m.device_hit_len, m.last_device_node
        self.client.inc_lock_ref(node)
        return pages, hit, node, loaded, min(fetched, loaded), failed

    def serve(self, req: ServeRequest) -> ServeResult:
        prompt = np.asarray(req.prompt, dtype=np.int32)
        if prompt.ndim != 1 or prompt.size == 0:
            raise ValueError(f"prompt must be a non-empty 1-D token array, got shape {prompt.shape}")
        if req.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {req.max_new_tokens}")
        t0 = time.perf_counter()
        if self.hicache:
            self.client.check_hicache_events()
        prefix_pages, hit, node, loaded, fetched, failed = self._match(req)
        total = prompt.size + req.max_new_tokens
        table = np.concatenate([prefix_pages, self.client.alloc(total - hit)]).astype(np.int32)
        ns = (req.extra_key, req.cache_salt)
        start, prefix_len = hit, hit
        budget = self.prefill_budget
        while budget and prompt.size - start > budget:
            end = start + budget
            self.engine.extend(prompt[:end], table, start)
            state = self.client.cache_unfinished_req(RequestState(RadixKey(prompt[:end], *ns), table, prefix_len, node))
            table, prefix_len, node = state.device_pages, state.prefix_len, state.last_node
            start = end
        logits = self.engine.extend(prompt, table, start)[-1]
        ttft = time.perf_counter() - t0
        gen = self.engine.decode(prompt, logits, table, req.max_new_tokens)
        seq = np.concatenate([prompt, np.asarray(gen.tokens[:-1], dtype=np.int32)])
        self.client.cache_finished_req(RequestState(RadixKey(seq, *ns), table, prefix_len, node))
        return ServeResult(gen.tokens, logits, ttft, time.perf_counter() - t0, int(prompt.size), hit - loaded,
                           loaded, int(prompt.size) - hit, fetched, failed)

    def serve_all(self, requests: Sequence[ServeRequest]) -> list[ServeResult]:
        return [self.serve(r) for r in requests]
