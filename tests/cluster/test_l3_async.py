"""L3 off the hot path: negative cache for existence lookups, batched manifest (warm restart)."""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
from support.hicache_env import HiCacheEnv

from hicache.cluster.storage_tier import PrefetchParams, PrefetchState
from hicache.cluster.tree import RadixKey
from hicache.storage import Namespace, page_keys


def seq(start, n):
    return np.arange(start, start + n, dtype=np.int32)


def _prefetch(env, tokens, req_id):
    """Starts a prefetch; its outcome once its existence query answered (the query runs off the head's
    thread: ``settle`` waits for it)."""
    key = RadixKey(tokens)
    m = env.head.match_prefix(key)
    p = env.head.prefetch_from_storage(PrefetchParams(req_id, key, m.best_match_node))
    if p.state is PrefetchState.RUNNING:
        assert env.head.controller.storage.settle(60)
        p = env.head.check_prefetch_progress(req_id)
    return p


def test_negative_cache_skips_repeated_misses_and_expires(tmp_path):
    url = f"file://{tmp_path}/l3"
    # A long TTL, expired below by moving the remembered expiries back: no wall-clock race on a busy machine.
    reader = HiCacheEnv(storage_url=url, storage_kwargs={"negative_cache_ttl_s": 300.0})
    a = seq(0, 32)
    assert _prefetch(reader, a, "r0").state is PrefetchState.NOT_STARTED
    counters = reader.head.controller.storage.counters
    assert counters.prefetch_negative_hits == 0
    assert _prefetch(reader, a, "r1").state is PrefetchState.NOT_STARTED  # remembered: no lookup
    assert counters.prefetch_negative_hits == 1
    writer = HiCacheEnv(storage_url=url)  # another replica stores the prefix meanwhile
    writer.serve(a)
    writer.head.flush_write_through_acks()
    assert _prefetch(reader, a, "r2").state is PrefetchState.NOT_STARTED  # still within the TTL
    assert counters.prefetch_negative_hits == 2
    misses = reader.head.controller.storage._misses
    assert misses and all(expiry > time.monotonic() + 200 for expiry, _ in misses.values())
    for key, (expiry, reason) in misses.items():
        misses[key] = (expiry - 301.0, reason)
    assert _prefetch(reader, a, "r3").state is not PrefetchState.NOT_STARTED  # expired: storage asked
    assert counters.prefetch_negative_hits == 2
    reader.head.flush_write_through_acks()
    assert reader.serve(a)["loaded"] == 32  # and the hit serves exactly (serve() checks bytes)


def test_negative_cache_is_bounded():
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        env = HiCacheEnv(storage_url=f"file://{d}/l3", storage_kwargs={"negative_cache_size": 2})
        for i in range(4):
            _prefetch(env, seq(1000 * (i + 1), 16), f"m{i}")
        assert len(env.head.controller.storage._misses) == 2


def test_manifest_lists_stored_prefixes_after_flush(tmp_path):
    url = f"file://{tmp_path}/l3"
    env = HiCacheEnv(storage_url=url, storage_kwargs={"manifest_interval_s": 3600})
    a = seq(0, 16)
    longer = np.r_[a, seq(500, 8)].astype(np.int32)
    b = seq(2000, 12)
    for t in (b, a, longer):  # the first entry is written at once, the rest wait for the interval
        env.serve(t)
        env.head.flush_write_through_acks()
    tier = env.head.controller.storage
    tier.flush_manifest()
    assert tier.counters.manifest_coalesced >= 1  # a's entry was replaced by the longer path
    store = env.workers._executors()[0].storage
    ns = Namespace(env.fingerprint)
    got = sorted(tuple(p.tokens.tolist()) for p in store.list_prefixes(ns))
    assert got == sorted([tuple(longer.tolist()), tuple(b.tolist())])
    # Entries queued after the last flush are written on detach.
    c = seq(3000, 8)
    env.serve(c)
    env.head.flush_write_through_acks()
    env.head.detach_storage_backend()
    again = HiCacheEnv(storage_url=url)
    store = again.workers._executors()[0].storage
    assert tuple(c.tolist()) in {tuple(p.tokens.tolist()) for p in store.list_prefixes(ns)}


