"""Ray metrics for a replica: ``hicache_*`` counters, gauges and histograms, tagged by replica.

Owned by the head (one exporter per replica; runs on the head's control thread). ``update`` turns the
head's monotonic ``cache_stats()`` into counter increments (deltas since the previous update) and
sets the gauges; ``observe_transfer`` feeds the transfer-latency histogram from worker acks. Ray's
metrics agent serves them in Prometheus format on each node's metrics export port (names get Ray's
``ray_`` prefix there), which the Ray dashboard and Grafana read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_LATENCY_BOUNDARIES = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
_DIRECTIONS = {"d2h": "l1_to_l2", "h2d": "l2_to_l1", "h2s": "l2_to_l3", "s2h": "l3_to_l2"}


class HeadMetrics:
    def __init__(self, replica: str) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        self.replica = replica
        tags = {"replica": replica}
        self.hit_tokens = Counter("hicache_hit_tokens", "Prompt tokens served from each tier", ("replica", "tier"))
        self.queried_tokens = Counter("hicache_queried_tokens", "Whole-page prompt tokens looked up", ("replica",))
        self.miss_tokens = Counter("hicache_miss_tokens", "Tokens not served, by reason", ("replica", "reason"))
        self.prompt_tokens = Counter("hicache_prompt_tokens", "Served requests' prompt tokens, each once, by fate: "
                                     "hit_l1 / hit_l2 / hit_l3 or the miss reason", ("replica", "fate"))
        self.bytes_moved = Counter("hicache_bytes_moved", "Bytes moved between tiers (all hosts)",
                                   ("replica", "direction"))
        self.transfer_failures = Counter("hicache_transfer_failures", "Transfers that failed on a host",
                                         ("replica",))
        self.evicted_tokens = Counter("hicache_evicted_tokens", "Tokens evicted per tier", ("replica", "tier"))
        self.prefetch = Counter("hicache_prefetch", "L3 prefetch outcomes (pages)", ("replica", "outcome"))
        self.l3_backup_pages = Counter("hicache_l3_backup_pages", "Pages stored to L3", ("replica", "outcome"))
        self.occupancy = Gauge("hicache_pool_tokens", "Tokens held per tier", ("replica", "tier"))
        self.capacity = Gauge("hicache_pool_capacity_tokens", "Capacity per tier", ("replica", "tier"))
        self.in_flight = Gauge("hicache_transfers_in_flight", "Transfers sent and not yet acked", ("replica",))
        self.latency = Histogram("hicache_transfer_latency_seconds", "Transfer duration on a host",
                                 _LATENCY_BOUNDARIES, ("replica", "direction", "host"))
        self.l3_errors = Counter("hicache_l3_errors", "L3 operations that failed, by kind: timeout, refused, "
                                 "missing_bucket, permission, other, corrupt_in_transit, corrupt_at_rest, "
                                 "unavailable (failed fast: breaker open) (all hosts)", ("replica", "kind"))
        self.l3_available = Gauge("hicache_l3_available", "1 while the hosts' L3 breaker is closed (requests "
                                  "ask L3), 0 while it is open or probing", ("replica",))
        self.drain_pages = Gauge("hicache_drain_pages", "Preemption drain: pages L3 lacked when it started "
                                 "(candidate), sent, stored (drained), not stored yet (left, every round) and not stored by "
                                 "the deadline (not_fitted), of those on paths longer than one backup (oversized)", ("replica", "kind"))
        for metric in (self.hit_tokens, self.queried_tokens, self.miss_tokens, self.prompt_tokens, self.bytes_moved,
                       self.transfer_failures, self.evicted_tokens, self.prefetch, self.l3_backup_pages,
                       self.occupancy, self.capacity, self.in_flight, self.latency, self.l3_errors, self.l3_available,
                       self.drain_pages):
            metric.set_default_tags(tags)
        self._last: dict[tuple[str, ...], float] = {}

    def _inc(self, counter, key: tuple[str, ...], total: float, tags: Mapping[str, str] | None = None) -> None:
        delta = total - self._last.get(key, 0)
        if delta > 0:
            counter.inc(delta, tags=dict(tags or {}))
        self._last[key] = total

    def update(self, stats: Mapping[str, Any]) -> None:
        """Exports a ``CacheHead.cache_stats()`` snapshot (counters as deltas since the last one)."""
        self.occupancy.set(stats["device_tokens"], tags={"tier": "l1"})
        self.capacity.set(stats["device_capacity_tokens"], tags={"tier": "l1"})
        for fate, tokens in stats.get("prompt_tokens", {}).items():
            self._inc(self.prompt_tokens, ("prompt", fate), tokens, {"fate": fate})
        if "host_tokens" not in stats:
            return
        self.occupancy.set(stats["host_tokens"], tags={"tier": "l2"})
        self.capacity.set(stats["host_capacity_tokens"], tags={"tier": "l2"})
        self.in_flight.set(stats["in_flight"])
        self._inc(self.queried_tokens, ("queried",), stats["queried_tokens"])
        l3 = stats.get("storage", {})
        l3_tokens = l3.get("prefetch_pages", 0) * stats.get("page_size", 1)
        self._inc(self.hit_tokens, ("hit", "l1"), stats["device_hit_tokens"], {"tier": "l1"})
        self._inc(self.hit_tokens, ("hit", "l2"), stats["host_hit_tokens"], {"tier": "l2"})
        self._inc(self.hit_tokens, ("hit", "l3"), l3_tokens, {"tier": "l3"})
        for reason, tokens in stats["miss_tokens"].items():
            self._inc(self.miss_tokens, ("miss", reason), tokens, {"reason": reason})
        for kind, moved in stats["bytes_moved"].items():
            direction = _DIRECTIONS.get(kind, kind)
            self._inc(self.bytes_moved, ("bytes", direction), moved, {"direction": direction})
        self._inc(self.transfer_failures, ("failures",), stats["transfer_failures"])
        self._inc(self.evicted_tokens, ("evicted", "l1"), stats.get("device_evicted_tokens", 0), {"tier": "l1"})
        self._inc(self.evicted_tokens, ("evicted", "l2"), stats["host_evicted_tokens"], {"tier": "l2"})
        if l3:
            for outcome, key in (("fetched", "prefetch_pages"), ("redundant", "prefetch_redundant_pages")):
                self._inc(self.prefetch, ("prefetch", outcome), l3.get(key, 0), {"outcome": outcome})
            self._inc(self.prefetch, ("prefetch", "failed"), l3.get("prefetch_failures", 0), {"outcome": "failed"})
            for outcome, key in (("stored", "backup_pages"), ("skipped", "backup_skipped_pages")):
                self._inc(self.l3_backup_pages, ("l3", outcome), l3.get(key, 0), {"outcome": outcome})
            for kind, count in stats.get("storage_errors", {}).items():
                self._inc(self.l3_errors, ("l3err", kind), count, {"kind": kind})
            self.l3_available.set(1 if stats.get("storage_breaker", "closed") == "closed" else 0)
        drain = stats.get("drain")
        if drain is not None:
            for kind in ("candidate", "sent", "drained", "left", "not_fitted", "oversized"):
                self.drain_pages.set(drain[f"{kind}_pages"], tags={"kind": kind})

    def observe_transfer(self, kind: str, seconds: float, host: int = 0) -> None:
        self.latency.observe(seconds, tags={"direction": _DIRECTIONS.get(kind, kind), "host": str(host)})
