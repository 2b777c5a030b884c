"""L3 on a failing network (issue #23), through the seeded fault wrapper over memory://, file:// and
gs:// (emulator): bytes damaged in transit are misses and never deletions; hangs and refused
connections cost a call at most its deadline and open the breaker, whose probe closes it again; a
deleted bucket is counted as such; nothing raises to the caller.

Synchronisation is by the wrapper's counters and hang gate and the breaker's ``ManualClock``, never
by sleeping. Wall-clock bounds appear only where the bound is the behaviour under test (a call's
deadline), with a generous margin."""

from __future__ import annotations

import threading
import time

import fsspec
import numpy as np
import pytest

from hicache.storage import FsspecStorage, ModelFingerprint, Namespace, ShardCoord, StorageConfig, page_keys
from hicache.storage.errors import StorageUnavailableError
from hicache.storage.fault_injection import FaultPlan, FaultyFileSystem, OpFaults
from hicache.storage.testing import ManualClock, NumpyHostPool, same_bytes
from hicache.storage.testing import slot_range as S

FP = ModelFingerprint("tiny-test", "float32", page_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
SLOT_SHAPE = (2, 2, 4, 2, 8)
PPO = 4
N_CHAINS = 6
PAGES = 8  # per chain: two objects
MARGIN_S = 1.0  # slack over a deadline for a loaded machine


def _target(scheme: str):
    if scheme == "gs":
        import gcsfs

        return gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True, use_listings_cache=False)
    if scheme == "file":
        return fsspec.filesystem("file", auto_mkdir=True)
    return fsspec.filesystem("memory")


@pytest.fixture
def make(make_url):
    """``make(scheme, url=None, plan=None, **config)`` -> a store reading and writing through a
    ``FaultyFileSystem`` (``store.faulty``) with a ``ManualClock`` breaker (``store.clock``)."""
    made: list[FsspecStorage] = []

    def build(scheme: str, url: str | None = None, plan: FaultPlan | None = None, **cfg) -> FsspecStorage:
        url = url or make_url(scheme)
        fs = FaultyFileSystem(_target(scheme), plan or FaultPlan())
        cfg = {"pages_per_object": PPO, "timeout_s": 20.0, "exists_timeout_s": 20.0, "list_timeout_s": 20.0,
               "max_pending_ops": 10_000, **cfg}
        clock = ManualClock()
        st = FsspecStorage(url, FP, StorageConfig(**cfg), fs=fs, clock=clock)
        st.pool = NumpyHostPool(64, SLOT_SHAPE, np.float32)
        st.register_host_pool(st.pool, shard=ShardCoord.full(FP))
        st.faulty, st.clock, st.url_ = fs, clock, url
        made.append(st)
        return st

    yield build
    for st in made:
        st.faulty.release_hangs()
        st.close(timeout_s=0.1)


def _chains():
    out = []
    for c in range(N_CHAINS):
        ns = Namespace(FP, cache_salt=f"chain-{c}")
        toks = np.arange(PAGES * FP.page_size, dtype=np.int64) + 1000 * c
        out.append((ns, toks, page_keys(ns, toks)))
    return out


def _fill_store(st) -> None:
    """Every chain stored (pages from slots 0..PAGES-1, seeded per chain) and recorded."""
    for c, (ns, toks, keys) in enumerate(_chains()):
        st.pool.fill_random(S(0, PAGES), seed=100 + c)
        assert st.batch_set(keys, S(0, PAGES)) == [True] * PAGES
        assert st.record_prefix(ns, toks)


def _stored_objects(st) -> list[str]:
    return sorted(st.faulty.fs.find(st._base))


def _read_all(st) -> tuple[int, bool]:
    """(pages loaded over every chain, every loaded page bit-exact)."""
    ref = NumpyHostPool(PAGES, SLOT_SHAPE, np.float32)
    hits, exact = 0, True
    for c, (_, _, keys) in enumerate(_chains()):
        got = st.batch_get(keys, S(20, 20 + PAGES))
        n = sum(got)
        assert got == [True] * n + [False] * (PAGES - n)
        ref.fill_random(S(0, PAGES), seed=100 + c)
        exact &= same_bytes(st.pool.buf[20 : 20 + n], ref.buf[:n])
        hits += n
    return hits, exact


