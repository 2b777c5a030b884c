"""A direct step channel: a client's wire-format steps to its head actor over one TCP socket.

A Ray actor call costs far more CPU on each side (task spec, serialization, object refs, core-worker
threads) than a step buffer sent over a socket (figures: docs/performance.md). Ray keeps the
lifecycle, placement, health and the fallback: the head hands out the channel's address through a
Ray call (``CacheHeadActor.step_channel``) and the client connects to it.

Protocol: frames of an 8-byte big-endian length plus that many bytes, both ways. The client's first
frame is the server's token (``TOKEN_BYTES`` random bytes, known only through the Ray call); the
server answers ``HELLO`` or closes the connection. Then every frame is one request and gets exactly
one reply frame, in order (a client may have several requests in flight). The server binds one
address, on an ephemeral port: 127.0.0.1 (``ChannelScope.NODE``: clients on the head's node) or the
head's node address (``ChannelScope.CLUSTER``: clients on any node that reaches it, the production
layout where serving runs on the TPU hosts). The token is the only check (README, security notes):
it is sent in clear, so it keeps out whoever cannot make Ray calls, not whoever reads the network.

Ownership and threads:
* ``StepChannelServer``: owned by the head actor. One accept thread, one thread per connection (at
  most ``max_connections``); each thread reads a frame, calls ``handler(frame) -> reply`` (the head
  runs the step under its lock: one step at a time with the Ray control thread and every other
  connection) and writes the reply. A frame buffer belongs to the thread that read it.
* ``StepChannel``: owned by one ``RayTransport`` (not thread-safe); its receive buffer keeps a
  partial frame across a timeout, so a reply that comes late is read (and dropped) later, never taken
  for the answer to another request. Replies may be collected in any order: one read while waiting
  for a later ticket is kept until its ticket is collected.

Every wait is bounded: the client's by the caller's timeout (``TimeoutError``, the channel stays
usable), the server's by ``POLL_S`` slices that check for ``close()``, the handshake by
``HANDSHAKE_TIMEOUT_S``, a reply write by ``SEND_TIMEOUT_S``. Frames are at most ``MAX_FRAME_BYTES``.
A broken or closed connection raises ``ChannelClosedError`` and stays closed.

Wake-ups: the request of a full scheduler step spans many TCP segments. Both sides size their socket
buffers for whole frames (``SOCKET_BUFFER_BYTES``, set before listen/connect) so the sender never
waits for the reader's turn on a busy host, and a reader waiting for the rest of a frame sets
``SO_RCVLOWAT`` to what is missing, so it wakes once per frame instead of once per TCP segment.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
TOKEN_BYTES = 32
HELLO = b"hicache-step-channel/1"
MAX_FRAME_BYTES = 1 << 30  # a step of a few thousand requests is a few MiB
MAX_CONNECTIONS = 64
POLL_S = 0.5  # server threads wake this often to see close()
HANDSHAKE_TIMEOUT_S = 10.0
SEND_TIMEOUT_S = 60.0  # the server's reply write (a client that stopped reading)
_LEN = struct.Struct("!Q")
_SCRATCH = 1 << 18
SOCKET_BUFFER_BYTES = 4 << 20  # a step's frame fits: the sender does not wait for the reader's turn
_LOWAT_CAP = 1 << 20  # a waiting reader wakes once this much of its frame (or all of it) has come


def _sized_socket() -> socket.socket:
    """A TCP socket with buffers for whole frames (set before listen/connect, so the window scales)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    return sock


class ChannelScope(str, Enum):
    """Who can reach a head's step channel."""

    NODE = "node"  # 127.0.0.1: clients on the head's node only
    CLUSTER = "cluster"  # the head node's address: clients on any host that reaches it


class ChannelClosedError(ConnectionError):
    """The connection is closed or broken (by either side); the channel cannot be used again."""


@dataclass(frozen=True)
class ChannelAddress:
    """Where a head's step channel listens: its Ray node, the port, the token a client must send first,
    and the address it is bound to (127.0.0.1: only a client on ``node_id`` can reach it)."""

    node_id: str
    port: int
    token: bytes
    host: str = LOOPBACK

    def __repr__(self) -> str:  # the token stays out of logs
        return f"ChannelAddress(node_id={self.node_id!r}, host={self.host!r}, port={self.port})"

    @property
    def node_local(self) -> bool:
        """Bound to loopback: reachable from the head's node only."""
        return self.host == LOOPBACK

    def reachable_from(self, node_id: str) -> bool:
        return not self.node_local or node_id == self.node_id


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    """Writes one frame: its length and ``payload`` in one ``sendmsg`` (no copy of the payload into a
    frame), the rest with ``sendall`` when the kernel took only part; the socket's timeout bounds each."""
    head = _LEN.pack(len(payload))
    sent = sock.sendmsg([head, payload])
    if sent < len(head):
        sock.sendall(head[sent:])
        sent = len(head)
    if sent - len(head) < len(payload):
        sock.sendall(memoryview(payload)[sent - len(head) :])


