"""L3 integration: L2->L3 backup, L3->L2 prefetch, sharing across processes, isolation, outages."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import fsspec
import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from support.hicache_env import HiCacheEnv

from hicache.cluster.storage_tier import PrefetchParams, PrefetchState, StorageParams
from hicache.cluster.tree import InsertParams, RadixKey, RequestState
from hicache.storage import StorageConfig


def seq(start, n):
    return np.arange(start, start + n, dtype=np.int32)


def check(env):
    env.head.tree.check_invariants()
    env.head.controller.check_invariants()


def _populate_in_subprocess(url: str, sequences: list[list[int]]) -> None:
    code = textwrap.dedent(f"""
        import os, sys
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parents[1])!r})
        import numpy as np
        from support.hicache_env import HiCacheEnv
        env = HiCacheEnv(page_size=4, device_pages=32, host_slots=64, storage_url={url!r})
        for s in {sequences!r}:
            env.serve(np.asarray(s, dtype=np.int32))
        env.head.flush_write_through_acks()
        st = env.head.cache_stats()["storage"]
        assert st["backup_pages"] > 0, st
        print("ok", st["backup_pages"])
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


def test_second_process_gets_l3_hits_bit_identical(tmp_path):
    url = f"file://{tmp_path}/l3"
    a, b = seq(0, 40), np.r_[seq(0, 16), seq(900, 12)].astype(np.int32)
    _populate_in_subprocess(url, [a.tolist(), b.tolist()])
    env = HiCacheEnv(page_size=4, device_pages=32, host_slots=64, storage_url=url)
    r = env.serve(a)  # cold head: prefetch L3 -> L2, load L2 -> L1; serve() checks the bytes exactly
    assert r["prefetched"] == 40 and r["loaded"] == 40
    r = env.serve(b)
    assert r["device_hit"] == 16 and r["prefetched"] == 12 and r["loaded"] == 12
    check(env)


def test_write_through_to_l3_and_restart_from_l3(tmp_path):
    url = f"file://{tmp_path}/l3"
    env = HiCacheEnv(page_size=4, device_pages=32, host_slots=64, storage_url=url)
    a = seq(100, 30)
    env.serve(a)
    env.head.flush_write_through_acks()
    st = env.head.cache_stats()["storage"]
    assert st["backup_pages"] == 7 and st["backup_failures"] == 0
    assert all(n.stored for n in env.head.tree.iter_nodes())
    # A restarted head (new process state) finds it again through L3 only.
    env2 = HiCacheEnv(page_size=4, device_pages=32, host_slots=64, storage_url=url)
    r = env2.serve(a)
    assert r["prefetched"] == 28 and r["loaded"] == 28


@pytest.mark.parametrize("index", [True, False], ids=["default", "no_index"])
def test_cold_head_reads_a_divergent_prefix_bit_identical(tmp_path, index):
    """Another head whose request diverges from a stored sequence inside its second object reads
    the whole objects before the divergence, and with the leading-page index (default) the second
    object's 2 pages its prompt shares; serve() checks the bytes exactly."""
    url = f"file://{tmp_path}/l3"
    a = seq(0, 48)  # 12 pages: three objects of 4 pages
    kw = {"pages_per_object": 4, "storage": StorageConfig(leading_page_index=index)}
    warm = HiCacheEnv(page_size=4, device_pages=32, host_slots=64, storage_url=url, storage_kwargs=kw)
    warm.serve(a)
    warm.head.flush_write_through_acks()
    cold = HiCacheEnv(page_size=4, device_pages=32, host_slots=64, storage_url=url, storage_kwargs=kw)
    q = np.r_[a[:26], seq(900, 14)].astype(np.int32)  # shares 6 whole pages: the second object's first 2
    r = cold.serve(q)
    shared = 24 if index else 16  # pages 0..5 (from both objects), or 0..3: the first object
    assert r["prefetched"] == shared and r["loaded"] == shared
    assert cold.head.cache_stats()["storage"]["prefetch_failures"] == 0
    cold.head.flush_write_through_acks()  # (fetched pages hang below a prefix with an L2 copy)
    r = cold.serve(a)  # the rest: pages 6, 7 of the second object, then the third (from inside the chunk)
    assert r["device_hit"] == 24 and r["prefetched"] == 24 and r["loaded"] == 24
    check(cold)


