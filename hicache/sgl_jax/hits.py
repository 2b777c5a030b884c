"""Prompt tokens served per tier, from the head's statistics (``Engine.hicache_stats``) and sgl-jax's count.

sgl-jax reports per request the prompt tokens it did not compute (``meta_info["cached_tokens"]``: L1 hits
plus what was loaded back); the head counts the tokens loaded back from L2 (``loaded_tokens``, including
pages L3 brought into L2 first) and the pages fetched from L3 (``storage.prefetch_pages``). Pure
arithmetic on those counters; runs anywhere.
"""

from __future__ import annotations

from typing import Any


def hit_tokens_by_tier(stats: dict[str, Any], cached_tokens: int) -> dict[str, int]:
    """``{"L1": ..., "L2": ..., "L3": ...}``: tokens reused from L1, loaded from L2, fetched from L3 (then
    loaded through L2). A page L3 fetched but no request loaded counts in L3 and not in L2."""
    loaded = int(stats.get("loaded_tokens", 0))
    l3 = int(stats.get("storage", {}).get("prefetch_pages", 0)) * int(stats["page_size"])
    return {"L1": max(0, cached_tokens - loaded), "L2": max(0, loaded - l3), "L3": l3}