@contextlib.contextmanager
def _hanging_l3_write(env, tokens):
    """Serves ``tokens`` and holds its L2->L3 write in storage (in flight) until the block ends (or 60 s:
    a test that waited for the write would find it no longer in flight). Afterwards every transfer is
    flushed and the storage restored."""
    release, storage = threading.Event(), env.worker.storage_executor.storage
    real_set = storage.batch_set

    def slow_set(*args, **kwargs):
        release.wait(60)
        return real_set(*args, **kwargs)

    storage.batch_set = slow_set
    try:
        env.serve(tokens)  # its L1->L2 backup, then its L2->L3 write (which hangs)
        deadline = time.monotonic() + 30
        while not env.head.controller.storage.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)  # a poll: the backup goes after backup_hold_calls calls, its ack starts the write
            env.head.check_hicache_events()
        assert env.head.controller.storage.in_flight, "the L3 write never started"
        yield
    finally:
        release.set()
    env.head.flush_write_through_acks()
    del storage.batch_set


def test_load_back_does_not_wait_for_l3_writes_in_flight(tmp_path):
    """A request's load-back waits for its L2->L1 load only: an L2->L3 write still running (slow storage)
    is neither waited for nor blocks the load (it is still in flight when the load is done)."""
    env = HiCacheEnv(storage_url=f"file://{tmp_path}/l3", faults={"delay_polls": 0})
    a, b = seq(0, 32), seq(5000, 32)
    env.serve(a)
    env.head.flush_write_through_acks()
    assert env.head.evict(32).evicted_tokens == 32  # a: host-only (in L2 and L3)
    with _hanging_l3_write(env, b):
        env.workers.delay_polls = 10**9  # polls hold the load's ack: the load-back has to wait for it
        r = env.serve(a)  # checks the loaded bytes
        assert env.head.controller.storage.in_flight  # the L3 write is still running
        assert r["loaded"] == 32


def test_alloc_short_of_pages_waits_for_l1_backups_not_l3_writes(tmp_path):
    """L1 full, one node locked only by its held L1->L2 backup, an L2->L3 write hanging: an alloc that needs
    that node's pages sends and waits for the backup (then evicts it), not for the L3 write, which frees no
    L1 page (it is still in flight when the alloc is done)."""
    env = HiCacheEnv(storage_url=f"file://{tmp_path}/l3", device_pages=16)
    a, b, c = seq(0, 32), seq(5000, 32), seq(9000, 32)
    env.serve(a)
    env.head.flush_write_through_acks()
    with _hanging_l3_write(env, b):
        env.serve(c)  # evicts a (in L2); c's backup is held, c locked by it
        assert env.head.controller.outbox.open_backups.chains, "c's backup should be held"
        pages = env.head.alloc(48)  # 12 pages: b's 8 + c's 8 are all there is; c's need its backup acked
        assert len(pages) == 12
        assert env.head.controller.storage.in_flight  # the L3 write is still running
        env.head.free(pages)
    assert env.serve(c)["loaded"] == 32  # c's backup landed intact (serve() checks the bytes)


# -- write hold: pause_writes() keeps L2->L3 writes out of the serving loop's prefill window ----------


def _stored_pages(env, tokens):
    store = env.workers._executors()[0].storage
    return store.batch_exists(page_keys(Namespace(env.fingerprint), tokens))


def _paused_backup(tmp_path, **kwargs):
    """An env whose tier is paused and holds the L2->L3 write of one served sequence."""
    env = HiCacheEnv(storage_url=f"file://{tmp_path}/l3", storage_kwargs=kwargs)
    tier = env.head.controller.storage
    tier.pause_writes()
    a = seq(0, 16)
    env.serve(a)
    env.head.controller.flush_device_backups()  # the D->H ack queues the L2->L3 write: held
    return env, tier, a


def test_paused_writes_are_held_then_sent_on_resume_bit_exact(tmp_path):
    env, tier, a = _paused_backup(tmp_path)
    assert tier.writes_paused and tier.counters.backup_held_ops == 1
    assert tier.in_flight == 0  # held, not sent
    pinned = [n for n in env.head.controller.tree.iter_nodes() if n.host_pin]
    assert pinned  # its nodes stay pinned in L2 meanwhile
    assert _stored_pages(env, a) == 0  # nothing reached L3 while paused
    assert tier.resume_writes() == 1 and not tier.writes_paused
    env.head.controller.submit()
    env.head.flush_write_through_acks()
    assert _stored_pages(env, a) == 4
    assert tier.counters.backup_pages == 4 and not any(n.host_pin for n in env.head.controller.tree.iter_nodes())
    cold = HiCacheEnv(storage_url=f"file://{tmp_path}/l3")
    assert cold.serve(a)["prefetched"] == 16  # serve() checks the loaded bytes