def test_isolation_by_salt_extra_key_and_fingerprint(tmp_path):
    url = f"file://{tmp_path}/l3"
    env = HiCacheEnv(storage_url=url)
    a = seq(0, 32)
    env.serve(a)
    env.head.flush_write_through_acks()
    other = HiCacheEnv(storage_url=url)
    for key in (RadixKey(a, cache_salt="s1"), RadixKey(a, extra_key="lora")):
        m = other.head.match_prefix(key)
        req = f"iso-{key.namespace}"
        p = other.head.prefetch_from_storage(PrefetchParams(req, key, m.best_match_node))
        assert p.tokens == 0
        if p.state is PrefetchState.RUNNING:  # the existence query runs off the head's thread
            assert other.head.controller.storage.settle(60)
            p = other.head.check_prefetch_progress(req)
        assert p.state is PrefetchState.NOT_STARTED and p.reason == "not enough pages in L3"
    other_model = HiCacheEnv(storage_url=url, model_id="another-model")
    assert other_model.serve(a)["prefetched"] == 0
    assert HiCacheEnv(storage_url=url).serve(a)["prefetched"] == 32  # same namespace: found


_HANGING_LOCK = threading.Lock()


class FlakyFS(MemoryFileSystem):
    """An in-memory filesystem whose reads can be made to hang or fail (a storage outage)."""

    protocol = "flaky"
    mode = "ok"
    root_marker = ""
    release = threading.Event()  # "hang": a call waits for this (the test sets it), not for a time
    hanging = 0  # calls waiting on ``release`` now

    def cat_file(self, path, start=None, end=None, **kw):
        self._maybe_fail()
        return super().cat_file(path, start, end, **kw)

    def exists(self, path, **kw):
        if FlakyFS.mode == "raise-exists":
            raise OSError("storage down")
        return super().exists(path, **kw)

    def _open(self, path, mode="rb", **kw):
        if "r" in mode:
            self._maybe_fail()
        return super()._open(path, mode, **kw)

    def pipe_file(self, path, value, mode="overwrite", **kw):
        if FlakyFS.mode in ("hang", "raise"):
            self._maybe_fail()
        return super().pipe_file(path, value, mode=mode, **kw)

    @staticmethod
    def _maybe_fail():
        if FlakyFS.mode == "hang":
            release = FlakyFS.release
            with _HANGING_LOCK:
                FlakyFS.hanging += 1
            try:
                release.wait(120)
            finally:
                with _HANGING_LOCK:
                    FlakyFS.hanging -= 1
        if FlakyFS.mode == "raise":
            raise OSError("storage down")


@pytest.fixture
def flaky():
    fsspec.register_implementation("flaky", FlakyFS, clobber=True)
    FlakyFS.store.clear()
    FlakyFS.mode = "ok"
    FlakyFS.release = threading.Event()
    yield FlakyFS
    FlakyFS.mode = "ok"
    FlakyFS.release.set()  # hung calls return (to storage clients that gave up on them)
    FlakyFS.store.clear()


@pytest.mark.parametrize("mode", ["raise", "hang"])
def test_storage_outage_degrades_to_recompute(flaky, mode):
    from hicache.storage import StorageConfig

    kwargs = {"storage": StorageConfig(timeout_s=0.5), "prefetch_timeout_max_s": 1.0}
    writer = HiCacheEnv(storage_url="flaky://l3", storage_kwargs=kwargs)
    a = seq(0, 24)
    writer.serve(a)
    writer.head.flush_write_through_acks()
    assert writer.head.cache_stats()["storage"]["backup_pages"] == 6
    flaky.mode = mode
    reader = HiCacheEnv(storage_url="flaky://l3", storage_kwargs=kwargs)
    r = reader.serve(a)  # the prefetch fails or times out: recompute, exact (serve() checks)
    if mode == "hang":
        assert flaky.hanging > 0  # the request did not wait for the hung storage calls
        flaky.release.set()
        flaky.release = threading.Event()  # calls from now on hang until the test ends
    assert r["prefetched"] == 0 and r["loaded"] == 0 and r["device_hit"] == 0
    st = reader.head.cache_stats()
    assert st["device_tokens"] == 24
    # Backups while storage is down fail or are skipped, never pile up.
    for i in range(4):
        reader.serve(seq(1000 + 100 * i, 16))
    reader.head.flush_write_through_acks()
    assert reader.head.controller.storage.in_flight == 0
    assert reader.head.cache_stats()["in_flight"] == 0
    check(reader)
    flaky.mode = "ok"
    assert reader.serve(a)["device_hit"] == 24  # L1 still serves


