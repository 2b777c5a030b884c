"""Leaf kernels (no imports of other hicache packages). One folder per kernel family, each with a
Pallas kernel, a pure-jnp reference beside it and shared validation."""

from hicache.kernels.paged_copy import CopyImpl, select_impl

__all__ = ["CopyImpl", "select_impl"]
