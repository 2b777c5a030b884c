"""The tiny local Qwen3: a safetensors file sgl-jax's loader reads back bit for bit, and bad shapes rejected."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hicache.sgl_jax.tiny_model import TinyQwen3, write_tiny_qwen3


def test_written_weights_read_back_exactly(tmp_path: Path) -> None:
    from safetensors.numpy import load_file  # what sgl-jax's weight loader reads with

    model = TinyQwen3(num_hidden_layers=1, seed=3)
    folder = write_tiny_qwen3(tmp_path / "m", model)
    loaded = load_file(str(folder / "model.safetensors"))
    expected = model.weights()
    assert loaded.keys() == expected.keys()
    assert all(np.array_equal(loaded[k], expected[k]) for k in expected)
    assert json.loads((folder / "config.json").read_text())["head_dim"] == 128
    assert not np.array_equal(TinyQwen3(seed=4).weights()["lm_head.weight"], TinyQwen3(seed=3).weights()["lm_head.weight"])


@pytest.mark.parametrize(("field", "value"), [("head_dim", 64), ("num_key_value_heads", 3), ("vocab_size", 0)])
def test_bad_shapes_are_rejected(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=f"{field}|{value}"):
        TinyQwen3(**{field: value})
