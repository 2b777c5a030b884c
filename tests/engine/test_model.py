"""Reference engine: cached KV == recomputed KV, bit for bit; the paged model is the dense model.

Real JAX on CPU, no mocks. One ``ModelRunner`` per model config per module (one compile each); each
test takes fresh pages from a per-runner page counter, so tests share the pool without interfering.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.reference.engine import (
    ForwardConfig,
    ModelConfig,
    ModelRunner,
    chunk_rows,
    init_params,
    kv_layout,
    numerics_key,
    pages_needed,
    prefill_start,
    reference_forward,
)

PAGE = 8
FWD = ForwardConfig(chunk_size=16, page_size=PAGE, max_pages=16)  # max context 128
NUM_PAGES = 512
BASE = ModelConfig(num_layers=2)
SWA = ModelConfig(num_layers=3, sliding_window=12)  # window on layers 0 and 2, full on layer 1


class Pages:
    """Hands out never-reused page ids of one runner (the tests' stand-in for the L1 allocator)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._next = itertools.count()

    def take(self, n: int) -> list[int]:
        ids = [next(self._next) for _ in range(n)]
        assert ids[-1] < NUM_PAGES, "test page budget exhausted; raise NUM_PAGES"
        return ids

    def reserved(self, name: str, n: int) -> list[int]:
        """The same ``n`` pages on every call with ``name`` (for hypothesis examples)."""
        if not hasattr(self, "_reserved"):
            self._reserved: dict[str, list[int]] = {}
        if name not in self._reserved:
            self._reserved[name] = self.take(n)
        return self._reserved[name]


# Paged forward vs the dense reference (two different programs): f32 matmuls are exact-f32 on CPU,
# TF32 by default on NVIDIA GPUs (differences ~2e-3 seen on an H200). Cached-vs-recomputed checks
# (the same program) stay bit-exact everywhere.
REF_TOL = 1e-4 if jax.default_backend() == "cpu" else 5e-3


@pytest.fixture(scope="module")
def base() -> Pages:
    return Pages(ModelRunner(BASE, FWD, NUM_PAGES))


@pytest.fixture(scope="module")
def swa() -> Pages:
    return Pages(ModelRunner(SWA, FWD, NUM_PAGES))


@pytest.fixture(scope="module")
def bf16() -> Pages:
    return Pages(ModelRunner(ModelConfig(num_layers=2, dtype="bfloat16", sliding_window=12), FWD,
                             NUM_PAGES))


@pytest.fixture(scope="module")
def sharded() -> Pages:
    """The pool sharded on the KV-head axis over 2 fake CPU devices (as the data plane lays it out)."""
    if len(jax.devices()) < 4:
        pytest.skip(f"needs 4 devices (fake CPU devices here), {jax.default_backend()} has {len(jax.devices())}")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("kv",))
    pool = kv_layout.make_pool(BASE, NUM_PAGES, PAGE,
                               jax.sharding.NamedSharding(mesh, kv_layout.sharded_spec("kv")))
    return Pages(ModelRunner(BASE, FWD, pool=pool))


@pytest.fixture(params=["base", "swa"])
def pages(request: pytest.FixtureRequest) -> Pages:
    return request.getfixturevalue(request.param)


def _prompt(seed: int, n: int, vocab: int = 512) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def _kv(runner: ModelRunner, table: list[int], n: int) -> tuple[np.ndarray, np.ndarray]:
    return kv_layout.read_positions(runner.pool, np.asarray(table), n)


def _assert_same_bits(a: np.ndarray, b: np.ndarray, what: str) -> None:
    assert a.shape == b.shape, what
    assert a.tobytes() == b.tobytes(), f"{what}: max |diff| {np.max(np.abs(a - b))}"


# --- (1) prefix reuse, incl. KV written by decode steps --------------------------------------------

@pytest.mark.parametrize("reuse_pages", [1, 3, 5, 6, 8])
def test_prefill_with_reused_pages_is_bit_identical(pages: Pages, reuse_pages: int) -> None:
    _check_reuse(pages, reuse_pages)


def test_bfloat16_reuse_is_bit_identical(bf16: Pages) -> None:
    """bf16 weights and pools: attention reads the pool, so the bf16 rounding of K/V is shared."""
    _check_reuse(bf16, 6)


