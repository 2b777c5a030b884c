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

Only the control plane crosses hosts. L1 pages are the device pool's global page ids, identical on every host;
the host tiers (L2/L3) would need each host's worker to run the head's transfer plans on its own shard, which
this channel does not carry yet: several hosts are served with L1 only (``options.check_server_args``).

``decision_log`` (a folder, for tests and debugging): each rank appends one line per decision (sequence
number, method, a digest of call and result) to ``rank<i>.log`` there, so two ranks' logs can be compared.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from hicache.cluster import CacheClient, CacheHead
from hicache.cluster.client import DoneStep, EmbeddedTransport
from hicache.cluster.head import Call, CallResult

DECISION_PORT_OFFSET = 7  # past sgl-jax's own ports (dist_init_addr's port + 1 .. + 6)
HELLO = b"hicache-follower"


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


class _Channel:
    """What both ends share: a ZeroMQ socket, and ``submit`` as a step that has run when it returns."""

    _context: zmq.Context
    _socket: zmq.Socket

    def step(self, calls: Sequence[Call]) -> list[CallResult]:
        raise NotImplementedError

    def submit(self, calls: Sequence[Call]) -> DoneStep:
        return DoneStep(self.step(calls))

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


class LeaderTransport(_Channel):
    """Rank 0: the head's transport that sends every call and its answer to the other ranks (module docstring)."""

    def __init__(self, inner: EmbeddedTransport, address: tuple[str, int], followers: int, *,
                 timeout_s: float, log_folder: str | None = None) -> None:
        if followers < 1:
            raise ValueError(f"a leader needs >= 1 follower, got {followers}")
        self.inner = inner
        self.head = inner.head
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.SNDHWM, 0)  # never drop a decision: the followers read every one
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(f"tcp://{address[0]}:{address[1]}")
        self._followers: list[bytes] = []
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while len(self._followers) < followers:
            if not poller.poll(int(timeout_s * 1000)):
                self.close()
                raise TimeoutError(f"hicache: {len(self._followers)} of {followers} sgl-jax ranks connected to the "
                                   f"decision channel at {address[0]}:{address[1]} within {timeout_s} s")
            identity, hello = self._socket.recv_multipart()
            if hello == HELLO:
                self._followers.append(identity)
        for identity in self._followers:
            self._socket.send_multipart([identity, b"ready"])
        self._log = _DecisionLog(log_folder, 0, f"leader (head) of {followers} follower(s)")

    def _publish(self, calls: Call | Sequence[Call], ok: bool, value: Any) -> None:
        payload = pickle.dumps((calls, ok, value))
        self._log.record(_method(calls), payload)  # before sending: no follower logs a decision rank 0 has not
        for identity in self._followers:
            self._socket.send_multipart([identity, payload])

    def _run(self, calls: Any, run: Any) -> Any:
        """``run(calls)`` on the head; its answer, or its error, goes to every follower before the caller gets it."""
        try:
            value = run(calls)
        except Exception as e:
            self._publish(calls, False, e)
            raise
        self._publish(calls, True, value)
        return value

    def call(self, call: Call) -> Any:
        return self._run(call, self.inner.call)

    def step(self, calls: Sequence[Call]) -> list[CallResult]:
        return self._run(list(calls), self.inner.step)



class RankDivergedError(RuntimeError):
    """This rank made another cache call than rank 0 at the same point: their schedulers diverged."""


class FollowerTransport(_Channel):
    """Ranks >= 1: answers each call with rank 0's answer to the same call (module docstring); holds no head."""

    def __init__(self, address: tuple[str, int], rank: int, *, timeout_s: float,
                 log_folder: str | None = None) -> None:
        self.rank = rank
        self._timeout_s = timeout_s
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(f"tcp://{address[0]}:{address[1]}")
        self._socket.send(HELLO)
        self._address = address
        if self._receive() != b"ready":
            raise RuntimeError(f"hicache rank {rank}: unexpected greeting from rank 0 at {address}")
        self._log = _DecisionLog(log_folder, rank, "follower of rank 0 (no head)")

    def _receive(self) -> bytes:
        try:
            return self._socket.recv()
        except zmq.Again:
            raise TimeoutError(f"hicache rank {self.rank}: no decision from rank 0 at {self._address[0]}:"
                               f"{self._address[1]} within {self._timeout_s} s (is rank 0 gone?)") from None

    def _answer(self, calls: Call | Sequence[Call]) -> tuple[bool, Any]:
        payload = self._receive()
        leader_calls, ok, value = pickle.loads(payload)
        if canonical(leader_calls) != canonical(calls):
            raise RankDivergedError(f"hicache rank {self.rank} made call {calls!r} where rank 0 made "
                                    f"{leader_calls!r} (decision {self._log.seq + 1})")
        self._log.record(_method(calls), payload)
        return ok, value

    def call(self, call: Call) -> Any:
        ok, value = self._answer(call)
        if not ok:
            raise value
        return value

    def step(self, calls: Sequence[Call]) -> list[CallResult]:
        ok, value = self._answer(list(calls))
        if not ok:
            raise value
        return value



def multi_host_client(options: Any, server_args: Any, *, page_size: int, num_pages: int) -> CacheClient:
    """This rank's ``CacheClient`` on sgl-jax's ``nnodes`` > 1 hosts: rank 0's over the head (created here, in
    rank 0's scheduler process only), the others' over rank 0's decisions. Blocks until every rank is connected
    (at most ``options.decision_timeout_s``)."""
    address = decision_address(server_args.dist_init_addr)
    timeout, log = float(options.decision_timeout_s), options.decision_log
    transport: LeaderTransport | FollowerTransport
    if server_args.node_rank == 0:
        head = CacheHead(options.head_config(page_size=page_size, num_pages=num_pages))
        transport = LeaderTransport(EmbeddedTransport(head), address, server_args.nnodes - 1, timeout_s=timeout,
                                    log_folder=log)
    else:
        transport = FollowerTransport(address, server_args.node_rank, timeout_s=timeout, log_folder=log)
    return CacheClient(transport, page_size)
