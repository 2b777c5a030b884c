"""The manifest entries one store wrote, by lineage: which of them a longer entry supersedes.

A conversation's stored path grows turn by turn, and every stored path gets a manifest entry (one small
file, ``FsspecStorage.record_prefix``). A longer entry makes the entries of its prefixes redundant: a
warm restart lists the longest first and its storage-only tree entries cover their prefixes. So on a
local filesystem ``record_prefix`` moves the file of the longest entry this store wrote that is a
strict prefix of the new one to the new entry's name (hidden while it is rewritten,
``_LocalBackend.supersede_local``) instead of creating a file: creating an inode is the costly part
of an entry on this kind of host (ext4 without a journal: 20 us to over 1 ms of kernel CPU per file,
depending on how many inodes other processes freed in the last 30 s), a rename, a rewrite and a
link cost tens of us. A lineage also keeps one entry file, not one per turn.

Only entries this process wrote are moved (another writer's entry is never touched). ``OwnEntries``
is owned by one ``FsspecStorage``; bounded (LRU, ``capacity`` entries); thread-safe (its own lock).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

_Key = tuple[str, int, bytes]  # (namespace name prefix, entry length in tokens, its last page's tokens)


class OwnEntries:
    def __init__(self, page_size: int, capacity: int = 1024) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        self.page_size, self.capacity = page_size, capacity
        self._entries: OrderedDict[_Key, tuple[str, np.ndarray]] = OrderedDict()  # key -> (path, tokens)
        self._lengths: dict[str, dict[int, int]] = {}  # name prefix -> entry length -> how many entries
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def _key(self, name: str, tokens: np.ndarray, length: int) -> _Key:
        return name, length, tokens[length - self.page_size : length].tobytes()

    def add(self, name: str, tokens: np.ndarray, path: str) -> None:
        """This store wrote the entry ``path`` of ``tokens`` (whole pages) in namespace ``name``."""
        key = self._key(name, tokens, len(tokens))
        with self._lock:
            if key not in self._entries:
                lengths = self._lengths.setdefault(name, {})
                lengths[key[1]] = lengths.get(key[1], 0) + 1
            self._entries[key] = (path, tokens.copy())
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._forget(*self._entries.popitem(last=False))

    def take_ancestor(self, name: str, tokens: np.ndarray) -> str | None:
        """The path of the longest entry this store wrote in ``name`` whose tokens are a strict prefix
        of ``tokens`` (whole pages), forgotten here (the caller moves it); None if there is none."""
        with self._lock:
            lengths = self._lengths.get(name)
            if not lengths:
                return None
            n = len(tokens)
            for length in sorted((x for x in lengths if x < n), reverse=True):
                key = self._key(name, tokens, length)
                entry = self._entries.get(key)
                if entry is not None and np.array_equal(entry[1], tokens[:length]):
                    del self._entries[key]
                    self._forget(key, entry)
                    return entry[0]
            return None

    def _forget(self, key: _Key, _entry: tuple[str, np.ndarray]) -> None:
        name, length = key[0], key[1]
        lengths = self._lengths[name]
        lengths[length] -= 1
        if not lengths[length]:
            del lengths[length]
            if not lengths:
                del self._lengths[name]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._lengths.clear()
