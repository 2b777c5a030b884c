"""A serving loop over the cache and the reference engine, in the order SGLang's scheduler uses its tree.

Per request: match (all prompt tokens but the last, whose logits start decoding) -> with L3, when
the whole pages past the L1+L2 match hold >= ``l3_min_tokens``, an L3 prefetch into L2 (waited for as
the stop policy allows) -> load-back of the L2 hit (waited for, bounded; it locks the reused prefix)
or the lock alone, and the alloc of pages for the rest -> chunked prefill (each chunk but
the last cached with ``cache_unfinished_req``) -> greedy decode -> ``cache_finished_req`` -> with a host
tier, ``check_hicache_events`` (sends held backups, applies acks, sends the L2->L3 writes they queue).
A request's start is one head call (``begin_request``: the write hold, match, L3 query, lock and
alloc, as far as nothing is to be waited for; a started prefetch and an L2 load-back add one step
each). Nothing but the request's own match, load-back, L3 query and alloc runs between the start of its
service and its first token: L1->L2 backups and their acks are handled after the decode, L2->L3 writes
run on the workers' storage threads. ``ServeResult.phases`` says where each request's time went.

L3 prefetch at arrival (as SGLang starts it when a request enters the waiting queue): a driver that
knows a request is queued calls ``arrive(req)``; its match and L3 existence query run then, and the
fetch into L2 runs on the worker's storage thread while earlier requests are served. ``serve(req)``
then checks that prefetch (bounded wait per the stop policy); it asks L3 again only if the L1+L2
match shrank since the arrival (one storage query per request, as SGLang). A request served without
``arrive`` starts its prefetch itself.

Iteration-level serving (``ServingLoop``, SGLang's event loop): a waiting queue and a running set;
each iteration either runs the next waiting request's work up to its first token (``prefill_first``,
the default) or one decode step of the running requests (``engine.decode_step``), then
``cache_finished_req`` for those done; ``fcfs_whole_request`` serves one request start to finish like
``serve``. Every forward is the engine's fixed-shape chunk program, so outputs and logits do not
depend on the interleaving. ``Scheduler.serve`` / ``serve_all`` serve one request at a time.

Where the model runs (DESIGN.md §1): the ``Scheduler`` drives an ``Engine``; every engine call
forwards over the replica's L1 pool, wherever that pool lives:

* ``ModelRunner`` itself (L1 only, embedded): the runner owns its pool; nothing else touches it.
* ``WorkerEngine`` (embedded HiCache): the model sits inside the ``HostWorker``, which owns the L1
  array and lends it to the model for each call (``HostWorker.run_model``), on this one thread; any
  transfer a cache call dispatches therefore reads or writes the array the last forward produced.
* ``hicache.reference.ray_engine.RayEngine`` (a Ray replica): the model sits inside every host's
  ``HostWorkerActor`` and runs SPMD over the replica's sharded L1 pool; each call goes to every host.
"""

from __future__ import annotations

import itertools
import logging
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

import numpy as np

from hicache.cluster.begin import BeginParams
from hicache.cluster.client import CacheClient, ResultRef
from hicache.cluster.controller import LoadBackParams
from hicache.cluster.head import Call, Method
from hicache.cluster.storage_tier import PrefetchParams, PrefetchState
from hicache.cluster.tree import RadixKey, RequestState
from hicache.reference.engine import batched
from hicache.reference.engine.runner import Generation, ModelRunner, greedy_decode

log = logging.getLogger(__name__)


class Engine(Protocol):
    """The model as the scheduler sees it (``ModelRunner`` methods of the same names and meaning)."""

    @property
    def page_size(self) -> int: ...

    def extend(self, tokens: np.ndarray, page_table: np.ndarray, start_pos: int) -> np.ndarray: ...

    def prefill(self, tokens: np.ndarray, page_table: np.ndarray, start_pos: int) -> np.ndarray: ...

    def decode(self, tokens: np.ndarray, last_logits: np.ndarray, page_table: np.ndarray,
               max_new_tokens: int, *, between_steps: Callable[[], None] | None = None) -> Generation: ...

    def decode_step(self, tokens: np.ndarray, page_table: np.ndarray) -> np.ndarray: ...

    def generate_no_cache(self, tokens: np.ndarray, max_new_tokens: int) -> Generation: ...


