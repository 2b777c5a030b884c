"""sgl-jax serving through hicache: sgl-jax's Engine with hicache's head as its prefix cache (issue #24).

``from hicache.sgl_jax import Engine, HiCacheOptions``; ``Engine(model_path=..., hicache=HiCacheOptions())``
starts sgl-jax with the radix tree and every cache decision in an embedded hicache head inside sgl-jax's
scheduler process, L1 pages being sgl-jax's own device KV pool. sgl-jax is an optional dependency:
``HiCacheOptions`` and ``tiny_model`` import without it; ``Engine`` first checks the sgl-jax seams
(``hicache.sgl_jax.seams``) and fails with one error naming the version and what is missing.
"""

from __future__ import annotations

from typing import Any

from hicache.sgl_jax.options import HiCacheOptions
from hicache.sgl_jax.seams import SglJaxSeamError

__all__ = ["Engine", "HiCacheOptions", "SglJaxSeamError"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from hicache.sgl_jax import seams

        seams.require()
        from hicache.sgl_jax.engine import Engine

        return Engine
    raise AttributeError(f"module 'hicache.sgl_jax' has no attribute {name!r}")
