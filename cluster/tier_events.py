"""Tier events and miss reasons of one replica: the radix tree's tier listener on the head.

The tree calls ``on_stored`` / ``on_removed`` (as ``RadixTree.listener``) whenever a node gains or
loses its L1 pages or its L2 copy; the controller adds ``loaded`` when a load-back is acked. Each
event is one packed int (``events.pack_event``) in a bounded log that ``take`` turns into ``KVEvent``
objects (off the hot path). Evictions also leave a ghost (parent node, first page of the key) so
``record_match`` can tell a miss of evicted data (``EVICTED_L1``/``EVICTED_L2``; ``EVICTED_L3`` when the
node was stored in L3 too, so a miss means L3 dropped it as well) from one of data never cached, or
cached in another namespace only (``NAMESPACE_DIFFERS``, asked of the tree on a miss from the root).
``last_miss_reason`` is that reason for the head's per-request explanation
(``hicache.cluster.token_account``). All of it runs on the head's one thread.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

from hicache.cluster.events import (
    EVENT_CODES,
    EVENT_ID_SHIFT,
    EVENT_TOKENS_SHIFT,
    CacheCounters,
    EventKind,
    KVEvent,
    MissReason,
    Tier,
    unpack_event,
)
from hicache.cluster.tree import MatchResult, RadixKey, TreeNode

MAX_EVENTS = 100_000  # events kept until taken (the oldest go first)
_MAX_GHOSTS = 65_536
# Event codes by the tier's name (what the tree's listener calls pass); events are packed ints (events.py).
_STORED_CODE = {t.value: EVENT_CODES[EventKind.STORED, t] for t in Tier}
_REMOVED_CODE = {t.value: EVENT_CODES[EventKind.REMOVED, t] for t in Tier}
_LOADED_CODE = EVENT_CODES[EventKind.STORED, Tier.DEVICE]
_ID, _TOKENS = EVENT_ID_SHIFT, EVENT_TOKENS_SHIFT
_DEVICE = Tier.DEVICE.value
_NOT_CACHED = MissReason.NOT_CACHED


class TierEvents:
    """The event log (``log``: packed ints, shared with ``HostTier``, which logs L2 evictions) and the
    ghosts of evicted nodes; ``record_match`` adds a match's hits and misses to ``counters``."""

    def __init__(self, page_size: int, counters: CacheCounters,
                 cached_elsewhere: Callable[[RadixKey], bool] | None = None, keep_events: bool = True) -> None:
        """``cached_elsewhere(key)``: whether another namespace holds ``key``'s first page (the tree's).
        ``keep_events=False``: only the ghosts and miss reasons (an L1-only head: nobody takes events)."""
        self.log: deque[int] = deque(maxlen=MAX_EVENTS if keep_events else 0)
        self.counters = counters
        self._ghosts: OrderedDict[tuple[int, bytes], MissReason] = OrderedDict()
        self._last_miss: tuple[MissReason, int] | None = None  # the last match's missing tokens, by reason
        self._page_size = page_size
        self._page_bytes = 4 * page_size  # int32 tokens: the first page of a key, as bytes
        self._cached_elsewhere = cached_elsewhere

    def on_stored(self, node: TreeNode, tier: str) -> None:
        self.log.append(node.id << _ID | node.num_tokens << _TOKENS | _STORED_CODE[tier])

    def on_removed(self, node: TreeNode, tier: str) -> None:
        self.log.append(node.id << _ID | node.num_tokens << _TOKENS | _REMOVED_CODE[tier])
        if tier == _DEVICE:
            if node.host_slots is not None:
                return  # demoted to host-only: still cached (the common L1 eviction under HiCache)
            reason = MissReason.EVICTED_L1
        elif node.device_pages is not None:
            return
        else:
            reason = MissReason.EVICTED_L3 if node.stored else MissReason.EVICTED_L2
        parent = node.parent
        if parent is not None:
            ghosts = self._ghosts
            ghost = (parent.id, node.key_bytes[: self._page_bytes])
            ghosts[ghost] = reason
            ghosts.move_to_end(ghost)
            if len(ghosts) > _MAX_GHOSTS:
                ghosts.popitem(last=False)

    def loaded(self, node: TreeNode) -> None:
        """``node`` has its L1 pages again (an acked load-back)."""
        self.log.append(node.id << _ID | node.num_tokens << _TOKENS | _LOADED_CODE)

    def take(self) -> list[KVEvent]:
        events = [unpack_event(e) for e in self.log]
        self.log.clear()
        return events

    def record_match(self, key: RadixKey, m: MatchResult) -> None:
        """Counts the whole pages of ``key``: L1 hits, L2 hits, and misses by reason."""
        n = len(key.token_ids)
        whole = n - n % self._page_size
        device, host = m.device_hit_len, m.host_hit_len
        c = self.counters
        c.queried_tokens += whole
        c.device_hit_tokens += device
        c.host_hit_tokens += host
        missing = whole - device - host
        if missing > 0:
            reason = _NOT_CACHED
            if self._ghosts:
                pos = device + host
                page = key.token_ids[pos : pos + self._page_size].tobytes()
                reason = self._ghosts.get((m.best_match_node, page), reason)
            if reason is _NOT_CACHED and not device + host and self._cached_elsewhere is not None and self._cached_elsewhere(key):
                reason = MissReason.NAMESPACE_DIFFERS
            c.miss_tokens[reason] += missing
            self._last_miss = (reason, missing)
        else:
            self._last_miss = None

    @property
    def last_miss_reason(self) -> MissReason | None:
        """Why the last match's missing whole pages were missed (None: it missed none)."""
        return None if self._last_miss is None else self._last_miss[0]

    def move_last_miss(self, reason: MissReason) -> None:
        """The last match's missing tokens were missed for ``reason`` after all (L3 was down, not asked):
        they move there from the reason the match gave them. Once per match."""
        last, self._last_miss = self._last_miss, None
        if last is not None:
            self.counters.miss_tokens[last[0]] -= last[1]
            self.counters.miss_tokens[reason] += last[1]
