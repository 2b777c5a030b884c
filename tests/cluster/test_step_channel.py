"""The step channel's socket protocol on its own (no Ray): handshake, order, timeouts, closing, limits."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from hicache.cluster.step_channel import (
    LOOPBACK,
    ChannelAddress,
    ChannelClosedError,
    StepChannel,
    StepChannelServer,
    _send_frame,
)


class Gate:
    """A handler that echoes each request reversed; while ``open`` is clear a request waits for it
    (``entered`` is set once a request runs, so a test knows the server is inside the handler)."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Event()
        self.seen: list[bytes] = []

    def __call__(self, frame: bytearray) -> bytes:
        self.entered.set()
        assert self.open.wait(30)
        self.seen.append(bytes(frame))
        return bytes(frame[::-1])


@pytest.fixture
def server():
    gate = Gate()
    srv = StepChannelServer(gate, "node-a")
    srv.gate = gate
    yield srv
    srv.close()


def test_requests_in_flight_get_their_own_replies_in_order(server):
    ch = StepChannel(server.address, 5.0)
    payloads = [bytes([i]) * (1 + 50_000 * i) for i in range(5)]  # up to 200 KB: several reads per frame
    tickets = [ch.send(p) for p in payloads]
    assert ch.in_flight == 5
    for t, p in zip(tickets, payloads):
        assert ch.recv(t, 5.0) == p[::-1]
    assert ch.in_flight == 0 and server.frames == 5 and ch.usable()


def test_frames_larger_than_the_socket_buffers_arrive_whole_both_ways(server):
    """A frame the kernel takes in parts (``sendmsg`` of length + payload, then the rest) arrives whole."""
    ch = StepChannel(server.address, 30.0)
    payload = bytes(range(256)) * (12 << 12)  # 12 MiB: three times SOCKET_BUFFER_BYTES
    assert ch.recv(ch.send(payload), 30.0) == payload[::-1]
    assert server.gate.seen == [payload] and ch.usable()


def test_replies_can_be_collected_out_of_order(server):
    ch = StepChannel(server.address, 5.0)
    first, second, third = ch.send(b"12"), ch.send(b"34"), ch.send(b"56")
    assert ch.recv(second, 5.0) == b"43"  # the reply to ``first`` is kept until it is collected
    assert ch.recv(first, 5.0) == b"21" and ch.recv(third, 5.0) == b"65"
    with pytest.raises(ValueError, match="ticket 1"):
        ch.recv(second, 1.0)


def test_listens_on_loopback_only_and_hides_the_token(server):
    listener = server._listener.getsockname()
    assert listener[0] == LOOPBACK and listener[1] == server.address.port > 0
    assert server.address.token.hex() not in repr(server.address)


def test_binds_the_given_address_and_refuses_wildcards():
    """A CLUSTER-scope channel listens on one address (the head node's), which clients on other nodes dial."""
    gate = Gate()
    srv = StepChannelServer(gate, "node-a", host="127.0.0.2")  # stands in for a node address on this machine
    try:
        assert srv._listener.getsockname()[0] == "127.0.0.2" and srv.address.host == "127.0.0.2"
        assert not srv.address.node_local and srv.address.reachable_from("node-b")
        ch = StepChannel(srv.address, 5.0)
        assert ch.recv(ch.send(b"ab"), 5.0) == b"ba"
        with pytest.raises(ChannelClosedError, match="cannot connect to 127.0.0.1"):  # not on loopback
            StepChannel(ChannelAddress("node-a", srv.address.port, srv.address.token), 5.0)
    finally:
        srv.close()
    local = ChannelAddress("node-a", 1, b"t")
    assert local.node_local and local.reachable_from("node-a") and not local.reachable_from("node-b")
    for wildcard in ("0.0.0.0", "::", ""):
        with pytest.raises(ValueError, match="wildcard"):
            StepChannelServer(gate, "node-a", host=wildcard)


def test_a_wrong_token_is_refused_and_nothing_runs(server):
    bad = ChannelAddress("node-a", server.address.port, b"x" * len(server.address.token))
    with pytest.raises(ChannelClosedError, match="refused"):
        StepChannel(bad, 5.0)
    raw = socket.create_connection((LOOPBACK, server.address.port), timeout=5)  # an oversized first frame
    _send_frame(raw, b"y" * 1000)
    assert raw.recv(1) == b""  # closed without an answer
    raw.close()
    assert server.gate.seen == [] and server.frames == 0 and server.refused == 1


def test_a_timeout_keeps_the_channel_and_drops_the_late_reply(server):
    ch = StepChannel(server.address, 5.0)
    server.gate.open.clear()
    late = ch.send(b"late")
    with pytest.raises(TimeoutError):
        ch.recv(late, 0.2)
    nxt = ch.send(b"next")
    server.gate.open.set()
    assert ch.recv(nxt, 5.0) == b"txen"  # the reply to "late" was read first and dropped
    with pytest.raises(ValueError, match="ticket 0"):
        ch.recv(late, 1.0)


def test_a_closed_server_closes_the_channel_without_a_hang(server):
    ch = StepChannel(server.address, 5.0)
    assert ch.recv(ch.send(b"ab"), 5.0) == b"ba"
    server.gate.open.clear()
    server.gate.entered.clear()
    pending = ch.send(b"cd")
    assert server.gate.entered.wait(30)  # the server runs "cd" (held) when it closes
    server.close()
    server.gate.open.set()  # the running request finishes; its reply has nowhere to go
    with pytest.raises(ChannelClosedError):
        ch.recv(pending, 5.0)
    assert not ch.usable()
    with pytest.raises(ChannelClosedError):
        ch.send(b"ef")
    with pytest.raises(ChannelClosedError, match="cannot connect|refused"):  # (the listener may linger 0.5 s)
        StepChannel(server.address, 1.0)


def test_an_idle_channel_sees_that_the_server_went_away(server):
    ch = StepChannel(server.address, 5.0)
    assert ch.usable()
    server.close()
    end = time.monotonic() + 30  # a poll: the server's close reaches the client socket asynchronously
    while ch.usable():
        assert time.monotonic() < end
        time.sleep(0.01)
    assert "closed" in ch.closed


def test_a_server_that_never_answers_the_handshake_fails_within_the_timeout():
    silent = socket.create_server((LOOPBACK, 0))  # accepts (backlog), never answers
    try:
        with pytest.raises(ChannelClosedError, match="no handshake answer"):
            StepChannel(ChannelAddress("n", silent.getsockname()[1], b"t" * 32), 0.3)
    finally:
        silent.close()


def test_connection_limit_and_bad_options():
    srv = StepChannelServer(Gate(), "n", max_connections=1)
    try:
        first = StepChannel(srv.address, 5.0)
        with pytest.raises(ChannelClosedError):
            StepChannel(srv.address, 2.0)
        assert first.recv(first.send(b"ok"), 5.0) == b"ko"
    finally:
        srv.close()
    with pytest.raises(ValueError, match="max_connections"):
        StepChannelServer(Gate(), "n", max_connections=0)
    with pytest.raises(TypeError, match="handler"):
        StepChannelServer(None, "n")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s"):
        StepChannel(ChannelAddress("n", 1, b""), 0)