# ---- bytes damaged in transit ------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["corrupt_p", "truncate_p"])
@pytest.mark.parametrize("p", [0.3, 1.0])
def test_damage_in_transit_is_a_miss_and_deletes_nothing(scheme, make, damage, p):
    writer = make(scheme)
    _fill_store(writer)
    objects = _stored_objects(writer)
    baseline, exact = _read_all(make(scheme, url=writer.url_))
    assert baseline == N_CHAINS * PAGES and exact

    st = make(scheme, url=writer.url_, plan=FaultPlan(read=OpFaults(**{damage: p}), seed=7))
    hits, exact = _read_all(st)
    listed = st.list_prefixes(_chains()[0][0])
    s = st.stats()
    injected = st.faulty.injected()["corrupt" if damage == "corrupt_p" else "truncate"]
    assert injected > 0 and s.corrupt_in_transit > 0
    assert (s.corrupt_at_rest, s.corrupt_deleted) == (0, 0)
    assert exact  # what was loaded is the stored data, bit for bit
    if p == 1.0:  # every read damaged, the re-read too: nothing loads
        assert hits == 0 and listed == []
    else:  # a first read damaged and its re-read clean: the object loads after all
        assert hits > 0 and s.objects_read > 0
    assert _stored_objects(writer) == objects  # no intact object (or manifest entry) deleted
    assert _read_all(make(scheme, url=writer.url_)) == (baseline, True)  # a clean cold reader: all hits


def test_a_manifest_entry_cut_in_transit_reads_short_and_stays(make):
    writer = make("memory")
    _fill_store(writer)
    ns = _chains()[0][0]
    st = make("memory", url=writer.url_, plan=FaultPlan(read=OpFaults(truncate_p=1.0), seed=3))
    assert st.list_prefixes(ns) == []
    s = st.stats()
    assert s.corrupt_by_reason.get("short", 0) >= 1 and "bad_key" not in s.corrupt_by_reason
    assert (s.corrupt_at_rest, s.corrupt_deleted) == (0, 0)
    assert len(make("memory", url=writer.url_).list_prefixes(ns)) == 1  # still there


def test_a_manifest_entry_cut_at_rest_reads_short_and_is_removed(scheme, make):
    writer = make(scheme)
    _fill_store(writer)
    ns = _chains()[0][0]
    d, name = writer._manifest.location(ns)
    (entry,) = [p for p in writer.faulty.fs.find(d) if p.rsplit("/", 1)[-1].startswith(name)]
    blob = writer.faulty.fs.cat_file(entry)
    writer.faulty.fs.rm_file(entry)
    writer.faulty.fs.pipe_file(entry, blob[:-8])  # a torn write: the last token missing
    st = make(scheme, url=writer.url_)
    assert st.list_prefixes(ns) == []
    s = st.stats()
    assert dict(s.corrupt_by_reason) == {"short": 1}
    assert (s.corrupt_at_rest, s.corrupt_deleted, s.corrupt_in_transit) == (1, 1, 0)
    assert not writer.faulty.fs.exists(entry)


def test_an_object_corrupt_at_rest_is_removed_under_flips_in_transit(scheme, make):
    """At-rest damage is still found and removed while 30% of reads are also flipped in transit
    (a read pair with a transit flip is not proof; a later clean pair is)."""
    writer = make(scheme)
    _fill_store(writer)
    _, _, keys = _chains()[0]
    path = writer.object_path(keys[3])
    blob = bytearray(writer.faulty.fs.cat_file(path))
    blob[-5] ^= 0x40
    writer.faulty.fs.rm_file(path)
    writer.faulty.fs.pipe_file(path, bytes(blob))
    before = set(_stored_objects(writer))
    st = make(scheme, url=writer.url_, plan=FaultPlan(read=OpFaults(corrupt_p=0.3), seed=11))
    for _ in range(20):
        st.batch_get(keys, S(20, 20 + PAGES))
        if st.stats().corrupt_deleted:
            break
    s = st.stats()
    assert (s.corrupt_at_rest, s.corrupt_deleted) == (1, 1)
    assert set(_stored_objects(writer)) == before - {path}  # that object only


# ---- existence checks: one metadata request per object, never a listing ------------------------


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


