"""sgl-jax on several hosts with one hicache head: rank 0 calls the head, every other rank applies its answers.

sgl-jax runs one scheduler process per host (``nnodes``); all of them run the same iteration at once (the
forward is one SPMD program over every host's devices, sharded on KV heads), so every scheduler makes the
same prefix-cache and allocator calls in the same order, and each must get the same answer: the same page
ids, hit lengths, node ids, evictions. sgl-jax's own HiCache keeps one tree per host and hopes replaying the
same request list keeps them equal. Here there is one tree, in the head, and only rank 0 calls it:

- **Rank 0** (the one that receives the requests and publishes them to the others) holds the head (embedded
  in its scheduler process) behind ``LeaderTransport``: every call or step runs on the head, and the call
  with its result (or error) goes to every other rank, in order, before rank 0 uses the result.
- **Ranks >= 1** hold no head and no tree: their ``CacheClient`` sits on ``FollowerTransport``, which answers
  each call with the next result rank 0 sent, after checking that rank 0 made the very same call (the same
  method and arguments). A rank whose calls differ stops with an error naming both calls, instead of running
  the forward on other pages; a leader that is gone stops it after ``decision_timeout_s``.

Why rank 0 broadcasting and not every rank calling the head: the head's answers depend on the order of the
calls (allocations, evictions, LRU clocks), so N ranks calling it would need the head to merge N copies of
every call into one (wait for all of them, a cross-host barrier per call) and would multiply its load by N;
with one caller the head sees one order, and the other ranks get its answers by construction. It also follows
sgl-jax's own split: rank 0 already receives every request and publishes it. The decisions travel on their own
ZeroMQ channel (sgl-jax's dependency): rank 0 binds a ROUTER at the host of ``dist_init_addr``, port
``+ DECISION_PORT_OFFSET`` (sgl-jax uses ``+1..+6``), each other rank connects a DEALER and says hello, and rank
0 waits for all of them at start (bounded).

L1 pages are the device pool's global page ids, identical on every host. The host tiers (L2, L3) are per host:
each rank's ``HostWorker`` moves its own shard, and the head's transfer plans reach the followers' workers on the
same channel (``hicache.sgl_jax.rank_workers``), so every rank runs the same L2 writes, loads and L3 fetches at
the same point of its call sequence, and the head applies a transfer once every rank acked it.

A repeat of a pure read (``REPEATABLE_READS``: the sizes sgl-jax asks in every scheduler iteration, idle ones
included) with no other call between is answered from the last answer on every rank, and nothing is sent: the
rule depends only on the call sequence, which the ranks share, and the head's state changes only in calls.

``decision_log`` (a folder, for tests and debugging): each rank appends one line per decision and per transfer
plan (sequence number, method or ``plan``, a digest of what rank 0 sent) to ``rank<i>.log`` there, so two
ranks' logs can be compared.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
import time
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from hicache.cluster import CacheClient, CacheHead
from hicache.cluster.client import DoneStep, EmbeddedTransport
from hicache.cluster.head import Call, CallResult, Method
from hicache.cluster.worker_group import LocalWorkerGroup
from hicache.sgl_jax.rank_workers import PLAN, RankWorkerGroup, serve_worker_message

DECISION_PORT_OFFSET = 7  # past sgl-jax's own ports (dist_init_addr's port + 1 .. + 6)
HELLO = b"hicache-follower"
DECISION = "decision"  # a call and the head's answer (the other kinds: ``rank_workers``)
# Pure reads of the head's state: a repeat of the same call with no other call between gets the same answer,
# which no rank sends or waits for (sgl-jax asks the sizes several times in every scheduler iteration).
REPEATABLE_READS = frozenset({Method.STATS, Method.CACHE_STATS})


def decision_address(dist_init_addr: str) -> tuple[str, int]:
    """The host and port of rank 0's decision channel for sgl-jax's ``dist_init_addr`` (``host:port``)."""
    host, sep, port = dist_init_addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"dist_init_addr must be host:port, got {dist_init_addr!r}")
    return host, int(port) + DECISION_PORT_OFFSET


class _DecisionLog:
    """Appends ``seq method digest`` lines to ``folder/rank<rank>.log`` (no folder: nothing)."""

    def __init__(self, folder: str | None, rank: int, role: str) -> None:
        self.seq = 0
        self._path = None if folder is None else Path(folder) / f"rank{rank}.log"
        if self._path is not None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._path.write_text(f"# rank {rank}: {role}\n")

    def record(self, method: str, payload: bytes) -> None:
        self.seq += 1
        if self._path is not None:
            with open(self._path, "a") as f:
                f.write(f"{self.seq} {method} {hashlib.sha256(payload).hexdigest()[:16]}\n")


def canonical(obj: Any) -> Any:
    """``obj`` as plain comparable values (dataclasses by field, arrays by dtype, shape and bytes): two calls are the
    same call when these are equal (pickles are not comparable: the same array can pickle differently)."""
    if isinstance(obj, np.ndarray):
        return ("ndarray", obj.dtype.str, obj.shape, np.ascontiguousarray(obj).tobytes())
    if isinstance(obj, Enum):
        return (type(obj).__name__, obj.value)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj).__name__, *(canonical(getattr(obj, f.name)) for f in dataclasses.fields(obj)))
    if isinstance(obj, (list, tuple)):
        return tuple(canonical(x) for x in obj)
    if isinstance(obj, dict):
        return tuple(sorted((repr(k), canonical(v)) for k, v in obj.items()))
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _method(calls: Call | Sequence[Call]) -> str:
    if isinstance(calls, Call):
        return calls.method.value
    return "step:" + ",".join(c.method.value for c in calls)


class LeaderChannel:
    """Rank 0's end of the channel: a ROUTER bound at ``address`` that waits (bounded) for ``followers`` hellos,
    then sends every message to every follower, in order, and collects their replies (``gather``)."""

    def __init__(self, address: tuple[str, int], followers: int, *, timeout_s: float,
                 log_folder: str | None = None) -> None:
        if followers < 1:
            raise ValueError(f"a leader needs >= 1 follower, got {followers}")
        self.timeout_s = timeout_s
        self._address = address
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.SNDHWM, 0)  # never drop a decision: the followers read every one
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(f"tcp://{address[0]}:{address[1]}")
        self._followers: list[bytes] = []
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._asked = 0  # sequence number of the last ``gather`` (a late reply to an earlier one is dropped)
        while len(self._followers) < followers:
            if not self._poller.poll(int(timeout_s * 1000)):
                self.close()
                raise TimeoutError(f"hicache: {len(self._followers)} of {followers} sgl-jax ranks connected to the "
                                   f"decision channel at {address[0]}:{address[1]} within {timeout_s} s")
            identity, hello = self._socket.recv_multipart()
            if hello == HELLO:
                self._followers.append(identity)
        for identity in self._followers:
            self._socket.send_multipart([identity, b"ready"])
        self.log = _DecisionLog(log_folder, 0, f"leader (head) of {followers} follower(s)")

    @property
    def followers(self) -> int:
        return len(self._followers)

    def broadcast(self, kind: str, *body: Any, log_as: str | None = None) -> None:
        """Sends the message ``(kind, *body)`` to every follower; ``log_as``: logged under that name first (no
        follower logs a message rank 0 has not)."""
        payload = pickle.dumps((kind, *body))
        if log_as is not None:
            self.log.record(log_as, payload)
        for identity in self._followers:
            self._socket.send_multipart([identity, payload])

    def gather(self, kind: str, *body: Any, timeout_s: float) -> list[Any]:
        """Sends ``(kind, number, *body)`` to every follower and returns each one's reply body; TimeoutError
        when some follower has not replied within ``timeout_s`` (it is gone or stuck)."""
        self._asked += 1
        number = self._asked
        self.broadcast(kind, number, *body)
        replies: dict[bytes, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) < len(self._followers):
            left_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            if not self._poller.poll(left_ms):
                raise TimeoutError(f"hicache: {len(self._followers) - len(replies)} sgl-jax rank(s) did not answer "
                                   f"{kind!r} on {self._address[0]}:{self._address[1]} within {timeout_s} s")
            identity, payload = self._socket.recv_multipart()
            answered, value = pickle.loads(payload)
            if answered == number:
                replies[identity] = value
        return [replies[i] for i in self._followers]

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


class FollowerChannel:
    """A rank >= 1's end: a DEALER connected to rank 0's channel (hello, then ``ready``, bounded)."""

    def __init__(self, address: tuple[str, int], rank: int, *, timeout_s: float,
                 log_folder: str | None = None) -> None:
        self.rank = rank
        self._timeout_s = timeout_s
        self._address = address
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(f"tcp://{address[0]}:{address[1]}")
        self._socket.send(HELLO)
        if self._receive() != b"ready":
            raise RuntimeError(f"hicache rank {rank}: unexpected greeting from rank 0 at {address}")
        self.log = _DecisionLog(log_folder, rank, "follower of rank 0 (no head)")

    def _receive(self) -> bytes:
        try:
            return self._socket.recv()
        except zmq.Again:
            raise TimeoutError(f"hicache rank {self.rank}: no decision from rank 0 at {self._address[0]}:"
                               f"{self._address[1]} within {self._timeout_s} s (is rank 0 gone?)") from None

    def receive(self) -> tuple[bytes, tuple]:
        """The next message from rank 0: its bytes (what the logs digest) and the message."""
        payload = self._receive()
        return payload, pickle.loads(payload)

    def reply(self, number: int, value: Any) -> None:
        self._socket.send(pickle.dumps((number, value)))

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


class LeaderTransport:
    """Rank 0: the head's transport that sends every call and its answer to the other ranks (module docstring)."""

    def __init__(self, inner: EmbeddedTransport, channel: LeaderChannel) -> None:
        self.inner = inner
        self.head = inner.head
        self.channel = channel
        self._last_read: tuple[Any, Any] | None = None  # (canonical call, answer) of the last repeated read

    def _run(self, calls: Any, run: Any) -> Any:
        """``run(calls)`` on the head; its answer, or its error, goes to every follower before the caller gets it."""
        try:
            value = run(calls)
        except Exception as e:
            self.channel.broadcast(DECISION, calls, False, e, log_as=_method(calls))
            raise
        self.channel.broadcast(DECISION, calls, True, value, log_as=_method(calls))
        return value

    def call(self, call: Call) -> Any:
        key = canonical(call) if call.method in REPEATABLE_READS else None
        last, self._last_read = self._last_read, None
        if key is not None and last is not None and last[0] == key:
            self._last_read = last
            return last[1]  # nothing ran on the head since: the followers reuse it too
        value = self._run(call, self.inner.call)
        if key is not None:
            self._last_read = (key, value)
        return value

    def step(self, calls: Sequence[Call]) -> list[CallResult]:
        self._last_read = None
        return self._run(list(calls), self.inner.step)

    def submit(self, calls: Sequence[Call]) -> DoneStep:
        return DoneStep(self.step(calls))

    def close(self) -> None:
        self.channel.close()


