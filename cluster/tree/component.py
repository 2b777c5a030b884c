"""Pluggable tree components (UnifiedRadixCache idea): one tree, several kinds of cached state.

The radix tree owns structure (keys, parents, children, access times); each component owns one kind of
per-node value and its pool: Full attention KV (``FullComponent``, always present), later sliding-window
KV and Mamba state. The tree calls the hooks below at the points where node values must follow the
structure. Hooks run on the head, once per replica, never on the workers.

Full-only trees never call the optional hooks below ``on_revive``: the tree loops over
``extra_components`` only, so a tree without SWA/Mamba pays nothing for them. Among the extra components
the tree calls an optional hook only on those that override it (``ComponentHooks``): a hook a component
does not define costs it nothing per request.

HiCache hooks (L1 <-> L2 per component; the controller owns the host pools and the transfers):

- ``build_hicache_transfers(node, phase)`` says what this component must move for ``node``. For
  ``BACKUP`` the destinations are host ids the host tier fills in (``dst=None``); for ``LOAD_BACK`` the
  controller has already attached device pages to the loading chain (``node.loading``) and the component
  names sources (host ids) and destinations (device ids), reserving device ids it owns (Mamba slots).
  Full (``FullComponent``): one KV transfer along the chain of ancestors without host copy (backup) /
  being loaded (load-back); the HiCache controller still builds that one itself (same chain rules). SWA: backup the SWA pages of live nodes;
  load back only host-only nodes within the window before ``node``'s end. Mamba: the single state of
  ``node`` (restore into a fresh tree slot; requests then copy-on-write from it).
- ``commit_hicache_transfer(node, phase, transfers, ok)`` runs after every host acked (``ok``) or the
  transfer failed (``ok=False``: release what ``build`` reserved, change nothing else).
- ``drive_host_eviction(num_tokens, tracker)`` drops this component's own host copies (never the Full
  chain) in LRU order until ``num_tokens`` tokens' worth were freed, reporting each through ``tracker``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from hicache.cluster.tree.params import NO_VALUES  # shared empty per-component mapping

if TYPE_CHECKING:
    from hicache.cluster.tree.node import TreeNode
    from hicache.cluster.tree.params import InsertParams, MatchResult, RequestState
    from hicache.cluster.tree.radix import RadixTree

__all__ = [
    "NO_VALUES",
    "ComponentHooks",
    "ComponentTransfer",
    "HiCachePhase",
    "HostEvictionTracker",
    "TreeComponent",
]


class HiCachePhase(str, Enum):
    BACKUP = "backup"  # L1 -> L2 (device -> host)
    LOAD_BACK = "load_back"  # L2 -> L1 (host -> device)


@dataclass(frozen=True, eq=False)
class ComponentTransfer:
    """One copy a component needs for a HiCache phase; ids are plain ints (they cross to workers)."""

    component: str
    phase: HiCachePhase
    node_id: int
    src: np.ndarray  # i32[n]: device ids (BACKUP) or host ids (LOAD_BACK)
    dst: np.ndarray | None  # i32[n]: host ids (BACKUP, filled in by the host tier) or device ids
    num_tokens: int  # tokens whose state this transfer carries (host accounting)

    def __post_init__(self) -> None:
        if not isinstance(self.phase, HiCachePhase):
            raise TypeError(f"phase must be a HiCachePhase, got {self.phase!r}")
        if self.dst is not None and np.shape(self.dst) != np.shape(self.src):
            raise ValueError(f"transfer dst shape {np.shape(self.dst)} != src shape {np.shape(self.src)}")


class HostEvictionTracker(Protocol):
    """Receives the host copies a component drops during host eviction (the host tier frees them)."""

    def release(self, component: str, node_id: int, host_ids: np.ndarray, num_tokens: int) -> None: ...

    def pinned(self, node_id: int) -> bool: ...


class TreeComponent(ABC):
    """Per-node state that follows the radix structure.

    Hook order guarantees: ``validate_insert`` runs before any mutation of an insert (raise there, never
    later); ``on_split`` runs after the tree split ``suffix`` into ``prefix`` + ``suffix``; ``on_create``
    and ``on_revive`` run after the tree attached the node; ``on_remove`` runs before the node is dropped.
    """

    name: str = ""
    # Class of the component's per-node value: the tree puts a fresh one in ``node.component_data[name]``
    # of every node it creates (roots included), so hooks read it without a presence test.
    value_type: type | None = None

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

    # -- optional hooks of extra components (never called for the Full component) ----------------
    def insert_boundaries(
        self, params: InsertParams, page_start: int, page_end: int, index: np.ndarray
    ) -> Sequence[int]:
        """Page indices strictly inside (page_start, page_end) where a new leaf must be cut in nodes
        (``index``: ``params.device_pages[page_start:page_end]`` as ``intp``, for fancy indexing)."""
        return ()

    def on_insert_existing(self, params: InsertParams, nodes: Sequence[tuple[TreeNode, int, int]]) -> None:
        """An insert passed through ``nodes`` (already in L1), each ``(node, page_start, page_end)``: the
        pages of ``params`` it covers. Once per insert, for the nodes below the request's locked node only
        (its path holds the tree's own pages)."""

    def on_device_drop(self, node: TreeNode) -> None:
        """The node's L1 KV was evicted; the node stays in the tree (it has a host copy)."""

    def after_device_evict(self, parent: TreeNode) -> int:
        """A child of ``parent`` just left L1; may drop nodes that became useless. Returns tokens freed."""
        return 0

    def on_lock(self, node: TreeNode) -> None:
        """A request locked the path root..node (after the Full lock)."""

    def on_unlock(self, node: TreeNode) -> None:
        """A request unlocked the path root..node (after the Full unlock)."""

    def limit_host_match(self, device_path: list[TreeNode], host_path: list[TreeNode]) -> int:
        """How many host-only nodes after ``device_path`` this component can serve (default: all)."""
        return len(host_path)

    def match_value(self, device_path: list[TreeNode], branch_len: int) -> Any:
        """Per-component part of a MatchResult (``MatchResult.components[name]``); None for none.

        ``branch_len`` is the L1 hit length before any component limited it (where the key leaves the tree).
        """
        return None

    def validate_request(self, state: RequestState) -> None:
        """Raise ValueError/TypeError if the request's per-component value is wrong; must not mutate."""

    def begin_request(self, match: MatchResult, decode_positions: range | None = None) -> Any:
        """Per-request resources for a request continuing from ``match`` (None: the component needs none).
        ``decode_positions``: the positions its decode steps will compute at most (None: unknown)."""
        return None

    def trim_request(self, state: RequestState) -> int:
        """Releases per-request values no later step needs; returns how many were released."""
        return 0

    def on_request_cached(self, state: RequestState, end: TreeNode, finished: bool) -> Any:
        """After the tree inserted the request's whole pages (``end``: node ending there, or the root).

        ``finished``: release or hand over the request's values, return None. Otherwise return the value
        the continuing request carries on with (``RequestState.components[name]``).
        """
        return None

    def release_request(self, state: RequestState) -> None:
        """The request is abandoned (``RadixTree.abandon_request``): release its values, cache nothing."""

    evict_param: str = ""  # keyword of RadixTree.evict that drives this component's own eviction
    # HiCache: build this component's BACKUP transfers when the D2H op is sent, not when its chain is queued
    # (a value set on the chain's nodes in between, e.g. a Mamba state cached at a node end, still goes)
    backup_at_send: bool = False
    host_id_is_page: bool = True  # an L2 id holds one page of the node's tokens (False: one value per node)

    def evict_component(self, amount: int) -> int:
        """Component-own eviction (SWA tokens, Mamba states); returns what was freed in the same unit."""
        return 0

    # -- HiCache (see the module docstring) --------------------------------------------------------
    def build_hicache_transfers(self, node: TreeNode, phase: HiCachePhase) -> tuple[ComponentTransfer, ...]:
        return ()

    def commit_hicache_transfer(
        self, node: TreeNode, phase: HiCachePhase, transfers: Sequence[ComponentTransfer], ok: bool = True
    ) -> None:
        """Applies (``ok``) or rolls back the transfers ``build_hicache_transfers`` returned."""

    def drive_host_eviction(self, num_tokens: int, tracker: HostEvictionTracker) -> int:
        """Drops this component's host copies until ``num_tokens`` were freed; returns tokens freed."""
        return 0

    def take_released_host_copies(self) -> list[tuple[str, int, np.ndarray]]:
        """(component, node id, host ids) of the host copies of nodes removed since the last call."""
        return []

    def take_late_backups(self) -> list[TreeNode]:
        """Nodes whose value (with ``backup_at_send``) should be copied to L2 by the next D2H op on its own:
        set after the node's Full KV was backed up, so no backup chain carries it."""
        return []

    def host_copies(self) -> list[np.ndarray]:
        """The host ids of every host copy this component records (host tier checks)."""
        return []

    # -- L3 (the storage tier keeps this component's host copies as objects of its own pool) ----------------
    # Pages before a node end whose values a hit ending there reads (Mamba: 1, its state; SWA: the window's);
    # 0: the component keeps nothing in L3 (an L3 hit cannot serve it)
    l3_value_pages: int = 0

    def host_copy(self, node: TreeNode) -> np.ndarray | None:
        """The host ids of ``node``'s host copy (its last ``len`` pages' values, in page order), or None."""
        return None

    def adopt_host_copy(self, node: TreeNode, host_ids: np.ndarray) -> None:
        """``node`` (a host-only node just made from an L3 fetch) holds its last ``len(host_ids)`` pages' values
        in these committed host ids."""
        raise NotImplementedError(f"component {self.name!r} keeps no values in L3")

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


class ComponentHooks:
    """Per hook, the bound methods of the components that define it, in component order.

    Built once per tree. Optional hooks (``TreeComponent`` defaults: no-ops, or "all" for the limits)
    list only the components that override them, so the tree's per-request loops skip the rest; the
    structure hooks every component must define (``on_create``, ``on_split``, ``on_remove``) list all.
    The hooks whose results the tree files by component (``NAMED``) list ``(component name, method)``.
    """

    OPTIONAL = (
        "validate_insert", "on_revive", "insert_boundaries", "on_insert_existing", "on_device_drop",
        "after_device_evict", "on_lock", "on_unlock", "limit_match", "limit_host_match", "match_value",
        "validate_request", "begin_request", "trim_request", "on_request_cached",
    )
    REQUIRED = ("on_create", "on_split", "on_remove")
    NAMED = ("match_value", "begin_request", "on_request_cached")
    __slots__ = OPTIONAL + REQUIRED

    validate_insert: tuple[Callable[[InsertParams, list[tuple[int, int]]], None], ...]
    on_revive: tuple[Callable[[TreeNode, InsertParams, int, int], None], ...]
    insert_boundaries: tuple[Callable[[InsertParams, int, int, np.ndarray], Sequence[int]], ...]
    on_insert_existing: tuple[Callable[[InsertParams, Sequence[tuple[TreeNode, int, int]]], None], ...]
    on_device_drop: tuple[Callable[[TreeNode], None], ...]
    after_device_evict: tuple[Callable[[TreeNode], int], ...]
    on_lock: tuple[Callable[[TreeNode], None], ...]
    on_unlock: tuple[Callable[[TreeNode], None], ...]
    limit_match: tuple[Callable[[list[TreeNode]], int], ...]
    limit_host_match: tuple[Callable[[list[TreeNode], list[TreeNode]], int], ...]
    match_value: tuple[tuple[str, Callable[[list[TreeNode], int], Any]], ...]
    validate_request: tuple[Callable[[RequestState], None], ...]
    begin_request: tuple[tuple[str, Callable[[MatchResult, range | None], Any]], ...]
    trim_request: tuple[Callable[[RequestState], int], ...]
    on_request_cached: tuple[tuple[str, Callable[[RequestState, TreeNode, bool], Any]], ...]
    on_create: tuple[Callable[[TreeNode, InsertParams, int, int], None], ...]
    on_split: tuple[Callable[[TreeNode, TreeNode], None], ...]
    on_remove: tuple[Callable[[TreeNode], None], ...]

    def __init__(self, components: Sequence[TreeComponent]) -> None:
        for hook in self.OPTIONAL:
            default = getattr(TreeComponent, hook)
            defining = [c for c in components if getattr(type(c), hook) is not default]
            if hook in self.NAMED:
                setattr(self, hook, tuple((c.name, getattr(c, hook)) for c in defining))
            else:
                setattr(self, hook, tuple(getattr(c, hook) for c in defining))
        for hook in self.REQUIRED:
            setattr(self, hook, tuple(getattr(c, hook) for c in components))
