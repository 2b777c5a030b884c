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

import numpy as np

BLOCK = 16  # references cover whole blocks of an entry (a multiple of every usual page size)
MAX_SCAN_BLOCKS = 128  # a key looks for an entry ending at most this many blocks (2048 tokens) before its end
NEAR_BLOCKS = 32  # ... first among the last 32 (a turn's new tokens), then further back
DEFAULT_CAP_TOKENS = 4 << 20  # per session: 16 MiB of int32 on each side
MAX_CAP_TOKENS = 4 << 20
MAX_SESSIONS = 16  # per head


class KeyHistory:
    """The ordered, bounded entries of one session (identical on client and head)."""

    def __init__(self, session: int, cap_tokens: int) -> None:
        if not 0 < cap_tokens <= MAX_CAP_TOKENS:
            raise ValueError(f"cap_tokens must be in (0, {MAX_CAP_TOKENS}], got {cap_tokens}")
        self.session = session
        self.cap_tokens = cap_tokens
        self.steps = 0  # steps committed
        self.checked = True  # (head) every entry came from a buffer of valid token ids (``wire.run_step``)
        self.tokens = 0
        self._entries: OrderedDict[int, np.ndarray] = OrderedDict()
        self._next = 0

    def get(self, entry_id: int, num_tokens: int) -> np.ndarray | None:
        """The first ``num_tokens`` tokens of entry ``entry_id``; None if it is gone or shorter."""
        entry = self._entries.get(entry_id)
        if entry is None or entry.shape[0] < num_tokens:
            return None
        return entry[:num_tokens]

    def commit(self, keys: list[np.ndarray]) -> None:
        """Appends a step's keys (private copies) in order and counts the step."""
        for tokens in keys:
            entry_id, self._next = self._next, self._next + 1
            self._entries[entry_id] = tokens
            self.tokens += tokens.shape[0]
            self._added(entry_id, tokens)
            while self.tokens > self.cap_tokens:
                old_id, old = self._entries.popitem(last=False)
                self.tokens -= old.shape[0]
                self._removed(old_id, old)
        self.steps += 1

    def _added(self, entry_id: int, tokens: np.ndarray) -> None:
        pass

    def _removed(self, entry_id: int, tokens: np.ndarray) -> None:
        pass


_BLOCK_BYTES = np.dtype((np.void, BLOCK * 4))  # one block of int32 tokens as one bytes object


class SentKeys(KeyHistory):
    """The client's copy, indexed to find an entry that is a prefix of a new key."""

    def __init__(self, cap_tokens: int = DEFAULT_CAP_TOKENS) -> None:
        super().__init__(int.from_bytes(os.urandom(8), "little") >> 1, cap_tokens)
        self._index: dict[bytes, int] = {}  # an entry's last whole block -> the newest entry ending with it

    @staticmethod
    def _last_block(tokens: np.ndarray) -> bytes | None:
        end = tokens.shape[0] // BLOCK * BLOCK
        return tokens[end - BLOCK : end].tobytes() if end else None

    def _added(self, entry_id: int, tokens: np.ndarray) -> None:
        last = self._last_block(tokens)
        if last is not None:
            self._index[last] = entry_id

    def _removed(self, entry_id: int, tokens: np.ndarray) -> None:
        last = self._last_block(tokens)
        if last is not None and self._index.get(last) == entry_id:
            del self._index[last]

    def find(self, tokens: np.ndarray) -> tuple[int, int]:
        """(entry id, n): the longest entry prefix (whole blocks, verified token by token) that
        ``tokens`` (contiguous int32) starts with, among entries ending in its last ``MAX_SCAN_BLOCKS``
        blocks; (-1, 0) when there is none."""
        top = tokens.shape[0] // BLOCK
        low = max(0, top - MAX_SCAN_BLOCKS)
        index = self._index
        if top == 0 or not index:
            return -1, 0
        entries = self._entries
        near = max(low, top - NEAR_BLOCKS)
        for first, last in ((near, top), (low, near)):  # the usual hit ends near the key's end: look there first
            blocks = tokens[first * BLOCK : last * BLOCK].view(_BLOCK_BYTES).tolist()  # bytes objects, one numpy call
            for block in filter(index.__contains__, reversed(blocks)):  # longest first; the lookups run in C
                entry_id = index[block]
                entry = entries[entry_id]
                n = entry.shape[0] // BLOCK * BLOCK  # the entry ends with ``block``: at this block of ``tokens``?
                if (first * BLOCK < n <= last * BLOCK and blocks[n // BLOCK - first - 1] == block
                        and entry[:n].tobytes() == tokens[:n].tobytes()):  # two copies + memcmp: faster than array_equal
                    return entry_id, n
        return -1, 0

    def commit_copies(self, keys: list[np.ndarray]) -> None:
        """``commit`` of private copies (serving code may reuse its arrays)."""
        self.commit([k.copy() for k in keys])


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
