"""The scheduler subprocess side: sgl-jax's ``Scheduler`` with hicache as its tree cache and allocator.

``install(options)`` runs first thing in the scheduler subprocess (``hicache.sgl_jax.launch``) and
rebinds two globals of sgl-jax's scheduler module, in that process only: ``build_kv_cache`` (sgl-jax's
tree-cache builder; ours builds the embedded head and the adapters) and ``Scheduler`` (the class that
sgl-jax's ``run_scheduler_process`` instantiates; ours puts the head's allocator where sgl-jax's was
and adds the head's statistics to ``get_internal_state``). sgl-jax's files are not touched.
"""

from __future__ import annotations

import functools
from typing import Any

from sgl_jax.srt.managers import scheduler as sgl_scheduler
from sgl_jax.srt.managers.scheduler import Scheduler

from hicache.sgl_jax.allocator import HeadPageAllocator, drain
from hicache.sgl_jax.options import HiCacheOptions
from hicache.sgl_jax.prefix_cache import HiCachePrefixCache
from hicache.sgl_jax.ranks import multi_host_client
from hicache.sgl_jax.seams import SglJaxSeamError, sgl_jax_version
from hicache.sgl_jax.tiers import attach_storage, build_client, rank_worker

STATS_KEY = "hicache"  # the key of the head's statistics in the scheduler's internal state


def build_hicache_kv_cache(options: HiCacheOptions, *, server_args: Any, req_to_token_pool: Any,
                           token_to_kv_pool_allocator: Any, page_size: int, is_hybrid: bool = False,
                           is_hybrid_recurrent: bool = False, tp_size: int = 1, **_: Any) -> HiCachePrefixCache:
    """``build_kv_cache`` for hicache: an embedded head over sgl-jax's device pool (its pages, its ids), with
    the host tiers ``options`` ask for (``hicache.sgl_jax.tiers``)."""
    if is_hybrid or is_hybrid_recurrent:
        raise ValueError("hicache cannot page sgl-jax's hybrid pools (a sliding-window model needs "
                         "disable_hybrid_swa_memory=True; recurrent hybrids are not supported: see options.py)")
    device_allocator = token_to_kv_pool_allocator
    if device_allocator.page_size != page_size:
        raise ValueError(f"allocator page_size {device_allocator.page_size} != scheduler page_size {page_size}")
    num_pages = device_allocator.size // page_size
    kvcache = device_allocator.get_kvcache()
    if server_args.nnodes > 1:  # one head, on rank 0; the other ranks apply its decisions and plans
        worker = attach = None
        if options.host_pages:
            worker = rank_worker(options, kvcache, page_size=page_size, num_pages=num_pages,
                                 rank=server_args.node_rank)
            attach = attach_storage(options, worker, server_args.model_path, tp_size)
        client = multi_host_client(options, server_args, page_size=page_size, num_pages=num_pages, worker=worker,
                                   attach=attach)
    else:
        client, worker = build_client(options, kvcache, page_size=page_size, num_pages=num_pages,
                                      model_path=server_args.model_path, tp_size=tp_size)
    allocator = HeadPageAllocator(client, kvcache, num_pages, page_size)
    drain(device_allocator)
    return HiCachePrefixCache(client, req_to_token_pool, allocator, host_tier=worker is not None,
                              storage=options.l3_url is not None, l3_min_tokens=options.l3_min_tokens)


class HiCacheScheduler(Scheduler):
    """sgl-jax's scheduler, with the head's allocator as ``token_to_kv_pool_allocator``."""

    def init_memory_pool_and_cache(self) -> None:
        super().init_memory_pool_and_cache()  # calls our build_hicache_kv_cache (installed below)
        if not isinstance(self.tree_cache, HiCachePrefixCache):
            raise SglJaxSeamError(f"sgl-jax {sgl_jax_version()} built a {type(self.tree_cache).__name__}, not "
                                  "hicache's: its scheduler no longer calls scheduler.build_kv_cache")
        self.token_to_kv_pool_allocator = self.tree_cache.token_to_kv_pool_allocator

    def get_new_batch_prefill(self) -> Any:
        """sgl-jax's, plus one fix: sgl-jax marks the batch full when a waiting request does not fit and
        clears the mark only when a running request finishes, so with nothing running the request would
        wait forever. With hicache, what keeps L1 room then is locks of transfers in flight: those are
        settled (a bounded wait) and the mark cleared, so the next iteration tries the request again."""
        batch = super().get_new_batch_prefill()
        if batch is None and self.waiting_queue and self.running_batch.is_empty() and self.running_batch.batch_is_full:
            if self.tree_cache.hicache_enabled:
                self.tree_cache.client.flush_write_through_acks()
            for info in self.running_batch.reqs_info:
                info.batch_is_full = False
        return batch

    def get_internal_state(self, recv_req: Any) -> Any:
        """sgl-jax's internal state plus the head's statistics, read once the transfers in flight are acked
        (a bounded wait, with a host tier): locks that only a transfer holds do not show as protected."""
        out = super().get_internal_state(recv_req)
        if self.tree_cache.hicache_enabled:
            self.tree_cache.client.flush_write_through_acks()
        out.internal_state[STATS_KEY] = self.tree_cache.stats()
        return out


def install(options: HiCacheOptions) -> None:
    """Makes sgl-jax's scheduler module build hicache's scheduler and cache (this process only)."""
    sgl_scheduler.build_kv_cache = functools.partial(build_hicache_kv_cache, options)
    sgl_scheduler.Scheduler = HiCacheScheduler
