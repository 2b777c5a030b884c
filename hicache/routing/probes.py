"""Ways a router reaches a replica's head: in process (``HeadProbe``: a ``CacheClient`` plus the
replica's load) and over a loopback channel (``ProbeServer`` in the replica, ``ChannelProbe`` in the
router), for a replica that runs its head in its own process (a Ray Serve replica).

``ProbeServer`` is owned by the replica: one ``StepChannelServer`` (``hicache.cluster.step_channel``:
loopback only, a random token, bounded waits) whose connection threads run ``answer(query)``; the
replica serializes that with its own head calls (``answer`` takes its lock). ``ChannelProbe`` is owned by
one router (one connection, reopened after a failure); its waits are bounded by the router's deadline.
Frames are pickles of ``RouteQuery`` / ``ReplicaView`` (authenticated by the channel token).
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass

from hicache.cluster.client import CacheClient
from hicache.cluster.route_query import RouteQuery
from hicache.cluster.step_channel import ChannelAddress, ChannelClosedError, StepChannel, StepChannelServer
from hicache.routing.router import ReplicaLoad, ReplicaView


class HeadProbe:
    """A replica whose head this process reaches through ``client`` (embedded or Ray); ``load()`` gives
    its serving loop's queued and running requests."""

    def __init__(self, name: str, client: CacheClient, load: Callable[[], ReplicaLoad]) -> None:
        self.name = name
        self.client = client
        self.load = load
        self._busy = threading.Lock()  # a client is not thread-safe: one probe at a time

    def probe(self, query: RouteQuery) -> ReplicaView:
        if not self._busy.acquire(blocking=False):
            raise TimeoutError(f"replica {self.name}: the previous probe is still waiting")
        try:
            return ReplicaView(self.client.route_query(query), self.load())
        finally:
            self._busy.release()


HOLD_MAX_S = 60.0  # a held probe answers after this at the latest


@dataclass(frozen=True)
class HoldProbes:
    """Test hook (a ``ProbeServer`` with ``test_hooks``): hold every probe's answer until released, as a
    head busy with a long step would."""

    hold: bool


class ProbeServer:
    """Answers routers' probes for one replica: ``answer(query) -> ReplicaView`` on a loopback channel.
    ``test_hooks``: also accept ``HoldProbes`` frames (off in production)."""

    def __init__(self, answer: Callable[[RouteQuery], ReplicaView], node_id: str = "local", *,
                 test_hooks: bool = False) -> None:
        self._answer = answer
        self._test_hooks = test_hooks
        self._open = threading.Event()
        self._open.set()
        self._server = StepChannelServer(self._handle, node_id, max_frame_bytes=16 << 20)

    @property
    def address(self) -> ChannelAddress:
        return self._server.address

    def _handle(self, frame: bytearray) -> bytes:
        query = pickle.loads(frame)
        if type(query) is HoldProbes and self._test_hooks:
            if query.hold:
                self._open.clear()
            else:
                self._open.set()
            return pickle.dumps(query)
        if type(query) is not RouteQuery:
            raise TypeError(f"a probe frame must hold a RouteQuery, got {type(query).__name__}")
        self._open.wait(HOLD_MAX_S)
        return pickle.dumps(self._answer(query), protocol=pickle.HIGHEST_PROTOCOL)

    def close(self) -> None:
        self._server.close()


class ChannelProbe:
    """A router's connection to one replica's ``ProbeServer``; ``probe`` waits at most ``timeout_s``
    (``TimeoutError``; the next probe still works) and reconnects after a broken connection."""

    def __init__(self, name: str, address: ChannelAddress, timeout_s: float) -> None:
        self.name = name
        self.address = address
        self.timeout_s = timeout_s
        self._channel: StepChannel | None = None
        self._busy = threading.Lock()  # a probe still waiting (its router gave up on it) owns the channel

    def probe(self, query: RouteQuery) -> ReplicaView:
        if not self._busy.acquire(blocking=False):
            raise TimeoutError(f"replica {self.name}: the previous probe is still waiting")
        try:
            return self._probe(query)
        finally:
            self._busy.release()

    def _probe(self, query: RouteQuery) -> ReplicaView:
        ch = self._channel
        if ch is None or ch.closed is not None:
            ch = self._channel = StepChannel(self.address, self.timeout_s, max_frame_bytes=16 << 20)
        try:
            ticket = ch.send(pickle.dumps(query, protocol=pickle.HIGHEST_PROTOCOL))
            view = pickle.loads(ch.recv(ticket, self.timeout_s))
        except ChannelClosedError:
            self._channel = None
            raise
        if type(view) is not ReplicaView:
            raise TypeError(f"probe answer must be a ReplicaView, got {type(view).__name__}")
        return view

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
