"""Configuration of the reference engine: the model (``ModelConfig``) and the fixed forward shape
(``ForwardConfig``).

Both are frozen, hashable dataclasses: ``ModelConfig`` is a static argument of the jitted forward, and
both feed the numerics signature (``numerics_key``) that a KV fingerprint must carry, because the bits
of the KV cache depend on the forward shape as well as on the model (see ``hicache.reference.engine.model``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

_DTYPES = ("float32", "bfloat16")


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _layer_set(name: str, layers: object, num_layers: int) -> None:
    if not isinstance(layers, tuple):
        raise ValueError(f"{name} must be a tuple, got {layers!r}")
    for layer in layers:
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < num_layers:
            raise ValueError(f"{name} entry {layer!r} not in [0, {num_layers})")
    if len(set(layers)) != len(layers):
        raise ValueError(f"{name} has duplicates: {layers}")


@dataclass(frozen=True)
class ModelConfig:
    """A tiny decoder-only transformer: RMSNorm, GQA attention with RoPE, SwiGLU MLP, untied head.

    ``sliding_window`` (tokens, the query included) applies to the layers in ``sliding_window_layers``;
    when that is ``None`` it applies to every other attention layer starting at layer 0 (local/global
    alternation). ``recurrent_layers`` have a gated linear recurrence instead of attention
    (``hicache.reference.engine.recurrent``: their context is one state per request, no KV).
    Defaults are small enough to compile and run fast on a 2-core CPU.
    """

    vocab_size: int = 512
    num_layers: int = 2
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    hidden: int = 128
    mlp_hidden: int = 256
    dtype: str = "float32"
    seed: int = 0
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] | None = None
    # Not in the repr: ``numerics_key`` (an L3 fingerprint) prints it only when set, so attention-only
    # models keep the fingerprint they had before the field existed.
    recurrent_layers: tuple[int, ...] = field(default=(), repr=False)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "num_q_heads", "num_kv_heads", "head_dim",
                     "hidden", "mlp_hidden"):
            _positive_int(name, getattr(self, name))
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads={self.num_q_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")
        if self.sliding_window is not None:
            _positive_int("sliding_window", self.sliding_window)
        if self.sliding_window_layers is not None:
            if self.sliding_window is None:
                raise ValueError(
                    f"sliding_window_layers={self.sliding_window_layers} given without sliding_window")
            if not isinstance(self.sliding_window_layers, tuple):
                raise ValueError(
                    f"sliding_window_layers must be a tuple, got {self.sliding_window_layers!r}")
            for layer in self.sliding_window_layers:
                if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
                    raise ValueError(
                        f"sliding_window_layers entry {layer!r} not in [0, {self.num_layers})")
            if len(set(self.sliding_window_layers)) != len(self.sliding_window_layers):
                raise ValueError(f"sliding_window_layers has duplicates: {self.sliding_window_layers}")
        _layer_set("recurrent_layers", self.recurrent_layers, self.num_layers)
        if set(self.recurrent_layers) & set(self.sliding_window_layers or ()):
            raise ValueError(f"layers {sorted(set(self.recurrent_layers) & set(self.sliding_window_layers or ()))} "
                             "are both recurrent_layers and sliding_window_layers")
        if len(self.recurrent_layers) == self.num_layers:
            raise ValueError(f"recurrent_layers={self.recurrent_layers} leave no attention layer")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 1.0):
            raise ValueError(f"rope_theta must be a number > 1, got {self.rope_theta!r}")
        if not (isinstance(self.norm_eps, float) and self.norm_eps > 0.0):
            raise ValueError(f"norm_eps must be a positive float, got {self.norm_eps!r}")

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def q_per_kv(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def window_of(self, layer: int) -> int | None:
        """The sliding window of ``layer`` in tokens, or ``None`` for a full-attention layer."""
        if self.sliding_window is None or layer in self.recurrent_layers:
            return None
        layers = (self.sliding_window_layers if self.sliding_window_layers is not None
                  else self.attention_layers[::2])
        return self.sliding_window if layer in layers else None

    def is_recurrent(self, layer: int) -> bool:
        return layer in self.recurrent_layers

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(layer for layer in range(self.num_layers) if layer not in self.recurrent_layers)

    @property
    def swa_layers(self) -> tuple[int, ...]:
        return tuple(layer for layer in range(self.num_layers) if self.window_of(layer) is not None)


@dataclass(frozen=True)
class ForwardConfig:
    """The one fixed shape of every forward (prefill chunks and decode steps alike).

    ``chunk_size`` rows per forward; token position ``p`` is always computed in row ``p % chunk_size``.
    Attention reads ``max_pages * page_size`` key slots through the page table (masked), so
    ``max_pages`` bounds a request's context. ``page_size`` must equal the L1 pool's page size.
    """

    chunk_size: int = 16
    page_size: int = 8
    max_pages: int = 64

    def __post_init__(self) -> None:
        for name in ("chunk_size", "page_size", "max_pages"):
            _positive_int(name, getattr(self, name))

    @property
    def max_context(self) -> int:
        return self.page_size * self.max_pages


def numerics_key(model: ModelConfig, fwd: ForwardConfig, backend: str,
                 mesh_shape: tuple[int, ...] = ()) -> str:
    """Everything the KV bits depend on, as a stable string for a cache fingerprint.

    Two engines produce bit-identical KV for the same tokens only when all of these agree (same
    compiled program: same backend and jax/XLA version). ``backend`` is e.g.
    ``jax.default_backend()``; ``mesh_shape`` is the shape of the mesh a sharded pool lives on (``()``
    for one device), since a forward split over another mesh may round its reductions differently.
    """
    recurrent = f"|recurrent={model.recurrent_layers}" if model.recurrent_layers else ""
    return (f"hicache-engine-v2|{model!r}{recurrent}|chunk={fwd.chunk_size}|page={fwd.page_size}"
            f"|max_pages={fwd.max_pages}|backend={backend}|mesh={tuple(mesh_shape)}"
            f"|jax={jax.__version__}")
