"""``StorageConfig``: the options of one ``FsspecStorage`` (frozen; validated when built).

Pure data: read by the store when it is built and on every call (deadline, chunk size), never
changed after.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

MiB = 1 << 20
# Default object size by URL scheme: large objects on gs:// (a new bucket ramps to ~1000 writes/s
# and every request has a fixed latency), smaller ones where a write is cheap.
DEFAULT_TARGET_OBJECT_BYTES: Mapping[str, int] = {"file": 4 * MiB, "local": 4 * MiB, "memory": 1 * MiB, "gs": 16 * MiB, "gcs": 16 * MiB}
FALLBACK_TARGET_OBJECT_BYTES = 8 * MiB  # any other scheme


@dataclasses.dataclass(frozen=True)
class StorageConfig:
    timeout_s: float = 30.0  # default deadline of one call (exists/get/set)
    io_threads: int = 8  # sync backends: worker threads; async: max concurrent requests / 4
    max_pending_ops: int | None = None  # sync backends: cap on abandoned, still-running ops (8 * io_threads)
    target_object_bytes: int | None = None  # None → DEFAULT_TARGET_OBJECT_BYTES[scheme]
    pages_per_object: int | None = None  # overrides target_object_bytes for every pool
    write_partial_chunks: bool = True  # store the tail of a sequence that ends mid-chunk
    max_bytes: int | None = None  # file:// only: byte cap over the whole root, LRU eviction
    evict_low_watermark: float = 0.9  # evict down to this fraction of max_bytes
    max_inflight_bytes: int = 256 * MiB  # batch_set gathers from the pool in groups this large
    delete_corrupt: bool = True  # remove objects that fail verification so they can be rewritten
    storage_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if isinstance(self.io_threads, bool) or not isinstance(self.io_threads, int) or self.io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {self.io_threads!r}")
        for name in ("target_object_bytes", "pages_per_object", "max_bytes", "max_pending_ops"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        if isinstance(self.max_inflight_bytes, bool) or not isinstance(self.max_inflight_bytes, int) or self.max_inflight_bytes < 1:
            raise ValueError(f"max_inflight_bytes must be a positive int, got {self.max_inflight_bytes!r}")
        if not 0.0 < self.evict_low_watermark <= 1.0:
            raise ValueError(f"evict_low_watermark must be in (0, 1], got {self.evict_low_watermark!r}")

    def object_bytes_for(self, scheme: str) -> int:
        """Target object size on ``scheme``: ``target_object_bytes`` or the scheme's default."""
        return self.target_object_bytes or DEFAULT_TARGET_OBJECT_BYTES.get(scheme, FALLBACK_TARGET_OBJECT_BYTES)
