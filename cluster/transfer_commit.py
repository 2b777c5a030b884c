"""Applying a finished transfer to the tree: the state change every host acked, or the rollback.

``HiCacheController`` hands each transfer that ``PlanOutbox.receive`` reports done (every host acked
it, or it was given up on) to ``TransferCommitter.apply``, on the head's one thread. A D->H batch
turns its chains' staged slots into L2 copies and unlocks them; an H->D batch makes its chains
device+host again and finishes its load ids; a failed copy rolls its chains back to their state
before it and frees what it reserved; an L3 op goes to the storage tier. Node states: see
``hicache.cluster.controller``.
"""

from __future__ import annotations

from hicache.cluster.component_host import ComponentHostPool
from hicache.cluster.events import CacheCounters, MissReason
from hicache.cluster.host_tier import HostTier
from hicache.cluster.inflight import PendingTransfer
from hicache.cluster.plan_outbox import CopyBatch
from hicache.cluster.storage_tier import StorageTier
from hicache.cluster.tier_events import MAX_EVENTS, TierEvents
from hicache.cluster.tree import ComponentTransfer, HiCachePhase, RadixTree
from hicache.workers.plan import OpKind

_D2H = OpKind.BACKUP_D2H


class TransferCommitter:
    """Applies finished transfers. ``loads``: load id -> the batch carrying it (queued or in flight);
    ``finished_loads``: load id -> ok, kept (bounded) until ``take_finished`` asks; ``storage``: the
    attached L3 tier (the controller sets it), which completes L3 ops and follows acked backups up;
    ``component_hosts``: the L2 ids of a hybrid tree's component pools, by component name (empty for Full
    only): a copy's component parts are committed, or their ids freed, with its Full pages."""

    def __init__(self, tree: RadixTree, host: HostTier, events: TierEvents, counters: CacheCounters,
                 component_hosts: dict[str, ComponentHostPool] | None = None) -> None:
        self.tree = tree
        self.host = host
        self.component_hosts = component_hosts or {}
        self.events = events
        self.counters = counters
        self.storage: StorageTier | None = None
        self.loads: dict[int, CopyBatch] = {}
        self.finished_loads: dict[int, bool] = {}

    def apply(self, p: PendingTransfer) -> None:
        """``p`` is done on every host (acked, or failed)."""
        if type(p) is not CopyBatch:
            self.complete_storage(p)
        elif p.errors:
            self.fail_copies(p)
        elif p.kind is _D2H:
            self.commit_backups(p)
        else:
            self.commit_loads(p)

    def give_up(self, p: PendingTransfer, reason: str) -> None:
        """Fails ``p`` (sent or not) on every host and rolls it back."""
        p.fail(reason)
        self.apply(p)

    def take_finished(self, load_id: int) -> bool | None:
        """True / False once load ``load_id`` succeeded / failed (told once); None while it runs."""
        return self.finished_loads.pop(load_id, None)

    def commit_backups(self, batch: CopyBatch) -> None:
        """Every host acked the D->H op of ``batch``: the chains' staged slots (``op.host_slots``, in chain
        order; splits since keep the order) become L2 copies with one allocator update, each chain's path
        lock is released, and each chain's leaf absorbs its parent where the tree allows
        (``RadixTree.merge_backed_up``)."""
        chains = batch.chains
        assert batch.op is not None  # acked: it was sent
        if batch.parts:
            self._commit_backup_parts(batch.chains, batch.parts)
        if batch.loose:
            self._end_loose(batch, ok=True)
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

    def commit_loads(self, batch: CopyBatch) -> None:
        """Every host acked the H->D op of ``batch``: each chain (root to leaf) is device+host again, and a
        load releases its path lock (one that holds its caller's leaves it)."""
        loaded = self.events.loaded
        unlock = self.tree.full.unlock
        maybe_push = self.host.maybe_push
        loads, finished = self.loads, self.finished_loads
        tokens = 0
        for i, (nodes, caller_lock, load_id) in enumerate(zip(batch.chains, batch.caller_locks, batch.load_ids)):
            if self.component_hosts:  # (before ``loading`` clears: the components find the chain by it)
                self._commit_load_parts(nodes[-1], batch.parts.get(i, ()) if batch.parts else ())
            for n in nodes:
                n.pending = None
                n.loading = False
                n.host_pin -= 1
                tokens += n.num_tokens
                loaded(n)
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

    def fail_copies(self, batch: CopyBatch) -> None:
        """The copies of ``batch`` failed (on some host, or given up on): every chain rolls back to its
        state before the copy and what the copy reserved is freed."""
        self.counters.transfer_failures += len(batch.chains)
        full = self.tree.full
        if batch.kind is _D2H:
            unreserve = self.host.unreserve
            for i, parts in (batch.parts or {}).items():
                for t in parts:
                    assert t.dst is not None  # reserved when queued
                    pool = self.component_hosts[t.component]
                    pool.unreserve(t.dst)
                    # (the component releases what it holds for the copy: e.g. Mamba, the state it kept in L1)
                    pool.component.commit_hicache_transfer(batch.chains[i][-1], HiCachePhase.BACKUP, [t], ok=False)
            if batch.loose:
                self._end_loose(batch, ok=False)
            for nodes in batch.chains:
                for n in nodes:
                    n.pending = None
                    assert n.staged_slots is not None  # every node of a D->H chain was staged
                    unreserve(n.staged_slots)
                    n.staged_slots = None
                full.unlock(nodes[-1])
            return
        host = self.host
        for i, (nodes, caller_lock, load_id) in enumerate(zip(batch.chains, batch.caller_locks, batch.load_ids)):
            if self.component_hosts:  # components release what their part reserved (e.g. a Mamba slot)
                self._commit_load_parts(nodes[-1], batch.parts.get(i, ()) if batch.parts else (), ok=False)
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
            del self.loads[load_id]
            self.finished_loads[load_id] = False
        self._bound_finished_loads()

    def _commit_backup_parts(self, chains: list, parts: dict[int, list[ComponentTransfer]]) -> None:
        """The component copies of acked backups: each component records its host copies (on the chain's
        nodes, split since or not), their ids become committed."""
        for i, transfers in parts.items():
            for name, pool in self.component_hosts.items():
                mine = [t for t in transfers if t.component == name]
                if mine:
                    pool.component.commit_hicache_transfer(chains[i][-1], HiCachePhase.BACKUP, mine)
                    for t in mine:
                        assert t.dst is not None  # reserved when queued
                        pool.commit(t.dst)

    def _end_loose(self, batch: CopyBatch, ok: bool) -> None:
        """The copies of ``batch.loose`` are acked (``ok``: the components record them, their ids are committed)
        or failed (ids freed, components roll back); each node's lock is released."""
        assert batch.loose is not None
        for node, parts in batch.loose:
            for t in parts:
                assert t.dst is not None  # reserved when sent
                pool = self.component_hosts[t.component]
                pool.component.commit_hicache_transfer(node, HiCachePhase.BACKUP, [t], ok=ok)
                (pool.commit if ok else pool.unreserve)(t.dst)
            self.tree.full.unlock(node)
            if ok and self.storage is not None:  # its Full pages went to L3 before: the value follows alone
                self.storage.on_host_committed([node])

    def _commit_load_parts(self, leaf, transfers, ok: bool = True) -> None:
        """A load of the chain ending at ``leaf`` acked (``ok``): every component with a host tier restores what
        it loaded and drops what it did not (e.g. SWA pages outside the window become tombstones); or failed:
        each releases what its part reserved (the chain's pages are dropped after)."""
        for name, pool in self.component_hosts.items():
            pool.component.commit_hicache_transfer(leaf, HiCachePhase.LOAD_BACK,
                                                   [t for t in transfers if t.component == name], ok)

    def complete_storage(self, p: PendingTransfer) -> None:
        """An L3 op is done on every host (acked, or failed)."""
        if p.errors:
            self.counters.transfer_failures += 1
        for n in p.nodes:
            n.pending = None
        assert p.op is not None  # L3 ops are built when queued
        if self.storage is not None and self.storage.owns(p.op.op_id):  # BACKUP_H2S, PREFETCH_S2H
            self.storage.complete(p)

    def _bound_finished_loads(self) -> None:
        finished = self.finished_loads
        while len(finished) > MAX_EVENTS:
            finished.pop(next(iter(finished)))
