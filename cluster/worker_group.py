"""The head's view of one replica's host workers: ``WorkerGroup``, and ``LocalWorkerGroup`` in process.

The head (on its one thread) sends every ``TransferPlan`` to every host worker of the replica through
its ``WorkerGroup`` and collects their acks; it also asks them about L3 (each host keeps its own storage
client over its shard of each page). ``LocalWorkerGroup`` holds in-process ``HostWorker`` objects
(embedded mode, tests); ``hicache.cluster.ray_workers.RayWorkerGroup`` holds Ray actor handles.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import Protocol

import numpy as np

from hicache.storage import FsspecStorage, ModelFingerprint, Namespace
from hicache.workers.plan import TransferAck, TransferPlan
from hicache.workers.storage_exec import OpenStorage, StorageAttachment, StorageExecutor


class WorkerGroup(Protocol):
    @property
    def num_hosts(self) -> int: ...

    def submit(self, plan: TransferPlan) -> None: ...

    def poll(self) -> list[TransferAck]: ...

    def wait(self, timeout_s: float, op_ids: Collection[int] | None = None) -> list[TransferAck]: ...
    # op_ids: wait only for these ops (and earlier ops of their kind), as HostWorker.wait

    # L3: every host keeps its own storage client over its shard of each page.
    def attach_storage(self, attachment: StorageAttachment | None) -> None: ...

    def storage_pages_per_object(self) -> int: ...

    # Every host's storage client is in this process and does its I/O on the calling thread (a local
    # disk): the head may ask it on its own thread, which costs less than handing the call to another.
    @property
    def storage_local(self) -> bool: ...

    def storage_exists(self, keys: Sequence[str], first_page: int, min_pages: int = 1,
                       fingerprint: ModelFingerprint | None = None, chunk_start_key: str | None = None) -> int: ...
    # MIN over hosts. min_pages: exact at or above it, below it any smaller count; fingerprint: pages stored
    # under another model fingerprint (a miss's diagnostic, never loaded); chunk_start_key: the key of the
    # first page of first_page's chunk where it lies inside one (FsspecStorage.batch_exists)

    # Per key, whether every host holds the one-page object of component pool ``pool`` ("mamba", "swa") it names
    # (AND over hosts; storage trouble is False).
    def storage_exists_each(self, pool: str, keys: Sequence[str]) -> list[bool]: ...

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


def component_host_pools(worker) -> dict:  # (HostWorker) -> its component pools' L2 by name
    """The L2 pools of a worker's component pools (a hybrid model's), which its storage executor registers."""
    return {name: host for name, (_, host, _) in getattr(worker, "pools", {}).items()}


class LocalWorkerGroup:
    """Workers living in this process (embedded mode; tests). ``open_storage``: how each host opens its L3
    client (default ``FsspecStorage``; a replay passes one that gates visibility by its virtual clock)."""

    def __init__(self, workers: Sequence, open_storage: OpenStorage | None = None) -> None:  # Sequence[HostWorker]
        if not workers:
            raise ValueError("a worker group needs at least one worker")
        self.workers = list(workers)
        self._open_storage: OpenStorage = FsspecStorage if open_storage is None else open_storage
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
            worker.storage_executor = (None if attachment is None else StorageExecutor(
                attachment, worker.host_pool, self._open_storage, component_host_pools(worker)))

    def _executors(self) -> list[StorageExecutor]:
        execs = [w.storage_executor for w in self.workers]
        for e in execs:  # (a loop, no generator: on the L3 miss query of every request)
            if not isinstance(e, StorageExecutor):
                raise RuntimeError("no storage backend attached")
        return execs

    def storage_pages_per_object(self) -> int:
        return self._executors()[0].storage.pages_per_object()

    @property
    def storage_local(self) -> bool:
        return all(e.storage.runs_inline for e in self._executors())

    def storage_exists(self, keys: Sequence[str], first_page: int, min_pages: int = 1,
                       fingerprint: ModelFingerprint | None = None, chunk_start_key: str | None = None) -> int:
        execs = self._executors()
        found = execs[0].storage.batch_exists(keys, first_page=first_page, min_pages=min_pages, fingerprint=fingerprint,
                                              chunk_start_key=chunk_start_key)
        for e in execs[1:]:  # MIN over hosts
            found = min(found, e.storage.batch_exists(keys, first_page=first_page, min_pages=min_pages,
                                                      fingerprint=fingerprint, chunk_start_key=chunk_start_key))
        return found

    def storage_exists_each(self, pool: str, keys: Sequence[str]) -> list[bool]:
        flags = [True] * len(keys)
        for e in self._executors():  # AND over hosts
            kind = e.parts[pool][2] if pool in e.parts else None
            if kind is None:
                return [False] * len(keys)
            flags = [a and b for a, b in zip(flags, e.storage.exists_each(keys, pool=kind))]
        return flags

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