class _FrameReader:
    """Reads length-prefixed frames from ``sock``; a partial frame stays buffered across timeouts."""

    def __init__(self, sock: socket.socket, max_frame_bytes: int) -> None:
        self._sock = sock
        self.limit = max_frame_bytes  # the largest frame accepted now
        self._buf = bytearray()
        self._scratch = bytearray(_SCRATCH)
        self._lowat = 1  # SO_RCVLOWAT now: bytes that must have come before a wait ends

    def _wake_at(self, missing: int) -> None:
        """Waits end when ``missing`` bytes have come (one wake-up per frame, not one per TCP segment)."""
        lowat = max(1, min(missing, _LOWAT_CAP))
        if lowat != self._lowat:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
            self._lowat = lowat

    def pending(self) -> bool:
        return bool(self._buf)

    def _take(self) -> bytearray | None:
        buf = self._buf
        if len(buf) < _LEN.size:
            self._wake_at(_LEN.size - len(buf))
            return None
        (n,) = _LEN.unpack_from(buf)
        if n > self.limit:
            raise ChannelClosedError(f"frame of {n} bytes exceeds the limit of {self.limit}")
        end = _LEN.size + n
        if len(buf) < end:
            self._wake_at(end - len(buf))
            return None
        frame = buf[_LEN.size : end]
        del buf[:end]
        return frame

    def read(self, timeout_s: float | None, stop: threading.Event | None = None) -> bytearray:
        """The next frame. ``timeout_s``: ``TimeoutError`` after that long (what arrived stays
        buffered); None: wait in ``POLL_S`` slices until ``stop`` is set (then ``ChannelClosedError``)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        sock, view = self._sock, memoryview(self._scratch)
        while True:
            frame = self._take()
            if frame is not None:
                return frame
            if deadline is None:
                if stop is not None and stop.is_set():
                    raise ChannelClosedError("channel closed")
                sock.settimeout(POLL_S)
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no frame within {timeout_s}s")
                sock.settimeout(left)
            try:
                n = sock.recv_into(view)
            except TimeoutError:
                continue
            except OSError as e:
                raise ChannelClosedError(f"connection broken: {e}") from e
            if n == 0:
                raise ChannelClosedError("connection closed by the peer")
            self._buf += view[:n]


# -- head side -----------------------------------------------------------------------------------------
class StepChannelServer:
    """Serves ``handler`` on an ephemeral port of ``host`` (see the module docstring). ``close()`` stops it."""

    def __init__(self, handler: Callable[[bytearray], bytes], node_id: str, *, host: str = LOOPBACK,
                 max_connections: int = MAX_CONNECTIONS, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        if not callable(handler):
            raise TypeError(f"handler must be callable, got {type(handler).__name__}")
        if type(max_connections) is not int or max_connections < 1:
            raise ValueError(f"max_connections must be an int >= 1, got {max_connections!r}")
        if type(max_frame_bytes) is not int or max_frame_bytes < TOKEN_BYTES:
            raise ValueError(f"max_frame_bytes must be an int >= {TOKEN_BYTES}, got {max_frame_bytes!r}")
        if not isinstance(host, str) or not host or host in ("0.0.0.0", "::", ""):
            raise ValueError(f"host must be one address to bind (not a wildcard), got {host!r}")
        self._handler = handler
        self._max_connections = max_connections
        self._max_frame = max_frame_bytes
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self.frames = 0  # requests answered (all connections)
        self.refused = 0  # connections closed for a wrong token
        self._listener = _sized_socket()  # accepted connections inherit its buffer sizes
        try:
            self._listener.bind((host, 0))
            self._listener.listen()
        except OSError:
            self._listener.close()
            raise
        self._listener.settimeout(POLL_S)
        self.address = ChannelAddress(node_id, self._listener.getsockname()[1], self._token, host)
        threading.Thread(target=self._accept, name="hicache-channel-accept", daemon=True).start()

    @property
    def closed(self) -> bool:
        return self._stop.is_set()

    @property
    def connections(self) -> int:
        return len(self._conns)

    def close(self) -> None:
        """Stops accepting and closes every connection (their threads exit; a step running now finishes)."""
        self._stop.set()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        self._listener.close()
        for conn in conns:
            _shut(conn)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            with self._lock:
                if self._stop.is_set() or len(self._conns) >= self._max_connections:
                    _shut(conn)
                    continue
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn, peer), name="hicache-channel", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: object) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = _FrameReader(conn, TOKEN_BYTES)  # nothing bigger than a token before the handshake
        try:
            try:
                token = reader.read(HANDSHAKE_TIMEOUT_S)
            except (TimeoutError, ChannelClosedError):
                return
            if not hmac.compare_digest(bytes(token), self._token):
                with self._lock:
                    self.refused += 1
                log.warning("step channel: a connection from %s sent a wrong token; closed", peer)
                return
            reader.limit = self._max_frame
            self._send(conn, HELLO)
            while True:
                frame = reader.read(None, self._stop)
                reply = self._handler(frame)
                with self._lock:
                    self.frames += 1
                self._send(conn, reply)
        except ChannelClosedError:
            pass
        except Exception as e:  # a reply that cannot be written, a handler bug: this connection ends
            if not self._stop.is_set():
                log.warning("step channel connection closed: %s: %s", type(e).__name__, e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            _shut(conn)

    @staticmethod
    def _send(conn: socket.socket, payload: bytes) -> None:
        conn.settimeout(SEND_TIMEOUT_S)
        _send_frame(conn, payload)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


# -- client side ---------------------------------------------------------------------------------------
class StepChannel:
    """A client's connection to a ``StepChannelServer``: ``send`` a request, ``recv`` replies in order."""

    def __init__(self, address: ChannelAddress, timeout_s: float, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        if not isinstance(address, ChannelAddress):
            raise TypeError(f"address must be a ChannelAddress, got {type(address).__name__}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.address = address
        self.closed: str | None = None  # why the channel is closed
        self._sent = 0  # requests sent
        self._received = 0  # replies read (including the ones dropped)
        self._early: dict[int, bytearray] = {}  # replies read before their ticket was collected
        self._abandoned: set[int] = set()  # tickets whose collection timed out: their replies are dropped
        where = f"{address.host}:{address.port}"
        self._sock = _sized_socket()
        try:
            self._sock.settimeout(timeout_s)
            self._sock.connect((address.host, address.port))
        except OSError as e:
            self._sock.close()
            raise ChannelClosedError(f"cannot connect to {where}: {e}") from e
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._reader = _FrameReader(self._sock, max_frame_bytes)
        self._send_timeout = timeout_s
        try:
            self._write(address.token)
            hello = self._reader.read(timeout_s)
        except TimeoutError:
            self.close("no handshake answer")
            raise ChannelClosedError(f"step channel {where}: no handshake answer within {timeout_s}s") from None
        except ChannelClosedError as e:
            self.close(str(e))
            raise ChannelClosedError(f"step channel {where} refused the connection: {e}") from e
        if hello != HELLO:
            self.close("bad handshake")
            raise ChannelClosedError(f"step channel {where}: unexpected handshake {bytes(hello[:32])!r}")

    @property
    def in_flight(self) -> int:
        """Requests sent whose reply was not read yet."""
        return self._sent - self._received

    def usable(self) -> bool:
        """Open and, when no reply is due, not closed by the server meanwhile (one non-blocking peek)."""
        if self.closed is not None:
            return False
        if self._sent == self._received and not self._reader.pending():
            self._sock.settimeout(0)  # no wait (a socket with a timeout polls before it reads)
            try:
                data = self._sock.recv(1, socket.MSG_PEEK)
            except BlockingIOError:
                return True
            except OSError as e:
                self.close(f"connection broken: {e}")
                return False
            self.close("closed by the head" if not data else "unexpected data from the head")
            return False
        return True

    def _write(self, payload: bytes) -> None:
        self._sock.settimeout(self._send_timeout)
        try:
            _send_frame(self._sock, payload)
        except OSError as e:  # a timeout too: part of the frame may be out, the stream is unusable
            self.close(f"send failed: {type(e).__name__}: {e}")
            raise ChannelClosedError(self.closed) from e

    def send(self, payload: bytes) -> int:
        """Sends one request; returns its ticket (for ``recv``). ``ChannelClosedError``: the request was
        not (completely) sent, so the server does not run it."""
        if self.closed is not None:
            raise ChannelClosedError(self.closed)
        self._write(payload)
        self._sent += 1
        return self._sent - 1

    def recv(self, ticket: int, timeout_s: float) -> bytearray:
        """The reply to request ``ticket`` (once). ``TimeoutError`` when it has not come within
        ``timeout_s``: the ticket is abandoned (its reply is dropped when it comes; the channel stays
        usable); ``ChannelClosedError`` when the connection is gone."""
        early = self._early.pop(ticket, None)
        if early is not None:
            return early
        if not self._received <= ticket < self._sent or ticket in self._abandoned:
            raise ValueError(f"ticket {ticket} is not awaiting a reply (replies read: {self._received}, sent: {self._sent})")
        if self.closed is not None:
            raise ChannelClosedError(self.closed)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                frame = self._reader.read(max(deadline - time.monotonic(), 1e-6))
            except TimeoutError:
                self._abandoned.add(ticket)
                raise
            except ChannelClosedError as e:
                self.close(str(e))
                raise
            got, self._received = self._received, self._received + 1
            if got == ticket:
                return frame
            if got in self._abandoned:
                self._abandoned.discard(got)
            else:
                self._early[got] = frame

    def close(self, reason: str = "closed by the client") -> None:
        if self.closed is None:
            self.closed = reason
            _shut(self._sock)
