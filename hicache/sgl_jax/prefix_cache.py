"""``HiCachePrefixCache``: sgl-jax's ``BasePrefixCache`` whose tree and every cache decision live in a hicache head.

sgl-jax's scheduler calls this object as it calls its own ``RadixCache`` (match, lock, cache a finished or
chunked request, evict, sizes); each call becomes a ``CacheClient`` call to the head (embedded in the
scheduler process for one host). The "tree nodes" sgl-jax holds on its requests (``req.last_node``) are
the head's node ids. Page ids are sgl-jax's own (``hicache.sgl_jax.page_map``); the slots a request
holds are listed in sgl-jax's ``req_to_token_pool``, which this object reads and rewrites as
``RadixCache`` does. Owned by sgl-jax's scheduler, one per scheduler process; single-threaded.

Token accounting (``hicache.cluster.token_account``, as the reference scheduler does it): the request's last
match before it is scheduled (sgl-jax matches with ``req`` set then, and ``init_load_back`` follows for that
request) and its load-back are kept per request (``_Served``), and its finish reports the request's
``TokenAccount`` to the head in the same step as ``cache_finished_req``. Built from call results only, so every
rank of several hosts builds the same record (the follower checks it is rank 0's call). The reason of the
missed part is L3's when L3 was asked (``explain_l3``), else ``NOT_CACHED``: a plain match does not return the
tree's reason (evicted, other namespace).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
from sgl_jax.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefParams,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    MatchPrefixParams,
    MatchResult,
)

from hicache.cluster import CacheClient
from hicache.cluster.client import ResultRef
from hicache.cluster.controller import LoadBackParams
from hicache.cluster.events import MissReason
from hicache.cluster.head import Call, Method
from hicache.cluster.storage_tier import PrefetchParams, PrefetchProgress, PrefetchState
from hicache.cluster.token_account import TokenAccount, account_request, explain_l3
from hicache.cluster.tree import RadixKey, RequestState
from hicache.sgl_jax.allocator import HeadPageAllocator
from hicache.sgl_jax.page_map import SLOT_DTYPE, pages_to_slots, slots_to_pages


@dataclass
class _Served:
    """What the cache did for one request so far: its last match before scheduling and its load-back."""

    key_len: int
    device_hit: int
    host_hit: int
    node: int  # the match's best node (``init_load_back`` of this request names it)
    fetched: int = 0  # tokens L3 brought into L2 for it
    l3: PrefetchProgress | None = None  # L3's answer, when asked
    loaded: int = 0
    refused: tuple[MissReason | None, int] = (None, 0)  # the L2 part not loaded back, and why


MAX_SERVED = 1 << 14  # requests whose record is kept between their match and their finish


class HiCachePrefixCache(BasePrefixCache):
    def __init__(self, client: CacheClient, req_to_token_pool: Any, allocator: HeadPageAllocator, *,
                 host_tier: bool = False, storage: bool = False, l3_min_tokens: int = 0) -> None:
        """``host_tier``: the head has hicache's L2 (sgl-jax then calls the load-back and event hooks);
        ``storage``: and L3, asked at a request's match when the whole pages past its L1+L2 match hold
        >= ``l3_min_tokens`` tokens."""
        self.client = client
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = allocator
        self.page_size = allocator.page_size
        self.disable = False  # sgl-jax reads it: a disabled cache turns off cache-aware scheduling
        # sgl-jax calls its HiCache hooks (init_load_back, check_hicache_events, ...) only when this is True
        self.hicache_enabled = host_tier
        self.storage = storage
        self.l3_min_tokens = max(l3_min_tokens, self.page_size)
        self._prefetch_ids = itertools.count()
        # Load-backs sgl-jax's own HiCache would have dropped (more tokens than free L1 slots, the
        # ``mem_quota`` it passes): the head evicted L1 and loaded them. Tokens.
        self.loaded_past_free_tokens = 0
        self._served: dict[str, _Served] = {}  # by sgl-jax's request id, from its match to its finish
        self._last_matched: _Served | None = None  # the request sgl-jax matched last (it loads back next)

    @staticmethod
    def _key(token_ids: Any, extra_key: str | None) -> RadixKey:
        return RadixKey(np.asarray(token_ids, dtype=SLOT_DTYPE), extra_key)

    # -- matching and locks --------------------------------------------------------------------------
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """The head's match; with L3, a request's match (``params.req`` set: sgl-jax is about to schedule it)
        first fetches what L3 holds past L1+L2 into L2 (waited for, bounded), so the match that follows
        returns it as a host hit that ``init_load_back`` loads."""
        key = self._key(params.key.token_ids, params.key.extra_key)
        m = self.client.match_prefix(key)
        req = getattr(params, "req", None)
        if req is not None:
            earlier = self._served.get(req.rid)
            served = _Served(len(key), m.device_hit_len, 0, m.best_match_node,
                             fetched=0 if earlier is None else earlier.fetched)
            if self.storage:
                m = self._fetch_from_l3(key, m, served)
            served.host_hit = m.host_hit_len if self.hicache_enabled else 0
            served.node = m.best_match_node
            self._served.pop(req.rid, None)  # (re-inserted last: the oldest entry goes first below)
            self._served[req.rid] = self._last_matched = served
            if len(self._served) > MAX_SERVED:  # requests aborted while waiting never finish
                del self._served[next(iter(self._served))]
        return MatchResult(
            device_indices=pages_to_slots(m.device_pages, self.page_size),
            last_device_node=m.last_device_node,
            # the deepest node with an L2 copy (the device node when there is no host hit, as sgl-jax requires)
            last_host_node=m.best_match_node if m.host_hit_len else m.last_device_node,
            best_match_node=m.best_match_node,
            host_hit_length=m.host_hit_len if self.hicache_enabled else 0,
        )

    def _fetch_from_l3(self, key: RadixKey, m: Any, served: _Served) -> Any:
        """Prefetches L3's pages past the match ``m`` of ``key`` into L2 and matches again (one step); ``m``
        when L3 is not worth asking or holds nothing more. Notes L3's answer and what it fetched in ``served``."""
        whole = len(key) - len(key) % self.page_size
        if whole - m.device_hit_len - m.host_hit_len < self.l3_min_tokens:
            return m
        req_id = f"sgl-{next(self._prefetch_ids)}"
        served.l3 = started = self.client.prefetch_from_storage(PrefetchParams(req_id, key, m.best_match_node))
        if started.state is PrefetchState.NOT_STARTED:
            return m
        # matched again in the same step: applying the prefetch's acks may merge nodes of the first match
        checked, matched = self.client.step([Call(Method.CHECK_PREFETCH_PROGRESS, req_id),
                                             Call(Method.MATCH_PREFIX, key)])
        served.l3 = progress = checked.unwrap()
        if progress.state is PrefetchState.DONE:
            served.fetched += progress.tokens
        return matched.unwrap()

    def inc_lock_ref(self, node: int) -> IncLockRefResult:
        return IncLockRefResult(delta=self.client.inc_lock_ref(node))

    def dec_lock_ref(self, node: int, params: DecLockRefParams | None = None) -> int:
        return self.client.dec_lock_ref(node)

    # -- caching requests ----------------------------------------------------------------------------
    def _state(self, req: Any, token_ids: list[int]) -> RequestState:
        """The head's view of ``req``: its tokens, the pages of its slots, the tree-owned prefix, its lock."""
        slots = self.req_to_token_pool.read(req.req_pool_idx, len(token_ids))
        pages = slots_to_pages(slots, self.page_size)
        return RequestState(self._key(token_ids, req.extra_key), pages, req.cache_protected_len, req.last_node)

    def cache_finished_req(self, req: Any, is_insert: bool = True, **kwargs: Any) -> None:
        """Inserts the request's whole pages (the head frees duplicates and the partial tail) and unlocks;
        ``is_insert=False`` (a retracted request): frees its own pages and unlocks."""
        committed = req.pop_committed_kv_cache()
        state = self._state(req, (req.origin_input_ids + req.output_ids)[:committed])
        account = self._account(req)
        if is_insert:
            if account is None:
                self.client.cache_finished_req(state)
                return
            finished, reported = self.client.step([Call(Method.CACHE_FINISHED_REQ, state),
                                                   Call(Method.REPORT_TOKENS, account)])
            finished.unwrap()
            reported.unwrap()
            return
        own = state.device_pages[state.prefix_len // self.page_size :]
        self.client.free(own)
        self.client.dec_lock_ref(state.last_node)

    def _account(self, req: Any) -> TokenAccount | None:
        """The finished request's ``TokenAccount`` (module docstring); None when it was not matched as a prompt
        (a retracted request matched again with its output, or an aborted one never matched)."""
        served = self._served.pop(req.rid, None)
        prompt_len = len(req.origin_input_ids)
        if served is None or served.key_len != prompt_len - 1:
            return None
        loaded = served.loaded
        fetched = min(served.fetched, loaded)
        rest = explain_l3(MissReason.NOT_CACHED, served.l3)
        return account_request(prompt_len, self.page_size, hit_l1=served.device_hit, hit_l2=loaded - fetched,
                               hit_l3=fetched, refused=served.refused, rest=rest)

    def cache_unfinished_req(self, req: Any, **kwargs: Any) -> None:
        """Chunked prefill: caches what the request computed so far; the request continues on the tree's
        pages (duplicates freed) and its lock moves to the new end, as with sgl-jax's RadixCache."""
        token_ids = req.fill_ids
        old_prefix = req.cache_protected_len
        new = self.client.cache_unfinished_req(self._state(req, token_ids))
        slots = pages_to_slots(new.device_pages, self.page_size)[: len(token_ids)]
        self.req_to_token_pool.write((req.req_pool_idx, slice(old_prefix, new.prefix_len)),
                                     slots[old_prefix : new.prefix_len])
        req.last_matched_prefix_len = new.prefix_len
        req.cache_protected_len = new.prefix_len
        req.prefix_indices = slots
        req.last_node = new.last_node

    # -- the host tier (sgl-jax calls these only when ``hicache_enabled``) ------------------------------
    def init_load_back(self, last_host_node: int, host_hit_length: int,
                       mem_quota: int | None = None) -> tuple[np.ndarray, int, list]:
        """Loads the L2 part of a request's match back into L1 now and waits for it (bounded): returns the
        loaded part's slots, the node the prefix now ends at, and no deferred work (sgl-jax's
        ``finish_load_back`` gets an empty plan). Unlike sgl-jax's own HiCache, a load that needs more than
        ``mem_quota`` (sgl-jax's free slots) evicts L1 cache through the head instead of being recomputed;
        the head counts what it could not load (``miss_tokens``: ``no_space``, or a failed transfer). Runs
        between forwards on the scheduler thread (overlap scheduling is off with a host tier)."""
        none = np.empty(0, dtype=SLOT_DTYPE)
        if host_hit_length <= 0:
            return none, last_host_node, []
        started, done = self.client.step([
            Call(Method.INIT_LOAD_BACK, LoadBackParams(last_host_node, host_hit_length)),
            Call(Method.WAIT_LOAD_BACK, ResultRef(0, "load_id"))])
        r = started.unwrap()
        served, self._last_matched = self._last_matched, None
        if served is not None and served.node != last_host_node:
            served = None  # (not the request matched last: its record keeps no load-back)
        if r.load_id == -1 or not done.unwrap():  # nothing loaded (no room) or the load failed: recomputed
            if served is not None:
                why = r.miss_reason if r.load_id == -1 else MissReason.LOAD_FAILED
                served.refused = (why, host_hit_length)
            return none, last_host_node, []  # (sgl-jax keeps the request's L1 prefix and lock)
        if served is not None:
            served.loaded = r.loaded_tokens
            if r.loaded_tokens < host_hit_length:
                served.refused = (r.miss_reason, host_hit_length - r.loaded_tokens)
        if mem_quota is not None and r.loaded_tokens > mem_quota:
            self.loaded_past_free_tokens += r.loaded_tokens
        loaded = pages_to_slots(r.device_pages[-(r.loaded_tokens // self.page_size):], self.page_size)
        return loaded, r.last_node, []

    def finish_load_back(self, flush_plan: list) -> None:
        """Nothing deferred: ``init_load_back`` loads before it returns."""

    def check_hicache_events(self) -> None:
        """Sends queued backups and applies the acks that arrived (never blocks)."""
        self.client.check_hicache_events()

    def flush_write_through_acks(self) -> None:
        """sgl-jax calls this every decode step to free locks of finished backups early: as
        ``check_hicache_events`` (the head's own flush would wait for every transfer)."""
        self.client.check_hicache_events()

    def ready_to_load_host_cache(self) -> int:
        return self.client.ready_to_load_host_cache()

    def precompile_hicache_transfers(self) -> None:
        """Nothing: the transfer programs compile on first use (one per batch bucket)."""

    # -- eviction and sizes --------------------------------------------------------------------------
    def evict(self, params: EvictParams) -> EvictResult:
        return EvictResult(num_tokens_evicted=self.client.evict(params.num_tokens).evicted_tokens)

    def evictable_size(self, dp_rank: int = 0) -> int:
        return self.client.stats().evictable_tokens

    def protected_size(self, dp_rank: int = 0) -> int:
        return self.client.stats().protected_tokens

    def total_size(self) -> int:
        return self.client.stats().cached_tokens

    def reset(self) -> None:
        """Empties the head (L1, L2; an attached L3 keeps its content, its queued writes and manifest are
        written first): every transfer in flight is waited for (bounded) before."""
        if self.hicache_enabled:
            self.client.flush_write_through_acks()
        self.client.reset()
        self._served.clear()
        self._last_matched = None
        self.token_to_kv_pool_allocator.take_padding_page()

    def pretty_print(self) -> None:
        print(f"hicache head: {self.client.cache_stats()}")

    def stats(self) -> dict[str, Any]:
        """The head's tree statistics and tier counters (what ``Engine.hicache_stats`` returns)."""
        st = self.client.stats()
        return {
            "match_calls": st.match_calls,
            "matched_tokens": st.matched_tokens,
            "queried_tokens": st.queried_tokens,
            "evicted_tokens": st.evicted_tokens,
            "num_nodes": st.num_nodes,
            "free_pages": st.free_pages,
            "request_pages": st.request_pages,
            "protected_tokens": st.protected_tokens,
            "loaded_past_free_tokens": self.loaded_past_free_tokens,
            **self.client.cache_stats(),
        }