def test_attach_and_detach_at_runtime(tmp_path):
    env = HiCacheEnv()
    a = seq(0, 16)
    env.serve(a)
    env.head.flush_write_through_acks()
    params = StorageParams(f"file://{tmp_path}/l3", env.fingerprint, prefetch_min_tokens=4)
    env.head.attach_storage_backend(params)
    with pytest.raises(RuntimeError, match="already attached"):
        env.head.attach_storage_backend(params)
    env.serve(seq(500, 16))
    env.head.detach_storage_backend()
    assert env.head.controller.storage is None
    with pytest.raises(RuntimeError, match="no storage backend"):
        env.head.check_prefetch_progress("x")
    with pytest.raises(ValueError, match="url"):
        StorageParams("not-a-url", env.fingerprint)
    with pytest.raises(ValueError, match="prefetch policy"):
        StorageParams("file:///x", env.fingerprint, prefetch_policy="never")
    with pytest.raises(ValueError, match="write_hold_max_s"):
        StorageParams("file:///x", env.fingerprint, write_hold_max_s=-1.0)


def test_reset_keeps_l3_attached_and_writes_the_queued_manifest(tmp_path):
    """A reset empties the tree, L1 and L2, not the configuration: the same L3 stays attached on the head
    and on the worker (one view), its queued manifest entries are written first, and the cold state gets
    L3 hits (never an L1/L2 hit from before the reset)."""
    from hicache.storage import FsspecStorage, Namespace

    url = f"file://{tmp_path}/l3"
    env = HiCacheEnv(page_size=4, device_pages=32, host_slots=64, storage_url=url,
                     storage_kwargs={"manifest_interval_s": 60.0})  # the 2nd path stays queued until flushed
    a, b = seq(0, 24), seq(500, 16)
    env.serve(a)
    env.head.flush_write_through_acks()
    env.serve(b)
    env.head.flush_write_through_acks()
    params, executor = env.head.controller.storage.params, env.worker.storage_executor
    assert env.head.cache_stats()["storage"]["backup_pages"] == 10
    env.head.reset()
    env.settle_l3()  # the warm restart runs in the background
    ctl = env.head.controller
    assert ctl.storage is not None and ctl.storage.params is params
    assert env.worker.storage_executor is not None and env.worker.storage_executor is not executor  # reopened
    assert env.head.cache_stats()["storage"]["backup_pages"] == 0  # a fresh tier's counters
    store = FsspecStorage(url, env.fingerprint)
    try:
        stored = {p.num_pages for p in store.list_prefixes(Namespace(env.fingerprint), verify=False)}
    finally:
        store.close()
    assert {6, 4} <= stored  # both paths, the queued one written by the reset
    for tokens in (a, b):
        m = env.head.match_prefix(RadixKey(tokens))
        assert (m.device_hit_len, m.host_hit_len) == (0, 0)
    r = env.serve(a)  # L3 -> L2 -> L1; serve() checks the bytes exactly
    assert r["prefetched"] == 24 and r["loaded"] == 24
    check(env)
    env.head.detach_storage_backend()
    env.head.reset()
    env.settle_l3()  # the warm restart runs in the background
    assert env.head.controller.storage is None and env.worker.storage_executor is None


# -- warm restart from the L3 manifest ------------------------------------------------------------------
def _exists_calls(env) -> int:
    return env.worker.storage_executor.storage.stats().exists_calls


