"""The reference ``Scheduler``: one request at a time over the cache and an engine, in the order
SGLang's scheduler uses its tree.

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

``ServingLoop`` (``hicache.reference.serving_loop``) interleaves requests with the same steps
(``begin``, ``cache_prompt``, ``finish``). One thread: the scheduler, its ``CacheClient`` and the
engine's model calls all run on the serving thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from hicache.cluster.begin import BeginParams
from hicache.cluster.client import CacheClient, ResultRef
from hicache.cluster.controller import LoadBackParams
from hicache.cluster.cost_model import PrefillReport
from hicache.cluster.events import MissReason
from hicache.cluster.head import Call, Method
from hicache.cluster.storage_tier import PrefetchParams, PrefetchProgress, PrefetchState
from hicache.cluster.token_account import TokenAccount, account_request, explain_l3
from hicache.cluster.tree import RadixKey, RequestState
from hicache.cluster.tree.params import NO_VALUES
from hicache.reference.engine.runner import Generation, tracked_len
from hicache.reference.engine_adapters import Engine
from hicache.reference.serve_types import ServePhases, ServeRequest, ServeResult

log = logging.getLogger(__name__)


class _Prefix(NamedTuple):
    """Where a request's prefill starts: its page table, the reused prefix and its locked node (one
    per request: a NamedTuple builds in one step)."""

    table: np.ndarray  # i32[pages]: every page of the request, prefix pages first
    hit: int  # tokens reused (L1 + loaded), page-aligned; the tree owns the pages of [0, hit)
    node: int  # last node of the reused prefix, locked
    loaded: int = 0  # of hit, loaded back from L2 (including what L3 prefetched)
    fetched: int = 0  # of loaded, fetched from L3 for this request
    failed: bool = False
    components: Mapping[str, Any] = NO_VALUES  # the request's component values (Mamba: its state slot)
    refused: tuple[MissReason | None, int] = (None, 0)  # the matched L2 part not loaded back, and why
    rest: MissReason | None = None  # why the whole pages past the match and the refused part were missed


def _table(*parts: np.ndarray) -> np.ndarray:
    """A request's page table: its prefix pages, then its own (i32)."""
    return np.concatenate(parts).astype(np.int32, copy=False)


class _Arrival(NamedTuple):
    """What ``arrive`` learned about a queued request."""

    req: ServeRequest
    prefetch: str | None  # id of the L3 prefetch it started, or None
    covered: int  # prompt tokens L1+L2 matched then, plus those its prefetch fetches: L3 held nothing past them
    skipped: PrefetchProgress | None = None  # L3's answer when it started no prefetch (why: its token record)


class Begun(NamedTuple):
    """A request past its first token: what decoding and ``cache_finished_req`` need (one per request:
    a NamedTuple builds in one step; ``Scheduler.cache_prompt`` returns a new one)."""

    req: ServeRequest
    prompt: np.ndarray  # i32[n]
    ns: tuple[str | None, str | None]  # (extra_key, cache_salt)
    table: np.ndarray  # i32[pages]: every page of the request
    prefix_len: int  # tokens the tree owns (reused + chunks cached by cache_unfinished_req)
    node: int  # locked node at the end of prefix_len
    logits: np.ndarray  # f32[vocab]: of the last prompt token
    prefix: _Prefix
    marks: tuple[float, ...]  # perf_counter at the start and at the end of match, l3, load_back, prefill
    components: Mapping[str, Any] = NO_VALUES  # RequestState.components (Mamba: the working state slot)
    swa_table: np.ndarray | None = None  # i32[pages]: SWA page ids of ``table`` (an engine with an SWA pool)

    @property
    def state_slot(self) -> int | None:
        """The request's recurrent state slot (models with recurrent layers), else None."""
        return state_slot(self.components)

    @property
    def engine_args(self) -> dict[str, Any]:
        """The keyword arguments of its forwards past the page table (state slot, SWA table; none for Full)."""
        return engine_args(self.components, self.swa_table)

    @property
    def decode_args(self) -> dict[str, Any]:
        """``engine_args`` of its decode steps: with its track slot, if the head gave it one (the engine copies
        the working state there at page ends, for ``finish`` to cache)."""
        out = engine_args(self.components, self.swa_table)
        value = self.components.get("mamba")
        if value is not None and value.track >= 0:
            out["track_slot"] = int(value.track)
        return out


