"""L3 object format: a small self-verifying header followed by the raw payload.

Layout (little-endian)::

    off  size  field
      0     8  magic  b"HICKV\\x00\\r\\n"
      8     2  format_version (u16)            -- checked right after the magic
     10     2  header_len (u16)                -- 144 + 4*ndim + 32*num_links
     12     1  kind (u8: 1 = KV/state pages, 2 = manifest entry)
     13     1  ndim (u8) of the per-page shape
     14     2  link_every (u16): S, the spacing of the object's link names (0: none)
     16    32  model fingerprint digest
     48    32  object key (chain hash of the last page; manifest: namespace seed)
     80     8  first_page (u64, absolute page index of the first page in the chain)
     88     4  num_pages (u32; manifest: number of tokens)
     92     4  num_links (u32)
     96    16  dtype name, ASCII, NUL-padded (``np.dtype.name``, e.g. "bfloat16")
    112     8  payload_len (u64)
    120    16  XXH3-128(payload), canonical (big-endian) digest
    136 4*ndim per-page shape (u32 each)
      . 32*num_links  link keys: chain key of page first_page + c - 1, c in link_counts(...)
      .     8  XXH3-64(header bytes before this field), u64

The payload is ``num_pages`` pages, each ``prod(shape) * itemsize`` bytes, C order.

Links (v3, v4). A file:// object of more than S pages is also reachable under the chain key of
every S-th page inside it (hard links, ``fsspec_store``), so a query that ends or diverges inside
the object still reads its leading pages. The header lists those keys, so a reader that opened a
link checks that its name is bound to this object at that position (``decode(..., longer_ok=True)``)
exactly as a reader of the object's own name checks ``key``. v4 (``link_counts``): an object that
starts the chain (first_page 0) of more than 2 pages is also named at the chain's page 1, so every
stored chain of >= 2 pages is named there: a prefix query that needs >= 2 pages answers a miss with
one existence check (v3: one per object size below S, three for 2-page prefetch minimums).

Checksum: XXH3 (``xxhash``), not CRC32C. Version 1 used CRC32C; on this kind of host the
hardware CRC32C runs at ~15 GB/s on cached data and XXH3 at ~25-35 GB/s, and a local read from
the page cache copies at ~13 GB/s, so the checksum is the largest cost of an L3 hit after the
copy itself (measurements: ``benchmarks/storage_bench.py``). XXH3 detects accidental corruption
(torn writes, bit flips, truncation, misplaced objects); it is not a defence against a malicious
writer, and neither was CRC32C. Other format versions (v1 included) are never decoded: the
version is checked right after the magic and is part of every object path, so they are a clean
miss.

Buffers: ``encode_header`` (and ``HeaderEncoder.encode``, its per-pool form) returns a fresh
``bytes`` the caller owns; it never copies the payload (the writer sends header and payload as
two buffers). ``decode`` returns a zero-copy
``memoryview`` of the payload inside the caller's buffer; the caller keeps that buffer alive
while it uses the view. Any mismatch raises ``CorruptObjectError`` with a ``CorruptReason``;
callers turn it into a counted miss and never hand the bytes on.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import struct
from typing import Any

import numpy as np
import xxhash

MAGIC = b"HICKV\x00\r\n"
FORMAT_VERSION = 4
_FIXED = struct.Struct("<8sHHBBH32s32sQII16sQ16s")  # up to and including the payload digest
assert _FIXED.size == 136
_HEADER_SUM = struct.Struct("<Q")  # XXH3-64 of the header bytes before it
MAX_NDIM = 16
MAX_LINKS = (0xFFFF - _FIXED.size - 4 * MAX_NDIM - _HEADER_SUM.size) // 32  # header_len is a u16


def link_counts(first_page: int, num_pages: int, every: int) -> tuple[int, ...]:
    """Leading page counts ``c`` of an object's link names, ascending: the object of ``num_pages``
    pages from ``first_page`` is also named at the chain key of page ``first_page + c - 1`` (a link
    covers the object's first ``c`` pages). ``every`` = S: every S-th page inside it; an object that
    starts the chain also at its page 1 (v4). ``every`` 0: no links."""
    if not every:
        return ()
    counts = range(every, num_pages, every)
    if first_page == 0 and every > 2 and num_pages > 2:
        return (2, *counts)
    return tuple(counts)


class ObjectKind(enum.IntEnum):
    PAGES = 1
    MANIFEST = 2


class CorruptReason(str, enum.Enum):
    SHORT = "short"  # fewer bytes than the header or the header's payload_len announce
    TRAILING = "trailing"  # more bytes than announced
    BAD_MAGIC = "bad_magic"
    BAD_VERSION = "bad_version"
    BAD_HEADER = "bad_header"  # header checksum or impossible header fields
    BAD_KIND = "bad_kind"
    BAD_FINGERPRINT = "bad_fingerprint"
    BAD_KEY = "bad_key"  # object content belongs to another key / position
    BAD_SHAPE = "bad_shape"
    BAD_DTYPE = "bad_dtype"
    BAD_CHECKSUM = "bad_checksum"  # payload checksum


class CorruptObjectError(ValueError):
    """An L3 object failed verification; it must be treated as a miss."""

    def __init__(self, reason: CorruptReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason


def payload_digest(buf: bytes | bytearray | memoryview | np.ndarray) -> bytes:
    """16-byte XXH3-128 digest of any contiguous buffer, without copying it."""
    return xxhash.xxh3_128_digest(np.frombuffer(buf, dtype=np.uint8))


def payload_hasher() -> Any:
    """A streaming form of ``payload_digest``: ``update(buf)`` per part, then ``digest()``."""
    return xxhash.xxh3_128()


def _header_sum(buf: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(buf)


@dataclasses.dataclass(frozen=True)
class ObjectMeta:
    """What a reader expects (and a writer declares) about one object."""

    kind: ObjectKind
    fingerprint: bytes  # 32 bytes
    key: bytes  # 32 bytes
    first_page: int
    num_pages: int
    dtype: str
    shape: tuple[int, ...]  # per page
    num_links: int = 0  # link keys in the header (see the module docstring)

    def __post_init__(self) -> None:
        if len(self.fingerprint) != 32 or len(self.key) != 32:
            raise ValueError("fingerprint and key must be 32 bytes")
        if len(self.dtype.encode("ascii")) > 16:
            raise ValueError(f"dtype name too long for the header: {self.dtype!r}")
        if len(self.shape) > MAX_NDIM or any(int(d) < 0 or int(d) >= 2**32 for d in self.shape):
            raise ValueError(f"unsupported page shape {self.shape}")
        if self.first_page < 0 or not (0 <= self.num_pages < 2**32):
            raise ValueError(f"bad first_page/num_pages {self.first_page}/{self.num_pages}")
        if not 0 <= self.num_links <= MAX_LINKS:
            raise ValueError(f"bad num_links {self.num_links}")

    @property
    def header_len(self) -> int:
        return _FIXED.size + 4 * len(self.shape) + 32 * self.num_links + _HEADER_SUM.size

    def payload_len(self, itemsize: int) -> int:
        return self.num_pages * math.prod(self.shape) * itemsize


class HeaderEncoder:
    """Headers of objects that share kind, fingerprint, dtype, per-page shape and link spacing (one
    pool's objects): those fields are validated and packed once, not per object. ``encode`` is
    bit-identical to ``encode_header`` with the same fields. ``header_len``: without links."""

    def __init__(self, kind: ObjectKind, fingerprint: bytes, dtype: str, shape: tuple[int, ...], link_every: int = 0) -> None:
        probe = ObjectMeta(kind, fingerprint, bytes(32), 0, 0, dtype, tuple(shape))  # validates
        if isinstance(link_every, bool) or not isinstance(link_every, int) or not 0 <= link_every < 2**16:
            raise ValueError(f"link_every must be an int in [0, 65535], got {link_every!r}")
        self.header_len = probe.header_len
        self.link_every = link_every
        self._kind, self._fp, self._dtype = int(kind), fingerprint, dtype.encode("ascii")
        self._ndim = len(probe.shape)
        self._shape = struct.pack(f"<{self._ndim}I", *probe.shape)

    def encode(
        self, key: bytes, first_page: int, num_pages: int,
        payload: bytes | memoryview | np.ndarray | list[memoryview] | tuple[memoryview, ...],
        link_keys: tuple[bytes, ...] = (),
    ) -> bytes:
        """Header for ``payload`` (checksummed here; the payload itself is not copied): one buffer,
        or a list of contiguous buffers that make the payload in order (runs of pool slots, written
        as they lie in pool memory).
        ``link_keys``: keys of pages ``first_page + c - 1``, c in ``link_counts`` (all of them)."""
        if len(key) != 32:
            raise ValueError(f"key must be 32 bytes, got {len(key)}")
        if first_page < 0 or not (0 <= num_pages < 2**32):
            raise ValueError(f"bad first_page/num_pages {first_page}/{num_pages}")
        n = len(link_keys)
        if n and (n != len(link_counts(first_page, num_pages, self.link_every)) or any(len(k) != 32 for k in link_keys)):
            raise ValueError(f"{n} link keys do not fit {num_pages} pages from page {first_page} linked every {self.link_every}")
        if isinstance(payload, (list, tuple)):  # parts, concatenated in order (no copy)
            h = xxhash.xxh3_128()
            size = 0
            for part in payload:
                h.update(part)
                size += memoryview(part).nbytes
            digest = h.digest()
        else:
            u8 = np.frombuffer(payload, dtype=np.uint8)
            size, digest = u8.size, payload_digest(u8)
        head = _FIXED.pack(
            MAGIC, FORMAT_VERSION, self.header_len + 32 * n, self._kind, self._ndim, self.link_every, self._fp, key,
            first_page, num_pages, n, self._dtype, size, digest,
        ) + self._shape
        if n:
            head += b"".join(link_keys)
        return head + _HEADER_SUM.pack(_header_sum(head))


def encode_header(meta: ObjectMeta, payload: bytes | memoryview | np.ndarray) -> bytes:
    """Header for ``payload`` (checksummed here; the payload itself is not copied). No links."""
    if meta.num_links:
        raise ValueError("encode_header writes objects without links; use HeaderEncoder.encode(link_keys=...)")
    enc = HeaderEncoder(meta.kind, meta.fingerprint, meta.dtype, meta.shape)
    return enc.encode(meta.key, meta.first_page, meta.num_pages, payload)


def decode_header(
    head: bytes | bytearray | memoryview, expect: ObjectMeta, *, payload_len: int, total_len: int
) -> bytes:
    """Verify the header bytes ``head`` of an object of ``total_len`` bytes whose payload must be
    ``payload_len`` bytes; return the payload digest to verify the payload against."""
    return _check_header(memoryview(head).cast("B"), total_len, expect, payload_len)[1]


def _check_header(
    mv: memoryview, n: int, expect: ObjectMeta, payload_len: int | None, longer_ok: bool = False
) -> tuple[int, bytes, int]:
    """Checks everything but the payload checksum; ``n`` is the object's total size.
    ``longer_ok``: the object may start where ``expect`` does and hold more pages, if its header
    binds ``expect.key`` to page ``expect.num_pages`` as a link key. Returns (header_len, payload
    digest, num_pages)."""
    if len(mv) < 12:
        raise CorruptObjectError(CorruptReason.SHORT, f"{n} bytes < minimal header")
    if bytes(mv[:8]) != MAGIC:
        raise CorruptObjectError(CorruptReason.BAD_MAGIC, f"magic {bytes(mv[:8])!r}")
    version, header_len = struct.unpack_from("<HH", mv, 8)
    if version != FORMAT_VERSION:
        raise CorruptObjectError(CorruptReason.BAD_VERSION, f"format version {version} != {FORMAT_VERSION}")
    if n < _FIXED.size + _HEADER_SUM.size or n < header_len or len(mv) < _FIXED.size + _HEADER_SUM.size:
        raise CorruptObjectError(CorruptReason.SHORT, f"{n} bytes < header")
    (_, _, _, kind, ndim, every, fp, key, first_page, num_pages, nlinks, dtype_raw, plen, pdigest) = _FIXED.unpack_from(mv, 0)
    if header_len != _FIXED.size + 4 * ndim + 32 * nlinks + _HEADER_SUM.size:
        raise CorruptObjectError(CorruptReason.BAD_HEADER, f"header_len {header_len} vs ndim {ndim}, {nlinks} links")
    if len(mv) < header_len:
        raise CorruptObjectError(CorruptReason.BAD_SHAPE, f"header of {header_len} bytes, expected {expect.header_len}")
    (hsum,) = _HEADER_SUM.unpack_from(mv, header_len - _HEADER_SUM.size)
    if _header_sum(mv[: header_len - _HEADER_SUM.size]) != hsum:
        raise CorruptObjectError(CorruptReason.BAD_HEADER, "header checksum mismatch")
    if kind != int(expect.kind):
        raise CorruptObjectError(CorruptReason.BAD_KIND, f"kind {kind} != {int(expect.kind)}")
    if fp != expect.fingerprint:
        raise CorruptObjectError(CorruptReason.BAD_FINGERPRINT, f"fingerprint {fp.hex()[:16]}… differs")
    exact = key == expect.key and first_page == expect.first_page and num_pages == expect.num_pages
    if not exact and longer_ok and first_page == expect.first_page and num_pages > expect.num_pages and every:
        counts = link_counts(first_page, num_pages, every)  # expect.key must be the link of its count
        if nlinks == len(counts) and expect.num_pages in counts:
            at = _FIXED.size + 4 * ndim + 32 * counts.index(expect.num_pages)
            exact = bytes(mv[at : at + 32]) == expect.key
    if not exact:
        raise CorruptObjectError(
            CorruptReason.BAD_KEY,
            f"object is (key {key.hex()[:12]}…, first_page {first_page}, {num_pages} pages), expected "
            f"(key {expect.key.hex()[:12]}…, first_page {expect.first_page}, {expect.num_pages} pages)",
        )
    dtype = dtype_raw.rstrip(b"\x00").decode("ascii", "replace")
    if dtype != expect.dtype:
        raise CorruptObjectError(CorruptReason.BAD_DTYPE, f"dtype {dtype!r} != {expect.dtype!r}")
    shape = struct.unpack_from(f"<{ndim}I", mv, _FIXED.size)
    if tuple(shape) != tuple(expect.shape):
        raise CorruptObjectError(CorruptReason.BAD_SHAPE, f"shape {shape} != {tuple(expect.shape)}")
    if payload_len is not None and num_pages != expect.num_pages:  # a longer object, through a link
        payload_len = payload_len // expect.num_pages * num_pages
    if payload_len is not None and plen != payload_len:
        raise CorruptObjectError(CorruptReason.BAD_SHAPE, f"payload_len {plen} != {payload_len}")
    have = n - header_len
    if have < plen:
        raise CorruptObjectError(CorruptReason.SHORT, f"payload {have} < {plen} bytes")
    if have > plen:
        raise CorruptObjectError(CorruptReason.TRAILING, f"payload {have} > {plen} bytes")
    return header_len, pdigest, num_pages


def decode(
    buf: bytes | bytearray | memoryview,
    expect: ObjectMeta,
    *,
    payload_len: int | None = None,
    verify_payload: bool = True,
    longer_ok: bool = False,
) -> memoryview:
    """Verify ``buf`` against ``expect`` (and the expected ``payload_len`` if given); return the
    payload view or raise ``CorruptObjectError``. ``longer_ok``: ``buf`` may be a longer object
    reached through a link (``_check_header``); the view then holds all of its pages."""
    mv = memoryview(buf).cast("B")
    header_len, pdigest, _ = _check_header(mv, len(mv), expect, payload_len, longer_ok)
    payload = mv[header_len:]
    if verify_payload and payload_digest(payload) != pdigest:
        raise CorruptObjectError(CorruptReason.BAD_CHECKSUM, "payload checksum mismatch")
    return payload
