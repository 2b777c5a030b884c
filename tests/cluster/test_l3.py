"""L3 integration: L2->L3 backup, L3->L2 prefetch, sharing across processes, isolation, outages."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import fsspec
import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from hicache.cluster.storage_tier import PrefetchParams, PrefetchState, StorageParams
from hicache.cluster.tree import RadixKey
from support.hicache_env import HiCacheEnv


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


def test_isolation_by_salt_extra_key_and_fingerprint(tmp_path):
    url = f"file://{tmp_path}/l3"
    env = HiCacheEnv(storage_url=url)
    a = seq(0, 32)
    env.serve(a)
    env.head.flush_write_through_acks()
    other = HiCacheEnv(storage_url=url)
    for key in (RadixKey(a, cache_salt="s1"), RadixKey(a, extra_key="lora")):
        m = other.head.match_prefix(key)
        p = other.head.prefetch_from_storage(PrefetchParams(f"iso-{key.namespace}", key, m.best_match_node))
        assert p.state is PrefetchState.NOT_STARTED
    other_model = HiCacheEnv(storage_url=url, model_id="another-model")
    assert other_model.serve(a)["prefetched"] == 0
    assert HiCacheEnv(storage_url=url).serve(a)["prefetched"] == 32  # same namespace: found


class FlakyFS(MemoryFileSystem):
    """An in-memory filesystem whose reads can be made to hang or fail (a storage outage)."""

    protocol = "flaky"
    mode = "ok"
    root_marker = ""

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
            time.sleep(3)
        if FlakyFS.mode == "raise":
            raise OSError("storage down")


@pytest.fixture
def flaky():
    fsspec.register_implementation("flaky", FlakyFS, clobber=True)
    FlakyFS.store.clear()
    FlakyFS.mode = "ok"
    yield FlakyFS
    FlakyFS.mode = "ok"
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
    t0 = time.monotonic()
    r = reader.serve(a)  # the prefetch fails or times out: recompute, exact (serve() checks)
    assert time.monotonic() - t0 < 8
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
    assert env.head.controller.storage is None and env.worker.storage_executor is None
