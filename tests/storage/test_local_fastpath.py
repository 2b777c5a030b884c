"""file:// read path: one ``preadv`` per object straight into pool memory (``slot_view``), no
separate existence round (a failed ``open`` is the miss), verification before anything counts as
loaded, a wiped destination on failure, LRU mtimes set on the descriptor, bounded hangs. Write
path: no separate existence round either, stored objects are skipped untouched, bounded writers."""

from __future__ import annotations

import dataclasses
import os
import struct
import threading
import time

import numpy as np
import pytest

from hicache.storage import CorruptReason, ModelFingerprint, Namespace, page_keys
from hicache.storage.format import FORMAT_VERSION, ObjectKind, ObjectMeta, encode_header
from hicache.storage.testing import NumpyHostPool, same_bytes
from hicache.storage.testing import slot_range as S

SLOT_SHAPE = (2, 2, 4, 2, 8)  # conftest's pool


def _corruptions(st, fp, key: str, blob: bytes) -> dict[str, tuple[bytes, CorruptReason]]:
    hlen = len(blob) - 4 * st.pool.slot_bytes
    payload = np.frombuffer(blob[hlen:], np.uint8)
    meta = ObjectMeta(ObjectKind.PAGES, fp.digest(), bytes.fromhex(key), 0, 4, "float32", SLOT_SHAPE)

    def flip(at: int) -> bytes:
        b = bytearray(blob)
        b[at] ^= 0x10
        return bytes(b)

    version = bytearray(blob)
    struct.pack_into("<H", version, 8, FORMAT_VERSION + 1)
    other_fp = dataclasses.replace(fp, model_id="other").digest()
    return {
        "flip_payload": (flip(hlen + 37), CorruptReason.BAD_CHECKSUM),
        "flip_header": (flip(90), CorruptReason.BAD_HEADER),
        "wrong_version": (bytes(version), CorruptReason.BAD_VERSION),
        "wrong_fingerprint": (encode_header(dataclasses.replace(meta, fingerprint=other_fp), payload) + bytes(payload), CorruptReason.BAD_FINGERPRINT),
        "wrong_shape": (encode_header(dataclasses.replace(meta, shape=(2, 2, 4, 8, 2)), payload) + bytes(payload), CorruptReason.BAD_SHAPE),
        "wrong_dtype": (encode_header(dataclasses.replace(meta, dtype="int32"), payload) + bytes(payload), CorruptReason.BAD_DTYPE),
        "truncate": (blob[:-100], CorruptReason.SHORT),
        "truncate_header": (blob[:50], CorruptReason.SHORT),
        "trailing": (blob + b"x", CorruptReason.TRAILING),
        "garbage": (b"not an object at all", CorruptReason.BAD_MAGIC),
    }


def _keys(fp: ModelFingerprint, n_pages: int, salt: str = "fast") -> list[str]:
    return page_keys(Namespace(fp, cache_salt=salt), np.arange(n_pages * fp.page_size))


def _rewrite(st, key: str, blob: bytes) -> None:
    path = st.object_path(key)
    os.unlink(path)
    with open(path, "wb") as f:
        f.write(blob)


class _CountingExists:
    """Wraps the backend's existence checks: ``paths`` counts the paths asked, ``rounds`` the
    batched rounds (``exists_many``; on a local root the probes are single stats, in order)."""

    def __init__(self, st) -> None:
        self.rounds, self.paths, self._many, self._one = 0, 0, st._io.exists_many, st._io.exists_one
        st._io.exists_many = self
        st._io.exists_one = self.one

    def __call__(self, paths, deadline):
        self.rounds += 1
        self.paths += len(paths)
        return self._many(paths, deadline)

    def one(self, path, deadline):
        self.paths += 1
        return self._one(path, deadline)


# same-size corruptions land in the pool through the single read and must be wiped; wrong-size
# ones are rejected from the header alone and never touch the pool
_LANDED = {"flip_payload", "flip_header", "wrong_version", "wrong_fingerprint", "wrong_shape", "wrong_dtype", "swapped"}
_SIZE = {"truncate", "truncate_header", "trailing", "garbage"}


