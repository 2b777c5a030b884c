"""hicache: a multi-level KV cache (device HBM / host DRAM / object storage) for JAX LLM serving.

Public API re-exports. The control plane lives in ``hicache.cluster``, the data plane in
``hicache.workers`` and ``hicache.kernels``, L3 in ``hicache.storage`` (see DESIGN.md §2).
"""

__version__ = "0.1.0"