def test_warm_restart_after_reset_reports_storage_hits_and_loads_bit_identical(tmp_path):
    """After a reset the tree is rebuilt from the manifest as storage-only entries: no device or host hit,
    ``storage_hit_len`` says what L3 has, the prefetch needs no existence lookup and loads exact KV; an
    insert of computed KV over storage-only entries makes them device nodes."""
    env = HiCacheEnv(page_size=4, device_pages=32, host_slots=64, storage_url=f"file://{tmp_path}/l3")
    a, b = seq(0, 24), np.r_[seq(0, 8), seq(700, 16)].astype(np.int32)
    for tokens in (a, b):
        env.serve(tokens)
        env.head.flush_write_through_acks()
    env.head.reset()
    env.settle_l3()  # the warm restart runs in the background
    tree = env.head.tree
    assert tree.storage_only.tokens == 24 + 16  # b shares its first 8 tokens with a
    st = env.head.cache_stats()["storage"]
    assert st["warm_restart_prefixes"] == 2 and st["warm_restart_tokens"] == 40
    check(env)
    m = env.head.match_prefix(RadixKey(np.r_[a, seq(5000, 3)].astype(np.int32)))
    assert (m.device_hit_len, m.host_hit_len, m.storage_hit_len) == (0, 0, 24)
    assert m.best_match_node == m.last_host_node == tree.default_root.id  # nothing to load back
    before = _exists_calls(env)
    r = env.serve(a)  # L3 -> L2 -> L1 without asking L3 what it has; serve() checks the bytes exactly
    assert r["prefetched"] == 24 and r["loaded"] == 24
    assert _exists_calls(env) == before
    assert env.head.cache_stats()["storage"]["prefetch_known_stored"] == 1
    assert tree.storage_only.tokens == 16  # a's entries became L2 (now L1+L2) nodes; b's tail is left
    m = env.head.match_prefix(RadixKey(b))
    assert (m.device_hit_len, m.host_hit_len, m.storage_hit_len) == (8, 0, 16)
    check(env)
    # Computed KV over the storage-only tail: the request inserts its own pages there.
    env.head.inc_lock_ref(m.last_device_node)
    own = env.head.alloc(16)
    env.worker.device_pool.write_pages(own, env.rows(b, 2, 4))
    env.head.cache_finished_req(RequestState(RadixKey(b), np.concatenate([m.device_pages, own]), 8,
                                             m.last_device_node))
    assert tree.storage_only.tokens == 0
    m = env.head.match_prefix(RadixKey(b))
    assert (m.device_hit_len, m.storage_hit_len) == (24, 0)
    np.testing.assert_array_equal(env.worker.device_pool.read_pages(m.device_pages), env.rows(b, 0, 6))
    check(env)
    env.head.detach_storage_backend()
    assert tree.storage_only.cap_tokens == 0
    check(env)


def test_warm_restart_corrupt_object_is_a_counted_miss_and_drops_the_entry(tmp_path):
    import pathlib

    env = HiCacheEnv(page_size=4, device_pages=32, host_slots=64, storage_url=f"file://{tmp_path}/l3")
    a = seq(300, 32)
    env.serve(a)
    env.head.flush_write_through_acks()
    env.head.reset()
    env.settle_l3()  # the warm restart runs in the background
    assert env.head.tree.storage_only.tokens == 32
    objects = [p for p in pathlib.Path(tmp_path, "l3").rglob("*") if p.is_file() and "manifest" not in p.parts]
    assert objects
    for p in objects:  # flip the last payload byte of every KV object
        raw = bytearray(p.read_bytes())
        raw[-1] ^= 0xFF
        p.write_bytes(bytes(raw))
    m = env.head.match_prefix(RadixKey(a))
    assert m.storage_hit_len == 32
    r = env.serve(a)  # the read fails its checksum: recompute, exact (serve() checks)
    assert r["prefetched"] == 0 and r["loaded"] == 0 and r["device_hit"] == 0
    st = env.head.cache_stats()["storage"]
    assert st["prefetch_failures"] == 1 and st["storage_only_dropped_tokens"] == 32
    assert env.worker.storage_executor.storage.stats().corrupt_objects >= 1
    assert env.head.tree.storage_only.tokens == 0
    assert env.head.match_prefix(RadixKey(a)).device_hit_len == 32  # the recomputed KV, never the corrupt one
    check(env)


@pytest.mark.parametrize("index", [True, False], ids=["default", "no_index"])
def test_warm_restart_request_ending_inside_a_stored_object_reads_the_whole_objects_before_it(tmp_path, index):
    """A request that diverges from a stored path inside an L3 object (2 pages per object here): the
    known-stored prefetch takes the whole objects before it, and asks L3 for the rest, which with the
    leading-page index (default) gives that object's first page; it never fails or drops."""
    env = HiCacheEnv(page_size=4, device_pages=32, host_slots=64, storage_url=f"file://{tmp_path}/l3",
                     storage_kwargs={"storage": StorageConfig(leading_page_index=index)})
    a = seq(0, 32)  # 8 pages = 4 objects
    env.serve(a)
    env.head.flush_write_through_acks()
    env.head.reset()
    env.settle_l3()  # the warm restart runs in the background
    q = np.r_[a[:20], seq(900, 12)].astype(np.int32)  # shares 5 pages: the 3rd object only half
    assert env.head.match_prefix(RadixKey(q)).storage_hit_len == 20
    r = env.serve(q)  # serve() checks the bytes exactly
    st = env.head.cache_stats()["storage"]
    assert r["prefetched"] == (20 if index else 16) and st["prefetch_known_stored"] == 1
    assert st["prefetch_failures"] == 0 and st["storage_only_dropped_tokens"] == 0
    m = env.head.match_prefix(RadixKey(a))  # q computed page 5 itself; a's last 3 pages stay known in L3
    assert (m.device_hit_len, m.storage_hit_len) == (20, 12)
    check(env)


