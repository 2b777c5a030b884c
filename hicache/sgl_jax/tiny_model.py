"""A tiny random Qwen3, and a tiny random Gemma-2 (local/global attention), in HF layout (config.json +
safetensors), written locally: no download.

For tests, benchmarks and the docs of ``hicache.sgl_jax``. The weights come from a seeded numpy RNG, so
two folders written with the same seed hold the same model (and give the same greedy tokens). Serve it
with ``skip_tokenizer_init=True`` and ``input_ids``: no tokenizer is written. ``head_dim`` is 128 because
sgl-jax's KV pool pads head_dim to a multiple of 128 and its CPU attention fails on the padding.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class TinyQwen3:
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 128
    max_position_embeddings: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "seed" else 1):
                raise ValueError(f"TinyQwen3.{name} must be a positive int, got {value!r}")
        if self.head_dim % 128:
            raise ValueError(f"head_dim must be a multiple of 128 (sgl-jax pads its KV pool to it), got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )

    def hf_config(self) -> dict:
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "attention_bias": False,
            "bos_token_id": 0,
            "eos_token_id": 1,
        }

    def weights(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d

        def dense(rows: int, cols: int) -> np.ndarray:
            return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

        out = {
            "model.embed_tokens.weight": rng.standard_normal((self.vocab_size, h)).astype(np.float32),
            "model.norm.weight": np.ones(h, np.float32),
            "lm_head.weight": dense(self.vocab_size, h),
        }
        for layer in range(self.num_hidden_layers):
            p = f"model.layers.{layer}"
            out.update({
                f"{p}.input_layernorm.weight": np.ones(h, np.float32),
                f"{p}.post_attention_layernorm.weight": np.ones(h, np.float32),
                f"{p}.self_attn.q_proj.weight": dense(q, h),
                f"{p}.self_attn.k_proj.weight": dense(kv, h),
                f"{p}.self_attn.v_proj.weight": dense(kv, h),
                f"{p}.self_attn.o_proj.weight": dense(h, q),
                f"{p}.self_attn.q_norm.weight": np.ones(d, np.float32),
                f"{p}.self_attn.k_norm.weight": np.ones(d, np.float32),
                f"{p}.mlp.gate_proj.weight": dense(i, h),
                f"{p}.mlp.up_proj.weight": dense(i, h),
                f"{p}.mlp.down_proj.weight": dense(h, i),
            })
        return out


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """The safetensors format for float32 arrays: an 8-byte little-endian header size, a JSON header of
    names, shapes and byte ranges (space-padded to 8 bytes), then the raw little-endian data."""
    header: dict[str, dict] = {}
    offset = 0
    for name, array in tensors.items():
        if array.dtype != np.float32:
            raise ValueError(f"{name}: only float32 is written, got {array.dtype}")
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for array in tensors.values():
            f.write(np.ascontiguousarray(array, dtype="<f4").tobytes())


def write_tiny_qwen3(path: str | Path, model: TinyQwen3 | None = None) -> Path:
    """Writes ``model`` (default ``TinyQwen3()``) to the folder ``path`` (created); returns it."""
    model = model or TinyQwen3()
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.hf_config(), indent=2))
    write_safetensors(folder / "model.safetensors", model.weights())
    return folder


def write_tiny_gemma2(path: str | Path, sliding_window: int = 8, seed: int = 0) -> Path:
    """A tiny random Gemma-2 (``TinyQwen3``'s sizes, tied embeddings, softcaps) whose even layers attend to the
    last ``sliding_window`` tokens and odd layers to all: a local/global hybrid. The post-norm gains are 3 (Gemma
    norms scale by 1 + weight) so that the layers, not the tied embedding, pick the next token. Written to the
    folder ``path`` (created); returns it."""
    if not isinstance(sliding_window, int) or isinstance(sliding_window, bool) or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int, got {sliding_window!r}")
    sizes = TinyQwen3(seed=seed)
    config = {k: v for k, v in sizes.hf_config().items() if k not in ("hidden_act", "attention_bias")}
    layers = sizes.num_hidden_layers
    config.update({
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": sizes.head_dim, "sliding_window": sliding_window, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "attention_bias": False, "tie_word_embeddings": True,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
    })
    weights = sizes.weights()
    h = sizes.hidden_size
    weights["model.embed_tokens.weight"] *= 0.02
    weights["model.norm.weight"] = np.zeros(h, np.float32)
    del weights["lm_head.weight"]
    for layer in range(layers):
        p = f"model.layers.{layer}"
        del weights[f"{p}.self_attn.q_norm.weight"], weights[f"{p}.self_attn.k_norm.weight"]
        for norm in ("input_layernorm", "pre_feedforward_layernorm"):
            weights[f"{p}.{norm}.weight"] = np.zeros(h, np.float32)
        for norm in ("post_attention_layernorm", "post_feedforward_layernorm"):
            weights[f"{p}.{norm}.weight"] = np.full(h, 2.0, np.float32)
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    write_safetensors(folder / "model.safetensors", weights)
    return folder