class RankDivergedError(RuntimeError):
    """This rank made another cache call than rank 0 at the same point: their schedulers diverged."""


class FollowerTransport:
    """Ranks >= 1: answers each call with rank 0's answer to the same call (module docstring); holds no head.
    While it waits for a decision it also runs what rank 0's head asked of this rank's host worker
    (``serve_worker_message``; ``workers``: None with L1 only)."""

    def __init__(self, channel: FollowerChannel, workers: LocalWorkerGroup | None = None) -> None:
        self.channel = channel
        self.rank = channel.rank
        self.workers = workers
        self._last_read: tuple[Any, Any] | None = None

    def _answer(self, calls: Call | Sequence[Call]) -> tuple[bool, Any]:
        log = self.channel.log
        while True:
            payload, message = self.channel.receive()
            if message[0] == DECISION:
                break
            if self.workers is None:
                raise RuntimeError(f"hicache rank {self.rank}: rank 0 sent {message[0]!r} for a host worker, "
                                   "and this rank has none (L1 only): the ranks were started with other options")
            if message[0] == PLAN:
                log.record(PLAN, payload)
            reply = serve_worker_message(self.workers, message)
            if reply is not None:
                self.channel.reply(*reply)
        _, leader_calls, ok, value = message
        if canonical(leader_calls) != canonical(calls):
            raise RankDivergedError(f"hicache rank {self.rank} made call {calls!r} where rank 0 made "
                                    f"{leader_calls!r} (decision {log.seq + 1})")
        log.record(_method(calls), payload)
        return ok, value

    def call(self, call: Call) -> Any:
        key = canonical(call) if call.method in REPEATABLE_READS else None
        last, self._last_read = self._last_read, None
        if key is not None and last is not None and last[0] == key:
            self._last_read = last
            return last[1]  # rank 0 sent nothing for it: the same rule (LeaderTransport.call)
        ok, value = self._answer(call)
        if not ok:
            raise value
        if key is not None:
            self._last_read = (key, value)
        return value

    def step(self, calls: Sequence[Call]) -> list[CallResult]:
        self._last_read = None
        ok, value = self._answer(list(calls))
        if not ok:
            raise value
        return value

    def submit(self, calls: Sequence[Call]) -> DoneStep:
        return DoneStep(self.step(calls))

    def close(self) -> None:
        self.channel.close()