@pytest.mark.parametrize("index", [True, False], ids=["default", "no_index"])
def test_existence_checks_are_object_metadata_requests_never_listings(scheme, make, index):
    """Counted through the wrapper: its calls, and on gs:// every HTTP request gcsfs sends (a
    listing gcsfs makes inside ``_info`` shows there, which the control at the end proves). The
    reader keeps to its own shard (``layout_refresh_s=None``): finding other layouts' shard folders
    is a listing of its own, at most every ``layout_refresh_s`` (tests/storage/test_shard_cover.py).
    A hit is object metadata requests only, with or without the leading-page index; a miss with the
    index (default) also lists the one index folder of the chunk it stopped in (in the round of its
    partial-object probes), which finds no entry here."""
    writer = make(scheme)
    _fill_store(writer)
    st = make(scheme, url=writer.url_, layout_refresh_s=None, leading_page_index=index)
    fs = st.faulty
    calls, reqs = fs.calls(), fs.requests()
    _, _, keys = _chains()[0]
    assert st.batch_exists(keys) == PAGES  # two stored objects
    assert st.batch_exists(keys[:4]) == 4  # ends on the first object's last page
    assert st.batch_set(keys, S(0, PAGES)) == [True] * PAGES  # skipped: its existence round says stored
    dc, dr = _delta(fs.calls(), calls), _delta(fs.requests(), reqs)
    assert dc["list"] == 0 and dc["read"] == 0 and dc["write"] == 0 and dc["metadata"] == 2 + 1 + 2
    assert st.batch_exists([k[::-1] for k in keys]) == 0  # none stored: naturals, then partials
    listings = 1 if index else 0  # beside the partials: the first chunk's folder
    dc, dr = _delta(fs.calls(), calls), _delta(fs.requests(), reqs)
    assert dc["list"] == listings and dc["read"] == 0 and dc["write"] == 0
    asked = 2 + 1 + 2 + 2 + 3  # objects asked about: stored pair; one; the set's pair; missing pair, then 3 partials
    assert dc["metadata"] == asked
    assert st.stats().index_lookups == listings
    if scheme == "gs":
        assert dr == {"read": 0, "write": 0, "metadata": asked, "list": listings, "delete": 0}
        before = fs.requests()["list"]
        assert fs.exists(st.object_path(keys[3]))  # fsspec's exists: gcsfs' _info lists the prefix too
        assert fs.requests()["list"] > before
    else:
        assert dr == dict.fromkeys(dr, 0)  # memory://, file://: no HTTP


# ---- hangs, refused connections: deadlines and the breaker -------------------------------------


def _timed(call):
    t0 = time.monotonic()
    r = call()
    return r, time.monotonic() - t0


@pytest.mark.parametrize("fault", ["hang", "refused"])
def test_breaker_opens_fails_fast_and_a_probe_closes_it(scheme, make, fault):
    writer = make(scheme)
    _fill_store(writer)
    _, _, keys = _chains()[0]
    deadline = 0.5
    faults = OpFaults(hang_p=1.0) if fault == "hang" else OpFaults(refuse_p=1.0)
    st = make(scheme, url=writer.url_, plan=FaultPlan.every(faults, hang_max_s=60.0),
              timeout_s=deadline, exists_timeout_s=deadline, breaker_threshold=3)
    fs = st.faulty
    calls = 0
    while st.stats().breaker_state == "closed":
        assert calls < 3  # threshold calls at most (a call counts once, whatever its rounds)
        n, took = _timed(lambda: st.batch_exists(keys))
        assert n == 0 and took < deadline + MARGIN_S
        calls += 1
    assert calls == (3 if fault == "hang" else 1)  # every connection refused: open at once
    s = st.stats()
    assert s.breaker_opens == 1 and not st.available
    assert (s.timeouts if fault == "hang" else s.refused) > 0
    seen = sum(fs.injected().values())
    # open: misses at once, nothing reaches the network, nothing raises
    assert st.batch_exists(keys) == 0
    assert st.batch_get(keys, S(20, 28)) == [False] * PAGES
    with pytest.raises(StorageUnavailableError):  # a write is refused whole, typed, for the caller to count
        st.batch_set(keys, S(0, 8))
    assert st.list_prefixes(_chains()[0][0]) == []
    assert sum(fs.injected().values()) == seen
    assert st.stats().unavailable >= 3 and st.stats().skipped_write_pages == PAGES
    # the endpoint comes back; the cooldown passes; one probe closes the breaker; hits resume
    fs.set_plan(FaultPlan())
    fs.release_hangs()
    assert st.batch_exists(keys) == 0  # still within the cooldown
    st.clock.advance(st.config.breaker_cooldown_s)
    assert st.available and st.stats().breaker_state == "half_open"
    assert st.batch_exists(keys, timeout_s=20.0) == PAGES  # the probe
    assert st.stats().breaker_state == "closed"
    assert st.batch_get(keys, S(20, 28), timeout_s=20.0) == [True] * PAGES


