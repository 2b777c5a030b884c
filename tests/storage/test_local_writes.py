"""file:// write path on a local filesystem: with ``local_inline_write_bytes`` set, batches up to
that size (default 4 MiB) are written on the calling thread (no I/O-thread hand-off), with one
pool read per transfer and the same write-once / skip / deadline / error semantics as the pooled
path (larger batches, or ``None``); manifest entries are written inline either way."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hicache.storage import Namespace, page_keys
from hicache.storage.testing import NumpyHostPool, same_bytes
from hicache.storage.testing import slot_range as S

SLOT_SHAPE = (2, 2, 4, 2, 8)  # conftest's pool
INLINE = 1 << 20  # local_inline_write_bytes for the inline tests


def _keys(fp, n_pages: int, salt: str = "writes") -> list[str]:
    return page_keys(Namespace(fp, cache_salt=salt), np.arange(n_pages * fp.page_size))


class _CountingReads(NumpyHostPool):
    """A pool without zero-copy views or concurrent slot I/O (like the workers' host pools)."""

    concurrent_slot_io = False
    slot_view = None

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.reads = 0

    def read_slots(self, slots):
        self.reads += 1
        return super().read_slots(slots)


@pytest.mark.parametrize("pool_kind", ["views", "copies"])
def test_small_batch_is_written_on_the_calling_thread(make_store, fp, handoffs, pool_kind):
    pool = NumpyHostPool(64, SLOT_SHAPE, np.float32) if pool_kind == "views" else _CountingReads(64, SLOT_SHAPE, np.float32)
    st = make_store("file", pool=pool, local_inline_write_bytes=INLINE)
    if not st._io.inline_io:
        pytest.skip("the test's tmp dir is not on a local filesystem")
    keys = _keys(fp, 14)  # 3 full objects + a partial one of 2 pages
    pool.fill_random(S(0, 14), 5)
    spy = handoffs(st)
    assert st.batch_set(keys, S(0, 14)) == [True] * 14
    assert spy.calls == 0
    if pool_kind == "copies":
        assert pool.reads == 1  # one gather for the whole transfer, not one per object
    s = st.stats()
    reg = st._pools[next(iter(st._pools))]
    assert (s.objects_written, s.bytes_written) == (4, sum(reg.object_bytes(a, m) for a, m in ((0, 4), (4, 4), (8, 4), (12, 2))))
    assert st.batch_get(keys, S(20, 34)) == [True] * 14 and same_bytes(pool.buf[20:34], pool.buf[0:14])
    mt = [os.stat(st.object_path(keys[i])).st_mtime_ns for i in (3, 7, 11, 13)]
    assert mt == sorted(mt, reverse=True) and len(set(mt)) == 4  # chain order: shallow pages newest
    # stored objects are skipped untouched, on the calling thread again
    pool.buf[0:14] = 0
    spy.calls = 0  # (reads hand off to the I/O threads)
    assert st.batch_set(keys, S(0, 14)) == [True] * 14 and spy.calls == 0
    assert st.stats().objects_skipped_existing == 4
    assert st.batch_get(keys, S(40, 54)) == [True] * 14 and same_bytes(pool.buf[40:54], pool.buf[20:34])


def test_large_batch_or_remote_root_uses_the_io_threads(make_store, fp, handoffs):
    st0 = make_store("file", local_inline_write_bytes=None)  # always the I/O threads
    keys = _keys(fp, 8)
    st0.pool.fill_random(S(0, 8), 6)
    spy0 = handoffs(st0)
    assert st0.batch_set(keys, S(0, 8)) == [True] * 8 and spy0.calls == 1
    if st0._io.inline_io:  # the default: a request's few objects on the calling thread
        dflt = make_store("file")
        assert dflt.config.local_inline_write_bytes == 4 << 20
        dflt.pool.buf[:] = st0.pool.buf
        spy_d = handoffs(dflt)
        assert dflt.batch_set(keys, S(0, 8)) == [True] * 8 and spy_d.calls == 0
    st = make_store("file", local_inline_write_bytes=3 * 8 * 128)  # below one 4-page object (4 KiB)
    st.pool.fill_random(S(0, 8), 6)
    spy = handoffs(st)
    assert st.batch_set(keys, S(0, 8)) == [True] * 8 and spy.calls == 1
    st2 = make_store("file", local_inline_write_bytes=INLINE)
    st2._io.inline_io = False  # what a root on a network/FUSE mount gets
    spy2 = handoffs(st2)
    st2.pool.buf[:] = st.pool.buf
    assert st2.batch_set(keys, S(0, 8)) == [True] * 8 and spy2.calls == 1
    for s in (st0, st, st2):
        assert s.batch_get(keys, S(20, 28)) == [True] * 8 and same_bytes(s.pool.buf[20:28], st.pool.buf[0:8])


def test_inline_write_past_the_deadline_writes_nothing(make_store, fp):
    st = make_store("file", local_inline_write_bytes=INLINE)
    keys = _keys(fp, 8)
    st.pool.fill_random(S(0, 8), 7)
    assert st.batch_set(keys, S(0, 8), timeout_s=1e-9) == [False] * 8
    s = st.stats()
    assert (s.timeouts, s.objects_written) == (2, 0)
    assert not os.path.exists(st.object_path(keys[3])) and st.batch_exists(keys) == 0


def test_inline_write_error_fails_its_pages_only(make_store, fp):
    st = make_store("file", local_inline_write_bytes=INLINE)
    for salt in (f"writes-{i}" for i in range(100)):  # the 2nd object's fan-out directory is only its own
        keys = _keys(fp, 12, salt)
        bad = os.path.dirname(st.object_path(keys[7]))
        if bad not in (os.path.dirname(st.object_path(keys[3])), os.path.dirname(st.object_path(keys[11]))):
            break
    st.pool.fill_random(S(0, 12), 8)
    os.rmdir(bad)  # (made, empty, when the store was opened)
    with open(bad, "w"):  # a file where the object's directory should be: open fails
        pass
    assert st.batch_set(keys, S(0, 12)) == [True] * 4 + [False] * 4 + [True] * 4
    s = st.stats()
    assert (s.errors, s.objects_written) == (1, 2)
    assert st.batch_exists(keys) == 4  # the chain stops at the missing object


def test_bad_inline_limit_is_a_value_error():
    from hicache.storage import StorageConfig

    for v in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="local_inline_write_bytes"):
            StorageConfig(local_inline_write_bytes=v)