def test_a_pause_ends_by_itself_after_write_hold_max_s(tmp_path):
    env, tier, a = _paused_backup(tmp_path, write_hold_max_s=300.0)
    assert tier.counters.backup_held_ops == 1
    tier._paused_at -= 301.0  # expired (no wall-clock race on a busy machine)
    _prefetch(env, seq(5000, 16), "other")  # the next call into the tier ends the pause, sends the write
    assert not tier.writes_paused
    env.head.flush_write_through_acks()
    assert _stored_pages(env, a) == 4


def test_detach_of_a_paused_tier_unpins_held_writes(tmp_path):
    env, tier, a = _paused_backup(tmp_path)
    env.head.detach_storage_backend()  # no in-flight error for writes that were never sent
    assert not any(n.host_pin for n in env.head.controller.tree.iter_nodes())
    fresh = HiCacheEnv(storage_url=f"file://{tmp_path}/l3")
    # A controller whose flush ends the pause sends them first; otherwise detach drops them (a
    # later query misses them). Either way whole objects or none, never wrong data.
    got = (tier.counters.backup_held_dropped_pages, _stored_pages(fresh, a))
    assert got in ((4, 0), (0, 4))
    if got == (0, 4):
        assert fresh.serve(a)["prefetched"] == 16  # bit-exact (serve() checks the bytes)


def test_tier_detach_drops_held_writes(tmp_path):
    env, tier, a = _paused_backup(tmp_path)
    tier.detach()  # what the controller calls last; held writes still held here
    assert tier.counters.backup_held_dropped_pages == 4 and tier.in_flight == 0
    assert not any(n.host_pin for n in env.head.controller.tree.iter_nodes())
    assert _stored_pages(HiCacheEnv(storage_url=f"file://{tmp_path}/l3"), a) == 0


def test_reads_are_never_held_and_a_zero_bound_never_pauses(tmp_path):
    url = f"file://{tmp_path}/l3"
    writer = HiCacheEnv(storage_url=url)
    a = seq(0, 16)
    writer.serve(a)
    writer.head.flush_write_through_acks()
    reader = HiCacheEnv(storage_url=url)
    reader.head.controller.storage.pause_writes()
    assert reader.serve(a)["prefetched"] == 16  # the prefetch went out while writes were paused
    off = HiCacheEnv(storage_url=f"file://{tmp_path}/l3-off", storage_kwargs={"write_hold_max_s": 0.0})
    tier = off.head.controller.storage
    tier.pause_writes()
    assert not tier.writes_paused
    off.serve(seq(100, 16))
    off.head.flush_write_through_acks()
    assert tier.counters.backup_held_ops == 0 and _stored_pages(off, seq(100, 16)) == 4


def test_a_due_manifest_write_waits_for_the_resume(tmp_path):
    env = HiCacheEnv(storage_url=f"file://{tmp_path}/l3",
                     storage_kwargs={"manifest_interval_s": 0.0, "write_hold_max_s": 300.0})
    tier = env.head.controller.storage
    env.serve(seq(0, 16))
    env.head.controller.flush_device_backups()  # the L2->L3 write is queued (not paused yet) ...
    env.head.controller.submit()  # ... and sent
    tier.pause_writes()
    deadline = time.monotonic() + 10.0
    while tier.counters.backup_pages == 0 and time.monotonic() < deadline:  # its ack, applied while paused
        env.head.check_hicache_events()
        time.sleep(0.01)
    assert tier.counters.backup_pages == 4
    assert tier._manifest and tier.counters.manifest_records == 0  # due, but held with the writes
    tier.resume_writes()
    tier.flush_manifest()
    assert tier.counters.manifest_records == 1