def test_a_call_of_several_failed_rounds_counts_once_toward_the_breaker(scheme, make):
    """Every operation times out fast (the endpoint's own timeout, well before the call's deadline): one
    ``batch_exists`` lists the other layouts, then asks the natural objects, then the partial ones,
    each round failed; it is one failed call, so ``breaker_threshold`` calls open the breaker."""
    writer = make(scheme)
    _fill_store(writer)
    _, _, keys = _chains()[0]
    st = make(scheme, url=writer.url_, plan=FaultPlan.every(OpFaults(hang_p=1.0), hang_max_s=0.05),
              exists_timeout_s=20.0, breaker_threshold=3)
    for call in range(3):
        assert st.stats().breaker_state == "closed"
        hung = st.faulty.injected()["hang"]
        assert st.batch_exists(keys) == 0
        if call == 0:  # (later calls skip the listing: it is refreshed every layout_refresh_s)
            assert st.faulty.injected()["hang"] - hung > PAGES // PPO  # more than one round ran
    s = st.stats()
    assert (s.breaker_state, s.breaker_opens) == ("open", 1) and s.timeouts > 3


def test_probe_watches_the_location_without_a_request(make):
    """``probe``: True while the endpoint answers; False without I/O while the breaker is open;
    after the cooldown it is the probe that closes the breaker."""
    st = make("memory", breaker_threshold=2)
    assert st.probe() is True
    st.faulty.set_plan(FaultPlan.every(OpFaults(refuse_p=1.0)))
    assert st.probe() is False and st.probe() is False
    assert st.stats().breaker_state == "open"
    seen = st.faulty.injected()["refused"]
    assert st.probe() is False and st.faulty.injected()["refused"] == seen  # no I/O
    st.faulty.set_plan(FaultPlan())
    st.clock.advance(st.config.breaker_cooldown_s)
    assert st.probe() is True and st.stats().breaker_state == "closed"


def test_a_hung_gs_call_leaves_nothing_running(make):
    """On gcsfs' loop the items a deadline cut are cancelled: none is still hanging after the call."""
    st = make("gs", plan=FaultPlan(metadata=OpFaults(hang_p=1.0), hang_max_s=60.0), exists_timeout_s=0.3)
    _, _, keys = _chains()[0]
    assert st.batch_exists(keys) == 0
    assert st.faulty.release_hangs() == 0  # (a thread pool's abandoned items would still hang here)


def test_a_failed_probe_opens_the_breaker_for_another_cooldown(make):
    st = make("memory", plan=FaultPlan.every(OpFaults(refuse_p=1.0)), breaker_threshold=2)
    _, _, keys = _chains()[0]
    while st.stats().breaker_state == "closed":
        st.batch_exists(keys)
    st.clock.advance(st.config.breaker_cooldown_s)
    assert st.batch_exists(keys) == 0  # the probe, refused
    s = st.stats()
    assert (s.breaker_state, s.breaker_opens) == ("open", 2)


def test_existence_checks_are_held_to_their_short_bound(scheme, make):
    """``batch_exists`` without ``timeout_s`` waits at most ``exists_timeout_s``, however long the
    data calls' deadline."""
    st = make(scheme, plan=FaultPlan(metadata=OpFaults(hang_p=1.0), hang_max_s=60.0),
              timeout_s=30.0, exists_timeout_s=0.3)
    _, _, keys = _chains()[0]
    (n, took) = _timed(lambda: st.batch_exists(keys))
    assert n == 0 and took < 0.3 + MARGIN_S
    assert st.stats().timeouts > 0