def engine_args(components: Mapping[str, Any], swa_table: np.ndarray | None) -> dict[str, Any]:
    slot = state_slot(components)
    out: dict[str, Any] = {} if slot is None else {"state_slot": slot}
    if swa_table is not None:
        out["swa_table"] = swa_table
    return out


def state_slot(components: Mapping[str, Any]) -> int | None:
    value = components.get("mamba")
    return None if value is None else int(value.slot)


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
                 prefill_budget: int = 0, l3_min_tokens: int = 0, hold_storage_writes: bool = False,
                 swa_tables: bool = False, recurrent: bool = False) -> None:
        """``prefill_budget`` > 0 splits long prefills into pieces of that many tokens (a page multiple),
        caching each finished piece with ``cache_unfinished_req`` as a chunked-prefill scheduler does.

        ``hold_storage_writes`` (with ``storage``): L2->L3 writes wait on the head while a request is
        between its start and its first token (``serve`` also holds those its finish queues until the
        next first token), so their CPU stays out of prefills. It costs two head calls per request:
        worth it where the client is in-process (the embedded stack turns it on), not over Ray.

        ``l3_min_tokens`` (with ``storage``): L3 is asked only when the whole pages of the prompt past
        the L1+L2 match hold at least that many tokens (pass the head's ``prefetch_min_tokens``: the
        head would skip a shorter prefetch anyway; asking costs a round trip to the head).

        ``swa_tables``: the engine keeps sliding-window KV in the head's SWA pool (``ModelRunner(swa_pages=)``):
        each forward gets the request's SWA page table, asked from the head (``swa_pages``) whenever its page
        table changes (start, each ``cache_unfinished_req``).

        ``recurrent``: the engine keeps recurrent states in the head's Mamba pool (``ModelRunner(state_slots=)``).
        With either (a hybrid model), a request whose match has an L2 part starts, after the load-back, from
        a match of L1 only (``BeginParams.l1_only``: Mamba, the working state slot copying the loaded state).
        A recurrent request's decode copies its working state into its track slot at page ends
        (``Begun.decode_args``) and ``finish`` says which state that is (``tracked_len``): the tree caches the
        answer's last whole page, which the conversation's next turn hits."""
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
        if not isinstance(swa_tables, bool):
            raise TypeError(f"swa_tables must be a bool, got {swa_tables!r}")
        self.swa_tables = swa_tables
        if not isinstance(recurrent, bool):
            raise TypeError(f"recurrent must be a bool, got {recurrent!r}")
        self.recurrent = recurrent
        self.l3_min_tokens = max(l3_min_tokens, ps)
        self._req_ids = itertools.count()
        self._arrived: dict[int, _Arrival] = {}  # arrive()d requests not served yet, by id(request)

    def _l3_may_extend(self, key: RadixKey, m) -> bool:
        """Whether L3 is worth asking: the whole pages past the L1+L2 match hold >= ``l3_min_tokens``."""
        whole = len(key) - len(key) % self.client.page_size
        return self.storage and whole - m.device_hit_len - m.host_hit_len >= self.l3_min_tokens

    def _start_prefetch(self, key: RadixKey, m) -> tuple[str | None, int, PrefetchProgress | None]:
        """Asks L3 for what L1+L2 lack (``m``: the match now): (the id of the started prefetch or None,
        the tokens it fetches, L3's answer when it started none)."""
        if not self._l3_may_extend(key, m):
            return None, 0, None
        req_id = f"req-{next(self._req_ids)}"
        started = self.client.prefetch_from_storage(PrefetchParams(req_id, key, m.best_match_node))
        if started.state is PrefetchState.NOT_STARTED:
            return None, 0, started
        return req_id, started.tokens, None

    def arrive(self, req: ServeRequest) -> bool:
        """``req`` entered the queue: starts its L3 prefetch now (the existence query, then the fetch of
        what it finds, both off this thread), so that they overlap the wait; ``serve(req)`` (the same
        object) picks it up. True if a prefetch runs for it (its query unanswered yet, or a fetch started;
        a local disk answers a miss at once). At most
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
        req_id, tokens, skipped = self._start_prefetch(key, m)
        self._arrived[id(req)] = _Arrival(req, req_id, m.device_hit_len + m.host_hit_len + tokens, skipped)
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

    def _check_prefetch(self, key: RadixKey, req_id: str):  # -> (MatchResult, tokens from L3, PrefetchProgress)
        """Waits for prefetch ``req_id`` as the stop policy allows and matches again."""
        # Matched again in the same round trip, whatever the progress: the check applies acks, and an
        # acked L1->L2 backup may merge unlocked nodes of the earlier match (``RadixTree.merge_backed_up``),
        # whose ids must not be used after it.
        checked, matched = self.client.step([Call(Method.CHECK_PREFETCH_PROGRESS, req_id),
                                             Call(Method.MATCH_PREFIX, key)])
        progress: PrefetchProgress = checked.unwrap()
        return matched.unwrap(), progress.tokens if progress.state is PrefetchState.DONE else 0, progress

    def _reuse(self, m, total: int) -> tuple[np.ndarray, int, int, int, bool, MissReason | None]:
        """Loads the L2 part of ``m`` back (it locks the prefix it returns: ``LoadBackParams.lock``), waits
        for it (bounded) and allocates pages for the rest of ``total`` tokens, in one step; without an L2
        part (no host tier), the lock and the alloc. Returns (page table, reused tokens, locked node,
        loaded tokens, load failed, why the load-back refused the L2 part). A failed load falls back to the L1 prefix (the load's lock covers
        it): its part gets pages of its own and the lock moves to the L1 prefix."""
        if not (self.hicache and m.host_hit_len > 0):
            locked, own = self.client.step([Call(Method.INC_LOCK_REF, m.last_device_node),
                                            Call(Method.ALLOC, total - m.device_hit_len)])
            locked.unwrap()
            if not own.ok:  # the lock must not outlive the request that failed
                self.client.dec_lock_ref(m.last_device_node)
            return _table(m.device_pages, own.unwrap()), m.device_hit_len, m.last_device_node, 0, False, None
        started, done, own = self.client.step([  # a load id of -1 (nothing loaded) waits for nothing
            Call(Method.INIT_LOAD_BACK, LoadBackParams(m.best_match_node, m.host_hit_len, lock=True)),
            Call(Method.WAIT_LOAD_BACK, ResultRef(0, "load_id")),
            Call(Method.ALLOC, ResultRef(0, "device_hit_len", scale=-1, offset=total))])
        r = started.unwrap()
        if done.unwrap():
            return (_table(r.device_pages, own.unwrap()), r.device_hit_len, r.last_node, r.loaded_tokens, False,
                    r.miss_reason)
        own = own.unwrap()  # the L2 copy could not be loaded: recompute its part from the L1 prefix
        locked, unlocked, more = self.client.step([
            Call(Method.INC_LOCK_REF, m.last_device_node), Call(Method.DEC_LOCK_REF, r.last_node),
            Call(Method.ALLOC, r.device_hit_len - m.device_hit_len)])
        locked.unwrap()
        unlocked.unwrap()
        return _table(m.device_pages, more.unwrap(), own), m.device_hit_len, m.last_device_node, 0, True, None

    def _reuse_then_begin(self, m, key: RadixKey,
                          total: int) -> tuple[np.ndarray, int, int, int, bool, MissReason | None, Mapping[str, Any]]:
        """``_reuse`` for a hybrid model (its match's L1 part alone may not serve it: its L2 part ends where
        every component can): loads the L2 part back (with the Mamba state at its end, the SWA window's
        pages), then drops the load's lock and starts the request from a match of L1 only (lock, alloc and,
        recurrent, its working state slot copying the state at the match's end), in one step. A load that was refused
        or failed leaves what the components can serve from L1 (the deepest node with a state, a live
        window): the request recomputes from there. Returns ``_reuse``'s values and the request's component
        values."""
        started, done = self.client.step([
            Call(Method.INIT_LOAD_BACK, LoadBackParams(m.best_match_node, m.host_hit_len, lock=True)),
            Call(Method.WAIT_LOAD_BACK, ResultRef(0, "load_id"))])
        r = started.unwrap()
        loaded_ok = bool(done.ok and done.unwrap())
        # (the load's lock goes first: what the request's own lock does not cover, e.g. a loaded chain past the
        # deepest state, may be evicted by its alloc; nothing runs between the two calls of a step)
        unlocked, begun = self.client.step([Call(Method.DEC_LOCK_REF, r.last_node),
                                            Call(Method.BEGIN_REQUEST, BeginParams(key, total, l1_only=True))])
        b = begun.unwrap()
        unlocked.unwrap()
        assert b.pages is not None  # (an L1-only match has nothing to load or fetch)
        hit = b.match.device_hit_len
        loaded = max(0, min(r.loaded_tokens, hit - m.device_hit_len)) if loaded_ok else 0
        table = _table(b.match.device_pages, b.pages) if hit else b.pages
        return table, hit, b.match.last_device_node, loaded, not loaded_ok, r.miss_reason, b.components

    def _begin_l1(self, key: RadixKey,
                  total: int) -> tuple[np.ndarray, int, int, int, bool, MissReason | None, Mapping[str, Any]]:
        """A hybrid request starts from a match of L1 only (lock, alloc, its component values), as
        ``_reuse_then_begin`` does after its load: nothing to load."""
        b = self.client.step([Call(Method.BEGIN_REQUEST, BeginParams(key, total, l1_only=True))])[0].unwrap()
        assert b.pages is not None  # (an L1-only match has nothing to load or fetch)
        hit = b.match.device_hit_len
        table = _table(b.match.device_pages, b.pages) if hit else b.pages
        return table, hit, b.match.last_device_node, 0, False, None, b.components

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
        (``Begun.marks`` from ``t0``, the start, up to the end of the load-back phase): the head's own
        seconds in the L3 query and the lock + alloc count in those phases, the rest of its call in the
        match."""
        r = self.client.begin_request(self._begin_params(key, total, arrival))
        t1 = time.perf_counter()
        marks = [t0, t1 - r.l3_s - r.alloc_s]
        m, fetched, rest = r.match, r.fetched, r.miss_reason
        if arrival is not None and arrival.skipped is not None and r.prefetch is None:
            rest = explain_l3(rest, arrival.skipped)  # L3 was asked at arrival only (down, or nothing there)
        if r.prefetch is not None:  # started: waited for as the stop policy allows, then matched again
            m, more, progress = self._check_prefetch(key, r.prefetch.req_id)
            fetched += more
            rest = explain_l3(rest, progress)
        marks.append(time.perf_counter() - r.alloc_s)
        if r.pages is not None:  # locked and allocated in the call
            hit = m.device_hit_len
            table = _table(m.device_pages, r.pages) if hit else r.pages
            p = _Prefix(table, hit, m.last_device_node, components=r.components, rest=rest)
        else:
            comps: Mapping[str, Any] = NO_VALUES
            if (self.recurrent or self.swa_tables) and m.host_hit_len > 0:
                table, hit, node, loaded, failed, refused, comps = self._reuse_then_begin(m, key, total)
            elif self.recurrent or self.swa_tables:  # (after a prefetch that brought nothing to load)
                table, hit, node, loaded, failed, refused, comps = self._begin_l1(key, total)
            else:
                table, hit, node, loaded, failed, refused = self._reuse(m, total)
            not_loaded = m.device_hit_len + m.host_hit_len - hit  # the L2 part the load-back refused or failed
            p = _Prefix(table, hit, node, loaded, min(fetched, loaded), failed, comps,
                        refused=(MissReason.LOAD_FAILED if failed else refused, not_loaded), rest=rest)
        marks.append(time.perf_counter())
        return p, marks

    def begin(self, req: ServeRequest, *, resume: bool = True) -> Begun:
        """Everything up to the first token: match, L3, load-back + alloc, (chunked) prefill. With
        ``hold_storage_writes``, L2->L3 writes are held from here; ``resume=False`` leaves them held
        after a successful prefill (the caller resumes once it has handed out the first token); a
        failure resumes them whatever ``resume`` says."""
        t0 = time.perf_counter()
        prompt, key = self._key(req)
        arrival = self._arrived.pop(id(req), None)
        ns = (req.extra_key, req.cache_salt)
        done = False
        held = None  # (table, prefix_len, node, components) once the prefix is locked and pages allocated
        try:
            p, marks = self._prefix(key, prompt.size + req.max_new_tokens, arrival, t0)
            table, prefix_len, node, comps = held = p.table, p.hit, p.node, p.components
            swa = self._swa_table(table)
            self._start_states(comps)
            start = p.hit
            budget = self.prefill_budget
            while budget and prompt.size - start > budget:
                end = start + budget
                self._prefill(prompt[:end], table, start, comps, swa)
                table, prefix_len, node, comps = held = self._cache_computed(prompt[:end], ns, table, prefix_len,
                                                                             node, comps)
                swa = self._swa_table(table)
                start = end
            for cut in self._state_cuts(comps, start, prompt.size):
                # A recurrent state is cached only where the engine's state is after exactly a node end: the
                # prefill stops and caches at the point where the key leaves the tree (a branch later requests
                # share) and at the prompt's last whole page (what a later turn matches).
                self._prefill(prompt[:cut], table, start, comps, swa)
                table, prefix_len, node, comps = held = self._cache_computed(prompt[:cut], ns, table, prefix_len,
                                                                             node, comps)
                swa = self._swa_table(table)
                start = cut
            logits = self._prefill(prompt, table, start, comps, swa)  # the last row only: one wait, no copies
            if self.swa_tables:  # its SWA pages behind the window are spare from now on (no later step reads them)
                self.client.trim_request(RequestState(RadixKey(prompt, *ns), table, prefix_len, node, 0, comps))
            marks.append(time.perf_counter())
            done = True
        except BaseException:  # a failed forward (or chunk insert) keeps neither its lock nor its pages
            if held is not None:
                self._abandon(*held, ns)
            raise
        finally:  # also when the match, load-back or a forward fails
            if self.hold_writes and (resume or not done):
                self.client.resume_storage_writes()
        return Begun(req, prompt, ns, table, prefix_len, node, logits, p, tuple(marks), comps, swa)

    def _state_cuts(self, comps: Mapping[str, Any], start: int, n: int) -> list[int]:
        """Where a request with a recurrent state caches its prefill (page-aligned, in (start, n)): the tree's
        branch point (``MambaRequest.branching_seqlen``) and the last whole page of its key (n - 1 tokens)."""
        value = comps.get("mamba")
        if value is None:
            return []
        ps = self.client.page_size
        cuts = {value.branching_seqlen // ps * ps, (n - 1) // ps * ps}
        return sorted(c for c in cuts if start < c < n)

    def _prefill(self, tokens: np.ndarray, table: np.ndarray, start: int, comps: Mapping[str, Any],
                 swa: np.ndarray | None) -> np.ndarray:
        return self.engine.prefill(tokens, table, start, **engine_args(comps, swa))

    def _swa_table(self, table: np.ndarray) -> np.ndarray | None:
        return self.client.swa_pages(table) if self.swa_tables else None

    def _start_states(self, comps: Mapping[str, Any]) -> None:
        """Before a request's first forward: its working state slot takes the cached state its prefix
        ends with (``MambaRequest.copies``) or the zero state (nothing cached to continue from)."""
        value = comps.get("mamba")
        if value is None:
            return
        if value.copies:
            self.engine.copy_states(value.copies)
        else:
            self.engine.zero_states([value.slot])

    def cache_prompt(self, b: Begun) -> Begun:
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
            table, prefix_len, node, comps = self._cache_computed(b.prompt, b.ns, b.table, b.prefix_len, b.node,
                                                                  b.components)
        except BaseException:
            self._abandon(b.table, b.prefix_len, b.node, b.components, b.ns)
            raise
        return b._replace(table=table, prefix_len=prefix_len, node=node, components=comps,
                          swa_table=self._swa_table(table))

    def _cache_computed(self, tokens: np.ndarray, ns: tuple[str | None, str | None], table: np.ndarray,
                        prefix_len: int, node: int,
                        comps: Mapping[str, Any] = NO_VALUES) -> tuple[np.ndarray, int, int, Mapping[str, Any]]:
        """``cache_unfinished_req`` of a running request's computed ``tokens`` (a chunked prefill's piece
        or the whole prompt): their whole pages go into the tree and its lock moves to their end (with a
        recurrent state: the tree may take the request's slot for that end and hand it a fresh one, whose
        copy runs here). Returns the request's new (page table, tokens the tree owns, locked node,
        component values)."""
        state = self.client.cache_unfinished_req(RequestState(RadixKey(tokens, *ns), table, prefix_len, node, 0, comps))
        value = state.components.get("mamba")
        if value is not None and value.copies:
            self.engine.copy_states(value.copies)
        return state.device_pages, state.prefix_len, state.last_node, state.components

    def _abandon(self, table: np.ndarray, prefix_len: int, node: int, comps: Mapping[str, Any] = NO_VALUES,
                 ns: tuple[str | None, str | None] = (None, None)) -> None:
        """A request that failed after its lock and alloc (a forward or its decode raised): unlocks its
        prefix and frees its own pages (those past ``prefix_len``, and its component values), inserting
        nothing, in one step. Best effort: the caller raises the request's own error; a release that
        fails too is logged."""
        own = np.asarray(table[prefix_len // self.client.page_size:], dtype=np.int32)
        calls = ([Call(Method.DEC_LOCK_REF, node), Call(Method.FREE, own)] if not comps else
                 [Call(Method.ABANDON_REQUEST, RequestState(RadixKey(np.zeros(prefix_len, np.int32), *ns), table,
                                                           prefix_len, node, 0, comps))])
        try:
            for r in self.client.step(calls):
                r.unwrap()
        except Exception as e:  # (the cache is unreachable too: its state is the head's to recover)
            log.warning("could not release a failed request's lock (node %s) and %d pages: %s", node, own.size, e)

    def finish(self, b: Begun, gen: Generation, decode_s: float) -> ServeResult:
        """Caches the finished request (``cache_finished_req``; with a host tier, ``check_hicache_events``:
        sends held backups, applies acks, off the next request's critical path) and sums up its times."""
        t = time.perf_counter()
        seq = np.concatenate([b.prompt, np.asarray(gen.tokens[:-1], dtype=np.int32)])
        comps, value = b.components, b.components.get("mamba")
        if value is not None and value.track >= 0:  # which state its decode left in the track slot (``decode_args``)
            track_len = tracked_len(b.prompt.size, seq.size, self.client.page_size)
            comps = {**comps, "mamba": dataclasses.replace(value, track_len=track_len)}
        state = RequestState(RadixKey(seq, *b.ns), b.table, b.prefix_len, b.node, 0, comps)
        mk, p, n = b.marks, b.prefix, int(b.prompt.size)
        # the L3 cost model's recompute rate: this prefill's computed tokens and seconds (with L3 only)
        report = PrefillReport(n - p.hit, max(0.0, mk[-1] - mk[-2])) if self.storage else None
        tokens = self.account(p, n)
        if not self.client.in_process:  # one round trip (the check runs even if the finish fails)
            calls = [Call(Method.CACHE_FINISHED_REQ, state)]
            if self.hicache:
                calls.append(Call(Method.CHECK_HICACHE_EVENTS))
            if report is not None:
                calls.append(Call(Method.REPORT_PREFILL, report))
            calls.append(Call(Method.REPORT_TOKENS, tokens))
            for r in self.client.step(calls):
                r.unwrap()
        else:
            self.client.cache_finished_req(state)
            if self.hicache:
                self.client.check_hicache_events()
            if report is not None:
                self.client.report_prefill(report)
            self.client.report_tokens(tokens)
        end = time.perf_counter()
        match, l3, load_back, prefill = (y - x for x, y in zip(mk, mk[1:]))
        phases = ServePhases(match, l3, load_back, prefill, decode_s, end - t)
        return ServeResult(gen.tokens, b.logits, mk[-1] - mk[0], end - mk[0], n, p.hit - p.loaded, p.loaded,
                           n - p.hit, p.fetched, p.failed, phases, gen.logits, tokens)

    def account(self, p: _Prefix, prompt_len: int) -> TokenAccount:
        """Where each of the request's prompt tokens came from (``hicache.cluster.token_account``)."""
        return account_request(prompt_len, self.client.page_size, hit_l1=p.hit - p.loaded,
                               hit_l2=p.loaded - p.fetched, hit_l3=p.fetched, refused=p.refused, rest=p.rest)

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
            b = self.begin(req)  # (no hook: writes resume once the first token's logits are in)
            step = between_steps
        else:  # writes resume right after the first token is handed out: in the first between_steps()
            b = self.begin(req, resume=False)
            step = _AfterFirstToken(between_steps, self.client.resume_storage_writes)
        t = time.perf_counter()
        extra = b.decode_args
        try:
            if extra:
                gen = self.engine.decode(b.prompt, b.logits, b.table, req.max_new_tokens, between_steps=step, **extra)
            elif step is None:
                gen = self.engine.decode(b.prompt, b.logits, b.table, req.max_new_tokens)
            else:
                gen = self.engine.decode(b.prompt, b.logits, b.table, req.max_new_tokens, between_steps=step)
        except BaseException:  # nothing of a failed decode is cached: its lock and pages go back
            self._abandon(b.table, b.prefix_len, b.node, b.components, b.ns)
            raise
        finally:  # a one-token answer never calls between_steps; a failed decode must not keep the hold
            if isinstance(step, _AfterFirstToken):
                step.resume()
        decode_s = time.perf_counter() - t
        if self.hold_writes:  # the next request's prefill may follow at once: its writes wait for that first token
            self.client.pause_storage_writes()
        return self.finish(b, gen, decode_s)

    def serve_all(self, requests: Sequence[ServeRequest]) -> list[ServeResult]:
        return [self.serve(r) for r in requests]
