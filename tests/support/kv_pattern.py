"""Known KV contents for exactness tests without a model.

The 'KV' of the token at position ``p`` is a function of the whole prefix up to ``p`` (like real KV),
so serving a page computed for another prefix shows up as a mismatch. Values are small integers, exact
in float32 and bfloat16-free; layers and K/V get distinct offsets.
"""

from __future__ import annotations

import numpy as np

_MOD = 1 << 19


def prefix_codes(tokens: np.ndarray) -> np.ndarray:
    """i64[n]: a rolling code of tokens[:p+1] for every position p."""
    t = np.asarray(tokens, dtype=np.int64)
    weights = np.arange(1, t.size + 1, dtype=np.int64)
    return np.cumsum((t % 1009) * (weights % 997) + 1) % _MOD


def page_rows(tokens: np.ndarray, first_page: int, num_pages: int, row_shape: tuple[int, ...], page_size: int,
              dtype=np.float32) -> np.ndarray:
    """Rows [num_pages, L, 2, S, H, D] for pages first_page.. of a sequence (positions past the end are 0)."""
    num_layers, two, s, heads, dim = row_shape
    assert two == 2 and s == page_size
    codes = prefix_codes(tokens)
    out = np.zeros((num_pages, *row_shape), dtype=dtype)
    for i in range(num_pages):
        lo = (first_page + i) * page_size
        vals = np.zeros(page_size, dtype=np.int64)
        n = max(0, min(page_size, codes.size - lo))
        vals[:n] = codes[lo : lo + n]
        for layer in range(num_layers):
            for kv in range(2):
                out[i, layer, kv] = (vals + (layer * 2 + kv) * _MOD)[:, None, None].astype(dtype)
    return out