def test_listing_has_its_own_deadline(scheme, make):
    writer = make(scheme)
    _fill_store(writer)
    st = make(scheme, url=writer.url_, plan=FaultPlan(listing=OpFaults(hang_p=1.0), hang_max_s=60.0),
              list_timeout_s=0.5)
    (out, took) = _timed(lambda: st.list_prefixes(_chains()[0][0]))
    assert out == [] and took < 0.5 + MARGIN_S
    assert st.stats().timeouts == 1


@pytest.mark.parametrize("fault", ["error", "hang"])
def test_a_failed_leading_page_listing_is_a_counted_miss_of_those_pages_only(scheme, make, fault):
    """The leading-page index: the listing of a chunk's first-page folder goes through the same breaker
    as the call's other operations, and ends by half the call's time left; failing (an error, or a
    hang past that end) it costs only the leading pages, counted, and the whole objects before them
    still load. A listing that runs out its own end is slow, not down: the breaker stays closed
    (threshold 1 here: one tripped round would open it)."""
    writer = make(scheme)
    _fill_store(writer)
    faults = OpFaults(error_p=1.0) if fault == "error" else OpFaults(hang_p=1.0)
    st = make(scheme, url=writer.url_, plan=FaultPlan(listing=faults, hang_max_s=60.0), breaker_threshold=1,
              retries=0, layout_refresh_s=None)
    _, _, keys = _chains()[0]
    assert st.batch_exists(keys[:6], timeout_s=2.0) == 4  # the first object; pages 4, 5 only via the listing
    assert st.batch_get(keys[:6], S(20, 26), timeout_s=2.0) == [True] * 4 + [False] * 2
    s = st.stats()
    assert (s.timeouts if fault == "hang" else s.errors) >= 1
    assert s.breaker_opens == 0 and s.breaker_state == "closed"
    st.faulty.set_plan(FaultPlan())  # the listing answers again: the leading pages come back
    st.faulty.release_hangs()
    assert st.batch_exists(keys[:6]) == 6


def test_transient_errors_are_retried_within_the_deadline(make):
    """503s on 60% of calls: our retries make the calls succeed; each retry is counted."""
    st = make("memory", plan=FaultPlan.every(OpFaults(error_p=0.6), seed=5), retries=8, retry_backoff_s=0.0)
    _fill_store(st)
    assert _read_all(st) == (N_CHAINS * PAGES, True)
    assert st.stats().retries > 0 and st.stats().breaker_opens == 0


def test_a_refused_gs_endpoint_is_refused_not_retried_until_the_deadline(gcs_emulator):
    """gcsfs' own retries (backoff of 1, 2, 4 ... s) are off: a refused connection surfaces as
    ``refused`` within the deadline instead of a timeout."""
    from support.net import free_loopback_port

    port = free_loopback_port()  # nothing listens there
    opts = {"token": "anon", "endpoint_url": f"http://127.0.0.1:{port}"}
    st = FsspecStorage("gs://hicache-test/refused", FP,
                       StorageConfig(pages_per_object=PPO, timeout_s=5.0, exists_timeout_s=5.0, storage_options=opts))
    st.register_host_pool(NumpyHostPool(64, SLOT_SHAPE, np.float32), shard=ShardCoord.full(FP))
    _, _, keys = _chains()[0]
    try:
        assert st.batch_set(keys, S(0, PAGES)) == [False] * PAGES
        s = st.stats()
        assert s.refused > 0 and s.timeouts == 0
    finally:
        st.close()


# ---- bucket deleted ------------------------------------------------------------------------------


def test_bucket_deleted_is_counted_and_nothing_raises(scheme, make):
    writer = make(scheme)
    _fill_store(writer)
    ns, toks, keys = _chains()[0]
    st = make(scheme, url=writer.url_, plan=FaultPlan(bucket_deleted=True))
    assert st.batch_exists(keys) == 0
    assert st.batch_get(keys, S(20, 28)) == [False] * PAGES
    assert st.batch_set(keys, S(0, 8)) == [False] * PAGES  # (stored already: the existence check says no)
    assert st.record_prefix(ns, toks) is False
    assert st.list_prefixes(ns) == []
    s = st.stats()
    assert s.missing_bucket >= 3 and s.errors >= s.missing_bucket  # writes, manifest write, listing
    assert s.error_counts()["missing_bucket"] == s.missing_bucket
    assert s.breaker_state == "closed"  # the endpoint answers: recompute, no breaker


