"""pytest plugin: sgl-jax's own host-pool tests run against hicache's host pool.

``python -m pytest -p hicache.sgl_jax.pytest_plugin .../sgl_jax/test/mem_cache/test_host_kv_pool.py
.../test_hicache_controller.py .../test_hicache_e2e.py`` binds ``sgl_jax.srt.mem_cache.host_kv_pool.LRUHostKVPool``
to ``hicache.sgl_jax.host_kv_pool.HostKVPoolAdapter`` (sgl-jax's interface over hicache's ``HostPool``) before
any test module is imported, so every ``LRUHostKVPool`` those tests, sgl-jax's ``HiCacheController`` and
``UnifiedRadixCache`` and ``kv_cache_builder.init_hicache`` build is hicache's. A test module imported before
the plugin (a conftest that imports it) still gets the adapter: collection rebinds the name in each collected
module that holds sgl-jax's class. ``pytest_unconfigure`` restores sgl-jax's class. Compatibility check, not
serving code: the Engine's L2 (``hicache.sgl_jax.tiers``) does not go through sgl-jax's host pool at all.

Tests skipped (each reads a private attribute of sgl-jax's class, which the adapter does not imitate; the
behaviour they guard is held by the adapter's public contract, see ``HostKVPoolAdapter``), by ``test_id``:

- ``test_host_kv_pool.py::TestLRUHostKVPoolBoundaryInvariants::test_lru_copy_from_device_not_implemented``:
  reads ``pool._device_pool.kv_buffer`` to build its argument.
- ``test_host_kv_pool.py::TestLRUHostKVPoolBoundaryInvariants::test_stage_backup_rejects_out_of_range_device_page``:
  reads ``pool._device_pool.kv_buffer`` for the device page count.
- ``test_host_kv_pool.py::TestLRUHostKVPoolBucketPadding::test_three_page_roundtrip_bit_exact``:
  calls ``pool._pad_to_page_bucket`` (sgl-jax's gather bucket helper).
- ``test_host_kv_pool.py::TestLRUHostKVPoolABA::test_stage_backup_drops_gather_when_slot_reused_midflight``:
  replaces ``pool._jit_gather_one_layer`` and reads ``pool._pending_lock`` / ``pool._pending_gather``.
- ``test_host_kv_pool.py::TestLRUHostKVPoolABA::test_flush_backup_rejects_stale_epoch``:
  rewrites ``pool._pending_gather`` entries and reads ``pool._slots``.
- ``test_host_kv_pool.py::TestLRUHostKVPoolABA::test_flush_load_skips_stale_epoch``:
  rewrites ``pool._pending_load`` entries under ``pool._pending_load_lock``.

``tests/sgl_jax_serving/test_pytest_plugin.py`` runs the three files with this plugin and checks the set of
skipped tests is exactly this list.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

PRIVATE_ATTRIBUTE_TESTS: dict[str, str] = {
    "test_host_kv_pool.py::TestLRUHostKVPoolBoundaryInvariants::test_lru_copy_from_device_not_implemented":
        "pool._device_pool",
    "test_host_kv_pool.py::TestLRUHostKVPoolBoundaryInvariants::test_stage_backup_rejects_out_of_range_device_page":
        "pool._device_pool",
    "test_host_kv_pool.py::TestLRUHostKVPoolBucketPadding::test_three_page_roundtrip_bit_exact":
        "pool._pad_to_page_bucket",
    "test_host_kv_pool.py::TestLRUHostKVPoolABA::test_stage_backup_drops_gather_when_slot_reused_midflight":
        "pool._jit_gather_one_layer, pool._pending_gather",
    "test_host_kv_pool.py::TestLRUHostKVPoolABA::test_flush_backup_rejects_stale_epoch":
        "pool._pending_gather, pool._slots",
    "test_host_kv_pool.py::TestLRUHostKVPoolABA::test_flush_load_skips_stale_epoch":
        "pool._pending_load",
}

_original: Any = None


def _classes() -> tuple[Any, Any, Any]:
    from sgl_jax.srt.mem_cache import host_kv_pool

    from hicache.sgl_jax.host_kv_pool import HostKVPoolAdapter

    return host_kv_pool, getattr(host_kv_pool, "LRUHostKVPool", None), HostKVPoolAdapter


def pytest_configure(config: pytest.Config) -> None:
    global _original
    from hicache.sgl_jax import seams

    seams.require()
    module, current, adapter = _classes()
    if current is None:
        raise seams.SglJaxSeamError(f"sgl-jax {seams.sgl_jax_version()} has no "
                                    f"sgl_jax.srt.mem_cache.host_kv_pool.LRUHostKVPool to rebind")
    if current is not adapter:
        _original = current
        module.LRUHostKVPool = adapter


def pytest_unconfigure(config: pytest.Config) -> None:
    global _original
    if _original is not None:
        module, _, _ = _classes()
        module.LRUHostKVPool = _original
        _original = None


def pytest_report_header(config: pytest.Config) -> str:
    module, current, _ = _classes()
    return f"hicache.sgl_jax.pytest_plugin: {module.__name__}.LRUHostKVPool is {current.__module__}.{current.__qualname__}"


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    _, current, _ = _classes()
    for module in list(sys.modules.values()):
        if _original is not None and getattr(module, "LRUHostKVPool", None) is _original:
            setattr(module, "LRUHostKVPool", current)
    for item in items:
        attributes = PRIVATE_ATTRIBUTE_TESTS.get(test_id(item))
        if attributes is not None:
            item.add_marker(pytest.mark.skip(
                reason=f"reads {attributes}, private to sgl-jax's LRUHostKVPool (hicache.sgl_jax.pytest_plugin)"))


def test_id(item: pytest.Item) -> str:
    """``file.py::Class::test``, wherever the rootdir is (node ids are relative to it)."""
    return "::".join([item.path.name, *item.nodeid.split("::")[1:]])
