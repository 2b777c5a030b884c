"""Pluggable tree components (UnifiedRadixCache idea): one tree, several kinds of cached state.

The radix tree owns structure (keys, parents, children, access times); each component owns one kind of
per-node value and its pool: Full attention KV (``FullComponent``, always present), later sliding-window
KV and Mamba state. The tree calls the hooks below at the points where node values must follow the
structure. Hooks run on the head, once per replica, never on the workers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache.cluster.tree.node import TreeNode
    from hicache.cluster.tree.params import InsertParams
    from hicache.cluster.tree.radix import RadixTree


class TreeComponent(ABC):
    """Per-node state that follows the radix structure.

    Hook order guarantees: ``validate_insert`` runs before any mutation of an insert (raise there, never
    later); ``on_split`` runs after the tree split ``suffix`` into ``prefix`` + ``suffix``; ``on_create``
    and ``on_revive`` run after the tree attached the node; ``on_remove`` runs before the node is dropped.
    """

    name: str = ""

    def attach(self, tree: RadixTree) -> None:
        self.tree = tree

    # -- structure -------------------------------------------------------------------------------
    def validate_insert(self, params: InsertParams, new_page_ranges: list[tuple[int, int]]) -> None:
        """Raise ValueError/TypeError if ``params`` cannot be inserted; must not mutate."""

    @abstractmethod
    def on_create(self, node: TreeNode, params: InsertParams, page_start: int, page_end: int) -> None:
        """A new node now holds pages [page_start, page_end) of the inserted sequence."""

    @abstractmethod
    def on_split(self, prefix: TreeNode, suffix: TreeNode) -> None:
        """``prefix`` took the first pages of ``suffix``; split the component's value the same way."""

    @abstractmethod
    def on_remove(self, node: TreeNode) -> None:
        """The node leaves the tree; release what the component holds for it."""

    def on_revive(self, node: TreeNode, params: InsertParams, page_start: int, page_end: int) -> None:
        """An L1-evicted node got fresh L1 values from an insert (recompute after eviction)."""

    # -- match -----------------------------------------------------------------------------------
    def limit_match(self, path: list[TreeNode]) -> int:
        """How many nodes of the matched L1 path this component can serve (default: all)."""
        return len(path)

    # -- checks and reporting ----------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the component's bookkeeping disagrees with the tree."""

    def stats(self) -> dict[str, Any]:
        return {}

    def reset(self) -> None:
        """Drop every value; the tree is being emptied."""
