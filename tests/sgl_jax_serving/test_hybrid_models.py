"""Hybrid (local/global attention, linear-recurrent) sgl-jax models and hicache (issue #26, item 5).

A sliding-window model runs through hicache when sgl-jax keeps full-size KV on every layer
(``disable_hybrid_swa_memory=True``: the window is a mask): tokens served from L1 and L2 hits equal the
tokens computed without a hit and sgl-jax's without a cache, hits asserted. Without that flag, and for recurrent hybrids, the Engine fails at start,
before any subprocess, with one error naming the model kind and the sgl-jax piece that stops it
(docs/perf_notes_sglhyb.md).
"""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.sgl_jax_env import HOST_PAGES, SAMPLING, engine_kwargs, running

from hicache.sgl_jax import HiCacheOptions
from hicache.sgl_jax.engine import Engine
from hicache.sgl_jax.tiny_model import write_tiny_gemma2

WINDOW = 8  # tokens the local layers see: far fewer than a prompt holds, so the mask decides outputs


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma2(tmp_path_factory.mktemp("tiny-gemma2"), sliding_window=WINDOW)


def prompts() -> list[list[int]]:
    """Four 45-token prompts with no common prefix (180 tokens: more than the 128-token L1), then the same
    four reversed: the second pass finds the last ones in L1 and the first ones only in L2, and the first
    pass, which hits nothing, is what sgl-jax computes without a cache."""
    rng = np.random.default_rng(7)
    first = [rng.integers(2, 500, size=45).tolist() for _ in range(4)]
    return first + first[::-1]


def serve(engine: Any) -> tuple[list[list[int]], int]:
    outputs, cached = [], 0
    for prompt in prompts():  # one request at a time: the order of evictions is the workload's
        out = engine.generate(input_ids=[prompt], sampling_params=SAMPLING)[0]
        outputs.append(out["output_ids"])
        cached += out["meta_info"]["cached_tokens"]
    return outputs, cached


FULL_KV = {"disable_hybrid_swa_memory": True}  # sgl-jax masks the window over full-size KV on every layer


@pytest.fixture(scope="module")
def hicache_run(tiny_gemma2: Path) -> dict[str, Any]:
    options = HiCacheOptions(host_pages=HOST_PAGES)
    with running(Engine, **engine_kwargs(tiny_gemma2, **FULL_KV), hicache=options) as engine:
        outputs, cached = serve(engine)
        return {"outputs": outputs, "tiers": engine.hit_tokens_by_tier(cached), "stats": engine.hicache_stats()}


def test_sliding_window_model_hits_from_l1_and_l2_give_the_computed_tokens(hicache_run: dict[str, Any]) -> None:
    outputs = hicache_run["outputs"]
    assert outputs[4:] == outputs[:4][::-1]  # served from L1 / L2 == computed with no hit (the first pass)
    assert len({tuple(o) for o in outputs}) > 1  # the model does not answer every prompt alike
    tiers = hicache_run["tiers"]
    assert tiers["L1"] > 0 and tiers["L2"] > 0, tiers
    stats = hicache_run["stats"]
    assert stats["request_pages"] == 1 and stats["in_flight"] == 0  # only the padding page held


def test_sliding_window_model_exact_against_sgl_jax_without_cache(tiny_gemma2: Path,
                                                                  hicache_run: dict[str, Any]) -> None:
    from sgl_jax.srt.entrypoints.engine import Engine as SglEngine

    with running(SglEngine, **engine_kwargs(tiny_gemma2, disable_radix_cache=True, **FULL_KV)) as engine:
        reference, cached = serve(engine)
    assert cached == 0
    assert hicache_run["outputs"] == reference


def test_sliding_window_model_with_its_hybrid_pool_fails_before_launch(tiny_gemma2: Path) -> None:
    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match=r"a sliding-window \(local/global attention\) model.*"
                                         r"SWATokenToKVPoolAllocator.*SWARadixCache.*disable_hybrid_swa_memory=True"):
        Engine(**engine_kwargs(tiny_gemma2), hicache=HiCacheOptions())
    assert multiprocessing.active_children() == before


def test_recurrent_hybrid_model_fails_before_launch(tmp_path: Path) -> None:
    """A Kimi-Linear config (only its config is read): sgl-jax runs it with a recurrent state pool that only
    its own UnifiedRadixCache caches."""
    config = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 512,
              "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 2048, "torch_dtype": "float32",
              "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "head_dim": 128, "num_heads": 4,
                                     "short_conv_kernel_size": 4}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match=r"a linear-recurrent hybrid \(kimi_linear\).*UnifiedRadixCache"):
        Engine(**engine_kwargs(tmp_path), hicache=HiCacheOptions())
    assert multiprocessing.active_children() == before


def test_tiny_gemma2_rejects_a_window_that_is_not_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sliding_window must be a positive int, got 0"):
        write_tiny_gemma2(tmp_path, sliding_window=0)
    assert not any(tmp_path.iterdir())