class RemoteModelEngine(ABC):
    """An ``Engine`` whose model lives elsewhere (a worker) and is reached by ``call(method, *args)``."""

    page_size: int

    @abstractmethod
    def call(self, method: str, *args: Any) -> Any:
        """``model.<method>(*args)`` where the model lives, over the L1 array; returns its result."""

    def extend(self, tokens: np.ndarray, page_table: np.ndarray, start_pos: int) -> np.ndarray:
        return self.call("extend", tokens, page_table, start_pos)

    def prefill(self, tokens: np.ndarray, page_table: np.ndarray, start_pos: int) -> np.ndarray:
        return self.call("prefill", tokens, page_table, start_pos)

    def decode(self, tokens: np.ndarray, last_logits: np.ndarray, page_table: np.ndarray,
               max_new_tokens: int, *, between_steps: Callable[[], None] | None = None) -> Generation:
        """One call for the whole decode; with ``between_steps``, one call per step and the hook between
        them, here (it may call the cache, which may transfer over L1: never inside a model call)."""
        if between_steps is None:
            return self.call("decode", tokens, last_logits, page_table, max_new_tokens)
        return greedy_decode(lambda seq: self.decode_step(seq, page_table), tokens, last_logits,
                             max_new_tokens, between_steps=between_steps)

    def decode_step(self, tokens: np.ndarray, page_table: np.ndarray) -> np.ndarray:
        return self.call("decode_step", tokens, page_table)

    def decode_steps(self, seqs: Sequence[np.ndarray], tables: Sequence[np.ndarray]) -> list[np.ndarray]:
        """``decode_step`` for each request (one call each; an engine whose model runs in this process
        does it in one dispatch)."""
        return [self.decode_step(s, t) for s, t in zip(seqs, tables)]

    def compile_decode_batches(self, max_batch: int) -> None:
        """Compiles what ``decode_steps`` runs for up to ``max_batch`` requests (nothing here)."""

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

    def decode(self, tokens: np.ndarray, last_logits: np.ndarray, page_table: np.ndarray,
               max_new_tokens: int, *, between_steps: Callable[[], None] | None = None) -> Generation:
        """As ``RemoteModelEngine.decode``, the request checked once (``ModelRunner.decoder``: no pool
        touched), not at every step; each step one model call, the hook between them."""
        if between_steps is None:
            return self.call("decode", tokens, last_logits, page_table, max_new_tokens)
        step = self.worker.model.decoder(tokens, page_table, max_new_tokens)
        return greedy_decode(lambda seq: self.worker.run_model(lambda _: step(seq)), tokens, last_logits,
                             max_new_tokens, between_steps=between_steps)

    def decode_steps(self, seqs: Sequence[np.ndarray], tables: Sequence[np.ndarray]) -> list[np.ndarray]:
        """One model call, one dispatch (``hicache.reference.engine.batched.decode_steps``), bit-identical."""
        return self.worker.run_model(lambda model: batched.decode_steps(model, seqs, tables))

    def compile_decode_batches(self, max_batch: int) -> None:
        self.worker.run_model(lambda model: batched.compile_batches(model, max_batch))


@dataclass(frozen=True)
class ServeRequest:
    prompt: np.ndarray  # i32[n], n >= 1
    max_new_tokens: int
    extra_key: str | None = None
    cache_salt: str | None = None


@dataclass(frozen=True)
class ServePhases:
    """Where a request's service time went (seconds, ``time.perf_counter`` deltas on the serving
    thread). Up to the first token: ``match`` (the request's first head call, ``begin_request``, less
    its head-side L3 query and lock + alloc: the write hold, the arrival prefetch's check, the match),
    ``l3`` (the L3 query; a started prefetch's wait and the match after it), ``load_back`` (lock the
    reused prefix, load its L2 part back and wait for it, allocate pages for the rest), ``prefill`` (every forward of the prompt,
    logits on the host). After it: ``decode`` and ``finish`` (``cache_finished_req`` and, with a host
    tier, ``check_hicache_events``). In a ``ServingLoop``, ``decode`` sums the request's own decode
    steps (other requests' iterations run in between)."""

    match: float = 0.0
    l3: float = 0.0
    load_back: float = 0.0
    prefill: float = 0.0
    decode: float = 0.0
    finish: float = 0.0


@dataclass(frozen=True, eq=False)
class ServeResult:
    output: tuple[int, ...]
    last_logits: np.ndarray  # f32[vocab]: logits of the last prompt token
    ttft_s: float
    latency_s: float
    prompt_len: int
    device_hit_tokens: int  # prefix found in L1
    loaded_tokens: int  # prefix brought back from L2 (including what L3 prefetched into L2)
    computed_tokens: int  # prompt tokens prefilled past the reused prefix (prompt_len - reused)
    storage_tokens: int = 0  # of loaded_tokens, fetched from L3 for this request
    load_failed: bool = False
    phases: ServePhases = ServePhases()
    logits: np.ndarray | None = None  # f32[len(output), vocab]: row i gave output[i] (row 0 = last_logits)


@dataclass(frozen=True, init=False)
class _Prefix:
    """Where a request's prefill starts: its page table, the reused prefix and its locked node."""

    table: np.ndarray  # i32[pages]: every page of the request, prefix pages first
    hit: int  # tokens reused (L1 + loaded), page-aligned; the tree owns the pages of [0, hit)
    node: int  # last node of the reused prefix, locked
    loaded: int = 0  # of hit, loaded back from L2 (including what L3 prefetched)
    fetched: int = 0  # of loaded, fetched from L3 for this request
    failed: bool = False

    def __init__(self, table: np.ndarray, hit: int, node: int, loaded: int = 0, fetched: int = 0,
                 failed: bool = False) -> None:  # one per request: fields in one dict update
        self.__dict__.update(table=table, hit=hit, node=node, loaded=loaded, fetched=fetched, failed=failed)


