"""``HiCacheOptions``: what a user chooses when sgl-jax serves through hicache, and the server-args check.

Both run in the process that builds the Engine, before any subprocess starts: sgl-jax answers a failure
in its scheduler subprocess by killing its parent, so every bad option must fail here, with a
``ValueError`` naming the value. The options travel to the scheduler subprocess pickled (spawn).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hicache.cluster import HeadConfig
from hicache.cluster.tree import EvictionPolicy, TreeConfig


@dataclass(frozen=True)
class HiCacheOptions:
    """hicache as sgl-jax's prefix cache, one host, L1 only (sgl-jax's device KV pool, paged by the head).

    ``replica`` names the head (metrics, L3 namespace later); ``eviction_policy`` orders L1 victims.
    """

    replica: str = "sgl-jax"
    eviction_policy: EvictionPolicy | str = EvictionPolicy.LRU

    def __post_init__(self) -> None:
        # HeadConfig / TreeConfig validate the names and the policy (ValueError naming the value).
        config = self.head_config(page_size=1, num_pages=1)
        object.__setattr__(self, "eviction_policy", config.tree.eviction_policy)

    def head_config(self, page_size: int, num_pages: int) -> HeadConfig:
        """The embedded head for a device pool of ``num_pages`` sgl-jax pages (ids 1..num_pages) of
        ``page_size`` tokens: one page more, id 0, which the head hands out once and never gets back
        (sgl-jax's padding slot; see ``hicache.sgl_jax.allocator``)."""
        tree = TreeConfig(page_size=page_size, capacity_pages=num_pages + 1, eviction_policy=self.eviction_policy)
        return HeadConfig(replica=self.replica, tree=tree)


# server_args values hicache cannot serve with yet (or that would silently replace it): value -> why.
def unsupported_server_args(server_args: Any) -> list[str]:
    """Reasons ``server_args`` cannot run with hicache as its prefix cache; empty when it can."""
    reasons = []

    def need(ok: bool, name: str, why: str) -> None:
        if not ok:
            reasons.append(f"{name}={getattr(server_args, name)!r}: {why}")

    need(not server_args.disable_radix_cache, "disable_radix_cache", "hicache is the prefix cache; do not disable it")
    need(server_args.hicache_storage == "disable", "hicache_storage",
         "that is sgl-jax's own HiCache; hicache replaces it (leave it 'disable')")
    need(not server_args.enable_unified_radix_tree, "enable_unified_radix_tree",
         "selects sgl-jax's own tree; hicache replaces it")
    need(server_args.speculative_algorithm is None, "speculative_algorithm", "speculative decoding is not supported yet")
    need(not server_args.enable_single_process, "enable_single_process",
         "the scheduler must run in its own process (the head lives there)")
    need(server_args.nnodes == 1, "nnodes", "several hosts need the Ray head (not supported yet)")
    need(server_args.dp_size == 1, "dp_size", "data parallelism is not supported yet")
    need(server_args.disaggregation_mode == "null", "disaggregation_mode", "PD disaggregation is not supported yet")
    need(server_args.schedule_policy != "dfs-weight", "schedule_policy",
         "dfs-weight walks sgl-jax's tree nodes; use fcfs, lpm, lof or random")
    return reasons


def check_server_args(server_args: Any) -> None:
    """Raises ``ValueError`` listing every server arg hicache cannot serve with."""
    reasons = unsupported_server_args(server_args)
    if reasons:
        raise ValueError("sgl-jax with hicache as its prefix cache: " + "; ".join(reasons))
