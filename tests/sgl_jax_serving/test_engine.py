"""sgl-jax's real Engine serving through hicache: greedy outputs token for token equal to sgl-jax without
a cache and with its own RadixCache, prefix hits and evictions counted by hicache's head."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.sgl_jax_env import engine_kwargs, run, running

from hicache.sgl_jax import Engine, HiCacheOptions


@pytest.fixture(scope="module")
def hicache_run(tiny_model: Path) -> dict[str, Any]:
    with running(Engine, **engine_kwargs(tiny_model), hicache=HiCacheOptions()) as engine:
        outputs, cached = run(engine)
        stats = engine.hicache_stats()
    return {"outputs": outputs, "cached": cached, "stats": stats}


def test_hicache_outputs_equal_no_cache(no_cache_outputs: list[list[int]], hicache_run: dict[str, Any]) -> None:
    assert hicache_run["outputs"] == no_cache_outputs
    assert all(len(o) > 0 for o in no_cache_outputs)


def test_hicache_outputs_equal_sgl_jax_radix_cache(tiny_model: Path, hicache_run: dict[str, Any]) -> None:
    from sgl_jax.srt.entrypoints.engine import Engine as SglEngine

    with running(SglEngine, **engine_kwargs(tiny_model)) as engine:
        outputs, cached = run(engine)
    assert cached > 0
    assert hicache_run["outputs"] == outputs


def test_head_counts_hits_and_evictions_and_leaks_nothing(hicache_run: dict[str, Any]) -> None:
    stats = hicache_run["stats"]
    assert hicache_run["cached"] > 0  # sgl-jax scheduled requests on prefixes the head matched
    assert stats["matched_tokens"] > 0
    assert stats["device_evicted_tokens"] > 0  # the workload outgrows the 128-token pool
    assert stats["page_size"] == 1
    assert stats["device_capacity_tokens"] == 128 + 1  # sgl-jax's pages plus its padding page 0
    assert stats["request_pages"] == 1  # every request's pages went back: only the padding page is held
    assert stats["protected_tokens"] == 0


def test_hicache_paged_serves_and_leaks_nothing(tiny_model: Path, no_cache_outputs: list[list[int]]) -> None:
    """page_size 4: the head's pages are sgl-jax's 4-slot pages. sgl-jax's own paged path on XLA:CPU is not
    token-exact (without any cache, page_size 4 already changes outputs of later rounds), so only the first
    round, which no cache can serve, is compared; the rest asserts what the head did."""
    with running(Engine, **engine_kwargs(tiny_model, page_size=4), hicache=HiCacheOptions()) as engine:
        outputs, cached = run(engine)
        stats = engine.hicache_stats()
    assert outputs[:2] == no_cache_outputs[:2]
    assert cached > 0 and cached % 4 == 0  # sgl-jax ran on whole pages the head matched
    assert stats["matched_tokens"] > 0 and stats["device_evicted_tokens"] > 0
    assert stats["page_size"] == 4 and stats["device_capacity_tokens"] == 128 + 4
    assert stats["request_pages"] == 1 and stats["protected_tokens"] == 0
