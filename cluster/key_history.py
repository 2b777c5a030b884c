"""Match keys a client already sent, so a new key can refer to one as its prefix (wire format).

A multi-turn prompt is the previous turn's prompt plus a few hundred new tokens; sending it whole
every turn makes the token ids dominate a Ray ``step``. Client and head therefore keep the same
bounded, ordered history of the match keys of one client *session*: every step appends its match
keys (in call order, after resolving references), oldest entries leave first once the entries' charge
(their tokens plus ``ENTRY_TOKENS`` each) exceeds ``cap_tokens``. A new key is sent as (entry id,
tokens of that entry it starts with) + its remaining tokens.

The copies stay identical because both sides commit a step's keys together with a step counter:
the client commits when it gets the step's answer, the head when it runs the step. The client
sends (session, steps committed); the head serves a session only at exactly that count and creates
one only at step 0, otherwise it answers "resync" and runs nothing; the client then starts a new
session and sends the step without references. Any lost or failed call also starts a new session.
Same session and same count therefore means the same entries, so an entry id never names other
tokens on the head than on the client.

Why a reference is never a wrong key: entry ids are assigned in commit order on both sides and an entry
never changes, so an id the head still holds names the tokens the client sent under it; an id it does not
hold (evicted by another rule, a head restarted or a session dropped) makes the head answer "resync",
never a guess. The two sides need not evict alike for this: a difference only costs a resync.

Memory (both bounds in int32 tokens, 4 bytes each): a session holds at most ``cap_tokens`` of charge
(default ``DEFAULT_CAP_TOKENS``: 16 MiB of token bytes, plus the per-entry objects the charge covers);
the client keeps one session per transport, the head at most ``MAX_SESSIONS`` sessions of at most
``MAX_CAP_TOKENS`` each (256 MiB of tokens in all), least recently used leaving first.

Ownership: ``SentKeys`` belongs to one ``RayTransport`` (serving process, not thread-safe) and holds
private copies of the keys; ``KeyHistories`` belongs to the head actor (control thread) and bounds
the sessions it keeps.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Generic, TypeVar

import numpy as np

BLOCK = 16  # references cover whole blocks of an entry (a multiple of every usual page size)
MAX_SCAN_BLOCKS = 128  # a key looks for an entry ending at most this many blocks (2048 tokens) before its end
ANCHOR = 8  # blocks between the positions an entry is indexed at (a find probes once per ANCHOR new blocks)
MAX_CANDIDATES = 8  # entries kept per anchor block (the newest): what one probe checks at most
DEFAULT_CAP_TOKENS = 4 << 20  # per session: 16 MiB of int32 on each side
MAX_CAP_TOKENS = 4 << 20
MAX_SESSIONS = 16  # per head
# An entry is charged its tokens plus this many (256 bytes: about the Python objects holding it on either
# side), so a history of short or empty keys stays within its cap too: at most cap_tokens / ENTRY_TOKENS entries.
ENTRY_TOKENS = 64
_BLOCK_NBYTES = BLOCK * 4
_Entry = TypeVar("_Entry")
_SentEntry = tuple[bytes, bytes | None]  # (token bytes, its anchor block: the index key)


class _History(Generic[_Entry]):
    """The ordered, bounded entries of one session (identical on client and head), each entry held as
    ``_Entry`` (the head: an int32 array; the client: token bytes and their index key)."""

    def __init__(self, session: int, cap_tokens: int) -> None:
        if not 0 < cap_tokens <= MAX_CAP_TOKENS:
            raise ValueError(f"cap_tokens must be in (0, {MAX_CAP_TOKENS}], got {cap_tokens}")
        self.session = session
        self.cap_tokens = cap_tokens
        self.steps = 0  # steps committed
        self.tokens = 0  # what the entries are charged: their tokens plus ENTRY_TOKENS each
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next = 0

    def _append(self, keys: list[_Entry]) -> None:
        """Appends a step's keys (private copies) in order and counts the step."""
        entries, size = self._entries, self._size
        entry_id, tokens, cap = self._next, self.tokens, self.cap_tokens
        for key in keys:
            entries[entry_id] = key
            tokens += size(key)
            self._added(entry_id, key)
            entry_id += 1
            while tokens > cap:
                old_id, old = entries.popitem(last=False)
                tokens -= size(old)
                self._removed(old_id, old)
        self._next, self.tokens = entry_id, tokens
        self.steps += 1

    @staticmethod
    def _size(entry: _Entry) -> int:
        """Tokens of an entry."""
        raise NotImplementedError

    def _added(self, entry_id: int, entry: _Entry) -> None:
        pass

    def _removed(self, entry_id: int, entry: _Entry) -> None:
        pass


class KeyHistory(_History[np.ndarray]):
    """The head's copy of one session: entries are token vectors. ``unchecked``: ids of the entries holding
    tokens that were not checked to be valid ids (a step whose buffer failed the check; normally none), so a
    key that refers to one is checked in full (``hicache.cluster.wire``)."""

    def __init__(self, session: int, cap_tokens: int) -> None:
        super().__init__(session, cap_tokens)
        self.unchecked: set[int] = set()

    def get(self, entry_id: int, num_tokens: int) -> np.ndarray | None:
        """The first ``num_tokens`` tokens of entry ``entry_id``; None if it is gone or shorter."""
        entry = self._entries.get(entry_id)
        if entry is None or entry.shape[0] < num_tokens:
            return None
        return entry[:num_tokens]

    def commit(self, keys: list[np.ndarray], unchecked: list[int] | None = None) -> None:
        """Appends a step's keys (private copies) in order and counts the step; ``unchecked``: the positions
        in ``keys`` of those whose tokens were not all checked."""
        first = self._next
        if unchecked:
            self.unchecked.update(first + i for i in unchecked)
        self._append(keys)

    def _removed(self, entry_id: int, entry: np.ndarray) -> None:
        if self.unchecked:
            self.unchecked.discard(entry_id)

    @staticmethod
    def _size(entry: np.ndarray) -> int:
        return len(entry) + ENTRY_TOKENS


