"""file:// byte cap with LRU eviction (reads bump recency; the deep end of a chain goes first)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hicache.storage import FsspecStorage, ModelFingerprint, Namespace, ShardCoord, StorageConfig, page_keys
from hicache.storage.chunking import Chunking
from hicache.storage.format import ObjectKind, ObjectMeta
from hicache.storage.testing import NumpyHostPool
from hicache.storage.testing import slot_range as S

FP = ModelFingerprint("tiny-test", "float32", page_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
SLOT = (2, 2, 4, 2, 8)  # 1 KiB pages


def _store(url, cap):
    st = FsspecStorage(url, FP, StorageConfig(pages_per_object=4, max_bytes=cap, evict_low_watermark=0.75))
    pool = NumpyHostPool(16, SLOT)
    st.register_host_pool(pool, shard=ShardCoord.full(FP))
    pool.fill_random(S(0, 16), 0)
    return st


def _chain(c, pages=8):
    return page_keys(Namespace(FP, cache_salt=f"chain-{c}"), np.arange(pages * 4))


def test_byte_cap_lru(tmp_path):
    """The cap counts each object with its leading-page index entry (``32 * 4 + 8`` bytes) and
    evicts them together: no entry is left naming an evicted object."""
    url = f"file://{tmp_path}/l3"
    obj = 4 * 1024 + ObjectMeta(ObjectKind.PAGES, bytes(32), bytes(32), 0, 4, "float32", SLOT).header_len  # 4 pages + header
    unit = obj + 4 * 32 + 8  # the object and its index entry
    st = _store(url, cap=10 * unit)  # room for 5 chains of 2 objects
    chains = [_chain(c) for c in range(6)]
    for c in range(4):
        assert st.batch_set(chains[c], S(0, 8)) == [True] * 8
    assert st.stats().evicted_objects == 0
    assert st.batch_get(chains[0], S(8, 16)) == [True] * 8  # chain 0 is read again: LRU bump
    st.batch_set(chains[4], S(0, 8))  # 10 objects: at the cap, nothing evicted
    assert st.stats().evicted_objects == 0
    st.batch_set(chains[5], S(0, 8))  # 12 > 10: evict the 5 least recent down to 7.5 objects
    s = st.stats()
    assert s.evicted_objects == 5 and s.index_deleted == 5 and s.used_bytes == 7 * unit
    assert s.evicted_bytes == 5 * unit and s.index_written == 12
    assert st.used_bytes() == 7 * unit  # what is on disk, rescanned
    assert [st.batch_exists(ch) for ch in chains] == [8, 0, 0, 4, 8, 8]
    # chain 0 survived because it was read; chain 3 lost its deep end first and keeps its head
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "l3") for f in fs if "/manifest" not in d]
    entries = [f for f in files if Chunking.object_of_index_entry(f) is not None]
    assert len(entries) == 7 and sorted(Chunking.object_of_index_entry(f) for f in entries) == sorted(set(files) - set(entries))
    st.close()


def test_orphaned_index_entry_goes_first(tmp_path):
    """An entry whose object another process deleted is evicted by the next pass, before any
    object; its query meanwhile is a plain miss of those pages."""
    st = _store(f"file://{tmp_path}/l3", cap=1 << 30)
    keys = _chain(0)
    assert st.batch_set(keys, S(0, 8)) == [True] * 8
    os.unlink(st.object_path(keys[7]))  # object [4, 8) gone behind the store's back
    assert st.batch_exists(keys[:6]) == 4  # its entry dangles: no pages from it
    capped = _store(f"file://{tmp_path}/l3", cap=1)
    assert capped.batch_set(_chain(1, pages=4), S(0, 4)) == [True] * 4  # over the cap: a pass runs
    s = capped.stats()  # everything goes (cap 1): the orphan as an entry, each object with its own
    assert (s.evicted_objects, s.index_deleted) == (2, 3)
    left = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "l3") for f in fs]
    assert [f for f in left if Chunking.object_of_index_entry(f) is not None] == []
    st.close()
    capped.close()


def test_cap_counts_other_processes_writes(tmp_path):
    url = f"file://{tmp_path}/l3"
    obj = 4 * 1024 + 148
    a = _store(url, cap=6 * obj)
    b = FsspecStorage(url, FP, StorageConfig(pages_per_object=4))  # uncapped writer
    b.register_host_pool(a._pools[next(iter(a._pools))].pool, shard=ShardCoord.full(FP))
    for c in range(5):
        b.batch_set(_chain(c), S(0, 8))
    a.batch_set(_chain(9), S(0, 8))  # a's accounting rescans and sees b's 10 objects
    assert a.used_bytes() <= 6 * obj
    assert a.batch_exists(_chain(9)) == 8
    a.close()
    b.close()


def test_cap_rejected_for_other_schemes():
    with pytest.raises(ValueError, match="file://"):
        FsspecStorage("memory://x", FP, StorageConfig(max_bytes=1000))


def test_writes_and_reads_set_lru_recency_in_chain_order(tmp_path):
    """Objects written or read together get recency in chain order, shallow pages newest (so
    eviction takes a chain's deep end first), and a read makes them newer than any write before."""
    st = _store(f"file://{tmp_path}/l3", cap=1 << 30)
    keys = _chain(0, pages=12)
    assert st.batch_set(keys, S(0, 12)) == [True] * 12
    paths = [st.object_path(keys[i]) for i in (3, 7, 11)]
    written = [os.stat(p).st_mtime_ns for p in paths]
    assert written[0] > written[1] > written[2]
    assert st.batch_get(keys, S(4, 16)) == [True] * 12
    read = [os.stat(p).st_mtime_ns for p in paths]
    assert read[0] > read[1] > read[2] > max(written)
    st.close()
