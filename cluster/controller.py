"""HiCache controller: the L1<->L2 policy of one replica, running inside the head.

It decides backups (write policies), load-backs and host eviction, turns them into ``TransferOp`` s, sends
them to every host of the replica in ``seq`` order, and applies a node's state change only when every
host acked (DESIGN.md §1). A failed transfer rolls the nodes back and frees what was reserved.

Node states (Full KV): device-only -> device + staged (backup in flight, path locked) -> device+host ->
host-only (L1 evicted) -> removed (L2 evicted); load-back: host-only -> loading (L1 pages attached,
locked, host copy pinned) -> device+host. When a backup is acked, its chain's leaf absorbs its parent if
both are device+host and nothing tells them apart (``RadixTree.merge_backed_up``): a write-through
conversation stays one node. Runs on the head's single thread; workers never decide.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from hicache.cluster.events import (
    EVENT_CODES,
    EVENT_ID_SHIFT,
    EVENT_TOKENS_SHIFT,
    CacheCounters,
    EventKind,
    KVEvent,
    MissReason,
    Tier,
    unpack_event,
)
from hicache.cluster.host_tier import HostTier
from hicache.cluster.policy import HiCacheConfig, WritePolicy
from hicache.cluster.storage_tier import L3_UNAVAILABLE, PrefetchParams, PrefetchProgress, StorageParams, StorageTier
from hicache.cluster.transfers import PendingTransfer, WorkerGroup
from hicache.cluster.tree import CacheCapacityError, MatchResult, PageOwner, RadixKey, RadixTree, TreeNode
from hicache.cluster.tree.allocator import concat
from hicache.workers.plan import OpKind, TransferAck, TransferOp, TransferPlan

_MAX_EVENTS = 100_000
_MAX_GHOSTS = 65_536
# check_events sends held backups anyway once they waited this many calls or this long (bounded hold).
_BACKUP_HOLD_CALLS = 4
_BACKUP_HOLD_S = 0.05
# Event codes by the tier's name (what the tree's listener calls pass); events are packed ints (events.py).
_STORED_CODE = {t.value: EVENT_CODES[EventKind.STORED, t] for t in Tier}
_REMOVED_CODE = {t.value: EVENT_CODES[EventKind.REMOVED, t] for t in Tier}
_LOADED_CODE = EVENT_CODES[EventKind.STORED, Tier.DEVICE]
_ID, _TOKENS = EVENT_ID_SHIFT, EVENT_TOKENS_SHIFT
_DEVICE = Tier.DEVICE.value
_D2H, _H2D = OpKind.BACKUP_D2H, OpKind.LOAD_H2D
_NOT_CACHED = MissReason.NOT_CACHED
_TREE = int(PageOwner.TREE)
_NO_PAGES = np.empty(0, np.int32)
_NO_PAGES.setflags(write=False)
_T = TypeVar("_T")


# LoadBackParams and LoadBackResult (one of each per load-back) write their fields into the instance dict in
# one call: the generated __init__ of a frozen dataclass stores each field through object.__setattr__ (about
# three times the cost; RadixKey hand-writes its __init__ for the same reason). Still frozen after __init__.


@dataclass(frozen=True, init=False)
class LoadBackParams:
    """``lock=True``: the result's ``last_node`` comes locked for the caller, exactly as after
    ``inc_lock_ref(last_node)`` (also when nothing is loaded), and a started load holds that same lock
    until its ack instead of taking and releasing its own (one lock walk per load-back instead of three).
    The caller then must not lock ``last_node`` again; it releases it as any lock (``dec_lock_ref``, or
    ``cache_finished_req`` with it as the request's ``last_node``), also after a failed load."""

    node_id: int  # MatchResult.best_match_node
    host_hit_len: int  # MatchResult.host_hit_len (checked against the tree)
    mem_quota: int | None = None  # max L1 tokens this load may take; None = no limit
    lock: bool = False

    def __init__(self, node_id: int, host_hit_len: int, mem_quota: int | None = None, lock: bool = False) -> None:
        self.__dict__.update(node_id=node_id, host_hit_len=host_hit_len, mem_quota=mem_quota, lock=lock)


@dataclass(frozen=True, eq=False, init=False)
class LoadBackResult:
    """Pages of the whole cached prefix after the load; the caller locks ``last_node`` as after a match.

    ``load_id`` is -1 when nothing was loaded (then ``miss_reason`` says why, if there was a host hit).
    The loaded pages may be read only after ``wait_load_back(load_id)`` returned True.
    """

    device_pages: np.ndarray  # i32[device_hit_len // page_size]
    device_hit_len: int
    last_node: int
    loaded_tokens: int
    load_id: int
    miss_reason: MissReason | None = None

    def __init__(self, device_pages: np.ndarray, device_hit_len: int, last_node: int, loaded_tokens: int,
                 load_id: int, miss_reason: MissReason | None = None) -> None:
        self.__dict__.update(device_pages=device_pages, device_hit_len=device_hit_len, last_node=last_node,
                             loaded_tokens=loaded_tokens, load_id=load_id, miss_reason=miss_reason)


class _CopyBatch(PendingTransfer):
    """The D->H backups or the H->D loads queued since the last send: ``submit`` sends them as ONE
    TransferOp (one dispatch, one ack per host for the whole batch), then a new batch opens.

    Per copy, list entries only (nothing is built per copy): its chain (root to leaf; each node's
    ``pending`` is this batch), its id arrays (the head's own int32 ids, pairs in chain order, never
    written in place), and for loads the load id and ``caller_lock`` (the load holds its caller's path
    lock, ``LoadBackParams.lock``, released by the caller, not by the ack). ``op`` is the merged op once
    sent, None before."""

    __slots__ = ("kind", "chains", "pages", "slots", "num_pages", "load_ids", "caller_locks")

    def __init__(self, kind: OpKind, num_hosts: int) -> None:
        super().__init__(None, -1, [], num_hosts)
        self.kind = kind
        self.chains: list[list[TreeNode]] = []
        self.pages: list[np.ndarray] = []
        self.slots: list[np.ndarray] = []
        self.num_pages = 0
        self.load_ids: list[int] = []
        self.caller_locks: list[bool] = []

    @property
    def num_transfers(self) -> int:  # type: ignore[override]
        return len(self.chains)

    def add(self, chain: list[TreeNode], pages: np.ndarray, slots: np.ndarray) -> int:
        """Queues the copy of ``chain`` (``pages[i] <-> slots[i]``); returns the pages now queued."""
        self.chains.append(chain)
        self.pages.append(pages)
        self.slots.append(slots)
        for n in chain:
            n.pending = self
        self.num_pages += len(pages)  # (len: no shape tuple per call)
        return self.num_pages

    def merged_op(self, op_id: int) -> TransferOp:
        """The batch as one op (its copies' id pairs concatenated, in queue order). The ids are the head's
        own (allocators, nodes; never written in place): the op takes them as they are (``copy_op``)."""
        pages, slots = self.pages, self.slots
        if len(pages) == 1:
            return TransferOp.copy_op(op_id, self.kind, pages[0], slots[0])
        return TransferOp.copy_op(op_id, self.kind, concat(pages), concat(slots))

    def on_split(self, prefix: TreeNode, suffix: TreeNode) -> None:
        for chain in self.chains:
            for i, n in enumerate(chain):
                if n is suffix:
                    chain.insert(i, prefix)
                    return


class HiCacheController:
    def __init__(self, tree: RadixTree, config: HiCacheConfig, workers: WorkerGroup) -> None:
        self.tree = tree
        self.config = config
        self.workers = workers
        self._num_hosts = workers.num_hosts
        self._backup_hits = config.backup_hits
        self.counters = CacheCounters()
        self._pending: dict[int, PendingTransfer] = {}  # sent op id -> its transfers (an L3 op or a copy batch)
        self._loads: dict[int, _CopyBatch] = {}  # load id -> the batch carrying it (queued or in flight)
        self._finished_loads: dict[int, bool] = {}  # load id -> ok, until asked
        # Built, not yet sent, by kind (``submit`` sends each kind its own way; no filtering per send).
        self._open_loads = _CopyBatch(_H2D, self._num_hosts)  # H->D: one op, sent at the next submit
        self._open_backups = _CopyBatch(_D2H, self._num_hosts)  # D->H: one op, held while batching
        self._queued_storage: list[PendingTransfer] = []  # L3 ops: one op each, sent at the next submit
        # True while ``submit`` (not forced) would send: loads or L3 ops queued, or a full backup batch. Callers
        # that send after every call (the head) test it first: most calls queue nothing that must go.
        self.send_due = False
        self._backup_batch_pages = config.backup_batch_pages
        # Pages of the last L1 alloc (``note_alloc``): held backups lock their nodes, so ``check_events`` sends
        # them once L1's free + evictable pages fall below it (a next alloc like it would wait for them).
        self._last_alloc_pages = 0
        self._backup_held_calls = 0  # check_events calls since the oldest queued backup was queued
        self._backup_queued_at = 0.0
        self._deferred: dict[int, TreeNode] = {}  # backups waiting for an ancestor's backup ack
        self._seq = itertools.count()
        self._op_ids = itertools.count()
        self.storage: StorageTier | None = None
        self.on_transfer: Callable[[str, float, int], None] | None = None  # (op kind, seconds, host) per ack
        # Packed ints (events.pack_event); the KVEvent objects are built when taken (off the hot path).
        self._events: deque[int] = deque(maxlen=_MAX_EVENTS)
        self.host = HostTier(tree, config.host_slots, self._events)
        self._ghosts: OrderedDict[tuple[int, bytes], MissReason] = OrderedDict()
        self._last_miss: tuple[MissReason, int] | None = None  # the last match's missing tokens, by reason
        self._page_size = tree.page_size
        self._page_bytes = 4 * tree.page_size  # int32 tokens: the first page of a key, as bytes
        tree.listener = self
        tree.after_insert = self._after_insert
        if config.write_policy is WritePolicy.WRITE_BACK:
            tree.before_device_evict = self._write_back

    # -- tier listener (events, ghosts for miss reasons) ---------------------------------------------
    def on_stored(self, node: TreeNode, tier: str) -> None:
        self._events.append(node.id << _ID | node.num_tokens << _TOKENS | _STORED_CODE[tier])

    def on_removed(self, node: TreeNode, tier: str) -> None:
        self._events.append(node.id << _ID | node.num_tokens << _TOKENS | _REMOVED_CODE[tier])
        if tier == _DEVICE:
            if node.host_slots is not None:
                return  # demoted to host-only: still cached (the common L1 eviction under HiCache)
            reason = MissReason.EVICTED_L1
        elif node.device_pages is not None:
            return
        else:
            reason = MissReason.EVICTED_L2
        parent = node.parent
        if parent is not None:
            ghosts = self._ghosts
            ghost = (parent.id, node.key_bytes[: self._page_bytes])
            ghosts[ghost] = reason
            ghosts.move_to_end(ghost)
            if len(ghosts) > _MAX_GHOSTS:
                ghosts.popitem(last=False)

    def take_events(self) -> list[KVEvent]:
        events = [unpack_event(e) for e in self._events]
        self._events.clear()
        return events

    # -- match accounting ------------------------------------------------------------------------------
    def record_match(self, key: RadixKey, m: MatchResult) -> None:
        n = len(key.token_ids)
        whole = n - n % self._page_size
        device, host = m.device_hit_len, m.host_hit_len
        c = self.counters
        c.queried_tokens += whole
        c.device_hit_tokens += device
        c.host_hit_tokens += host
        missing = whole - device - host
        if missing > 0:
            reason = _NOT_CACHED
            if self._ghosts:
                pos = device + host
                page = key.token_ids[pos : pos + self._page_size].tobytes()
                reason = self._ghosts.get((m.best_match_node, page), reason)
            c.miss_tokens[reason] += missing
            self._last_miss = (reason, missing)
        else:
            self._last_miss = None

    def _note_l3_skip(self, progress: PrefetchProgress) -> None:
        """An L3 query skipped because L3 is down: the last match's missing tokens (which L3 was asked
        for) move to the ``l3_unavailable`` miss reason."""
        last, self._last_miss = self._last_miss, None
        if last is not None and progress.reason == L3_UNAVAILABLE:
            reason, missing = last
            self.counters.miss_tokens[reason] -= missing
            self.counters.miss_tokens[MissReason.L3_UNAVAILABLE] += missing

    # -- backups (L1 -> L2) -------------------------------------------------------------------------
    def _after_insert(self, path: list[TreeNode]) -> None:
        threshold = self._backup_hits
        if not threshold:
            return
        # Nodes with an L2 copy (or one in flight) are a prefix of the path (chains are contiguous from the
        # root), so only the suffix after them may need a backup; the deepest node that qualifies takes every
        # ancestor without a copy along in one chain. Under write_through that is the last node (its first
        # insert counts as a hit): tested before any loop.
        node = path[-1]
        if node.host_slots is not None or node.staged_slots is not None:
            return
        if node.hit_count < threshold:
            for node in reversed(path):
                if node.host_slots is not None or node.staged_slots is not None:
                    return
                if node.hit_count >= threshold:
                    break
            else:
                return
        self._backup_chain(node)

    def _backup_chain(self, node: TreeNode) -> bool:
        """Backs up ``node`` and every ancestor without an L2 copy, in one op. False if not started."""
        parent = node.parent
        pages = node.device_pages
        if (
            (parent.host_slots is not None or parent.parent is None) and pages is not None and not node.loading
            and node.host_slots is None and node.staged_slots is None
        ):
            # The common chain (a new leaf below a backed-up node or the root): the node alone, as
            # ``FullComponent.backup_chain`` would find it, without the walk.
            chain = [node]
        else:
            chain, blocker = self.tree.full.backup_chain(node)
            if blocker is not None:
                if blocker.staged_slots is not None and blocker is not node:
                    self._deferred[node.id] = node  # an ancestor's backup is in flight: after its ack
                return False
            if not chain:
                return False
            # Node page arrays are never written in place (splits and evictions replace them), so a single
            # node's array is used as is; TransferOp copies it when the op is built.
            pages = chain[0].device_pages if len(chain) == 1 else concat([c.device_pages for c in chain])
        k = len(pages)
        slots = self.host.take(k)
        if slots is None:  # host eviction first: it must not drop the copy of the node the chain hangs below
            anchor = chain[0].parent
            anchor.host_pin += 1
            try:
                slots = self.host.reserve(k)
            finally:
                anchor.host_pin -= 1
            if slots is None:
                return False  # L2 full of pinned / in-flight entries: this node stays L1-only
        if len(chain) == 1:
            node.staged_slots = slots
        else:
            start = 0
            for c in chain:
                k = len(c.device_pages)
                c.staged_slots = slots[start : start + k]
                start += k
        self.tree.full.lock(chain[-1])
        # The open batch goes as one TransferOp when sent (``submit``): nothing is built per chain.
        batch = self._open_backups
        if not batch.num_pages:
            self._backup_held_calls = 0
            self._backup_queued_at = time.monotonic()
        if batch.add(chain, pages, slots) >= self._backup_batch_pages:
            self.send_due = True
        return True

    def _write_back(self, victims: list[TreeNode]) -> None:
        """write_back: L1 victims without an L2 copy are backed up (and waited for) before eviction."""
        started = [v for v in victims if v.host_slots is None and self._backup_chain(v)]
        if started:
            self.flush_device_backups()

    # -- load-back (L2 -> L1) -----------------------------------------------------------------------
    def init_load_back(self, params: LoadBackParams) -> LoadBackResult:
        if not isinstance(params, LoadBackParams):
            raise TypeError(f"init_load_back expects LoadBackParams, got {type(params).__name__}")
        if params.mem_quota is not None and (not isinstance(params.mem_quota, int) or params.mem_quota < 0):
            raise ValueError(f"mem_quota must be an int >= 0 or None, got {params.mem_quota!r}")
        caller_lock = params.lock
        if caller_lock is not True and caller_lock is not False:
            raise TypeError(f"LoadBackParams.lock must be a bool, got {caller_lock!r}")
        node = self.tree.node(params.node_id)
        chain = []
        tokens = 0
        loadable = True
        n = node
        while n.device_pages is None and n.parent is not None:
            chain.append(n)
            tokens += n.num_tokens
            if n.host_slots is None or n.pending is not None:
                loadable = False
            n = n.parent
        last_device = n
        if node.parent is not None and node.device_pages is not None and node.loading:
            raise ValueError(f"node {params.node_id} is already loading")
        if params.host_hit_len != tokens:
            raise ValueError(
                f"host_hit_len {params.host_hit_len} does not match node {params.node_id} "
                f"({tokens} host-only tokens above it): match again"
            )
        if not loadable:
            raise ValueError(f"node {params.node_id} is not loadable (no host copy or a transfer in flight)")
        reason = None
        if not chain:
            pass
        elif tokens < self.config.load_back_threshold:
            reason = MissReason.BELOW_THRESHOLD
        elif params.mem_quota is not None and tokens > params.mem_quota:
            reason = MissReason.OVER_QUOTA
        if reason is None and chain:
            if len(chain) > 1:
                chain.reverse()
            return self._start_load(chain, last_device, tokens, caller_lock)
        if reason is not None:
            self.counters.miss_tokens[reason] += tokens
        if caller_lock:
            self.tree.lock_path(last_device)
        return self._prefix_result(last_device, last_device, None, 0, -1, reason)

    def _start_load(self, chain: list[TreeNode], last_device: TreeNode, tokens: int,
                    caller_lock: bool) -> LoadBackResult:
        tree = self.tree
        full = tree.full
        leaf = chain[-1]
        # One lock on the whole path: last_device's pages must survive the eviction alloc() may do, and the
        # chain stays locked until the load is acked (host-only nodes take the lock without L1 accounting;
        # their pages count as protected once attached). With ``caller_lock`` it is the caller's lock, taken
        # in every component as ``inc_lock_ref`` takes it (``tree.lock_path``, inline: one call less).
        full.lock(leaf)
        if caller_lock:
            for on_lock in tree.hooks.on_lock:
                on_lock(leaf)
        for c in chain:
            c.host_pin += 1  # write_back: the eviction below may back up and evict host leaves
        # The chain's pages go straight to the tree (it takes them below): no request-held state in between.
        allocator = full.allocator
        need = tokens // self._page_size
        self.note_alloc(need)
        try:
            try:
                self.tree.make_room(need, tokens)
            except CacheCapacityError:
                if not self.in_flight:
                    raise
                # Nodes locked only by queued/in-flight backups become evictable once acked (as head.alloc).
                self.relieve_l1(lambda: self.tree.make_room(need, tokens))
            pages = allocator.alloc(need, _TREE)
        except CacheCapacityError:
            for c in chain:
                c.host_pin -= 1
            if caller_lock:  # the caller's lock moves to the prefix it gets
                self.tree.dec_lock_ref(leaf.id)
                self.tree.lock_path(last_device)
            else:
                full.unlock(leaf)
                if last_device.parent is not None:
                    full.maybe_push(last_device)  # an eviction pass may have dropped its queue entry meanwhile
            self.counters.miss_tokens[MissReason.NO_SPACE] += tokens
            return self._prefix_result(last_device, last_device, None, 0, -1, MissReason.NO_SPACE)
        slots = full.attach_loading_chain(chain, pages)
        load_id = next(self._op_ids)
        # The open batch goes as one TransferOp at the next send (``submit``): one per step, not per request.
        batch = self._open_loads
        batch.add(chain, pages, slots)
        batch.load_ids.append(load_id)
        batch.caller_locks.append(caller_lock)
        self.send_due = True
        self._loads[load_id] = batch
        return self._prefix_result(leaf, last_device, pages, tokens, load_id, None)

    def _prefix_result(self, last: TreeNode, last_device: TreeNode, loaded_pages: np.ndarray | None, loaded: int,
                       load_id: int, reason: MissReason | None) -> LoadBackResult:
        """The prefix ending at ``last``: the L1 path down to ``last_device``, then the pages being loaded."""
        parts = []
        n = last_device
        while n.parent is not None:
            parts.append(n.device_pages)
            n = n.parent
        parts.reverse()
        if loaded_pages is not None:
            parts.append(loaded_pages)
        if len(parts) > 1:
            pages = concat(parts)
        else:
            pages = parts[0] if parts else _NO_PAGES
        return LoadBackResult(pages, len(pages) * self._page_size, last.id, loaded, load_id, reason)

    def wait_load_back(self, load_id: int, timeout_s: float | None = None) -> bool:
        """True once load ``load_id`` is acked by every host; False if it failed or timed out."""
        if load_id == -1:
            return True
        finished = self._finished_loads.pop(load_id, None)
        if finished is not None:
            return finished
        if load_id not in self._loads:
            raise ValueError(f"unknown load id {load_id}")
        timeout = self.config.ack_timeout_s if timeout_s is None else timeout_s
        # Sends every queued load as one op (the loads of a whole scheduler step share one dispatch and
        # one ack); queued backups keep batching (they are off the critical path).
        self.submit()
        self._apply(self.workers.poll())
        if load_id in self._loads:
            # Only the loads in flight (device ops are acked in order): never the L2->L3 writes.
            loads = [op_id for op_id, p in self._pending.items() if p.kind is _H2D]
            self._apply(self.workers.wait(timeout, loads))
        return self._finished_loads.pop(load_id, False)

    # -- sending and acks ---------------------------------------------------------------------------
    def _queue(self, op: TransferOp, nodes: list[TreeNode]) -> PendingTransfer:
        """Queues the L3 op ``op`` (the storage tier's callback) for the nodes waiting on it. (L1<->L2 copies
        join the open ``_CopyBatch`` of their kind where they are built.)"""
        pending = PendingTransfer(op, -1, nodes, self._num_hosts)
        for n in nodes:
            n.pending = pending
        self._queued_storage.append(pending)
        self.send_due = True
        return pending

    @property
    def _has_queued(self) -> bool:
        return bool(self._open_loads.chains or self._open_backups.chains or self._queued_storage)

    # -- L3 ------------------------------------------------------------------------------------------
    def attach_storage_backend(self, params: StorageParams) -> None:
        """Attaches L3 at runtime; only while no transfer is in flight."""
        if not isinstance(params, StorageParams):
            raise TypeError(f"attach_storage_backend expects StorageParams, got {type(params).__name__}")
        if self.storage is not None:
            raise RuntimeError("a storage backend is already attached: detach it first")
        if self.in_flight:
            raise RuntimeError(f"cannot attach storage with {self.in_flight} transfers in flight")
        self.storage = StorageTier(self.tree, self.host, self.workers, params, self._queue, self._op_ids)

    def detach_storage_backend(self) -> None:
        """Drains in-flight work (bounded by ``ack_timeout_s``), then detaches L3."""
        if self.storage is None:
            return
        self.flush_write_through_acks()
        if self.storage.in_flight:
            raise RuntimeError(f"{self.storage.in_flight} storage ops still in flight after the ack timeout")
        self.storage.detach()
        self.storage = None

    def prefetch_from_storage(self, params: PrefetchParams) -> PrefetchProgress:
        if self.storage is None:
            raise RuntimeError("no storage backend attached")
        progress = self.storage.prefetch(params)
        self._note_l3_skip(progress)
        self.submit()
        return progress

    def prefetch_matched(self, req_id: str, key: RadixKey, m: MatchResult) -> PrefetchProgress:
        """``prefetch_from_storage`` below ``m.best_match_node``, ``m`` the tree's match of ``key`` in this
        same head call (``CacheHead.begin_request``): its node and depth are known, not checked again."""
        if self.storage is None:
            raise RuntimeError("no storage backend attached")
        progress = self.storage.prefetch_matched(req_id, key, self.tree.node(m.best_match_node),
                                                 m.device_hit_len + m.host_hit_len)
        self._note_l3_skip(progress)
        self.submit()
        return progress

    def check_prefetch_progress(self, req_id: str) -> PrefetchProgress:
        """Applies acks; under ``wait_complete``/``timeout`` blocks (bounded) as the policy allows.
        Held backups stay held (the request waits here; its prefetch op went out when it started)."""
        if self.storage is None:
            raise RuntimeError("no storage backend attached")
        self.submit()
        self._apply(self.workers.poll())
        budget = self.storage.wait_budget_s(req_id, self.config.ack_timeout_s)
        if budget > 0:
            self._apply(self.workers.wait(budget))
        return self.storage.progress(req_id)

    def submit(self, force: bool = False) -> int:
        """Sends queued ops as one plan to all hosts; returns the number of transfers sent.

        Loads (and storage ops) are sent at once: a request waits for them; queued loads travel as ONE
        merged op. Backups are off the critical path: alone they wait until ``backup_batch_pages`` are
        queued (or ``force``); a plan that goes out for loads or storage ops leaves them queued (a D2H
        dispatch is never on a request's critical path); when they go, they go merged into ONE op. So a
        scheduler step costs one dispatch and one ack per host per kind, not one per request.
        """
        if not (self.send_due or force):
            return 0  # nothing queued, or only backups still batching: the common case
        loads, storage, backups = self._open_loads, self._queued_storage, self._open_backups
        if backups.chains and (force or backups.num_pages >= self._backup_batch_pages):
            self._open_backups = _CopyBatch(_D2H, self._num_hosts)
        elif loads.chains or storage:
            # Loads / storage ops go now; held backups keep batching: a D2H dispatch never rides
            # on the plan of a request's load-back or L3 prefetch (its TTFT).
            backups = None
        else:
            return 0  # forced with nothing queued
        # What stays queued now is a backup batch below its size: nothing is due until more is queued.
        self.send_due = False
        seq = next(self._seq)
        sent: list[PendingTransfer] = storage  # queue order, one op each
        if storage:
            self._queued_storage = []
        if loads.chains:
            self._open_loads = _CopyBatch(_H2D, self._num_hosts)
            loads.op = loads.merged_op(next(self._op_ids))
            sent = [*sent, loads]
        if backups is not None:
            backups.op = backups.merged_op(next(self._op_ids))
            sent = [*sent, backups]
        pending = self._pending
        transfers = 0
        for p in sent:
            p.sent(seq)
            pending[p.op.op_id] = p
            transfers += p.num_transfers
        self.workers.submit(TransferPlan(seq, tuple(p.op for p in sent)))
        return transfers

    def check_events(self) -> int:
        """Sends what is queued and applies every ack that arrived; returns transfers completed.

        Loads go at once; backups keep batching up to ``backup_batch_pages``, but never wait longer than
        ``_BACKUP_HOLD_CALLS`` calls or ``_BACKUP_HOLD_S`` (their nodes stay locked meanwhile), nor once L1's
        free + evictable pages are fewer than the last alloc took (``note_alloc``): a next request like it
        would wait for them in its alloc, on its critical path; sent now, they are acked by then. L2->L3 backups queued by
        the acks applied here are sent before returning.
        """
        if self._open_loads.chains or self._open_backups.chains or self._queued_storage:
            force = False
            if self._open_backups.num_pages:
                self._backup_held_calls += 1
                force = (self._backup_held_calls >= _BACKUP_HOLD_CALLS
                         or time.monotonic() - self._backup_queued_at >= _BACKUP_HOLD_S
                         or self._l1_room() < self._last_alloc_pages)
            self.submit(force=force)
        if not self._pending:
            return 0
        done = self._apply(self.workers.poll())
        if self._queued_storage:  # follow-ups of those acks (L2->L3 backups): sent now, not in the next
            self.submit()  # request's prefetch or load-back
        return done

    def pause_storage_writes(self) -> None:
        """A prefill is next: L2->L3 writes queued from now wait on the head (``StorageTier.pause_writes``)."""
        if self.storage is not None:
            self.storage.pause_writes()

    def resume_storage_writes(self) -> int:
        """The first token is out: held L2->L3 writes are sent now (they run during the decode)."""
        n = self.storage.resume_writes() if self.storage is not None else 0
        if n:
            self.submit()
        return n

    def flush_write_through_acks(self) -> int:
        """Waits (bounded by ``ack_timeout_s``) until every in-flight transfer is acked, and applies them."""
        if self.storage is not None:
            self.storage.resume_writes()  # a flush sends everything, held writes included
        deadline = time.monotonic() + self.config.ack_timeout_s
        done = 0
        while True:  # acks may queue follow-up work (L2->L3 after D->H, deferred backups)
            self.submit(force=True)
            done += self._apply(self.workers.poll())
            left = deadline - time.monotonic()
            if (not self._pending and not self._has_queued) or left <= 0:
                break
            if self._pending:
                done += self._apply(self.workers.wait(left))
        return done

    def note_alloc(self, num_pages: int) -> None:
        """An L1 alloc of ``num_pages`` pages (a request's, a load-back's): the room ``check_events`` keeps free
        of held backups."""
        self._last_alloc_pages = num_pages

    def _l1_room(self) -> int:
        """L1 pages an alloc gets now without waiting for a transfer: free, plus evictable."""
        full = self.tree.full
        if not full.allocator.bounded:
            return self._last_alloc_pages  # an unbounded L1 grows: nothing waits
        return full.allocator.num_free + full.evictable_tokens // self._page_size

    def relieve_l1(self, retry: Callable[[], _T]) -> _T:
        """``retry()`` once L1 has more room, after a ``CacheCapacityError`` with transfers in flight: nodes
        locked only by their L1->L2 copy become evictable when it is acked. First the acks that already came
        (no wait; a copy sent at an earlier finish is usually done by the next request's alloc), then, if
        ``retry`` still fails, every held or in-flight copy is sent and waited for (bounded)."""
        if self._pending and self._apply(self.workers.poll()):
            try:
                return retry()
            except CacheCapacityError:
                pass
        self.flush_device_backups()
        return retry()

    def flush_device_backups(self) -> int:
        """What an L1 eviction short of pages needs: waits (bounded by ``ack_timeout_s``) until every held or
        in-flight L1->L2 copy is acked, and applies the acks (nodes locked only by their D->H copy become
        evictable). Unlike ``flush_write_through_acks`` it never waits for L2->L3 writes or L3 prefetches
        (milliseconds of storage I/O that free no L1 page) and leaves the follow-up L3 writes queued."""
        deadline = time.monotonic() + self.config.ack_timeout_s
        done = 0
        while True:  # an ack may open follow-up backups (a child's chain waits for its parent's copy)
            if self._open_backups.chains:
                self.submit(force=True)
            done += self._apply(self.workers.poll())
            backups = [op_id for op_id, p in self._pending.items() if p.kind is _D2H]
            left = deadline - time.monotonic()
            if (not backups and not self._open_backups.chains) or left <= 0:
                return done
            if backups:
                done += self._apply(self.workers.wait(left, backups))

    def _apply(self, acks: list[TransferAck]) -> int:
        done = 0
        pending = self._pending
        for ack in acks:
            p = pending.get(ack.op_id)
            if p is None:
                continue  # an ack for a transfer already given up on
            if ack.host not in p.acked_hosts:
                kind = p.kind
                self.counters.bytes_moved[kind._value_] += ack.bytes_moved
                if self.on_transfer is not None:
                    self.on_transfer(kind._value_, ack.duration_s, ack.host)
                p.record(ack)
            if len(p.acked_hosts) == p.num_hosts:
                del pending[ack.op_id]
                kind = p.kind
                if kind is not _H2D and kind is not _D2H:
                    self._complete_storage(p)
                elif p.errors:
                    self._fail_copies(p)  # type: ignore[arg-type]  # L1<->L2 ops are copy batches
                elif kind is _H2D:
                    self._commit_loads(p)  # type: ignore[arg-type]
                else:
                    self._commit_backups(p)  # type: ignore[arg-type]
                done += p.num_transfers
        if done and self._deferred:
            retry, self._deferred = list(self._deferred.values()), {}
            for node in retry:
                if node.parent is not None and node.host_slots is None and node.staged_slots is None:
                    self._backup_chain(node)
            self.submit()
        return done

    def _commit_backups(self, batch: _CopyBatch) -> None:
        """Every host acked the D->H op of ``batch``: the chains' staged slots (``op.host_slots``, in chain
        order; splits since keep the order) become L2 copies with one allocator update, each chain's path
        lock is released, and each chain's leaf absorbs its parent where the tree allows
        (``RadixTree.merge_backed_up``)."""
        chains = batch.chains
        self.counters.backed_up_tokens += self.host.commit_chains(chains, batch.op.host_slots)  # clears ``pending``
        unlock, merge = self.tree.full.unlock, self.tree.merge_backed_up
        if self.storage is None:
            for nodes in chains:
                leaf = nodes[-1]
                merge(leaf)  # (the path lock is on both: equal locks either side of the unlock)
                unlock(leaf)  # one node less to walk once merged
            return
        for nodes in chains:
            unlock(nodes[-1])
            self.storage.on_host_committed(nodes)  # an L2->L3 write pins the chain: no merge then
            merge(nodes[-1])

    def _commit_loads(self, batch: _CopyBatch) -> None:
        """Every host acked the H->D op of ``batch``: each chain (root to leaf) is device+host again, and a
        load releases its path lock (one that holds its caller's leaves it)."""
        events = self._events
        unlock = self.tree.full.unlock
        maybe_push = self.host.maybe_push
        loads, finished = self._loads, self._finished_loads
        tokens = 0
        for nodes, caller_lock, load_id in zip(batch.chains, batch.caller_locks, batch.load_ids):
            for n in nodes:
                n.pending = None
                n.loading = False
                n.host_pin -= 1
                k = n.num_tokens
                tokens += k
                events.append(n.id << _ID | k << _TOKENS | _LOADED_CODE)
            leaf = nodes[-1]
            if not caller_lock:
                unlock(leaf)  # pushes the leaf as an L1 candidate if nothing else holds it
            # Every node but the leaf has a child with an L2 copy (and, now, L1 pages): only the leaf can
            # be a host eviction candidate.
            maybe_push(leaf)
            del loads[load_id]
            finished[load_id] = True
        self.counters.loaded_tokens += tokens
        self._bound_finished_loads()

    def _fail_copies(self, batch: _CopyBatch) -> None:
        """The copies of ``batch`` failed (on some host, or given up on): every chain rolls back to its
        state before the copy and what the copy reserved is freed."""
        self.counters.transfer_failures += len(batch.chains)
        full = self.tree.full
        if batch.kind is _D2H:
            unreserve = self.host.unreserve
            for nodes in batch.chains:
                for n in nodes:
                    n.pending = None
                    unreserve(n.staged_slots)
                    n.staged_slots = None
                full.unlock(nodes[-1])
            return
        host = self.host
        for nodes, caller_lock, load_id in zip(batch.chains, batch.caller_locks, batch.load_ids):
            tokens = 0
            if not caller_lock:  # else the caller releases its lock
                full.unlock(nodes[-1])
            for n in nodes:
                n.pending = None
                n.loading = False
                n.host_pin -= 1
                tokens += n.num_tokens
                full.drop_device(n)  # the pages never got the data: host-only again
            self.counters.miss_tokens[MissReason.LOAD_FAILED] += tokens
            parent = nodes[0].parent
            if parent is not None and parent.parent is not None:
                full.maybe_push(parent)  # may be an L1 leaf again
            for n in nodes:
                host.maybe_push(n)
            del self._loads[load_id]
            self._finished_loads[load_id] = False
        self._bound_finished_loads()

    def _complete_storage(self, p: PendingTransfer) -> None:
        """An L3 op is done on every host (acked, or failed)."""
        if p.errors:
            self.counters.transfer_failures += 1
        for n in p.nodes:
            n.pending = None
        if self.storage is not None and self.storage.owns(p.op.op_id):  # BACKUP_H2S, PREFETCH_S2H
            self.storage.complete(p)

    def _bound_finished_loads(self) -> None:
        finished = self._finished_loads
        while len(finished) > _MAX_EVENTS:
            finished.pop(next(iter(finished)))

    def drop_host_tier(self, reason: str = "worker lost") -> int:
        """Forgets all of L2 (a host worker died or restarted: its L2 shard is gone or stale).

        In-flight transfers fail (their acks, if any ever come, are ignored), host-only nodes leave the
        tree, device+host nodes become device-only, and every slot is free again. L1 keeps serving;
        nothing is ever served from the lost L2. Returns the tokens dropped from L2.
        """
        queued = self._queued_storage + [b for b in (self._open_loads, self._open_backups) if b.chains]
        self._queued_storage = []
        self._open_loads = _CopyBatch(_H2D, self._num_hosts)
        self._open_backups = _CopyBatch(_D2H, self._num_hosts)
        self.send_due = False
        failed = [*self._pending.values(), *queued]
        self._pending.clear()
        for p in failed:
            p.fail(reason)
            if type(p) is _CopyBatch:
                self._fail_copies(p)
            else:
                self._complete_storage(p)
        self._deferred.clear()
        self.host.return_block()
        dropped = 0
        # Leaves first, so every host-only node is childless when it goes.
        for node in sorted(self.tree.iter_nodes(), key=self.tree.depth, reverse=True):
            if node.host_slots is not None:
                dropped += self.host.drop(node)
        self.host.clear_queue()
        return dropped

    @property
    def in_flight(self) -> int:
        queued = len(self._open_loads.chains) + len(self._open_backups.chains) + len(self._queued_storage)
        return sum(p.num_transfers for p in self._pending.values()) + queued

    def check_invariants(self) -> None:
        self.host.check_invariants()
        for node in self.tree.iter_nodes():
            if node.staged_slots is not None or node.loading:
                assert node.pending is not None and node.lock_ref > 0, f"{node}: in flight but not locked"
            if node.loading:
                assert node.host_pin > 0 and node.host_slots is not None