class SentKeys(_History[_SentEntry]):
    """The client's copy, indexed to find an entry that is a prefix of a new key. Entries are the keys'
    token bytes (``tokens.tobytes()``: the one private copy a key needs, made while encoding it, also
    used to verify a match; committing copies nothing) with their anchor block (the index key).

    Anchors: an entry of ``n`` whole blocks is indexed under the content of its block ``(n - 1) // ANCHOR
    * ANCHOR`` (the last block at a multiple of ``ANCHOR``). A key that extends an entry by ``k`` blocks
    finds it at one of the key's own anchor positions at most ``k // ANCHOR + 1`` probes from its end: a
    probe per ``ANCHOR`` blocks of new tokens, not one per block. Several entries can share an anchor (a
    turn's prompt and its finished sequence, conversations that share a system prompt); each probe checks
    the newest ``MAX_CANDIDATES`` of them byte by byte (the index only narrows candidates)."""

    def __init__(self, cap_tokens: int = DEFAULT_CAP_TOKENS) -> None:
        super().__init__(int.from_bytes(os.urandom(8), "little") >> 1, cap_tokens)
        self._index: dict[bytes, list[int]] = {}  # an anchor block -> entries indexed under it, oldest first

    @staticmethod
    def _anchor(data: bytes) -> bytes | None:
        n = len(data) // _BLOCK_NBYTES
        if n == 0:
            return None
        a = (n - 1) // ANCHOR * ANCHOR * _BLOCK_NBYTES
        return data[a : a + _BLOCK_NBYTES]

    def _added(self, entry_id: int, entry: _SentEntry) -> None:
        anchor = entry[1]
        if anchor is not None:
            ids = self._index.get(anchor)
            if ids is None:
                self._index[anchor] = [entry_id]
            else:
                ids.append(entry_id)
                if len(ids) > MAX_CANDIDATES:
                    del ids[0]  # the oldest one is no longer a candidate (it stays an entry)

    def _removed(self, entry_id: int, entry: _SentEntry) -> None:
        anchor = entry[1]
        if anchor is not None:
            ids = self._index.get(anchor)
            if ids is not None and ids[0] == entry_id:  # entries leave oldest first
                del ids[0]
                if not ids:
                    del self._index[anchor]

    def get(self, entry_id: int, num_tokens: int) -> np.ndarray | None:
        """The first ``num_tokens`` tokens of entry ``entry_id`` (a read-only view of its bytes); None if it
        is gone or shorter."""
        entry = self._entries.get(entry_id)
        if entry is None or len(entry[0]) < 4 * num_tokens:
            return None
        return np.frombuffer(entry[0], np.int32, num_tokens)

    def find(self, tokens: np.ndarray, data: bytes | None = None) -> tuple[int, int]:
        """(entry id, n): the longest entry prefix (whole blocks, verified byte by byte) that ``tokens``
        (contiguous int32; ``data``: its ``tobytes()`` if the caller has it) starts with, among entries
        ending in its last ``MAX_SCAN_BLOCKS`` blocks; (-1, 0) when there is none."""
        top = tokens.shape[0] // BLOCK
        index = self._index
        if top == 0 or not index:
            return -1, 0
        if data is None:
            data = tokens.tobytes()
        entries, get, size = self._entries, index.get, _BLOCK_NBYTES
        low = max(1, top - MAX_SCAN_BLOCKS)  # fewest whole blocks an entry may have
        # Anchor positions from the key's end: an entry found at a higher one is longer than any below it.
        for a in range((top - 1) // ANCHOR * ANCHOR, (low - 1) // ANCHOR * ANCHOR - 1, -ANCHOR):
            ids = get(data[a * size : (a + 1) * size])
            if ids is None:
                continue
            best_id, best_n = -1, 0
            for entry_id in ids:
                entry = entries[entry_id][0]
                n = len(entry) // size
                if (best_n < n <= top and n >= low and (n - 1) // ANCHOR * ANCHOR == a
                        and data.startswith(memoryview(entry)[: n * size])):  # memcmp, no copy
                    best_id, best_n = entry_id, n
            if best_id >= 0:
                return best_id, best_n * BLOCK
        return -1, 0

    def commit(self, keys: list[bytes | np.ndarray]) -> None:
        """Appends a step's keys in order and counts the step, as private copies: token bytes as they are
        (``encode_calls`` made them), arrays (serving code may reuse them) as their int32 bytes."""
        anchor = self._anchor
        data = [k if type(k) is bytes else np.asarray(k, np.int32).tobytes() for k in keys]
        self._append([(d, anchor(d)) for d in data])

    commit_copies = commit

    @staticmethod
    def _size(entry: _SentEntry) -> int:
        return (len(entry[0]) >> 2) + ENTRY_TOKENS


class KeyHistories:
    """The head's copies, one per client session, at most ``MAX_SESSIONS`` (least recently used leave)."""

    def __init__(self) -> None:
        self._sessions: OrderedDict[int, KeyHistory] = OrderedDict()

    def for_step(self, session: int, steps: int, cap_tokens: int) -> KeyHistory | None:
        """The session's history if it has committed exactly ``steps`` steps (a new one for step 0);
        None: the copies may differ, the client must resync."""
        history = self._sessions.get(session)
        if history is None and steps == 0:
            history = self._sessions[session] = KeyHistory(session, min(cap_tokens, MAX_CAP_TOKENS))
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        if history is None or history.steps != steps:
            return None
        self._sessions.move_to_end(session)
        return history
