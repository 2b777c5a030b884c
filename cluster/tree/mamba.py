"""Mamba (recurrent state) component: one state slot per node, copy-on-write for requests.

Runs on the head, inside the replica's radix tree (DESIGN.md §1); workers and the model only see slot ids.

- Pool: ``num_slots`` state slots (None = unbounded) in a ``PageAllocator``: a slot is FREE, REQUEST (a
  running request's working state) or TREE (a node's cached state). One slot holds every Mamba layer's
  state of one sequence position (``state_shapes`` per layer, for sizing and checks only).
- Node value: the state after the node's last token, or none. A split gives the prefix no state (the
  state at the split point was never materialised). A match is truncated to the deepest L1 node with a
  state; ``MatchResult.components["mamba"]`` is ``MambaMatch(state_slot, branching_seqlen)``:
  ``state_slot`` is the state of exactly ``device_hit_len`` tokens (-1: start from the zero state) and
  ``branching_seqlen`` is where the key leaves the tree, L1 or L2 (>= device_hit_len). A scheduler that
  ends a prefill chunk there (``cache_unfinished_req``) gives that branch point a state.
- Copy-on-write: cached states are immutable. ``RadixTree.begin_request(match)`` (after locking the
  match's node) gives the request a fresh working slot and the copy ``(cached, working)``; only request
  slots are ever written, so two requests branching from one cached state never share a slot.
- Caching a request: when its key is page-aligned and the node ending there has no state, the tree
  takes the request's slot (finished) or takes it and hands the request a fresh slot plus the copy
  ``(taken, fresh)`` (unfinished, only when a slot can be had; otherwise the node stays stateless).
  Otherwise a finished request's slot is freed. ``MambaRequest.copies`` must run before its next forward.
- Track slot (SGLang's Mamba "extra buffer"): ``begin_request`` also gives the request a second REQUEST
  slot when the pool has a free one (no cached state is evicted for it; else -1: the request caches as
  without it) and its ``decode_positions`` (None: unknown) hold a page end (else the decode never writes it). Only the engine's decode writes it: the working state whenever that is at a page end
  (``ModelRunner.decode(track_slot=)``); the caller says at finish how many tokens it holds
  (``MambaRequest.track_len``). A finished request whose key is not page-aligned gives the node ending at
  the key's last whole page the track slot when it holds the state of exactly that many tokens and the
  node has no state. Every slot the tree does not take is freed with the request (finish, abandon). An
  unfinished request whose working slot the tree takes when the pool has no other slot continues in its
  track slot (and has none from then on).
- Locks: a request lock holds the state of its node only (the source of its copy), not the whole path.
- Eviction: ``evict(mamba_num=n)`` frees n unlocked states in LRU order (nodes keep their full KV); a
  request slot allocation evicts when the pool is full. Full eviction frees the node's state too.

HiCache (see ``component.py``): BACKUP copies a node's state slot to one host id, built when the D2H op is
sent (``backup_at_send``: a state adopted after the chain was queued still goes, and a queued chain pins
no state); a state whose copy was sent stays in L1 until the ack or failure (the op reads the slot). LOAD_BACK restores the single state of
the loaded node into a fresh slot (reserved by ``build``, the node's on commit), from which requests
copy-on-write as after any match; host eviction drops host states in LRU order. A match with an L2 part
ends at the deepest host-only node whose state is in L2 (``limit_host_match``); its Mamba value is only
valid for its L1 part when it has none: a request starts after the load with a match of L1 only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.cluster.tree.allocator import CacheCapacityError, PageAllocator, PageOwner
from hicache.cluster.tree.component import ComponentTransfer, HiCachePhase, HostEvictionTracker, TreeComponent
from hicache.cluster.tree.eviction import ComponentQueue, QueuedValue
from hicache.cluster.tree.node import TreeNode
from hicache.cluster.tree.params import InsertParams, MatchResult, RequestState
from hicache.cluster.tree.swa import check_positive_int

if TYPE_CHECKING:
    from hicache.cluster.tree.radix import RadixTree


@dataclass(frozen=True)
class MambaMatch:
    state_slot: int  # state after exactly device_hit_len tokens; -1 = zero state (nothing matched)
    branching_seqlen: int  # tokens of the key the tree holds (full KV in L1 or L2), before state truncation


@dataclass(frozen=True)
class MambaRequest:
    """A running request's Mamba value (``RequestState.components["mamba"]``)."""

    slot: int  # the request's own working state slot (only the request writes it)
    copies: tuple[tuple[int, int], ...] = ()  # (src slot, dst slot) to copy before the next forward
    branching_seqlen: int = 0
    track: int = -1  # the request's track slot (only its decode writes it), -1: none
    track_len: int = 0  # tokens whose state ``track`` holds (a page multiple; 0: none), set before the finish


