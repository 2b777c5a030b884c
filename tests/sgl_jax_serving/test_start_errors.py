"""Bad options, server args hicache cannot serve with, and another sgl-jax version: one clear error at
start, raised in the caller's process before sgl-jax starts any subprocess."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
from support.sgl_jax_env import engine_kwargs

import hicache.sgl_jax
from hicache.sgl_jax import HiCacheOptions, SglJaxSeamError, seams
from hicache.sgl_jax.engine import Engine
from hicache.sgl_jax.tiny_model import write_tiny_qwen3


def test_options_reject_bad_values() -> None:
    with pytest.raises(ValueError, match="'nope'"):
        HiCacheOptions(eviction_policy="nope")
    with pytest.raises(ValueError, match="'a/b'"):
        HiCacheOptions(replica="a/b")
    assert HiCacheOptions(eviction_policy="lfu").eviction_policy.value == "lfu"
    with pytest.raises(ValueError, match="host_pages must be an int >= 0, got -1"):
        HiCacheOptions(host_pages=-1)
    with pytest.raises(ValueError, match="'file:///x' needs an L2 tier"):
        HiCacheOptions(l3_url="file:///x")
    with pytest.raises(ValueError, match="'/no/scheme'"):
        HiCacheOptions(host_pages=8, l3_url="/no/scheme")
    with pytest.raises(ValueError, match="'sometimes'"):
        HiCacheOptions(host_pages=8, write_policy="sometimes")
    assert HiCacheOptions(host_pages=8, write_policy="write_back").head_config(1, 4).hicache.host_slots == 8


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"disable_radix_cache": True}, "disable_radix_cache=True"),
        ({"hicache_storage": "none"}, "hicache_storage='none'"),
        ({"enable_unified_radix_tree": True}, "enable_unified_radix_tree=True"),
        ({"schedule_policy": "dfs-weight"}, "schedule_policy='dfs-weight'"),
        ({"enable_single_process": True}, "enable_single_process=True"),
    ],
)
def test_server_args_hicache_cannot_serve_fail_before_launch(tiny_model: Path, overrides: dict, named: str) -> None:
    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match=named.replace("[", r"\[")):
        Engine(**engine_kwargs(tiny_model, **overrides), hicache=HiCacheOptions())
    assert multiprocessing.active_children() == before  # nothing was started


def test_host_tier_with_overlap_scheduling_fails_before_launch(tiny_model: Path) -> None:
    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match="disable_overlap_schedule=False"):
        Engine(**engine_kwargs(tiny_model, disable_overlap_schedule=False), hicache=HiCacheOptions(host_pages=8))
    assert multiprocessing.active_children() == before


def test_several_hosts_with_no_rank_0_address_fail_before_launch(tiny_model: Path) -> None:
    """Several hosts need rank 0's address: the decisions go from rank 0 to dist_init_addr's port + 7."""
    before = multiprocessing.active_children()
    two_hosts = {"nnodes": 2, "node_rank": 0, "tp_size": 2}
    with pytest.raises(ValueError, match="dist_init_addr=None"):
        Engine(**engine_kwargs(tiny_model, **two_hosts), hicache=HiCacheOptions())
    with pytest.raises(ValueError, match="decision_timeout_s must be a number > 0, got 0"):
        HiCacheOptions(decision_timeout_s=0)
    assert multiprocessing.active_children() == before


def test_model_with_a_kv_layout_the_pools_cannot_hold_fails_before_launch(tmp_path: Path) -> None:
    """An MLA model (a tiny DeepSeek-V3 config: only its config is read) and a model with sliding-window
    layers: one ValueError naming why, and nothing started."""
    import json

    mla = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 512,
           "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 64, "q_lora_rank": None,
           "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64, "n_routed_experts": 4,
           "num_experts_per_tok": 2, "max_position_embeddings": 2048, "torch_dtype": "float32"}
    swa = {**json.loads((write_tiny_qwen3(tmp_path / "base") / "config.json").read_text()),
           "layer_types": ["sliding_attention", "full_attention"]}
    before = multiprocessing.active_children()
    for name, config, named in (("mla", mla, "attention_arch=MLA"), ("swa", swa, "sliding_attention")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=named):
            Engine(**engine_kwargs(tmp_path / name), hicache=HiCacheOptions(host_pages=8))
    assert multiprocessing.active_children() == before


def test_l3_url_that_cannot_be_opened_fails_before_launch(tiny_model: Path, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    before = multiprocessing.active_children()
    for url, named in (("nope://bucket/x", "Protocol not known"), ((tmp_path / "a-file" / "l3").as_uri(), "a-file")):
        with pytest.raises(ValueError, match=f"l3_url=.* cannot be opened: .*{named}"):
            Engine(**engine_kwargs(tiny_model), hicache=HiCacheOptions(host_pages=8, l3_url=url))
    assert multiprocessing.active_children() == before


def test_engine_rejects_options_of_another_type(tiny_model: Path) -> None:
    with pytest.raises(TypeError, match="HiCacheOptions"):
        Engine(**engine_kwargs(tiny_model), hicache={"eviction_policy": "lru"})


def test_missing_seam_names_version_and_seam(monkeypatch: pytest.MonkeyPatch) -> None:
    from sgl_jax.srt.managers import scheduler as sgl_scheduler

    assert seams.missing_seams() == []
    monkeypatch.delattr(sgl_scheduler.Scheduler, "init_memory_pool_and_cache")  # as another version might
    version = seams.sgl_jax_version()
    expected = rf"sgl-jax {version} lacks .*sgl_jax\.srt\.managers\.scheduler:Scheduler\.init_memory_pool_and_cache"
    with pytest.raises(SglJaxSeamError, match=expected):
        seams.require()
    with pytest.raises(SglJaxSeamError, match=expected):
        hicache.sgl_jax.Engine  # the public entry point checks before it hands out the class
    with pytest.raises(SglJaxSeamError, match=expected):
        Engine(model_path="unused")


def test_missing_builder_keyword_is_a_missing_seam(monkeypatch: pytest.MonkeyPatch) -> None:
    from sgl_jax.srt.mem_cache import kv_cache_builder

    def build_kv_cache(*, server_args, page_size):  # an sgl-jax whose builder takes other arguments
        raise AssertionError("not called")

    monkeypatch.setattr(kv_cache_builder, "build_kv_cache", build_kv_cache)
    assert seams.missing_seams() == [
        "sgl_jax.srt.mem_cache.kv_cache_builder:build_kv_cache(req_to_token_pool=)",
        "sgl_jax.srt.mem_cache.kv_cache_builder:build_kv_cache(token_to_kv_pool_allocator=)",
        "sgl_jax.srt.mem_cache.kv_cache_builder:build_kv_cache(tp_size=)",
    ]


def test_without_sgl_jax_options_import_and_engine_names_the_install(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['sgl_jax'] = None\n"  # as if sgl-jax were not installed
        "import hicache.sgl_jax as h\n"
        "h.HiCacheOptions(eviction_policy='lfu')\n"
        "try:\n"
        "    h.Engine\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "hicache.sgl_jax needs sgl-jax: install it from its repository" in res.stdout
