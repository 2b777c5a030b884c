"""The host tiers (L2, L3) of sgl-jax on several hosts: rank 0's head plans, every rank's host worker moves its shard.

Each sgl-jax rank owns its devices' shard of the device KV pool (KV heads split over hosts, ``tp_size`` =
``nnodes``), so every rank keeps its own ``HostWorker`` over that shard (its L2 pool and its L3 client; built in
its scheduler process, ``hicache.sgl_jax.tiers.rank_worker``). The one head, on rank 0, sees them as one
``WorkerGroup`` of ``nnodes`` hosts, ``RankWorkerGroup``:

- ``submit(plan)``: the plan goes on rank 0's decision channel (``hicache.sgl_jax.ranks``) to every other rank,
  then to rank 0's own worker. A follower reads channel messages only while it waits for the answer of a cache
  call, and the head dispatches plans inside its calls, so each rank submits a plan at the same point of its
  scheduler's call sequence: between the same forwards, in the same order (the SPMD contract of
  ``HostWorker``), by construction.
- ``poll()`` / ``wait(timeout_s, op_ids)``: rank 0's worker's acks plus each follower's (a request on the channel
  that the follower answers from its waiting loop, ``serve_worker_message``). The head applies a transfer only
  when every host acked it (``TransferAck.host`` is the rank), so a failed L3 read on one host is a miss on all.
- ``attach_storage``: every rank builds its own L3 client over its shard (the attachment travels on the channel).
- L3 queries (existence, manifest, errors, breaker, probe) ask rank 0's client only: the head calls some of them
  on its background threads, which must not use the channel (one thread per ZeroMQ socket, and a follower
  answers only inside a cache call). A shard another host lacks shows as that host's failed read (an ack with
  ``ok=False``): the prefetch fails on every host and the request recomputes, never wrong KV.

Runs in rank 0's scheduler process (the group) and in each follower's (``serve_worker_message``), on the scheduler
thread.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any, Protocol

from hicache.cluster.worker_group import LocalWorkerGroup
from hicache.workers import HostWorker
from hicache.workers.plan import TransferAck, TransferPlan
from hicache.workers.storage_exec import StorageAttachment

# Channel message kinds for a follower's host worker (beside ``ranks.DECISION``).
PLAN, ATTACH, POLL, WAIT = "plan", "attach_storage", "poll", "wait"
REPLY_GRACE_S = 5.0  # a follower's own bounded wait plus the hop back, over what rank 0 waits itself


class Channel(Protocol):  # ranks.LeaderChannel
    timeout_s: float

    @property
    def followers(self) -> int: ...

    def broadcast(self, kind: str, *body: Any, log_as: str | None = None) -> None: ...

    def gather(self, kind: str, *body: Any, timeout_s: float) -> list[Any]: ...


class RankWorkerGroup(LocalWorkerGroup):
    """Rank 0's worker and every follower rank's, as one ``WorkerGroup`` of ``1 + channel.followers`` hosts."""

    def __init__(self, worker: HostWorker, channel: Channel) -> None:
        if worker.host_index != 0:
            raise ValueError(f"rank 0's worker must be host 0, got host {worker.host_index}")
        super().__init__([worker])
        self.channel = channel

    @property
    def num_hosts(self) -> int:
        return 1 + self.channel.followers

    def submit(self, plan: TransferPlan) -> None:
        """As ``LocalWorkerGroup.submit`` (the group's own seq), on every rank: the followers' copy first."""
        seq = self._next_seq
        self._next_seq = seq + 1
        wire = plan if plan.seq == seq else TransferPlan(seq, plan.ops)
        self.channel.broadcast(PLAN, wire, log_as=PLAN)
        self.workers[0].submit(wire)

    def poll(self) -> list[TransferAck]:
        acks = self.workers[0].poll()
        for theirs in self.channel.gather(POLL, timeout_s=self.channel.timeout_s):
            acks += theirs
        return acks

    def wait(self, timeout_s: float, op_ids: Collection[int] | None = None) -> list[TransferAck]:
        deadline = time.monotonic() + timeout_s
        acks = self.workers[0].wait(timeout_s, op_ids)
        left = max(0.0, deadline - time.monotonic())
        ids = None if op_ids is None else sorted(op_ids)
        for theirs in self.channel.gather(WAIT, left, ids, timeout_s=left + REPLY_GRACE_S):
            acks += theirs
        return acks

    def attach_storage(self, attachment: StorageAttachment | None) -> None:
        self.channel.broadcast(ATTACH, attachment)
        super().attach_storage(attachment)


def serve_worker_message(workers: LocalWorkerGroup, message: tuple) -> tuple[int, list[TransferAck]] | None:
    """Runs one of rank 0's requests for this follower's worker; returns the reply to send ``(number, acks)``,
    or None for a message that needs none. ``workers``: this rank's one worker (host index = its rank)."""
    kind = message[0]
    if kind == PLAN:
        workers.workers[0].submit(message[1])  # rank 0's seq: no renumbering here
        return None
    if kind == ATTACH:
        workers.attach_storage(message[1])
        return None
    if kind == POLL:
        return message[1], workers.poll()
    if kind == WAIT:
        _, number, timeout_s, op_ids = message
        return number, workers.wait(timeout_s, op_ids)
    raise ValueError(f"unknown host-worker message {kind!r} from rank 0")
