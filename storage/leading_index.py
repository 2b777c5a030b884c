"""Leading-page index: find an object of a chunk by its FIRST page, for a query that ends or diverges
inside it (opt-in: ``StorageConfig.leading_page_index``).

An object is named by the chain key of its last page (``chunking``), which a query that stops
inside the object cannot compute. Beside each object it writes, the store writes one small index
entry named by the object's first and last page keys (``Chunking.index_path``: under the chunk
size's ``i/{first key}/`` folder) holding the chain key of every page of the object. A query whose
hit stops inside a chunk whose first page it holds lists that one folder, reads the entries (at most
``MAX_CANDIDATES``), and takes the object whose leading keys match its own chain furthest; the
object itself is then read whole and verified as usual (its header names its last key and position,
its checksum covers every page), and only the matching leading pages are used. The keys chain, so
a last key vouches for every earlier page of its object: an entry only says which pages to use.

Entry bytes: the keys, 32 bytes each, in page order, then XXH3-64 (u64 little-endian) of them. An
entry that fails its checks (length, checksum, first or last key against its name, more pages than
the chunk) is no candidate. Old objects have no entry: they just give no leading pages (L3 is a
cache). Pure functions; the store does the I/O, under the call's deadline and breaker.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence

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
    """How many leading ``keys`` equal the query's keys from its index ``offset`` on (a lazy
    ``ChainKeys`` is hashed only as far as it is read)."""
    n = 0
    for i, k in enumerate(keys):
        j = offset + i
        if j >= len(query_keys) or query_keys[j] != k.hex():
            break
        n += 1
    return n
