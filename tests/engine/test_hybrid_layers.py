"""The reference engine's hybrid layers on their own: recurrent layers (state pool) and sliding-window
layers in their own SWA pool give bit-identical logits however the sequence is split into calls, whatever
slot or SWA pages hold the context, and match the dense reference to float tolerance."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from hicache.reference.engine import ForwardConfig, ModelConfig, ModelRunner, reference_forward

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