def test_corrupt_object_via_single_read_is_a_counted_miss_and_wiped(make_store, fp):
    st = make_store("file")
    keys = _keys(fp, 4)  # exactly one object
    st.pool.fill_random(S(0, 4), 3)
    assert st.batch_set(keys, S(0, 4)) == [True] * 4
    blob = st.fs.cat_file(st.object_path(keys[3]))
    cases = _corruptions(st, fp, keys[3], blob)
    other = _keys(fp, 4, salt="other")
    st.batch_set(other, S(0, 4))
    cases["swapped"] = (st.fs.cat_file(st.object_path(other[3])), CorruptReason.BAD_KEY)
    assert set(cases) == _LANDED | _SIZE
    sentinel = np.full((4, *SLOT_SHAPE), 7.0, np.float32)
    for name, (bad, reason) in cases.items():
        _rewrite(st, keys[3], bad)
        st.pool.buf[40:44] = sentinel
        before = st.stats()
        assert st.batch_get(keys, S(40, 44)) == [False] * 4, name
        after = st.stats()
        if name in _LANDED:  # read straight into the slots, then wiped: no byte of it stays
            assert not st.pool.buf[40:44].view(np.uint32).any(), f"{name}: pool not wiped"
        else:
            assert same_bytes(st.pool.buf[40:44], sentinel), f"{name}: pool touched"
        assert after.corrupt_by_reason.get(reason.value, 0) == before.corrupt_by_reason.get(reason.value, 0) + 1, name
        assert (after.hit_pages, after.objects_read) == (before.hit_pages, before.objects_read), name
        assert not os.path.exists(st.object_path(keys[3])), f"{name}: corrupt object kept"
        assert st.batch_set(keys, S(0, 4)) == [True] * 4, name  # rewritable, then loads
        assert st.batch_get(keys, S(40, 44)) == [True] * 4, name
        assert same_bytes(st.pool.buf[40:44], st.pool.buf[0:4]), name


@pytest.mark.parametrize("variant", ["no_slot_view", "calling_thread_only"])
def test_corrupt_object_without_views_never_reaches_the_pool(make_store, fp, variant):
    pool = NumpyHostPool(64, SLOT_SHAPE, np.float32)
    if variant == "no_slot_view":
        pool.slot_view = None  # I/O threads scatter verified payloads
    else:
        pool.concurrent_slot_io = False  # verified payloads are scattered on the calling thread
    st = make_store("file", pool=pool)
    keys = _keys(fp, 8)
    pool.fill_random(S(0, 8), 4)
    assert st.batch_set(keys, S(0, 8)) == [True] * 8
    assert st.batch_get(keys, S(20, 28)) == [True] * 8
    assert same_bytes(pool.buf[0:8], pool.buf[20:28])
    path = st.object_path(keys[7])
    blob = bytearray(st.fs.cat_file(path))
    blob[-5] ^= 0xFF
    _rewrite(st, keys[7], bytes(blob))
    pool.buf[20:28] = 9.0
    assert st.batch_get(keys, S(20, 28)) == [True] * 4 + [False] * 4
    assert same_bytes(pool.buf[20:24], pool.buf[0:4])
    assert (pool.buf[24:28] == 9.0).all()  # never scattered
    assert st.stats().corrupt_by_reason == {"bad_checksum": 1}


