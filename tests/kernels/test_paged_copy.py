"""Paged copy kernels vs the pure-jnp reference (Pallas in TPU interpret mode on CPU)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hicache.kernels import paged_copy as pc
from hicache.kernels.paged_copy import CopyImpl

NUM_PAGES = 12


def _pool(layers: int, page_size: int, heads: int, head_dim: int, dtype, seed: int = 0) -> jax.Array:
    rng = np.random.default_rng(seed)
    shape = (layers, 2, NUM_PAGES, page_size, heads, head_dim)
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


# Every value of every axis of the sweep appears; pairs are spread over the cases. The full
# cross product (48 cases, ~1 s each in interpret mode) runs with -m slow.
SWEEP_AXES = dict(page_size=(1, 16, 64), layers=(1, 4), heads=(1, 8), head_dim=(64, 128),
                  dtype=(jnp.bfloat16, jnp.float32))
FAST_CASES = [
    (1, 1, 1, 64, jnp.bfloat16),
    (16, 4, 8, 128, jnp.float32),
    (64, 1, 8, 64, jnp.float32),
    (1, 4, 8, 128, jnp.bfloat16),
    (16, 1, 1, 128, jnp.bfloat16),
    (64, 4, 1, 64, jnp.bfloat16),
]
FULL_CASES = [c for c in itertools.product(*SWEEP_AXES.values()) if c not in FAST_CASES]

# Non-contiguous, unsorted ids; the padded tail (count < m) must be ignored.
IDS = np.array([7, 2, 11, 0, 5], np.int32)
DST = np.array([3, 9, 1, 10, 6], np.int32)


def _check_case(impl: CopyImpl, page_size, layers, heads, head_dim, dtype) -> None:
    kv = _pool(layers, page_size, heads, head_dim, dtype)
    row = pc.page_row_shape(kv.shape)
    m = 8  # bucketed capacity > count: padding rows must stay untouched
    ids = jnp.asarray(np.pad(IDS, (0, m - IDS.size)))
    out = jnp.full((m, *row), 3, dtype)
    got = pc.gather_pages(kv, ids, jnp.int32(IDS.size), out, impl=impl)
    want = pc.gather_pages_reference(kv, jnp.asarray(IDS))
    np.testing.assert_array_equal(np.asarray(got[: IDS.size]), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got[IDS.size:]), np.full((m - IDS.size, *row), 3, dtype))

    src = jnp.asarray(np.random.default_rng(1).standard_normal((m, *row), dtype=np.float32)).astype(dtype)
    dst = jnp.asarray(np.pad(DST, (0, m - DST.size)))
    expect = pc.scatter_pages_reference(kv, jnp.asarray(DST), src[: DST.size])
    new = pc.scatter_pages(jnp.array(kv), dst, jnp.int32(DST.size), src, impl=impl)
    np.testing.assert_array_equal(np.asarray(new), np.asarray(expect))


@pytest.mark.parametrize("impl", [CopyImpl.PALLAS_INTERPRET, CopyImpl.XLA])
@pytest.mark.parametrize("case", FAST_CASES, ids=lambda c: f"s{c[0]}-l{c[1]}-h{c[2]}-d{c[3]}-{jnp.dtype(c[4]).name}")
def test_kernel_matches_reference(impl, case):
    _check_case(impl, *case)


@pytest.mark.slow
@pytest.mark.parametrize("impl", [CopyImpl.PALLAS_INTERPRET, CopyImpl.XLA])
@pytest.mark.parametrize("case", FULL_CASES, ids=lambda c: f"s{c[0]}-l{c[1]}-h{c[2]}-d{c[3]}-{jnp.dtype(c[4]).name}")
def test_kernel_matches_reference_full_sweep(impl, case):
    _check_case(impl, *case)


def test_sweep_covers_every_value():
    for axis, (name, values) in enumerate(SWEEP_AXES.items()):
        assert {c[axis] for c in FAST_CASES} == set(values), name


@pytest.mark.parametrize(
    "ids, err, match",
    [
        ([], ValueError, "empty"),
        ([1, 2, 1], ValueError, r"duplicates: \[1\]"),
        ([0, 12], ValueError, r"out of range \[0, 12\): \[12\]"),
        ([-1, 3], ValueError, r"out of range \[0, 12\): \[-1\]"),
        ([[1, 2]], ValueError, "1-D"),
        ([1.0, 2.0], TypeError, "integers"),
        ([True, False], TypeError, "integers"),
    ],
)
def test_bad_ids_rejected(ids, err, match):
    with pytest.raises(err, match=match):
        pc.validate_ids(np.array(ids), NUM_PAGES)
    arr = np.array(ids)
    if arr.dtype.kind == "i" and arr.ndim == 1:  # the int32 fast path reports the same errors
        with pytest.raises(err, match=match):
            pc.validate_ids(arr.astype(np.int32), NUM_PAGES)


@pytest.mark.parametrize("n", [3, 24, 25, 300])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_validate_ids_long_arrays(n, dtype):
    """Every path (Python list for tiny int32 arrays, one numpy sort otherwise) accepts a permutation
    and names a duplicate or an id out of range wherever it sits."""
    upper = 1000
    ids = np.random.default_rng(n).permutation(upper)[:n].astype(dtype)
    got = pc.validate_ids(ids, upper)
    assert got.dtype == np.int32 and np.array_equal(got, ids) and not np.shares_memory(got, ids)
    dup = ids.copy()
    dup[-1] = dup[0]
    with pytest.raises(ValueError, match=rf"duplicates: \[{int(ids[0])}\]"):
        pc.validate_ids(dup, upper)
    for bad in (upper, -1):
        wrong = ids.copy()
        wrong[n // 2] = bad
        with pytest.raises(ValueError, match=rf"out of range \[0, {upper}\): \[{bad}\]"):
            pc.validate_ids(wrong, upper)
    assert np.array_equal(pc.validate_ids(ids, upper), ids)  # inputs untouched by the failed checks


def test_validate_ids_int32_fast_path_returns_a_copy():
    src = np.array([7, 0, 11], np.int32)
    got = pc.validate_ids(src, NUM_PAGES)
    assert got.dtype == np.int32 and got.tolist() == [7, 0, 11] and got is not src
    src[0] = 1
    assert got[0] == 7


def test_validate_ids_returns_int32_copy():
    src = np.array([3, 1], np.int64)
    got = pc.validate_ids(src, NUM_PAGES)
    assert got.dtype == np.int32 and got.tolist() == [3, 1]


def test_shape_validation():
    with pytest.raises(ValueError, match="axis 1 must be 2"):
        pc.validate_kv_shape((1, 3, 4, 16, 8, 64))
    with pytest.raises(ValueError, match="num_layers, 2, num_pages"):
        pc.validate_kv_shape((2, 4, 16, 8, 64))
    with pytest.raises(ValueError, match=r"has 2 rows but 3 page ids"):
        pc.validate_pages_shape((1, 2, 4, 16, 8, 64), (2, 1, 2, 16, 8, 64), 3)
    with pytest.raises(ValueError, match="must be \\[n"):
        pc.validate_pages_shape((1, 2, 4, 16, 8, 64), (2, 1, 2, 16, 4, 64), 2)
    with pytest.raises(ValueError, match="count=0"):
        pc.validate_count(0, 4)


def test_select_impl_per_backend():
    assert pc.select_impl("tpu") is CopyImpl.PALLAS_TPU
    assert pc.select_impl("cpu") is CopyImpl.XLA
    assert pc.select_impl("gpu") is CopyImpl.XLA
    assert pc.select_impl() is CopyImpl.XLA  # this machine
    with pytest.raises(ValueError, match="'metal'"):
        pc.select_impl("metal")


def test_copy_to_host_refuses_off_tpu():
    kv = _pool(1, 1, 1, 64, jnp.float32)
    with pytest.raises(NotImplementedError, match="pl.HOST"):
        pc.copy_pages_to_host(kv, jnp.array([0], jnp.int32), jnp.int32(1), num_rows=1)
