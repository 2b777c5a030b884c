"""``HeadPageAllocator``: sgl-jax's token-to-KV allocator, answered by the head's L1 page allocator.

sgl-jax's scheduler and batches allocate KV slots through the allocator object they hold; with hicache
that object is this one, so every L1 page an sgl-jax request gets comes from the head (the one decision
point: it evicts its own tree to make room) and the ids it returns are sgl-jax's own pages/slots
(``hicache.sgl_jax.page_map``). sgl-jax's original allocator is drained at start so that any path still
reaching it fails as out of memory instead of handing out the head's pages twice.

Owned by sgl-jax's scheduler (one per scheduler process); the device KV buffers stay sgl-jax's
(``get_kvcache()``). A failed allocation returns None, as sgl-jax's allocators do.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sgl_jax.srt.mem_cache.allocator import BaseTokenToKVPoolAllocator

from hicache.cluster import CacheClient
from hicache.cluster.tree import CacheCapacityError
from hicache.sgl_jax.page_map import SLOT_DTYPE, pages_to_slots, unique_pages

PADDING_PAGE = 0  # sgl-jax's slot 0 ("no slot"); the head hands this page out once, at start, for good


class HeadPageAllocator(BaseTokenToKVPoolAllocator):
    def __init__(self, client: CacheClient, kvcache: Any, num_pages: int, page_size: int) -> None:
        super().__init__(num_pages * page_size, page_size, kvcache, dp_size=1)
        self.client = client
        self._free_group: list[np.ndarray] | None = None  # slots freed between free_group_begin/_end
        self.take_padding_page()

    def take_padding_page(self) -> None:
        """Takes page 0 off the head's free list (at start and after every reset of the head)."""
        page = self.client.alloc(self.page_size)
        if page.tolist() != [PADDING_PAGE]:
            raise RuntimeError(f"the head's first page must be {PADDING_PAGE} (sgl-jax's padding), got {page.tolist()}")

    # -- sizes ---------------------------------------------------------------------------------------
    def available_size(self, dp_rank: int = 0) -> int:
        return self.client.stats().free_pages * self.page_size

    def debug_print(self) -> str:
        st = self.client.stats()
        return f"head L1: {st.free_pages} free, {st.request_pages} request, {st.cached_tokens} cached tokens"

    # -- allocation ----------------------------------------------------------------------------------
    def _pages(self, num_pages: int) -> np.ndarray | None:
        try:
            return self.client.alloc(num_pages * self.page_size)
        except CacheCapacityError:
            return None

    def alloc(self, need_size: int, dp_rank: int = 0) -> np.ndarray | None:
        ps = self.page_size
        if need_size % ps:
            raise ValueError(f"alloc({need_size}) must be a multiple of page_size {ps}")
        pages = self._pages(need_size // ps)
        return None if pages is None else pages_to_slots(pages, ps)

    def alloc_extend(self, prefix_lens: list[int], seq_lens: list[int], last_loc: list[int],
                     extend_num_tokens: int, dp_rank: int = 0) -> np.ndarray | None:
        """Slots for tokens ``prefix_len .. seq_len - 1`` of each request: first the rest of the request's
        partial last page (after ``last_loc``), then fresh pages from the head."""
        ps = self.page_size
        prefix = np.asarray(prefix_lens, dtype=np.int64)
        seq = np.asarray(seq_lens, dtype=np.int64)
        new_pages = -(-seq // ps) - (-(-prefix // ps))
        pages = self._pages(int(new_pages.sum()))
        if pages is None:
            return None
        out = np.empty(extend_num_tokens, dtype=SLOT_DTYPE)
        at = used = 0
        for pre, end, last, fresh in zip(prefix.tolist(), seq.tolist(), last_loc, new_pages.tolist()):
            in_last = min(end, -(-pre // ps) * ps) - pre  # tokens that continue the partial last page
            out[at : at + in_last] = np.arange(last + 1, last + 1 + in_last)
            at += in_last
            rest = end - pre - in_last
            out[at : at + rest] = pages_to_slots(pages[used : used + fresh], ps)[:rest]
            at, used = at + rest, used + fresh
        if at != extend_num_tokens:
            raise ValueError(f"extend_num_tokens {extend_num_tokens} != {at} tokens between prefix_lens and seq_lens")
        return out

    def alloc_decode(self, seq_lens: list[int], last_loc: list[int], dp_rank: int = 0) -> np.ndarray | None:
        """One slot per request for its token ``seq_len - 1``: a fresh page's first slot when that token
        starts a page, else the slot after ``last_loc``."""
        ps = self.page_size
        starts_page = (np.asarray(seq_lens, dtype=np.int64) - 1) % ps == 0
        pages = self._pages(int(starts_page.sum()))
        if pages is None:
            return None
        out = np.asarray(last_loc, dtype=SLOT_DTYPE) + 1
        out[starts_page] = pages * ps
        return out

    # -- release -------------------------------------------------------------------------------------
    def free(self, free_index: np.ndarray, dp_rank: int = 0) -> None:
        if free_index.size == 0:
            return
        if self._free_group is not None:
            self._free_group.append(free_index)
            return
        self.client.free(unique_pages(free_index, self.page_size))

    def free_group_begin(self) -> None:
        self._free_group = []

    def free_group_end(self) -> None:
        group, self._free_group = self._free_group, None
        if group:
            self.free(np.concatenate(group))

    def clear(self, dp_rank: int | None = None) -> None:
        """Nothing to do: sgl-jax clears the allocator right after resetting the tree cache, and the head's
        reset (``HiCachePrefixCache.reset``) already returned every page (page 0 taken again)."""
        self._free_group = None

    def merge_and_sort_free(self, dp_rank: int = 0) -> None:
        """The head keeps one free list: nothing to merge."""

    def backup_state(self) -> Any:
        raise NotImplementedError("hicache's allocator has no state rollback (speculative decoding is not supported)")

    def restore_state(self, state: Any) -> None:
        raise NotImplementedError("hicache's allocator has no state rollback (speculative decoding is not supported)")

    def get_cpu_copy(self, indices: Any) -> Any:
        return self._kvcache.get_cpu_copy(indices)

    def load_cpu_copy(self, kv_cache_cpu: Any, indices: Any) -> Any:
        return self._kvcache.load_cpu_copy(kv_cache_cpu, indices)


def drain(allocator: Any) -> None:
    """Takes every free slot off sgl-jax's own allocator (see the module docstring)."""
    n = allocator.available_size()
    if n and allocator.alloc(n) is None:
        raise RuntimeError(f"could not drain sgl-jax's allocator ({n} slots free)")