def test_warm_restart_respects_its_cap_and_off_switch(tmp_path):
    url = f"file://{tmp_path}/l3"
    writer = HiCacheEnv(page_size=4, device_pages=32, host_slots=64, storage_url=url)
    seqs = [seq(1000 * (i + 1), 16) for i in range(4)]
    for tokens in seqs:
        writer.serve(tokens)
        writer.head.flush_write_through_acks()
    writer.head.controller.storage.flush_manifest()
    capped = HiCacheEnv(page_size=4, device_pages=32, host_slots=64, storage_url=url,
                        storage_kwargs={"warm_restart_max_tokens": 40})
    assert capped.head.tree.storage_only.tokens == 40  # 16 + 16 + the first 8 of a third
    assert sorted(capped.head.match_prefix(RadixKey(t)).storage_hit_len for t in seqs) == [0, 8, 16, 16]
    check(capped)
    off = HiCacheEnv(page_size=4, device_pages=32, host_slots=64, storage_url=url,
                     storage_kwargs={"warm_restart_max_tokens": 0})
    assert off.head.tree.storage_only.tokens == 0
    assert off.head.match_prefix(RadixKey(seqs[0])).storage_hit_len == 0
    assert off.serve(seqs[0])["prefetched"] == 16  # still found by asking L3
    with pytest.raises(ValueError, match="warm_restart_max_tokens"):
        StorageParams(url, off.fingerprint, warm_restart_max_tokens=-1)


def test_storage_only_entries_lru_cap_and_tier_transitions():
    """Tree level: storage-only entries are evicted LRU at their leaves when over the cap, never block L1
    eviction, and a stored node that loses its L1 copy above them stays as a storage-only node."""
    from hicache.cluster.tree import RadixTree, SWAComponent, TreeConfig

    tree = RadixTree(TreeConfig(page_size=4, capacity_pages=16))
    entries = tree.storage_only
    entries.cap_tokens = 48
    root = tree.default_root
    x, y, z = seq(0, 16), seq(100, 16), seq(200, 16)
    assert [entries.add_path(root, t) for t in (x, y, z)] == [16, 16, 16]
    assert entries.add_path(root, seq(300, 16)) == 0  # no room left
    assert entries.add_path(root, x[:8]) == 0  # already covered
    tree.check_invariants()
    tree.match_prefix(RadixKey(y))  # touched: x is the least recently used entry now
    tree.match_prefix(RadixKey(z))
    entries.cap_tokens = 32
    assert entries.trim() == 16
    assert tree.match_prefix(RadixKey(x)).storage_hit_len == 0
    assert tree.match_prefix(RadixKey(y)).storage_hit_len == 16
    tree.check_invariants()
    # Bad input over storage-only entries: ValueError, state unchanged.
    from support.tree_model import snapshot

    before = snapshot(tree)
    with pytest.raises(ValueError):
        tree.insert(InsertParams(RadixKey(y), np.arange(4, dtype=np.int32)))  # pages the caller does not hold
    assert snapshot(tree) == before
    # Computed KV for the first half of y: the split-off prefix becomes a device node (stored), the rest stays.
    pages = tree.alloc(8)
    tree.insert(InsertParams(RadixKey(y[:8]), pages))
    m = tree.match_prefix(RadixKey(y))
    assert (m.device_hit_len, m.host_hit_len, m.storage_hit_len) == (8, 0, 8)
    assert entries.tokens == 8 + 16
    tree.check_invariants()
    # L1 eviction is not blocked by the storage-only child; the stored node stays as a storage-only one.
    assert tree.evict(8).evicted_tokens == 8
    m = tree.match_prefix(RadixKey(y))
    assert (m.device_hit_len, m.storage_hit_len) == (0, 16)
    assert entries.tokens == 32
    tree.check_invariants()
    hybrid = RadixTree(TreeConfig(page_size=4), [SWAComponent(8)])
    hybrid.storage_only.cap_tokens = 48  # a hybrid tree keeps them too (their component values: none)
    assert hybrid.storage_only.add_path(hybrid.default_root, x) == len(x) - len(x) % 4
    assert hybrid.match_prefix(RadixKey(x)).storage_hit_len == len(x) - len(x) % 4
    hybrid.check_invariants()


