"""``connect``: a ``CacheClient`` whose calls go to a replica's head actor through Ray.

Runs in the serving process (once per scheduler). Every remote call has a timeout; Ray's errors
become ``hicache.cluster.errors`` exceptions; a batched ``step`` (and a single call: a step of one)
is one round trip in the compact wire format of ``hicache.cluster.wire`` (a match key that extends
one this client sent before travels as a reference plus its new tokens: ``key_history``). The transport
remembers the head's epoch and sends it with every call: after a head restart or a lost host the
head refuses calls from the old epoch once (``HiCacheReplicaResetError``), so stale node ids and
pages are never applied to the new state. Not thread-safe: one transport per scheduler thread.

Pipelining: ``submit`` sends a step and returns at once, up to ``max_in_flight`` steps stay in flight
(the head's single control thread runs them in submission order; every step carries its key-history
step count, so a step the head does not run in that order is refused, never misapplied). The client
encodes the next step while the head runs this one. Results are collected oldest first. A step
refused for its key history ("resync": nothing ran, nor did any later step of that session) is sent
again in a fresh session, and so is every later step still in flight, in order, before ``submit``
or ``result`` returns; a step that failed (timeout, head lost) fails alone, the steps after it are
collected at once (each ran, failed, or is sent again), so nothing submitted later overtakes them.

Step channel (``hicache.cluster.step_channel``): a client sends its steps over a socket the head hands
out through a Ray call (bound to the head node's address, or to loopback: then only a client on the
head's node uses it), not as Ray actor calls (a Ray call costs far
more CPU on each side than the socket); same request and reply bytes, same head code, same order
(one connection, replies in order). A channel that times out stays in use (the late reply is read
and dropped); one that breaks fails its steps in flight (``HiCacheUnavailableError``: they may have
run) and the next step asks the head for a channel again (a restarted head has a new one); while
there is none (a loopback channel on another node, switched off, the head unreachable) steps go as Ray calls, and the
client asks again after ``channel_retry_s`` (``connect``; default ``CHANNEL_RETRY_S``).

Buffers: a submitted step keeps its ``Call`` list (results decode against it) and a private copy of
its match keys (the key history); serving code may reuse its arrays once ``submit`` returned.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import ray

from hicache.cluster import wire
from hicache.cluster.client import CacheClient
from hicache.cluster.errors import HiCacheError, HiCacheReplicaResetError, HiCacheTimeoutError, HiCacheUnavailableError
from hicache.cluster.head import Call, CallResult
from hicache.cluster.key_history import DEFAULT_CAP_TOKENS, SentKeys
from hicache.cluster.ray_head import NAMESPACE, Reply, get_head
from hicache.cluster.step_channel import ChannelClosedError, StepChannel

log = logging.getLogger(__name__)

_CHUNK = 90_000  # below Ray's max_direct_call_object_size (100 KB): arguments travel inline
DEFAULT_MAX_IN_FLIGHT = 4
CHANNEL_RETRY_S = 5.0  # after no channel could be opened, steps go as Ray calls this long before the next try
CHANNEL_CONNECT_TIMEOUT_S = 5.0  # at most, for asking the head for its channel and for connecting


class _InFlight:
    """One submitted step: what it was encoded against, its reply ref, then its outcome."""

    __slots__ = ("calls", "sent", "epoch", "ref", "channel", "ticket", "results", "error")

    def __init__(self, calls: list[Call]) -> None:
        self.calls = calls
        self.sent: SentKeys | None = None  # the key-history session it was encoded against
        self.epoch: int | None = None  # the epoch it was sent with
        self.ref: Any = None  # its Ray call, or
        self.channel: StepChannel | None = None  # the step channel it went on, and its ticket there
        self.ticket = -1
        self.results: list[CallResult] | None = None
        self.error: BaseException | None = None


class RayStep:
    """A step submitted through a ``RayTransport`` (``PendingStep``)."""

    def __init__(self, transport: RayTransport, entry: _InFlight) -> None:
        self._transport = transport
        self._entry = entry

    def result(self) -> list[CallResult]:
        """Waits for this step (and the ones submitted before it); raises what made it fail."""
        entry = self._entry
        while entry.results is None and entry.error is None:
            self._transport._collect_oldest()
        if entry.error is not None:
            raise entry.error
        return entry.results  # type: ignore[return-value]


class RayTransport:
    def __init__(self, head: Any, replica: str, timeout_s: float = 30.0,
                 history_tokens: int = DEFAULT_CAP_TOKENS, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                 step_channel: bool = True, channel_retry_s: float = CHANNEL_RETRY_S) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not channel_retry_s >= 0:
            raise ValueError(f"channel_retry_s must be >= 0, got {channel_retry_s}")
        if type(max_in_flight) is not int or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}")
        self.head = head
        self.replica = replica
        self.timeout_s = float(timeout_s)
        self.max_in_flight = max_in_flight
        self.epoch: int | None = None  # last epoch the head answered from
        self._sent = SentKeys(history_tokens)  # match keys the head holds (or will, once in-flight steps ran)
        self._in_flight: deque[_InFlight] = deque()
        self._use_channel = step_channel
        self._channel_retry_s = float(channel_retry_s)
        self._channel: StepChannel | None = None
        self._channel_retry_at = 0.0  # time.monotonic() from which a channel may be asked for again
        self._node_id: str | None = None
        self.channel_steps = 0  # steps sent over the step channel (a step sent again counts again)
        self.ray_steps = 0  # steps sent as Ray calls

    # -- step channel ------------------------------------------------------------------------------------
    def _usable_channel(self) -> StepChannel | None:
        """The open step channel; else a new one if the head has one for this node (asked at most every
        ``channel_retry_s`` after a try that gave none); else None (the step goes as a Ray call)."""
        channel = self._channel
        if channel is not None and channel.usable():
            return channel
        self._channel = None
        if not self._use_channel or time.monotonic() < self._channel_retry_at:
            return None
        wait_s = min(self.timeout_s, CHANNEL_CONNECT_TIMEOUT_S)
        try:
            address = ray.get(self.head.step_channel.remote(), timeout=wait_s)
            if self._node_id is None:
                self._node_id = ray.get_runtime_context().get_node_id()
            if address is not None and address.reachable_from(self._node_id):
                self._channel = StepChannel(address, wait_s)
        except (ray.exceptions.RayError, ChannelClosedError) as e:  # the Ray call says the same, or falls back
            log.info("replica %s: no step channel (%s: %s); steps go as Ray calls", self.replica, type(e).__name__, e)
        if self._channel is None:
            self._channel_retry_at = time.monotonic() + self._channel_retry_s
        return self._channel

    def close(self) -> None:
        """Closes the step channel (steps in flight on it fail); later steps open a new one."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    # -- one round trip ----------------------------------------------------------------------------------
    def _send(self, entry: _InFlight) -> None:
        """Encodes ``entry`` against the current key-history session and sends it (step channel, else a Ray
        call); the session counts the step (and its keys) at once, as the head will when it runs it."""
        sent = self._sent
        header, buf, keys = wire.encode_calls(entry.calls, sent)
        request = pickle.dumps((self.epoch, sent.session, sent.steps, sent.cap_tokens, header, buf),
                               protocol=pickle.HIGHEST_PROTOCOL)
        entry.sent, entry.epoch, entry.channel, entry.ref = sent, self.epoch, None, None
        channel = self._usable_channel()
        if channel is not None:
            try:
                entry.ticket = channel.send(request)
                entry.channel = channel
                self.channel_steps += 1
            except ChannelClosedError:  # not (completely) sent, so the head does not run it: the Ray call does
                self._channel = None
        if entry.channel is None:
            blob = memoryview(request)
            entry.ref = self.head.step_wire.remote(*[blob[i : i + _CHUNK].tobytes() for i in range(0, len(blob), _CHUNK)])
            self.ray_steps += 1
        sent.commit_copies(keys)

    def _timeout(self) -> HiCacheTimeoutError:
        return HiCacheTimeoutError(
            f"replica {self.replica!r}: step got no answer within {self.timeout_s}s (it may still be applied)")

    def _channel_reply(self, entry: _InFlight) -> Reply:
        assert entry.channel is not None
        try:
            return pickle.loads(entry.channel.recv(entry.ticket, self.timeout_s))
        except TimeoutError:
            raise self._timeout() from None
        except ChannelClosedError as e:
            raise HiCacheUnavailableError(
                f"replica {self.replica!r}: step channel lost ({e}); the step may have been applied"
            ) from e

    def _reply(self, entry: _InFlight) -> Reply:
        """The head's answer to ``entry`` ("ok" or "resync"); raises the hicache error of any other."""
        try:
            if entry.channel is not None:
                reply = self._channel_reply(entry)
            else:
                reply = ray.get(entry.ref, timeout=self.timeout_s)
                if isinstance(reply, bytes):
                    reply = pickle.loads(reply)
        except ray.exceptions.GetTimeoutError:
            raise self._timeout() from None
        except (ray.exceptions.RayActorError, ray.exceptions.RaySystemError) as e:
            raise HiCacheUnavailableError(f"replica {self.replica!r}: head unreachable: {type(e).__name__}") from e
        except ray.exceptions.RayTaskError as e:
            raise HiCacheError(f"replica {self.replica!r}: step failed in the head: {e}") from e
        if reply.status in ("ok", "resync"):
            self.epoch = reply.epoch
            return reply
        if reply.status == "reset":
            self.epoch = reply.epoch
            raise HiCacheReplicaResetError(self.replica, entry.epoch, reply.epoch, reply.reason)
        raise HiCacheUnavailableError(reply.reason or f"replica {self.replica!r} is unavailable")

    def _forget(self, sent: SentKeys | None) -> None:
        """The head's copy of ``sent`` is unknown (or refused): later steps start a new session."""
        if sent is self._sent:
            self._sent = SentKeys(sent.cap_tokens)

    def _complete(self, entry: _InFlight) -> bool:
        """Waits for ``entry``'s outcome; a step the head refused for its key history is sent again,
        once, in a fresh session (the head cannot refuse a session's first step). False: it failed or
        was sent again (the steps after it must not wait behind a stale session)."""
        for attempt in range(2):
            try:
                reply = self._reply(entry)
            except BaseException as e:  # the head may or may not have run it: its key history is unknown
                self._forget(entry.sent)
                entry.error = e
                return False
            if reply.status == "ok":
                try:
                    header, buf = reply.results
                    entry.results = wire.decode_results(header, buf, entry.calls)
                except Exception as e:  # a reply this client cannot read: that step fails, not the transport
                    entry.error = HiCacheError(f"replica {self.replica!r}: unreadable step reply: {e!r}")
                    return False
                return attempt == 0
            self._forget(entry.sent)
            if attempt == 0:
                try:
                    self._send(entry)
                except BaseException as e:
                    entry.error = e
                    return False
        entry.error = HiCacheError(f"replica {self.replica!r}: the head refused a new key-history session")
        return False

    def _collect_oldest(self) -> None:
        """Completes the oldest step in flight; if it did not simply succeed, completes all the others too,
        in order, before anything new is sent."""
        if not self._complete(self._in_flight.popleft()):
            while self._in_flight:
                self._complete(self._in_flight.popleft())

    # -- Transport ---------------------------------------------------------------------------------------
    def submit(self, calls: Sequence[Call]) -> RayStep:
        entry = _InFlight(list(calls))
        while len(self._in_flight) >= self.max_in_flight:
            self._collect_oldest()
        self._send(entry)
        self._in_flight.append(entry)
        return RayStep(self, entry)

    def step(self, calls: Sequence[Call]) -> list[CallResult]:
        return self.submit(calls).result()

    def call(self, call: Call) -> Any:
        return self.step([call])[0].unwrap()


