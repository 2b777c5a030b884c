"""The Ray cluster: head actor + one HostWorker actor per fake host, Ray client, failures, two replicas.

One loopback ``ray.cluster_utils.Cluster`` for the module: a head node (``hicache_head``) and two fake
hosts (``hicache_host: 2`` each, so two replicas fit side by side), every host worker a
``jax.distributed`` process with 2 fake CPU devices (the replica's mesh: 4 devices, KV heads 0-1 on
host 0, 2-3 on host 1). Most tests stand in for the forward by writing a known KV pattern into
pages through the worker actors (SPMD: both hosts) and read every hit back from both hosts, bit for
bit; the engine test runs the reference model itself inside both host workers (``RayEngine``).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from support.kv_pattern import page_rows  # noqa: E402
from support.ray_cluster import loopback_cluster  # noqa: E402
from support.token_accounting import assert_tokens_accounted  # noqa: E402

import hicache  # noqa: E402
from hicache.cluster import HeadConfig, embedded, ray_storage_record  # noqa: E402
from hicache.cluster.client import ResultRef  # noqa: E402
from hicache.cluster.controller import LoadBackParams  # noqa: E402
from hicache.cluster.cost_model import CostOptions  # noqa: E402
from hicache.cluster.errors import (  # noqa: E402
    HiCacheError,
    HiCacheReplicaResetError,
    HiCacheTimeoutError,
    HiCacheUnavailableError,
)
from hicache.cluster.head import Call, Method  # noqa: E402
from hicache.cluster.policy import HiCacheConfig  # noqa: E402
from hicache.cluster.ray_head import HeadState, ReplicaConfig, get_head, stop_replica, worker_handles  # noqa: E402
from hicache.cluster.ray_workers import WorkerGroupOptions  # noqa: E402
from hicache.cluster.route_query import RouteQuery  # noqa: E402
from hicache.cluster.storage_tier import PrefetchParams, PrefetchState, StorageParams  # noqa: E402
from hicache.cluster.tree import InsertParams, RadixKey, RequestState, TreeConfig  # noqa: E402
from hicache.storage import ModelFingerprint  # noqa: E402
from hicache.workers import KVCacheSpec  # noqa: E402
from hicache.workloads import MultiTurnSpec, multi_turn  # noqa: E402

PS = 4
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=4, page_size=PS, dtype="float32")
RETRYABLE = (HiCacheUnavailableError, HiCacheTimeoutError, ray.exceptions.RayActorError)


def seq(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def replica_config(name: str, device_pages: int = 64, host_slots: int = 256) -> ReplicaConfig:
    # L1 (64 pages) is smaller than the kill test's working set: L2 and load-backs are in play.
    return ReplicaConfig(
        HeadConfig(name, TreeConfig(PS, device_pages),
                   HiCacheConfig(host_slots, ack_timeout_s=10.0, backup_batch_pages=4)),
        WorkerGroupOptions.fake_cpu_hosts(SPEC, num_hosts=2, devices_per_host=2),
        detached=False, health_interval_s=0.25,
    )


# Hits counted, not this VM's speed: a Ray replica's existence query and fetch go through the worker actors,
# which on a loaded CI box can outlast the default waits (50 ms, 0.5 s) or lose to recompute in the cost model.
DETERMINED = dict(prefetch_policy="wait_complete", prefetch_wait_max_s=30.0, query_wait_max_s=30.0,
                  cost=CostOptions(enabled=False))


def l3_params(path) -> StorageParams:
    """L3 on a local directory, for SPEC's KV (every replica using ``path`` shares it)."""
    fp = ModelFingerprint("ray-test", "float32", PS, SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim)
    return StorageParams(f"file://{path}/l3", fp, prefetch_min_tokens=PS, pages_per_object=2, **DETERMINED)


@pytest.fixture(scope="module")
def cluster():
    with loopback_cluster(num_hosts=2, host_slots=2) as c:
        yield c


@pytest.fixture(scope="module")
def replica_x(cluster):
    handle = hicache.start_replica(replica_config("x"))  # a non-detached head lives as long as its handle
    yield "x"
    del handle


