"""Run beside sgl-jax's host-pool tests under ``-p hicache.sgl_jax.pytest_plugin`` (``test_pytest_plugin.py``
copies it out of ``tests/``, so the project's conftest does not load there): checks the class those tests
built was hicache's. Not collected by the project's own runs (its name does not start with ``test_``)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np

SGL_JAX_FILES = {"test_host_kv_pool.py", "test_hicache_controller.py", "test_hicache_e2e.py"}


def test_sgl_jax_names_hicache_host_pool() -> None:
    from sgl_jax.srt.mem_cache import host_kv_pool

    from hicache.sgl_jax.host_kv_pool import HostKVPoolAdapter

    assert host_kv_pool.LRUHostKVPool is HostKVPoolAdapter
    modules = {Path(m.__file__).name: m for m in list(sys.modules.values())
               if Path(getattr(m, "__file__", None) or "-").name in SGL_JAX_FILES}
    assert set(modules) == SGL_JAX_FILES  # collected in this session, before this test ran
    assert all(m.LRUHostKVPool is HostKVPoolAdapter for m in modules.values())


def test_sgl_jax_init_hicache_builds_hicache_host_pool() -> None:
    """sgl-jax's own builder (``kv_cache_builder.init_hicache``) attaches hicache's pool to its tree."""
    from sgl_jax.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sgl_jax.srt.mem_cache.kv_cache_builder import init_hicache
    from sgl_jax.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sgl_jax.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sgl_jax.srt.utils.mesh_utils import create_device_mesh

    from hicache.sgl_jax.host_kv_pool import HostKVPoolAdapter

    mesh = create_device_mesh(ici_parallelism=[1, -1], dcn_parallelism=[1, 1])
    kv = MHATokenToKVPool(size=16, page_size=1, dtype=jnp.float32, head_num=4, head_dim=128, layer_num=2,
                          mesh=mesh, dp_size=1)
    allocator = TokenToKVPoolAllocator(size=16, kvcache=kv, dp_size=1)
    cache = UnifiedRadixCache(req_to_token_pool=ReqToTokenPool(size=4, max_context_len=64, dtype=np.int32),
                              token_to_kv_pool_allocator=allocator, page_size=1, kv_head_num=4, head_dim=128,
                              layer_num=2, max_seq_len=64, dtype=jnp.float32)
    args = SimpleNamespace(hicache_ratio=2.0, hicache_write_through_threshold=1, hicache_write_policy="write_through")
    init_hicache(cache, args, mesh, allocator)
    try:
        assert isinstance(cache.host_pool, HostKVPoolAdapter)
        assert cache.host_pool.total_size() == 32 and cache.host_pool.host.num_slots == 32
    finally:
        cache.hicache_controller.shutdown()
