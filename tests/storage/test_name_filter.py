"""file:// name map (``StorageConfig.name_filter_bytes``, ``hicache.storage.name_filter``): an existence
check of a name no store on the root ever wrote answers a miss without a ``stat``; every name a store
wrote (objects and links, by this or another store instance on the root, also before the map existed)
is still found; ``clear`` zeroes the map in place; the byte cap never counts or evicts it."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hicache.storage import ChainKeys, Namespace, page_keys
from hicache.storage.name_filter import NameFilter
from hicache.storage.testing import slot_range as S


def _chain(fp, n_pages: int, salt: str):
    ns = Namespace(fp, cache_salt=salt)
    toks = np.random.default_rng(sum(salt.encode())).integers(0, 1000, n_pages * fp.page_size)
    return ns, toks, page_keys(ns, toks)


class _Stats:
    """Counts the filesystem existence checks of a store (``exists_one``: one stat each)."""

    def __init__(self, st) -> None:
        self.n, self._inner = 0, st._io.exists_one
        st._io.exists_one = self

    def __call__(self, path, deadline):
        self.n += 1
        return self._inner(path, deadline)


@pytest.fixture
def local(make_store):
    def make(**kw):
        kw.setdefault("pages_per_object", 16)
        kw.setdefault("link_every_pages", 4)
        st = make_store("file", **kw)
        if not st._io.local_fs:
            pytest.skip("the test's tmp dir is not on a local filesystem (no name map there)")
        return st
    return make


def test_a_never_written_name_is_a_miss_without_a_stat(local, fp):
    st = local()
    stats = _Stats(st)
    for i in range(20):
        ns, toks, _ = _chain(fp, 24, f"miss-{i}")
        assert st.batch_exists(ChainKeys(ns, toks), min_pages=2) == 0
    assert stats.n <= 2  # (slots shared with other names: rare, then a stat answers)
    ns, toks, keys = _chain(fp, 24, "stored")
    st.pool.fill_random(S(0, 24), 1)
    assert st.batch_set(keys, S(0, 24)) == [True] * 24
    for end, found in ((2, 2), (3, 2), (5, 4), (16, 16), (20, 20), (24, 24)):  # names and links: found
        assert st.batch_exists(keys[:end]) == found, end
    assert st.batch_get(keys, S(30, 54)) == [True] * 24


def test_another_store_on_the_root_sees_the_names_it_writes(local, fp, make_url):
    url = make_url("file")
    reader, writer = local(url=url), local(url=url)
    ns, toks, keys = _chain(fp, 20, "shared")
    assert reader.batch_exists(keys) == 0  # (before: a miss)
    writer.pool.fill_random(S(0, 20), 2)
    assert writer.batch_set(keys, S(0, 20)) == [True] * 20
    assert reader.batch_exists(keys) == 20 and reader.batch_exists(keys[:10]) == 8  # its link at page 7
    assert reader.batch_get(keys, S(30, 50)) == [True] * 20


def test_objects_written_before_the_map_existed_are_found(local, fp, make_url):
    url = make_url("file")
    old = local(url=url, name_filter_bytes=None)
    ns, toks, keys = _chain(fp, 20, "before")
    old.pool.fill_random(S(0, 20), 3)
    assert old.batch_set(keys, S(0, 20)) == [True] * 20
    assert not os.path.exists(f"{old._base}.names")
    new = local(url=url)  # makes the map, marks what is there
    assert new._names.created and new.batch_exists(keys) == 20 and new.batch_exists(keys[:3]) == 2


def test_deleted_names_stay_maybe_and_clear_zeroes_the_map(local, fp):
    st = local()
    ns, toks, keys = _chain(fp, 16, "deleted")
    st.pool.fill_random(S(0, 16), 4)
    st.batch_set(keys, S(0, 16))
    for p in (1, 3, 7, 11, 15):  # the object and its links, deleted behind the store's back
        os.unlink(st.object_path(keys[p]))
    stats = _Stats(st)
    assert st.batch_exists(keys, min_pages=2) == 0 and stats.n == 1  # marked: the stat answers
    st.batch_set(keys, S(0, 16))
    st.clear()
    stats.n = 0
    assert st.batch_exists(keys, min_pages=2) == 0 and stats.n == 0  # cleared: no stat
    st.batch_set(keys, S(0, 16))  # written again: marked again
    assert st.batch_exists(keys) == 16


def test_the_byte_cap_never_counts_or_evicts_the_map(local, fp):
    probe = local()
    obj = probe._pools[next(iter(probe._pools))].object_bytes(0, 16)
    st = local(max_bytes=2 * obj)
    for c in range(4):
        ns, toks, keys = _chain(fp, 16, f"cap-{c}")
        st.pool.fill_random(S(0, 16), c)
        st.batch_set(keys, S(0, 16))
    assert st.used_bytes() <= 2 * obj and os.path.getsize(f"{st._base}.names") == 4 << 20
    assert st.batch_exists(keys) == 16


def test_name_filter_is_shared_through_the_file_and_rejects_bad_sizes(tmp_path):
    a = NameFilter(str(tmp_path / "m.names"), 1 << 16)
    b = NameFilter(str(tmp_path / "m.names"), 1 << 12)  # a smaller request maps the file's size
    assert a.created and not b.created and b.nbytes == 1 << 16
    names = [f"kv/x/{i:064x}" for i in range(200)]
    a.add(names[:100])
    assert all(b.may_contain(n) for n in names[:100])
    assert sum(b.may_contain(n) for n in names[100:]) <= 2
    b.clear()
    assert not any(a.may_contain(n) for n in names[:100])
    a.close(), b.close()
    for bad in (4095, 5000, 1 << 12 | 1, True, 4096.0):
        with pytest.raises(ValueError, match="nbytes"):
            NameFilter(str(tmp_path / "bad.names"), bad)
