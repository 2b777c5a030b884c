"""Leading-page index: find an object of a chunk by its FIRST page, for a query that ends or diverges
inside it (``StorageConfig.leading_page_index``, on by default).

An object is named by the chain key of its last page (``chunking``), which a query that stops
inside the object cannot compute. Beside each object it writes, the store writes one small index
entry named by the object's first and last page keys (``Chunking.index_path``: under the chunk
size's ``i/{first key}/`` folder) holding the chain key of every page of the object. A query whose
hit stops inside a chunk whose first page's key it knows (its own, or the caller's
``chunk_start_key`` where the query starts inside the chunk) lists that one folder (in the same
round as the chunk's partial-object probes, so a miss costs no extra round), reads the entries (at
most ``MAX_CANDIDATES``, with their objects' existence checks in the same round), and takes the
object whose leading keys match its own chain furthest; the
object itself is then read whole and verified as usual (its header names its last key and position,
its checksum covers every page), and only the matching leading pages are used. The keys chain, so
a last key vouches for every earlier page of its object: an entry only says which pages to use.

Entry bytes: the keys, 32 bytes each, in page order, then XXH3-64 (u64 little-endian) of them. An
entry that fails its checks (length, checksum, first or last key against its name, more pages than
the chunk) is no candidate. Old objects have no entry: they just give no leading pages (L3 is a
cache). Pure functions; the store does the I/O, under the call's deadline and breaker.

Bounds per chunk a hit stops inside: one listing of the folder's first ``MAX_CANDIDATES + C``
names in name order (one request on gcs whatever the folder holds), at most ``MAX_CANDIDATES``
entry reads of ``32 * C + 8`` bytes each and as many existence checks. A folder
with more siblings (many chains diverging inside one chunk) gets the best of the first
``MAX_CANDIDATES`` in name order: at least the pages they all share, never pages of another chain.
Capacity: the file:// byte cap deletes an entry with its object (and any orphaned entry first,
``lru``); on gs:// lifecycle rules age entries out a little after their objects (written after
them): an entry whose object is gone is a miss (its object's existence is checked), never wrong KV.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Container, Sequence

import xxhash

_KEY_RE = re.compile(r"^[0-9a-f]{64}$")
MAX_CANDIDATES = 8  # index entries read per listed folder: objects sharing a chunk's first page
_SUM = struct.Struct("<Q")


def is_key(name: str) -> bool:
    """Whether a listed entry name is a chain key (anything else in the folder is no entry)."""
    return _KEY_RE.match(name) is not None


def encode(keys: list[str]) -> bytes:
    """Entry bytes of an object whose pages have chain keys ``keys`` (in page order)."""
    raw = b"".join(bytes.fromhex(k) for k in keys)
    return raw + _SUM.pack(xxhash.xxh3_64_intdigest(raw))


def decode(buf: bytes | bytearray | memoryview, first_key: str, last_key: str, max_pages: int) -> list[bytes] | None:
    """The page keys (32 bytes each) of a valid entry for the object from ``first_key`` to
    ``last_key``, or None."""
    mv = memoryview(buf).cast("B")
    n = (len(mv) - _SUM.size) // 32
    if n < 1 or n > max_pages or len(mv) != 32 * n + _SUM.size:
        return None
    raw = bytes(mv[: 32 * n])
    if _SUM.unpack_from(mv, 32 * n)[0] != xxhash.xxh3_64_intdigest(raw):
        return None
    keys = [raw[32 * i : 32 * (i + 1)] for i in range(n)]
    if keys[0].hex() != first_key or keys[-1].hex() != last_key:
        return None
    return keys


def matching(keys: list[bytes], query_keys: Sequence[str], offset: int) -> int:
    """How many leading ``keys`` the query's chain shares, where ``keys[i]`` is the query's page
    ``offset + i``: an object that starts before the query (``offset < 0``: the query starts inside
    its chunk) shares its pages before the query when it shares the query's first page (keys chain);
    0 when it shares none of the query's pages. (A lazy ``ChainKeys`` is hashed only as far as it
    is read.)"""
    skip = max(0, -offset)
    n = 0
    for i in range(skip, len(keys)):
        j = offset + i
        if j >= len(query_keys) or query_keys[j] != keys[i].hex():
            break
        n += 1
    return skip + n if n else 0


def candidates(paths: Sequence[str], probed: Container[str]) -> list[str]:
    """The last keys of the entries a folder listing shows, to read: valid names, not ``probed``
    already (objects ending inside the query are asked for by name), in name order, at most
    ``MAX_CANDIDATES`` (a folder with more siblings gives at most their best leading pages)."""
    names = sorted({p.rstrip("/").rsplit("/", 1)[-1] for p in paths})
    return [n for n in names if is_key(n) and n not in probed][:MAX_CANDIDATES]
