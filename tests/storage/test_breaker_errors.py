"""The breaker's state machine, the error kinds of what client libraries raise, and the new
StorageConfig fields' validation."""

from __future__ import annotations

import errno

import aiohttp
import pytest
from aiohttp.client_reqrep import ConnectionKey
from fsspec.exceptions import FSTimeoutError

from hicache.storage import StorageConfig
from hicache.storage.breaker import Breaker, BreakerState
from hicache.storage.errors import ErrorKind, StorageUnavailableError, classify, is_transient
from hicache.storage.testing import ManualClock


def _open(b: Breaker) -> None:
    for _ in range(b.threshold):
        assert b.allow()
        b.record(answered=False, tripped=True)


def test_threshold_failed_rounds_within_the_window_open_it():
    clock = ManualClock()
    b = Breaker(3, 5.0, clock, window_s=10.0)
    for _ in range(2):
        b.record(answered=False, tripped=True)
    clock.advance(10.5)  # those two leave the window
    for _ in range(2):
        b.record(answered=False, tripped=True)
        b.record(answered=True, tripped=False)  # clean rounds between change nothing
    assert b.state is BreakerState.CLOSED
    b.record(answered=True, tripped=True)  # answers, but a hang cost the round its deadline
    assert (b.state, b.opens) == (BreakerState.OPEN, 1) and not b.allow()


def test_a_call_counts_one_failure_whatever_its_rounds():
    b = Breaker(2, 5.0, ManualClock())
    b.record(answered=False, tripped=True)  # a call's listing timed out ...
    b.record(answered=False, tripped=True, repeat=True)  # ... and then its existence round
    assert b.state is BreakerState.CLOSED
    b.record(answered=False, tripped=True)  # the next failed call
    assert (b.state, b.opens) == (BreakerState.OPEN, 1)
    b2 = Breaker(2, 5.0, ManualClock())
    b2.record(answered=False, tripped=True, refused=True, repeat=True)  # every connection refused: at once
    assert b2.state is BreakerState.OPEN


def test_a_round_of_refusals_opens_it_at_once():
    b = Breaker(3, 5.0, ManualClock())
    b.record(answered=False, tripped=True, refused=True)
    assert (b.state, b.opens) == (BreakerState.OPEN, 1)


def test_a_clock_swapped_in_keeps_the_time_since_it_opened():
    real, manual = ManualClock(), ManualClock()
    real.advance(1000.0)
    b = Breaker(1, 5.0, real)
    _open(b)
    real.advance(2.0)
    b.use_clock(manual)
    assert not b.allow()
    manual.advance(2.9)
    assert b.state is BreakerState.OPEN
    manual.advance(0.1)
    assert b.state is BreakerState.HALF_OPEN


def test_half_open_lets_one_probe_through():
    clock = ManualClock()
    b = Breaker(2, 5.0, clock)
    _open(b)
    clock.advance(4.9)
    assert not b.allow()
    clock.advance(0.1)
    assert b.state is BreakerState.HALF_OPEN
    assert b.allow()  # the probe
    assert not b.allow()  # others fail fast while it runs
    b.record(answered=True, tripped=False)
    assert b.state is BreakerState.CLOSED and b.allow()


@pytest.mark.parametrize("answered, tripped", [(False, False), (True, True)])  # no answer; a hang beside answers
def test_a_failed_probe_reopens_and_late_failures_do_not_extend_the_cooldown(answered, tripped):
    clock = ManualClock()
    b = Breaker(1, 5.0, clock)
    _open(b)
    clock.advance(5.0)
    assert b.allow()
    b.record(answered=answered, tripped=tripped)
    assert (b.state, b.opens) == (BreakerState.OPEN, 2)
    clock.advance(4.0)
    b.record(answered=False, tripped=True)  # a round that began before it opened
    clock.advance(1.0)
    assert b.allow()


@pytest.mark.parametrize("args", [(0, 1.0), (True, 1.0), (2, -1.0), (2, "1"), (2, 1.0, ManualClock(), 0.0)])
def test_breaker_bad_arguments(args):
    with pytest.raises(ValueError, match="threshold|cooldown_s|window_s"):
        Breaker(*args)


@pytest.mark.parametrize(
    "exc, on_root, kind, transient",
    [
        (TimeoutError(), False, ErrorKind.TIMEOUT, False),
        (FSTimeoutError(), False, ErrorKind.TIMEOUT, False),
        (aiohttp.ServerTimeoutError(), False, ErrorKind.TIMEOUT, False),
        (BlockingIOError(), False, ErrorKind.TIMEOUT, False),
        (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), False, ErrorKind.REFUSED, False),
        (aiohttp.ClientConnectorError(ConnectionKey("127.0.0.1", 1, False, True, None, None, None, None),
                                      ConnectionRefusedError(errno.ECONNREFUSED, "refused")),
         False, ErrorKind.REFUSED, False),
        (ConnectionResetError(errno.ECONNRESET, "reset"), False, ErrorKind.REFUSED, True),
        (aiohttp.ServerDisconnectedError(), False, ErrorKind.REFUSED, True),
        (OSError(errno.ECONNRESET, "reset"), False, ErrorKind.REFUSED, True),
        (PermissionError(errno.EACCES, "no"), False, ErrorKind.PERMISSION, False),
        (FileNotFoundError("x"), False, ErrorKind.MISSING, False),
        (FileNotFoundError("bucket"), True, ErrorKind.MISSING_BUCKET, False),
        (OSError(errno.EIO, "503 Service Unavailable"), False, ErrorKind.OTHER, True),
        (FileExistsError("taken"), False, ErrorKind.OTHER, False),
        (ValueError("a bug"), False, ErrorKind.OTHER, False),
        (StorageUnavailableError("open"), False, ErrorKind.UNAVAILABLE, False),
    ],
)
def test_error_kinds(exc, on_root, kind, transient):
    assert classify(exc, on_root=on_root) is kind
    assert is_transient(exc) is transient


@pytest.mark.parametrize(
    "code, on_root, kind, transient",
    [(403, False, ErrorKind.PERMISSION, False), (401, False, ErrorKind.PERMISSION, False),
     (404, True, ErrorKind.MISSING_BUCKET, False), (503, False, ErrorKind.OTHER, True),
     (429, False, ErrorKind.OTHER, True), (412, False, ErrorKind.OTHER, False)],
)
def test_error_kinds_of_gcsfs_http_errors(gcs_emulator, code, on_root, kind, transient):
    from gcsfs.retry import HttpError  # (after the emulator fixture set gcsfs' import-time env)

    e = HttpError({"code": code, "message": "m"})
    assert classify(e, on_root=on_root) is kind
    assert is_transient(e) is transient


@pytest.mark.parametrize(
    "field, bad",
    [("exists_timeout_s", 0), ("list_timeout_s", -1.0), ("close_timeout_s", True), ("retries", -1),
     ("retries", 1.5), ("retry_backoff_s", -0.1), ("breaker_threshold", 0), ("breaker_cooldown_s", "5"),
     ("breaker_window_s", 0)],
)
def test_config_rejects_bad_values_naming_them(field, bad):
    with pytest.raises(ValueError, match=field):
        StorageConfig(**{field: bad})


def test_config_defaults_keep_request_waits_short():
    c = StorageConfig()
    assert c.exists_timeout_s < 1.0 <= c.timeout_s
    assert (c.breaker_threshold, c.breaker_cooldown_s, c.retries) == (3, 5.0, 2)
