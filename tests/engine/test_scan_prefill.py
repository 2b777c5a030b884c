"""A prefill dispatched as scans of its chunks (``ModelRunner(scan_chunks=...)``) equals one forward per
chunk bit for bit; the runner's memo of checked page tables never lets an unchecked table through."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.reference.engine import kv_layout, runner, scan
from hicache.reference.engine.config import ForwardConfig, ModelConfig
from hicache.reference.engine.runner import TABLE_MEMO, ModelRunner

BASE = ModelConfig()
SWA = ModelConfig(num_layers=3, sliding_window=12)


@pytest.mark.parametrize("model, chunk", [(BASE, 16), (SWA, 8)])
def test_scanned_prefill_equals_one_forward_per_chunk_bit_for_bit(model, chunk):
    """Two runners, same params: one dispatches each chunk alone, the other in scans of up to 8 chunks
    (sizes 8, 4, 2 and a lone chunk, largest first). Logits of every computed position, the last
    logits, the decode after it and the whole pool are the same bits, for prompts of 1 to 15
    chunks after prefixes that end inside a chunk, at its start, or nowhere."""
    fwd = ForwardConfig(chunk_size=chunk, page_size=8, max_pages=16)
    one = ModelRunner(model, fwd, num_pages=96, scan_chunks=1)
    many = ModelRunner(model, fwd, num_pages=96, params=one.params, scan_chunks=8)
    assert one.scan_chunks == 1 and many.scan_chunks == 8
    rng = np.random.default_rng(chunk)
    for i, (n, start) in enumerate([(120, 0), (128, 8), (77, 0), (100, 64), (33, 16), (9, 8), (128, 0)]):
        prompt = rng.integers(0, model.vocab_size, n).tolist()
        table = [int(p) for p in rng.permutation(96)[:16]]
        if start:  # the prefix's KV, computed the same way in both pools
            for r in (one, many):
                r.extend(prompt[:start], table, 0)
        got, ref = many.extend(prompt, table, start), one.extend(prompt, table, start)
        assert got.tobytes() == ref.tobytes(), (n, start)
        assert many.prefill(prompt, table, start).tobytes() == one.prefill(prompt, table, start).tobytes()
        if n < 128:
            new = min(4, 129 - n)
            g1, g2 = (r.decode(prompt, ref[-1], table, new) for r in (one, many))
            assert g1.tokens == g2.tokens and g1.logits.tobytes() == g2.logits.tobytes()
        assert np.asarray(many.pool).tobytes() == np.asarray(one.pool).tobytes(), (n, start)
    assert many.forwards == one.forwards


def test_scan_chunks_is_checked_defaults_to_the_module_setting_and_is_off_where_not_checked(monkeypatch):
    fwd = ForwardConfig(chunk_size=16, page_size=8, max_pages=16)
    for bad in (0, 3, -2, True, 2.0):
        with pytest.raises(ValueError, match=rf"scan_chunks must be a positive power of two, got {bad!r}"):
            ModelRunner(BASE, fwd, num_pages=8, scan_chunks=bad)
    assert ModelRunner(BASE, fwd, num_pages=8).scan_chunks == runner.SCAN_CHUNKS_DEFAULT
    monkeypatch.setattr(runner, "SCAN_CHUNKS_DEFAULT", 4)
    assert ModelRunner(BASE, fwd, num_pages=8).scan_chunks == 4
    monkeypatch.setattr(scan, "BIT_EXACT_PLATFORMS", frozenset({"tpu"}))
    r = ModelRunner(BASE, fwd, num_pages=8, scan_chunks=8)
    assert r.scan_chunks == 1  # a platform where the scan's bits were not checked: a forward per chunk
    before = r.forwards
    r.prefill(list(range(40)), list(range(5)))
    assert r.forwards == before + 3


def test_checked_tables_are_remembered_by_content_only():
    """A table passed before is not checked again; the same array changed in place, a longer request
    over the same pages, or a pool of another size is checked again. The memo is bounded and its
    tables are read-only."""
    fwd = ForwardConfig(chunk_size=16, page_size=8, max_pages=16)
    r = ModelRunner(BASE, fwd, num_pages=16)
    prompt = list(range(20))
    table = np.array([3, 4, 5, 6], np.int32)
    r.prefill(prompt, table)
    padded = r._check_table(table, 20)
    assert padded is r._check_table(table.copy(), 20) and not padded.flags.writeable
    assert padded.tolist() == [3, 4, 5] + [0] * 13
    table[1] = 3  # the same array, now repeating a page
    with pytest.raises(ValueError, match=r"repeats a page among its first 3: \[3, 3, 5\]"):
        r.prefill(prompt, table)
    table[1] = 4
    with pytest.raises(ValueError, match=r"page_table has 4 pages, 5 needed for 40 tokens"):
        r.prefill(list(range(40)), table)
    with pytest.raises(ValueError, match=r"page id 16 at index 3 is outside the pool \[0, 16\)"):
        r.prefill(list(range(32)), [3, 4, 5, 16])
    r.set_pool(kv_layout.make_pool(BASE, 4, 8))  # a smaller pool: pages 4 and 5 are gone
    with pytest.raises(ValueError, match=r"page id 4 at index 1 is outside the pool \[0, 4\)"):
        r.prefill(prompt, table)
    r.set_pool(kv_layout.make_pool(BASE, TABLE_MEMO + 16, 8))
    for i in range(TABLE_MEMO + 10):
        r._check_table([i], 1)
    assert len(r._tables) == TABLE_MEMO