def _table(*parts: np.ndarray) -> np.ndarray:
    """A request's page table: its prefix pages, then its own (i32)."""
    return np.concatenate(parts).astype(np.int32, copy=False)


@dataclass(frozen=True)
class _Arrival:
    """What ``arrive`` learned about a queued request."""

    req: ServeRequest
    prefetch: str | None  # id of the L3 prefetch it started, or None
    covered: int  # prompt tokens L1+L2 matched then, plus those its prefetch fetches: L3 held nothing past them


@dataclass(frozen=True, eq=False, init=False)
class _Begun:
    """A request past its first token: what decoding and ``cache_finished_req`` need."""

    req: ServeRequest
    prompt: np.ndarray  # i32[n]
    ns: tuple[str | None, str | None]  # (extra_key, cache_salt)
    table: np.ndarray  # i32[pages]: every page of the request
    prefix_len: int  # tokens the tree owns (reused + chunks cached by cache_unfinished_req)
    node: int  # locked node at the end of prefix_len
    logits: np.ndarray  # f32[vocab]: of the last prompt token
    prefix: _Prefix
    marks: tuple[float, ...]  # perf_counter at the start and at the end of match, l3, load_back, prefill

    def __init__(self, req: ServeRequest, prompt: np.ndarray, ns: tuple[str | None, str | None], table: np.ndarray,
                 prefix_len: int, node: int, logits: np.ndarray, prefix: _Prefix, marks: tuple[float, ...]) -> None:
        self.__dict__.update(req=req, prompt=prompt, ns=ns, table=table, prefix_len=prefix_len, node=node,
                             logits=logits, prefix=prefix, marks=marks)  # one per request: one dict update


class _AfterFirstToken:
    """A ``between_steps`` hook that runs the driver's ``hook`` and then, on its first call only,
    ``resume`` (held L2->L3 writes are sent once the first token is out, after the driver saw it).
    ``resume()`` is idempotent: the serving code calls it again when the decode ends."""

    def __init__(self, hook: Callable[[], None], resume: Callable[[], object]) -> None:
        self._hook, self._resume = hook, resume
        self._pending = True

    def __call__(self) -> None:
        self._hook()
        self.resume()

    def resume(self) -> None:
        if self._pending:
            self._pending = False
            self._resume()


