"""The manifest: which token prefixes a namespace has stored, for a warm restart of a head's tree.

An entry is one small write-once object per stored prefix (full pages only), holding the prefix's
tokens (int64 LE) behind the usual self-verifying header (``format``, kind ``MANIFEST``, keyed by
the namespace seed)::

    {base}/manifest/{namespace[0]}/{namespace[:32]}-{entry_tag}

``entry_tag`` is SHA-256 of the namespace seed and the tokens: equal entries share one name (a
second record is a no-op), and a reader checks that an entry's content matches its name. A longer
prefix is a new entry beside the shorter ones; ``longest_first`` drops entries that prefix another.
Sixteen fan-out directories by the namespace digest's first hex digit; a namespace's entries are
one listing of its directory.

An entry that fails verification is re-read before anyone calls it corrupt (``corruption``): an
entry cut or flipped in transit is a skipped entry this time, never a deleted one.

Threads: ``record`` and ``read`` are called on the calling thread of ``FsspecStorage``'s
``record_prefix`` / ``list_prefixes``; their objects are listed, written and read through
``BatchIO`` (I/O threads or the filesystem's loop) under the caller's deadline.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, NamedTuple

import numpy as np

from hicache.storage.base import StoredPrefix
from hicache.storage.batch_io import BatchIO, Deadline
from hicache.storage.corruption import Verdict, note_failure, recheck
from hicache.storage.format import CorruptObjectError, HeaderEncoder, ObjectKind, ObjectMeta, declared_num_pages, decode
from hicache.storage.keys import Namespace


def entry_tag(seed: bytes, tokens: np.ndarray) -> str:
    """A manifest entry's name tag: SHA-256 of the namespace seed and the entry's tokens (int64 LE),
    hex. One hash over the tokens, not the chain's page by page (the name only has to be a pure
    function of the entry)."""
    return hashlib.sha256(seed + tokens.astype("<i8", copy=False).tobytes()).hexdigest()


class Entries(NamedTuple):
    tokens: list[np.ndarray]  # the valid entries' tokens
    failed: list[tuple[str, BaseException]]  # (path, error) of entries that could not be read
    corrupt: list[Verdict]  # entries whose first read failed verification, and what the re-read found


class Manifest:
    def __init__(self, base: str, fingerprint_digest: bytes, page_size: int, io: BatchIO) -> None:
        self.dir = f"{base}/manifest"
        self._fp = fingerprint_digest
        self._page_size = page_size
        self._io = io
        self._header = HeaderEncoder(ObjectKind.MANIFEST, fingerprint_digest, "int64", ())

    def location(self, namespace: Namespace) -> tuple[str, str]:
        """(directory, name prefix) of ``namespace``'s entries."""
        h = namespace.hexdigest()
        return f"{self.dir}/{h[0]}", f"{h[:32]}-"

    def record(self, namespace: Namespace, tokens: np.ndarray, deadline: Deadline) -> Any:
        """Writes the entry of ``tokens`` (int64, whole pages): True (written), False (stored
        already) or the exception."""
        seed = namespace.seed()
        d, name = self.location(namespace)
        path = f"{d}/{name}{entry_tag(seed, tokens)}"
        header = self._header

        def make() -> tuple[bytes, np.ndarray]:
            return header.encode(seed, 0, len(tokens), tokens.view(np.uint8)), tokens

        return self._io.write_many([(path, make)], deadline)[0]

    def read(self, namespace: Namespace, deadline: Deadline) -> Entries:
        """Every valid entry of ``namespace``. Listing errors raise; an entry that cannot be read
        is in ``failed``; one that fails verification is re-read (``corrupt``, and its tokens are
        used if the re-read verifies); one whose content does not match its name (copied,
        renamed) is skipped."""
        d, name = self.location(namespace)
        paths = sorted(p for p in self._io.list(d, deadline) if os.path.basename(p).startswith(name))
        seed = namespace.seed()

        def verify(i: int, raw: Any) -> np.ndarray:
            n = declared_num_pages(raw)  # a cut entry then reads SHORT, not a different entry
            meta = ObjectMeta(ObjectKind.MANIFEST, self._fp, seed, 0, n, "int64", ())
            return np.frombuffer(decode(raw, meta, payload_len=n * 8), dtype="<i8").copy()

        def post(i: int, raw: Any) -> np.ndarray:
            try:
                return verify(i, raw)
            except CorruptObjectError as e:
                raise note_failure(e, raw) from None

        out = Entries([], [], [])
        read: list[tuple[str, Any]] = []
        bad: list[tuple[str, CorruptObjectError]] = []
        for path, r in zip(paths, self._io.read_many(paths, post, deadline)):
            if isinstance(r, CorruptObjectError):
                bad.append((path, r))
            else:
                read.append((path, r))
        for r, verdict in recheck(self._io, [p for p, _ in bad], [e for _, e in bad], verify, deadline):
            out.corrupt.append(verdict)
            read.append((verdict.path, r))
        for path, r in read:
            if isinstance(r, BaseException):
                if not isinstance(r, CorruptObjectError):
                    out.failed.append((path, r))
            elif len(r) and len(r) % self._page_size == 0 and entry_tag(seed, r) == os.path.basename(path)[len(name):]:
                out.tokens.append(r)
        return out


def longest_first(prefixes: list[StoredPrefix]) -> list[StoredPrefix]:
    """``prefixes`` longest first, without those that are a prefix of a longer one (inserting
    them into a tree after the longer one would change nothing)."""
    kept: list[StoredPrefix] = []
    tips: set[str] = set()
    for sp in sorted(prefixes, key=lambda sp: -sp.num_pages):
        if sp.keys[-1] not in tips:
            kept.append(sp)
            tips.update(sp.keys)
    return kept