def test_no_existence_round_for_reads(make_store, fp):
    st = make_store("file")
    keys = _keys(fp, 12)  # 3 objects
    st.pool.fill_random(S(0, 12), 5)
    st.batch_set(keys, S(0, 12))
    spy = _CountingExists(st)
    assert st.batch_get(keys, S(20, 32)) == [True] * 12
    assert spy.paths == 0  # full hit: the reads alone
    # a miss at a chunk whose shorter partial objects lie inside the query: they are probed
    # (local root: on this thread, longest first, up to the first one stored)
    os.unlink(st.object_path(keys[7]))
    assert st.batch_get(keys, S(20, 32)) == [True] * 4 + [False] * 8
    inline = st._io.inline_io
    assert (spy.rounds, spy.paths) == ((0, 3) if inline else (1, 3))  # partial candidates of chunk 1 (pages 6, 5, 4)
    # the partial object found by the probe is read in a second round
    st.batch_set(keys[:6], S(0, 6))  # chunk 0 exists, writes the partial (pages 4, 5)
    st.pool.buf[20:32] = 0
    spy.paths = 0
    assert st.batch_get(keys, S(20, 32)) == [True] * 6 + [False] * 6
    assert spy.paths == (2 if inline else 3)  # page 6: missing, page 5: stored (the probe stops)
    assert same_bytes(st.pool.buf[20:26], st.pool.buf[0:6])
    # a one-page query at a chunk's first page: its natural object (ending at page 8) is not
    # stored (chunk 2 is stored in full, named by page 11) and no shorter object exists: a miss
    # with nothing to probe, so still no existence check
    spy.rounds = spy.paths = 0
    assert st.batch_get(keys[8:9], S(40, 41), first_page=8) == [False]
    assert spy.paths == 0


def test_existence_checks_run_on_the_calling_thread_until_a_batch_is_slow(make_store, fp, handoffs):
    st = make_store("file")
    if not st._io.inline_io:
        pytest.skip("the test's tmp dir is not on a local filesystem (stats go to the pool there)")
    keys = _keys(fp, 12)  # 3 objects
    st.pool.fill_random(S(0, 12), 7)
    st.batch_set(keys[:8], S(0, 8))
    spy = handoffs(st)
    assert st.batch_exists(keys) == 8
    assert st.batch_exists(keys[8:], first_page=8) == 0
    assert spy.calls == 0  # no thread hand-off: the stats ran here
    # a deadline already past: every path is a timeout (a miss), counted, still no hand-off
    from hicache.storage.fsspec_store import _Deadline

    res = st._io.exists_many([st.object_path(k) for k in keys[:2]], _Deadline(0.0))
    assert all(isinstance(r, TimeoutError) for r in res) and spy.calls == 0
    # a batch slower than the limit (a slow mount): later batches are bounded on a pool thread
    st._io.INLINE_STAT_LIMIT_S = -1.0
    assert st.batch_exists(keys[:8]) == 8 and spy.calls == 0  # one round (both found), still inline
    assert st.batch_exists(keys[:8]) == 8 and spy.calls == 1  # the next one went to the pool
    assert st.batch_exists(keys[:5]) == 4  # same answers either way


def test_local_existence_stops_at_the_first_missing_object(make_store, fp):
    """A local query stats its objects in chain order and stops at the first missing one: a miss
    costs its first object and that chunk's shorter partial candidates, not one stat per chunk."""
    st = make_store("file")
    if not st._io.inline_io:
        pytest.skip("the test's tmp dir is not on a local filesystem (stats go to the pool there)")
    keys = _keys(fp, 16)  # 4 chunks of 4 pages
    spy = _CountingExists(st)
    assert st.batch_exists(keys) == 0
    assert spy.paths == 1 + 3  # chunk 0's natural object, then its partials (pages 2, 1, 0)
    st.pool.fill_random(S(0, 16), 3)
    st.batch_set(keys[:4], S(0, 4))
    spy.paths = 0
    assert st.batch_exists(keys) == 4
    assert spy.paths == 2 + 3  # chunks 0 (stored) and 1 (missing), chunk 1's partials; never chunks 2, 3
    st.batch_set(keys, S(0, 16))
    spy.paths = 0
    assert st.batch_exists(keys) == 16 and spy.paths == 4


def test_objects_behind_a_missing_one_do_not_count(make_store, fp):
    st = make_store("file")
    keys = _keys(fp, 16)  # 4 objects
    st.pool.fill_random(S(0, 16), 6)
    st.batch_set(keys, S(0, 16))
    os.unlink(st.object_path(keys[7]))
    before = st.stats()
    assert st.batch_get(keys, S(20, 36)) == [True] * 4 + [False] * 12
    after = st.stats()
    assert after.hit_pages - before.hit_pages == 4
    assert after.miss_pages - before.miss_pages == 12
    assert after.corrupt_objects == before.corrupt_objects and after.errors == before.errors


