"""The multi-replica Serve app on a loopback Ray cluster (one per module): requests reach the replica the
hicache router picks, heads that do not answer in time leave a load-only choice, a dead replica is
routed around (last: it kills one); every output equals the no-cache run."""

from __future__ import annotations

import pickle
import time

import numpy as np
import pytest
import ray
from ray import serve

from hicache.cluster.step_channel import StepChannel
from hicache.reference.engine.config import ForwardConfig, ModelConfig
from hicache.reference.engine.runner import ModelRunner
from hicache.routing.probes import HoldProbes
from hicache.routing.serve_app import deployment
from hicache.routing.serve_router import GenerateRequest, probe_address, routers_in_this_process

REPLICAS = 2
MAX_PAGES = 16
WAIT_S = 120.0  # bound on the waits for Serve's own background updates (routing stats, a death)


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {WAIT_S}s")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    l3 = tmp_path_factory.mktemp("l3")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="hicache-route")
    serve.start(proxy_location="Disabled")
    dep = deployment(num_replicas=REPLICAS, probe_timeout_s=2.0, routing_stats_period_s=0.2)
    options = {"l3_url": f"file://{l3}", "l1_pages": 48, "l2_slots": 64, "max_pages": MAX_PAGES, "test_hooks": True}
    handle = serve.run(dep.bind(options), name="hicache-route", route_prefix=None)
    runner = ModelRunner(ModelConfig(), ForwardConfig(chunk_size=16, page_size=8, max_pages=MAX_PAGES), num_pages=MAX_PAGES)
    try:
        yield dep, options, handle, runner
    finally:
        serve.shutdown()
        ray.shutdown()


def _router():
    routers = routers_in_this_process()
    assert len(routers) == 1, routers
    return routers[0]


def _ask(handle, runner, prompt, n=2):
    out = handle.remote(GenerateRequest(tuple(int(t) for t in prompt), n)).result(timeout_s=WAIT_S)
    assert out["output"] == list(runner.generate_no_cache(np.asarray(prompt, np.int32), n).tokens)
    assert sum(out["tokens"].values()) == len(prompt)  # every prompt token once: hit tier or miss reason
    return out, _router().decisions[-1]


def test_requests_reach_the_replica_the_router_picks(app):
    _, _, handle, runner = app
    rng = np.random.default_rng(0)
    _ask(handle, runner, rng.integers(0, 512, 9))  # creates the router in this process
    # Serve pushes each replica's probe address with its routing stats.
    _wait_for(lambda: _ask(handle, runner, rng.integers(0, 512, 9))[1].answered == REPLICAS, "probe answers")
    docs = [rng.integers(0, 512, 64) for _ in range(REPLICAS)]
    home = {}
    for d, doc in enumerate(docs):
        out, dec = _ask(handle, runner, np.concatenate([doc, rng.integers(0, 512, 5)]))
        assert dec.chosen == out["replica"] and not dec.fallback
        home[d] = out["replica"]
    for d, doc in enumerate(docs):
        out, dec = _ask(handle, runner, np.concatenate([doc, rng.integers(0, 512, 7)]))
        assert dec.chosen == out["replica"] == home[d] and dec.answered == REPLICAS
        assert out["device_hit_tokens"] >= 64  # its L1 copy
    # Serve pickles the router's module by value on every deploy: a live router in this process must not
    # put anything unpicklable there.
    assert deployment(num_replicas=1)._deployment_config.request_router_config.get_request_router_class()


def _hold_probes(hold: bool) -> None:
    """Every replica's probe server holds (or releases) its answers (``HoldProbes``, a test hook)."""
    for r in _router().curr_replicas.values():
        ch = StepChannel(probe_address(r.routing_stats), 30.0)
        try:
            assert pickle.loads(ch.recv(ch.send(pickle.dumps(HoldProbes(hold))), 30.0)) == HoldProbes(hold)
        finally:
            ch.close()


def test_heads_that_do_not_answer_in_time_leave_a_load_only_choice(app):
    _, _, handle, runner = app
    rng = np.random.default_rng(1)
    before = _router().stats.fallbacks
    _hold_probes(True)
    try:
        for _ in range(2):
            out, dec = _ask(handle, runner, rng.integers(0, 512, 40))
            assert dec.fallback and dec.answered == 0 and dec.chosen == out["replica"]
        assert _router().stats.fallbacks == before + 2
    finally:
        _hold_probes(False)
    out, dec = _ask(handle, runner, rng.integers(0, 512, 40))  # answered again
    assert not dec.fallback and dec.answered == REPLICAS


def test_a_dead_replica_is_routed_around(app):
    _, _, handle, runner = app
    rng = np.random.default_rng(2)
    doc = rng.integers(0, 512, 64)
    first, _ = _ask(handle, runner, np.concatenate([doc, rng.integers(0, 512, 5)]))
    victim = first["replica"]
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith(f"#{victim}")]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    # The replica that holds doc's prefix in L1 is gone: served elsewhere, exact. (Right after the kill its
    # probe may still answer; Serve then takes the router's next rank.)
    out, _ = _ask(handle, runner, np.concatenate([doc, rng.integers(0, 512, 5)]))
    assert out["replica"] != victim
    _wait_for(lambda: all(r.replica_id.unique_id != victim for r in _router().curr_replicas.values()),
              "removal of the dead replica")
    for _ in range(2):
        out, dec = _ask(handle, runner, np.concatenate([doc, rng.integers(0, 512, 5)]))
        assert out["replica"] != victim and dec.chosen == out["replica"] and not dec.fallback