def test_storage_only_entries_survive_l1_and_l2_eviction_above_them(tmp_path):
    """A prefetch of part of a storage-only entry splits it (fetched part -> L2 nodes, rest stays); when
    those nodes lose L1 and then L2, they turn back into storage-only nodes; a later request loads all
    of it exactly."""
    env = HiCacheEnv(page_size=4, device_pages=32, host_slots=64, storage_url=f"file://{tmp_path}/l3")
    a = seq(40, 32)
    env.serve(a)
    env.head.flush_write_through_acks()
    env.head.reset()
    env.settle_l3()  # the warm restart runs in the background
    tree, host = env.head.tree, env.head.controller.host
    r = env.serve(a[:16])
    assert r["prefetched"] == 16 and r["loaded"] == 16
    assert tree.storage_only.tokens == 16
    m = env.head.match_prefix(RadixKey(a))
    assert (m.device_hit_len, m.host_hit_len, m.storage_hit_len) == (16, 0, 16)
    check(env)
    assert tree.evict(32).evicted_tokens == 16  # L1 copy goes; the L2 copy and the entry below stay
    m = env.head.match_prefix(RadixKey(a))
    assert (m.device_hit_len, m.host_hit_len, m.storage_hit_len) == (0, 16, 16)
    check(env)
    assert host.evict(64) == 4  # the L2 copy goes too: a storage-only node again
    m = env.head.match_prefix(RadixKey(a))
    assert (m.device_hit_len, m.host_hit_len, m.storage_hit_len) == (0, 0, 32)
    assert tree.storage_only.tokens == 32
    check(env)
    r = env.serve(a)
    assert r["prefetched"] == 32 and r["loaded"] == 32
    assert tree.storage_only.tokens == 0
    check(env)


@pytest.mark.parametrize("seed", range(6))
def test_storage_only_entries_random_ops_keep_invariants_and_only_report_added_prefixes(seed):
    """Random add/match/insert/evict/cap changes on a small Full tree: invariants hold after every step,
    the storage-only tokens never exceed the cap, and every reported storage hit is a prefix of a path
    that was added as stored (no device or host hit ever comes from one)."""
    from hicache.cluster.tree import CacheCapacityError, RadixTree, TreeConfig

    rng = np.random.default_rng(seed)
    ps = 2
    tree = RadixTree(TreeConfig(page_size=ps, capacity_pages=24))
    entries = tree.storage_only
    entries.cap_tokens = 40
    added: list[np.ndarray] = []

    def tokens():
        return rng.integers(0, 3, int(rng.integers(1, 12)) * ps).astype(np.int32)

    for _ in range(300):
        op = rng.integers(0, 6)
        if op == 0:
            t = tokens()
            if entries.add_path(tree.default_root, t):
                added.append(t)
        elif op == 1:
            t = tokens()
            m = tree.match_prefix(RadixKey(t))
            assert m.host_hit_len == 0 and m.device_hit_len + m.storage_hit_len <= len(t)
            if m.storage_hit_len:
                end = m.device_hit_len + m.storage_hit_len
                assert any(len(a) >= end and np.array_equal(a[:end], t[:end]) for a in added)
        elif op == 2:
            t = tokens()
            m = tree.match_prefix(RadixKey(t))
            tree.inc_lock_ref(m.last_device_node)
            try:
                own = tree.alloc(len(t) - m.device_hit_len)
            except CacheCapacityError:
                tree.dec_lock_ref(m.last_device_node)
                continue
            tree.cache_finished_req(RequestState(RadixKey(t), np.concatenate([m.device_pages, own]),
                                                 m.device_hit_len, m.last_device_node))
        elif op == 3:
            tree.evict(int(rng.integers(1, 16)))
        elif op == 4:
            entries.cap_tokens = int(rng.integers(0, 48))
            entries.trim()
        elif op == 5 and rng.random() < 0.2:
            entries.drop_all()
        tree.check_invariants()
        assert entries.tokens <= entries.cap_tokens or entries.tokens == 0