def test_sharded_pool_reuse_is_bit_identical(sharded: Pages) -> None:
    r = sharded.runner
    assert len(r.pool.sharding.device_set) == 2 and len(r.pool.addressable_shards) == 2
    _check_reuse(sharded, 6)
    with pytest.raises(ValueError, match=r"not on the runner's devices"):
        r.set_pool(kv_layout.make_pool(BASE, NUM_PAGES, PAGE, jax.devices()[3]))


def _check_reuse(pages: Pages, reuse_pages: int) -> None:
    """Request A: 45-token prompt + 20 greedy tokens (positions 45..63 written by decode steps).
    Request B: A's sequence + a new turn, reusing A's first ``reuse_pages`` pages (page 5 mixes
    prefill and decode KV, pages 6-7 are decode-only). B's logits, KV and greedy tokens must equal
    B recomputed from scratch."""
    r = pages.runner
    prompt_a = _prompt(1, 45)
    table_a = pages.take(8)
    gen_a = r.generate(prompt_a, table_a, max_new_tokens=20)
    seq_a = prompt_a + list(gen_a.tokens)  # KV present for positions [0, 64)
    prompt_b = seq_a[:64] + _prompt(2, 13)  # 77 tokens
    new_tokens = 9
    n_pages_b = pages_needed(len(prompt_b) + new_tokens - 1, PAGE)

    table_scratch = pages.take(n_pages_b)
    scratch = r.extend(prompt_b, table_scratch, 0)  # f32[77, vocab]
    scratch_gen = r.decode(prompt_b, scratch[-1], table_scratch, new_tokens)

    start = reuse_pages * PAGE
    table_b = table_a[:reuse_pages] + pages.take(n_pages_b - reuse_pages)
    reused = r.extend(prompt_b, table_b, start)
    _assert_same_bits(reused, scratch[start:], "prompt logits after reuse")
    gen_b = r.decode(prompt_b, reused[-1], table_b, new_tokens)
    assert gen_b.tokens == scratch_gen.tokens
    _assert_same_bits(gen_b.logits, scratch_gen.logits, "decode logits after reuse")

    n_kv = len(prompt_b) + new_tokens - 1
    for got, want, name in zip(_kv(r, table_b, n_kv), _kv(r, table_scratch, n_kv), "KV"):
        _assert_same_bits(got, want, f"{name} in B's pages")
    # A's decode-written KV equals the prefill-written KV of the same tokens.
    for got, want, name in zip(_kv(r, table_a, 64), _kv(r, table_scratch, 64), "KV"):
        _assert_same_bits(got, want, f"{name} of A (prefill+decode) vs scratch prefill")


def test_chunk_split_does_not_change_bits(pages: Pages) -> None:
    """The same 77 tokens computed in one pass, in odd splits, and token by token (as decode does)."""
    r = pages.runner
    seq = _prompt(3, 77)
    n = pages_needed(len(seq), PAGE)
    table_one = pages.take(n)
    one = r.extend(seq, table_one, 0)
    for cuts in ([5, 29, 30, 61], list(range(1, 77))):
        table = pages.take(n)
        parts = [r.extend(seq[:end], table, beg) for beg, end in zip([0] + cuts, cuts + [77])]
        _assert_same_bits(np.concatenate(parts), one, f"logits with cuts {cuts[:6]}")
        for got, want, name in zip(_kv(r, table, 77), _kv(r, table_one, 77), "KV"):
            _assert_same_bits(got, want, f"{name} with cuts {cuts[:6]}")


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 100), cuts=st.lists(st.integers(1, 99), max_size=4, unique=True),
       reuse=st.integers(0, 12), seed=st.integers(0, 2**16))