def test_a_real_gs_bucket_deleted_mid_run(gcs_emulator):
    import gcsfs

    gfs = gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True, use_listings_cache=False)
    bucket = f"hicache-gone-{time.monotonic_ns()}"
    gfs.mkdir(bucket)
    st = FsspecStorage(f"gs://{bucket}/l3", FP, StorageConfig(pages_per_object=PPO, timeout_s=20.0, exists_timeout_s=20.0,
                                                          storage_options={"token": "anon"}))
    st.register_host_pool(NumpyHostPool(64, SLOT_SHAPE, np.float32), shard=ShardCoord.full(FP))
    try:
        ns, toks, keys = _chains()[0]
        assert st.batch_set(keys[:4], S(0, 4)) == [True] * 4
        gfs.rm(bucket, recursive=True)
        assert st.batch_exists(keys) == 0
        assert st.batch_set(keys, S(0, PAGES)) == [False] * PAGES
        assert st.list_prefixes(ns) == []
        assert st.probe() is False
        s = st.stats()
        assert s.missing_bucket >= 4 and s.breaker_state == "closed"
    finally:
        st.close()


# ---- close ---------------------------------------------------------------------------------------


def test_close_is_bounded_with_operations_hung_in_flight(scheme, make):
    st = make(scheme, plan=FaultPlan(write=OpFaults(hang_p=1.0), hang_max_s=60.0), timeout_s=60.0)
    _, _, keys = _chains()[0]
    st.pool.fill_random(S(0, PAGES), 1)
    out: list = []
    t = threading.Thread(target=lambda: out.append(st.batch_set(keys, S(0, PAGES))))
    t.start()
    assert st.faulty.wait_for_hangs(1, timeout=30.0)
    drained, took = _timed(lambda: st.close(timeout_s=0.3))
    assert drained is False and took < 0.3 + MARGIN_S
    st.faulty.release_hangs()
    t.join(timeout=30.0)
    assert not t.is_alive() and len(out[0]) == PAGES
    assert st.close() is True  # idempotent


_EXIT_WITH_A_HUNG_CALL = """
import fsspec, numpy as np
from hicache.storage import FsspecStorage, ModelFingerprint, Namespace, ShardCoord, StorageConfig, page_keys
from hicache.storage.fault_injection import FaultPlan, FaultyFileSystem, OpFaults
from hicache.storage.testing import NumpyHostPool
fp = ModelFingerprint("tiny-test", "float32", page_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
fs = FaultyFileSystem(fsspec.filesystem("memory"), FaultPlan(metadata=OpFaults(hang_p=1.0), hang_max_s=3600.0))
st = FsspecStorage("memory://exit-with-a-hung-call", fp, StorageConfig(exists_timeout_s=0.2), fs=fs)
st.register_host_pool(NumpyHostPool(8, (2, 2, 4, 2, 8), np.float32), shard=ShardCoord.full(fp))
assert st.batch_exists(page_keys(Namespace(fp), np.arange(16))) == 0
assert fs.wait_for_hangs(1, timeout=30.0)
print("returned", flush=True)
"""  # ... and exits without close, an I/O thread blocked in the backend for an hour


def test_a_hung_sync_backend_never_holds_process_exit():
    """The sync backends' I/O threads are daemon threads: the process exits at once although one
    of them is blocked in a call that would hang for an hour."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _EXIT_WITH_A_HUNG_CALL], capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert r.stdout.strip() == b"returned"


def test_a_chained_gs_url_gets_the_gs_defaults(gcs_emulator):
    """``faulty::gs://...``: gs:// object size, no listings or instance cache, the bucket probe."""
    url = f"faulty::{gcs_emulator}/chained"
    st = FsspecStorage(url, FP, StorageConfig(storage_options={"gs": {"token": "anon"}}))
    try:
        pool = NumpyHostPool(8, SLOT_SHAPE, np.float32)
        st.register_host_pool(pool, shard=ShardCoord.full(FP))
        assert st.scheme == "gs"
        assert st.pages_per_object() == StorageConfig().object_bytes_for("gs") // pool.slot_bytes
        target = st.fs.fs
        assert target.dircache.use_listings_cache is False
        assert target is not type(target)(token="anon")  # not an instance from the cache
        assert st.probe() is True
        assert st.fs.requests()["list"] == 0  # (the bucket probe: one GET of the bucket)
    finally:
        st.close()
