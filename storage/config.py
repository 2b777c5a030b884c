"""``StorageConfig``: the options of one ``FsspecStorage`` (frozen; validated when built).

Pure data: read by the store when it is built and on every call (deadline, chunk size), never
changed after.

Deadlines (each holds whatever the client library does: operations still running at the deadline
are abandoned (threads) or cancelled (gcsfs' loop), retries and their backoff stop there):

- ``timeout_s``: a data call the caller gives no ``timeout_s=``: ``batch_get``, ``batch_set``,
  ``record_prefix``.
- ``exists_timeout_s``: ``batch_exists`` / ``exists`` without ``timeout_s=``: the existence check
  runs while a request waits, so it is short; ``min(exists_timeout_s, timeout_s)`` applies.
- ``list_timeout_s``: ``list_prefixes`` (manifest listing, entry reads and their existence checks
  together) and ``clear``.
- ``close_timeout_s``: how long ``close`` waits for operations in flight before cancelling them.

Local I/O (``local_io``): a file:// root on this host's own disk (``object_store.on_local_disk``)
runs each call's I/O on the calling thread (``batch_io.InlineBatchIO``): a local file operation
takes microseconds, less than handing it to an I/O thread; the callers are background threads
already (a worker's storage lanes, the head's query and manifest threads). Any other root, and
``LocalIO.THREADS``, uses I/O threads and abandons what the deadline passes.

Breaker (``breaker``): ``breaker_threshold`` calls with a timeout or connection error within
``breaker_window_s`` open it (a call counts once, whatever its rounds; a round of refusals opens it at
once); ``breaker_cooldown_s`` later one probe call goes through.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

MiB = 1 << 20
# Default object size by URL scheme: large objects on gs:// (a new bucket ramps to ~1000 writes/s
# and every request has a fixed latency), smaller ones where a write is cheap.
DEFAULT_TARGET_OBJECT_BYTES: Mapping[str, int] = {"file": 4 * MiB, "local": 4 * MiB, "memory": 1 * MiB, "gs": 16 * MiB, "gcs": 16 * MiB}
FALLBACK_TARGET_OBJECT_BYTES = 8 * MiB  # any other scheme


class LocalIO(str, enum.Enum):
    """Where a file:// root's I/O runs (module docstring)."""

    AUTO = "auto"  # on the calling thread if the root is on this host's own disk, else I/O threads
    INLINE = "inline"  # on the calling thread (a local root the mount table does not name, e.g.)
    THREADS = "threads"  # on I/O threads, with deadlines that abandon a hung call


@dataclasses.dataclass(frozen=True)
class StorageConfig:
    timeout_s: float = 30.0  # deadline of batch_get / batch_set / record_prefix (module docstring)
    exists_timeout_s: float = 0.5  # deadline of batch_exists / exists (capped by timeout_s)
    list_timeout_s: float = 10.0  # deadline of list_prefixes and clear
    close_timeout_s: float = 5.0  # close waits this long for operations in flight, then cancels
    retries: int = 2  # extra attempts of an operation after a transient error, within its deadline
    retry_backoff_s: float = 0.05  # first backoff; doubles per attempt; never past the deadline
    breaker_threshold: int = 3  # failed calls (timeouts / connection errors) within breaker_window_s that open it
    breaker_window_s: float = 10.0  # how long a failed call counts toward breaker_threshold
    breaker_cooldown_s: float = 5.0  # open breaker: fail fast this long, then let one probe through
    io_threads: int = 8  # sync backends: worker threads; async: max concurrent requests / 4
    local_io: LocalIO = LocalIO.AUTO  # file:// only: I/O on the calling thread or on I/O threads
    max_pending_ops: int | None = None  # sync backends: cap on abandoned, still-running ops (8 * io_threads)
    target_object_bytes: int | None = None  # None → DEFAULT_TARGET_OBJECT_BYTES[scheme]
    pages_per_object: int | None = None  # overrides target_object_bytes for every pool
    write_partial_chunks: bool = True  # store the tail of a sequence that ends mid-chunk
    # write a leading-page index entry beside each object and look there when a query's hit stops
    # inside a chunk whose first page's key it knows (``leading_index``); off: such a query loses
    # up to C-1 pages of that chunk, and a miss saves the listing (no extra round: it joins a probe)
    leading_page_index: bool = True
    max_bytes: int | None = None  # file:// only: byte cap over the whole root, LRU eviction
    evict_low_watermark: float = 0.9  # evict down to this fraction of max_bytes
    max_inflight_bytes: int = 256 * MiB  # batch_set gathers from the pool in groups this large
    delete_corrupt: bool = True  # remove objects proven corrupt at rest, so they can be rewritten
    # topology-free reads (``shard_cover``): look for other layouts' shard objects at most this often
    # (None: read this host's own shard objects only)
    layout_refresh_s: float | None = 30.0
    storage_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "local_io", LocalIO(self.local_io))
        except ValueError:
            raise ValueError(f"local_io must be one of {[m.value for m in LocalIO]}, got {self.local_io!r}") from None
        for name in ("timeout_s", "exists_timeout_s", "list_timeout_s", "close_timeout_s", "breaker_window_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be > 0, got {v!r}")
        for name in ("retry_backoff_s", "breaker_cooldown_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"{name} must be >= 0, got {v!r}")
        for name, least in (("io_threads", 1), ("retries", 0), ("breaker_threshold", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"{name} must be an int >= {least}, got {v!r}")
        for name in ("target_object_bytes", "pages_per_object", "max_bytes", "max_pending_ops"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        if isinstance(self.max_inflight_bytes, bool) or not isinstance(self.max_inflight_bytes, int) or self.max_inflight_bytes < 1:
            raise ValueError(f"max_inflight_bytes must be a positive int, got {self.max_inflight_bytes!r}")
        if self.layout_refresh_s is not None and (
                isinstance(self.layout_refresh_s, bool) or not isinstance(self.layout_refresh_s, (int, float))
                or not self.layout_refresh_s >= 0):
            raise ValueError(f"layout_refresh_s must be >= 0 or None, got {self.layout_refresh_s!r}")
        if not 0.0 < self.evict_low_watermark <= 1.0:
            raise ValueError(f"evict_low_watermark must be in (0, 1], got {self.evict_low_watermark!r}")

    def object_bytes_for(self, scheme: str) -> int:
        """Target object size on ``scheme``: ``target_object_bytes`` or the scheme's default."""
        return self.target_object_bytes or DEFAULT_TARGET_OBJECT_BYTES.get(scheme, FALLBACK_TARGET_OBJECT_BYTES)
