"""Match keys a client already sent, so a new key can refer to one as its prefix (wire format).

A multi-turn prompt is the previous turn's prompt plus a few hundred new tokens; sending it whole
every turn makes the token ids dominate a Ray ``step``. Client and head therefore keep the same
bounded, ordered history of the match keys of one client *session*: every step appends its match
keys (in call order, after resolving references), oldest entries leave first once the history holds
more than ``cap_tokens`` tokens. A new key is sent as (entry id, tokens of that entry it starts
with) + its remaining tokens.

The copies stay identical because both sides commit a step's keys together with a step counter:
the client commits when it gets the step's answer, the head when it runs the step. The client
sends (session, steps committed); the head serves a session only at exactly that count and creates
one only at step 0, otherwise it answers "resync" and runs nothing; the client then starts a new
session and sends the step without references. Any lost or failed call also starts a new session.
Same session and same count therefore means the same entries, so an entry id never names other
tokens on the head than on the client.

Ownership: ``SentKeys`` belongs to one ``RayTransport`` (serving process, not thread-safe) and holds
private copies of the keys; ``KeyHistories`` belongs to the head actor (control thread) and bounds
the sessions it keeps (``MAX_SESSIONS`` x ``MAX_CAP_TOKENS`` int32 tokens at most).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Generic, TypeVar

import numpy as np

BLOCK = 16  # references cover whole blocks of an entry (a multiple of every usual page size)
MAX_SCAN_BLOCKS = 128  # a key looks for an entry ending at most this many blocks (2048 tokens) before its end
DEFAULT_CAP_TOKENS = 4 << 20  # per session: 16 MiB of int32 on each side
MAX_CAP_TOKENS = 4 << 20
MAX_SESSIONS = 16  # per head
_BLOCK_NBYTES = BLOCK * 4
_Entry = TypeVar("_Entry")
_SentEntry = tuple[bytes, bytes | None]  # (token bytes, its last whole block: the index key)


class _History(Generic[_Entry]):
    """The ordered, bounded entries of one session (identical on client and head), each entry held as
    ``_Entry`` (the head: an int32 array; the client: token bytes and their index key)."""

    def __init__(self, session: int, cap_tokens: int) -> None:
        if not 0 < cap_tokens <= MAX_CAP_TOKENS:
            raise ValueError(f"cap_tokens must be in (0, {MAX_CAP_TOKENS}], got {cap_tokens}")
        self.session = session
        self.cap_tokens = cap_tokens
        self.steps = 0  # steps committed
        self.tokens = 0
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
        return len(entry)


class SentKeys(_History[_SentEntry]):
    """The client's copy, indexed to find an entry that is a prefix of a new key. Entries are the keys'
    token bytes (``tokens.tobytes()``: the one private copy a key needs, made while encoding it, also
    used to verify a match; committing copies nothing) with their last whole block (the index key)."""

    def __init__(self, cap_tokens: int = DEFAULT_CAP_TOKENS) -> None:
        super().__init__(int.from_bytes(os.urandom(8), "little") >> 1, cap_tokens)
        self._index: dict[bytes, int] = {}  # an entry's last whole block -> the newest entry ending with it

    @staticmethod
    def _last_block(data: bytes) -> bytes | None:
        end = len(data) // _BLOCK_NBYTES * _BLOCK_NBYTES
        return data[end - _BLOCK_NBYTES : end] if end else None

    def _added(self, entry_id: int, entry: _SentEntry) -> None:
        if entry[1] is not None:
            self._index[entry[1]] = entry_id

    def _removed(self, entry_id: int, entry: _SentEntry) -> None:
        last = entry[1]
        if last is not None and self._index.get(last) == entry_id:
            del self._index[last]

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
        # Longest first: the usual hit ends a few blocks before the key's end (a turn's new tokens), and a
        # probe is one slice and one dict lookup.
        for n in range(top, max(0, top - MAX_SCAN_BLOCKS), -1):
            entry_id = get(data[(n - 1) * size : n * size])
            if entry_id is None:
                continue
            entry = entries[entry_id][0]
            if len(entry) // size == n and data.startswith(memoryview(entry)[: n * size]):  # memcmp, no copy
                return entry_id, n * BLOCK
        return -1, 0

    def commit(self, keys: list[bytes | np.ndarray]) -> None:
        """Appends a step's keys in order and counts the step, as private copies: token bytes as they are
        (``encode_calls`` made them), arrays (serving code may reuse them) as their int32 bytes."""
        last_block = self._last_block
        data = [k if type(k) is bytes else np.asarray(k, np.int32).tobytes() for k in keys]
        self._append([(d, last_block(d)) for d in data])

    commit_copies = commit

    @staticmethod
    def _size(entry: _SentEntry) -> int:
        return len(entry[0]) >> 2


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
