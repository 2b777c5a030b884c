"""hicache's host pool (L2) and object store (L3) under sgl-jax's real Engine (issue #24).

Greedy outputs token for token equal to sgl-jax without a cache, with the workload's tier rounds
(``support.sgl_jax_env.rounds``) forcing L1 and L2 evictions so that every tier serves tokens (asserted
> 0): L1+L2+L3, then a restarted engine on the same L3. Load-backs that sgl-jax's own HiCache drops
(more tokens than free L1 slots) are loaded by evicting L1, and counted. The L1+L2 configuration alone
runs in the slow suite (the L1+L2+L3 run covers its load-backs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.sgl_jax_env import HOST_PAGES, engine_kwargs, rounds, run, running

from hicache.sgl_jax import Engine, HiCacheOptions

L3_PAGES_PER_OBJECT = 8  # of one-token pages: a 40-token prefix ends on an object boundary


def serve(tiny_model: Path, options: HiCacheOptions) -> dict[str, Any]:
    with running(Engine, **engine_kwargs(tiny_model), hicache=options) as engine:
        outputs, cached = run(engine)
        stats = engine.hicache_stats()
        tiers = engine.hit_tokens_by_tier(cached)
    return {"outputs": outputs, "stats": stats, "tiers": tiers, "cached": cached}


def assert_every_prompt_token_accounted(result: dict[str, Any]) -> None:
    """Every request reported its ``TokenAccount`` to the head: the head's per-fate sums hold every prompt
    token of the workload once, and the hits are the tokens sgl-jax did not compute."""
    fates = result["stats"]["prompt_tokens"]
    assert sum(fates.values()) == sum(len(p) for prompts in rounds() for p in prompts)
    assert fates.get("hit_l1", 0) + fates.get("hit_l2", 0) + fates.get("hit_l3", 0) == result["cached"], fates
    assert fates.get("partial_page", 0) == sum(len(prompts) for prompts in rounds())  # each prompt's last token


@pytest.fixture(scope="module")
def l3_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tmp_path_factory.mktemp("l3").as_uri()


@pytest.fixture(scope="module")
def l1_l2_l3(tiny_model: Path, l3_url: str) -> dict[str, Any]:
    return serve(tiny_model, HiCacheOptions(host_pages=HOST_PAGES, l3_url=l3_url,
                                            l3_pages_per_object=L3_PAGES_PER_OBJECT))


def assert_no_leak(stats: dict[str, Any]) -> None:
    assert stats["request_pages"] == 1 and stats["protected_tokens"] == 0  # only the padding page is held
    assert stats["in_flight"] == 0 and stats["transfer_failures"] == 0


def test_l1_l2_l3_exact_with_hits_from_every_tier(l1_l2_l3: dict[str, Any], no_cache_outputs: list) -> None:
    assert l1_l2_l3["outputs"] == no_cache_outputs
    tiers = l1_l2_l3["tiers"]
    assert tiers["L1"] > 0 and tiers["L2"] > 0 and tiers["L3"] > 0, tiers
    stats = l1_l2_l3["stats"]
    assert stats["host_evicted_tokens"] > 0 and stats["device_evicted_tokens"] > 0  # both tiers overflowed
    assert stats["storage"]["backup_pages"] > 0
    assert_no_leak(stats)
    assert_every_prompt_token_accounted(l1_l2_l3)
    fates = stats["prompt_tokens"]
    assert fates["hit_l1"] > 0 and fates["hit_l2"] > 0 and 0 < fates["hit_l3"] <= tiers["L3"], fates


def test_load_backs_past_free_slots_are_loaded_not_recomputed(l1_l2_l3: dict[str, Any]) -> None:
    """sgl-jax's own HiCache loads a host hit only into free L1 slots (``mem_quota``), all or nothing; the
    head evicts L1 cache for it instead. The workload's L2 hits arrive with L1 full of evictable cache."""
    stats = l1_l2_l3["stats"]
    assert stats["loaded_past_free_tokens"] > 0
    assert stats["miss_tokens"].get("no_space", 0) == 0  # nothing recomputed for lack of room


def test_restarted_engine_hits_l3(tiny_model: Path, l3_url: str, l1_l2_l3: dict[str, Any],
                                  no_cache_outputs: list) -> None:
    restarted = serve(tiny_model, HiCacheOptions(host_pages=HOST_PAGES, l3_url=l3_url,
                                                 l3_pages_per_object=L3_PAGES_PER_OBJECT))
    assert restarted["outputs"] == no_cache_outputs
    assert restarted["tiers"]["L3"] > l1_l2_l3["tiers"]["L3"]  # a cold L1/L2: what the first run computed comes from L3
    assert_no_leak(restarted["stats"])


@pytest.mark.slow
def test_l1_l2_exact_with_l2_hits(tiny_model: Path, no_cache_outputs: list) -> None:
    result = serve(tiny_model, HiCacheOptions(host_pages=HOST_PAGES))
    assert result["outputs"] == no_cache_outputs
    assert result["tiers"]["L1"] > 0 and result["tiers"]["L2"] > 0 and result["tiers"]["L3"] == 0
    assert result["stats"]["loaded_past_free_tokens"] > 0
    assert_no_leak(result["stats"])
