"""file:// fan-out directories are spread over ext4 block groups: their parents are top directories
(``FS_TOPDIR_FL``) before the sixteen are made; best effort where the flag is unsupported."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hicache.storage import Namespace, page_keys
from hicache.storage.placement import FS_TOPDIR_FL, directory_flags, spread_subdirectories


def _supported(tmp_path) -> bool:
    probe = tmp_path / "probe"
    probe.mkdir()
    return spread_subdirectories(str(probe))


def test_fanout_parents_are_top_directories_and_objects_go_below(make_store, make_url, fp, tmp_path):
    if not _supported(tmp_path):
        pytest.skip("the filesystem of tmp_path has no FS_TOPDIR_FL (not ext2/3/4)")
    st = make_store("file", url=make_url("file"))
    pool_parent = os.path.dirname(os.path.dirname(st.object_path("a" * 64)))
    manifest_parent = st._manifest_parent()
    for parent in (pool_parent, manifest_parent):
        assert directory_flags(parent) & FS_TOPDIR_FL
        assert sorted(os.listdir(parent)) == list("0123456789abcdef")
        for d in os.listdir(parent):  # the sixteen themselves are plain directories
            assert not directory_flags(os.path.join(parent, d)) & FS_TOPDIR_FL
    ns = Namespace(fp, cache_salt="placed")
    toks = np.arange(4 * fp.page_size, dtype=np.int32)
    keys = page_keys(ns, toks)
    st.pool.write_slots(np.arange(4, dtype=np.int32), np.ones((4, *st.pool.slot_shape), st.pool.dtype))
    assert st.batch_set(keys, np.arange(4, dtype=np.int32)) == [True] * 4 and st.record_prefix(ns, toks)
    assert os.path.dirname(os.path.dirname(st.object_path(keys[-1]))) == pool_parent
    assert st.batch_get(keys, np.arange(8, 12, dtype=np.int32)) == [True] * 4


def test_spreading_is_best_effort(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"x")
    assert spread_subdirectories(str(f)) is False and directory_flags(str(f)) is None  # not a directory
    assert spread_subdirectories(str(tmp_path / "missing")) is False
    if _supported(tmp_path):
        d = tmp_path / "twice"
        d.mkdir()
        assert spread_subdirectories(str(d)) and spread_subdirectories(str(d))  # idempotent
        assert directory_flags(str(d)) & FS_TOPDIR_FL
