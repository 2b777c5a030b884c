"""file:// manifest entries of a growing path: a longer entry takes over the file of the entry this store
wrote for its prefix (no new inode; ``hicache.storage.manifest_lineage``); other writers' entries, other
branches and other schemes keep theirs; warm-restart listings are unchanged."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hicache.storage import Namespace, page_keys
from hicache.storage.manifest_lineage import OwnEntries

P = 4  # the suite fingerprint's page size


def _entries(st, ns) -> dict[str, int]:
    """Manifest entry name -> inode, and every other (hidden) name in the namespace's directory."""
    d, prefix = st._manifest_name(ns)
    return {os.path.basename(p): os.stat(p).st_ino for p in st._io.list_files(d)}


def _stored(st, toks, ns) -> None:
    keys = page_keys(ns, toks)
    st.pool.write_slots(np.arange(len(keys), dtype=np.int32),
                        np.ones((len(keys), *st.pool.slot_shape), st.pool.dtype))
    assert all(st.batch_set(keys, np.arange(len(keys), dtype=np.int32)))


def _one_chain(make_store, make_url, fp, salt: str, pages: int):
    """(url, a file:// store, namespace, tokens of ``pages`` pages stored in it)."""
    url = make_url("file")
    st = make_store("file", url=url)
    ns = Namespace(fp, cache_salt=salt)
    toks = np.arange(pages * P, dtype=np.int32) + len(salt)
    _stored(st, toks, ns)
    return url, st, ns, toks


def test_a_growing_path_keeps_one_entry_file(make_store, make_url, fp):
    url, st, ns, toks = _one_chain(make_store, make_url, fp, "grow", 10)
    assert st.record_prefix(ns, toks[: 3 * P])
    (first, ino), = _entries(st, ns).items()
    assert st.record_prefix(ns, toks[: 6 * P]) and st.record_prefix(ns, toks)
    entries = _entries(st, ns)
    assert list(entries.values()) == [ino] and first not in entries  # one file, moved along, nothing hidden left
    reader = make_store("file", url=url)
    (got,) = reader.list_prefixes(ns)
    assert np.array_equal(got.tokens, toks) and got.num_pages == 10
    assert st.record_prefix(ns, toks) and list(_entries(st, ns).values()) == [ino]  # the same entry again: as is


def test_branches_and_other_writers_entries_keep_their_files(make_store, make_url, fp):
    url = make_url("file")
    st, other = make_store("file", url=url), make_store("file", url=url)
    ns = Namespace(fp, cache_salt="branches")
    stem = np.arange(4 * P, dtype=np.int32)
    a, b = (np.r_[stem, np.full(2 * P, x)].astype(np.int32) for x in (1000, 2000))
    longer = np.r_[a, np.full(P, 3000)].astype(np.int32)
    _stored(st, longer, ns)
    _stored(st, b, ns)
    assert other.record_prefix(ns, stem)  # another writer's entry: never moved by st
    stem_entry = _entries(st, ns)
    assert st.record_prefix(ns, a) and st.record_prefix(ns, b)  # two branches: a file each
    three = _entries(st, ns)
    assert len(three) == 3 and stem_entry.items() <= three.items()
    assert st.record_prefix(ns, longer)  # extends a: a's file, renamed
    now = _entries(st, ns)
    assert len(now) == 3 and set(now.values()) == set(three.values()) and stem_entry.items() <= now.items()
    got = sorted(tuple(p.tokens.tolist()) for p in make_store("file", url=url).list_prefixes(ns))
    assert got == sorted([tuple(longer.tolist()), tuple(b.tolist())])  # the stem is covered by both


def test_an_entry_deleted_behind_the_store_is_written_afresh(make_store, make_url, fp):
    url, st, ns, toks = _one_chain(make_store, make_url, fp, "vanished", 6)
    assert st.record_prefix(ns, toks[: 2 * P])
    d = st._manifest_name(ns)[0]
    for p in st._io.list_files(d):
        os.unlink(p)
    assert st.record_prefix(ns, toks)
    (got,) = make_store("file", url=url).list_prefixes(ns)
    assert np.array_equal(got.tokens, toks)
    assert len(_entries(st, ns)) == 1


@pytest.mark.parametrize("scheme", ["memory"])
def test_other_schemes_keep_every_entry(make_store, fp, scheme):
    st = make_store(scheme)
    ns = Namespace(fp, cache_salt="mem")
    toks = np.arange(6 * P, dtype=np.int32)
    assert st._own_entries is None
    assert st.record_prefix(ns, toks[: 2 * P]) and st.record_prefix(ns, toks)
    d, prefix = st._manifest_name(ns)
    assert len([p for p in st._io.list_files(d) if os.path.basename(p).startswith(prefix)]) == 2


def test_own_entries_finds_the_longest_strict_prefix_and_stays_bounded():
    own = OwnEntries(page_size=2, capacity=3)
    t = np.arange(12, dtype=np.int64)
    own.add("n-", t[:4], "p4")
    own.add("n-", t[:8], "p8")
    own.add("m-", t[:8], "other namespace")
    assert own.take_ancestor("n-", t[:8]) == "p4"  # strict prefixes only
    assert own.take_ancestor("n-", t) == "p8" and own.take_ancestor("n-", t) is None  # taken: forgotten
    diverged = t.copy()
    diverged[1] = 99  # same length and last page, another first page: not a prefix
    own.add("n-", t[:4], "p4")
    assert own.take_ancestor("n-", diverged) is None
    for i in range(5):
        own.add("k-", t[: 2 * (i + 1)], f"k{i}")
    assert len(own) == 3
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="page_size"):
            OwnEntries(bad)
        with pytest.raises(ValueError, match="capacity"):
            OwnEntries(2, bad)


def test_a_longer_entry_another_writer_published_first_is_not_taken_over(make_store, make_url, fp):
    url, st, ns, toks = _one_chain(make_store, make_url, fp, "raced", 9)
    other = make_store("file", url=url)
    assert st.record_prefix(ns, toks[: 3 * P])
    assert other.record_prefix(ns, toks[: 6 * P])  # the longer entry, published by another writer first
    theirs = _entries(other, ns)
    assert len(theirs) == 2
    assert st.record_prefix(ns, toks[: 6 * P])  # ours moves there, loses the race: its file goes
    left = _entries(st, ns)
    assert len(left) == 1 and set(left.values()) <= set(theirs.values())  # theirs stays, untouched
    assert st.record_prefix(ns, toks)  # not ours to move: a file of its own
    assert len(_entries(st, ns)) == 2 and set(left.items()) <= set(_entries(st, ns).items())