@dataclass(frozen=True)
class MambaStats:
    capacity_slots: int
    free_slots: int
    tree_slots: int
    request_slots: int  # running requests' working and track slots, and slots reserved for loads
    bytes_per_slot: int
    evicted_states: int


class _MambaNode(QueuedValue):
    __slots__ = ("slot", "lock", "host_slot", "backing_up")

    def __init__(self) -> None:
        self.version = 0  # ``QueuedValue`` fields, set here (no super call per node)
        self.queued = False
        self.slot = -1  # device state slot (TREE) or -1
        self.lock = 0  # requests that copy from this node's state
        self.host_slot = -1  # host copy of the state or -1
        self.backing_up = False  # a D2H op reads ``slot``: not evictable until it is acked or failed


def check_state_layout(num_slots: Any, state_shapes: Any, dtype: Any) -> tuple[str, int]:
    """Validates a state pool's layout (ValueError naming the value); returns (dtype name, bytes per slot)."""
    check_positive_int("mamba num_slots", num_slots, allow_none=True)
    if not isinstance(state_shapes, tuple) or not state_shapes:
        raise ValueError(f"state_shapes must be a non-empty tuple of shapes, got {state_shapes!r}")
    for shape in state_shapes:
        if not isinstance(shape, tuple) or not shape or any(
            not isinstance(d, int) or isinstance(d, bool) or d <= 0 for d in shape
        ):
            raise ValueError(f"each state shape must be a tuple of positive ints, got {shape!r}")
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:
        raise ValueError(f"unknown state dtype {dtype!r}") from None
    return str(np.dtype(dtype)), int(sum(np.prod(s) for s in state_shapes)) * itemsize


def _as_slot(value: Any, what: str) -> int:
    if isinstance(value, np.ndarray):
        if value.shape != ():
            raise ValueError(f"{what} must be a single slot id, got an array of shape {value.shape}")
        value = value.item()
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int slot id, got {value!r}")
    return int(value)


