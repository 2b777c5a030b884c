"""Fixtures for sgl-jax served through hicache: a tiny local model (helpers: ``support.sgl_jax_env``).

sgl-jax is an optional test dependency (installed from ../shared/vendor/ on Python 3.12, see the README);
without it every test here is skipped. (This folder is not called ``sgl_jax``: ``tests/`` is on
``sys.path``, and a ``tests/sgl_jax`` folder would shadow the ``sgl_jax`` package, here and in the
spawned scheduler subprocess.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("sgl_jax", reason="sgl-jax is not installed (see .ci/run and ../shared/vendor/README.md)")

from support.sgl_jax_env import engine_kwargs, run, running  # noqa: E402

from hicache.sgl_jax.tiny_model import write_tiny_qwen3  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def no_cache_outputs(tiny_model: Path) -> list[list[int]]:
    """The workload's greedy outputs from sgl-jax without any prefix cache: the reference."""
    from sgl_jax.srt.entrypoints.engine import Engine as SglEngine

    with running(SglEngine, **engine_kwargs(tiny_model, disable_radix_cache=True)) as engine:
        outputs, cached = run(engine)
    assert cached == 0
    return outputs