class RayEnv:
    """Scheduler stand-in: control calls through a ``connect`` client, the forward through the workers."""

    def __init__(self, replica: str, timeout_s: float = 30.0) -> None:
        self.replica = replica
        self.client = hicache.connect(replica, timeout_s=timeout_s)
        self.refresh()

    def refresh(self) -> None:
        self.epoch, self.workers, self.ranges = worker_handles(self.replica)

    def pids(self) -> set[int]:
        return {p["pid"] for p in ray.get([w.ping.remote() for w in self.workers], timeout=30)}

    def rows(self, tokens: np.ndarray, first_page: int, num_pages: int) -> np.ndarray:
        return page_rows(tokens, first_page, num_pages, SPEC.page_shape, PS)

    def write(self, pages: np.ndarray, rows: np.ndarray) -> None:
        """The forward: every host writes its KV heads of ``pages`` (SPMD)."""
        ray.get([w.write_pages.remote(pages, rows[..., a:b, :]) for w, (a, b) in zip(self.workers, self.ranges)],
                timeout=30)

    def read(self, pages: np.ndarray) -> np.ndarray:
        """All KV heads of ``pages``, gathered from every host's shard."""
        return np.concatenate(ray.get([w.read_pages.remote(pages) for w in self.workers], timeout=30), axis=-2)

    def serve(self, tokens: np.ndarray) -> dict:
        """Match (+ load-back), lock, alloc, write the missing pages, finish; checks every hit exactly."""
        c, key = self.client, RadixKey(tokens)
        m = c.match_prefix(key)
        pages, hit, node, loaded = m.device_pages, m.device_hit_len, m.last_device_node, 0
        if m.host_hit_len:
            r = c.init_load_back(LoadBackParams(m.best_match_node, m.host_hit_len))
            if r.load_id >= 0 and c.wait_load_back(r.load_id):
                pages, hit, node, loaded = r.device_pages, r.device_hit_len, r.last_node, r.loaded_tokens
            elif r.load_id >= 0:
                m = c.match_prefix(key)
                pages, hit, node = m.device_pages, m.device_hit_len, m.last_device_node
        c.inc_lock_ref(node)
        if hit:
            np.testing.assert_array_equal(self.read(pages), self.rows(tokens, 0, hit // PS))
        own = c.alloc(len(tokens) - hit)
        if own.size:
            self.write(own, self.rows(tokens, hit // PS, own.size))
        c.cache_finished_req(RequestState(key, np.concatenate([pages, own]), hit, node))
        return {"device_hit": hit - loaded, "loaded": loaded}

    def prefetch(self, tokens: np.ndarray, req_id: str) -> int:
        """Fetches the L3 prefix of ``tokens`` (which this replica does not hold) into L2; returns its length."""
        key = RadixKey(tokens)
        m = self.client.match_prefix(key)
        assert m.device_hit_len + m.host_hit_len == 0
        started = self.client.prefetch_from_storage(PrefetchParams(req_id, key, m.best_match_node))
        assert started.state in (PrefetchState.RUNNING, PrefetchState.DONE)
        progress = self.client.check_prefetch_progress(req_id)
        assert progress.state is PrefetchState.DONE
        return progress.tokens

    def serve_retrying(self, tokens: np.ndarray, deadline_s: float = 90.0) -> tuple[dict, int]:
        """A scheduler's reaction to a lost host: drop the request (the replica resets) and redo it."""
        end, failures = time.monotonic() + deadline_s, 0
        while True:
            try:
                return self.serve(tokens), failures
            except RETRYABLE:
                failures += 1
                if time.monotonic() > end:
                    raise
                time.sleep(0.2)
                try:
                    self.refresh()
                except RETRYABLE:
                    pass


@pytest.fixture
def env_x(replica_x):
    env = RayEnv(replica_x)
    env.client.flush_write_through_acks()
    env.client.reset()
    return env


def test_replica_spans_both_hosts(env_x):
    h = ray.get(get_head("x").health.remote())
    assert h.state is HeadState.READY and h.num_hosts == 2 and h.page_size == PS
    assert env_x.ranges == [(0, 2), (2, 4)]  # heads sharded over the 2 x 2 device global mesh
    pings = ray.get([w.ping.remote() for w in env_x.workers])
    assert len({p["pid"] for p in pings}) == 2 and pings[0]["jax"] == pings[1]["jax"]  # one jax session


def test_backup_evict_load_back_is_bit_identical_on_every_host(env_x):
    c, a = env_x.client, seq(0, 24)
    env_x.serve(a)
    assert c.flush_write_through_acks() >= 1
    st = c.cache_stats()
    assert st["host_tokens"] == 24 and st["backed_up_tokens"] == 24
    assert st["bytes_moved"]["d2h"] == 2 * 6 * SPEC.page_bytes // 2  # each host moved its half of 6 pages
    env_x.serve(seq(1000, 250))  # pushes `a` out of L1
    c.flush_write_through_acks()
    hits = c.route_query(RouteQuery((RadixKey(a),))).hits[0]  # a router's dry run over Ray
    m = c.match_prefix(RadixKey(a))
    assert m.device_hit_len < 24 and m.device_hit_len + m.host_hit_len == 24
    assert (hits.l1, hits.l2) == (m.device_hit_len, m.host_hit_len)
    free = c.alloc(c.stats().free_pages * PS)  # every free L1 page := garbage, on both hosts
    env_x.write(free, np.full((free.size, *SPEC.page_shape), -7, np.float32))
    c.free(free)
    r = env_x.serve(a)  # asserts the loaded pages hold a's KV on both hosts' shards
    assert r["loaded"] == 24 - r["device_hit"] and r["loaded"] > 0
    assert c.cache_stats()["loaded_tokens"] == r["loaded"]


def test_batched_step_is_one_round_trip_with_per_call_errors(env_x):
    key = RadixKey(seq(0, 9))
    res = env_x.client.step([Call(Method.MATCH_PREFIX, key), Call("alloc", 8), Call("free", [12345]), Call(Method.STATS),
                             Call("free", ResultRef(1)), Call("free", ResultRef(2))])  # chained on earlier results
    assert [r.ok for r in res] == [True, True, False, True, True, False]
    assert isinstance(res[2].error, ValueError) and isinstance(res[5].error, ValueError)
    assert res[1].value.size == 2 and env_x.client.stats().request_pages == 0
    with pytest.raises(ValueError):  # single calls raise the cache's own error types
        env_x.client.free([12345])


def test_two_replicas_side_by_side(replica_x, env_x):
    handle = hicache.start_replica(replica_config("y"))  # noqa: F841  # a non-detached head lives as long as its handle
    try:
        env_y = RayEnv("y")
        assert env_y.pids().isdisjoint(env_x.pids()) and env_y.ranges == env_x.ranges
        a, b = seq(0, 20), seq(300, 20)
        env_x.serve(a)
        env_y.serve(b)
        assert env_x.serve(a)["device_hit"] == 20 and env_y.serve(b)["device_hit"] == 20
        # Separate trees and pools: neither sees the other's prefix (L3 sharing comes with L3).
        assert env_y.client.match_prefix(RadixKey(a)).device_hit_len == 0
        assert env_x.client.match_prefix(RadixKey(b)).device_hit_len == 0
        env_x.client.flush_write_through_acks()
        env_y.client.flush_write_through_acks()
        assert env_x.client.cache_stats()["host_tokens"] == 20 == env_y.client.cache_stats()["host_tokens"]
    finally:
        stop_replica("y")
    with pytest.raises(HiCacheUnavailableError):
        hicache.connect("y")


# -- hybrid models (SWA+Full, Mamba+Full) served through a Ray replica ---------------------------------------
def hybrid_model(kind: str):
    """3 layers of SPEC's heads: "swa", layers 0 and 2 local (window 12); "mamba", layer 1 recurrent."""
    from hicache.reference.engine import ModelConfig

    extra = {"swa": {"sliding_window": 12}, "mamba": {"recurrent_layers": (1,)}}[kind]
    return ModelConfig(vocab_size=256, num_layers=3, num_q_heads=8, num_kv_heads=SPEC.num_kv_heads,
                       head_dim=SPEC.head_dim, hidden=32, mlp_hidden=64, **extra)


def hybrid_replica(name: str, kind: str, num_hosts: int) -> ReplicaConfig:
    from hicache.replica_file import replica_config

    return dataclasses.replace(replica_config(hybrid_replica_file(name, kind, num_hosts)), health_interval_s=0.25)


def hybrid_replica_file(name: str, kind: str, num_hosts: int, l1_pages: int = 16) -> dict:
    """A replica file (``hicache up``'s path): L1 of ``l1_pages`` (a conversation or two of the chat below:
    later turns come back from L2), the component's L1 pool about as large and its L2 smaller than the Full
    L2; the workers' component pool layouts come from the file's model and components."""
    model = hybrid_model(kind)
    components = {"swa": {"swa": {"window": 12, "num_tokens": l1_pages * PS, "host_tokens": 64 * PS}},
                  "mamba": {"mamba": {"num_slots": 8, "state_shapes": [[1, model.hidden]], "host_slots": 24}}}[kind]
    layers = {"num_layers": model.num_layers, "num_kv_heads": SPEC.num_kv_heads, "head_dim": SPEC.head_dim,
              "dtype": "float32"} | ({"swa_layers": len(model.swa_layers)} if kind == "swa" else {})
    return {"replica": name, "page_size": PS, "l1_pages": l1_pages, "l2_slots": 128, "detached": False,
            "model": layers, "components": components,
            "workers": {"num_hosts": num_hosts, "devices_per_host": 4 // num_hosts}}


def serve_hybrid_chat(name: str, kind: str, conversations: int = 2, turns: int = 4) -> dict:
    """The Ray drivers' multi-turn chat (``hicache.testing.drivers``) on replica ``name``: every output and its
    logits equal the no-cache run's on the same mesh; L1 and L2 hits; nothing held after, and evicting all
    returns every pool (Full L1, the component's L1) to free."""
    from hicache.testing.drivers import ServedReplica, chat_workload

    served = ServedReplica(name, 120.0, None, 300.0, model=hybrid_model(kind), page=PS)  # per call: a loaded CI box
    assert (served.engine.swa_tables, served.engine.recurrent) == (kind == "swa", kind == "mamba")
    assert served.engine.mesh_shape == (4,)
    work = chat_workload(served, conversations, turns, seed=5)
    l1 = l2 = 0
    hits = {}
    for i in [c * turns + t for t in range(turns) for c in range(conversations)]:  # turn-major
        prompt, ref = work[i]
        res = served.serve(prompt)
        assert res.output == ref.tokens, (kind, i)
        np.testing.assert_array_equal(res.logits, ref.logits)
        assert_tokens_accounted(res)
        hits[i] = res.device_hit_tokens + res.loaded_tokens
        l1 += res.device_hit_tokens
        l2 += res.loaded_tokens - res.storage_tokens
        served.client.flush_write_through_acks()  # what L2 holds does not depend on this box's speed
    if kind == "mamba" and turns == 4:  # the third answers crossed page end 40 (key 41; their prompts' cut: 36):
        # their decode's track slot cached that state on every host, and the last turns hit it
        assert [hits[c * turns + 3] for c in range(conversations)] == [40] * conversations, hits
    c = served.client
    st, comp = c.stats(), c.cache_stats()[kind]
    assert st.request_pages == 0 and st.protected_tokens == 0
    assert comp["request_pages" if kind == "swa" else "request_slots"] == 0
    c.evict(10_000)
    st, comp = c.stats(), c.cache_stats()[kind]
    assert st.free_pages == 16 and st.evictable_tokens == 0
    if kind == "swa":
        assert comp["free_pages"] == comp["capacity_pages"] == 16
        assert 0 < comp["host_tokens"] <= comp["host_capacity_tokens"] == 64 * PS
    else:
        assert comp["free_slots"] == comp["capacity_slots"] == 8
        assert 0 < comp["host_states"] <= comp["host_capacity_states"] == 24
    return {"l1": l1, "l2": l2}


@pytest.mark.parametrize("kind, num_hosts", [
    ("mamba", 2), ("swa", 2), pytest.param("mamba", 1, marks=pytest.mark.slow), pytest.param("swa", 1, marks=pytest.mark.slow)])
def test_hybrid_multi_turn_on_a_ray_replica_equals_no_cache(replica_x, kind, num_hosts):
    """A hybrid model served through a Ray replica (beside x): every host worker keeps the component's pools
    (sharded on KV heads like L1, with their L2), the plans carry the component's L1<->L2 copies to every host,
    the engine reads its SWA pages / recurrent states from them. Multi-turn chats under L1 pressure are exact,
    with L1 and L2 hits."""
    from hicache.reference.engine import ForwardConfig
    from hicache.reference.ray_engine import RayEngine

    name, fwd = f"hyb-{kind}-{num_hosts}", ForwardConfig(chunk_size=16, page_size=PS, max_pages=24)
    handle = hicache.start_replica(hybrid_replica(name, kind, num_hosts))  # noqa: F841  # lives with its handle
    try:
        assert worker_handles(name)[2] == ([(0, 2), (2, 4)] if num_hosts == 2 else [(0, 4)])  # KV heads per host
        hits = serve_hybrid_chat(name, kind)
        assert hits["l1"] > 0 and hits["l2"] > 0, hits
        # a model the replica's components or pool layouts do not fit: refused before anything is attached
        other = hybrid_model("mamba" if kind == "swa" else "swa")
        with pytest.raises(ValueError, match=rf"replica '{name}': .*component"):
            RayEngine(name, other, fwd)
        if kind == "swa":  # the window fits, but one local layer where the workers keep two
            with pytest.raises(ValueError, match=r"the workers' swa pool layout .* is not the model's"):
                RayEngine(name, dataclasses.replace(hybrid_model(kind), sliding_window_layers=(0,)), fwd)
        else:  # a state of another width than the component's
            with pytest.raises(ValueError, match=r"state_shapes=\(\(1, 64\),\)"):
                RayEngine(name, dataclasses.replace(hybrid_model(kind), hidden=64), fwd)
    finally:
        stop_replica(name)


@pytest.mark.slow  # (two hybrid replicas start and compile one after the other: about a minute here)
@pytest.mark.parametrize("kind", ["mamba", "swa"])
def test_a_second_hybrid_replica_serves_from_the_l3_the_first_filled(replica_x, kind, tmp_path):
    """L3 per component pool on the Ray path: a hybrid replica's hosts store their shards of the Full pages and of
    the component values (SWA pages / recurrent states) as objects of each pool; a second replica (new head, new
    workers: nothing in L1 or L2) serves the same chat from them, exact, with L3 hits whose values it fetched."""
    from hicache.testing.drivers import ServedReplica, chat_workload

    work = None
    for n, name in enumerate((f"l3a-{kind}", f"l3b-{kind}")):
        handle = hicache.start_replica(hybrid_replica(name, kind, 2))  # noqa: F841  # lives with its handle
        try:
            served = ServedReplica(name, 120.0, f"file://{tmp_path}", 300.0, model=hybrid_model(kind), page=PS,
                                   wait_for_l3=True)
            work = work or chat_workload(served, 2, 3, seed=7)
            fetched = 0
            for prompt, ref in work[::-1] if n else work:  # (the second: the longest turns first, from L3)
                res = served.serve(prompt)
                assert res.output == ref.tokens
                np.testing.assert_array_equal(res.logits, ref.logits)
                fetched += res.storage_tokens
                served.client.flush_write_through_acks()
            values = served.client.cache_stats()["storage"]["component_values"]
            if n:
                assert fetched > 0 and values["values_fetched"] > 0, values
            else:
                assert values["values_stored"] > 0, values
        finally:
            stop_replica(name)


def test_hybrid_replica_config_names_missing_or_foreign_component_pools():
    """A hybrid head's workers need each component's pool layout; a layout for a pool the head does not keep,
    or a state pool paged like KV, is refused too: one ValueError at start, naming it."""
    from hicache.reference.stack import component_specs

    for kind in ("swa", "mamba"):
        assert hybrid_replica("ok", kind, 2).workers.component_specs == component_specs(hybrid_model(kind), PS)
        cfg = hybrid_replica("bad", kind, 2)
        with pytest.raises(ValueError, match=rf"need a pool layout \(component_specs\['{kind}'\]"):
            dataclasses.replace(cfg, workers=dataclasses.replace(cfg.workers, component_specs={}))
        with pytest.raises(ValueError, match=rf"component_specs \['{kind}'\] name pools the head keeps no host tier"):
            ReplicaConfig(HeadConfig("bad", cfg.head.tree, cfg.head.hicache), cfg.workers)
    from hicache.replica_file import replica_config

    raw = hybrid_replica_file("bad", "mamba", 2)
    for shapes in ([[1, 32], [2]], [[1, 12]]):  # not one [layers, hidden] state; hidden not split over 2 x 4 heads
        raw["components"]["mamba"]["state_shapes"] = shapes
        with pytest.raises(ValueError, match=r"config: components.mamba.state_shapes .* workers keep one state shape"):
            replica_config(raw)
    raw = hybrid_replica_file("bad", "swa", 2)
    del raw["model"]["swa_layers"]
    with pytest.raises(ValueError, match=r"config: the swa component has a host tier: .*component_specs\['swa'\]"):
        replica_config(raw)
    specs = component_specs(hybrid_model("mamba"), PS)
    with pytest.raises(ValueError, match=r"component_specs\['mamba'\] must be a KVCacheSpec with page_size 1"):
        WorkerGroupOptions.fake_cpu_hosts(SPEC, 2, component_specs={"mamba": dataclasses.replace(specs["mamba"], page_size=PS)})


def test_the_test_hooks_are_refused_unless_the_replica_enables_them(replica_x):
    with pytest.raises(RuntimeError, match="test_hooks"):
        ray.get(get_head(replica_x).hold_control_for_test.remote(1.0), timeout=30)


def test_client_timeout_is_a_hicache_error_not_a_hang(cluster):
    handle = hicache.start_replica(  # noqa: F841  # (kept: the head lives as long as its handle)
        ReplicaConfig(HeadConfig("z", TreeConfig(PS, 64)), detached=False, test_hooks=True))
    try:
        fast = hicache.connect("z", timeout_s=0.05, step_channel=False)  # Ray calls (the channel: below)
        _steps_behind_a_held_head_time_out(fast, get_head("z"))
        assert fast._transport.ray_steps == 3
        assert hicache.connect("z", timeout_s=30).stats().num_nodes == 0
    finally:
        stop_replica("z")
    with pytest.raises(HiCacheUnavailableError):
        hicache.connect("nope")


def test_a_client_whose_key_history_the_head_dropped_resyncs(cluster):
    """17 schedulers on one head: the first one's key history leaves the head (16 sessions kept); its
    next prompt, sent as a reference to its previous one, is refused once and resent whole."""
    from hicache.cluster.key_history import MAX_SESSIONS

    handle = hicache.start_replica(ReplicaConfig(HeadConfig("w", TreeConfig(PS, 64)), detached=False))
    try:
        first = hicache.connect("w")
        a = seq(0, 64)
        m = first.match_prefix(RadixKey(a))
        first.inc_lock_ref(m.last_device_node)
        first.cache_finished_req(RequestState(RadixKey(a), first.alloc(64), 0, m.last_device_node))
        session = first._transport._sent.session
        for _ in range(MAX_SESSIONS):
            hicache.connect("w").stats()
        assert first.match_prefix(RadixKey(np.r_[a, 1, 2, 3])).device_hit_len == 64
        assert first._transport._sent.session != session  # it started over
        assert first.match_prefix(RadixKey(np.r_[a, 1, 2, 3, 4])).device_hit_len == 64
    finally:
        stop_replica("w")
        del handle


def test_steps_in_flight_run_in_submission_order_and_refused_ones_are_resent_in_order(cluster):
    """Steps submitted without waiting (4 in flight) give exactly the results of the same steps run one by
    one on an embedded head: each inserts a key and matches the next, so a step run out of order would
    show in the hits. Before them the head dropped this client's key history (17 clients, 16 sessions
    kept): every step in flight is refused, nothing runs, and all are sent again, in order."""
    from hicache.cluster.key_history import MAX_SESSIONS

    config = HeadConfig("p", TreeConfig(PS, 64))
    handle = hicache.start_replica(ReplicaConfig(config, detached=False))
    try:
        client = hicache.connect("p", max_in_flight=4)
        local = embedded(config)
        first = [Call(Method.ALLOC, 8 * 16)]
        pages = client.step(first)[0].unwrap()
        np.testing.assert_array_equal(pages, local.step(first)[0].unwrap())
        session = client._transport._sent.session
        for _ in range(MAX_SESSIONS):
            hicache.connect("p").stats()
        keys = [RadixKey(seq(500, 16 * (i + 1))) for i in range(8)]
        steps = [[Call(Method.INSERT, InsertParams(keys[i], pages[: 4 * (i + 1)])), Call(Method.MATCH_PREFIX, keys[i + 1]),
                  Call(Method.INC_LOCK_REF, ResultRef(1, "last_device_node")), Call(Method.STATS)] for i in range(7)]
        pending = [client.submit_step(calls) for calls in steps]
        assert 0 < len(client._transport._in_flight) <= 4  # the oldest were taken to keep at most 4 in flight
        for got, calls in zip([p.result() for p in pending], steps):
            want = local.step(calls)
            assert got[0].unwrap().prefix_len == want[0].unwrap().prefix_len
            m, w = got[1].unwrap(), want[1].unwrap()
            assert (m.device_hit_len, m.last_device_node) == (w.device_hit_len, w.last_device_node)
            np.testing.assert_array_equal(m.device_pages, w.device_pages)
            assert got[2].unwrap() == want[2].unwrap() and got[3].unwrap() == want[3].unwrap()
        assert client._transport._sent.session != session  # refused once, then a new session
        assert client.stats() == local.stats() and local.stats().cached_tokens == 7 * 16
    finally:
        stop_replica("p")
        del handle


def _workload():
    spec = MultiTurnSpec(conversations=6, turns=4, system_prompts=2, system_tokens=(16, 32), user_tokens=(4, 12),
                         output_tokens=(4, 12), vocab_size=1000, seed=3)
    return [t for rnd in multi_turn(spec) for t in rnd]


def test_kill_a_worker_mid_workload_then_it_rejoins_with_l3_attached(replica_x, tmp_path):
    env = RayEnv("x")
    head = get_head("x")
    env.client.attach_storage_backend(l3_params(tmp_path))
    a = seq(7000, 24)  # stored to L3 by the first gang, not served again before the rebuild
    env.serve(a)
    env.client.flush_write_through_acks()
    assert env.client.cache_stats()["storage"]["backup_pages"] == 6
    resets = ray.get(head.health.remote()).resets
    turns = _workload()
    old_pids, failures = env.pids(), 0
    for i, turn in enumerate(turns):
        if i == len(turns) // 3:
            ray.kill(env.workers[1])  # host 1 dies with backups in flight
        r, f = env.serve_retrying(turn.prompt)
        failures += f
    h = ray.get(head.health.remote())
    assert failures >= 1 and h.state is HeadState.READY and h.resets == resets + 1 and h.reason == ""
    assert env.pids().isdisjoint(old_pids)  # a whole new gang (one jax.distributed session)
    env.client.flush_write_through_acks()
    st = env.client.cache_stats()
    assert st["host_tokens"] > 0 and st["backed_up_tokens"] > 0  # L2 fills again on the new gang
    assert st["storage"]["backup_pages"] > 0  # the same L3 is attached to the new gang and backs up to it
    # After the rejoin every cached prefix reads back exactly (no page from the dead gang is served).
    for turn in turns[-6:]:
        env.serve(turn.prompt)
    # a's KV, written to L3 by the lost gang, comes back through the new gang's L2 bit for bit.
    assert env.prefetch(a, "after-rebuild") == 24
    assert env.serve(a)["loaded"] == 24  # serve() compares both hosts' shards with a's KV
    env.client.detach_storage_backend()


def test_kill_the_head_it_restarts_without_stale_hits_and_with_its_l3(replica_x, tmp_path):
    """The head actor restarts (constructor state lost): empty tree, L1 and L2, never a stale hit; the L3
    attached at runtime before the kill is attached again (kept in the GCS), so L3 hits resume exactly."""
    env = RayEnv("x")
    params = l3_params(tmp_path)
    env.client.attach_storage_backend(params)
    try:
        _restart_the_head_with_l3(env, params)
    finally:
        env.client.detach_storage_backend()
    assert ray_storage_record.attached("x") == ray_storage_record.Attached(None)  # a detach is kept too


def _restart_the_head_with_l3(env: RayEnv, params: StorageParams) -> None:
    a = seq(5000, 24)
    env.serve(a)
    assert env.serve(a)["device_hit"] == 24
    env.client.flush_write_through_acks()
    assert env.client.cache_stats()["storage"]["backup_pages"] == 6
    assert ray_storage_record.attached("x") == ray_storage_record.Attached(params)
    head = get_head("x")
    ray.kill(head, no_restart=False)
    end, errors = time.monotonic() + 90, set()
    while True:  # the kill is asynchronous: wait until the restarted incarnation answers
        try:
            if ray.get(head.health.remote(), timeout=5).reconstructed:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < end
        time.sleep(0.1)
    while True:
        try:
            m = env.client.match_prefix(RadixKey(a))
            break
        except (HiCacheError, ray.exceptions.RayActorError) as e:
            errors.add(type(e))
            assert time.monotonic() < end, errors
            time.sleep(0.2)
    assert HiCacheReplicaResetError in errors or HiCacheUnavailableError in errors
    assert (m.device_hit_len, m.host_hit_len) == (0, 0)  # empty tree, empty L1/L2: never a stale hit
    h = ray.get(get_head("x").health.remote())
    assert h.reconstructed and h.state is HeadState.READY and h.reason == ""
    st = env.client.cache_stats()
    assert st["storage"]["backup_pages"] == 0 and st["host_tokens"] == 0  # a new state, with the same L3
    env.refresh()
    assert env.prefetch(a, "after-head-restart") == 24  # L3 -> L2 on the new gang
    assert env.serve(a)["loaded"] == 24  # L2 -> L1; serve() compares both hosts' shards with a's KV
    assert env.serve(a)["device_hit"] == 24


def test_two_replicas_share_l3_bit_identical(replica_x, env_x, tmp_path):
    """Replica x computes and stores to L3; replica z (its own head, workers and L1/L2) gets L3 hits
    for x's prefix, loaded through its L2 into its L1, bit-identical on both of its hosts."""
    params = l3_params(tmp_path)
    env_x.client.attach_storage_backend(params)
    a = seq(5000, 24)
    env_x.serve(a)
    env_x.client.flush_write_through_acks()
    assert env_x.client.cache_stats()["storage"]["backup_pages"] == 6
    handle = hicache.start_replica(dataclasses.replace(replica_config("z"), storage=params))  # L3 from the start
    try:
        env_z = RayEnv("z")
        assert env_z.prefetch(a, "z-1") == 24
        r = env_z.serve(a)  # load-back from z's L2; serve() compares both hosts' shards bit for bit
        assert r["loaded"] == 24
        env_z.client.detach_storage_backend()
    finally:
        stop_replica("z")
        del handle
    assert ray_storage_record.attached("z") is None  # stopped: a new "z" starts from its own config
    env_x.client.detach_storage_backend()


def test_engine_in_the_host_workers_is_exact_with_l1_l2_l3_hits(replica_x, env_x, tmp_path):
    """The reference engine runs inside both host workers (SPMD over the head-sharded L1 pool,
    DESIGN.md §1), driven by the scheduler loop through the Ray client: with prefix hits from L1, L2
    and L3 its generated tokens and logits equal, bit for bit, the no-cache run on the same mesh."""
    from hicache.cluster.storage_tier import StorageParams
    from hicache.reference.engine import ForwardConfig, ModelConfig
    from hicache.reference.ray_engine import RayEngine
    from hicache.reference.scheduler import Scheduler
    from hicache.reference.serve_types import ServeRequest

    model = ModelConfig(vocab_size=256, num_layers=SPEC.num_layers, num_q_heads=8, num_kv_heads=SPEC.num_kv_heads,
                        head_dim=SPEC.head_dim, hidden=32, mlp_hidden=64)
    engine = RayEngine("x", model, ForwardConfig(chunk_size=16, page_size=PS, max_pages=16))
    assert engine.mesh_shape == (4,)  # 2 hosts x 2 devices: the forward spans both processes
    c = env_x.client
    l3 = StorageParams(f"file://{tmp_path}/l3", engine.fingerprint(), prefetch_min_tokens=PS, pages_per_object=2,
                       **DETERMINED)
    c.attach_storage_backend(l3)
    sched = Scheduler(c, engine, hicache=True, storage=True, prefill_budget=16)
    rng = np.random.default_rng(8)
    served: list[int] = []
    before = sum(c.cache_stats()["prompt_tokens"].values())

    def served_exactly(prompt: np.ndarray):
        res = sched.serve(ServeRequest(prompt, max_new_tokens=3))
        ref = engine.generate_no_cache(prompt, 3)
        assert res.output == ref.tokens
        np.testing.assert_array_equal(res.last_logits, ref.logits[0])
        assert_tokens_accounted(res)
        served.append(len(prompt))
        return np.concatenate([prompt, np.asarray(res.output, np.int32)]), res

    def turn(history: np.ndarray) -> np.ndarray:
        return np.concatenate([history, rng.integers(0, model.vocab_size, 6, dtype=np.int32)])

    history, cold = served_exactly(rng.integers(0, model.vocab_size, 29, dtype=np.int32))
    assert cold.computed_tokens == 29
    history, r = served_exactly(turn(history))
    assert r.device_hit_tokens >= 24 and r.loaded_tokens == 0  # L1
    c.flush_write_through_acks()
    assert c.evict(10_000).evicted_tokens > 0  # everything unlocked leaves L1; the L2 copies stay
    history, r = served_exactly(turn(history))
    assert r.loaded_tokens >= 32 and r.storage_tokens == 0  # L2 -> L1 load-back on both hosts
    assert r.tokens.hit_l2 == r.loaded_tokens
    assert sum(c.cache_stats()["prompt_tokens"].values()) - before == sum(served)  # each token once, per replica
    c.flush_write_through_acks()  # L2 -> L3 backups land
    assert c.cache_stats()["storage"]["backup_pages"] >= 10
    c.detach_storage_backend()
    c.reset()  # a cold replica: empty tree, L1 and L2; only L3 remembers
    c.attach_storage_backend(l3)
    _, r = served_exactly(turn(history))
    assert r.storage_tokens >= 40 and r.device_hit_tokens == 0  # L3 -> L2 -> L1
    assert r.tokens.hit_l3 == r.storage_tokens
    c.flush_write_through_acks()
    c.detach_storage_backend()


def test_replica_file_l3_section_becomes_the_start_storage(tmp_path):
    """``l3`` in a replica file -> ``ReplicaConfig.storage`` (attached at start and after every restart);
    a bad key or value names itself; L3 needs L2 and a fingerprint of the replica's KV shape."""
    from hicache.replica_file import load_replica_file

    base = ("replica: f\npage_size: 4\nl1_pages: 64\nl2_slots: 128\n"
            "model: {num_layers: 2, num_kv_heads: 4, head_dim: 4, dtype: float32}\n"
            "workers: {platform: cpu, num_hosts: 2, devices_per_host: 2}\n")
    path = tmp_path / "r.yaml"
    path.write_text(base + "l3: {url: 'file:///kv', model_id: m, prefetch_policy: best_effort, pages_per_object: 2,"
                           " storage: {max_bytes: 1000000}}\n")
    st = load_replica_file(path).storage
    assert (st.url, st.prefetch_policy.value, st.pages_per_object, st.storage.max_bytes) == (
        "file:///kv", "best_effort", 2, 1_000_000)
    assert st.fingerprint == ModelFingerprint("m", "float32", 4, 2, 4, 4)
    assert load_replica_file(tmp_path / "r.yaml").storage == st  # a pure function of the file
    for l3, msg in [("{url: 'file:///kv', model_id: m, bogus: 1}", "bogus"),
                    ("{url: 'file:///kv'}", "model_id"),
                    ("{url: kv, model_id: m}", "url"),
                    ("{url: 'file:///kv', model_id: m, storage: {nope: 1}}", "nope")]:
        path.write_text(base + f"l3: {l3}\n")
        with pytest.raises(ValueError, match=msg):
            load_replica_file(path)
    path.write_text(base.replace("l2_slots: 128", "l2_slots: 0") + "l3: {url: 'file:///kv', model_id: m}\n")
    with pytest.raises(ValueError, match="host tier"):
        load_replica_file(path)
    cfg = replica_config("f")
    wrong = StorageParams("file:///kv", ModelFingerprint("m", "float32", PS, SPEC.num_layers, 8, SPEC.head_dim))
    with pytest.raises(ValueError, match="does not match"):
        dataclasses.replace(cfg, storage=wrong)
    with pytest.raises(TypeError, match="StorageParams"):
        dataclasses.replace(cfg, storage="file:///kv")


# -- the step channel (a loopback socket to the head; Ray calls are the fallback) ------------------------------
C_CONFIG = HeadConfig("c", TreeConfig(PS, 1024))  # room for three tenants' workloads (no eviction)


@pytest.fixture(scope="module")
def replica_c(cluster):
    """A control-plane-only replica (no host workers): starts and restarts in a second or two."""
    handle = hicache.start_replica(ReplicaConfig(C_CONFIG, detached=False, test_hooks=True))
    yield "c"
    stop_replica("c")
    del handle


@pytest.fixture
def client_c(replica_c):
    client = hicache.connect(replica_c)
    client.reset()
    return client


def _hold_control(head):
    """Occupies the head's control thread (its state lock held) until ``release_control_for_test``, through
    the head's test-only hook (``ReplicaConfig.test_hooks``): a step in flight for as long as the test
    needs. Returns the hold's ref once it holds."""
    held = head.hold_control_for_test.remote(300.0)
    assert ray.get(head.wait_control_held_for_test.remote(60.0), timeout=90)
    return held


def _steps_behind_a_held_head_time_out(client, head) -> None:
    """Steps behind a long one fail with ``HiCacheTimeoutError`` (no hang), two in flight each alone."""
    held = _hold_control(head)
    with pytest.raises(HiCacheTimeoutError):
        client.stats()
    pending = [client.submit_step([Call(Method.STATS)]) for _ in range(2)]
    for p in pending:
        with pytest.raises(HiCacheTimeoutError):
            p.result()
    ray.get(head.release_control_for_test.remote(), timeout=10)
    assert ray.get(held, timeout=60) is True


def _same(got, want) -> None:
    """Two step results are the same answers: values (arrays bit for bit), or errors of the same type."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.ok == w.ok, (g, w)
        if not g.ok:
            assert type(g.error) is type(w.error)
        elif isinstance(w.value, np.ndarray):
            np.testing.assert_array_equal(g.value, w.value)
        elif dataclasses.is_dataclass(w.value):
            for f in dataclasses.fields(w.value):
                a, b = getattr(g.value, f.name), getattr(w.value, f.name)
                if isinstance(b, np.ndarray):
                    np.testing.assert_array_equal(a, b)
                elif isinstance(b, RadixKey):
                    np.testing.assert_array_equal(a.token_ids, b.token_ids)
                else:
                    assert a == b, (f.name, a, b)
        else:
            assert g.value == w.value


def _chat_steps(client, tenant: str | None = None, hits: list[int] | None = None) -> list[list[Call]]:
    """A multi-turn workload as a scheduler sends it: per batch the previous batch's finishes, then match,
    lock and alloc chained on the matches (``ResultRef``), plus a call that fails. Returns the steps sent;
    ``tenant``: the keys' ``extra_key``; ``hits``: gets each match's device hit length."""
    turns, steps, finish = _workload(), [], []
    for i in range(0, len(turns), 4):
        group = turns[i : i + 4]
        nf = len(finish)
        calls = finish + [Call(Method.MATCH_PREFIX, RadixKey(t.prompt, tenant)) for t in group]
        for j, t in enumerate(group):
            calls += [Call(Method.INC_LOCK_REF, ResultRef(nf + j, "last_device_node")),
                      Call(Method.ALLOC, ResultRef(nf + j, "device_hit_len", -1, len(t.sequence)))]
        calls.append(Call(Method.FREE, [99_999]))
        res = client.step(calls)
        steps.append(calls)
        finish = []
        for j, t in enumerate(group):
            m, own = res[nf + j].unwrap(), res[nf + len(group) + 2 * j + 1].unwrap()
            if hits is not None:
                hits.append(m.device_hit_len)
            finish.append(Call(Method.CACHE_FINISHED_REQ, RequestState(
                RadixKey(t.sequence, tenant), np.concatenate([m.device_pages, own]), m.device_hit_len, m.last_device_node)))
    client.step(finish)
    return steps + [finish]


def test_step_channel_answers_exactly_as_the_embedded_head(client_c):
    transport = client_c._transport
    before = (transport.channel_steps, transport.ray_steps)
    local = embedded(C_CONFIG)
    steps = _chat_steps(client_c)
    assert (transport.channel_steps - before[0], transport.ray_steps - before[1]) == (len(steps), 0)
    client_c.reset()
    for calls in steps:  # the same steps again, on both: every answer the same
        _same(client_c.step(calls), local.step(calls))
    _same(client_c.step([Call(Method.STATS)]), local.step([Call(Method.STATS)]))
    assert transport._channel is not None and transport._channel.address.node_id == ray.get_runtime_context().get_node_id()
    ray_only = hicache.connect("c", step_channel=False)
    ray_only.reset()
    local.reset()
    for calls in steps:
        _same(ray_only.step(calls), local.step(calls))
    assert ray_only._transport.channel_steps == 0 and ray_only._transport._channel is None


def test_two_clients_bounded_key_histories_over_the_step_channel_answer_as_embedded(cluster):
    """Two schedulers on one head send the same chat workload, step for step interleaved, over the step
    channel, each with a key history of 96 tokens (entries leave while later keys would extend them): every
    answer equals an embedded head's that got the same steps in the same order (a reference resolved against
    the other client's history, or against an entry one side dropped, would show as another key), and both
    sides keep each history within its bound."""
    from hicache.cluster.ray_client import RayTransport

    cap = 400
    config = HeadConfig("kh", TreeConfig(PS, 1024))
    handle = hicache.start_replica(ReplicaConfig(config, detached=False))
    try:
        head = get_head("kh")
        transports = [RayTransport(head, "kh", history_tokens=cap) for _ in range(2)]
        clients = [hicache.CacheClient(t, PS) for t in transports]
        local = embedded(config)
        turns, finishes, steps = _workload(), [[], []], 0
        for i in range(0, len(turns), 4):
            group = turns[i : i + 4]
            for c, client in enumerate(clients):
                nf = len(finishes[c])
                calls = finishes[c] + [Call(Method.MATCH_PREFIX, RadixKey(t.prompt)) for t in group]
                for j, t in enumerate(group):
                    calls += [Call(Method.INC_LOCK_REF, ResultRef(nf + j, "last_device_node")),
                              Call(Method.ALLOC, ResultRef(nf + j, "device_hit_len", -1, len(t.sequence)))]
                want = local.step(calls)
                _same(client.step(calls), want)
                finishes[c] = [Call(Method.CACHE_FINISHED_REQ, RequestState(
                    RadixKey(t.sequence), np.concatenate([want[nf + j].value.device_pages,
                                                          want[nf + len(group) + 2 * j + 1].value]),
                    want[nf + j].value.device_hit_len, want[nf + j].value.last_device_node)) for j, t in enumerate(group)]
            steps += 1
        for c, client in enumerate(clients):
            _same(client.step(finishes[c]), local.step(finishes[c]))
        assert local.stats().matched_tokens > 0
        for t in transports:
            assert (t.channel_steps, t.ray_steps) == (steps + 1, 0)
            assert 0 < t._sent.tokens <= cap and t._sent._next > len(t._sent._entries)  # entries left
        sessions = [t._sent.session for t in transports]
        assert sessions[0] != sessions[1]
        kept = ray.get(head.__ray_call__.remote(
            lambda a, ids: [(a._histories._sessions[s].steps, a._histories._sessions[s].tokens) for s in ids], sessions))
        assert kept == [(t._sent.steps, t._sent.tokens) for t in transports]
    finally:
        stop_replica("kh")
        del handle


def test_steps_of_two_channels_and_ray_calls_never_run_at_once(replica_c, client_c):
    """Three schedulers at the same time (two over their own channels, one as Ray calls), each in its own
    namespace: each gets exactly the hits it gets alone (one step at a time in the head), and the tree
    holds all three."""
    import threading

    alone = embedded(C_CONFIG)
    want: list[int] = []
    for _ in range(2):
        _chat_steps(alone, "t0", want)
    clients = [client_c, hicache.connect(replica_c), hicache.connect(replica_c, step_channel=False)]
    hits: list[list[int]] = [[] for _ in clients]
    failures: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for _ in range(2):
                _chat_steps(clients[i], f"t{i}", hits[i])
        except BaseException as e:  # reported below
            failures.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures and not any(t.is_alive() for t in threads)
    assert hits == [want] * 3 and sum(want[len(want) // 2 :]) > 0
    assert client_c.stats().cached_tokens == 3 * alone.stats().cached_tokens
    assert [c._transport.channel_steps > 0 for c in clients] == [True, True, False]


def test_step_channel_timeout_is_a_hicache_error_and_the_late_replies_are_dropped(client_c):
    transport = client_c._transport
    client_c.stats()
    channel = transport._channel
    assert channel is not None
    transport.timeout_s = 0.05
    _steps_behind_a_held_head_time_out(client_c, get_head("c"))
    transport.timeout_s = 30.0
    pages = client_c.alloc(8)  # the three stats replies came late: read and dropped, not taken for this one
    assert isinstance(pages, np.ndarray) and pages.size == 2
    assert transport._channel is channel and channel.in_flight == 0


def test_a_dead_step_channel_fails_its_steps_then_ray_calls_carry_them(replica_c):
    client_c = hicache.connect(replica_c, channel_retry_s=0.0)  # asks the head for a channel at every step
    client_c.reset()
    head, transport = get_head("c"), client_c._transport
    client_c.stats()
    assert transport._channel is not None
    held = _hold_control(head)  # held until the channel is closed
    waiting = client_c.submit_step([Call(Method.STATS)])  # on the channel, behind the held step
    ray.get(head.set_step_channel.remote(False), timeout=10)  # closes the channel and its connections
    with pytest.raises(HiCacheUnavailableError, match="step channel lost"):
        waiting.result()
    ray.get(head.release_control_for_test.remote(), timeout=10)
    assert ray.get(held, timeout=60) is True
    rays = transport.ray_steps
    a = seq(100, 16)
    m = client_c.match_prefix(RadixKey(a))  # as a Ray call: the head has no channel now
    client_c.inc_lock_ref(m.last_device_node)
    client_c.cache_finished_req(RequestState(RadixKey(a), client_c.alloc(16), 0, m.last_device_node))
    assert client_c.match_prefix(RadixKey(a)).device_hit_len == 16
    assert transport.ray_steps - rays == 5 and transport._channel is None
    ray.get(head.set_step_channel.remote(True), timeout=10)
    elsewhere = hicache.connect("c")
    elsewhere._transport._node_id = "another-node"  # a scheduler on another node cannot reach 127.0.0.1 here
    assert elsewhere.match_prefix(RadixKey(a)).device_hit_len == 16
    assert (elsewhere._transport.channel_steps, elsewhere._transport.ray_steps) == (0, 1)
    channel_steps = transport.channel_steps
    assert client_c.match_prefix(RadixKey(a)).device_hit_len == 16
    assert transport.channel_steps == channel_steps + 1 and transport._channel is not None


def test_transport_options_are_checked_before_anything_is_sent():
    from hicache.cluster.ray_client import RayTransport

    for bad in (dict(timeout_s=0), dict(max_in_flight=0), dict(channel_retry_s=-1.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RayTransport(None, "nowhere", **bad)


def test_head_restart_the_client_reconnects_its_step_channel(replica_c):
    client = hicache.connect(replica_c)
    transport = client._transport
    a = seq(200, 16)
    m = client.match_prefix(RadixKey(a))
    client.inc_lock_ref(m.last_device_node)
    client.cache_finished_req(RequestState(RadixKey(a), client.alloc(16), 0, m.last_device_node))
    old = transport._channel.address
    head = get_head(replica_c)
    _hold_control(head)  # never released: the head is killed while it holds
    waiting = client.submit_step([Call(Method.STATS)])  # on the channel, behind the held step
    ray.kill(head, no_restart=False)
    with pytest.raises(HiCacheUnavailableError):  # its channel died with the head: an error, not a hang
        waiting.result()
    end, errors = time.monotonic() + 60, set()
    while True:
        try:
            steps = transport.channel_steps
            m = client.match_prefix(RadixKey(a))
            if transport.channel_steps > steps:  # answered through a channel of the restarted head
                break
        except HiCacheError as e:
            errors.add(type(e))
        assert time.monotonic() < end, errors
        time.sleep(0.2)
    assert HiCacheReplicaResetError in errors  # the old epoch was refused once
    assert m.device_hit_len == 0  # a fresh tree: never a stale hit
    assert ray.get(head.health.remote(), timeout=10).reconstructed
    assert transport._channel.address != old


# -- topology-free L3 reads: replicas of another host count share L3 (storage.shard_cover) ---------------------
@pytest.fixture(scope="module")
def notice_file(tmp_path_factory):
    return tmp_path_factory.mktemp("notice") / "preempted"


@pytest.fixture(scope="module")
def replica_one(cluster, notice_file):
    """One host with 4 fake devices: the same global mesh as x's 2 hosts x 2 devices (so the same
    engine fingerprint), but one shard (KV heads 0-3) where x has two (0-1, 2-3). Its head watches
    ``notice_file`` for a preemption notice."""
    from hicache.cluster.drain import PreemptionConfig

    cfg = replica_config("one")
    handle = hicache.start_replica(dataclasses.replace(
        cfg, workers=WorkerGroupOptions.fake_cpu_hosts(SPEC, num_hosts=1, devices_per_host=4),
        preemption=PreemptionConfig("file", str(notice_file), poll_s=0.05)))
    yield "one"
    stop_replica("one")
    del handle


def _cold(env: RayEnv, params: StorageParams) -> None:
    """Empty tree, L1 and L2; L3 attached anew (its storage clients list the stored layouts)."""
    env.client.flush_write_through_acks()
    env.client.detach_storage_backend()
    env.client.reset()
    env.client.attach_storage_backend(params)


def test_l3_of_two_hosts_is_read_by_one_host_and_back_bit_for_bit(replica_x, env_x, replica_one, tmp_path):
    """Pages x's two hosts stored (one object per host and chunk) are assembled by the one host of
    "one" (and the reverse), prefetched into L2, loaded into L1 and read back bit for bit."""
    params = l3_params(tmp_path)
    env_1 = RayEnv(replica_one)
    assert env_1.ranges == [(0, 4)] and env_x.ranges == [(0, 2), (2, 4)]
    _cold(env_x, params)
    _cold(env_1, params)
    a, b = seq(7000, 24), seq(8000, 24)
    env_x.serve(a)
    env_1.serve(b)
    for env in (env_x, env_1):
        env.client.flush_write_through_acks()
        assert env.client.cache_stats()["storage"]["backup_pages"] == 6
    _cold(env_x, params)
    _cold(env_1, params)
    assert env_1.prefetch(a, "one-a") == 24  # from x's two shards
    assert env_1.serve(a)["loaded"] == 24  # serve() compares L1 with a's KV, bit for bit
    assert env_x.prefetch(b, "x-b") == 24  # each of x's hosts reads its heads of one's shard
    assert env_x.serve(b)["loaded"] == 24
    for env in (env_x, env_1):
        env.client.detach_storage_backend()


def test_engines_of_another_host_count_are_exact_with_each_others_l3_hits(replica_x, env_x, replica_one, tmp_path):
    """The reference engine on x (2 hosts x 2 devices) and on "one" (1 host x 4 devices): the same
    fingerprint, other shards. Each serves the other's next turn from L3 with outputs and logits
    bit-identical to its own no-cache run."""
    from hicache.reference.engine import ForwardConfig, ModelConfig
    from hicache.reference.ray_engine import RayEngine
    from hicache.reference.scheduler import Scheduler
    from hicache.reference.serve_types import ServeRequest

    model = ModelConfig(vocab_size=256, num_layers=SPEC.num_layers, num_q_heads=8, num_kv_heads=SPEC.num_kv_heads,
                        head_dim=SPEC.head_dim, hidden=32, mlp_hidden=64)
    fwd = ForwardConfig(chunk_size=16, page_size=PS, max_pages=16)
    engines = {name: RayEngine(name, model, fwd) for name in ("x", replica_one)}
    assert engines["x"].fingerprint() == engines[replica_one].fingerprint()
    l3 = StorageParams(f"file://{tmp_path}/l3", engines["x"].fingerprint(), prefetch_min_tokens=PS, pages_per_object=2,
                       **DETERMINED)
    clients = {"x": env_x.client, replica_one: RayEnv(replica_one).client}
    for c in clients.values():
        c.flush_write_through_acks()
        c.reset()
        c.attach_storage_backend(l3)
    rng = np.random.default_rng(29)
    history = rng.integers(0, model.vocab_size, 21, dtype=np.int32)
    for writer, reader in (("x", replica_one), (replica_one, "x")):
        results, lengths = [], []
        for name in (writer, reader):  # each starts cold: only L3 remembers the turns before
            clients[name].detach_storage_backend()
            clients[name].reset()
            clients[name].attach_storage_backend(l3)
            sched = Scheduler(clients[name], engines[name], hicache=True, storage=True, prefill_budget=16)
            prompt = np.concatenate([history, rng.integers(0, model.vocab_size, 6, dtype=np.int32)])
            res = sched.serve(ServeRequest(prompt, max_new_tokens=3))
            ref = engines[name].generate_no_cache(prompt, 3)
            assert res.output == ref.tokens
            np.testing.assert_array_equal(res.last_logits, ref.logits[0])
            clients[name].flush_write_through_acks()
            results.append(res)
            lengths.append(len(prompt))
            history = np.concatenate([prompt, np.asarray(res.output, np.int32)])
            clients[name].detach_storage_backend()  # flushes its manifest (the next warm restart lists this turn)
            clients[name].attach_storage_backend(l3)
        assert results[1].storage_tokens >= lengths[0] // PS * PS  # the writer's whole turn, from L3
    for c in clients.values():
        c.detach_storage_backend()


def test_a_two_host_replica_drains_through_the_ray_client(replica_x, env_x, tmp_path):
    """A notice to a Ray replica: its head stores what L3 lacks (both hosts' shards), reports it, and a
    cold start of the same replica prefetches it all."""
    from hicache.cluster.drain import DrainParams

    params = l3_params(tmp_path)
    a = seq(9000, 24)
    env_x.serve(a)
    env_x.client.flush_write_through_acks()
    env_x.client.attach_storage_backend(params)  # L3 holds none of it yet
    prog = env_x.client.drain(DrainParams(30.0))
    assert prog.candidate_pages == 6 and prog.drained_pages >= 6 and prog.not_fitted_pages == 0
    assert env_x.client.cache_stats()["drain"]["state"] == "done"
    _cold(env_x, params)  # (a reset admits requests again)
    assert "drain" not in env_x.client.cache_stats()
    assert env_x.prefetch(a, "x-drained") == 24
    assert env_x.serve(a)["loaded"] == 24
    env_x.client.detach_storage_backend()


def test_a_notice_file_makes_the_replica_head_drain_by_itself(replica_one, notice_file, tmp_path):
    """``ReplicaConfig.preemption``: the head's watcher sees the notice and drains its state; a client
    sees the drain in ``cache_stats``; a cold start of the replica prefetches what was drained."""
    params = l3_params(tmp_path)
    env_1 = RayEnv(replica_one)
    env_1.client.flush_write_through_acks()
    env_1.client.detach_storage_backend()
    env_1.client.reset()
    a = seq(9500, 24)
    env_1.serve(a)
    env_1.client.flush_write_through_acks()
    env_1.client.attach_storage_backend(params)
    notice_file.write_text("20")
    end = time.monotonic() + 60.0
    while (drain := env_1.client.cache_stats().get("drain", {})).get("state") != "done":
        assert time.monotonic() < end, drain
        time.sleep(0.1)
    assert drain["deadline_s"] == 20.0 and drain["drained_pages"] >= 6 and drain["not_fitted_pages"] == 0
    _cold(env_1, params)
    assert env_1.prefetch(a, "one-drained") == 24
    env_1.client.detach_storage_backend()
