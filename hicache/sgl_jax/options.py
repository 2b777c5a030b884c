"""``HiCacheOptions``: what a user chooses when sgl-jax serves through hicache, and the server-args check.

Both run in the process that builds the Engine, before any subprocess starts: sgl-jax answers a failure
in its scheduler subprocess by killing its parent, so every bad option must fail here, with a
``ValueError`` naming the value. The options travel to the scheduler subprocess pickled (spawn).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hicache.cluster import HeadConfig
from hicache.cluster.policy import HiCacheConfig, WritePolicy
from hicache.cluster.tree import EvictionPolicy, TreeConfig


@dataclass(frozen=True)
class HiCacheOptions:
    """hicache as sgl-jax's prefix cache on one host: L1 is sgl-jax's device KV pool, paged by the head.

    ``replica`` names the head (metrics); ``eviction_policy`` orders L1 victims. ``host_pages`` > 0 adds
    hicache's host pool (L2) of that many pages, backed up per ``write_policy``; ``l3_url`` (an fsspec URL,
    ``file:///path`` by default, ``gs://bucket/prefix``; needs L2) adds hicache's object store (L3), asked
    for prompts whose whole pages past the L1+L2 match hold >= ``l3_min_tokens`` tokens, under the
    namespace ``model_id`` (default: a fingerprint of the model's files, ``hicache.sgl_jax.tiers``).

    Several hosts (sgl-jax's ``nnodes`` > 1): rank 0 holds the head and sends its decisions and transfer plans
    to the other ranks (``hicache.sgl_jax.ranks``), each of which moves its own shard of L2/L3; they wait up
    to ``decision_timeout_s`` for each;
    ``decision_log`` (a folder) makes every rank log the decisions it applied there (tests, debugging).
    """

    replica: str = "sgl-jax"
    eviction_policy: EvictionPolicy | str = EvictionPolicy.LRU
    host_pages: int = 0
    write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH
    l3_url: str | None = None
    l3_min_tokens: int = 16
    l3_pages_per_object: int | None = None  # None: the store's default object size
    model_id: str | None = None
    decision_timeout_s: float = 60.0
    decision_log: str | None = None

    def __post_init__(self) -> None:
        for name in ("host_pages", "l3_min_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"HiCacheOptions.{name} must be an int >= 0, got {value!r}")
        if self.l3_url is not None:
            if not isinstance(self.l3_url, str) or "://" not in self.l3_url:
                raise ValueError(f"l3_url must be an fsspec URL like file:///path or gs://bucket, got {self.l3_url!r}")
            if not self.host_pages:
                raise ValueError(f"l3_url={self.l3_url!r} needs an L2 tier to stage through: set host_pages > 0")
        timeout = self.decision_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"HiCacheOptions.decision_timeout_s must be a number > 0, got {timeout!r}")
        if self.decision_log is not None and (not isinstance(self.decision_log, str) or not self.decision_log):
            raise ValueError(f"decision_log must be a folder path or None, got {self.decision_log!r}")
        if self.model_id is not None and (not isinstance(self.model_id, str) or not self.model_id):
            raise ValueError(f"model_id must be a non-empty str or None, got {self.model_id!r}")
        # HeadConfig / TreeConfig / HiCacheConfig validate the names and policies (ValueError naming the value).
        object.__setattr__(self, "write_policy", HiCacheConfig(1, self.write_policy).write_policy)
        config = self.head_config(page_size=1, num_pages=1)
        object.__setattr__(self, "eviction_policy", config.tree.eviction_policy)

    def head_config(self, page_size: int, num_pages: int) -> HeadConfig:
        """The embedded head for a device pool of ``num_pages`` sgl-jax pages (ids 1..num_pages) of
        ``page_size`` tokens: one page more, id 0, which the head hands out once and never gets back
        (sgl-jax's padding slot; see ``hicache.sgl_jax.allocator``)."""
        tree = TreeConfig(page_size=page_size, capacity_pages=num_pages + 1, eviction_policy=self.eviction_policy)
        hicache = None
        if self.host_pages:
            hicache = HiCacheConfig(host_slots=self.host_pages, write_policy=self.write_policy)
        return HeadConfig(replica=self.replica, tree=tree, hicache=hicache)


# server_args values hicache cannot serve with yet (or that would silently replace it): value -> why.
def unsupported_server_args(server_args: Any, options: HiCacheOptions | None = None) -> list[str]:
    """Reasons ``server_args`` cannot run with hicache as its prefix cache (with ``options``' tiers); empty
    when it can."""
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
    need(server_args.nnodes == 1 or server_args.dist_init_addr is not None, "dist_init_addr",
         "several hosts need dist_init_addr (host:port of rank 0): hicache's decisions go to its port + 7")
    need(server_args.dp_size == 1, "dp_size", "data parallelism is not supported yet")
    need(server_args.disaggregation_mode == "null", "disaggregation_mode", "PD disaggregation is not supported yet")
    need(server_args.schedule_policy != "dfs-weight", "schedule_policy",
         "dfs-weight walks sgl-jax's tree nodes; use fcfs, lpm, lof or random")
    if options is not None and options.host_pages:
        need(server_args.disable_overlap_schedule, "disable_overlap_schedule",
             "hicache's L1<->L2 transfers run on the scheduler thread, which must be the one running the "
             "forwards (set disable_overlap_schedule=True with host_pages > 0)")
    return reasons


# sgl-jax's model_runner.py:169 and model_runner_kv_cache_mixin.py:851 (commit cddbf6f) name these hybrids; the
# reasons below say which sgl-jax piece stops each (docs/perf_notes_sglhyb.md has the file:line detail).
SWA_BLOCKER = (
    "sgl-jax keeps a sliding-window model's local layers in a separate pool (SWAKVPool) whose allocator "
    "(SWATokenToKVPoolAllocator, the only holder of its full->SWA slot mapping) runs only with sgl-jax's own "
    "SWARadixCache or ChunkCache as the tree (ScheduleBatch.init_new asserts it), so hicache cannot be its prefix "
    "cache; set disable_hybrid_swa_memory=True to keep full-size KV on every layer, which hicache serves as "
    "full attention")
RECURRENT_BLOCKER = (
    "sgl-jax caches recurrent (linear-attention / Mamba) states only in its own UnifiedRadixCache (RECURRENT "
    "component), and its model runner refuses any other tree for these models (it requires "
    "enable_unified_radix_tree or disable_radix_cache, and hicache_storage='disable'), so hicache cannot be "
    "their prefix cache")


def recurrent_model_type(hf_config: Any) -> str | None:
    """The model type when sgl-jax runs ``hf_config`` as a linear-recurrent hybrid (its own three detectors,
    as its model runner asks them), else None."""
    from sgl_jax.srt.configs.bailing_hybrid import get_bailing_hybrid_config
    from sgl_jax.srt.configs.kimi_linear import get_kimi_linear_config
    from sgl_jax.srt.configs.qwen3_5 import get_qwen3_5_hybrid_config

    detectors = (get_kimi_linear_config, get_qwen3_5_hybrid_config, get_bailing_hybrid_config)
    if any(detect(hf_config) is not None for detect in detectors):
        return str(getattr(hf_config, "model_type", "unknown"))
    return None


def unsupported_kv_layout(server_args: Any) -> list[str]:
    """Reasons the model's KV cache is not one hicache's pools hold (MHA layers in one full-size pool), read
    from its config as sgl-jax reads it; empty when it is. A sliding-window model fits with
    ``disable_hybrid_swa_memory=True`` (sgl-jax then masks the window over full-size KV on every layer)."""
    from sgl_jax.srt.configs.model_config import AttentionArch, ModelConfig

    config = ModelConfig.from_server_args(server_args)
    reasons = []
    kind = recurrent_model_type(config.hf_config)
    if kind is not None:
        return [f"a linear-recurrent hybrid ({kind}): {RECURRENT_BLOCKER}"]
    if config.attention_arch != AttentionArch.MHA:
        reasons.append(f"attention_arch={config.attention_arch.name}: hicache's pools hold MHA KV pages only")
    layer_types = set(getattr(config.hf_text_config, "layer_types", None) or ())
    # sgl-jax's own rule for a hybrid SWA pool (model_runner.py:164): a window in the config, not disabled
    hybrid_swa = bool(config.sliding_window) and config.sliding_window > 0
    if (hybrid_swa or "sliding_attention" in layer_types) and not server_args.disable_hybrid_swa_memory:
        reasons.append(f"a sliding-window (local/global attention) model, layer_types={sorted(layer_types)}, "
                       f"sliding_window={config.sliding_window}: {SWA_BLOCKER}")
    elif layer_types - {"full_attention", "sliding_attention"}:
        reasons.append(f"layer_types={sorted(layer_types)}: hicache serves full- and sliding-window attention "
                       "layers only")
    return reasons


def check_server_args(server_args: Any, options: HiCacheOptions | None = None) -> None:
    """Raises ``ValueError`` listing every server arg hicache cannot serve with (with ``options``' tiers), and
    every reason the model's KV layout does not fit hicache's pools."""
    reasons = unsupported_server_args(server_args, options)
    if not reasons:
        reasons = [f"model {server_args.model_path}: {r}" for r in unsupported_kv_layout(server_args)]
    if not reasons and options is not None and options.l3_url is not None:
        from hicache.storage.object_store import open_object_store

        try:  # an unknown scheme or a local folder that cannot be made; a remote store that is down degrades to misses
            open_object_store(options.l3_url, {})
        except Exception as e:
            reasons.append(f"l3_url={options.l3_url!r} cannot be opened: {type(e).__name__}: {e}")
    if reasons:
        raise ValueError("sgl-jax with hicache as its prefix cache: " + "; ".join(reasons))
