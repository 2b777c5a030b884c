"""The head's outbox: transfers queued, batched, sent as ``TransferPlan`` s, and their acks collected.

``HiCacheController`` (on the head's one thread) queues every transfer it decides here: L1<->L2 copies
join the open ``CopyBatch`` of their kind (one merged ``TransferOp`` per kind and send), L3 ops go one
op each. ``submit`` sends what is due as ONE plan to every host of the replica, in ``seq`` order;
``receive`` records the hosts' acks and hands back the transfers every host has acked (DESIGN.md §1).

Write holds: D->H backups are off a request's critical path, so they wait in the open batch until
``backup_batch_pages`` are queued, or ``hold_call`` counted ``backup_hold_calls`` of the controller's
``check_events`` calls (a count, not a time: what a run sends does not depend on scheduling), or the
controller forces them (L1 short of room, a flush). The id arrays a batch holds are the head's own and
are never written in place; the workers get them in the op.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from hicache.cluster.inflight import PendingTransfer
from hicache.cluster.policy import HiCacheConfig
from hicache.cluster.tree import ComponentTransfer, TreeNode
from hicache.cluster.tree.allocator import concat
from hicache.cluster.worker_group import WorkerGroup
from hicache.workers.plan import OpKind, PoolCopy, TransferAck, TransferOp, TransferPlan

_D2H, _H2D = OpKind.BACKUP_D2H, OpKind.LOAD_H2D


class CopyBatch(PendingTransfer):
    """The D->H backups or the H->D loads queued since the last send: ``submit`` sends them as ONE
    TransferOp (one dispatch, one ack per host for the whole batch), then a new batch opens.

    Per copy, list entries only (nothing is built per copy): its chain (root to leaf; each node's
    ``pending`` is this batch), its id arrays (the head's own int32 ids, pairs in chain order, never
    written in place), and for loads the load id and ``caller_lock`` (the load holds its caller's path
    lock, ``LoadBackParams.lock``, released by the caller, not by the ack). ``op`` is the merged op once
    sent, None before."""

    __slots__ = ("chains", "pages", "slots", "num_pages", "load_ids", "caller_locks", "parts", "loose")

    def __init__(self, kind: OpKind, num_hosts: int) -> None:
        super().__init__(None, -1, [], num_hosts, kind)
        self.chains: list[list[TreeNode]] = []
        self.pages: list[np.ndarray] = []
        self.slots: list[np.ndarray] = []
        self.num_pages = 0
        self.load_ids: list[int] = []
        self.caller_locks: list[bool] = []
        # Hybrid trees: chain index -> the same copy's component-pool transfers (None until one has some).
        self.parts: dict[int, list[ComponentTransfer]] | None = None
        # Component copies of nodes outside the chains (their Full KV is in L2 already), each node locked
        self.loose: list[tuple[TreeNode, list[ComponentTransfer]]] | None = None

    def add_parts(self, index: int, parts: list[ComponentTransfer]) -> None:
        """More component-pool copies of chain ``index`` (with their destinations), before the op is built."""
        if self.parts is None:
            self.parts = {}
        self.parts.setdefault(index, []).extend(parts)

    def add_loose(self, node: TreeNode, parts: list[ComponentTransfer]) -> None:
        """Component copies of ``node`` without Full pages (its Full KV is in L2), before the op is built."""
        if self.loose is None:
            self.loose = []
        self.loose.append((node, parts))

    @property
    def num_transfers(self) -> int:  # type: ignore[override]  # a class constant in PendingTransfer
        return len(self.chains)

    def add(self, chain: list[TreeNode], pages: np.ndarray, slots: np.ndarray,
            parts: list[ComponentTransfer] | None = None) -> int:
        """Queues the copy of ``chain`` (``pages[i] <-> slots[i]``; ``parts``: its component pools' copies,
        with their destinations); returns the pages now queued."""
        if parts:
            self.add_parts(len(self.chains), parts)
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
        pools = self._pool_copies() if self.parts or self.loose else ()
        if len(pages) == 1:
            return TransferOp.copy_op(op_id, self.kind, pages[0], slots[0], pools)
        return TransferOp.copy_op(op_id, self.kind, concat(pages), concat(slots), pools)

    def _pool_copies(self) -> tuple[PoolCopy, ...]:
        """One ``PoolCopy`` per component pool: every part of the batch for it, in queue order."""
        by_pool: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        backup = self.kind is _D2H
        groups = list((self.parts or {}).values()) + [parts for _, parts in self.loose or ()]
        for transfers in groups:
            for t in transfers:
                assert t.dst is not None  # the controller gives every part its destination
                device, host = by_pool.setdefault(t.component, ([], []))
                device.append(t.src if backup else t.dst)
                host.append(t.dst if backup else t.src)
        return tuple(PoolCopy(name, concat(d), concat(h)) for name, (d, h) in by_pool.items())

    def on_split(self, prefix: TreeNode, suffix: TreeNode) -> None:
        for chain in self.chains:
            for i, n in enumerate(chain):
                if n is suffix:
                    chain.insert(i, prefix)
                    return


class PlanOutbox:
    """Queued and sent transfers of one controller, and the plan and op numbering they go out under.

    ``send_due`` is True while ``submit`` (not forced) would send: loads or L3 ops queued, or a full
    backup batch. The head tests it after every call before calling ``submit``: most calls queue nothing
    that must go."""

    def __init__(self, workers: WorkerGroup, config: HiCacheConfig) -> None:
        self.workers = workers
        self.num_hosts = workers.num_hosts
        self.pending: dict[int, PendingTransfer] = {}  # sent op id -> its transfers (an L3 op or a copy batch)
        # Built, not yet sent, by kind (``submit`` sends each kind its own way; no filtering per send).
        self.open_loads = CopyBatch(_H2D, self.num_hosts)  # H->D: one op, sent at the next submit
        self.open_backups = CopyBatch(_D2H, self.num_hosts)  # D->H: one op, held while batching
        self.queued_storage: list[PendingTransfer] = []  # L3 ops: one op each, sent at the next submit
        self.send_due = False
        self.op_ids = itertools.count()  # op ids and load ids (the storage tier numbers its ops here too)
        self._seq = itertools.count()
        self._batch_pages = config.backup_batch_pages
        self._hold_calls = config.backup_hold_calls
        self._held_calls = 0  # hold_call calls since the oldest queued backup was queued
        # Called with the backup batch right before its op is built (the controller's send-time component copies)
        self.before_backup_send: Callable[[CopyBatch], None] | None = None

    # -- queueing --------------------------------------------------------------------------------------
    def queue_storage(self, op: TransferOp, nodes: list[TreeNode]) -> PendingTransfer:
        """Queues the L3 op ``op`` (the storage tier's callback) for the nodes waiting on it."""
        pending = PendingTransfer(op, -1, nodes, self.num_hosts)
        for n in nodes:
            n.pending = pending
        self.queued_storage.append(pending)
        self.send_due = True
        return pending

    def queue_backup(self, chain: list[TreeNode], pages: np.ndarray, slots: np.ndarray,
                     parts: list[ComponentTransfer] | None = None) -> None:
        """Adds a D->H copy to the open batch; it is due once the batch holds ``backup_batch_pages``."""
        batch = self.open_backups
        if not batch.num_pages:
            self._held_calls = 0
        if batch.add(chain, pages, slots, parts) >= self._batch_pages:
            self.send_due = True

    def queue_load(self, chain: list[TreeNode], pages: np.ndarray, slots: np.ndarray, load_id: int,
                   caller_lock: bool, parts: list[ComponentTransfer] | None = None) -> CopyBatch:
        """Adds an H->D copy to the open batch (due at once: a request waits for it); returns the batch."""
        batch = self.open_loads
        batch.add(chain, pages, slots, parts)
        batch.load_ids.append(load_id)
        batch.caller_locks.append(caller_lock)
        self.send_due = True
        return batch

    def hold_call(self) -> bool:
        """Counts one ``check_events`` call while backups are held; True once they waited
        ``backup_hold_calls`` calls."""
        self._held_calls += 1
        return self._held_calls >= self._hold_calls

    @property
    def has_queued(self) -> bool:
        return bool(self.open_loads.chains or self.open_backups.chains or self.queued_storage)

    @property
    def in_flight(self) -> int:
        """Transfers queued or sent and not yet acked by every host."""
        queued = len(self.open_loads.chains) + len(self.open_backups.chains) + len(self.queued_storage)
        return sum(p.num_transfers for p in self.pending.values()) + queued

    def pending_ids(self, kind: OpKind) -> list[int]:
        """Ids of the sent ops of ``kind`` not yet acked by every host."""
        return [op_id for op_id, p in self.pending.items() if p.kind is kind]

    # -- sending and acks ------------------------------------------------------------------------------
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
        loads, storage, backups = self.open_loads, self.queued_storage, self.open_backups
        # Loads / storage ops go now; held backups keep batching unless full or forced: a D2H dispatch
        # never rides on the plan of a request's load-back or L3 prefetch (its TTFT).
        send_backups = bool(backups.chains) and (force or backups.num_pages >= self._batch_pages)
        if send_backups:
            self.open_backups = CopyBatch(_D2H, self.num_hosts)
        elif not (loads.chains or storage):
            return 0  # forced with nothing queued
        # What stays queued now is a backup batch below its size: nothing is due until more is queued.
        self.send_due = False
        seq = next(self._seq)
        sent: list[PendingTransfer] = storage  # queue order, one op each
        if storage:
            self.queued_storage = []
        if loads.chains:
            self.open_loads = CopyBatch(_H2D, self.num_hosts)
            loads.op = loads.merged_op(next(self.op_ids))
            sent = [*sent, loads]
        if send_backups:
            if self.before_backup_send is not None:
                self.before_backup_send(backups)
            backups.op = backups.merged_op(next(self.op_ids))
            sent = [*sent, backups]
        pending = self.pending
        ops: list[TransferOp] = []
        transfers = 0
        for p in sent:
            op = p.op
            assert op is not None  # built above (copy batches) or when queued (L3 ops)
            p.sent(seq)
            pending[op.op_id] = p
            ops.append(op)
            transfers += p.num_transfers
        self.workers.submit(TransferPlan(seq, tuple(ops)))
        return transfers

    def receive(self, acks: list[TransferAck], on_ack: Callable[[OpKind, TransferAck], None]) -> list[PendingTransfer]:
        """Records ``acks`` (``on_ack`` once per host and op; duplicates and acks of transfers given up on
        are dropped) and returns the transfers every host has now acked, no longer pending."""
        done: list[PendingTransfer] = []
        pending = self.pending
        for ack in acks:
            p = pending.get(ack.op_id)
            if p is None:
                continue  # an ack for a transfer already given up on
            if ack.host not in p.acked_hosts:
                on_ack(p.kind, ack)
                p.record(ack)
            if len(p.acked_hosts) == p.num_hosts:
                del pending[ack.op_id]
                done.append(p)
        return done

    def drop_all(self) -> list[PendingTransfer]:
        """Forgets every sent and queued transfer (a lost host worker) and returns them, sent first."""
        queued = self.queued_storage + [b for b in (self.open_loads, self.open_backups) if b.chains]
        self.queued_storage = []
        self.open_loads = CopyBatch(_H2D, self.num_hosts)
        self.open_backups = CopyBatch(_D2H, self.num_hosts)
        self.send_due = False
        dropped = [*self.pending.values(), *queued]
        self.pending.clear()
        return dropped