def multi_host_client(options: Any, server_args: Any, *, page_size: int, num_pages: int,
                      worker: Any = None, attach: Any = None) -> CacheClient:
    """This rank's ``CacheClient`` on sgl-jax's ``nnodes`` > 1 hosts: rank 0's over the head (created here, in
    rank 0's scheduler process only), the others' over rank 0's decisions. ``worker``: this rank's
    ``HostWorker`` (host index = rank) when the head has a host tier, which rank 0's head drives on every rank
    (``rank_workers``); ``attach(head)``: rank 0 attaches L3 with it. Blocks until every rank is connected
    (at most ``options.decision_timeout_s``)."""
    address = decision_address(server_args.dist_init_addr)
    timeout, log = float(options.decision_timeout_s), options.decision_log
    transport: LeaderTransport | FollowerTransport
    if server_args.node_rank == 0:
        channel = LeaderChannel(address, server_args.nnodes - 1, timeout_s=timeout, log_folder=log)
        try:
            group = None if worker is None else RankWorkerGroup(worker, channel)
            head = CacheHead(options.head_config(page_size=page_size, num_pages=num_pages), group)
            if attach is not None:
                attach(head)
        except BaseException:
            channel.close()
            raise
        transport = LeaderTransport(EmbeddedTransport(head), channel)
    else:
        channel_f = FollowerChannel(address, server_args.node_rank, timeout_s=timeout, log_folder=log)
        transport = FollowerTransport(channel_f, None if worker is None else LocalWorkerGroup([worker]))
    return CacheClient(transport, page_size)
