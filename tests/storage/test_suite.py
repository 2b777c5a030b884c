"""The abstract storage suite: every test runs against memory://, file:// and gs:// (emulator)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
import threading

import ml_dtypes
import numpy as np
import pytest

from hicache.storage import (
    CorruptReason,
    FsspecStorage,
    ModelFingerprint,
    Namespace,
    PoolKind,
    PoolTransfer,
    ShardCoord,
    StorageConfig,
    leading_index,
    page_keys,
)
from hicache.storage.batch_io import Deadline, IoItem, IoKind
from hicache.storage.format import FORMAT_VERSION, ObjectKind, ObjectMeta, encode_header
from hicache.storage.testing import NumpyHostPool, same_bytes
from hicache.storage.testing import slot_range as S


def _chain(fp, n_pages, *, start=0, salt=None, extra=None):
    ns = Namespace(fp, extra_key=extra, cache_salt=salt)
    toks = np.arange(start, start + n_pages * fp.page_size, dtype=np.int64) % 50000
    return ns, toks, page_keys(ns, toks)


def _fill(st, a, b, seed=1):
    st.pool.fill_random(S(a, b), seed)


def test_roundtrip_bit_identical(scheme, make_store, fp):
    st = make_store(scheme)
    _, _, keys = _chain(fp, 10)  # chunks of 4: 4 + 4 + partial 2
    _fill(st, 0, 10)
    assert st.batch_exists(keys) == 0
    assert st.batch_set(keys, S(0, 10)) == [True] * 10
    assert st.stats().objects_written == 3
    assert st.batch_exists(keys) == 10
    assert st.batch_get(keys, S(20, 30)) == [True] * 10
    assert same_bytes(st.pool.buf[0:10], st.pool.buf[20:30])
    # a second set finds everything stored and writes nothing
    assert st.batch_set(keys, S(0, 10)) == [True] * 10
    s = st.stats()
    assert (s.objects_written, s.objects_skipped_existing, s.hit_pages, s.miss_pages) == (3, 3, 10, 0)


def test_second_instance_sees_first_writes(scheme, make_store, make_url, fp):
    url = make_url(scheme)
    a, b = make_store(scheme, url=url), make_store(scheme, url=url)
    _, _, keys = _chain(fp, 8)
    _fill(a, 0, 8, seed=7)
    a.batch_set(keys, S(0, 8))
    assert b.batch_exists(keys) == 8
    assert b.batch_get(keys, S(0, 8)) == [True] * 8
    assert same_bytes(a.pool.buf[:8], b.pool.buf[:8])


def test_exists_is_prefix_ordered(scheme, make_store, fp):
    st = make_store(scheme)
    _, _, keys = _chain(fp, 12)
    _fill(st, 0, 12)
    st.batch_set(keys, S(0, 12))
    st.fs.rm_file(st.object_path(keys[7]))  # drop the middle chunk (pages 4..7)
    assert st.batch_exists(keys) == 4
    res = st.batch_get(keys, S(20, 32))
    assert res == [True] * 4 + [False] * 8  # only the contiguous prefix is loaded
    assert st.stats().miss_pages == 8


@pytest.mark.parametrize("index", [True, False], ids=["default", "no_index"])
def test_prefix_ending_mid_chunk_then_longer_sequence(scheme, make_store, fp, index):
    """Documented chunking rule: a partial tail is found by a later longer query via the probe;
    the longer sequence then stores the full chunk. A later shorter query ending inside a chunk
    stored only in full gets the chunk's leading pages from the leading-page index (default); with
    the index off it loses them (at most C-1 pages) unless a partial object ends there."""
    st = make_store(scheme) if index else make_store(scheme, leading_page_index=False)
    _, _, keys = _chain(fp, 11)
    _fill(st, 0, 11)
    assert st.batch_set(keys[:6], S(0, 6)) == [True] * 6  # chunk 0 full + partial (pages 4,5)
    assert st.batch_exists(keys) == 6  # probe finds the partial object of chunk 1
    assert st.batch_get(keys, S(30, 41)) == [True] * 6 + [False] * 5
    assert same_bytes(st.pool.buf[0:6], st.pool.buf[30:36])
    # the longer sequence writes full chunk 1 and partial chunk 2 (chunk 0 skipped)
    before = st.stats()
    assert st.batch_set(keys, S(0, 11)) == [True] * 11
    after = st.stats()
    assert after.objects_written - before.objects_written == 2
    assert after.index_written - before.index_written == (2 if index else 0)
    assert st.batch_exists(keys) == 11
    if index:  # pages 4..6 of the full object [4, 8), pages 4, 5 of the partial one
        assert [st.batch_exists(keys[:n]) for n in (7, 6, 5)] == [7, 6, 5]
        assert st.batch_get(keys[:7], S(30, 37)) == [True] * 7
        assert same_bytes(st.pool.buf[0:7], st.pool.buf[30:37])
    else:  # pages 4, 5 only where the partial object ends
        assert [st.batch_exists(keys[:n]) for n in (7, 6, 5)] == [6, 6, 4]


def test_prefix_ending_or_diverging_inside_an_object_gets_its_leading_pages(scheme, make_store, fp):
    """#27 item 3b: a query that reaches an object's first page
    but ends (or diverges from the stored chain) inside the object still gets the object's leading
    pages that match its own chain, on every scheme alike; a corrupt object is a miss. Written
    against the public API only (no object names), so it holds for any object layout. A query
    starting inside a chunk cannot compute the key of the chunk's first page: the caller passes it
    (``chunk_start_key``), or that chunk gives no leading pages."""
    st = make_store(scheme)  # the defaults: the leading-page index on
    ns, toks, keys = _chain(fp, 8)  # objects [0, 4) and [4, 8), full
    _fill(st, 0, 8, seed=5)
    assert st.batch_set(keys, S(0, 8)) == [True] * 8
    # ends inside object [4, 8): its pages 4 and 5 come from it
    assert st.batch_exists(keys[:6]) == 6
    assert st.batch_get(keys[:6], S(20, 26)) == [True] * 6
    assert same_bytes(st.pool.buf[0:6], st.pool.buf[20:26])
    # the same from the object's first page (a query after an L2 hit of pages 0..3)
    assert st.batch_exists(keys[4:7], first_page=4) == 3
    assert st.batch_get(keys[4:7], S(30, 33), first_page=4) == [True] * 3
    assert same_bytes(st.pool.buf[4:7], st.pool.buf[30:33])
    # from inside the object (a query after an L2 hit of pages 0..4)
    assert st.batch_exists(keys[5:7], first_page=5) == 0
    assert st.batch_exists(keys[5:7], first_page=5, chunk_start_key=keys[4]) == 2
    assert st.batch_get(keys[5:7], S(34, 36), first_page=5, chunk_start_key=keys[4]) == [True] * 2
    assert same_bytes(st.pool.buf[5:7], st.pool.buf[34:36])
    # diverges at page 6: only pages 4 and 5 of the object match this chain
    other = toks.copy()
    other[6 * fp.page_size :] += 1
    diverged = page_keys(ns, other)
    assert diverged[:6] == keys[:6] and diverged[6] != keys[6]
    assert st.batch_exists(diverged) == 6
    assert st.batch_get(diverged, S(40, 48)) == [True] * 6 + [False] * 2
    assert same_bytes(st.pool.buf[0:6], st.pool.buf[40:46])
    assert st.batch_exists(diverged[5:8], first_page=5, chunk_start_key=keys[4]) == 1  # page 5 only
    assert st.batch_exists(diverged[6:8], first_page=6, chunk_start_key=keys[4]) == 0  # shares no page


def test_corrupt_object_gives_no_leading_pages(scheme, make_store, fp):
    """An object found for its leading pages is verified whole first: corrupt, it is a miss (and its
    good sibling still loads). The store holds only object [4, 8), written alone; the query ends
    inside it."""
    st = make_store(scheme)  # the defaults: the leading-page index on
    _, _, keys = _chain(fp, 8)
    _fill(st, 0, 8, seed=6)
    assert st.batch_set(keys[4:], S(4, 8), first_page=4) == [True] * 4
    assert st.batch_get(keys[4:6], S(20, 22), first_page=4) == [True] * 2
    assert same_bytes(st.pool.buf[4:6], st.pool.buf[20:22])
    (path,) = [p for p in st.fs.find(st._root) if "/i/" not in p]  # the one object stored
    blob = bytearray(st.fs.cat_file(path))
    blob[-1] ^= 0x01  # the last payload byte: a page the query does not use, checked all the same
    st.fs.pipe_file(path, bytes(blob))
    assert st.batch_get(keys[4:6], S(30, 32), first_page=4) == [False] * 2
    assert st.stats().corrupt_objects >= 1


def test_leading_page_index_entry_bad_or_dangling_gives_no_leading_pages(scheme, make_store, fp):
    """An index entry only points at an object: one that fails its checks is no candidate, and one
    whose object is gone gives nothing (the object's existence is checked before it counts)."""
    st = make_store(scheme, leading_page_index=True)
    _, _, keys = _chain(fp, 8)
    _fill(st, 0, 8, seed=8)
    st.batch_set(keys, S(0, 8))
    (entry,) = [p for p in st.fs.find(st._root) if "/i/" in p and p.endswith(keys[7])]
    good = st.fs.cat_file(entry)
    assert st.batch_exists(keys[:6]) == 6
    for bad in (good[:-1] + bytes([good[-1] ^ 1]), good[32:], good + b"\0"):  # checksum, length
        st.fs.rm_file(entry)
        st.fs.pipe_file(entry, bad)
        assert st.batch_exists(keys[:6]) == 4
        assert st.batch_get(keys[:6], S(20, 26)) == [True] * 4 + [False] * 2
    st.fs.rm_file(entry)
    st.fs.pipe_file(entry, good)
    st.fs.rm_file(st.object_path(keys[7]))  # the entry dangles
    assert st.batch_exists(keys[:6]) == 4
    assert st.batch_get(keys[:6], S(20, 26)) == [True] * 4 + [False] * 2


def test_more_siblings_than_candidates_bounded_reads_never_another_chains_pages(scheme, make_store, fp):
    """Twelve chains share pages 0..4 and diverge at page 5, so chunk [4, 8) has twelve objects with
    the same first page. A query of one of them ending at page 6 reads at most
    ``MAX_CANDIDATES`` index entries: it gets its own object's pages 4..6 if its entry is among
    those read, else the shared page 4 from a sibling, and never a sibling's page 5 or 6."""
    st = make_store(scheme)
    ns = Namespace(fp)
    chains = []
    for s in range(12):
        toks = np.arange(8 * fp.page_size, dtype=np.int64)
        toks[5 * fp.page_size :] += 1000 * (s + 1)
        keys = page_keys(ns, toks)
        _fill(st, 0, 5, seed=1)  # the shared pages: the same KV whichever chain stores them
        _fill(st, 5, 8, seed=100 + s)
        assert st.batch_set(keys, S(0, 8)) == [True] * 8
        chains.append(keys)
    assert len({k[4] for k in chains}) == 1 and len({k[5] for k in chains}) == 12
    # the folder's listing asks for its first names only (in name order, on every scheme alike)
    folder = st._pools[PoolKind.KV].chunking.index_dir(chains[0][4])
    every, first3 = st._io.mixed([IoItem(IoKind.LIST, folder), IoItem(IoKind.LIST, folder, first=3)], Deadline(20.0))
    assert len(every) == 12 and first3 == sorted(every)[:3]
    for s in (0, 11):
        before = st.stats()
        n = st.batch_exists(chains[s][:7])
        assert st.stats().index_reads - before.index_reads <= leading_index.MAX_CANDIDATES
        assert n in (5, 7)
        assert st.batch_get(chains[s][:7], S(20, 27)) == [True] * n + [False] * (7 - n)
        _fill(st, 5, 8, seed=100 + s)
        assert same_bytes(st.pool.buf[0:n], st.pool.buf[20 : 20 + n])


def test_the_same_writes_give_the_same_hits_on_every_scheme(make_store, fp):
    """No scheme has names of its own: for the same writes (full chunks, partial tails, a prefix
    stored before its longer sequence, an object deleted behind the store's back), file://,
    memory:// and gs:// answer every prefix query alike, in ``batch_exists`` (with and without
    ``min_pages``) and in ``batch_get``."""
    chains = [_chain(fp, n, salt=f"same-{n}")[2] for n in (3, 6, 11, 12)]
    answers = {}
    for scheme in ("memory", "file", "gs"):
        st = make_store(scheme)
        _fill(st, 0, 12, seed=3)
        for c, n in ((0, 3), (1, 6), (2, 6), (2, 11), (3, 12)):  # (chain, pages stored)
            assert st.batch_set(chains[c][:n], S(0, n)) == [True] * n
        st.fs.rm_file(st.object_path(chains[3][7]))  # chain 3 keeps its first object only
        exists, loaded = [], []
        for keys in chains:
            for first in range(0, len(keys), 3):
                for end in range(first + 1, len(keys) + 1):
                    q = keys[first:end]
                    exists.append((st.batch_exists(q, first_page=first), st.batch_exists(q, first_page=first, min_pages=2)))
            res = st.batch_get(keys, S(20, 20 + len(keys)))
            loaded.append(sum(res))
            assert res == [True] * sum(res) + [False] * (len(res) - sum(res))
            assert same_bytes(st.pool.buf[20 : 20 + sum(res)], st.pool.buf[0 : sum(res)])
        assert loaded == [3, 6, 11, 4], scheme
        answers[scheme] = exists
    assert answers["file"] == answers["memory"] == answers["gs"]


def test_misaligned_query(scheme, make_store, fp):
    st = make_store(scheme)
    _, _, keys = _chain(fp, 12)
    _fill(st, 0, 12)
    st.batch_set(keys, S(0, 12))
    assert st.batch_exists(keys[5:], first_page=5) == 7
    assert st.batch_get(keys[5:], S(40, 47), first_page=5) == [True] * 7
    assert same_bytes(st.pool.buf[5:12], st.pool.buf[40:47])
    with pytest.raises(ValueError, match="first_page=5"):
        st.batch_set(keys[5:], S(5, 12), first_page=5)


def test_min_pages_answers_exactly_at_or_above_it(scheme, make_store, make_url, fp):
    """``batch_exists(min_pages=k)`` equals the plain answer when that is >= k, and is < k otherwise,
    for stored prefixes ending anywhere in a chunk and queries starting mid-chunk; a second instance
    that answered a miss sees the first one's later writes."""
    url = make_url(scheme)
    writer, reader = make_store(scheme, url=url), make_store(scheme, url=url)
    chains = [_chain(fp, 10, salt=f"s{n}")[2] for n in (5, 6, 7, 8)]
    assert all(reader.batch_exists(keys, min_pages=2) == 0 for keys in chains)
    _fill(writer, 0, 10)
    for n, keys in zip((5, 6, 7, 8), chains):  # chunk 0 full, then 1, 2, 3 or 4 pages of chunk 1
        writer.batch_set(keys[:n], S(0, n))
    for keys in chains:
        for first in (0, 3, 5):
            for n in (1, 2, 4, 10 - first):
                q = keys[first : first + n]
                exact = reader.batch_exists(q, first_page=first)
                for least in (1, 2, 3, 5):
                    got = reader.batch_exists(q, first_page=first, min_pages=least)
                    assert got == exact if exact >= least else got < least, (first, n, least, exact, got)
    assert reader.batch_get(chains[2][:7], S(20, 27)) == [True] * 7
    assert same_bytes(reader.pool.buf[20:27], writer.pool.buf[0:7])


def test_min_pages_bad_input_raises_and_changes_nothing(scheme, make_store, fp):
    st = make_store(scheme)
    _, _, keys = _chain(fp, 4)
    before = st.stats()
    for bad, exc in ((0, ValueError), (-1, ValueError), (True, TypeError), ("2", TypeError), (2.0, TypeError)):
        with pytest.raises(exc, match="min_pages"):
            st.batch_exists(keys, min_pages=bad)
    assert st.stats() == before


def _opts(scheme):
    return {"token": "anon"} if scheme == "gs" else {}


def test_multi_pool_transfer(scheme, make_url, fp):
    st = FsspecStorage(make_url(scheme), fp, StorageConfig(pages_per_object=4, storage_options=_opts(scheme)))
    kv = NumpyHostPool(32, (2, 2, 4, 2, 8), np.float32)
    mamba = NumpyHostPool(8, (3, 5), np.float16)
    st.register_host_pool(kv, shard=ShardCoord.full(fp))
    st.register_host_pool(mamba, shard=ShardCoord(0, 1, 1, 0, 2, 2), kind=PoolKind.MAMBA, pages_per_object=1)
    with pytest.raises(ValueError, match="already registered"):
        st.register_host_pool(mamba, shard=ShardCoord(0, 1, 1, 0, 2, 2), kind=PoolKind.MAMBA)
    _, _, keys = _chain(fp, 6)
    kv.fill_random(S(0, 6), 3)
    mamba.fill_random(S(0, 1), 4)
    tr = [PoolTransfer(PoolKind.KV, keys, S(0, 6)), PoolTransfer(PoolKind.MAMBA, keys[5:], S(0, 1), first_page=5)]
    assert st.batch_set_pools(tr) == [[True] * 6, [True]]
    assert st.batch_exists(keys[5:], first_page=5, pool=PoolKind.MAMBA) == 1
    assert st.batch_exists(keys[4:5], first_page=4, pool=PoolKind.MAMBA) == 0
    back = [PoolTransfer(PoolKind.KV, keys, S(10, 16)), PoolTransfer("mamba", keys[5:], S(3, 4), first_page=5)]
    assert st.batch_get_pools(back) == [[True] * 6, [True]]
    assert same_bytes(kv.buf[0:6], kv.buf[10:16]) and same_bytes(mamba.buf[0:1], mamba.buf[3:4])
    with pytest.raises(ValueError, match="swa"):
        st.batch_get_pools([PoolTransfer(PoolKind.SWA, keys, S(0, 6))])
    st.close()


def test_exists_each_answers_per_key_for_one_page_pools(scheme, make_url, fp):
    """A component pool's values are sparse along the chain (a state at some node ends): ``exists_each`` answers
    per key in one round; write-once holds for them as for KV (a second write skips the stored object); a pool
    of several pages per object is refused, naming it."""
    st = FsspecStorage(make_url(scheme), fp, StorageConfig(pages_per_object=4, storage_options=_opts(scheme)))
    kv = NumpyHostPool(8, (2, 2, 4, 2, 8), np.float32)
    mamba = NumpyHostPool(8, (3, 5), np.float32)
    st.register_host_pool(kv, shard=ShardCoord.full(fp))
    st.register_host_pool(mamba, shard=ShardCoord(0, 1, 1, 0, 2, 2), kind=PoolKind.MAMBA, pages_per_object=1)
    _, _, keys = _chain(fp, 6)
    mamba.fill_random(S(0, 2), 5)
    tr = [PoolTransfer(PoolKind.MAMBA, keys[1:2], S(0, 1), first_page=1),
          PoolTransfer(PoolKind.MAMBA, keys[4:5], S(1, 2), first_page=4)]
    assert st.batch_set_pools(tr) == [[True], [True]]
    assert st.exists_each(keys, pool=PoolKind.MAMBA) == [False, True, False, False, True, False]
    assert st.exists_each([], pool=PoolKind.MAMBA) == []
    written = st.stats().objects_written
    assert st.batch_set_pools(tr[:1]) == [[True]]  # write-once: already stored, not written again
    assert st.stats().objects_written == written and st.stats().objects_skipped_existing >= 1
    with pytest.raises(ValueError, match="'kv' has 4"):
        st.exists_each(keys, pool=PoolKind.KV)
    with pytest.raises(ValueError, match="swa"):
        st.exists_each(keys, pool=PoolKind.SWA)
    st.close()


def test_named_objects_hold_a_run_of_pages_under_one_name(scheme, make_url, fp):
    """A pool of named objects (a hybrid model's values at a node end, e.g. an SWA window's pages): a run written
    at position 0 is ONE object named by its last key, found by ``exists_each`` and read back whole; no
    leading-page index entry beside it, no shorter object probed on a miss; the KV pool refuses the layout."""
    st = FsspecStorage(make_url(scheme), fp, StorageConfig(pages_per_object=4, storage_options=_opts(scheme)))
    kv = NumpyHostPool(8, (2, 2, 4, 2, 8), np.float32)
    swa = NumpyHostPool(8, (3, 5), np.float32)
    with pytest.raises(ValueError, match="named_objects is for component pools"):
        st.register_host_pool(kv, shard=ShardCoord.full(fp), kind=PoolKind.KV, named_objects=True)
    st.register_host_pool(kv, shard=ShardCoord.full(fp))
    st.register_host_pool(swa, shard=ShardCoord(0, 1, 1, 0, 2, 2), kind=PoolKind.SWA, pages_per_object=64,
                          named_objects=True)
    _, _, keys = _chain(fp, 6)
    swa.fill_random(S(0, 3), 6)
    assert st.batch_set_pools([PoolTransfer(PoolKind.SWA, [keys[4]] * 3, S(0, 3))]) == [[True] * 3]
    assert st.stats().objects_written == 1 and st.stats().index_written == 0
    assert st.exists_each(keys, pool=PoolKind.SWA) == [False, False, False, False, True, False]
    assert st.batch_get_pools([PoolTransfer(PoolKind.SWA, [keys[4]] * 3, S(4, 7))]) == [[True] * 3]
    assert same_bytes(swa.buf[0:3], swa.buf[4:7])
    asked = st.stats().exists_calls
    assert st.batch_get_pools([PoolTransfer(PoolKind.SWA, [keys[5]] * 3, S(4, 7))]) == [[False] * 3]
    assert st.stats().exists_calls == asked and st.stats().index_lookups == 0
    st.close()


def test_bfloat16_pool(scheme, make_url):
    fp16 = ModelFingerprint("bf", "bfloat16", 4, 2, 2, 8)
    st = FsspecStorage(make_url(scheme), fp16, StorageConfig(storage_options=_opts(scheme)))
    pool = NumpyHostPool(8, (2, 2, 4, 2, 8), ml_dtypes.bfloat16)
    st.register_host_pool(pool, shard=ShardCoord.full(fp16))
    assert st.pages_per_object() == st.config.target_object_bytes or st.pages_per_object() >= 1
    _, _, keys = _chain(fp16, 3)
    pool.fill_random(S(0, 3), 9)
    assert st.batch_set(keys, S(0, 3)) == [True] * 3
    assert st.batch_get(keys, S(4, 7)) == [True] * 3
    assert same_bytes(pool.buf[0:3], pool.buf[4:7])
    st.close()


@pytest.mark.parametrize("which", ["salt", "extra_key", "fingerprint"])
def test_isolation(scheme, make_store, make_url, fp, which):
    url = make_url(scheme)
    st = make_store(scheme, url=url)
    _, _, keys = _chain(fp, 8)
    _fill(st, 0, 8)
    st.batch_set(keys, S(0, 8))
    if which == "fingerprint":
        fp2 = dataclasses.replace(fp, layout_version=2)
        other = make_store(scheme, url=url, fp=fp2)
        _, _, keys2 = _chain(fp2, 8)
    else:
        other = st
        _, _, keys2 = _chain(fp, 8, salt="tenant-b" if which == "salt" else None, extra="lora-x" if which == "extra_key" else None)
    assert set(keys2).isdisjoint(keys)
    assert other.batch_exists(keys2) == 0
    assert other.batch_get(keys2, S(30, 38)) == [False] * 8
    if which == "fingerprint":  # same key, other fingerprint's store: still nothing
        assert other.batch_exists(keys) == 0


def _rewrite(st, key, data: bytes):
    st.fs.pipe_file(st.object_path(key), data)


def _corruptions(st, fp, key, blob: bytes):
    hlen = len(blob) - 4 * st.pool.slot_bytes
    flip_payload = bytearray(blob)
    flip_payload[hlen + 37] ^= 0x10
    flip_header = bytearray(blob)
    flip_header[90] ^= 0x01  # inside num_pages
    wrong_version = bytearray(blob)
    struct.pack_into("<H", wrong_version, 8, FORMAT_VERSION + 1)
    other_fp = dataclasses.replace(fp, model_id="other").digest()
    meta = ObjectMeta(ObjectKind.PAGES, other_fp, bytes.fromhex(key), 0, 4, "float32", st.pool.slot_shape)
    payload = np.frombuffer(blob[hlen:], np.uint8)
    wrong_fp = encode_header(meta, payload) + bytes(payload)
    meta_shape = dataclasses.replace(meta, fingerprint=fp.digest(), shape=(2, 2, 4, 8, 2))
    wrong_shape = encode_header(meta_shape, payload) + bytes(payload)
    meta_dtype = dataclasses.replace(meta, fingerprint=fp.digest(), dtype="int32")
    wrong_dtype = encode_header(meta_dtype, payload) + bytes(payload)
    return {
        "flip_payload": (bytes(flip_payload), CorruptReason.BAD_CHECKSUM),
        "flip_header": (bytes(flip_header), CorruptReason.BAD_HEADER),
        "truncate": (blob[:-100], CorruptReason.SHORT),
        "truncate_header": (blob[:50], CorruptReason.SHORT),
        "trailing": (blob + b"x", CorruptReason.TRAILING),
        "wrong_version": (bytes(wrong_version), CorruptReason.BAD_VERSION),
        "wrong_fingerprint": (wrong_fp, CorruptReason.BAD_FINGERPRINT),
        "wrong_shape": (wrong_shape, CorruptReason.BAD_SHAPE),
        "wrong_dtype": (wrong_dtype, CorruptReason.BAD_DTYPE),
        "garbage": (b"not an object at all", CorruptReason.BAD_MAGIC),
    }


def test_corrupt_objects_are_counted_misses(scheme, make_store, fp):
    st = make_store(scheme)
    _, _, keys = _chain(fp, 4)  # exactly one object
    _fill(st, 0, 4)
    st.batch_set(keys, S(0, 4))
    blob = st.fs.cat_file(st.object_path(keys[3]))
    cases = _corruptions(st, fp, keys[3], blob)
    # also: the object of another key/position copied under this name
    _, _, keys_b = _chain(fp, 4, start=999)
    st.batch_set(keys_b, S(0, 4))
    cases["swapped"] = (st.fs.cat_file(st.object_path(keys_b[3])), CorruptReason.BAD_KEY)
    sentinel = np.full((4, *st.pool.slot_shape), 7.0, np.float32)
    for name, (bad, reason) in cases.items():
        _rewrite(st, keys[3], bad)
        st.pool.buf[40:44] = sentinel
        before = st.stats().corrupt_by_reason.get(reason.value, 0)
        assert st.batch_get(keys, S(40, 44)) == [False] * 4, name
        assert same_bytes(st.pool.buf[40:44], sentinel), f"{name}: the pool was touched"
        assert st.stats().corrupt_by_reason.get(reason.value, 0) == before + 1, name
        # the corrupt object was removed, so the page can be stored again and then loads
        assert st.batch_exists(keys) == 0, name
        assert st.batch_set(keys, S(0, 4)) == [True] * 4, name
        assert st.batch_get(keys, S(40, 44)) == [True] * 4, name
        assert same_bytes(st.pool.buf[40:44], st.pool.buf[0:4]), name
    s = st.stats()
    # at rest: the same stored bytes failed twice, so each was deleted (conditionally on gs://)
    assert (s.corrupt_objects, s.corrupt_at_rest, s.corrupt_deleted, s.corrupt_in_transit) == (len(cases),) * 3 + (0,)


def test_bad_input_raises_and_changes_nothing(scheme, make_store, fp):
    st = make_store(scheme)
    _, _, keys = _chain(fp, 4)
    _fill(st, 0, 4)
    before = st.stats()
    bad_calls = [
        (lambda: st.batch_set(keys, S(0, 3)), ValueError, r"\(4,\)"),
        (lambda: st.batch_set(keys, np.arange(4.0)), TypeError, "float"),
        (lambda: st.batch_set(keys[:3] + ["xyz"], S(0, 4)), ValueError, "keys\\[3\\]"),
        (lambda: st.batch_set(keys[:3] + [b"k" * 64], S(0, 4)), TypeError, "keys\\[3\\]"),
        (lambda: st.batch_set(keys, np.array([0, 1, -2, 3], np.int32)), ValueError, "-2"),
        (lambda: st.batch_set(keys, S(0, 4), first_page=-1), ValueError, "-1"),
        (lambda: st.batch_set(keys, S(0, 4), first_page=2), ValueError, "first_page=2"),
        (lambda: st.batch_set("abc", S(0, 4)), TypeError, "str"),
        (lambda: st.batch_get(keys, np.array([1, 1, 2, 3], np.int32)), ValueError, "duplicate"),
        (lambda: st.batch_get(keys, S(0, 4), pool="nope"), ValueError, "nope"),
        (lambda: st.batch_exists(keys, timeout_s=0), ValueError, "timeout_s"),
        (lambda: st.batch_set_pools([object()]), TypeError, "transfers\\[0\\]"),
    ]
    for call, exc, match in bad_calls:
        with pytest.raises(exc, match=match):
            call()
    assert st.stats() == before
    assert st.batch_exists(keys) == 0


def test_manifest_warm_restart(scheme, make_store, make_url, fp):
    url = make_url(scheme)
    st = make_store(scheme, url=url)
    ns, toks, keys = _chain(fp, 10)
    _fill(st, 0, 10)
    st.batch_set(keys, S(0, 10))
    assert st.record_prefix(ns, toks[: 6 * fp.page_size + 1])  # partial page dropped
    assert st.record_prefix(ns, toks)
    assert st.record_prefix(ns, toks)  # idempotent
    ns_b, toks_b, keys_b = _chain(fp, 3, salt="b")
    st.batch_set(keys_b, S(0, 3))
    st.record_prefix(ns_b, toks_b)
    # "restart": a new instance over the same URL
    st2 = make_store(scheme, url=url)
    got = st2.list_prefixes(ns)
    assert len(got) == 1  # the 6-page entry is a prefix of the 10-page one
    assert got[0].num_pages == 10 and np.array_equal(got[0].tokens, toks) and got[0].keys == tuple(keys)
    assert [p.num_pages for p in st2.list_prefixes(ns_b)] == [3]
    # pages evicted behind the manifest's back: entries are trimmed to what is stored
    st.fs.rm_file(st.object_path(keys[7]))
    got = st2.list_prefixes(ns)
    assert [p.num_pages for p in got] == [4]  # both entries trimmed to chunk 0, deduplicated
    assert np.array_equal(got[0].tokens, toks[: 4 * fp.page_size])
    with pytest.raises(ValueError, match="fingerprint"):
        st2.list_prefixes(Namespace(dataclasses.replace(fp, head_dim=16)))


def test_manifest_namespaces_sharing_a_fanout_directory_list_only_their_own(scheme, make_store, make_url, fp):
    """Manifest entries of every namespace whose digest starts with the same hex digit share one
    directory: each namespace lists its own entries only (a new store instance included)."""
    url = make_url(scheme)
    st = make_store(scheme, url=url)
    ns_a, toks_a, keys_a = _chain(fp, 4, salt="a")
    ns_b = next(ns for ns in (Namespace(fp, cache_salt=f"b{i}") for i in range(200))
                if ns.hexdigest()[0] == ns_a.hexdigest()[0])
    toks_b = toks_a[: 2 * fp.page_size] + 7
    keys_b = page_keys(ns_b, toks_b)
    _fill(st, 0, 6)
    st.batch_set(keys_a, S(0, 4))
    st.batch_set(keys_b, S(4, 6))
    assert st.record_prefix(ns_a, toks_a) and st.record_prefix(ns_b, toks_b)
    st2 = make_store(scheme, url=url)
    got_a, got_b = st2.list_prefixes(ns_a), st2.list_prefixes(ns_b)
    assert [(p.num_pages, p.keys) for p in got_a] == [(4, tuple(keys_a))]
    assert [(p.num_pages, p.keys) for p in got_b] == [(2, tuple(keys_b))]
    assert st2.list_prefixes(Namespace(fp, cache_salt="neither")) == []


def test_manifest_entry_is_named_by_one_hash_of_its_tokens_and_checked_against_it(scheme, make_store, make_url, fp):
    """A manifest entry's name is ``{namespace[:32]}-`` + SHA-256(namespace seed, int64 LE tokens):
    one hash over the tokens, not the chain hashed page by page. An entry listed under a name that
    is not its own content's (copied, or renamed) is ignored."""
    url = make_url(scheme)
    st = make_store(scheme, url=url)
    ns, toks, keys = _chain(fp, 8, salt="tagged")
    _fill(st, 0, 8)
    st.batch_set(keys, S(0, 8))
    other = make_store(scheme, url=url)  # another writer's prefix entry: kept beside the longer one
    assert other.record_prefix(ns, toks[: 4 * fp.page_size]) and st.record_prefix(ns, toks)
    d, prefix = st._manifest.location(ns)
    tag = hashlib.sha256(ns.seed() + np.asarray(toks, "<i8").tobytes()).hexdigest()
    names = sorted(os.path.basename(p) for p in st.fs.find(d) if os.path.basename(p).startswith(prefix))
    assert f"{prefix}{tag}" in names and len(names) == 2
    short = next(n for n in names if n != f"{prefix}{tag}")
    st.fs.rm_file(f"{d}/{short}")  # the 4-page entry's bytes, re-listed under a name of 8 pages' worth
    st.fs.pipe_file(f"{d}/{prefix}{'0' * 64}", st.fs.cat_file(f"{d}/{prefix}{tag}"))
    st2 = make_store(scheme, url=url)
    assert [p.num_pages for p in st2.list_prefixes(ns)] == [8]  # the renamed copy is not an entry


def test_write_once_under_concurrent_writers_publishes_one_complete_object(scheme, make_store):
    """The object store's write-once (file://: temp file + link; memory://, gs://:
    ``mode="create"``): writers of one name released together → exactly one publishes, the others
    get ``FileExistsError``, the object is the winner's complete bytes, and nothing else is left."""
    if scheme == "gs":
        pytest.skip("gcp-storage-emulator ignores ifGenerationMatch=0, the precondition gcsfs sends for mode='create'")
    st = make_store(scheme)
    store = st._io.store
    d = f"{st._root}/race"
    path = f"{d}/obj"
    n = 4
    barrier = threading.Barrier(n)
    payloads = [np.full(1 << 16, i, np.uint8) for i in range(n)]
    outcome: dict[int, object] = {}

    def writer(i):
        barrier.wait()
        try:
            store.write_once(path, b"H%d" % i, payloads[i])
            outcome[i] = "won"
        except FileExistsError:
            outcome[i] = "exists"

    ts = [threading.Thread(target=writer, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    winners = [i for i, r in outcome.items() if r == "won"]
    assert len(winners) == 1 and sorted(outcome) == list(range(n)), outcome
    assert bytes(store.read(path)) == b"H%d" % winners[0] + payloads[winners[0]].tobytes()
    assert [os.path.basename(p) for p in store.list(d)] == ["obj"]
    with pytest.raises(FileExistsError):
        store.write_once(path, b"again", payloads[0])
    with pytest.raises(FileNotFoundError):
        store.read(f"{d}/missing")


def test_clear(scheme, make_store, fp):
    st = make_store(scheme)
    _, _, keys = _chain(fp, 8)
    st.batch_set(keys, S(0, 8))
    assert st.batch_exists(keys) == 8
    st.clear()
    assert st.batch_exists(keys) == 0
    assert st.batch_set(keys, S(0, 8)) == [True] * 8


def test_empty_batches(scheme, make_store):
    st = make_store(scheme)
    assert st.batch_exists([]) == 0
    assert st.batch_get([], S(0, 0)) == []
    assert st.batch_set([], S(0, 0)) == []
