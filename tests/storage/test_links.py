"""file:// link names (``StorageConfig.link_every_pages``): an object of C pages is also reachable
under the chain key of every S-th page inside it, so a query that ends or diverges inside it still
reads its leading pages (it loses < S pages, not < C), from one object per chunk; an object that
starts the chain also under its page 1 (format v4: a miss of a 2-page minimum is one stat). Reads through a
link verify the header's binding of that name and the whole payload; corrupt -> a wiped miss.
The byte cap counts an object once and evicts all of its names together."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hicache.storage import ChainKeys, Namespace, page_keys
from hicache.storage.testing import NumpyHostPool, same_bytes
from hicache.storage.testing import slot_range as S

SLOT_SHAPE = (2, 2, 4, 2, 8)  # conftest's pool


class _CopiesOnly(NumpyHostPool):
    """A pool without zero-copy views or concurrent slot I/O (like the workers' host pools)."""

    concurrent_slot_io = False
    slot_view = None


def _tokens(fp, n_pages: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, n_pages * fp.page_size)


@pytest.fixture(params=["views", "copies"])
def store16(request, make_store, fp):
    pool = NumpyHostPool(64, SLOT_SHAPE, np.float32) if request.param == "views" else _CopiesOnly(64, SLOT_SHAPE, np.float32)
    st = make_store("file", pool=pool, pages_per_object=16, link_every_pages=4)
    assert st._pools[next(iter(st._pools))].link_every == 4
    return st


def test_one_object_per_chunk_with_link_names(store16, fp):
    st = store16
    keys = page_keys(Namespace(fp), _tokens(fp, 16, 0))
    st.pool.fill_random(S(0, 16), 1)
    assert st.batch_set(keys, S(0, 16)) == [True] * 16
    assert st.stats().objects_written == 1
    ino = os.stat(st.object_path(keys[15])).st_ino
    assert [os.stat(st.object_path(keys[p])).st_ino for p in (1, 3, 7, 11)] == [ino] * 4
    assert not os.path.exists(st.object_path(keys[5]))
    assert st.batch_get(keys, S(16, 32)) == [True] * 16 and same_bytes(st.pool.buf[16:32], st.pool.buf[0:16])


@pytest.mark.parametrize("end", [1, 3, 4, 6, 11, 15])
def test_a_query_ending_inside_the_object_reads_up_to_its_last_link(store16, fp, end):
    st = store16
    keys = page_keys(Namespace(fp), _tokens(fp, 16, 0))
    st.pool.fill_random(S(0, 16), 2)
    st.batch_set(keys, S(0, 16))
    want = end // 4 * 4 or end // 2 * 2  # pages up to the last link at or before the query's end
    assert st.batch_exists(keys[:end]) == want
    st.pool.buf[16:32] = 0
    assert st.batch_get(keys[:end], S(16, 16 + end)) == [True] * want + [False] * (end - want)
    assert same_bytes(st.pool.buf[16 : 16 + want], st.pool.buf[0:want])


def test_a_query_diverging_inside_the_object_reads_the_shared_pages(store16, fp):
    st = store16
    a = _tokens(fp, 20, 0)
    b = a.copy()
    b[10 * fp.page_size + 1] += 1  # b shares pages 0..9 with a, differs from page 10 on
    ka, kb = page_keys(Namespace(fp), a), page_keys(Namespace(fp), b)
    assert ka[:10] == kb[:10] and ka[10] != kb[10]
    st.pool.fill_random(S(0, 20), 3)
    st.batch_set(ka, S(0, 20))  # one full object (pages 0..15) + the tail (16..19)
    assert st.batch_exists(kb) == 8  # up to the link at page 7 (without links: 0)
    assert st.batch_get(kb, S(32, 52)) == [True] * 8 + [False] * 12
    assert same_bytes(st.pool.buf[32:40], st.pool.buf[0:8])


def test_a_corrupt_object_read_through_a_link_is_a_wiped_miss(store16, fp):
    st = store16
    keys = page_keys(Namespace(fp), _tokens(fp, 16, 0))
    st.pool.fill_random(S(0, 16), 4)
    st.batch_set(keys, S(0, 16))
    path = st.object_path(keys[15])
    with open(path, "r+b") as f:  # flip a payload byte of page 2 (shared by every name)
        f.seek(os.path.getsize(path) - 14 * st.pool.slot_bytes + 5)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    st.pool.buf[16:32] = 7.0
    assert st.batch_get(keys[:6], S(16, 22)) == [False] * 6
    assert not (st.pool.buf[16:20] == st.pool.buf[0:4]).all()  # corrupt bytes never stay as data
    assert st.stats().corrupt_by_reason == {"bad_checksum": 1}


def test_byte_cap_counts_an_object_once_and_evicts_all_its_names(make_store, fp):
    probe = make_store("file", pages_per_object=16, link_every_pages=4)
    obj = probe._pools[next(iter(probe._pools))].object_bytes(0, 16)
    st = make_store("file", pages_per_object=16, link_every_pages=4, max_bytes=3 * obj, evict_low_watermark=0.7)
    chains = [page_keys(Namespace(fp, cache_salt=str(c)), _tokens(fp, 16, c)) for c in range(4)]
    st.pool.fill_random(S(0, 16), 5)
    for keys in chains[:3]:
        st.batch_set(keys, S(0, 16))
    assert st.used_bytes() == 3 * obj and st.stats().evicted_objects == 0  # 3 objects, 15 names: at the cap
    st.batch_set(chains[3], S(0, 16))  # over the cap: evict the oldest down to 0.7 x cap
    assert st.used_bytes() == 2 * obj
    s = st.stats()
    assert (s.evicted_objects, s.evicted_bytes) == (2, 2 * obj)
    left = [f for d, _, fs in os.walk(st._root) for f in fs if "/manifest" not in d]
    assert len(left) == 2 * 5  # no orphaned link names
    assert [st.batch_exists(keys) for keys in chains] == [0, 0, 16, 16]


def test_a_miss_probes_the_first_link_position_then_only_shorter_candidates(make_store, fp):
    """A chain's first chunk is asked at page 1 first (every stored chain of >= 2 pages is named
    there); a hit then climbs the link positions up to the first missing one."""
    st = make_store("file", pages_per_object=16, link_every_pages=4)
    if not st._io.inline_io:
        pytest.skip("the test's tmp dir is not on a local filesystem (stats go to the pool there)")
    asked = []
    inner = st._io.exists_one
    st._io.exists_one = lambda path, deadline: asked.append(path) or inner(path, deadline)
    keys = page_keys(Namespace(fp), _tokens(fp, 16, 0))
    lazy = ChainKeys(Namespace(fp), _tokens(fp, 16, 0))
    assert st.batch_exists(lazy) == 0
    # the first link position (page 1: every object of >= 2 pages is named there), then page 0
    assert asked == [st.object_path(keys[p]) for p in (1, 0)]
    assert lazy.hashed == 2  # a miss hashes the pages it asked about, not the whole chain
    st.pool.fill_random(S(0, 16), 6)
    st.batch_set(keys[:10], S(0, 10))  # one object of 10 pages, linked at pages 1, 3 and 7
    asked.clear()
    assert st.batch_exists(keys) == 10
    # page 1 (stored), the natural object (page 15, missing), the link positions 3, 7 (stored) and
    # 11 (missing), then the sizes below it down to the stored one (pages 10, 9)
    assert asked == [st.object_path(keys[p]) for p in (1, 15, 3, 7, 11, 10, 9)]
    asked.clear()
    st.batch_set(keys, S(0, 16))  # the whole chunk: page 1 and the natural object
    assert st.batch_exists(ChainKeys(Namespace(fp), _tokens(fp, 16, 0))) == 16
    assert asked == [st.object_path(keys[p]) for p in (1, 15)]


@pytest.mark.parametrize("ppo, every, links", [(4, 0, 0), (5, 4, 1), (16, 4, 3), (32, 4, 7), (64, 8, 7), (512, 64, 7)])
def test_link_spacing_grows_with_the_object(make_store, ppo, every, links):
    """At most 7 link names per object: beyond 32 pages the spacing grows with the chunk."""
    st = make_store("file", pages_per_object=ppo, link_every_pages=4)
    reg = st._pools[next(iter(st._pools))]
    assert (reg.link_every, reg.num_links(ppo, ppo)) == (every, links)
    assert reg.num_links(0, ppo) == links + (every > 2)  # a chain's first object: also page 1
    assert reg.prefix.endswith(f"/c{ppo}" + (f"l{every}" if every else ""))
    off = make_store("file", pages_per_object=ppo, link_every_pages=None)
    assert off._pools[next(iter(off._pools))].link_every == 0


def test_min_pages_leaves_out_only_the_shorter_candidates(make_store, make_url, fp):
    """``batch_exists(min_pages=k)``: names that could only make a hit of < k pages are not asked
    about (a miss costs fewer stats); a hit of >= k pages is found as without it, also when another
    store instance wrote it after this one answered a miss."""
    url = make_url("file")
    st, writer = make_store("file", url=url, pages_per_object=16, link_every_pages=4), make_store("file", url=url, pages_per_object=16, link_every_pages=4)
    if not st._io.inline_io:
        pytest.skip("the test's tmp dir is not on a local filesystem (stats go to the pool there)")
    asked = []
    inner = st._io.exists_one
    st._io.exists_one = lambda path, deadline: asked.append(path) or inner(path, deadline)
    tokens = _tokens(fp, 16, 0)
    keys = page_keys(Namespace(fp), tokens)
    for least, pages in ((1, (1, 0)), (2, (1,)), (3, (1,)), (4, (3,)), (5, (3,)), (9, (7,)), (16, (15,))):
        asked.clear()
        lazy = ChainKeys(Namespace(fp), tokens)
        assert st.batch_exists(lazy, min_pages=least) == 0
        assert asked == [st.object_path(keys[p]) for p in pages], least
        assert lazy.hashed == pages[0] + 1  # up to the page asked about first
    asked.clear()
    assert st.batch_exists(keys[:3], min_pages=4) == 0 and asked == []  # too few keys: no I/O
    writer.pool.fill_random(S(0, 16), 3)
    writer.batch_set(keys[:2], S(0, 2))  # a partial object of 2 pages (named at page 1)
    assert st.batch_exists(keys, min_pages=2) == 2 and st.batch_exists(keys) == 2
    assert st.batch_exists(keys, min_pages=3) < 3
    writer.batch_set(keys[:7], S(0, 7))  # 7 pages, linked at page 3
    assert st.batch_exists(keys, min_pages=5) == 7 == st.batch_exists(keys)
    assert st.batch_get(keys[:7], S(20, 27)) == [True] * 7
    assert same_bytes(st.pool.buf[20:27], writer.pool.buf[0:7])
    assert st.batch_exists(keys[5:], first_page=5, min_pages=2) == 2  # mid-chunk: counted from first_page
    assert st.batch_exists(keys[5:], first_page=5, min_pages=3) < 3


def test_min_pages_with_links_answers_exactly_at_or_above_it(store16, fp):
    """With link names (the gate moves to the largest link position below the shortest useful
    object): exact at or above ``min_pages`` for stored prefixes of any length, queries starting
    mid-chunk included; below it, any smaller count."""
    st = store16
    chains = {n: page_keys(Namespace(fp, cache_salt=f"n{n}"), _tokens(fp, 24, n)) for n in (1, 2, 3, 4, 5, 8, 9, 11, 16, 19)}
    st.pool.fill_random(S(0, 24), 5)
    for n, keys in chains.items():
        st.batch_set(keys[:n], S(0, n))
    for n, keys in chains.items():
        for first in (0, 2, 5):
            for q_end in (first + 1, first + 4, 9, 16, 24):
                if q_end <= first:
                    continue
                q = keys[first:q_end]
                exact = st.batch_exists(q, first_page=first)
                for least in (1, 2, 3, 4, 5, 7, 8, 9, 12, 16):
                    got = st.batch_exists(ChainKeys(Namespace(fp, cache_salt=f"n{n}"), _tokens(fp, 24, n)[first * fp.page_size : q_end * fp.page_size], parent=keys[first - 1] if first else None),
                                          first_page=first, min_pages=least)
                    assert got == exact if exact >= least else got < least, (n, first, q_end, least, exact, got)