def connect(replica: str = "default", address: str | None = None, *, timeout_s: float = 30.0,
            max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, step_channel: bool = True,
            channel_retry_s: float = CHANNEL_RETRY_S) -> CacheClient:
    """A client for the running replica ``replica`` (started with ``start_replica``).

    Joins the Ray cluster at ``address`` (default ``"auto"``) if this process is not connected yet.
    ``max_in_flight``: steps ``CacheClient.submit_step`` keeps in flight before it waits for the oldest.
    ``step_channel``: send steps over the head's step channel when this process can reach it (any node
    with ``ChannelScope.CLUSTER``, the head's node with ``NODE``; False: always as Ray calls); ``channel_retry_s``: after the head had no channel for
    this process, steps go as Ray calls this long before it is asked again.
    """
    if not ray.is_initialized():
        ray.init(address=address or "auto", namespace=NAMESPACE)
    head = get_head(replica)
    try:
        health = ray.get(head.health.remote(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise HiCacheTimeoutError(f"replica {replica!r}: no health answer within {timeout_s}s") from None
    except ray.exceptions.RayActorError as e:
        raise HiCacheUnavailableError(f"replica {replica!r}: head unreachable: {type(e).__name__}") from e
    transport = RayTransport(head, replica, timeout_s, max_in_flight=max_in_flight, step_channel=step_channel,
                             channel_retry_s=channel_retry_s)
    return CacheClient(transport, health.page_size)
