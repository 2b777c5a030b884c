"""L3 object format: a small self-verifying header followed by the raw payload.

Layout (little-endian)::

    off  size  field
      0     8  magic  b"HICKV\\x00\\r\\n"
      8     2  format_version (u16)            -- checked right after the magic
     10     2  header_len (u16)                -- 144 + 4*ndim
     12     1  kind (u8: 1 = KV/state pages, 2 = manifest entry)
     13     1  ndim (u8) of the per-page shape
     14     2  reserved, 0 (u16)
     16    32  model fingerprint digest
     48    32  object key (chain hash of the last page; manifest: namespace seed)
     80     8  first_page (u64, absolute page index of the first page in the chain)
     88     4  num_pages (u32; manifest: number of tokens)
     92     4  reserved, 0 (u32)
     96    16  dtype name, ASCII, NUL-padded (``np.dtype.name``, e.g. "bfloat16")
    112     8  payload_len (u64)
    120    16  XXH3-128(payload), canonical (big-endian) digest
    136 4*ndim per-page shape (u32 each)
      .     8  XXH3-64(header bytes before this field), u64

The payload is ``num_pages`` pages, each ``prod(shape) * itemsize`` bytes, C order.

The two reserved fields held the spacing and count of file:// link names (hard links naming an
object at pages inside it, removed: hits are the same on every scheme). Objects without links, the
only kind written now, have both at 0 and are byte-identical to what v4 wrote; a header with
either field set is ``BAD_HEADER``.

Checksum: XXH3 (``xxhash``), not CRC32C. Version 1 used CRC32C; on this kind of host the
checksum was the largest cost of an L3 hit after the copy itself (figures:
``docs/performance.md``). XXH3 detects accidental corruption
(torn writes, bit flips, truncation, misplaced objects); it is not a defence against a malicious
writer, and neither was CRC32C. Other format versions (v1 included) are never decoded: the
version is checked right after the magic and is part of every object path, so they are a clean
miss.

Buffers: ``encode_header`` (and ``HeaderEncoder.encode``, its per-pool form) returns a fresh
``bytes`` the caller owns; it never copies the payload (the writer sends header and payload as
two buffers). ``decode`` returns a zero-copy
``memoryview`` of the payload inside the caller's buffer; the caller keeps that buffer alive
while it uses the view. Any mismatch raises ``CorruptObjectError`` with a ``CorruptReason``;
callers turn it into a counted miss and never hand the bytes on. Pure functions and immutable
encoders: called wherever a write or read runs (calling thread, I/O threads, gcsfs' loop).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import struct

import numpy as np
import xxhash

MAGIC = b"HICKV\x00\r\n"
FORMAT_VERSION = 4
_FIXED = struct.Struct("<8sHHBBH32s32sQII16sQ16s")  # up to and including the payload digest
assert _FIXED.size == 136
_HEADER_SUM = struct.Struct("<Q")  # XXH3-64 of the header bytes before it
MAX_NDIM = 16


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
        self.size: int | None = None  # length of the bytes that failed (``corruption.note_failure``)
        self.digest: bytes | None = None  # their digest


def declared_num_pages(buf: bytes | bytearray | memoryview) -> int:
    """The ``num_pages`` field of an object's header as stored (0 if the bytes end before it): what
    a reader that does not know the count expects, so that a cut object reads ``SHORT``."""
    mv = memoryview(buf).cast("B")
    return struct.unpack_from("<I", mv, 88)[0] if len(mv) >= 92 else 0


def payload_digest(buf: bytes | bytearray | memoryview | np.ndarray) -> bytes:
    """16-byte XXH3-128 digest of any contiguous buffer, without copying it."""
    return xxhash.xxh3_128_digest(np.frombuffer(buf, dtype=np.uint8).data)


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

    def __post_init__(self) -> None:
        if len(self.fingerprint) != 32 or len(self.key) != 32:
            raise ValueError("fingerprint and key must be 32 bytes")
        if len(self.dtype.encode("ascii")) > 16:
            raise ValueError(f"dtype name too long for the header: {self.dtype!r}")
        if len(self.shape) > MAX_NDIM or any(int(d) < 0 or int(d) >= 2**32 for d in self.shape):
            raise ValueError(f"unsupported page shape {self.shape}")
        if self.first_page < 0 or not (0 <= self.num_pages < 2**32):
            raise ValueError(f"bad first_page/num_pages {self.first_page}/{self.num_pages}")

    @property
    def header_len(self) -> int:
        return _FIXED.size + 4 * len(self.shape) + _HEADER_SUM.size

    def payload_len(self, itemsize: int) -> int:
        return self.num_pages * math.prod(self.shape) * itemsize


class HeaderEncoder:
    """Headers of objects that share kind, fingerprint, dtype and per-page shape (one pool's
    objects): those fields are validated and packed once, not per object. ``encode`` is
    bit-identical to ``encode_header`` with the same fields."""

    def __init__(self, kind: ObjectKind, fingerprint: bytes, dtype: str, shape: tuple[int, ...]) -> None:
        probe = ObjectMeta(kind, fingerprint, bytes(32), 0, 0, dtype, tuple(shape))  # validates
        self.header_len = probe.header_len
        self._kind, self._fp, self._dtype = int(kind), fingerprint, dtype.encode("ascii")
        self._ndim = len(probe.shape)
        self._shape = struct.pack(f"<{self._ndim}I", *probe.shape)

    def encode(self, key: bytes, first_page: int, num_pages: int, payload: bytes | memoryview | np.ndarray) -> bytes:
        """Header for ``payload`` (checksummed here; the payload itself is not copied)."""
        if len(key) != 32:
            raise ValueError(f"key must be 32 bytes, got {len(key)}")
        if first_page < 0 or not (0 <= num_pages < 2**32):
            raise ValueError(f"bad first_page/num_pages {first_page}/{num_pages}")
        u8 = np.frombuffer(payload, dtype=np.uint8)
        head = _FIXED.pack(
            MAGIC, FORMAT_VERSION, self.header_len, self._kind, self._ndim, 0, self._fp, key,
            first_page, num_pages, 0, self._dtype, u8.size, payload_digest(u8),
        ) + self._shape
        return head + _HEADER_SUM.pack(_header_sum(head))


def encode_header(meta: ObjectMeta, payload: bytes | memoryview | np.ndarray) -> bytes:
    """Header for ``payload`` (checksummed here; the payload itself is not copied)."""
    enc = HeaderEncoder(meta.kind, meta.fingerprint, meta.dtype, meta.shape)
    return enc.encode(meta.key, meta.first_page, meta.num_pages, payload)


def _check_header(mv: memoryview, n: int, expect: ObjectMeta, payload_len: int | None) -> tuple[int, bytes]:
    """Checks everything but the payload checksum; ``n`` is the object's total size. Returns
    (header_len, payload digest)."""
    if len(mv) < 12:
        raise CorruptObjectError(CorruptReason.SHORT, f"{n} bytes < minimal header")
    if bytes(mv[:8]) != MAGIC:
        raise CorruptObjectError(CorruptReason.BAD_MAGIC, f"magic {bytes(mv[:8])!r}")
    version, header_len = struct.unpack_from("<HH", mv, 8)
    if version != FORMAT_VERSION:
        raise CorruptObjectError(CorruptReason.BAD_VERSION, f"format version {version} != {FORMAT_VERSION}")
    if n < _FIXED.size + _HEADER_SUM.size or n < header_len or len(mv) < _FIXED.size + _HEADER_SUM.size:
        raise CorruptObjectError(CorruptReason.SHORT, f"{n} bytes < header")
    (_, _, _, kind, ndim, reserved16, fp, key, first_page, num_pages, reserved32, dtype_raw, plen, pdigest) = _FIXED.unpack_from(mv, 0)
    if header_len != _FIXED.size + 4 * ndim + _HEADER_SUM.size or reserved16 or reserved32:
        raise CorruptObjectError(CorruptReason.BAD_HEADER, f"header_len {header_len} vs ndim {ndim}, reserved fields {reserved16}, {reserved32}")
    if len(mv) < header_len:
        raise CorruptObjectError(CorruptReason.BAD_SHAPE, f"header of {header_len} bytes, expected {expect.header_len}")
    (hsum,) = _HEADER_SUM.unpack_from(mv, header_len - _HEADER_SUM.size)
    if _header_sum(mv[: header_len - _HEADER_SUM.size]) != hsum:
        raise CorruptObjectError(CorruptReason.BAD_HEADER, "header checksum mismatch")
    if kind != int(expect.kind):
        raise CorruptObjectError(CorruptReason.BAD_KIND, f"kind {kind} != {int(expect.kind)}")
    if fp != expect.fingerprint:
        raise CorruptObjectError(CorruptReason.BAD_FINGERPRINT, f"fingerprint {fp.hex()[:16]}… differs")
    if (key, first_page, num_pages) != (expect.key, expect.first_page, expect.num_pages):
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
    if payload_len is not None and plen != payload_len:
        raise CorruptObjectError(CorruptReason.BAD_SHAPE, f"payload_len {plen} != {payload_len}")
    have = n - header_len
    if have < plen:
        raise CorruptObjectError(CorruptReason.SHORT, f"payload {have} < {plen} bytes")
    if have > plen:
        raise CorruptObjectError(CorruptReason.TRAILING, f"payload {have} > {plen} bytes")
    return header_len, pdigest


def decode(
    buf: bytes | bytearray | memoryview,
    expect: ObjectMeta,
    *,
    payload_len: int | None = None,
    verify_payload: bool = True,
) -> memoryview:
    """Verify ``buf`` against ``expect`` (and the expected ``payload_len`` if given); return the
    payload view or raise ``CorruptObjectError``."""
    mv = memoryview(buf).cast("B")
    header_len, pdigest = _check_header(mv, len(mv), expect, payload_len)
    payload = mv[header_len:]
    if verify_payload and payload_digest(payload) != pdigest:
        raise CorruptObjectError(CorruptReason.BAD_CHECKSUM, "payload checksum mismatch")
    return payload
