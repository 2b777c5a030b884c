"""What went wrong with a backend call: the error kinds ``StorageStats`` counts, the retry rule and
what trips the breaker.

``classify`` maps whatever a client library raised (builtin ``OSError`` family, fsspec's
``FSTimeoutError``, aiohttp's connection errors, gcsfs' ``HttpError`` with a status code) to one
``ErrorKind``. The client libraries are not imported here: their exceptions are recognised by
their builtin bases and by the ``code`` attribute gcsfs' ``HttpError`` carries, so storage works
with or without gcsfs installed.

Pure functions; called wherever a result is accounted (calling thread, I/O threads, gcsfs' loop).
"""

from __future__ import annotations

import enum
import errno


class ErrorKind(str, enum.Enum):
    """Why an object operation did not give its answer (keys of ``StorageStats.error_counts``)."""

    MISSING = "missing"  # the object is not stored: a plain miss, not an error
    TIMEOUT = "timeout"  # not finished by the call's deadline (or refused for a hung backend)
    REFUSED = "refused"  # connection refused / reset / unreachable
    MISSING_BUCKET = "missing_bucket"  # the bucket (root) is gone: a write or listing found none
    PERMISSION = "permission"  # 401 / 403 / EACCES
    OTHER = "other"  # anything else (5xx, EIO, ...)
    CORRUPT_IN_TRANSIT = "corrupt_in_transit"  # failed verification, intact at rest (not deleted)
    CORRUPT_AT_REST = "corrupt_at_rest"  # failed verification twice, same stored bytes (deleted)
    UNAVAILABLE = "unavailable"  # not tried: the breaker of this location is open


class StorageUnavailableError(ConnectionError):
    """An operation the open breaker failed fast, without touching the network."""


# Backend failures that say the endpoint is unreachable or unresponsive: they trip the breaker.
TRIPS_BREAKER = frozenset({ErrorKind.TIMEOUT, ErrorKind.REFUSED})
_CONN_ERRNOS = frozenset({errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.EHOSTUNREACH,
                          errno.ENETUNREACH, errno.ENETDOWN, errno.EPIPE})
_TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.EAGAIN, errno.EBUSY})
_TRANSIENT_HTTP = frozenset({408, 429, 500, 502, 503, 504})


def _http_code(e: BaseException) -> int | None:
    """The HTTP status of a gcsfs ``HttpError`` (or any error carrying an int ``code``/``status``)."""
    for attr in ("code", "status"):
        v = getattr(e, attr, None)
        if isinstance(v, str) and v.isdigit():
            v = int(v)
        if isinstance(v, int) and not isinstance(v, bool) and 100 <= v < 600:
            return v
    return None


def _is_connection_error(e: BaseException) -> bool:
    if isinstance(e, ConnectionError):  # refused, reset, aborted, broken pipe
        return True
    if any(c.__name__ == "ClientConnectionError" for c in type(e).__mro__):  # aiohttp
        return True
    return isinstance(e, OSError) and e.errno in _CONN_ERRNOS


def is_refusal(e: BaseException) -> bool:
    """Whether ``e`` is a refused connection (``ECONNREFUSED``: builtin, or aiohttp's connector
    error, which carries the errno of the ``OSError`` it wraps)."""
    return isinstance(e, ConnectionRefusedError) or (isinstance(e, OSError) and e.errno == errno.ECONNREFUSED)


def classify(e: BaseException, *, on_root: bool = False) -> ErrorKind:
    """The kind of the error ``e`` that one object operation raised. ``on_root``: a write or a
    listing, which do not need the path to exist, so "not found" can only be a missing bucket."""
    if isinstance(e, StorageUnavailableError):
        return ErrorKind.UNAVAILABLE
    if isinstance(e, (TimeoutError, BlockingIOError)):  # asyncio's, fsspec's, aiohttp's timeouts
        return ErrorKind.TIMEOUT
    if isinstance(e, PermissionError):
        return ErrorKind.PERMISSION
    code = None if isinstance(e, OSError) else _http_code(e)
    if code in (401, 403):
        return ErrorKind.PERMISSION
    if isinstance(e, FileNotFoundError) or code == 404:
        return ErrorKind.MISSING_BUCKET if on_root else ErrorKind.MISSING
    if _is_connection_error(e):
        return ErrorKind.REFUSED
    return ErrorKind.OTHER


def is_transient(e: BaseException) -> bool:
    """Whether our retry policy tries the operation again (within its deadline): connection
    errors (reset, aborted, unreachable), 408/429/5xx, EIO-like errors. Never a refused
    connection (nothing listens: certain for longer than a retry waits; the breaker's probe finds
    out when it listens again), timeouts (the deadline is spent), missing objects, lost write
    races, permissions or anything that is not an ``OSError`` or HTTP error."""
    kind = classify(e)
    if kind is ErrorKind.REFUSED:
        return not is_refusal(e)
    if kind is not ErrorKind.OTHER:
        return False
    if isinstance(e, OSError):
        return e.errno in _TRANSIENT_ERRNOS
    return _http_code(e) in _TRANSIENT_HTTP or any(c.__name__ == "ClientError" for c in type(e).__mro__)
