"""``build_kv_cache``: the one place that picks and assembles tree components and pools from a config.

SGLang's kv_cache_builder idea. Runs on the head (the head builds its replica's cache from its config);
scheduler-side code only ever calls the prefix-cache API (``match_prefix``, ``inc_lock_ref``,
``begin_request``, ``alloc``, ``trim_request``, ``cache_finished_req`` / ``cache_unfinished_req``,
``evict``...) and never branches on which components exist:

- ``("full",)``: full-attention KV only (``RadixTree`` with no extra components).
- ``("full", "swa")``: plus a sliding-window KV pool (``SWAComponent``; window, SWA pool tokens).
- ``("full", "mamba")``: plus a recurrent-state pool (``MambaComponent``; slots, per-layer state shapes).
- ``("full", "swa", "mamba")``: both.
- ``reuse=False``: chunk cache, no prefix reuse (``ChunkCache``): same API, nothing is ever cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

import numpy as np

from hicache.cluster.tree import (
    EvictResult,
    FinishResult,
    InsertParams,
    InsertResult,
    MatchResult,
    RadixKey,
    RadixTree,
    RequestState,
    TreeComponent,
    TreeConfig,
)
from hicache.cluster.tree.mamba import MambaComponent, check_state_layout
from hicache.cluster.tree.swa import SWAComponent


class ComponentKind(str, Enum):
    FULL = "full"
    SWA = "swa"
    MAMBA = "mamba"


def parse_components(spec: str | Sequence[str | ComponentKind]) -> tuple[ComponentKind, ...]:
    """``"swa"``, ``"full,mamba"`` or a sequence of names -> kinds, Full first, no duplicates."""
    if isinstance(spec, str):
        names = [s.strip() for s in spec.split(",") if s.strip()]
    elif isinstance(spec, (list, tuple)):
        names = list(spec)
    else:
        raise TypeError(f"components must be a str or a sequence of names, got {type(spec).__name__}")
    kinds = []
    for name in names:
        try:
            kinds.append(ComponentKind(name))
        except ValueError:
            choices = ", ".join(k.value for k in ComponentKind)
            raise ValueError(f"unknown cache component {name!r}; choose from {choices}") from None
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"duplicate cache components in {names!r}")
    rest = [k for k in kinds if k is not ComponentKind.FULL]
    order = [ComponentKind.SWA, ComponentKind.MAMBA]
    return (ComponentKind.FULL, *sorted(rest, key=order.index))


@dataclass(frozen=True)
class SWAConfig:
    """The sliding-window component: the window a hit needs and the SWA pool's size."""

    kind: ClassVar[ComponentKind] = ComponentKind.SWA
    window: int  # tokens of the sliding window
    num_tokens: int | None = None  # SWA pool size in tokens; None = unbounded
    # SWA pages' L2 (with a host tier) in tokens; None = as many as the Full L2 (``HiCacheConfig.host_slots``)
    host_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.host_tokens is not None and (
            not isinstance(self.host_tokens, int) or isinstance(self.host_tokens, bool) or self.host_tokens <= 0
        ):
            raise ValueError(f"swa host_tokens must be a positive int or None, got {self.host_tokens!r}")
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window <= 0:
            raise ValueError(f"sliding window must be a positive int, got {self.window!r}")
        if self.num_tokens is not None and (
            not isinstance(self.num_tokens, int) or isinstance(self.num_tokens, bool) or self.num_tokens <= 0
        ):
            raise ValueError(f"swa num_tokens must be a positive int or None, got {self.num_tokens!r}")


@dataclass(frozen=True)
class MambaConfig:
    """The recurrent-state component: one state slot per cached node end (and per running request)."""

    kind: ClassVar[ComponentKind] = ComponentKind.MAMBA
    num_slots: int | None = None  # state slots; None = unbounded
    state_shapes: tuple[tuple[int, ...], ...] = ((1,),)  # one entry per Mamba layer (conv, ssm, ...)
    dtype: str = "float32"
    # states' L2 (with a host tier) in slots, one state each; None = as many as the Full L2's pages
    # (``HiCacheConfig.host_slots``: a node holds at least one page, so at most that many node ends)
    host_slots: int | None = None

    def __post_init__(self) -> None:
        check_state_layout(self.num_slots, self.state_shapes, self.dtype)  # ValueError naming the value
        if self.host_slots is not None and (
            not isinstance(self.host_slots, int) or isinstance(self.host_slots, bool) or self.host_slots <= 0
        ):
            raise ValueError(f"mamba host_slots must be a positive int or None, got {self.host_slots!r}")

    @property
    def bytes_per_slot(self) -> int:
        return check_state_layout(self.num_slots, self.state_shapes, self.dtype)[1]


ComponentConfig = SWAConfig | MambaConfig  # one frozen dataclass per extra component, ``kind`` names it


