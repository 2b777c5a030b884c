"""In-flight transfers on the head: which nodes wait on which op, and when every host has acked.

The head numbers plans (``seq``) and ops (``op_id``), sends each plan to every host worker of the
replica, and applies an op's state change only when all hosts acked it (DESIGN.md §1); one failed host
fails the op for everyone. ``WorkerGroup`` is the head's view of the replica's workers: a list of
in-process ``HostWorker`` objects in embedded mode, Ray actor handles in the cluster.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import Protocol

import numpy as np

from hicache.cluster.tree import TreeNode
from hicache.storage import Namespace
from hicache.workers.plan import OpKind, TransferAck, TransferOp, TransferPlan
from hicache.workers.storage_exec import StorageAttachment, StorageExecutor

# A transfer's ack record before it is sent (``PendingTransfer.sent`` gives it a real one): shared immutable
# placeholders, so queuing a transfer allocates no set or list.
NOT_SENT: frozenset[int] = frozenset()  # no host acks a transfer that was not sent
NO_ERRORS: tuple[str, ...] = ()


class WorkerGroup(Protocol):
    @property
    def num_hosts(self) -> int: ...

    def submit(self, plan: TransferPlan) -> None: ...

    def poll(self) -> list[TransferAck]: ...

    def wait(self, timeout_s: float, op_ids: Collection[int] | None = None) -> list[TransferAck]: ...
    # op_ids: wait only for these ops (and the device ops before them), as HostWorker.wait

    # L3: every host keeps its own storage client over its shard of each page.
    def attach_storage(self, attachment: StorageAttachment | None) -> None: ...

    def storage_pages_per_object(self) -> int: ...

    def storage_exists(self, keys: Sequence[str], first_page: int, min_pages: int = 1) -> int: ...  # MIN over hosts
    # min_pages: exact at or above it, below it any smaller count (FsspecStorage.batch_exists)

    def storage_record_prefix(self, namespace: Namespace, tokens: np.ndarray) -> None: ...

    def storage_list_prefixes(self, namespace: Namespace) -> list: ...  # list[StoredPrefix], from host 0

    def storage_errors(self) -> dict[str, int]: ...  # errors by kind (L3_ERROR_KINDS), summed over hosts

    # The breaker of the hosts' storage clients: the worst state over hosts (BREAKER_STATES order); cheap
    # (no storage I/O), asked by the head before every L3 query.
    def storage_breaker_state(self) -> str: ...

    def storage_probe(self) -> bool: ...  # every host's client answers now (FsspecStorage.probe); off the hot path


# L3 error kinds a replica reports (``StorageStats.error_counts`` keys; metric label values).
L3_ERROR_KINDS = ("timeout", "refused", "missing_bucket", "permission", "other", "corrupt_in_transit",
                  "corrupt_at_rest", "unavailable")
BREAKER_STATES = ("closed", "half_open", "open")  # best to worst


def storage_error_counts(stats) -> dict[str, int]:  # (hicache.storage.StorageStats) -> counts by kind
    counts = stats.error_counts()
    return {k: int(counts.get(k, 0)) for k in L3_ERROR_KINDS}


def sum_error_counts(per_host) -> dict[str, int]:  # Iterable[dict[str, int]] -> the sum by kind
    total = dict.fromkeys(L3_ERROR_KINDS, 0)
    for counts in per_host:
        for k, v in counts.items():
            total[k] = total.get(k, 0) + v
    return total


def worst_breaker_state(states) -> str:  # Iterable[str] -> the worst (an open breaker on any host wins)
    return max(states, key=BREAKER_STATES.index, default="closed")


class LocalWorkerGroup:
    """Workers living in this process (embedded mode; tests)."""

    def __init__(self, workers: Sequence) -> None:  # Sequence[HostWorker]
        if not workers:
            raise ValueError("a worker group needs at least one worker")
        self.workers = list(workers)
        self._next_seq = 0  # as RayWorkerGroup's wire seq: outlives a head reset's new controller

    @property
    def num_hosts(self) -> int:
        return len(self.workers)

    def submit(self, plan: TransferPlan) -> None:
        """Sends ``plan`` under this group's own increasing ``seq``: a head ``reset`` starts a controller
        whose seqs restart at 0, while the workers' seq state lives as long as they do (until a reset
        both count alike and the plan goes as it is)."""
        seq = self._next_seq
        self._next_seq = seq + 1
        wire = plan if plan.seq == seq else TransferPlan(seq, plan.ops)
        for worker in self.workers:
            worker.submit(wire)

    def poll(self) -> list[TransferAck]:
        return [ack for worker in self.workers for ack in worker.poll()]

    def wait(self, timeout_s: float, op_ids: Collection[int] | None = None) -> list[TransferAck]:
        deadline = time.monotonic() + timeout_s
        acks = []
        for worker in self.workers:
            acks += worker.wait(max(0.0, deadline - time.monotonic()), op_ids)
        return acks

    def attach_storage(self, attachment: StorageAttachment | None) -> None:
        for worker in self.workers:
            if isinstance(worker.storage_executor, StorageExecutor):
                worker.storage_executor.close()
            worker.storage_executor = None if attachment is None else StorageExecutor(attachment, worker.host_pool)

    def _executors(self) -> list[StorageExecutor]:
        execs = [w.storage_executor for w in self.workers]
        for e in execs:  # (a loop, no generator: on the L3 miss query of every request)
            if not isinstance(e, StorageExecutor):
                raise RuntimeError("no storage backend attached")
        return execs  # type: ignore[return-value]

    def storage_pages_per_object(self) -> int:
        return self._executors()[0].storage.pages_per_object()

    def storage_exists(self, keys: Sequence[str], first_page: int, min_pages: int = 1) -> int:
        execs = self._executors()
        found = execs[0].storage.batch_exists(keys, first_page=first_page, min_pages=min_pages)
        for e in execs[1:]:  # MIN over hosts
            found = min(found, e.storage.batch_exists(keys, first_page=first_page, min_pages=min_pages))
        return found

    def storage_record_prefix(self, namespace: Namespace, tokens: np.ndarray) -> None:
        self._executors()[0].storage.record_prefix(namespace, tokens)

    def storage_list_prefixes(self, namespace: Namespace) -> list:
        return self._executors()[0].storage.list_prefixes(namespace)

    def storage_errors(self) -> dict[str, int]:
        return sum_error_counts(storage_error_counts(e.storage.stats()) for e in self._executors())

    def storage_breaker_state(self) -> str:
        return worst_breaker_state([e.storage.breaker.state.value for e in self._executors()])

    def storage_probe(self) -> bool:
        return all([e.storage.probe() for e in self._executors()])  # (a list: every host probes)


class PendingTransfer:
    """One op in flight and the nodes whose state waits on it (in root-to-leaf order).

    ``op`` is the op as sent; ``sent`` gives it its ack record (``acked_hosts``, ``errors``), shared by
    every transfer the op carries (the controller's copy batches carry many: ``num_transfers``). A plain
    slotted class: the head makes one per L3 op and per batch of L1<->L2 copies."""

    __slots__ = ("op", "seq", "nodes", "num_hosts", "acked_hosts", "errors")
    num_transfers = 1  # transfers this op carries (the requests' view: a copy batch counts its copies)

    def __init__(self, op: TransferOp | None, seq: int, nodes: list[TreeNode], num_hosts: int) -> None:
        self.op = op
        self.seq = seq
        self.nodes = nodes
        self.num_hosts = num_hosts
        self.acked_hosts: set[int] = NOT_SENT  # type: ignore[assignment]  # replaced by ``sent`` (never added to)
        self.errors: list[str] = NO_ERRORS  # type: ignore[assignment]  # replaced by ``sent``

    def sent(self, seq: int) -> None:
        """The op left in plan ``seq``: from now on hosts ack it."""
        self.seq, self.acked_hosts, self.errors = seq, set(), []

    def fail(self, reason: str) -> None:
        """Gives up on the transfer (sent or not): it completes as failed on every host."""
        self.errors = [*self.errors, reason]  # a new list: an unsent op holds the shared placeholder
        self.acked_hosts = set(range(self.num_hosts))

    @property
    def kind(self) -> OpKind:
        return self.op.kind  # type: ignore[union-attr]  # asked of L3 ops only (copy batches override it)

    @property
    def done(self) -> bool:
        return len(self.acked_hosts) == self.num_hosts

    @property
    def ok(self) -> bool:
        return self.done and not self.errors

    def on_split(self, prefix: TreeNode, suffix: TreeNode) -> None:
        """The tree split ``suffix``; ``prefix`` now carries the first part of the same transfer."""
        self.nodes.insert(self.nodes.index(suffix), prefix)

    def record(self, ack: TransferAck) -> None:
        """Records one host's ack (once per host; for every transfer sharing this record)."""
        if ack.host in self.acked_hosts:
            return  # a duplicate ack changes nothing
        self.acked_hosts.add(ack.host)
        if not ack.ok:
            self.errors.append(f"host {ack.host}: {ack.error}")
