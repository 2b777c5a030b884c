"""``decode_steps`` (one scan over B decode chunks) equals B ``decode_step`` calls bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.reference.engine.batched import batch_sizes, decode_steps, scan_lengths
from hicache.reference.engine.config import ForwardConfig, ModelConfig
from hicache.reference.engine.runner import ModelRunner
from hicache.reference.engine.scan import groups

MODEL = ModelConfig()


@pytest.mark.parametrize("chunk", [8, 16])
def test_batched_decode_equals_one_step_per_request_bit_for_bit(chunk):
    """Two runners, same params, same prefills; one decodes request by request, the other in batches
    of 1..8 (scans of power-of-two lengths: 3 = 2 + 1, 7 = 8 with an empty chunk): every logit row
    and the whole pool are the same bits, over three steps, positions in every row of the chunk."""
    fwd = ForwardConfig(chunk_size=chunk, page_size=8, max_pages=16)
    one = ModelRunner(MODEL, fwd, num_pages=160)
    many = ModelRunner(MODEL, fwd, num_pages=160, params=one.params)
    rng = np.random.default_rng(chunk)
    for b in range(1, 9):
        seqs = [list(rng.integers(0, MODEL.vocab_size, int(rng.integers(5, 100)))) for _ in range(b)]
        tables = [np.arange(i * 16, i * 16 + 16, dtype=np.int32)[::-1].copy() for i in range(b)]
        for s, t in zip(seqs, tables):
            for r in (one, many):
                r.extend(s, t, 0)
        for _ in range(3):
            ref = [one.decode_step(s, t) for s, t in zip(seqs, tables)]
            got = decode_steps(many, seqs, tables)
            for x, y in zip(got, ref):
                np.testing.assert_array_equal(x, y)
            for s, x in zip(seqs, ref):
                s.append(int(np.argmax(x)))
        np.testing.assert_array_equal(np.asarray(many.pool), np.asarray(one.pool))
    assert many.forwards == one.forwards


def test_batched_decode_rejects_bad_requests_and_runs_nothing():
    fwd = ForwardConfig(chunk_size=16, page_size=8, max_pages=16)
    r = ModelRunner(MODEL, fwd, num_pages=32)
    pool, forwards = r.pool, r.forwards
    seq, table = list(range(20)), np.arange(3, dtype=np.int32)
    with pytest.raises(ValueError, match="as many page tables"):
        decode_steps(r, [seq], [])
    with pytest.raises(ValueError, match="same page"):
        decode_steps(r, [seq, seq], [table, table])
    with pytest.raises(ValueError, match="outside the pool"):
        decode_steps(r, [seq], [np.array([0, 1, 99], np.int32)])
    with pytest.raises(ValueError, match="vocabulary"):
        decode_steps(r, [[MODEL.vocab_size]], [table])
    assert r.pool is pool and r.forwards == forwards
    assert [batch_sizes(n) for n in (1, 2, 3, 8, 9)] == [[1], [1, 2], [1, 2], [1, 2, 4, 8], [1, 2, 4, 8]]
    assert [groups(n) for n in (1, 3, 7, 8, 13)] == [[1], [2, 1], [4, 2, 1], [8], [8, 4, 1]]
    assert groups(40, 8) == [8] * 5 and groups(0) == []
    assert [scan_lengths(n) for n in range(1, 9)] == [[1], [2], [2, 1], [4], [4, 1], [4, 2], [8], [8]]
    assert scan_lengths(15) == [16] and scan_lengths(11) == [8, 2, 1] and scan_lengths(32) == [32]
    with pytest.raises(ValueError, match="at least one request, got 0"):
        batch_sizes(0)


def test_batched_decode_runs_only_where_its_bits_were_checked(monkeypatch):
    """Bit-identity is the compiler's: off the checked platforms (an H200's XLA:GPU gave other logits)
    both entry points refuse before anything runs, and the pool stays the runner's."""
    from hicache.reference.engine import batched, scan

    assert batched.supported("cpu") and not batched.supported("gpu") and not batched.supported("tpu")
    fwd = ForwardConfig(chunk_size=16, page_size=8, max_pages=16)
    monkeypatch.setattr(scan, "BIT_EXACT_PLATFORMS", frozenset({"tpu"}))
    r = ModelRunner(MODEL, fwd, num_pages=32)  # (the runner reads the platform off its pool)
    assert not r.scan_supported
    pool, forwards = r.pool, r.forwards
    with pytest.raises(ValueError, match=r"not bit-identical .*\['cpu'\]"):
        batched.compile_batches(r, 4)
    with pytest.raises(ValueError, match="not bit-identical"):
        decode_steps(r, [list(range(20))], [np.arange(3, dtype=np.int32)])
    assert r.pool is pool and r.forwards == forwards
