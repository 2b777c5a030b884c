"""``HiCachePrefixCache``: sgl-jax's ``BasePrefixCache`` whose tree and every cache decision live in a hicache head.

sgl-jax's scheduler calls this object as it calls its own ``RadixCache`` (match, lock, cache a finished or
chunked request, evict, sizes); each call becomes a ``CacheClient`` call to the head (embedded in the
scheduler process for one host). The "tree nodes" sgl-jax holds on its requests (``req.last_node``) are
the head's node ids. Page ids are sgl-jax's own (``hicache.sgl_jax.page_map``); the slots a request
holds are listed in sgl-jax's ``req_to_token_pool``, which this object reads and rewrites as
``RadixCache`` does. Owned by sgl-jax's scheduler, one per scheduler process; single-threaded.
"""

from __future__ import annotations

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
from hicache.cluster.tree import RadixKey, RequestState
from hicache.sgl_jax.allocator import HeadPageAllocator
from hicache.sgl_jax.page_map import SLOT_DTYPE, pages_to_slots, slots_to_pages


class HiCachePrefixCache(BasePrefixCache):
    def __init__(self, client: CacheClient, req_to_token_pool: Any, allocator: HeadPageAllocator) -> None:
        self.client = client
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = allocator
        self.page_size = allocator.page_size
        self.disable = False  # sgl-jax reads it: a disabled cache turns off cache-aware scheduling
        self.hicache_enabled = False  # sgl-jax's own host tier hooks stay off (hicache's L2 comes later)

    @staticmethod
    def _key(token_ids: Any, extra_key: str | None) -> RadixKey:
        return RadixKey(np.asarray(token_ids, dtype=SLOT_DTYPE), extra_key)

    # -- matching and locks --------------------------------------------------------------------------
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key = params.key
        m = self.client.match_prefix(self._key(key.token_ids, key.extra_key))
        node = m.last_device_node
        return MatchResult(
            device_indices=pages_to_slots(m.device_pages, self.page_size),
            last_device_node=node,
            last_host_node=node,  # L1 only: sgl-jax requires it to equal last_device_node
            best_match_node=node,
            host_hit_length=0,
        )

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
        if is_insert:
            self.client.cache_finished_req(state)
            return
        own = state.device_pages[state.prefix_len // self.page_size :]
        self.client.free(own)
        self.client.dec_lock_ref(state.last_node)

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
        self.client.reset()
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
            **self.client.cache_stats(),
        }
