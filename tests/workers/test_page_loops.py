"""The compiled page loops (``hicache.workers.page_loops``) through ``PageCopier``: bit-identical to
numpy indexing in both directions, for consecutive ids of every run length, mixed runs, random ids,
layouts with several layers and heads, 8/16/32-bit items and runs of odd byte counts (every word
type); the numpy strategy as the fallback without numba."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.workers import host_copy, page_loops
from hicache.workers.host_copy import CopyStrategy, PageCopier

NUM_PAGES, NUM_SLOTS = 64, 96

# (L, 2, S, H, D), item dtype: f32 1 KiB pages (hicache_bench's), bf16 bits with L>1 and H>1, runs of
# 2 bytes (u2 words), 3 bytes (u1 words) and 12 bytes (u4 words).
LAYOUTS = [
    ((1, 2, 16, 1, 8), np.uint32),
    ((2, 2, 4, 2, 16), np.uint16),
    ((3, 2, 1, 1, 1), np.uint16),
    ((1, 2, 1, 1, 3), np.uint8),
    ((2, 2, 1, 3, 1), np.uint32),
]


def _id_cases(rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """(pages, slots): consecutive runs of lengths 1..12 on both sides, runs broken on one side only,
    mixed run lengths in one batch, random ids, one page, the last page and slot."""
    cases = []
    for n in range(1, 13):
        p0, s0 = rng.integers(0, NUM_PAGES - n), rng.integers(0, NUM_SLOTS - n)
        cases.append((np.arange(p0, p0 + n), np.arange(s0, s0 + n)))
    cases.append((np.arange(10, 20), rng.permutation(NUM_SLOTS)[:10]))  # pages consecutive, slots not
    cases.append((rng.permutation(NUM_PAGES)[:10], np.arange(40, 50)))  # slots consecutive, pages not
    mixed = np.concatenate([np.arange(0, 5), [30], np.arange(8, 10), np.arange(50, 57), [7]])
    cases.append((mixed, np.concatenate([np.arange(60, 67), [5], np.arange(20, 28)])))
    cases.append((rng.permutation(NUM_PAGES)[:40], rng.permutation(NUM_SLOTS)[:40]))
    cases.append((np.array([NUM_PAGES - 1]), np.array([NUM_SLOTS - 1])))
    assert all(p.size == s.size for p, s in cases)
    return [(p.astype(np.int32), s.astype(np.int32)) for p, s in cases]


needs_numba = pytest.mark.skipif(not page_loops.available(), reason="numba is not installed")


@needs_numba
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: str(x))
def test_compiled_copies_match_numpy_indexing(layout):
    shape, dtype = layout
    rng = np.random.default_rng(7)
    info = np.iinfo(dtype)
    pool = rng.integers(0, info.max, (shape[0], shape[1], NUM_PAGES, *shape[2:]), dtype=dtype, endpoint=True)
    slab = rng.integers(0, info.max, (NUM_SLOTS, *shape), dtype=dtype, endpoint=True)
    copier = PageCopier(slab, NUM_PAGES)
    assert copier.strategy is CopyStrategy.COMPILED
    model_pool, model_slab = pool.copy(), slab.copy()
    for pages, slots in _id_cases(rng):
        copier.to_slab(pool.ctypes.data, pages, slots)
        model_slab[slots] = np.moveaxis(model_pool[:, :, pages], 2, 0)
        np.testing.assert_array_equal(slab, model_slab)
        back = rng.permutation(NUM_PAGES)[: pages.size].astype(np.int32)
        copier.to_pool(pool.ctypes.data, back, slots)
        model_pool[:, :, back] = np.moveaxis(model_slab[slots], 0, 2)
        np.testing.assert_array_equal(pool, model_pool)
        # and the same ids the other way round: the loads write exactly the backed-up pages
        copier.to_pool(pool.ctypes.data, pages, slots)
        model_pool[:, :, pages] = np.moveaxis(model_slab[slots], 0, 2)
        np.testing.assert_array_equal(pool, model_pool)


@needs_numba
def test_compiled_and_numpy_strategies_agree_on_one_copier():
    """Switching strategy on a live copier: each writes the same bytes (the pool view is shared)."""
    rng = np.random.default_rng(3)
    shape = (2, 2, 4, 2, 16)
    slab = rng.integers(0, 1 << 16, (NUM_SLOTS, *shape), dtype=np.uint16)
    pools = {s: np.zeros((2, 2, NUM_PAGES, 4, 2, 16), np.uint16) for s in CopyStrategy}
    copier = PageCopier(slab, NUM_PAGES)
    pages, slots = rng.permutation(NUM_PAGES)[:50].astype(np.int32), rng.permutation(NUM_SLOTS)[:50].astype(np.int32)
    for strategy, pool in pools.items():
        copier.set_strategy(strategy)
        copier.to_pool(pool.ctypes.data, pages, slots)
    np.testing.assert_array_equal(pools[CopyStrategy.COMPILED], pools[CopyStrategy.NUMPY])
    assert pools[CopyStrategy.NUMPY].any()


def test_word_dtype_is_the_widest_that_divides_a_run():
    words = [page_loops.word_dtype(b) for b in (512, 12, 6, 3, 1)]
    assert words == [np.dtype(t) for t in ("u8", "u4", "u2", "u1", "u1")]


def test_without_numba_the_numpy_strategy_is_the_default(monkeypatch):
    monkeypatch.setattr(page_loops, "available", lambda: False)
    assert host_copy.default_strategy() is CopyStrategy.NUMPY
    slab = np.zeros((4, 1, 2, 1, 1, 8), np.uint16)
    copier = PageCopier(slab, 8)
    assert copier.strategy is CopyStrategy.NUMPY
    with pytest.raises(ValueError, match="strategy 'compiled' needs numba"):
        copier.set_strategy("compiled")
    assert copier.strategy is CopyStrategy.NUMPY
    with pytest.raises(ValueError, match="strategy 'compiled' needs numba"):
        PageCopier(slab, 8, "compiled")


def test_unknown_strategy_is_rejected_and_changes_nothing():
    copier = PageCopier(np.zeros((4, 1, 2, 1, 1, 8), np.uint16), 8, "numpy")
    with pytest.raises(ValueError, match="'gpu_dma'"):
        copier.set_strategy("gpu_dma")
    assert copier.strategy is CopyStrategy.NUMPY


@needs_numba
def test_compiled_copy_of_unequal_id_arrays_is_refused_untouched():
    slab = np.arange(4 * 16, dtype=np.uint16).reshape(4, 1, 2, 1, 1, 8)
    pool = np.zeros((1, 2, 8, 1, 1, 8), np.uint16)
    copier = PageCopier(slab, 8, "compiled")
    before = slab.copy()
    with pytest.raises(ValueError, match="3 pages vs 2 slots"):
        copier.to_slab(pool.ctypes.data, np.arange(3, dtype=np.int32), np.arange(2, dtype=np.int32))
    with pytest.raises(ValueError, match="3 pages vs 2 slots"):
        copier.to_pool(pool.ctypes.data, np.arange(3, dtype=np.int32), np.arange(2, dtype=np.int32))
    np.testing.assert_array_equal(slab, before)
    assert not pool.any()


@needs_numba
def test_first_bad_id_finds_range_and_duplicate_errors_and_clears_its_marks():
    first_bad = page_loops.loops().first_bad_id
    marks = np.zeros(10, np.uint8)
    cases = [([0, 9, 3, 4], -1), ([2], -1), ([1, 2, 10, 3], 2), ([-1, 2], 0), ([4, 5, 6, 5, 7], 3),
             ([3, 3], 1), (list(range(10)), -1), ([0, 1, 2, 2147483647], 3)]
    for ids, want in cases:
        assert first_bad(np.array(ids, np.int32), 10, marks) == want, ids
        assert not marks.any(), ids


@needs_numba
def test_the_engine_checks_ids_in_one_compiled_pass_and_still_names_bad_values():
    """``TransferEngine.check`` on the CPU data path: good plan ids come back as private copies, bad
    ones raise the sort-based check's messages, and its marks stay clear for the next plan."""
    import jax

    from hicache.workers import HostWorker, KVCacheSpec

    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, page_size=16, dtype="float32")
    worker = HostWorker(spec, 24, 16, devices=[jax.devices()[0]], host_pool_kind="numpy_slab")
    engine = worker.engine
    assert engine._id_loops is not None
    pages, slots = np.array([5, 0, 23], np.int32), np.array([15, 2, 0], np.int32)
    got_pages, got_slots = engine.check(pages, slots)
    np.testing.assert_array_equal(got_pages, pages)
    np.testing.assert_array_equal(got_slots, slots)
    assert got_pages is not pages and not np.shares_memory(got_pages, pages)
    assert got_slots is not slots and not np.shares_memory(got_slots, slots)
    bad = [
        (([1, 24], [0, 1]), r"device_pages out of range \[0, 24\): \[24\]"),
        (([1, -2], [0, 1]), r"device_pages out of range \[0, 24\): \[-2\]"),
        (([1, 2], [0, 16]), r"host_slots out of range \[0, 16\): \[16\]"),
        (([4, 7, 4], [0, 1, 2]), r"device_pages has duplicates: \[4\]"),
        (([4, 7, 8], [5, 1, 5]), r"host_slots has duplicates: \[5\]"),
        (([1, 2], [0]), r"2 device_pages vs 1 host_slots"),
    ]
    for (p, s), message in bad:
        with pytest.raises(ValueError, match=message):
            engine.check(np.array(p, np.int32), np.array(s, np.int32))
        assert not engine._page_id_marks.any() and not engine._slot_id_marks.any()
    with pytest.raises(TypeError, match="device_pages must be integers"):
        engine.check(np.array([1.5]), np.array([0], np.int32))
    worker.close()


def test_a_copier_imports_numba_only_at_its_first_compiled_copy():
    """Building a copier (every single-shard slab pool does, also for engines that never use it)
    costs no numba import; the first copy does."""
    import subprocess
    import sys

    code = (
        "import sys, numpy as np\n"
        "from hicache.workers.host_copy import PageCopier\n"
        "c = PageCopier(np.zeros((4, 1, 2, 1, 1, 8), np.uint16), 8)\n"
        "print(c.strategy.value, 'numba' in sys.modules)\n"
        "pool = np.zeros((1, 2, 8, 1, 1, 8), np.uint16)\n"
        "c.to_pool(pool.ctypes.data, np.array([1], np.int32), np.array([2], np.int32))\n"
        "print('numba' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    if page_loops.available():
        assert out.stdout.split() == ["compiled", "False", "True"]
    else:
        assert out.stdout.split() == ["numpy", "False", "False"]
