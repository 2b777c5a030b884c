"""Topology-free reads: pages stored by hosts of one layout (1, 2 or 4 hosts, each over its KV-head
range) are read bit for bit by the hosts of another, assembled from the shard objects that hold
their heads; a prefix is a miss only where a needed shard is missing."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.storage import FsspecStorage, ModelFingerprint, Namespace, ShardCoord, StorageConfig, page_keys
from hicache.storage.shard_cover import cover, parse_tag
from hicache.storage.testing import NumpyHostPool, same_bytes, slot_range

from .conftest import storage_options

HEADS = 4
FP4 = ModelFingerprint("shard-test", "float32", page_size=4, num_layers=2, num_kv_heads=HEADS, head_dim=8)
FULL_SHAPE = (2, 2, 4, HEADS, 8)  # [layers, K/V, page, heads, head_dim]
FULL_SLOT_BYTES = int(np.prod(FULL_SHAPE)) * 4
PAGES = 10


def ranges(hosts: int) -> list[tuple[int, int]]:
    per = HEADS // hosts
    return [(i * per, (i + 1) * per) for i in range(hosts)]


def layout(url: str, hosts: int, **cfg) -> list[FsspecStorage]:
    """One store per host over its head range. The chunk size follows the slot size, as it does by
    default (4 full pages per object: 1 host -> 4 pages, 2 hosts -> 8, 4 hosts -> 16)."""
    cfg.setdefault("target_object_bytes", 4 * FULL_SLOT_BYTES)
    cfg.setdefault("timeout_s", 20.0)
    cfg.setdefault("exists_timeout_s", 20.0)
    scheme = url.split("://", 1)[0]
    out = []
    for a, b in ranges(hosts):
        st = FsspecStorage(url, FP4, StorageConfig(storage_options=storage_options(scheme), **cfg))
        st.register_host_pool(NumpyHostPool(32, (2, 2, 4, b - a, 8)), shard=ShardCoord(a, b, HEADS, 0, 2, 2))
        out.append(st)
    return out


def pool(st: FsspecStorage) -> NumpyHostPool:
    return st._pools[next(iter(st._pools))].pool  # type: ignore[return-value]  # the test's own pool


def heads_of(st: FsspecStorage) -> slice:
    shard = st._pools[next(iter(st._pools))].shard
    return slice(shard.head_start, shard.head_end)


def reference(pages: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((pages, *FULL_SHAPE)).astype(np.float32)


def write(stores: list[FsspecStorage], keys: list[str], data: np.ndarray) -> None:
    for st in stores:
        pool(st).write_slots(slot_range(0, len(keys)), np.ascontiguousarray(data[..., heads_of(st), :]))
        assert all(st.batch_set(keys, slot_range(0, len(keys))))


def keys_of(seed: int, pages: int = PAGES) -> list[str]:
    return page_keys(Namespace(FP4), np.arange(seed, seed + pages * FP4.page_size))


def written(url: str, seed: int, hosts: int, close_all, **cfg) -> tuple[list[str], np.ndarray, list[FsspecStorage]]:
    """Keys and pages of chain ``seed``, stored by a layout of ``hosts`` hosts."""
    keys, data = keys_of(seed * 100), reference(PAGES, seed)
    w = layout(url, hosts, **cfg)
    close_all(w)
    write(w, keys, data)
    return keys, data, w


@pytest.fixture
def close_all():
    made: list[FsspecStorage] = []
    yield made.extend
    for st in made:
        st.close()


PAIRS = [(2, 1), (1, 2), (4, 1), (1, 4), (2, 4), (4, 2)]


@pytest.mark.parametrize(("scheme", "writers", "readers"),
                         [(s, w, r) for s in ("memory", "file") for w, r in PAIRS] + [("gs", 2, 1)])
def test_a_layout_reads_what_another_wrote_bit_for_bit(scheme, writers, readers, make_url, close_all):
    url = make_url(scheme)
    keys, data, _ = written(url, 1, writers, close_all)
    r = layout(url, readers)
    close_all(r)
    for st in r:
        assert st.batch_exists(keys) == PAGES
        assert st.batch_get(keys[3:], slot_range(5, 5 + PAGES - 3), first_page=3) == [True] * (PAGES - 3)
        assert same_bytes(pool(st).read_slots(slot_range(5, 5 + PAGES - 3)), data[3:, ..., heads_of(st), :])
        assert st.stats().hit_pages == PAGES - 3


def test_a_prefix_is_a_miss_only_where_a_needed_shard_is_missing(tmp_path, close_all):
    url = f"file://{tmp_path}/l3"
    keys, data, w = written(url, 2, 2, close_all, pages_per_object=2)
    w[1].fs.rm_file(w[1].object_path(keys[5]))  # the heads-2..3 object of pages 4-5 is gone
    r = layout(url, 4)
    close_all(r)
    for st, want in zip(r, [PAGES, PAGES, 4, 4]):  # hosts 0-1 need only the heads-0..1 shard
        assert st.batch_exists(keys) == want
        slots = slot_range(0, PAGES)
        before = pool(st).read_slots(slots)
        got = st.batch_get(keys, slots)
        assert got == [True] * want + [False] * (PAGES - want)
        after = pool(st).read_slots(slots)
        assert same_bytes(after[:want], data[:want, ..., heads_of(st), :])
        assert same_bytes(after[want:], before[want:])  # nothing half-assembled lands in the pool
    (one,) = layout(url, 1, pages_per_object=2)
    close_all([one])
    assert one.batch_exists(keys) == 4


def test_a_corrupt_shard_object_ends_the_assembled_prefix(tmp_path, close_all):
    url = f"file://{tmp_path}/l3"
    keys, data, w = written(url, 3, 2, close_all, pages_per_object=2)
    path = w[0].object_path(keys[7])  # pages 6-7 of heads 0..1
    raw = bytearray(w[0].fs.cat_file(path))
    raw[-1] ^= 0xFF
    w[0].fs.rm_file(path)
    w[0].fs.pipe_file(path, bytes(raw))
    (one,) = layout(url, 1, pages_per_object=2)
    close_all([one])
    got = one.batch_get(keys, slot_range(0, PAGES))
    assert got == [True] * 6 + [False] * 4
    assert same_bytes(pool(one).read_slots(slot_range(0, 6)), data[:6])
    assert one.stats().corrupt_objects >= 1


def test_own_layout_first_another_when_it_holds_more_and_off_when_disabled(tmp_path, close_all):
    url = f"file://{tmp_path}/l3"
    keys, data = keys_of(400), reference(PAGES, 4)
    (own,) = layout(url, 1, pages_per_object=2)
    close_all([own])
    write([own], keys[:4], data[:4])
    w = layout(url, 2, pages_per_object=2)
    close_all(w)
    write(w, keys, data)
    (fresh,) = layout(url, 1, pages_per_object=2)
    close_all([fresh])
    assert fresh.batch_get(keys, slot_range(0, PAGES)) == [True] * PAGES  # the 2-host layout holds more
    assert same_bytes(pool(fresh).read_slots(slot_range(0, PAGES)), data)
    (off,) = layout(url, 1, pages_per_object=2, layout_refresh_s=None)
    close_all([off])
    assert off.batch_exists(keys) == 4  # own shard objects only


def test_a_layout_written_after_the_last_listing_is_found_by_a_refresh(tmp_path, close_all):
    url = f"file://{tmp_path}/l3"
    keys, data = keys_of(500), reference(PAGES, 5)
    (reader,) = layout(url, 1, layout_refresh_s=3600.0)
    close_all([reader])
    assert reader.batch_exists(keys) == 0  # lists now: nothing there
    w = layout(url, 2)
    close_all(w)
    write(w, keys, data)
    assert reader.batch_exists(keys) == 0  # not listed again within the hour
    assert reader.refresh_layouts() == 2
    assert reader.batch_exists(keys) == PAGES


def test_cover_picks_the_fewest_sources_with_the_longest_common_prefix():
    own = ShardCoord(0, 4, 4, 0, 2, 2)
    assert cover(own, [(0, 4), (0, 2), (2, 4)], [3, 8, 6]) == (6, [1, 2])
    assert cover(own, [(0, 4), (0, 2), (2, 4)], [6, 8, 6]) == (6, [0])
    assert cover(own, [(0, 4), (0, 2)], [0, 5]) == (0, [])  # heads 2..3 have no source
    assert cover(own, [(0, 4), (0, 1), (1, 4), (0, 2), (2, 4)], [0, 9, 2, 7, 7]) == (7, [3, 4])
    with pytest.raises(ValueError, match="2 head ranges but 1 hits"):
        cover(own, [(0, 4), (0, 2)], [1])
    assert parse_tag("h0-2of4.l0-2of2") == ShardCoord(0, 2, 4, 0, 2, 2)
    assert parse_tag("h2-2of4.l0-2of2") is None and parse_tag("manifest") is None


def test_bad_layout_refresh_is_refused():
    with pytest.raises(ValueError, match="layout_refresh_s must be >= 0 or None, got -1"):
        StorageConfig(layout_refresh_s=-1)


def test_a_chain_continued_by_another_layout_is_read_across_both(tmp_path, close_all):
    """A 2-host replica stored pages 0-5; a 1-host replica read them and stored what it added
    (pages 4-9, from the chunk boundary). Fresh readers of either layout, and of a third, read all
    ten pages: segment by segment, each from the layout that holds it."""
    url = f"file://{tmp_path}/l3"
    keys, data = keys_of(600), reference(PAGES, 6)
    w = layout(url, 2, pages_per_object=2)
    close_all(w)
    write(w, keys[:6], data[:6])
    (cont,) = layout(url, 1, pages_per_object=2)
    close_all([cont])
    pool(cont).write_slots(slot_range(0, 6), data[4:])
    assert all(cont.batch_set(keys[4:], slot_range(0, 6), first_page=4))
    for hosts in (1, 2, 4):
        r = layout(url, hosts, pages_per_object=2)
        close_all(r)
        for st in r:
            assert st.batch_exists(keys) == PAGES
            assert st.batch_get(keys, slot_range(0, PAGES)) == [True] * PAGES
            assert same_bytes(pool(st).read_slots(slot_range(0, PAGES)), data[..., heads_of(st), :])