@dataclass(frozen=True)
class KVCacheConfig:
    tree: TreeConfig = field(default_factory=TreeConfig)
    components: tuple[ComponentKind, ...] | str = (ComponentKind.FULL,)
    swa: SWAConfig | None = None
    mamba: MambaConfig | None = None
    reuse: bool = True  # False: chunk cache (no prefix reuse)

    def __post_init__(self) -> None:
        if not isinstance(self.tree, TreeConfig):
            raise TypeError(f"tree must be a TreeConfig, got {type(self.tree).__name__}")
        kinds = parse_components(self.components)
        object.__setattr__(self, "components", kinds)
        if ComponentKind.SWA in kinds and not isinstance(self.swa, SWAConfig):
            raise ValueError(f"components {[k.value for k in kinds]} include swa but swa config is {self.swa!r}")
        if ComponentKind.MAMBA in kinds and not isinstance(self.mamba, MambaConfig):
            raise ValueError(
                f"components {[k.value for k in kinds]} include mamba but mamba config is {self.mamba!r}"
            )
        if not self.reuse and kinds != (ComponentKind.FULL,):
            raise ValueError("a chunk cache (reuse=False) holds no hybrid components; use components=('full',)")


def components_of(configs: Sequence[ComponentConfig]) -> dict[ComponentKind, ComponentConfig]:
    """Checks a sequence of component configs (one per kind, no Full: it is always there) -> by kind."""
    if not isinstance(configs, (list, tuple)):
        raise ValueError(f"components must be a sequence of SWAConfig / MambaConfig, got {configs!r}")
    out: dict[ComponentKind, ComponentConfig] = {}
    for c in configs:
        if not isinstance(c, (SWAConfig, MambaConfig)):
            raise ValueError(f"a component config must be a SWAConfig or a MambaConfig, got {c!r}")
        if c.kind in out:
            raise ValueError(f"component {c.kind.value!r} configured twice: {out[c.kind]!r} and {c!r}")
        out[c.kind] = c
    return out


def cache_config(tree: TreeConfig, configs: Sequence[ComponentConfig] = ()) -> KVCacheConfig:
    """The ``KVCacheConfig`` of a tree plus component configs (``HeadConfig.components``)."""
    by_kind = components_of(configs)
    swa, mamba = by_kind.get(ComponentKind.SWA), by_kind.get(ComponentKind.MAMBA)
    assert swa is None or isinstance(swa, SWAConfig)
    assert mamba is None or isinstance(mamba, MambaConfig)
    return KVCacheConfig(tree, (ComponentKind.FULL, *by_kind), swa, mamba)


def build_components(config: KVCacheConfig) -> list[TreeComponent]:
    """Fresh extra components (everything but Full) for one tree, validated before any is built."""
    out: list[TreeComponent] = []
    for kind in config.components:
        if kind is ComponentKind.SWA:
            swa = config.swa
            assert swa is not None  # KVCacheConfig refuses the swa component without its config
            out.append(SWAComponent(swa.window, swa.num_tokens))
        elif kind is ComponentKind.MAMBA:
            m = config.mamba
            assert m is not None  # likewise for mamba
            out.append(MambaComponent(m.num_slots, m.state_shapes, m.dtype))
    return out


def build_kv_cache(config: KVCacheConfig) -> RadixTree:
    """The replica's prefix cache for ``config``: a ``RadixTree`` with the right components, or a chunk cache."""
    if not isinstance(config, KVCacheConfig):
        raise TypeError(f"build_kv_cache expects a KVCacheConfig, got {type(config).__name__}")
    if not config.reuse:
        return ChunkCache(config.tree)
    return RadixTree(config.tree, build_components(config))


class ChunkCache(RadixTree):
    """No prefix reuse (SGLang's ChunkCache): matches are always empty, finished requests free their pages.

    Keeps the allocator, locks-as-no-ops and the request flows so scheduler code is the same.
    """

    def match_prefix(self, key: RadixKey, use_host: bool = True) -> MatchResult:
        if not isinstance(key, RadixKey):
            raise TypeError(f"match_prefix expects a RadixKey, got {type(key).__name__}")
        root = self._root_for(key.namespace)
        self._match_calls += 1
        self._queried_tokens += len(key) - len(key) % self.page_size
        return MatchResult(np.empty(0, np.int32), 0, 0, root.id, root.id, root.id)

    def insert(self, params: InsertParams) -> InsertResult:
        """Nothing is cached; the caller keeps its pages."""
        if not isinstance(params, InsertParams):
            raise TypeError(f"insert expects InsertParams, got {type(params).__name__}")
        return InsertResult(0)

    def cache_finished_req(self, state: RequestState) -> FinishResult:
        _, pages, k, _, _ = self._check_request(state)
        own = pages[k:]
        self.full.allocator.release(own)
        return FinishResult(state.prefix_len, int(own.shape[0]))

    def cache_unfinished_req(self, state: RequestState) -> RequestState:
        self._check_request(state)
        return state

    def evict(self, num_tokens: int = 0, **component_amounts: int) -> EvictResult:
        if not isinstance(num_tokens, (int, np.integer)) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        if component_amounts:
            raise ValueError(f"a chunk cache has no component eviction, got {sorted(component_amounts)}")
        return EvictResult(0)