def _manifest_job_with_two_entries(tmp_path, hold_s: float):
    """An env whose manifest job (two entries) is inside its first entry's write, blocked there until
    ``release`` is set; returns (env, tier, the two prefixes, release)."""
    env = HiCacheEnv(storage_url=f"file://{tmp_path}/l3",
                     storage_kwargs={"manifest_interval_s": 0.0, "write_hold_max_s": hold_s})
    tier = env.head.controller.storage
    tier.pause_writes()
    a, b = seq(0, 16), seq(700, 16)
    for t in (a, b):
        env.serve(t)
    env.head.controller.flush_device_backups()
    tier.resume_writes()
    env.head.controller.submit()  # the L2->L3 writes go out ...
    tier.pause_writes()  # ... and their acks land while paused: both manifest entries wait
    deadline = time.monotonic() + 10.0
    while tier.counters.backup_pages < 8 and time.monotonic() < deadline:  # L2->L3 acked, entries queued
        env.head.check_hicache_events()
        time.sleep(0.01)
    assert tier.counters.backup_pages == 8 and len(tier._manifest) == 2 and tier._manifest_job is None
    workers = env.head.controller.storage.workers
    record, started, release = workers.storage_record_prefix, threading.Event(), threading.Event()

    def first_blocks(ns, tokens):  # the real record; the first one waits for the test
        if not started.is_set():
            started.set()
            assert release.wait(10.0)
        record(ns, tokens)

    workers.storage_record_prefix = first_blocks
    tier.resume_writes()  # starts the due manifest job
    assert started.wait(10.0)
    return env, tier, (a, b), release


def _listed(env):
    store = env.workers._executors()[0].storage
    return sorted(tuple(p.tokens.tolist()) for p in store.list_prefixes(Namespace(env.fingerprint)))


def test_a_running_manifest_write_stops_between_entries_while_paused(tmp_path):
    env, tier, (a, b), release = _manifest_job_with_two_entries(tmp_path, hold_s=300.0)
    tier.pause_writes()  # a prefill starts while the job is inside its first entry
    release.set()
    deadline = time.monotonic() + 10.0
    while tier.counters.manifest_hold_waits == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    # Counted before the job waits for the resume: the second entry cannot be recorded now.
    assert tier.counters.manifest_hold_waits == 1 and tier.counters.manifest_records == 1  # the second waits
    assert not tier._manifest_job.done()
    tier.resume_writes()  # the first token: the job goes on
    tier._manifest_job.result(timeout=10.0)
    assert tier.counters.manifest_records == 2
    assert _listed(env) == sorted([tuple(a.tolist()), tuple(b.tolist())])  # nothing lost


def test_a_pause_closes_the_manifest_gate_only_while_a_manifest_write_is_in_flight(tmp_path):
    """The manifest thread is the only waiter: with no write in flight a pause leaves the gate open (no
    lock taken on the serving thread), with one in flight it closes it until the resume."""
    env, tier, _, release = _manifest_job_with_two_entries(tmp_path, hold_s=300.0)
    tier.pause_writes()
    assert not tier._writes_open.is_set()
    tier.resume_writes()
    release.set()
    tier._manifest_job.result(timeout=10.0)
    deadline = time.monotonic() + 10.0
    while tier._manifest_jobs and time.monotonic() < deadline:  # the job's own exit, just after its result
        time.sleep(0.005)
    tier.pause_writes()
    assert tier.writes_paused and tier._writes_open.is_set()
    tier.resume_writes()
    assert tier.counters.manifest_records == 2


def test_a_paused_manifest_write_goes_on_after_the_hold_bound_without_a_resume(tmp_path):
    env, tier, (a, b), release = _manifest_job_with_two_entries(tmp_path, hold_s=0.2)
    tier.pause_writes()  # never resumed: the job waits at most what is left of the 0.2 s bound
    release.set()
    tier._manifest_job.result(timeout=10.0)
    assert tier.counters.manifest_records == 2 and tier.counters.manifest_hold_waits == 1
    assert tier.writes_paused
    assert _listed(env) == sorted([tuple(a.tolist()), tuple(b.tolist())])