def test_reads_bump_lru_in_chain_order(make_store, fp):
    st = make_store("file")
    keys = _keys(fp, 12)
    st.pool.fill_random(S(0, 12), 7)
    st.batch_set(keys, S(0, 12))
    paths = [st.object_path(keys[i]) for i in (3, 7, 11)]
    written = [os.stat(p).st_mtime_ns for p in paths]
    assert written[0] > written[1] > written[2]  # set before publishing, shallow pages newest
    time.sleep(0.01)
    assert st.batch_get(keys, S(20, 32)) == [True] * 12
    read = [os.stat(p).st_mtime_ns for p in paths]
    assert read[0] > read[1] > read[2] > max(written)


def test_hung_read_is_bounded_and_never_touches_the_pool_later(make_store, fp):
    """An object read that blocks (a hung mount): on the I/O threads (``local_inline_read_bytes``
    None) the call returns by its deadline and the blocked read never lands in the pool later."""
    st = make_store("file", timeout_s=20.0, local_inline_read_bytes=None)
    keys = _keys(fp, 8)
    st.pool.fill_random(S(0, 8), 8)
    st.batch_set(keys, S(0, 8))
    blocked, release = st.object_path(keys[7]), threading.Event()
    read_into = st._io.read_into

    def hanging(path, *a, **kw):
        if path == blocked:
            release.wait(10)
        return read_into(path, *a, **kw)

    st._io.read_into = hanging
    st.pool.buf[20:28] = 5.0
    t0 = time.monotonic()
    assert st.batch_get(keys, S(20, 28), timeout_s=0.5) == [True] * 4 + [False] * 4
    assert time.monotonic() - t0 < 3.0
    assert st.stats().timeouts >= 1
    release.set()  # the blocked reader goes on, long after the call: it must not touch the pool
    time.sleep(0.2)
    assert (st.pool.buf[24:28] == 5.0).all()
    assert threading.active_count() < 50


@pytest.mark.parametrize("inline", [4 << 20, None])
def test_a_special_file_in_place_of_an_object_is_a_miss_at_once(make_store, fp, inline):
    """A FIFO where an object should be would block a plain ``open`` until a writer comes: it is
    opened non-blocking and is a miss, on the calling thread (inline reads) and on the I/O threads."""
    st = make_store("file", timeout_s=20.0, local_inline_read_bytes=inline)
    keys = _keys(fp, 8)
    st.pool.fill_random(S(0, 8), 8)
    st.batch_set(keys, S(0, 8))
    path = st.object_path(keys[7])
    os.unlink(path)
    os.mkfifo(path)
    st.pool.buf[20:28] = 5.0
    t0 = time.monotonic()
    assert st.batch_get(keys, S(20, 28), timeout_s=5.0) == [True] * 4 + [False] * 4
    assert time.monotonic() - t0 < 2.0 and st.stats().timeouts == 0
    assert (st.pool.buf[24:28] == 5.0).all() and same_bytes(st.pool.buf[20:24], st.pool.buf[0:4])


@pytest.mark.parametrize("inline, handed_off", [(4 << 20, 0), (None, 1), (4 * 2 * 4 * 2 * 2 * 8 * 4, 1)])
def test_small_reads_run_on_the_calling_thread(make_store, fp, handoffs, inline, handed_off):
    """A batch_get of at most ``local_inline_read_bytes`` payload bytes reads its objects on the
    calling thread (no hand-off to the I/O threads); larger batches, or None, use the threads.
    Same pages either way."""
    st = make_store("file", local_inline_read_bytes=inline)
    keys = _keys(fp, 8)  # two objects of four pages: 2 * 4 * slot_bytes (1 KiB) payload bytes
    st.pool.fill_random(S(0, 8), 11)
    st.batch_set(keys, S(0, 8))
    spy = handoffs(st)
    assert st.batch_get(keys, S(20, 28)) == [True] * 8
    assert spy.calls == handed_off and same_bytes(st.pool.buf[20:28], st.pool.buf[0:8])


