"""Outages (backend raising or hanging → bounded time, per-key False, nothing lost from L2) and
concurrent writers of one key from two processes (one valid object, no torn reads)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from hicache.storage import (
    FsspecStorage,
    ModelFingerprint,
    Namespace,
    ShardCoord,
    StorageConfig,
    leading_index,
    page_keys,
)
from hicache.storage.chunking import Chunking
from hicache.storage.errors import StorageUnavailableError
from hicache.storage.testing import ManualClock, NumpyHostPool, same_bytes
from hicache.storage.testing import slot_range as S

FP = ModelFingerprint("tiny-test", "float32", page_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
SLOT = (2, 2, 4, 2, 8)


class FaultyMemoryFS(MemoryFileSystem):
    """A real in-memory filesystem whose data calls can be switched to raise or to hang."""

    protocol = ("faultymem",)
    root_marker = "/"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.mode = "ok"
        self.release = threading.Event()
        self.hang_paths: set[str] = set()  # reads of these hang until ``release`` (any mode)

    def _fault(self, path=None):
        if path in self.hang_paths:
            self.release.wait(60)
        if self.mode == "raise":
            raise ConnectionError("backend down")
        if self.mode == "hang":
            self.release.wait(60)

    def info(self, path, **kw):  # (fsspec's exists calls it too)
        self._fault()
        return super().info(path, **kw)

    def cat_file(self, path, *a, **kw):
        self._fault(path)
        return super().cat_file(path, *a, **kw)

    def pipe_file(self, path, value, *a, **kw):
        self._fault()
        return super().pipe_file(path, value, *a, **kw)


@pytest.fixture
def make_faulty():
    """``make_faulty(**config)`` -> (store over a FaultyMemoryFS, the fs, its pool); the store's
    breaker runs on ``store.clock`` (a ``ManualClock``)."""
    made = []

    def make(**cfg):
        fs = FaultyMemoryFS(skip_instance_cache=True)
        cfg = {"pages_per_object": 4, "timeout_s": 0.5, "exists_timeout_s": 0.5, "io_threads": 4, **cfg}
        clock = ManualClock()
        st = FsspecStorage(f"memory://faulty-{time.monotonic_ns()}", FP, StorageConfig(**cfg), fs=fs, clock=clock)
        st.clock = clock
        pool = NumpyHostPool(64, SLOT)
        st.register_host_pool(pool, shard=ShardCoord.full(FP))
        made.append((st, fs))
        return st, fs, pool

    yield make
    for st, fs in made:
        fs.release.set()
        st.close()


@pytest.fixture
def faulty(make_faulty):
    return make_faulty()


@pytest.mark.parametrize("mode", ["raise", "hang"])
def test_outage_is_bounded_and_per_key_false(faulty, mode):
    st, fs, pool = faulty
    keys = page_keys(Namespace(FP), np.arange(40))  # 10 pages
    pool.fill_random(S(0, 10), 5)
    assert st.batch_set(keys[:8], S(0, 8)) == [True] * 8  # stored before the outage
    l2_before = pool.buf.copy()
    fs.mode = mode
    for call, expect in [  # (a write first: while the breaker is open it raises instead)
        (lambda: st.batch_set(keys, S(0, 10)), [False] * 10),
        (lambda: st.batch_exists(keys), 0),
        (lambda: st.batch_get(keys, S(20, 30)), [False] * 10),
        (lambda: st.exists(keys[3], 3), False),
    ]:
        t0 = time.monotonic()
        assert call() == expect
        assert time.monotonic() - t0 < 2.0  # timeout_s=0.5 plus slack
    s = st.stats()
    assert (s.timeouts if mode == "hang" else s.refused) > 0
    assert s.breaker_state == "open" and s.unavailable > 0  # later calls failed fast
    with pytest.raises(StorageUnavailableError, match="breaker open"):  # a backup skipped, typed
        st.batch_set(keys, S(0, 10))
    assert st.stats().skipped_write_pages == 10
    assert same_bytes(pool.buf[:10], l2_before[:10])  # nothing lost from L2
    # recovery: the backend comes back; after the cooldown a probe closes the breaker and earlier
    # objects are still served
    fs.mode = "ok"
    fs.release.set()
    st.clock.advance(st.config.breaker_cooldown_s)
    deadline = time.monotonic() + 5
    while st.batch_exists(keys) < 8 and time.monotonic() < deadline:
        time.sleep(0.05)  # abandoned operations drain in the background
    assert st.batch_exists(keys) == 8
    assert st.batch_get(keys[:8], S(20, 28)) == [True] * 8
    assert same_bytes(pool.buf[20:28], pool.buf[0:8])


def test_a_read_that_ends_after_the_deadline_never_reaches_the_pool(faulty):
    """The pool takes pages from I/O threads (``concurrent_slot_io``): an object read that hangs
    past the call's deadline is a timed-out miss, and when it finally returns, after the call, its
    pages are not written into the slots (they may belong to someone else by then)."""
    st, fs, pool = faulty
    keys = page_keys(Namespace(FP), np.arange(32))  # 2 objects
    pool.fill_random(S(0, 8), 8)
    assert st.batch_set(keys, S(0, 8)) == [True] * 8
    fs.hang_paths.add(st.object_path(keys[7]))
    pool.buf[20:28] = 5.0
    assert st.batch_get(keys, S(20, 28), timeout_s=0.5) == [True] * 4 + [False] * 4
    assert st.stats().timeouts == 1
    fs.release.set()
    st._io._ex.shutdown(wait=True)  # the hung read has returned and its task has ended
    assert (pool.buf[24:28] == 5.0).all() and same_bytes(pool.buf[20:24], pool.buf[0:4])


def test_hung_backend_does_not_queue_without_bound(make_faulty):
    """Without the breaker (a threshold never reached), abandoned work on a hung backend is capped."""
    st, fs, pool = make_faulty(breaker_threshold=1000)
    keys = page_keys(Namespace(FP), np.arange(240))  # 60 pages = 15 objects per call
    fs.mode = "hang"
    t0 = time.monotonic()
    for _ in range(5):
        assert st.batch_set(keys, S(0, 60), timeout_s=0.2) == [False] * 60
    assert time.monotonic() - t0 < 5
    # abandoned work is capped: the cap (4 threads * 8) plus at most one call's operations
    assert 0 < st._io._abandoned <= st._io._max_abandoned + 15
    assert st.stats().timeouts > 5 * 15 - st._io._max_abandoned - 15  # later ones refused fast, not queued


# ---- two processes ---------------------------------------------------------------------------

_CHILD = r"""
import os, sys, time, numpy as np
from hicache.storage import *
from hicache.storage.testing import NumpyHostPool
role, url, go, n, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
fp = ModelFingerprint("tiny-test", "float32", page_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
st = FsspecStorage(url, fp, StorageConfig(pages_per_object=64, io_threads=2))
pool = NumpyHostPool(64, (2, 2, 4, 2, 8, 16))  # 16 KiB pages, 1 MiB objects
st.register_host_pool(pool, shard=ShardCoord.full(fp))
pool.fill_random(np.arange(64, dtype=np.int32), seed)
chains = [page_keys(Namespace(fp, cache_salt=str(c)), np.arange(64 * 4)) for c in range(n)]
while not os.path.exists(go):
    time.sleep(0.001)
if role == "writer":
    for keys in chains:
        assert st.batch_set(keys, np.arange(64, dtype=np.int32)) == [True] * 64
else:
    reads = 0
    t_end = time.monotonic() + 3
    while time.monotonic() < t_end:
        for keys in chains:
            r = st.batch_get(keys, np.arange(64, dtype=np.int32))
            # a contiguous prefix: all or none (one object per chain), never a torn read
            assert r == [True] * sum(r) + [False] * (64 - sum(r)), r
            reads += r[0]
        if reads >= n:
            break
s = st.stats()
print(s.objects_written, s.objects_raced, s.objects_skipped_existing, s.corrupt_objects, s.hit_pages, s.index_written)
"""


def test_two_process_writers_one_valid_object(tmp_path):
    """Two processes write the same chains with different bytes: each object is published once,
    whole, by one of them; beside each, one leading-page index entry (a function of the keys alone,
    so whichever writer publishes it, it is the same bytes) naming that object."""
    url = f"file://{tmp_path}/shared"
    go = tmp_path / "go"
    n = 20
    # writers hold *different* bytes for the same keys, so a mixed object would be detected
    procs = [
        subprocess.Popen([sys.executable, "-c", _CHILD, role, url, str(go), str(n), str(seed)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for role, seed in (("writer", 1), ("writer", 2), ("reader", 0))
    ]
    time.sleep(0.3)
    go.touch()
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        outs.append([int(x) for x in out.split()])
    (w1, r1, s1, c1, _, i1), (w2, r2, s2, c2, _, i2), (_, _, _, c3, reader_hits, _) = outs
    assert w1 + w2 == n  # every object written exactly once
    assert i1 + i2 == n  # and its index entry
    assert w1 + r1 + s1 == n and w2 + r2 + s2 == n  # the other writer saw it stored (or lost the race)
    assert c1 == c2 == c3 == 0  # nobody ever saw a torn or mixed object
    assert reader_hits > 0
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "shared") for f in fs]  # objects, temp files
    assert len(files) == 2 * n and not [f for f in files if os.path.basename(f).startswith(".tmp")]
    entries = {f: Chunking.object_of_index_entry(f) for f in files if Chunking.object_of_index_entry(f)}
    assert len(entries) == n and set(entries.values()) == set(files) - set(entries)
    # each object is entirely one writer's bytes
    st = FsspecStorage(url, FP, StorageConfig(pages_per_object=64))
    pool = NumpyHostPool(64, (2, 2, 4, 2, 8, 16))
    st.register_host_pool(pool, shard=ShardCoord.full(FP))
    refs = []
    for seed in (1, 2):
        ref = NumpyHostPool(64, (2, 2, 4, 2, 8, 16))
        ref.fill_random(S(0, 64), seed)
        refs.append(ref.buf)
    for c in range(n):
        keys = page_keys(Namespace(FP, cache_salt=str(c)), np.arange(256))
        (entry,) = [f for f, obj in entries.items() if obj == st.object_path(keys[63])]
        assert leading_index.decode(open(entry, "rb").read(), keys[0], keys[63], 64) == [bytes.fromhex(k) for k in keys]
        assert st.batch_get(keys, S(0, 64)) == [True] * 64
        assert same_bytes(pool.buf, refs[0]) or same_bytes(pool.buf, refs[1])
    st.close()


def test_concurrent_writers_memory_threads():
    st = FsspecStorage(f"memory://race-{time.monotonic_ns()}", FP, StorageConfig(pages_per_object=4))
    pool = NumpyHostPool(16, SLOT)
    st.register_host_pool(pool, shard=ShardCoord.full(FP))
    pool.fill_random(S(0, 8), 3)
    keys = page_keys(Namespace(FP), np.arange(32))
    res = []
    ts = [threading.Thread(target=lambda: res.append(st.batch_set(keys, S(0, 8)))) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert res == [[True] * 8] * 4
    s = st.stats()
    assert s.objects_written + s.objects_raced + s.objects_skipped_existing == 8  # 4 calls x 2 objects
    assert s.objects_written == 2
    assert st.batch_get(keys, S(8, 16)) == [True] * 8 and same_bytes(pool.buf[:8], pool.buf[8:])
    st.close()


def test_a_failed_local_write_leaves_no_object_and_no_temp_file(tmp_path, monkeypatch):
    """file:// write-once: a write that fails half-way (disk full) publishes nothing and leaves no
    temp file; the key is written normally afterwards."""
    from hicache.storage import object_store

    st = FsspecStorage(f"file://{tmp_path}/l3", FP, StorageConfig(pages_per_object=4))
    pool = NumpyHostPool(16, SLOT)
    st.register_host_pool(pool, shard=ShardCoord.full(FP))
    keys = page_keys(Namespace(FP), np.arange(16))
    pool.fill_random(S(0, 4), 5)

    def disk_full(fd, header, payload):
        os.write(fd, b"partial")
        os.close(fd)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(object_store, "write_all", disk_full)
    assert st.batch_set(keys, S(0, 4)) == [False] * 4
    d = os.path.dirname(st.object_path(keys[3]))
    assert os.listdir(d) == [] and st.stats().errors == 1
    monkeypatch.undo()
    assert st.batch_set(keys, S(0, 4)) == [True] * 4 and st.batch_exists(keys) == 4
    assert os.listdir(d) == [os.path.basename(st.object_path(keys[3]))]
    st.close()