class MambaComponent(TreeComponent):
    name = "mamba"
    evict_param = "mamba_num"
    value_type = _MambaNode
    backup_at_send = True
    host_id_is_page = False

    def __init__(
        self,
        num_slots: int | None = None,
        state_shapes: tuple[tuple[int, ...], ...] = ((1,),),
        dtype: str = "float32",
    ) -> None:
        self.dtype, self.bytes_per_slot = check_state_layout(num_slots, state_shapes, dtype)
        self.state_shapes = state_shapes
        self.allocator = PageAllocator(None if num_slots is None else int(num_slots))
        self.queue = ComponentQueue(self.name, self.is_evictable)
        self.evicted_states = 0
        self.released_host_copies: list[tuple[str, int, np.ndarray]] = []
        # States cached at node ends whose Full KV already has (or is getting) an L2 copy: no backup chain
        # will carry them, so the next D2H op does (``take_late_backups``)
        self.late_states: dict[int, TreeNode] = {}

    def attach(self, tree: RadixTree) -> None:
        super().attach(tree)
        self.queue.tree = tree
        self.page_size = tree.page_size

    # -- node values ---------------------------------------------------------------------------------
    @staticmethod
    def _state(node: TreeNode) -> _MambaNode:
        return node.component_data["mamba"]

    @staticmethod
    def state_slot(node: TreeNode) -> int:
        """The node's cached device state slot, or -1."""
        return node.component_data["mamba"].slot

    def is_evictable(self, node: TreeNode) -> bool:
        st = node.component_data["mamba"]
        return node.parent is not None and st.slot >= 0 and st.lock == 0 and not st.backing_up

    def _free_state(self, node: TreeNode, st: _MambaNode) -> None:
        self.allocator.release_one(st.slot)
        st.slot = -1

    def _alloc_slot(self, required: bool = True) -> int:
        """A REQUEST slot, evicting one unlocked state if the pool is full; -1 / raise if impossible."""
        alloc = self.allocator
        if alloc.bounded and alloc.num_free == 0:
            self.evict_component(1)
            if alloc.num_free == 0:
                if not required:
                    return -1
                raise CacheCapacityError(f"Mamba pool: all {alloc.capacity} state slots are in use or locked")
        return alloc.alloc_one()

    def free_slot(self, slot: int) -> None:
        """Returns a request slot the tree did not take (e.g. after a bare ``insert``)."""
        slot = _as_slot(slot, "slot")
        self.allocator.check_one(slot, PageOwner.REQUEST, "slot")
        self.allocator.release_one(slot)

    # -- structure hooks -------------------------------------------------------------------------------
    def on_create(self, node: TreeNode, params: InsertParams, page_start: int, page_end: int) -> None:
        """A new node has no state (the tree made its empty value)."""

    def on_split(self, prefix: TreeNode, suffix: TreeNode) -> None:
        """The prefix (a new node) has no state and no lock: the state at the split point was never
        materialised."""

    def on_device_drop(self, node: TreeNode) -> None:
        st = node.component_data["mamba"]
        if st.slot >= 0:
            self._free_state(node, st)

    def on_remove(self, node: TreeNode) -> None:
        self.late_states.pop(node.id, None)
        st = node.component_data["mamba"]
        if st.slot >= 0:
            self._free_state(node, st)
        if st.host_slot >= 0:
            self.released_host_copies.append((self.name, node.id, np.array([st.host_slot], dtype=np.int32)))
            st.host_slot = -1

    def take_released_host_copies(self) -> list[tuple[str, int, np.ndarray]]:
        out, self.released_host_copies = self.released_host_copies, []
        return out

    # -- locks -----------------------------------------------------------------------------------------
    def on_lock(self, node: TreeNode) -> None:
        node.component_data["mamba"].lock += 1

    def on_unlock(self, node: TreeNode) -> None:
        st = node.component_data["mamba"]
        st.lock -= 1
        if st.lock == 0 and st.slot >= 0:
            self.queue.push(node)

    # -- match -----------------------------------------------------------------------------------------
    def limit_match(self, path: list[TreeNode]) -> int:
        for i in range(len(path) - 1, -1, -1):
            if path[i].component_data["mamba"].slot >= 0:
                return i + 1
        return 0

    def limit_host_match(self, device_path: list[TreeNode], host_path: list[TreeNode]) -> int:
        for j in range(len(host_path) - 1, -1, -1):
            if host_path[j].component_data["mamba"].host_slot >= 0:
                return j + 1
        return 0

    def match_value(self, device_path: list[TreeNode], branch_len: int) -> MambaMatch:
        return MambaMatch(device_path[-1].component_data["mamba"].slot if device_path else -1, branch_len)

    # -- requests --------------------------------------------------------------------------------------
    def begin_request(self, match: MatchResult, decode_positions: range | None = None) -> MambaRequest:
        mm = match.components.get(self.name)
        if not isinstance(mm, MambaMatch):
            raise ValueError("the MatchResult has no Mamba part: it does not come from this tree's match_prefix")
        if match.host_hit_len:
            raise ValueError(f"the match has an L2 part ({match.host_hit_len} tokens): load it back, then start the "
                             "request from a match of L1 only")
        src = mm.state_slot
        if src >= 0:
            node = self.tree.node(match.last_device_node)
            st = node.component_data["mamba"]
            if st.slot != src:
                raise ValueError(f"node {node.id} no longer holds state slot {src}: match again")
            if st.lock <= 0:
                raise ValueError(f"lock node {node.id} (inc_lock_ref) before begin_request: its state is the copy source")
        slot = self._alloc_slot()
        alloc = self.allocator
        # A free slot only: evicting cached states for tracks cost more hits than they gave in small pools;
        # and none for a decode that crosses no page end (it would never write it).
        ps = self.page_size
        crosses = decode_positions is None or -(-decode_positions.start // ps) * ps < decode_positions.stop
        track = alloc.alloc_one() if crosses and (not alloc.bounded or alloc.num_free) else -1
        return MambaRequest(slot, ((src, slot),) if src >= 0 else (), mm.branching_seqlen, track)

    def validate_request(self, state: RequestState) -> None:
        value = state.components.get(self.name)
        if value is None:
            raise ValueError("RequestState.components lacks 'mamba': pass tree.begin_request(match)")
        if not isinstance(value, MambaRequest):
            raise TypeError(f"RequestState.components['mamba'] must be a MambaRequest, got {type(value).__name__}")
        slot = _as_slot(value.slot, "MambaRequest.slot")
        self.allocator.check_one(slot, PageOwner.REQUEST, "request state slot")
        track, track_len = _as_slot(value.track, "MambaRequest.track"), value.track_len
        if track >= 0:
            if track == slot:
                raise ValueError(f"MambaRequest.track {track} is the request's working slot")
            self.allocator.check_one(track, PageOwner.REQUEST, "request track slot")
        if (not isinstance(track_len, (int, np.integer)) or isinstance(track_len, bool) or track_len < 0
                or track_len % self.page_size or track_len > len(state.key) or (track_len and track < 0)):
            raise ValueError(f"MambaRequest.track_len must be a page multiple in [0, {len(state.key)}] (the key's "
                             f"length) and 0 without a track slot, got {track_len!r} (track {track})")

    def on_request_cached(self, state: RequestState, end: TreeNode, finished: bool) -> MambaRequest | None:
        value: MambaRequest = state.components[self.name]
        slot, track = int(value.slot), int(value.track)
        st = end.component_data["mamba"] if end.parent is not None else None
        # The end node's state a slot of the request can become (None: it keeps no state from this request).
        open_end = st if st is not None and st.slot < 0 and end.device_pages is not None else None
        aligned = len(state.key) % self.page_size == 0
        if finished:
            # ``end`` ends at the key's last whole page: the working slot holds its state when the key is
            # page-aligned, the track slot when the decode last copied the working state there.
            whole = len(state.key) - len(state.key) % self.page_size
            taken = slot if aligned else track if track >= 0 and value.track_len == whole else -1
            if open_end is None:
                taken = -1
            elif taken >= 0:
                self._adopt(end, open_end, taken)
            for own in (slot, track):
                if own >= 0 and own != taken:
                    self.allocator.release_one(own)
            return None
        if open_end is not None and aligned:
            fresh = self._alloc_slot(required=False)
            if fresh < 0 and track >= 0:  # a state cached now beats one the decode may leave: the track goes
                fresh, value = track, replace(value, track=-1, track_len=0)
            if fresh >= 0:
                self._adopt(end, open_end, slot)
                return replace(value, slot=fresh, copies=((slot, fresh),))
        return replace(value, copies=())

    def release_request(self, state: RequestState) -> None:
        value = state.components[self.name]  # (validated: REQUEST slots)
        self.allocator.release_one(int(value.slot))
        if value.track >= 0:
            self.allocator.release_one(int(value.track))

    def _adopt(self, node: TreeNode, st: _MambaNode, slot: int) -> None:
        self.allocator.transfer_one(slot, PageOwner.TREE)
        st.slot = slot
        if st.lock == 0:
            self.queue.push(node)
        if st.host_slot < 0 and (node.host_slots is not None or node.staged_slots is not None):
            self.late_states[node.id] = node

    def take_late_backups(self) -> list[TreeNode]:
        """Nodes whose L1 state should go to L2 on its own now: their Full KV is in L2 (committed), the state
        is not. Nodes whose Full copy is still in flight wait for a later call."""
        out, keep = [], {}
        for node_id, node in self.late_states.items():
            st = self._state(node)
            if st.slot < 0 or st.host_slot >= 0 or st.backing_up or node.host_slots is None and node.staged_slots is None:
                continue  # (evicted, copied meanwhile, or its Full copy is gone)
            if node.staged_slots is not None:
                keep[node_id] = node
            else:
                out.append(node)
        self.late_states = keep
        return out

    # -- eviction --------------------------------------------------------------------------------------
    def evict_component(self, amount: int) -> int:
        freed, rebuilt = 0, False
        while freed < amount:
            node = self.queue.pop()
            if node is None:
                if rebuilt:
                    break
                self.queue.rebuild(self.tree)
                rebuilt = True
                continue
            self._free_state(node, self._state(node))
            freed += 1
        self.evicted_states += freed
        self.queue.maybe_compact(self.tree)
        return freed

    # -- HiCache ---------------------------------------------------------------------------------------
    def build_hicache_transfers(self, node: TreeNode, phase: HiCachePhase) -> tuple[ComponentTransfer, ...]:
        if not isinstance(phase, HiCachePhase):
            raise TypeError(f"phase must be a HiCachePhase, got {phase!r}")
        if node.parent is None:
            return ()
        st = self._state(node)
        one = np.array([0], dtype=np.int32)
        if phase is HiCachePhase.BACKUP:
            if st.slot < 0 or st.host_slot >= 0 or st.backing_up:
                return ()
            st.backing_up = True  # until ``commit_hicache_transfer`` (acked, failed or not sent)
            return (ComponentTransfer(self.name, phase, node.id, one + st.slot, None, node.num_tokens),)
        if st.host_slot < 0 or st.slot >= 0:
            return ()
        dst = self._alloc_slot(required=False)  # reserved (REQUEST) until commit
        if dst < 0:
            return ()
        return (ComponentTransfer(self.name, phase, node.id, one + st.host_slot, one + dst, node.num_tokens),)

    def commit_hicache_transfer(
        self, node: TreeNode, phase: HiCachePhase, transfers: Sequence[ComponentTransfer], ok: bool = True
    ) -> None:
        for t in transfers:
            if t.component != self.name or t.phase is not phase:
                raise ValueError(f"transfer for {t.component}/{t.phase.value} given to mamba/{phase.value}")
            if np.shape(t.src) != (1,) or (t.dst is not None and np.shape(t.dst) != (1,)):
                raise ValueError(
                    f"mamba transfer moves one state slot; got src shape {np.shape(t.src)}, "
                    f"dst shape {None if t.dst is None else np.shape(t.dst)}"
                )
            if ok and t.dst is None:
                raise ValueError(f"mamba transfer for node {t.node_id} has no destination slot")
        for t in transfers:
            n = self.tree.node(t.node_id)
            st = self._state(n)
            dst = t.dst
            if phase is HiCachePhase.BACKUP and st.backing_up:
                st.backing_up = False
                if st.slot >= 0 and st.lock == 0:
                    self.queue.push(n)  # (an eviction pass may have dropped its entry meanwhile)
            if dst is None:  # a failed backup the host tier gave no slot: nothing to record or free
                continue
            if phase is HiCachePhase.BACKUP:
                if ok:
                    st.host_slot = int(dst[0])
            elif ok and n.device_pages is not None and st.slot < 0:
                self._adopt(n, st, int(dst[0]))
            else:
                self.allocator.free(np.asarray(dst, dtype=np.int32), PageOwner.REQUEST)

    def drive_host_eviction(self, num_tokens: int, tracker: HostEvictionTracker) -> int:
        if not isinstance(num_tokens, (int, np.integer)) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        victims = []
        for node in self.tree.iter_nodes():
            data = node.component_data
            st = data.get("mamba") if data else None
            if st is not None and st.host_slot >= 0 and not tracker.pinned(node.id):
                victims.append((node.last_access, node.id, node, st))
        victims.sort(key=lambda v: (v[0], v[1]))
        freed = 0
        for _, _, node, st in victims:
            if freed >= num_tokens:
                break
            tracker.release(self.name, node.id, np.array([st.host_slot], dtype=np.int32), node.num_tokens)
            st.host_slot = -1
            freed += node.num_tokens
        return freed

    l3_value_pages = 1  # a hit at a node end reads the state stored under that end's last page

    def host_copy(self, node: TreeNode) -> np.ndarray | None:
        slot = self._state(node).host_slot
        return None if slot < 0 else np.array([slot], dtype=np.int32)

    def adopt_host_copy(self, node: TreeNode, host_ids: np.ndarray) -> None:
        st = self._state(node)
        if np.shape(host_ids) != (1,) or st.host_slot >= 0 or node.parent is None:
            raise ValueError(f"node {node.id}: a Mamba host copy is one state of a node without one, got {host_ids!r}")
        st.host_slot = int(host_ids[0])

    def host_copies(self) -> list[np.ndarray]:
        """The host id of every state in L2 (host tier checks)."""
        return [np.array([st.host_slot], dtype=np.int32) for node in self.tree.iter_nodes()
                if (st := self._state(node)).host_slot >= 0]

    # -- checks and reporting ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        alloc = self.allocator
        slots = []
        for node in self.tree.iter_nodes():
            st = self._state(node)
            assert 0 <= st.lock <= node.lock_ref, f"{node}: Mamba lock {st.lock} outside the Full lock"
            if st.slot >= 0:
                assert node.device_pages is not None, f"{node}: device state without L1 KV"
                slots.append(st.slot)
        arr = np.asarray(slots, dtype=np.int32)
        assert np.unique(arr).size == arr.size, "a state slot is cached by two nodes"
        assert arr.size == alloc.count(PageOwner.TREE), "tree state slots disagree with the pool"
        assert (alloc.owners(arr) == PageOwner.TREE).all()
        assert alloc.num_free == alloc.count(PageOwner.FREE)

    def stats(self) -> dict[str, Any]:
        a = self.allocator
        return {
            "mamba": MambaStats(
                a.capacity, a.num_free, a.count(PageOwner.TREE), a.count(PageOwner.REQUEST),
                self.bytes_per_slot, self.evicted_states,
            )
        }

    def reset(self) -> None:
        self.allocator.reset()
        self.queue.clear()
        self.evicted_states = 0
        self.released_host_copies = []
        self.late_states = {}
