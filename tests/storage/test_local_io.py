"""Where a file:// root's I/O runs (``StorageConfig.local_io``): on the calling thread for a local
disk (``InlineBatchIO``), on I/O threads otherwise; deadlines and close still hold inline."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hicache.storage import FsspecStorage, LocalIO, ModelFingerprint, StorageConfig
from hicache.storage.batch_io import Deadline, InlineBatchIO, RetryPolicy
from hicache.storage.breaker import Breaker
from hicache.storage.object_store import LocalObjectStore, on_local_disk

FP = ModelFingerprint("tiny-test", "float32", page_size=4, num_layers=2, num_kv_heads=2, head_dim=8)


def test_a_local_root_runs_inline_unless_told_otherwise(tmp_path):
    assert on_local_disk(str(tmp_path)) and not on_local_disk("/proc")
    stores = {mode: FsspecStorage(f"file://{tmp_path}/{mode.value}", FP, StorageConfig(local_io=mode))
              for mode in LocalIO}
    mem = FsspecStorage("memory://local-io-test", FP, StorageConfig(local_io=LocalIO.INLINE))
    try:
        assert {m: st.runs_inline for m, st in stores.items()} == {
            LocalIO.AUTO: True, LocalIO.INLINE: True, LocalIO.THREADS: False}
        assert not mem.runs_inline  # not a local filesystem: the setting does not apply
    finally:
        for st in [*stores.values(), mem]:
            st.close()


def test_local_io_is_validated():
    assert StorageConfig(local_io="threads").local_io is LocalIO.THREADS  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="local_io must be one of"):
        StorageConfig(local_io="sometimes")  # type: ignore[arg-type]


class _Recording(LocalObjectStore):
    """The local store, noting which thread asks and able to hold a call until released."""

    def __init__(self) -> None:
        import fsspec

        super().__init__(fsspec.filesystem("file"))
        self.threads: list[int] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def exists(self, path: str) -> bool:
        self.threads.append(threading.get_ident())
        self.entered.set()
        assert self.release.wait(60)
        return super().exists(path)


def _inline(store: _Recording) -> InlineBatchIO:
    return InlineBatchIO(store, Breaker(3, 5.0), RetryPolicy(0, 0.0))


def test_inline_items_run_on_the_caller_and_start_only_before_the_deadline(tmp_path):
    (tmp_path / "a").write_bytes(b"x")
    store = _Recording()
    io = _inline(store)
    paths = [f"{tmp_path}/a", f"{tmp_path}/b"]
    assert io.exists_many(paths, Deadline(30.0)) == [True, False]
    assert store.threads == [threading.get_ident()] * 2
    late = io.exists_many(paths, Deadline(0.0))
    assert all(isinstance(r, TimeoutError) for r in late) and len(store.threads) == 2  # none started


def test_inline_close_waits_for_running_items_and_refuses_new_ones(tmp_path):
    store = _Recording()
    store.release.clear()
    io = _inline(store)
    out: list = []
    caller = threading.Thread(target=lambda: out.extend(io.exists_many([f"{tmp_path}/a"], Deadline(60.0))))
    caller.start()
    assert store.entered.wait(60)
    assert io.close(timeout_s=0.05) is False  # still running on the caller's thread
    store.release.set()
    caller.join(60)
    assert out == [False] and io.close(timeout_s=60) is True
    refused = io.exists_many([f"{tmp_path}/a"], Deadline(60.0))
    assert len(refused) == 1 and "closed" in str(refused[0])


def test_inline_file_store_round_trip_is_exact(tmp_path):
    from hicache.storage import Namespace, ShardCoord, page_keys
    from hicache.storage.testing import NumpyHostPool

    st = FsspecStorage(f"file://{tmp_path}/l3", FP, StorageConfig(pages_per_object=4))
    pool = NumpyHostPool(16, (2, 2, 4, 2, 8))
    st.register_host_pool(pool, shard=ShardCoord.full(FP))
    pool.fill_random(np.arange(8), 0)
    keys = page_keys(Namespace(FP, cache_salt="inline"), np.arange(6 * 4))
    try:
        assert st.runs_inline
        assert st.batch_set(keys, np.arange(6)) == [True] * 6
        assert st.batch_exists(keys) == 6
        assert st.batch_get(keys, np.arange(8, 14)) == [True] * 6
        np.testing.assert_array_equal(pool.read_slots(np.arange(8, 14)), pool.read_slots(np.arange(6)))
    finally:
        st.close()
