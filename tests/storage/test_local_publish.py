"""file:// publish step. On a local filesystem an object's final name is created exclusively with
no permission bits, written, then published (``fchmod``): an unpublished object (a writer is on
it, or one died) is a miss for every reader and existence check, never data, never "corrupt", and
a long-dead writer's leftover is removed by the next reader so the key can be written again. On a
network/FUSE mount the publish stays temp file + ``os.link``."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from hicache.storage import Namespace, fsspec_store, page_keys
from hicache.storage.testing import same_bytes
from hicache.storage.testing import slot_range as S


def _keys(fp, n_pages: int, salt: str = "publish") -> list[str]:
    return page_keys(Namespace(fp, cache_salt=salt), np.arange(n_pages * fp.page_size))


@pytest.fixture
def local_store(make_store):
    st = make_store("file")
    if not st._io.local_fs:
        pytest.skip("the test's tmp dir is not on a local filesystem")
    return st


def _unpublish(path: str, age_s: float = 0.0) -> None:
    """What a writer between create and publish leaves (``age_s``: how long ago it started)."""
    os.chmod(path, 0)
    if age_s:
        t = time.time() - age_s
        os.utime(path, (t, t))


def _stored_then_unpublished(st, fp, n_pages: int, seed: int, age_s: float = 0.0) -> tuple[list[str], str]:
    """Stores ``n_pages`` random pages, then unpublishes the object of the last one (``_unpublish``).
    Returns (the pages' keys, that object's path)."""
    keys = _keys(fp, n_pages)
    st.pool.fill_random(S(0, n_pages), seed)
    st.batch_set(keys, S(0, n_pages))
    path = st.object_path(keys[-1])
    _unpublish(path, age_s)
    return keys, path


def test_objects_are_published_in_place_with_no_temp_files(local_store, fp):
    st = local_store
    keys = _keys(fp, 8)
    st.pool.fill_random(S(0, 8), 1)
    assert st.batch_set(keys, S(0, 8)) == [True] * 8
    d = os.path.dirname(st.object_path(keys[3]))
    assert os.stat(st.object_path(keys[3])).st_mode & 0o777 == fsspec_store.PUBLISHED_MODE
    assert os.stat(st.object_path(keys[3])).st_nlink == 1  # one name, no link step
    assert not [f for f in os.listdir(d) if f.startswith(".tmp-")]
    assert st.batch_get(keys, S(8, 16)) == [True] * 8 and same_bytes(st.pool.buf[8:16], st.pool.buf[0:8])


def test_an_unpublished_object_is_a_miss_for_everyone_and_not_overwritten(local_store, fp):
    st = local_store
    keys, path = _stored_then_unpublished(st, fp, 8, seed=2)  # as if its writer were still writing it
    before = st.stats()
    assert st.batch_exists(keys) == 4
    assert not st.exists(keys[7], 7)
    st.pool.buf[8:16] = 0
    assert st.batch_get(keys, S(8, 16)) == [True] * 4 + [False] * 4
    assert (st.pool.buf[12:16] == 0).all()  # never read into the pool
    after = st.stats()
    assert after.corrupt_objects == before.corrupt_objects and after.errors == before.errors
    assert os.path.exists(path)  # a live writer's object is left alone
    # another writer of the same key does not write over it (one object per key)
    st.pool.fill_random(S(0, 8), 3)
    assert st.batch_set(keys[4:], S(4, 8), first_page=4) == [True] * 4
    assert st.stats().objects_written == after.objects_written
    os.chmod(path, fsspec_store.PUBLISHED_MODE)  # its writer publishes: now it is a hit
    assert st.batch_exists(keys) == 8


def test_a_dead_writers_leftover_is_removed_and_the_key_written_again(local_store, fp):
    st = local_store
    keys, path = _stored_then_unpublished(st, fp, 4, seed=4, age_s=fsspec_store.STALE_UNPUBLISHED_S + 60)
    assert st.batch_get(keys, S(8, 12)) == [False] * 4  # a miss; the reader removes the leftover
    assert not os.path.exists(path)
    assert st.batch_set(keys, S(0, 4)) == [True] * 4
    assert st.batch_get(keys, S(8, 12)) == [True] * 4 and same_bytes(st.pool.buf[8:12], st.pool.buf[0:4])


def test_a_failed_write_leaves_no_object(local_store, fp, monkeypatch):
    st = local_store
    keys = _keys(fp, 4)
    st.pool.fill_random(S(0, 4), 5)

    def broken(fd, header, payload):
        os.write(fd, b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fsspec_store, "_writev_all", broken)
    assert st.batch_set(keys, S(0, 4)) == [False] * 4
    assert not os.path.exists(st.object_path(keys[3]))
    assert st.stats().errors >= 1
    monkeypatch.undo()
    assert st.batch_set(keys, S(0, 4)) == [True] * 4 and st.batch_exists(keys) == 4


def test_network_mounts_publish_with_a_link(make_store, fp):
    st = make_store("file")
    st._io.local_fs = st._io.inline_io = False  # what a root on an NFS/FUSE mount gets
    keys = _keys(fp, 8)
    st.pool.fill_random(S(0, 8), 6)
    assert st.batch_set(keys, S(0, 8)) == [True] * 8
    d = os.path.dirname(st.object_path(keys[3]))
    assert not [f for f in os.listdir(d) if f.startswith(".tmp-")]
    assert os.stat(st.object_path(keys[3])).st_mode & 0o777
    assert st.batch_get(keys, S(8, 16)) == [True] * 8 and same_bytes(st.pool.buf[8:16], st.pool.buf[0:8])
    assert st.batch_set(keys, S(0, 8)) == [True] * 8
    assert st.stats().objects_skipped_existing == 2
