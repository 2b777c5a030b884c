"""The reference engine's hybrid layers on their own: recurrent layers (state pool) and sliding-window
layers in their own SWA pool give bit-identical logits however the sequence is split into calls, whatever
slot or SWA pages hold the context, and match the dense reference to float tolerance."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from hicache.reference.engine import ForwardConfig, ModelConfig, ModelRunner, reference_forward
from hicache.reference.engine.runner import greedy_decode, tracked_len

FWD = ForwardConfig(chunk_size=8, page_size=4, max_pages=16)
TOKENS = np.random.default_rng(0).integers(0, 512, 30)


@pytest.fixture(scope="module")
def recurrent_runner():
    return ModelRunner(ModelConfig(num_layers=3, recurrent_layers=(1,), sliding_window=12), FWD, num_pages=32,
                       state_slots=4)


def test_recurrent_state_continues_bit_exactly_across_calls_and_slots(recurrent_runner):
    r = recurrent_runner
    ref = r.generate_no_cache(TOKENS, 5)
    table = list(range(10, 20))
    r.zero_states([1])
    r.prefill(TOKENS[:16], table, 0, 1)  # the state after 16 tokens, then copied to another slot
    r.copy_states([(1, 3)])
    r.prefill(TOKENS[:16], list(range(20, 24)), 0, 1)  # slot 1 moves on (other pages); slot 3 keeps its copy
    logits = r.prefill(TOKENS, table, 16, 3)
    out = r.decode(TOKENS, logits, table, 5, state_slot=3)
    assert out.tokens == ref.tokens
    np.testing.assert_array_equal(out.logits, ref.logits)
    dense = np.asarray(reference_forward(r.params, jnp.asarray(TOKENS), cfg=r.model))
    np.testing.assert_allclose(dense[-1], ref.logits[0], rtol=1e-4, atol=1e-4)


def test_swa_pool_reads_only_the_window_and_stays_exact():
    cfg = ModelConfig(num_layers=3, sliding_window=12)
    plain = ModelRunner(cfg, FWD, num_pages=32)
    r = ModelRunner(cfg, FWD, num_pages=32, params=plain.params, swa_pages=16)
    ref = plain.generate_no_cache(TOKENS, 5)
    np.testing.assert_array_equal(r.generate_no_cache(TOKENS, 5).logits, ref.logits)  # same model either way
    table = list(range(10))
    r.prefill(TOKENS[:16], table, 0, swa_table=[11, 12, 7, 3])
    # position 16 on reads (4, 16]: page 0's SWA KV is no longer needed, the tree may have dropped it (-1)
    swa = [-1, 12, 7, 3, 9, 1, 2, 4, 5, 6]
    logits = r.prefill(TOKENS, table, 16, swa_table=swa)
    out = r.decode(TOKENS, logits, table, 5, swa_table=swa)
    assert out.tokens == ref.tokens
    np.testing.assert_array_equal(out.logits, ref.logits)


@pytest.mark.parametrize("how", ["decode", "decode_step"])
def test_track_slot_holds_the_state_at_the_last_page_end_its_decode_crossed(recurrent_runner, how):
    """``track_slot``: the working state is copied there whenever it is at a page end during the decode; at the
    end it equals a fresh prefill's state at ``tracked_len`` (not one token off), and outputs are unchanged."""
    r = recurrent_runner
    prompt, n_new, table = TOKENS[:13], 10, list(range(10))
    r.zero_states([0])
    logits = r.prefill(prompt, table, 0, 0)
    if how == "decode":
        gen = r.decode(prompt, logits, table, n_new, state_slot=0, track_slot=2)
    else:  # the serving loop's path: one call per step
        gen = greedy_decode(lambda seq: r.decode_step(seq, table, 0, track_slot=2), prompt, logits, n_new)
    ref = r.generate_no_cache(prompt, n_new)
    assert gen.tokens == ref.tokens
    np.testing.assert_array_equal(gen.logits, ref.logits)
    seq = np.r_[prompt, gen.tokens[:-1]]  # its steps computed positions [13, 22): page ends 16 and 20
    p = tracked_len(prompt.size, seq.size, FWD.page_size)
    assert p == 20
    states = {}
    for n in (p - 1, p, p + 1):
        r.zero_states([1])
        r.prefill(seq[:n], list(range(10, 16)), 0, 1)
        states[n] = np.asarray(r.state_pool)[:, :, 1].copy()
    track = np.asarray(r.state_pool)[:, :, 2]
    np.testing.assert_array_equal(track, states[p])
    assert not np.array_equal(track, states[p - 1]) and not np.array_equal(track, states[p + 1])


def test_tracked_len_is_the_last_page_end_a_decode_computed_from():
    assert tracked_len(13, 22, 4) == 20
    assert tracked_len(13, 16, 4) == 0  # positions [13, 16): no page end
    assert tracked_len(12, 14, 4) == 12  # the prompt ends at a page end: its first step copies it
    assert tracked_len(13, 13, 4) == 0  # a one-token answer: no decode step


@pytest.mark.parametrize("kwargs, match", [
    ({"state_slot": 0, "track_slot": 0}, "other than the working state_slot 0"),
    ({"state_slot": 0, "track_slot": 4}, r"track_slot 4 must be a slot of the state pool \[0, 4\)"),
    ({"state_slot": 0, "track_slot": 1.0}, "track_slot must be an int slot id, got 1.0"),
    ({"track_slot": 1}, "needs an int state_slot, got None"),
])
def test_bad_track_slot_is_refused_before_any_forward(recurrent_runner, kwargs, match):
    r = recurrent_runner
    table = list(range(10))
    before, forwards = np.asarray(r.state_pool).copy(), r.forwards
    with pytest.raises(ValueError, match=match):
        r.decode_step(TOKENS[:17], table, **kwargs)
    with pytest.raises(ValueError, match=match):
        r.decode(TOKENS[:16], np.zeros(r.model.vocab_size, np.float32), table, 3, **kwargs)
    assert r.forwards == forwards
    np.testing.assert_array_equal(np.asarray(r.state_pool), before)