def test_any_split_any_reuse_property(base: Pages, n: int, cuts: list[int], reuse: int,
                                      seed: int) -> None:
    """Arbitrary lengths, chunk cuts and reused page counts: always the one-pass bits."""
    r = base.runner
    # The same pages for all examples: every example rewrites what it reads.
    t_one, t_split, t_reuse = (base.reserved(name, FWD.max_pages) for name in ("one", "split", "reuse"))
    seq = _prompt(seed, n)
    one = r.extend(seq, t_one, 0)
    cuts = sorted(c for c in cuts if c < n)
    parts = [r.extend(seq[:end], t_split, beg) for beg, end in zip([0] + cuts, cuts + [n])]
    _assert_same_bits(np.concatenate(parts), one, f"logits, cuts {cuts}")
    for got, want, name in zip(_kv(r, t_split, n), _kv(r, t_one, n), "KV"):
        _assert_same_bits(got, want, f"{name}, cuts {cuts}")
    k = min(reuse, (n - 1) // PAGE)
    reused = r.extend(seq, t_split[:k] + t_reuse[k:], k * PAGE)
    _assert_same_bits(reused, one[k * PAGE:], f"logits reusing {k} pages")


def test_reuse_from_copied_pages(pages: Pages) -> None:
    """A prefix loaded back into *other* page ids (as an L2 -> L1 load does) gives the same bits."""
    r = pages.runner
    prompt = _prompt(4, 50)
    table_src = pages.take(pages_needed(50, PAGE))
    first = r.generate(prompt, table_src, max_new_tokens=1)
    moved = pages.take(4)  # copy the first 4 pages (32 tokens) elsewhere
    r.set_pool(kv_layout.copy_pages(r.pool, table_src[:4], moved))
    table = moved + pages.take(3)
    again = r.generate(prompt, table, max_new_tokens=6, start_pos=32)
    ref = r.generate_no_cache(prompt, max_new_tokens=6)
    assert again.tokens == ref.tokens and again.tokens[0] == first.tokens[0]
    _assert_same_bits(again.logits, ref.logits, "logits from moved pages")


# --- (2) greedy decoding, multi-turn ---------------------------------------------------------------

def test_multi_turn_greedy_matches_no_cache(pages: Pages) -> None:
    """Three turns, each reusing everything the previous turn left in the pages."""
    r = pages.runner
    table = pages.take(FWD.max_pages)
    seq: list[int] = []
    cached = 0  # positions whose KV is in ``table``
    for turn in range(3):
        seq = seq + _prompt(10 + turn, 11 + 7 * turn)
        start = prefill_start(cached, len(seq), PAGE)
        gen = r.generate(seq, table, max_new_tokens=8, start_pos=start)
        ref = r.generate_no_cache(seq, max_new_tokens=8)
        assert gen.tokens == ref.tokens, f"turn {turn}"
        _assert_same_bits(gen.logits, ref.logits, f"turn {turn} logits")
        seq = seq + list(gen.tokens)
        cached = len(seq) - 1


def test_generate_no_cache_leaves_l1_untouched(base: Pages) -> None:
    r = base.runner
    before = np.array(r.pool)
    r.generate_no_cache(_prompt(5, 20), max_new_tokens=3)
    _assert_same_bits(np.asarray(r.pool), before, "L1 pool")


def test_stop_token(base: Pages) -> None:
    r = base.runner
    ref = r.generate_no_cache(_prompt(6, 20), max_new_tokens=6)
    stop = ref.tokens[2]
    cut = r.generate_no_cache(_prompt(6, 20), max_new_tokens=6, stop_token=stop)
    assert cut.tokens == ref.tokens[: ref.tokens.index(stop) + 1]


# --- (3) the paged model is the dense model; sliding window ---------------------------------------

def test_paged_forward_matches_dense_reference(pages: Pages) -> None:
    r = pages.runner
    seq = _prompt(7, 100)
    got = r.extend(seq, pages.take(pages_needed(100, PAGE)), 0)
    want = np.asarray(reference_forward(r.params, np.asarray(seq, np.int32), cfg=r.model))
    np.testing.assert_allclose(got, want, rtol=REF_TOL, atol=REF_TOL)
    assert np.all(np.isfinite(got))


def test_sliding_window_changes_only_late_positions(base: Pages, swa: Pages) -> None:
    """Same weights (same seed and shapes up to layer 2); SWA differs only once the window cuts."""
    seq = _prompt(8, 40)
    b = base.runner.extend(seq, base.take(5), 0)
    s_cfg = ModelConfig(num_layers=2, sliding_window=SWA.sliding_window)
    s = np.asarray(reference_forward(init_params(s_cfg), np.asarray(seq, np.int32), cfg=s_cfg))
    w = SWA.sliding_window
    np.testing.assert_allclose(s[:w], b[:w], rtol=REF_TOL, atol=REF_TOL)
    assert np.max(np.abs(s[w:] - b[w:])) > 1e-2


def test_swa_layers_never_read_outside_the_window(swa: Pages) -> None:
    """NaN in SWA-layer pages behind every window changes nothing; NaN inside a window does."""
    r = swa.runner
    w = SWA.sliding_window
    prompt = _prompt(9, 70)
    ref = r.generate_no_cache(prompt, max_new_tokens=5)
    start = 48  # queries from 48 on see positions > 48 - 12 = 36: pages 0-3 (positions < 32) are dead
    table = swa.take(pages_needed(70 + 4, PAGE))
    r.extend(prompt[:start], table, 0)
    dead = table[: (start - w + 1) // PAGE]
    r.set_pool(kv_layout.fill_pages(r.pool, dead, np.nan, SWA.swa_layers))
    gen = r.generate(prompt, table, max_new_tokens=5, start_pos=start)
    assert gen.tokens == ref.tokens
    _assert_same_bits(gen.logits, ref.logits, "logits with NaN behind the window")

    live_page = table[len(dead)]  # positions 32..39: inside the window of query 48
    r.set_pool(kv_layout.fill_pages(r.pool, [live_page], np.nan, SWA.swa_layers[:1]))
    poisoned = r.extend(prompt, table, start)
    assert np.all(np.isnan(poisoned[0])), "query 48 must read positions 37..39 of layer 0"


def test_nan_where_no_query_may_look_changes_nothing(base: Pages) -> None:
    """Stale NaN in every slot no query may see (later slots of the request's own pages, the pages the
    padded page table points at) changes no bit: a masked score is -inf whatever its key holds, and
    unseen value rows are zeroed before ``p @ V``."""
    r = ModelRunner(BASE, FWD, NUM_PAGES, params=base.runner.params)  # own pool, same compiled forward
    prompt = _prompt(21, 27)
    ref = r.generate_no_cache(prompt, max_new_tokens=4)
    r.set_pool(kv_layout.fill_pages(r.pool, range(NUM_PAGES), np.nan))
    gen = r.generate(prompt, [5, 9, 2, 7], max_new_tokens=4)  # 30 positions; the padding reads page 0
    assert gen.tokens == ref.tokens
    _assert_same_bits(gen.logits, ref.logits, "logits over a pool full of NaN")


# --- (4) bad input and config ----------------------------------------------------------------------

def test_bad_requests_raise_value_error_naming_the_value(base: Pages) -> None:
    r = base.runner
    prompt = _prompt(11, 20)
    table = base.take(3)
    with pytest.raises(ValueError, match=r"page_table has 2 pages, 3 needed"):
        r.prefill(prompt, table[:2])
    with pytest.raises(ValueError, match=r"token id 512 at index 4"):
        r.prefill(prompt[:4] + [512] + prompt[5:], table)
    with pytest.raises(ValueError, match=r"token id -1 at index 0"):
        r.prefill([-1] + prompt[1:], table)
    with pytest.raises(ValueError, match=r"start_pos=3 must be a multiple of page_size=8"):
        r.prefill(prompt, table, start_pos=3)
    with pytest.raises(ValueError, match=r"start_pos=24 must be in \[0, 20\)"):
        r.prefill(prompt, table, start_pos=24)
    with pytest.raises(ValueError, match=rf"page id {NUM_PAGES} at index 1"):
        r.prefill(prompt, [table[0], NUM_PAGES, table[2]])
    with pytest.raises(ValueError, match=r"repeats a page"):
        r.prefill(prompt, [table[0], table[0], table[2]])
    with pytest.raises(ValueError, match=r"129 tokens exceed max_context=128"):
        r.prefill(_prompt(12, 129), list(range(17)))
    with pytest.raises(ValueError, match=r"non-empty"):
        r.prefill([], table)
    with pytest.raises(ValueError, match=r"max_new_tokens must be a positive int, got 0"):
        r.generate(prompt, table, max_new_tokens=0)
    with pytest.raises(ValueError, match=r"page_table has 3 pages, 4 needed for 20 tokens \+ 8 new"):
        r.generate(prompt, table, max_new_tokens=8)


def test_decode_checks_every_page_it_will_write_before_any_forward(base: Pages) -> None:
    r = base.runner
    prompt = _prompt(22, 15)  # 2 pages; 6 new tokens write positions up to 19: a third page
    table = base.take(2)
    logits = r.prefill(prompt, table)
    before = r.forwards
    with pytest.raises(ValueError, match=r"repeats a page"):
        r.decode(prompt, logits, table + [table[0]], max_new_tokens=6)
    with pytest.raises(ValueError, match=rf"page id {NUM_PAGES} at index 2 is outside the pool"):
        r.decode(prompt, logits, table + [NUM_PAGES], max_new_tokens=6)
    assert r.forwards == before  # rejected before the first decode step


def test_decoder_steps_equal_decode_step_and_reject_what_was_not_checked(base: Pages) -> None:
    r = base.runner
    prompt = _prompt(23, 13)  # 4 new tokens: positions 13..15 computed, 2 pages
    table = base.take(2)
    logits = r.prefill(prompt, table)
    step = r.decoder(prompt, table, max_new_tokens=4)
    seq = prompt + [int(np.argmax(logits))]
    got = step(seq)
    twin = base.take(2)  # the same request again in pages of its own, one decode_step
    r.prefill(prompt, twin)
    _assert_same_bits(got, r.decode_step(seq, twin), "decoder step vs decode_step")
    before = r.forwards
    with pytest.raises(ValueError, match=r"decode step at position 12: the request was checked for positions \[13, 16\)"):
        step(prompt)  # the prompt's own last position: not a decode step
    with pytest.raises(ValueError, match=r"decode step at position 16"):
        step(seq + [1, 2, 3])  # past the pages checked for max_new_tokens
    with pytest.raises(ValueError, match=rf"token id {BASE.vocab_size} at index 14 is outside the vocabulary"):
        step(seq + [BASE.vocab_size])
    assert r.forwards == before  # nothing forwarded by a rejected step


@pytest.mark.parametrize("kwargs, match", [
    ({"num_q_heads": 3}, r"num_q_heads=3 must be a multiple of num_kv_heads=2"),
    ({"head_dim": 31}, r"head_dim must be even for RoPE, got 31"),
    ({"vocab_size": 0}, r"vocab_size must be a positive int, got 0"),
    ({"dtype": "float16"}, r"dtype must be one of .*'float16'"),
    ({"sliding_window": 0}, r"sliding_window must be a positive int, got 0"),
    ({"sliding_window": 4, "sliding_window_layers": (0, 2)}, r"entry 2 not in \[0, 2\)"),
    ({"sliding_window_layers": (0,)}, r"without sliding_window"),
])
def test_bad_model_config(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kwargs)


def test_bad_forward_config_and_pool() -> None:
    with pytest.raises(ValueError, match=r"chunk_size must be a positive int, got 0"):
        ForwardConfig(chunk_size=0)
    with pytest.raises(ValueError, match=r"pool page_size=4 != ForwardConfig.page_size=8"):
        ModelRunner(BASE, FWD, pool=kv_layout.make_pool(BASE, 4, 4))
    with pytest.raises(ValueError, match=r"does not match the model"):
        ModelRunner(BASE, FWD, pool=kv_layout.make_pool(SWA, 4, PAGE))
    with pytest.raises(ValueError, match=r"must be \[layers, 2, pages.*got shape \(2, 4, 8, 2, 32\)"):
        ModelRunner(BASE, FWD, pool=kv_layout.make_pool(BASE, 4, PAGE)[:, 0])
    with pytest.raises(ValueError, match=r"dtype bfloat16 != model dtype float32"):
        ModelRunner(BASE, FWD, pool=kv_layout.make_pool(BASE, 4, PAGE).astype("bfloat16"))


# --- small pure pieces -----------------------------------------------------------------------------

def test_chunk_rows_pin_each_position_to_its_row() -> None:
    assert chunk_rows(0, 16, 16) == [(0, 0, 16)]
    assert chunk_rows(8, 40, 16) == [(0, 8, 16), (16, 16, 32), (32, 32, 40)]
    assert chunk_rows(45, 46, 16) == [(32, 45, 46)]
    with pytest.raises(ValueError, match=r"start=5, end=5"):
        chunk_rows(5, 5, 16)


def test_prefill_start_and_window_layers() -> None:
    assert prefill_start(0, 20, 8) == 0
    assert prefill_start(19, 20, 8) == 16
    assert prefill_start(16, 16, 8) == 8  # fully cached: recompute the last page for the logits
    assert prefill_start(40, 20, 8) == 16
    assert SWA.swa_layers == (0, 2) and BASE.swa_layers == ()
    assert ModelConfig(num_layers=4, sliding_window=8, sliding_window_layers=(1, 3)).swa_layers == (1, 3)
    assert numerics_key(BASE, FWD, "cpu") != numerics_key(BASE, ForwardConfig(chunk_size=8), "cpu")


def test_forward_donates_the_pool(base: Pages) -> None:
    r = base.runner
    old = r.pool
    r.prefill(_prompt(13, 5), base.take(1))
    assert old.is_deleted(), "forward_chunk must donate kv_pool (callers must drop old references)"