class Scheduler:
    def __init__(self, client: CacheClient, engine: Engine, *, hicache: bool = False, storage: bool = False,
                 prefill_budget: int = 0, l3_min_tokens: int = 0, hold_storage_writes: bool = False) -> None:
        """``prefill_budget`` > 0 splits long prefills into pieces of that many tokens (a page multiple),
        caching each finished piece with ``cache_unfinished_req`` as a chunked-prefill scheduler does.

        ``hold_storage_writes`` (with ``storage``): L2->L3 writes wait on the head while a request is
        between its start and its first token (``serve`` also holds those its finish queues until the
        next first token), so their CPU stays out of prefills. It costs two head calls per request:
        worth it where the client is in-process (the embedded stack turns it on), not over Ray.

        ``l3_min_tokens`` (with ``storage``): L3 is asked only when the whole pages of the prompt past
        the L1+L2 match hold at least that many tokens (pass the head's ``prefetch_min_tokens``: the
        head would skip a shorter prefetch anyway; asking costs a round trip to the head)."""
        ps = client.page_size
        if ps != engine.page_size:
            raise ValueError(f"cache page_size {ps} != engine page_size {engine.page_size}")
        if prefill_budget < 0 or prefill_budget % ps:
            raise ValueError(f"prefill_budget must be a multiple of page_size {ps}, got {prefill_budget}")
        if not isinstance(l3_min_tokens, int) or l3_min_tokens < 0:
            raise ValueError(f"l3_min_tokens must be an int >= 0, got {l3_min_tokens!r}")
        self.client = client
        self.engine = engine
        self.hicache = hicache
        self.storage = storage
        if not isinstance(hold_storage_writes, bool):
            raise TypeError(f"hold_storage_writes must be a bool, got {hold_storage_writes!r}")
        self.hold_writes = storage and hold_storage_writes
        self.prefill_budget = prefill_budget
        self.l3_min_tokens = max(l3_min_tokens, ps)
        self._req_ids = itertools.count()
        self._arrived: dict[int, _Arrival] = {}  # arrive()d requests not served yet, by id(request)

    def _l3_may_extend(self, key: RadixKey, m) -> bool:
        """Whether L3 is worth asking: the whole pages past the L1+L2 match hold >= ``l3_min_tokens``."""
        whole = len(key) - len(key) % self.client.page_size
        return self.storage and whole - m.device_hit_len - m.host_hit_len >= self.l3_min_tokens

    def _start_prefetch(self, key: RadixKey, m) -> tuple[str | None, int]:
        """Asks L3 for what L1+L2 lack (``m``: the match now): (the id of the started prefetch or None,
        the tokens it fetches)."""
        if not self._l3_may_extend(key, m):
            return None, 0
        req_id = f"req-{next(self._req_ids)}"
        started = self.client.prefetch_from_storage(PrefetchParams(req_id, key, m.best_match_node))
        return (None, 0) if started.state is PrefetchState.NOT_STARTED else (req_id, started.tokens)

    def arrive(self, req: ServeRequest) -> bool:
        """``req`` entered the queue: starts its L3 prefetch now, so that the fetch overlaps the wait;
        ``serve(req)`` (the same object) picks it up. True if a prefetch started. At most
        ``MAX_ARRIVED`` requests wait between ``arrive`` and ``serve``; beyond, ``arrive`` raises
        ``ValueError`` and nothing changes. Without L3 it only registers the request."""
        if id(req) in self._arrived:
            raise ValueError(f"request {req!r:.80} already arrived")
        if len(self._arrived) >= self.MAX_ARRIVED:
            raise ValueError(f"{len(self._arrived)} requests arrived and not served (MAX_ARRIVED): serve some first")
        key = self._key(req)[1]
        if not self.storage:
            self._arrived[id(req)] = _Arrival(req, None, 0)
            return False
        m = self.client.match_prefix(key)
        req_id, tokens = self._start_prefetch(key, m)
        self._arrived[id(req)] = _Arrival(req, req_id, m.device_hit_len + m.host_hit_len + tokens)
        return req_id is not None

    MAX_ARRIVED = 4096

    @staticmethod
    def _key(req: ServeRequest) -> tuple[np.ndarray, RadixKey]:
        """(the prompt as i32, the key a request matches: every prompt token but the last)."""
        prompt = np.asarray(req.prompt, dtype=np.int32)
        if prompt.ndim != 1 or prompt.size == 0:
            raise ValueError(f"prompt must be a non-empty 1-D token array, got shape {prompt.shape}")
        n = req.max_new_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:  # (the engine's rule, before any head call)
            raise ValueError(f"max_new_tokens must be an int >= 1, got {req.max_new_tokens!r}")
        return prompt, RadixKey(prompt[:-1], req.extra_key, req.cache_salt)

    def _check_prefetch(self, key: RadixKey, req_id: str):  # -> (MatchResult, tokens from L3)
        """Waits for prefetch ``req_id`` as the stop policy allows and matches again."""
        # Matched again in the same round trip, whatever the progress: the check applies acks, and an
        # acked L1->L2 backup may merge unlocked nodes of the earlier match (``RadixTree.merge_backed_up``),
        # whose ids must not be used after it.
        checked, matched = self.client.step([Call(Method.CHECK_PREFETCH_PROGRESS, req_id),
                                             Call(Method.MATCH_PREFIX, key)])
        progress = checked.unwrap()
        return matched.unwrap(), progress.tokens if progress.state is PrefetchState.DONE else 0

    def _reuse(self, m, total: int) -> tuple[np.ndarray, int, int, int, bool]:
        """Loads the L2 part of ``m`` back (it locks the prefix it returns: ``LoadBackParams.lock``), waits
        for it (bounded) and allocates pages for the rest of ``total`` tokens, in one step; without an L2
        part (no host tier), the lock and the alloc. Returns (page table, reused tokens, locked node,
        loaded tokens, load failed). A failed load falls back to the L1 prefix (the load's lock covers
        it): its part gets pages of its own and the lock moves to the L1 prefix."""
        if not (self.hicache and m.host_hit_len > 0):
            locked, own = self.client.step([Call(Method.INC_LOCK_REF, m.last_device_node),
                                            Call(Method.ALLOC, total - m.device_hit_len)])
            locked.unwrap()
            if not own.ok:  # the lock must not outlive the request that failed
                self.client.dec_lock_ref(m.last_device_node)
            return _table(m.device_pages, own.unwrap()), m.device_hit_len, m.last_device_node, 0, False
        started, done, own = self.client.step([  # a load id of -1 (nothing loaded) waits for nothing
            Call(Method.INIT_LOAD_BACK, LoadBackParams(m.best_match_node, m.host_hit_len, lock=True)),
            Call(Method.WAIT_LOAD_BACK, ResultRef(0, "load_id")),
            Call(Method.ALLOC, ResultRef(0, "device_hit_len", scale=-1, offset=total))])
        r = started.unwrap()
        if done.unwrap():
            return _table(r.device_pages, own.unwrap()), r.device_hit_len, r.last_node, r.loaded_tokens, False
        own = own.unwrap()  # the L2 copy could not be loaded: recompute its part from the L1 prefix
        locked, unlocked, more = self.client.step([
            Call(Method.INC_LOCK_REF, m.last_device_node), Call(Method.DEC_LOCK_REF, r.last_node),
            Call(Method.ALLOC, r.device_hit_len - m.device_hit_len)])
        locked.unwrap()
        unlocked.unwrap()
        return _table(m.device_pages, more.unwrap(), own), m.device_hit_len, m.last_device_node, 0, True

    def _begin_params(self, key: RadixKey, total: int, arrival: _Arrival | None) -> BeginParams:
        """The request's first head call. With L3: L3 is asked when the whole pages past the L1+L2 match
        hold >= ``l3_min_tokens``; for a request that ``arrive``d, its prefetch (if any) is checked first,
        and L3 is asked again only if the L1+L2 match has since shrunk below what the arrival's query
        covered (evicted meanwhile: L3 may hold it). Pages written to L3 past the covered length since
        the arrival came from requests served in between with the same prefix, which L1/L2 hold then. A
        request that did not arrive asks L3 here (a repeated miss is answered by the head's negative
        cache, no storage query)."""
        if not self.storage:
            return BeginParams(key, total, self.hold_writes)
        req_id = f"req-{next(self._req_ids)}"
        if arrival is None:
            return BeginParams(key, total, self.hold_writes, None, req_id, self.l3_min_tokens)
        return BeginParams(key, total, self.hold_writes, arrival.prefetch, req_id, self.l3_min_tokens, arrival.covered)

    def _prefix(self, key: RadixKey, total: int, arrival: _Arrival | None, t0: float) -> tuple[_Prefix, list[float]]:
        """Everything before the prefill: one head call (``begin_request``: the write hold, the arrival's
        prefetch check, the match, the L3 query, and, when nothing is to be loaded or waited for, the
        lock and the alloc); then, if a prefetch started, its wait and a fresh match, and, if the match
        has an L2 part, the load-back + lock + alloc (``_reuse``). Returns the prefix and the phase marks
        (``_Begun.marks`` from ``t0``, the start, up to the end of the load-back phase): the head's own
        seconds in the L3 query and the lock + alloc count in those phases, the rest of its call in the
        match."""
        r = self.client.begin_request(self._begin_params(key, total, arrival))
        t1 = time.perf_counter()
        marks = [t0, t1 - r.l3_s - r.alloc_s]
        m, fetched = r.match, r.fetched
        if r.prefetch is not None:  # started: waited for as the stop policy allows, then matched again
            m, more = self._check_prefetch(key, r.prefetch.req_id)
            fetched += more
        marks.append(time.perf_counter() - r.alloc_s)
        if r.pages is not None:  # locked and allocated in the call
            hit = m.device_hit_len
            table = _table(m.device_pages, r.pages) if hit else r.pages
            p = _Prefix(table, hit, m.last_device_node)
        else:
            table, hit, node, loaded, failed = self._reuse(m, total)
            p = _Prefix(table, hit, node, loaded, min(fetched, loaded), failed)
        marks.append(time.perf_counter())
        return p, marks

    def _begin(self, req: ServeRequest, *, resume: bool = True) -> _Begun:
        """Everything up to the first token: match, L3, load-back + alloc, (chunked) prefill. With
        ``hold_storage_writes``, L2->L3 writes are held from here; ``resume=False`` leaves them held
        after a successful prefill (the caller resumes once it has handed out the first token); a
        failure resumes them whatever ``resume`` says."""
        t0 = time.perf_counter()
        prompt, key = self._key(req)
        arrival = self._arrived.pop(id(req), None)
        ns = (req.extra_key, req.cache_salt)
        done = False
        held = None  # (table, prefix_len, node) once the prefix is locked and pages allocated
        try:
            p, marks = self._prefix(key, prompt.size + req.max_new_tokens, arrival, t0)
            table, prefix_len, node = held = p.table, p.hit, p.node
            start = p.hit
            budget = self.prefill_budget
            while budget and prompt.size - start > budget:
                end = start + budget
                self.engine.prefill(prompt[:end], table, start)
                table, prefix_len, node = held = self._cache_computed(prompt[:end], ns, table, prefix_len, node)
                start = end
            logits = self.engine.prefill(prompt, table, start)  # the last row only: one wait, no copies
            marks.append(time.perf_counter())
            done = True
        except BaseException:  # a failed forward (or chunk insert) keeps neither its lock nor its pages
            if held is not None:
                self._abandon(*held)
            raise
        finally:  # also when the match, load-back or a forward fails
            if self.hold_writes and (resume or not done):
                self.client.resume_storage_writes()
        return _Begun(req, prompt, ns, table, prefix_len, node, logits, p, tuple(marks))

    def _cache_prompt(self, b: _Begun) -> _Begun:
        """Caches the whole pages of ``b``'s prompt right after its prefill (``cache_unfinished_req``, as
        SGLang does after a prefill batch) and moves its lock to their end: a request that starts while
        ``b`` decodes reuses them (a shared system prompt is computed once, whatever the schedule), and
        their L1->L2 backup starts now. For ``ServingLoop``, where requests overlap; ``serve`` runs one
        request at a time and caches at the finish only. Returns ``b`` with its new page table, prefix
        and locked node (pages the tree already held in place of ours are freed and used instead: the
        same bits). A failed insert releases the request's lock and pages and raises."""
        whole = b.prompt.size - b.prompt.size % self.client.page_size
        if whole <= b.prefix_len:
            return b
        try:
            table, prefix_len, node = self._cache_computed(b.prompt, b.ns, b.table, b.prefix_len, b.node)
        except BaseException:
            self._abandon(b.table, b.prefix_len, b.node)
            raise
        return _Begun(b.req, b.prompt, b.ns, table, prefix_len, node, b.logits, b.prefix, b.marks)

    def _cache_computed(self, tokens: np.ndarray, ns: tuple[str | None, str | None], table: np.ndarray,
                        prefix_len: int, node: int) -> tuple[np.ndarray, int, int]:
        """``cache_unfinished_req`` of a running request's computed ``tokens`` (a chunked prefill's piece
        or the whole prompt): their whole pages go into the tree and its lock moves to their end.
        Returns the request's new (page table, tokens the tree owns, locked node)."""
        state = self.client.cache_unfinished_req(RequestState(RadixKey(tokens, *ns), table, prefix_len, node))
        return state.device_pages, state.prefix_len, state.last_node

    def _abandon(self, table: np.ndarray, prefix_len: int, node: int) -> None:
        """A request that failed after its lock and alloc (a forward or its decode raised): unlocks its
        prefix and frees its own pages (those past ``prefix_len``), inserting nothing, in one step. Best
        effort: the caller raises the request's own error; a release that fails too is logged."""
        own = np.asarray(table[prefix_len // self.client.page_size:], dtype=np.int32)
        try:
            for r in self.client.step([Call(Method.DEC_LOCK_REF, node), Call(Method.FREE, own)]):
                r.unwrap()
        except Exception as e:  # (the cache is unreachable too: its state is the head's to recover)
            log.warning("could not release a failed request's lock (node %s) and %d pages: %s", node, own.size, e)

    def _end(self, b: _Begun, gen: Generation, decode_s: float) -> ServeResult:
        """Caches the finished request (``cache_finished_req``; with a host tier, ``check_hicache_events``:
        sends held backups, applies acks, off the next request's critical path) and sums up its times."""
        t = time.perf_counter()
        seq = np.concatenate([b.prompt, np.asarray(gen.tokens[:-1], dtype=np.int32)])
        state = RequestState(RadixKey(seq, *b.ns), b.table, b.prefix_len, b.node)
        if self.hicache and not self.client.in_process:  # one round trip (the check runs even if the finish fails)
            finished, checked = self.client.step([Call(Method.CACHE_FINISHED_REQ, state),
                                                  Call(Method.CHECK_HICACHE_EVENTS)])
            finished.unwrap()
            checked.unwrap()
        else:
            self.client.cache_finished_req(state)
            if self.hicache:
                self.client.check_hicache_events()
        end = time.perf_counter()
        mk, p, n = b.marks, b.prefix, int(b.prompt.size)
        phases = ServePhases(*(y - x for x, y in zip(mk, mk[1:])), decode=decode_s, finish=end - t)
        return ServeResult(gen.tokens, b.logits, mk[-1] - mk[0], end - mk[0], n, p.hit - p.loaded, p.loaded,
                           n - p.hit, p.fetched, p.failed, phases, gen.logits)

    def serve(self, req: ServeRequest, between_steps: Callable[[], None] | None = None) -> ServeResult:
        """Serves ``req`` now, start to finish (its TTFT counts from here); picks up its prefetch if it
        ``arrive``d. (``ServingLoop`` interleaves requests instead.)

        ``between_steps()`` runs between its decode steps (outside any model call): a driver takes in
        the requests that arrived meanwhile there (``arrive``), as SGLang's event loop does every
        iteration, so their L3 fetches overlap this decode. Its time counts in this request's decode.

        With ``hold_storage_writes``, the L2->L3 writes this request's finish queues are held on the head
        (``pause_storage_writes``) until the next request's first token, so their CPU lands in that
        decode rather than in its prefill (each prefill holds writes too). With ``between_steps`` the
        resume runs in its first call, after the driver's hook (the first token is out: a server
        emits it, then does bookkeeping), or when the decode ends, whichever comes first. They are sent by the next
        ``serve``, ``resume_storage_writes()``, ``flush_write_through_acks()``, or the first cache call
        after ``StorageParams.write_hold_max_s``: a server that goes idle calls one of those."""
        if between_steps is None or not self.hold_writes:
            b = self._begin(req)  # (no hook: writes resume once the first token's logits are in)
            step = between_steps
        else:  # writes resume right after the first token is handed out: in the first between_steps()
            b = self._begin(req, resume=False)
            step = _AfterFirstToken(between_steps, self.client.resume_storage_writes)
        t = time.perf_counter()
        try:
            gen = (self.engine.decode(b.prompt, b.logits, b.table, req.max_new_tokens) if step is None else
                   self.engine.decode(b.prompt, b.logits, b.table, req.max_new_tokens, between_steps=step))
        except BaseException:  # nothing of a failed decode is cached: its lock and pages go back
            self._abandon(b.table, b.prefix_len, b.node)
            raise
        finally:  # a one-token answer never calls between_steps; a failed decode must not keep the hold
            if isinstance(step, _AfterFirstToken):
                step.resume()
        decode_s = time.perf_counter() - t
        if self.hold_writes:  # the next request's prefill may follow at once: its writes wait for that first token
            self.client.pause_storage_writes()
        return self._end(b, gen, decode_s)

    def serve_all(self, requests: Sequence[ServeRequest]) -> list[ServeResult]:
        return [self.serve(r) for r in requests]


# --- the iteration-level loop ---------------------------------------------------------------------


class SchedulePolicy(str, Enum):
    """What a ``ServingLoop`` iteration runs while requests wait and others decode."""

    PREFILL_FIRST = "prefill_first"  # SGLang: admit a waiting request (its whole pre-first-token work) first
    FCFS_WHOLE_REQUEST = "fcfs_whole_request"  # one request at a time, start to finish (``Scheduler.serve``)


@dataclass(frozen=True)
class LoopOptions:
    """``ServingLoop`` options. ``max_running``: requests decoding at once (hard bound); ``max_waiting``:
    queued requests (``submit`` refuses more); ``decode_batch``: running requests one decode iteration
    advances by one step each, round-robin (0: all of them, as SGLang's decode batch);
    ``batched_decode``: those steps in one dispatch (``hicache.reference.engine.batched``: bit-identical on the
    platforms it was checked on, ``ValueError`` elsewhere; only where the model runs in this process:
    ``ModelRunner``, ``WorkerEngine``; a remote engine still calls once per request)."""

    policy: SchedulePolicy = SchedulePolicy.PREFILL_FIRST
    max_running: int = 32
    max_waiting: int = 1024
    decode_batch: int = 0
    batched_decode: bool = False  # a decode iteration in one dispatch where the model runs in this process

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "policy", SchedulePolicy(self.policy))
        except ValueError:
            raise ValueError(f"policy must be one of {[p.value for p in SchedulePolicy]}, got {self.policy!r}") from None
        for name, low in (("max_running", 1), ("max_waiting", 1), ("decode_batch", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        if not isinstance(self.batched_decode, bool):
            raise ValueError(f"batched_decode must be a bool, got {self.batched_decode!r}")
        if self.max_waiting > Scheduler.MAX_ARRIVED:
            raise ValueError(f"max_waiting {self.max_waiting} > Scheduler.MAX_ARRIVED {Scheduler.MAX_ARRIVED}")


class StepKind(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    IDLE = "idle"


@dataclass(frozen=True)
class LoopStep:
    """What one ``ServingLoop.step`` ran: a prefill (``first_token``: the ticket that got its first
    token) or a decode iteration, and the requests it finished (ticket, result)."""

    kind: StepKind
    first_token: int | None = None
    finished: tuple[tuple[int, ServeResult], ...] = ()


class _Running:
    """A decoding request (the loop's own state; mutable, one thread)."""

    def __init__(self, ticket: int, begun: _Begun, pages: int) -> None:
        self.ticket, self.begun, self.pages = ticket, begun, pages  # pages: counted against the L1 capacity
        prompt = begun.prompt
        # the sequence so far (prompt + tokens taken) in one buffer filled up to ``_n``: a decode step reads a
        # view of its first ``_n`` ids (positions below ``_n`` are never written again), no per-step copy
        self._buf = np.empty(prompt.size + begun.req.max_new_tokens, np.int32)
        self._buf[: prompt.size] = prompt
        self._n = prompt.size
        self.tokens: list[int] = []
        self.logits = [begun.logits]
        self.decode_s = 0.0

    @property
    def seq(self) -> np.ndarray:
        """i32[prompt + tokens taken] (a view: read it, don't keep it past the next ``take``'s use)."""
        return self._buf[: self._n]

    def take(self) -> bool:
        """Takes the argmax of the last logits as the next token; True when the request is done."""
        nxt = int(np.argmax(self.logits[-1]))
        self.tokens.append(nxt)
        self._buf[self._n] = nxt
        self._n += 1
        return len(self.tokens) == self.begun.req.max_new_tokens

    def generation(self) -> Generation:
        return Generation(tuple(self.tokens), np.stack(self.logits))


class ServingLoop:
    """An iteration-level scheduler over a ``Scheduler`` (SGLang's event loop, one request per prefill).

    ``submit`` puts a request in the waiting queue (``Scheduler.arrive``: its L3 prefetch starts now).
    Each ``step`` is one iteration: with ``PREFILL_FIRST``, the next waiting request's pre-first-token
    work (match, L3 prefetch check, load-back, alloc, chunked prefill; then its prompt's whole pages go
    into the tree, ``Scheduler._cache_prompt``, for the requests that start while it decodes) if one
    waits and may start, else one decode step for each of up to ``decode_batch`` running requests
    (round-robin), then ``cache_finished_req`` for those done. A request may start when fewer than
    ``max_running`` run and the pages of the running ones plus its own (prompt + new tokens, counted
    whole, shared prefixes twice) fit the L1 capacity, or when nothing runs (its alloc may then evict
    all but itself).
    ``FCFS_WHOLE_REQUEST`` starts a request only when nothing runs. Every forward is the engine's
    fixed-shape chunk program, so outputs do not depend on the interleaving.

    Owns: the waiting queue and the running set (their page tables; the pages belong to the tree and
    the requests as in ``Scheduler.serve``). One thread; the engine's model calls run on it."""

    def __init__(self, scheduler: Scheduler, options: LoopOptions = LoopOptions()) -> None:
        if not isinstance(options, LoopOptions):
            raise TypeError(f"options must be LoopOptions, got {type(options).__name__}")
        self.scheduler = scheduler
        self.options = options
        self.capacity_pages = int(scheduler.client.stats().capacity_pages)
        self._tickets = itertools.count()
        self.waiting: deque[tuple[int, ServeRequest]] = deque()
        self.running: deque[_Running] = deque()
        self._running_pages = 0
        self._decode = self._decode_fn()

    def _decode_fn(self) -> Callable[[list[np.ndarray], list[np.ndarray]], list[np.ndarray]]:
        """One decode step per request: one dispatch with ``batched_decode`` (its programs compiled now,
        for up to ``max_running`` requests), else one ``decode_step`` each."""
        engine = self.scheduler.engine
        if not self.options.batched_decode:
            return lambda seqs, tables: [engine.decode_step(s, t) for s, t in zip(seqs, tables)]
        if isinstance(engine, ModelRunner):
            batched.compile_batches(engine, self.options.max_running)
            return lambda seqs, tables: batched.decode_steps(engine, seqs, tables)
        if isinstance(engine, RemoteModelEngine):
            engine.compile_decode_batches(self.options.max_running)
            return engine.decode_steps
        raise TypeError(f"batched_decode needs a ModelRunner or a RemoteModelEngine, got {type(engine).__name__}")

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def submit(self, req: ServeRequest) -> int:
        """Queues ``req``; returns its ticket. ``ValueError`` (nothing queued) on a bad request or a full
        queue."""
        if len(self.waiting) >= self.options.max_waiting:
            raise ValueError(f"{len(self.waiting)} requests wait (max_waiting): step the loop first")
        self.scheduler.arrive(req)
        ticket = next(self._tickets)
        self.waiting.append((ticket, req))
        return ticket

    def _pages(self, req: ServeRequest) -> int:
        return -(-(len(req.prompt) + req.max_new_tokens) // self.scheduler.client.page_size)

    def _may_start(self) -> bool:
        if not self.waiting:
            return False
        if not self.running:
            return True
        if self.options.policy is SchedulePolicy.FCFS_WHOLE_REQUEST or len(self.running) >= self.options.max_running:
            return False
        return self._running_pages + self._pages(self.waiting[0][1]) <= self.capacity_pages

    def step(self) -> LoopStep:
        """Runs one iteration (see the class docstring)."""
        if self._may_start():
            ticket, req = self.waiting.popleft()
            r = _Running(ticket, self.scheduler._begin(req), self._pages(req))
            self._running_pages += r.pages
            if r.take():
                return LoopStep(StepKind.PREFILL, ticket, (self._finish(r),))
            try:  # its prompt is reused by the requests that start while it decodes
                r.begun = self.scheduler._cache_prompt(r.begun)
            except BaseException:
                self._running_pages -= r.pages
                raise
            self.running.append(r)
            return LoopStep(StepKind.PREFILL, ticket)
        if not self.running:
            return LoopStep(StepKind.IDLE)
        n = self.options.decode_batch or len(self.running)
        batch = [self.running.popleft() for _ in range(min(n, len(self.running)))]
        t = time.perf_counter()
        logits = self._decode([r.seq for r in batch], [r.begun.table for r in batch])
        share = (time.perf_counter() - t) / len(batch)
        done = []
        for r, row in zip(batch, logits):
            r.logits.append(row)
            r.decode_s += share
            if r.take():
                done.append(r)
            else:
                self.running.append(r)
        return LoopStep(StepKind.DECODE, None, tuple(self._finish(r) for r in done))

    def _finish(self, r: _Running) -> tuple[int, ServeResult]:
        self._running_pages -= r.pages
        return r.ticket, self.scheduler._end(r.begun, r.generation(), r.decode_s)

    def run(self, requests: Sequence[ServeRequest]) -> list[ServeResult]:
        """Submits ``requests`` (as the queue takes them) and steps until every one is done; results in
        request order."""
        out: dict[int, ServeResult] = {}
        tickets: list[int] = []
        pending = deque(requests)
        while pending or not self.idle:
            while pending and len(self.waiting) < self.options.max_waiting:
                tickets.append(self.submit(pending.popleft()))
            out.update(self.step().finished)
        return [out[t] for t in tickets]