def test_writes_have_no_existence_round_and_skip_stored_objects(make_store, fp):
    st = make_store("file")
    keys = _keys(fp, 12)  # 3 objects
    st.pool.fill_random(S(0, 12), 9)
    spy = _CountingExists(st)
    assert st.batch_set(keys, S(0, 12)) == [True] * 12
    stat0 = [os.stat(st.object_path(keys[i])) for i in (3, 7, 11)]
    orig = st.pool.buf[0:12].copy()
    st.pool.buf[0:12] = 0  # a rewrite would store zeros
    assert st.batch_set(keys, S(0, 12)) == [True] * 12
    s = st.stats()
    assert spy.rounds == 0 and (s.objects_written, s.objects_skipped_existing, s.objects_raced) == (3, 3, 0)
    stat1 = [os.stat(st.object_path(keys[i])) for i in (3, 7, 11)]
    assert [(a.st_ino, a.st_mtime_ns) for a in stat0] == [(b.st_ino, b.st_mtime_ns) for b in stat1]
    assert not [f for f in os.listdir(os.path.dirname(st.object_path(keys[3]))) if f.startswith(".tmp-")]
    assert st.batch_get(keys, S(20, 32)) == [True] * 12 and same_bytes(st.pool.buf[20:32], orig)


@pytest.mark.parametrize("write_threads", [1, 2])
def test_local_write_concurrency_is_bounded(make_store, fp, write_threads):
    """``local_write_threads`` caps concurrent object writes below ``io_threads``: each write
    waits (bounded) for a companion; more writers than allowed would find one at once."""
    st = make_store("file", io_threads=4, local_write_threads=write_threads, local_inline_write_bytes=None)
    assert st.write_threads == write_threads
    keys = _keys(fp, 12)  # 3 objects
    st.pool.fill_random(S(0, 12), 10)
    lock, active, peak = threading.Lock(), [0], [0]
    inner = st._io.write_once_local

    def counting(*a, **kw):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline and peak[0] <= write_threads:
            time.sleep(0.005)
        try:
            return inner(*a, **kw)
        finally:
            with lock:
                active[0] -= 1

    st._io.write_once_local = counting
    assert st.batch_set(keys, S(0, 12)) == [True] * 12
    assert peak[0] == write_threads
    assert st.batch_get(keys, S(20, 32)) == [True] * 12
    assert same_bytes(st.pool.buf[20:32], st.pool.buf[0:12])


def test_chunked_read_verifies_every_chunk(make_store, fp, monkeypatch):
    """Objects read in several chunks (hashed as they land): bit-identical data, and a flipped
    byte in the last chunk is still a counted miss with the destination wiped."""
    from hicache.storage import fsspec_store

    monkeypatch.setattr(fsspec_store, "_READ_CHUNK", 1000)  # a 4 KiB payload: 5 chunks
    st = make_store("file")
    keys = _keys(fp, 8)
    st.pool.fill_random(S(0, 8), 11)
    assert st.batch_set(keys, S(0, 8)) == [True] * 8
    assert st.batch_get(keys, S(20, 28)) == [True] * 8
    assert same_bytes(st.pool.buf[20:28], st.pool.buf[0:8])
    path = st.object_path(keys[7])
    with open(path, "rb") as f:
        blob = bytearray(f.read())
    blob[-3] ^= 0x01
    _rewrite(st, keys[7], bytes(blob))
    st.pool.buf[20:28] = 7.0
    assert st.batch_get(keys, S(20, 28)) == [True] * 4 + [False] * 4
    assert not st.pool.buf[24:28].view(np.uint8).any()  # wiped, never the corrupt bytes
    assert st.stats().corrupt_by_reason == {"bad_checksum": 1}