def test_no_write_makes_a_directory(make_store, make_url, fp):
    """A file:// store makes its sixteen object and sixteen manifest fan-out directories when opened;
    objects (links included) and manifest entries of new namespaces then go into them (a ``mkdir``
    costs ext4 more than the object's own file)."""
    url = make_url("file")
    st = make_store("file", url=url, pages_per_object=8)  # an 8-page object has a link (every 4 pages)
    root = st._root

    def dirs() -> set[str]:
        return {d for d, _, _ in os.walk(root)}
    before = dirs()
    assert len([d for d in before if os.path.basename(d) in "0123456789abcdef" and len(os.path.basename(d)) == 1]) == 32
    for i in range(6):
        ns = Namespace(fp, cache_salt=f"dirs-{i}")
        toks = np.arange(10 * fp.page_size) + i
        st.pool.fill_random(S(0, 10), i)
        assert st.batch_set(page_keys(ns, toks), S(0, 10)) == [True] * 10
        assert st.record_prefix(ns, toks)
    assert st.stats().objects_written == 12 and dirs() == before
    assert os.stat(st.object_path(page_keys(ns, toks)[7])).st_nlink == 3  # the object and its links (pages 1, 3)
    again = make_store("file", url=url, pages_per_object=8)  # opening an existing store makes nothing either
    assert dirs() == before and again.batch_exists(page_keys(ns, toks)) == 10


def test_manifest_entries_are_written_inline(make_store, fp, handoffs):
    st = make_store("file")
    if not st._io.inline_io:
        pytest.skip("the test's tmp dir is not on a local filesystem")
    ns = Namespace(fp, cache_salt="manifest-inline")
    toks = np.arange(8 * fp.page_size)
    keys = page_keys(ns, toks)
    st.pool.fill_random(S(0, 8), 9)
    assert st.batch_set(keys, S(0, 8)) == [True] * 8
    spy = handoffs(st)
    assert st.record_prefix(ns, toks) and spy.calls == 0
    (got,) = st.list_prefixes(ns)
    assert got.num_pages == 8 and np.array_equal(got.tokens, toks)


class _ReadOnlyViews(_CountingReads):
    """A pool written only on the calling thread whose slots I/O threads may read (like the workers'
    ``_DeferredWrites`` over a one-slab host pool): ``slot_view`` for reads, no ``write_slots`` off
    the calling thread."""

    concurrent_slot_reads = True

    def slot_view(self, start, n):
        return self.buf[start : start + n]


@pytest.mark.parametrize("inline", [None, INLINE])
def test_objects_are_written_straight_from_scattered_slots(make_store, fp, inline):
    """A pool with ``slot_view`` and ``concurrent_slot_reads``: objects go from pool memory to the
    file as they lie, one buffer per run of consecutive slots (no ``read_slots`` copy), also when
    the slots are scattered and out of order; the bytes read back are the slots' own."""
    pool = _ReadOnlyViews(64, SLOT_SHAPE, np.float32)
    st = make_store("file", pool=pool, local_inline_write_bytes=inline)
    keys = _keys(fp, 10, salt=f"scattered-{inline}")  # objects of 4, 4, 2 pages
    slots = np.array([9, 10, 3, 40, 41, 42, 7, 60, 61, 0], np.int32)
    pool.fill_random(slots, 11)
    assert st.batch_set(keys, slots) == [True] * 10
    assert pool.reads == 0
    plain = make_store("file", url=st.url)  # reads with a plain pool: the bytes on disk
    assert plain.batch_get(keys, S(20, 30)) == [True] * 10
    assert same_bytes(plain.pool.buf[20:30], pool.buf[slots])
    blob = plain.fs.cat_file(plain.object_path(keys[3]))  # header + the pages of slots 9, 10, 3, 40
    assert blob.endswith(pool.buf[slots[:4]].tobytes())
