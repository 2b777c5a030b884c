"""HiCache controller: the L1<->L2 policy of one replica, running inside the head.

``CacheHead`` calls it, on the head's one thread (workers never decide). It decides backups (write
policies), load-backs and host eviction and queues them as transfers in its ``PlanOutbox``
(``hicache.cluster.plan_outbox``: batching, write holds, plans sent to every host in ``seq`` order);
``check_events`` and the waits apply the acks through its ``TransferCommitter``
(``hicache.cluster.transfer_commit``): a node's state changes only when every host acked (DESIGN.md
§1), and a failed transfer rolls the nodes back and frees what was reserved. The tree reports tier
changes to its ``TierEvents`` (``hicache.cluster.tier_events``: events, miss reasons).

Node states (Full KV): device-only -> device + staged (backup in flight, path locked) -> device+host ->
host-only (L1 evicted) -> removed (L2 evicted); load-back: host-only -> loading (L1 pages attached,
locked, host copy pinned) -> device+host. When a backup is acked, its chain's leaf absorbs its parent if
both are device+host and nothing tells them apart (``RadixTree.merge_backed_up``): a write-through
conversation stays one node.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from hicache.cluster.component_host import ComponentHostPool
from hicache.cluster.events import CacheCounters, KVEvent, MissReason
from hicache.cluster.host_tier import HostTier
from hicache.cluster.plan_outbox import CopyBatch, PlanOutbox
from hicache.cluster.policy import HiCacheConfig, WritePolicy
from hicache.cluster.storage_tier import (
    L3_UNAVAILABLE,
    PrefetchParams,
    PrefetchProgress,
    PrefetchState,
    StorageParams,
    StorageTier,
)
from hicache.cluster.tier_events import TierEvents
from hicache.cluster.transfer_commit import TransferCommitter
from hicache.cluster.tree import (
    CacheCapacityError,
    ComponentTransfer,
    HiCachePhase,
    MatchResult,
    PageOwner,
    RadixKey,
    RadixTree,
    TreeNode,
)
from hicache.cluster.tree.allocator import concat
from hicache.cluster.worker_group import WorkerGroup
from hicache.workers.plan import OpKind, TransferAck

_D2H, _H2D = OpKind.BACKUP_D2H, OpKind.LOAD_H2D
_TREE = int(PageOwner.TREE)
_NO_PAGES = np.empty(0, np.int32)
_NO_PAGES.setflags(write=False)
_T = TypeVar("_T")


# One LoadBackParams and one LoadBackResult per load-back: slotted, not frozen (a frozen dataclass's
# __init__ stores each field through object.__setattr__, which costs more).


@dataclass(slots=True)
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


@dataclass(slots=True, eq=False)
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


class HiCacheController:
    def __init__(self, tree: RadixTree, config: HiCacheConfig, workers: WorkerGroup,
                 component_host_slots: Mapping[str, int] | None = None) -> None:
        """``component_host_slots``: L2 ids per component pool of a hybrid tree (``"swa"``: SWA pages), whose
        copies ride in the Full pages' ops (``ComponentHostPool``); components without an entry keep L1 only."""
        self.tree = tree
        self.config = config
        self.counters = CacheCounters()
        self.outbox = PlanOutbox(workers, config)
        self.events = TierEvents(tree.page_size, self.counters, tree.cached_elsewhere)
        self.host = HostTier(tree, config.host_slots, self.events.log)
        self.component_host_slots = dict(component_host_slots or {})
        self.component_hosts = {name: ComponentHostPool(tree, tree.component(name), n)
                                for name, n in self.component_host_slots.items()}
        self.commits = TransferCommitter(tree, self.host, self.events, self.counters, self.component_hosts)
        # Component pools whose backups are built when the D2H op is sent (``TreeComponent.backup_at_send``)
        self._send_time_hosts = [p for p in self.component_hosts.values() if p.component.backup_at_send]
        self._queue_time_hosts = [p for p in self.component_hosts.values() if not p.component.backup_at_send]
        if self._send_time_hosts:
            self.outbox.before_backup_send = self._add_send_time_parts
        self.on_transfer: Callable[[str, float, int], None] | None = None  # (op kind, seconds, host) per ack
        self._backup_hits = config.backup_hits
        # Pages of the last L1 alloc (``note_alloc``): held backups lock their nodes, so ``check_events`` sends
        # them once L1's free + evictable pages fall below it (a next alloc like it would wait for them).
        self._last_alloc_pages = 0
        self._deferred: dict[int, TreeNode] = {}  # backups waiting for an ancestor's backup ack
        self._page_size = tree.page_size
        tree.listener = self.events
        tree.after_insert = self._after_insert
        if config.write_policy is WritePolicy.WRITE_BACK:
            tree.before_device_evict = self._write_back

    @property
    def workers(self) -> WorkerGroup:
        return self.outbox.workers

    @workers.setter
    def workers(self, workers: WorkerGroup) -> None:
        """Swaps the worker group plans go to and acks come from (tests wrap it to record or hold plans)."""
        self.outbox.workers = workers

    @property
    def storage(self) -> StorageTier | None:
        """The attached L3 tier, None without one."""
        return self.commits.storage

    @property
    def send_due(self) -> bool:
        """``submit`` (not forced) would send now (``PlanOutbox.send_due``)."""
        return self.outbox.send_due

    @property
    def in_flight(self) -> int:
        return self.outbox.in_flight

    def take_events(self) -> list[KVEvent]:
        return self.events.take()

    def record_match(self, key: RadixKey, m: MatchResult) -> None:
        self.events.record_match(key, m)

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
        assert parent is not None  # the root is never backed up
        pages = node.device_pages
        if (
            (parent.host_slots is not None or parent.parent is None) and pages is not None and not node.loading
            and node.host_slots is None and node.staged_slots is None
        ):
            # The common chain (a new leaf below a backed-up node or the root): the node alone, as
            # ``FullComponent.backup_chain`` would find it, without the walk.
            chain = [node]
            parts = [pages]
        else:
            chain, blocker = self.tree.full.backup_chain(node)
            if blocker is not None:
                if blocker.staged_slots is None or blocker is node:
                    return False
                # When the ancestor's backup is still queued, the nodes below it join the same op (one ack
                # commits both chains, ancestors first; a failed op rolls both back): a chunked prefill caches
                # a node end per chunk, and deferred ones were evicted from L1 before the ancestor's ack.
                if blocker.pending is not self.outbox.open_backups:
                    self._deferred[node.id] = node  # an ancestor's backup is in flight: after its ack
                    return False
                chain = self._chain_below(node, blocker)
            if not chain:
                return False
            parts = []
            for c in chain:  # every node of the chain has L1 pages (``backup_chain``'s rule)
                assert c.device_pages is not None
                parts.append(c.device_pages)
            # Node page arrays are never written in place (splits and evictions replace them), so a single
            # node's array is used as is; TransferOp copies it when the op is built.
            pages = parts[0] if len(parts) == 1 else concat(parts)
        k = len(pages)
        slots = self.host.take(k)
        if slots is None:  # host eviction first: it must not drop the copy of the node the chain hangs below
            anchor = chain[0].parent
            assert anchor is not None
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
            for c, part in zip(chain, parts):
                k = len(part)
                c.staged_slots = slots[start : start + k]
                start += k
        self.tree.full.lock(chain[-1])
        # The open batch goes as one TransferOp when sent (``submit``): nothing is built per chain.
        self.outbox.queue_backup(chain, pages, slots, self._backup_parts(chain) if self.component_hosts else None)
        return True

    @staticmethod
    def _chain_below(node: TreeNode, ancestor: TreeNode) -> list[TreeNode]:
        """``node`` and its ancestors below ``ancestor``, root first (none has an L2 copy or a staged one)."""
        chain = []
        while node is not ancestor:
            assert node.parent is not None and node.host_slots is None and node.staged_slots is None
            assert node.device_pages is not None and not node.loading
            chain.append(node)
            node = node.parent
        chain.reverse()
        return chain

    def _backup_parts(self, chain: list[TreeNode]) -> list[ComponentTransfer]:
        """The component copies that go with the backup of ``chain``, with the host ids reserved for them; a
        copy the component's L2 cannot make room for is left out (its node gets no component copy, so L2 hits
        stop where the component needs it)."""
        return self._reserved_parts(self._queue_time_hosts, chain)

    @staticmethod
    def _reserved_parts(pools: list[ComponentHostPool], chain: list[TreeNode]) -> list[ComponentTransfer]:
        parts = []
        for pool in pools:
            for node in chain:
                for t in pool.component.build_hicache_transfers(node, HiCachePhase.BACKUP):
                    ids = pool.reserve(len(t.src))
                    if ids is not None:
                        parts.append(dataclasses.replace(t, dst=ids))
                    else:  # no room: the component releases what it holds for the copy
                        pool.component.commit_hicache_transfer(node, HiCachePhase.BACKUP, [t], ok=False)
        return parts

    def _add_send_time_parts(self, batch: CopyBatch) -> None:
        """The backup batch goes now: the copies of the send-time components (Mamba states) join it, built from
        what its chains' nodes hold at this moment (the op reads them at dispatch; the nodes stay locked)."""
        for i, chain in enumerate(batch.chains):
            parts = self._reserved_parts(self._send_time_hosts, chain)
            if parts:
                batch.add_parts(i, parts)
        for pool in self._send_time_hosts:  # values cached on nodes already backed up (e.g. a branch's state)
            for node in pool.component.take_late_backups():
                parts = self._reserved_parts([pool], [node])
                if parts:
                    self.tree.full.lock(node)  # (its value stays in L1 until the ack)
                    batch.add_loose(node, parts)

    def _load_parts(self, leaf: TreeNode) -> list[ComponentTransfer]:
        """The component copies a load of the chain ending at ``leaf`` needs (e.g. SWA: the window's pages)."""
        parts: list[ComponentTransfer] = []
        for pool in self.component_hosts.values():
            parts += pool.component.build_hicache_transfers(leaf, HiCachePhase.LOAD_BACK)
        return parts

    def backup_to_host(self, node: TreeNode) -> bool:
        """Starts the L1 -> L2 backup of ``node`` and its ancestors without an L2 copy (a drain's L1-only
        nodes; L3 follows at the ack). False if it could not start."""
        return self._backup_chain(node)

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
        served = self.tree.servable_end(last_device)  # (hybrid trees: the L2 part was what the components needed)
        if caller_lock:
            self.tree.lock_path(served)
        return self._prefix_result(served, served, None, 0, -1, reason)

    def _start_load(self, chain: list[TreeNode], last_device: TreeNode, tokens: int,
                    caller_lock: bool) -> LoadBackResult:
        tree = self.tree
        full = tree.full
        leaf = chain[-1]
        # One lock on the whole path: last_device's pages must survive the eviction alloc() may do, and the
        # chain stays locked until the load is acked (host-only nodes take the lock without L1 accounting;
        # their pages count as protected once attached). With ``caller_lock`` it is the caller's lock, taken
        # in every component as ``inc_lock_ref`` takes it (``tree.lock_path``).
        if caller_lock:
            tree.lock_path(leaf)
        else:
            full.lock(leaf)
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
            served = self.tree.servable_end(last_device)
            if caller_lock:  # the caller's lock moves to the prefix it gets
                self.tree.dec_lock_ref(leaf.id)
                self.tree.lock_path(served)
            else:
                full.unlock(leaf)
                if last_device.parent is not None:
                    full.maybe_push(last_device)  # an eviction pass may have dropped its queue entry meanwhile
            self.counters.miss_tokens[MissReason.NO_SPACE] += tokens
            return self._prefix_result(served, served, None, 0, -1, MissReason.NO_SPACE)
        slots = full.attach_loading_chain(chain, pages)
        load_id = next(self.outbox.op_ids)
        # The open batch goes as one TransferOp at the next send (``submit``): one per step, not per request.
        self.commits.loads[load_id] = self.outbox.queue_load(
            chain, pages, slots, load_id, caller_lock, self._load_parts(leaf) if self.component_hosts else None)
        return self._prefix_result(leaf, last_device, pages, tokens, load_id, None)

    def _prefix_result(self, last: TreeNode, last_device: TreeNode, loaded_pages: np.ndarray | None, loaded: int,
                       load_id: int, reason: MissReason | None) -> LoadBackResult:
        """The prefix ending at ``last``: the L1 path down to ``last_device``, then the pages being loaded."""
        parts: list[np.ndarray] = []
        n = last_device
        while n.parent is not None:
            assert n.device_pages is not None  # last_device and its ancestors are in L1
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
        finished = self.commits.take_finished(load_id)
        if finished is not None:
            return finished
        if load_id not in self.commits.loads:
            raise ValueError(f"unknown load id {load_id}")
        timeout = self.config.ack_timeout_s if timeout_s is None else timeout_s
        # Sends every queued load as one op (the loads of a whole scheduler step share one dispatch and
        # one ack); queued backups keep batching (they are off the critical path).
        self.submit()
        self._apply(self.workers.poll())
        if load_id in self.commits.loads:
            # Only the loads in flight (acked in order): never the D2H backups or L2->L3 writes.
            self._apply(self.workers.wait(timeout, self.outbox.pending_ids(_H2D)))
        return bool(self.commits.take_finished(load_id))

    # -- L3 ------------------------------------------------------------------------------------------
    def attach_storage_backend(self, params: StorageParams) -> None:
        """Attaches L3 at runtime; only while no transfer is in flight."""
        if not isinstance(params, StorageParams):
            raise TypeError(f"attach_storage_backend expects StorageParams, got {type(params).__name__}")
        if self.storage is not None:
            raise RuntimeError("a storage backend is already attached: detach it first")
        if self.in_flight:
            raise RuntimeError(f"cannot attach storage with {self.in_flight} transfers in flight")
        self.commits.storage = StorageTier(self.tree, self.host, self.workers, params, self.outbox.queue_storage,
                                           self.outbox.op_ids, back_up=self._backup_chain,
                                           component_hosts=self.component_hosts)

    def detach_storage_backend(self) -> None:
        """Drains in-flight work (bounded by ``ack_timeout_s``), then detaches L3."""
        if self.storage is None:
            return
        self.flush_write_through_acks()
        if self.storage.in_flight:
            raise RuntimeError(f"{self.storage.in_flight} storage ops still in flight after the ack timeout")
        self.storage.detach()
        self.commits.storage = None

    def _no_storage(self, req_id: str) -> PrefetchProgress:
        """A prefetch while no L3 is attached (its attach failed at start or rebuild, or it was detached):
        the request goes on with L1/L2, and what L3 might have held is missed as unavailable."""
        self.events.move_last_miss(MissReason.L3_UNAVAILABLE)
        return PrefetchProgress(req_id, PrefetchState.NOT_STARTED, 0, True, L3_UNAVAILABLE)

    def prefetch_from_storage(self, params: PrefetchParams) -> PrefetchProgress:
        if self.storage is None:
            return self._no_storage(params.req_id)
        progress = self.storage.prefetch(params)
        if progress.reason == L3_UNAVAILABLE:  # not asked: the match's missing tokens are L3's misses
            self.events.move_last_miss(MissReason.L3_UNAVAILABLE)
        self.submit()
        return progress

    def prefetch_matched(self, req_id: str, key: RadixKey, m: MatchResult) -> PrefetchProgress:
        """``prefetch_from_storage`` below ``m.best_match_node``, ``m`` the tree's match of ``key`` in this
        same head call (``CacheHead.begin_request``): its node and depth are known, not checked again."""
        if self.storage is None:
            return self._no_storage(req_id)
        progress = self.storage.prefetch_matched(req_id, key, self.tree.node(m.best_match_node),
                                                 m.device_hit_len + m.host_hit_len)
        if progress.reason == L3_UNAVAILABLE:
            self.events.move_last_miss(MissReason.L3_UNAVAILABLE)
        self.submit()
        return progress

    def check_prefetch_progress(self, req_id: str) -> PrefetchProgress:
        """Applies acks; under ``wait_complete``/``timeout`` blocks (bounded) as the policy allows: for the
        prefetch's existence query (``query_wait_max_s``), then for its fetch. Held backups stay held (the request waits here; its prefetch op went out when it started)."""
        if self.storage is None:
            raise RuntimeError("no storage backend attached")
        storage = self.storage
        self.submit()
        self._apply(self.workers.poll())
        storage.wait_query(req_id, storage.query_budget_s(req_id))  # its answer may start the fetch:
        self.submit()  # sent now
        for _ in range(2):  # its fetch, then (fetched below an L1-only match) its anchor's L1->L2 copy
            if storage.fetch_parked(req_id):
                self.submit(force=True)  # that copy goes now, not after the batching of backups
            budget = storage.wait_budget_s(req_id, self.config.ack_timeout_s)
            op = storage.fetch_op(req_id)
            if budget <= 0 or op is None:  # its own transfers only: never behind other write-backs
                break
            self._apply(self.workers.wait(budget, (op,)))
        return storage.progress(req_id)

    # -- sending and acks ---------------------------------------------------------------------------
    def submit(self, force: bool = False) -> int:
        """Sends what is due (all that is queued if ``force``) as one plan (``PlanOutbox.submit``)."""
        return self.outbox.submit(force)

    def check_events(self) -> int:
        """Sends what is queued and applies every ack that arrived; returns transfers completed.

        Loads go at once; backups keep batching up to ``backup_batch_pages``, but never for more than
        ``backup_hold_calls`` calls (their nodes stay locked meanwhile), nor once L1's free + evictable pages
        are fewer than the last alloc took (``note_alloc``): a next request like it would wait for them in
        its alloc, on its critical path; sent now, they are acked by then. L2->L3 backups queued by the acks
        applied here are sent before returning.
        """
        outbox = self.outbox
        if self.storage is not None and self.storage.querying:
            self.storage.advance()  # answered L3 queries queue their fetches, sent below
        if outbox.has_queued:
            force = False
            if outbox.open_backups.num_pages:
                force = outbox.hold_call() or self._l1_room() < self._last_alloc_pages
            outbox.submit(force=force)
        if not outbox.pending:
            return 0
        done = self._apply(self.workers.poll())
        if outbox.queued_storage:  # follow-ups of those acks (L2->L3 backups): sent now, not in the next
            outbox.submit()  # request's prefetch or load-back
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

    def flush_write_through_acks(self, timeout_s: float | None = None) -> int:
        """Waits (bounded by ``timeout_s``, default ``ack_timeout_s``) until every in-flight transfer is
        acked, and applies them. The manifest entries of prefixes these acks stored in L3 are written on the
        storage tier's background thread and may land after this returns: a caller that lists or deletes L3
        objects next flushes them first (``StorageTier.flush_manifest``, or a detach)."""
        if self.storage is not None:
            self.storage.resume_writes()  # a flush sends everything, held writes included
        deadline = time.monotonic() + (self.config.ack_timeout_s if timeout_s is None else timeout_s)
        done = 0
        while True:  # acks may queue follow-up work (L2->L3 after D->H, deferred backups)
            self.submit(force=True)
            done += self._apply(self.workers.poll())
            left = deadline - time.monotonic()
            if (not self.outbox.pending and not self.outbox.has_queued) or left <= 0:
                break
            if self.outbox.pending:
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
        if self.outbox.pending and self._apply(self.workers.poll()):
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
        outbox = self.outbox
        while True:  # an ack may open follow-up backups (a child's chain waits for its parent's copy)
            if outbox.open_backups.chains:
                self.submit(force=True)
            done += self._apply(self.workers.poll())
            backups = outbox.pending_ids(_D2H)
            left = deadline - time.monotonic()
            if (not backups and not outbox.open_backups.chains) or left <= 0:
                return done
            if backups:
                done += self._apply(self.workers.wait(left, backups))

    def _apply(self, acks: list[TransferAck]) -> int:
        """Records ``acks``, applies every transfer now acked by all hosts; returns the transfers applied.
        Backups deferred behind an ancestor's copy start once an ack came."""
        done = 0
        apply = self.commits.apply
        for p in self.outbox.receive(acks, self._on_ack):
            apply(p)
            done += p.num_transfers
        if done and self._deferred:
            retry, self._deferred = list(self._deferred.values()), {}
            for node in retry:
                if node.parent is not None and node.host_slots is None and node.staged_slots is None:
                    self._backup_chain(node)
            self.submit()
        return done

    def _on_ack(self, kind: OpKind, ack: TransferAck) -> None:
        self.counters.bytes_moved[kind.value] += ack.bytes_moved
        storage = self.storage
        if storage is not None and ack.ok and (kind is OpKind.PREFETCH_S2H or kind is _H2D):  # cost model samples
            p = self.outbox.pending.get(ack.op_id)
            if p is not None and p.op is not None:
                storage.observe_ack(kind, p.op.num_pages, ack.bytes_moved, ack.duration_s)
        if self.on_transfer is not None:
            self.on_transfer(kind.value, ack.duration_s, ack.host)

    def drop_host_tier(self, reason: str = "worker lost") -> int:
        """Forgets all of L2 (a host worker died or restarted: its L2 shard is gone or stale).

        In-flight transfers fail (their acks, if any ever come, are ignored), host-only nodes leave the
        tree, device+host nodes become device-only, and every slot is free again. L1 keeps serving;
        nothing is ever served from the lost L2. Returns the tokens dropped from L2.
        """
        for p in self.outbox.drop_all():
            self.commits.give_up(p, reason)
        self._deferred.clear()
        self.host.return_block()
        dropped = 0
        for pool in self.component_hosts.values():
            pool.drop_all()
        # Leaves first, so every host-only node is childless when it goes.
        for node in sorted(self.tree.iter_nodes(), key=self.tree.depth, reverse=True):
            if node.host_slots is not None:
                dropped += self.host.drop(node)
        self.host.clear_queue()
        return dropped

    def check_invariants(self) -> None:
        self.host.check_invariants()
        for pool in self.component_hosts.values():
            pool.check_invariants()
        for node in self.tree.iter_nodes():
            if node.staged_slots is not None or node.loading:
                assert node.pending is not None and node.lock_ref > 0, f"{node}: in flight but not locked"
            if node.loading:
                assert node.host_pin > 0 and node.host_slots is not None