def test_min_pages_query_finds_another_replicas_write_exactly(tmp_path):
    """The existence query carries prefetch_min_tokens in pages (3 here): storage leaves out what
    could only make a shorter hit, yet a prefix another head stored after this one's miss is found
    whole, one of exactly the minimum too, and one below it starts nothing."""
    url = f"file://{tmp_path}/l3"
    kw = {"negative_cache_ttl_s": 0.0, "prefetch_min_tokens": 12, "pages_per_object": 8}
    reader, writer = HiCacheEnv(storage_url=url, storage_kwargs=kw), HiCacheEnv(storage_url=url, storage_kwargs=kw)
    assert reader.head.controller.storage._exists_min_pages == 3
    a, b, c = seq(0, 40), seq(500, 12), seq(900, 8)
    assert _prefetch(reader, a, "m0").state is PrefetchState.NOT_STARTED
    for tokens in (a, b, c):
        writer.serve(tokens)
    writer.head.flush_write_through_acks()
    assert reader.serve(a)["prefetched"] == 40  # serve() checks the bytes exactly
    assert reader.serve(np.r_[b, seq(700, 8)].astype(np.int32))["prefetched"] == 12
    assert _prefetch(reader, np.r_[c, seq(300, 8)].astype(np.int32), "m1").state is PrefetchState.NOT_STARTED
    assert reader.head.controller.storage.counters.prefetch_failures == 0


def test_prefetch_at_the_inflight_cap_is_no_remembered_miss(tmp_path):
    """Room for fewer pages than a prefetch's minimum is not L3's answer: storage is not asked and no
    miss is remembered (a later prefetch asks storage)."""
    url = f"file://{tmp_path}/l3"
    env = HiCacheEnv(storage_url=url, storage_kwargs={"negative_cache_ttl_s": 300.0, "prefetch_min_tokens": 12,
                                                      "max_inflight_prefetch_pages": 2})
    for i in range(2):
        p = _prefetch(env, seq(0, 32), f"c{i}")
        assert p.state is PrefetchState.NOT_STARTED and "max_inflight_prefetch_pages" in p.reason
    assert env.head.controller.storage.counters.prefetch_negative_hits == 0 and not env.head.controller.storage._misses


class _HeldPreviousFingerprints:
    """The real worker group, but existence checks under another fingerprint wait for ``gate`` (a
    deterministic hook: the previous-fingerprint check is slow)."""

    def __init__(self, inner, gate: threading.Event) -> None:
        self.inner, self.gate = inner, gate

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def storage_exists(self, keys, first_page, min_pages=1, fingerprint=None, chunk_start_key=None):
        if fingerprint is not None:
            assert self.gate.wait(60)
        return self.inner.storage_exists(keys, first_page, min_pages, fingerprint, chunk_start_key)


def test_a_slow_previous_fingerprint_check_never_holds_a_miss_and_answers_later_requests():
    """L3 holds the prompt under the previous model's fingerprint only. Its check runs after the query's
    own miss; while it is held, the request's wait for its query ends (moved past its bound here, as the
    clock would) with a plain miss, never "L3 unavailable"; once the check answers, a later request that
    hits the remembered miss reads "fingerprint differs"."""
    import concurrent.futures as cf

    from hicache.cluster.storage_tier import FINGERPRINT_DIFFERS, NOT_ENOUGH

    url = f"memory://l3ask-fp-{time.monotonic_ns()}"
    writer = HiCacheEnv(storage_url=url, model_id="model-v1")
    a = seq(0, 32)
    writer.serve(a)
    writer.head.flush_write_through_acks()
    reader = HiCacheEnv(storage_url=url, model_id="model-v2", storage_kwargs={
        "previous_fingerprints": (writer.fingerprint,), "query_wait_max_s": 30.0, "negative_cache_ttl_s": 300.0})
    tier = reader.head.controller.storage
    gate = threading.Event()
    tier.workers = _HeldPreviousFingerprints(tier.workers, gate)
    key = RadixKey(a)
    root = reader.head.match_prefix(key).best_match_node
    assert reader.head.prefetch_from_storage(PrefetchParams("r0", key, root)).state is PrefetchState.RUNNING
    task = tier._by_req["r0"]
    cf.wait([task.query], timeout=60)  # the query's own answer: nothing under model-v2
    task.query_until = 0.0  # the request's wait for its query is over
    p = reader.head.check_prefetch_progress("r0")
    assert (p.state, p.reason) == (PrefetchState.NOT_STARTED, NOT_ENOUGH)
    gate.set()
    ((_, late),) = tier._late_reasons
    assert late.result(timeout=60) is True  # found under model-v1
    p = reader.head.prefetch_from_storage(PrefetchParams("r1", key, root))
    assert (p.state, p.reason) == (PrefetchState.NOT_STARTED, FINGERPRINT_DIFFERS)
    assert tier.counters.prefetch_negative_hits == 1 and tier.counters.l3_queries == 1
