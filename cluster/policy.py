"""HiCache settings: write policy, L2 size, load-back limits, timeouts (frozen; validated on creation)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class WritePolicy(str, Enum):
    WRITE_THROUGH = "write_through"  # back a node up to L2 when it is first inserted
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # ... when it is hit the second time
    WRITE_BACK = "write_back"  # ... only when it is evicted from L1


@dataclass(frozen=True)
class HiCacheConfig:
    host_slots: int  # L2 capacity in pages (one slot holds one page of every layer, K and V)
    write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH
    write_through_threshold: int = 2  # hits before a selective backup
    load_back_threshold: int = 0  # tokens: shorter host hits are recomputed instead of loaded
    ack_timeout_s: float = 30.0  # bound on every wait for worker acks
    # L1->L2 backups wait until this many pages are queued, then go as ONE op (a plan sent for loads leaves
    # them queued), or until ``backup_hold_calls`` below
    backup_batch_pages: int = 256
    # ... but at most this many ``check_hicache_events`` calls since the first of them was queued: a count,
    # not a time, so what a run sends does not depend on how fast the box schedules the head
    backup_hold_calls: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.host_slots, int) or isinstance(self.host_slots, bool) or self.host_slots <= 0:
            raise ValueError(f"host_slots must be a positive int, got {self.host_slots!r}")
        try:
            object.__setattr__(self, "write_policy", WritePolicy(self.write_policy))
        except ValueError:
            raise ValueError(
                f"unknown write policy {self.write_policy!r}; choose one of {[p.value for p in WritePolicy]}"
            ) from None
        if self.write_through_threshold < 1:
            raise ValueError(f"write_through_threshold must be >= 1, got {self.write_through_threshold}")
        if self.load_back_threshold < 0:
            raise ValueError(f"load_back_threshold must be >= 0, got {self.load_back_threshold}")
        if self.backup_batch_pages < 1:
            raise ValueError(f"backup_batch_pages must be >= 1, got {self.backup_batch_pages}")
        if not isinstance(self.backup_hold_calls, int) or self.backup_hold_calls < 1:
            raise ValueError(f"backup_hold_calls must be an int >= 1, got {self.backup_hold_calls!r}")
        if not self.ack_timeout_s > 0:
            raise ValueError(f"ack_timeout_s must be > 0, got {self.ack_timeout_s}")

    @property
    def backup_hits(self) -> int:
        """Hits (inserts over a node, its creation included) that trigger a backup; 0 = never on insert."""
        if self.write_policy is WritePolicy.WRITE_THROUGH:
            return 1
        if self.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            return self.write_through_threshold
        return 0
