"""Reference engine: a tiny deterministic JAX transformer over the paged L1 pool.

``ModelConfig``/``ForwardConfig`` (config), ``forward_chunk``/``compiled_forward``/``step_input``/
``init_params``/``reference_forward`` (model), ``ModelRunner`` (params + L1 pool + chunk loop),
``kv_layout`` (the one place that knows the L1 pool layout). The scheduler loop that drives the runner with the cache lives elsewhere.
"""

from hicache.reference.engine import kv_layout
from hicache.reference.engine.config import ForwardConfig, ModelConfig, numerics_key
from hicache.reference.engine.model import (
    chunk_rows,
    compiled_forward,
    forward_chunk,
    init_params,
    reference_forward,
    step_input,
)
from hicache.reference.engine.runner import (
    Generation,
    ModelRunner,
    PendingLogits,
    pages_needed,
    prefill_start,
)

__all__ = [
    "ForwardConfig",
    "Generation",
    "ModelConfig",
    "ModelRunner",
    "PendingLogits",
    "chunk_rows",
    "compiled_forward",
    "forward_chunk",
    "init_params",
    "kv_layout",
    "numerics_key",
    "pages_needed",
    "prefill_start",
    "reference_forward",
    "step_input",
]
