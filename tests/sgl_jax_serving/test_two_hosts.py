"""sgl-jax on 2 hosts (nnodes=2, one scheduler process per host, gloo on CPU) with one hicache head.

Rank 0 holds the head; rank 1 holds no head and no tree and applies rank 0's decisions and transfer plans
(``hicache.sgl_jax.ranks``, ``hicache.sgl_jax.rank_workers``): each rank moves its own shard of L2 and L3.
Asserted: greedy outputs token for token equal to sgl-jax without a cache, hits > 0 (L1; L2 and L3 with the
host tiers), and both ranks applied the same decisions and plans (``decision_log``: the same sequence with the
same digests; rank 1's log says it is a follower with no head). The L1+L2+L3 Engine test is one 2-host start
(its reference is the session's one-host run); the slow one compares against stock sgl-jax on 2 hosts. Two
fast tests check the channel without sgl-jax: decisions, divergence, and both ranks' workers under one head.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.sgl_jax_env import HOST_PAGES, SAMPLING, rounds, running
from support.sgl_jax_hosts import free_port_range, host_kwargs, other_ranks

from hicache.cluster import CacheClient, CacheHead, EmbeddedTransport
from hicache.cluster.tree import InsertParams, RadixKey
from hicache.sgl_jax import HiCacheOptions
from hicache.sgl_jax.ranks import (
    FollowerChannel,
    FollowerTransport,
    LeaderChannel,
    LeaderTransport,
    RankDivergedError,
    decision_address,
)

ROUNDS = 3  # the shared-prefix rounds: L1 hits on both hosts
L3_PAGES_PER_OBJECT = 8  # as test_tiers: a 40-token prefix ends on an object boundary
# Sent after the workload: its forward runs on both ranks, so rank 1 has finished every workload request (and
# logged each decision) before it, whatever the timing (the decision logs are compared up to there).
SYNC_PROMPT = [3]


def decisions(log: Path) -> tuple[str, list[str]]:
    header, *lines = log.read_text().splitlines()
    return header, lines


def generate(engine: Any, workload: list[list[list[int]]]) -> tuple[list[list[int]], int]:
    outputs, cached = [], 0
    for prompts in workload:
        for out in engine.generate(input_ids=prompts, sampling_params=SAMPLING):
            outputs.append(out["output_ids"])
            cached += out["meta_info"]["cached_tokens"]
    return outputs, cached


def serve_two_hosts(model: Path, mode: str, workload: list[list[list[int]]], hicache: dict[str, Any] | None = None,
                    **overrides: Any) -> dict[str, Any]:
    """``workload`` on sgl-jax over 2 hosts (``mode``: "sgl-jax", or "hicache" with ``HiCacheOptions(**hicache)``
    on both ranks): the outputs, sgl-jax's cached tokens, and with hicache the head's stats and hits by tier."""
    from sgl_jax.srt.entrypoints.engine import Engine as SglEngine

    from hicache.sgl_jax import Engine

    dist = f"127.0.0.1:{free_port_range()}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAX_CPU_COLLECTIVES_IMPLEMENTATION", "gloo")
        with other_ranks(model, 2, dist, mode, overrides, hicache):
            kwargs = host_kwargs(model, 0, 2, dist, **overrides)
            if mode == "hicache":
                with running(Engine, **kwargs, hicache=HiCacheOptions(**(hicache or {}))) as engine:
                    outputs, cached = generate(engine, workload)
                    generate(engine, [[SYNC_PROMPT]])
                    return {"outputs": outputs, "cached": cached, "stats": engine.hicache_stats(),
                            "tiers": engine.hit_tokens_by_tier(cached)}
            with running(SglEngine, **kwargs) as engine:
                outputs, cached = generate(engine, workload)
                return {"outputs": outputs, "cached": cached}


def assert_same_decisions(log: Path) -> list[str]:
    """Rank 1 applied exactly rank 0's decisions and plans, in order, every one up to the workload's last finish
    (``SYNC_PROMPT``'s forward came after it on both ranks; what came after that may still be on its way when
    the test stops rank 1); returns rank 1's method names."""
    header0, leader = decisions(log / "rank0.log")
    header1, follower = decisions(log / "rank1.log")
    assert "leader (head)" in header0 and "follower of rank 0 (no head)" in header1
    assert follower == leader[: len(follower)]
    finishes = [i for i, line in enumerate(leader) if "cache_finished_req" in line.split()[1]]
    last_request_decision = finishes[-2]  # the workload's last (the last one is SYNC_PROMPT's)
    assert len(follower) > last_request_decision
    return [line.split()[1] for line in follower]


@pytest.mark.slow
def test_two_hosts_one_head_exact_and_same_decisions(tiny_model: Path, tmp_path: Path) -> None:
    workload = rounds()[:ROUNDS]
    reference = serve_two_hosts(tiny_model, "sgl-jax", workload, disable_radix_cache=True)
    assert reference["cached"] == 0
    served = serve_two_hosts(tiny_model, "hicache", workload, {"decision_log": str(tmp_path)})
    assert served["outputs"] == reference["outputs"]
    assert served["cached"] > 0
    applied = set(assert_same_decisions(tmp_path))
    # every finish carries the request's TokenAccount, built alike on both ranks (the same step)
    assert {"match_prefix", "alloc", "step:cache_finished_req,report_tokens", "inc_lock_ref"} <= applied


def test_two_hosts_with_l2_and_l3_exact_with_tier_hits(tiny_model: Path, tmp_path: Path,
                                                     no_cache_outputs: list) -> None:
    """The whole workload (its tier rounds overflow L1 and L2) on 2 hosts with L1+L2+L3: the outputs are one
    host's without a cache (the 2-host forward gives the same tokens: the slow test above), L2 and L3 served
    tokens, and rank 1 applied rank 0's decisions and transfer plans, the same ones in the same order."""
    log, l3 = tmp_path / "decisions", tmp_path / "l3"
    options = {"host_pages": HOST_PAGES, "l3_url": l3.as_uri(), "l3_pages_per_object": L3_PAGES_PER_OBJECT,
               "decision_log": str(log)}
    served = serve_two_hosts(tiny_model, "hicache", rounds(), options)
    assert served["outputs"] == no_cache_outputs
    tiers, stats = served["tiers"], served["stats"]
    assert tiers["L1"] > 0 and tiers["L2"] > 0 and tiers["L3"] > 0, tiers
    assert stats["in_flight"] == 0 and stats["transfer_failures"] == 0
    fates = stats["prompt_tokens"]  # every request's TokenAccount reached the head
    assert sum(fates.values()) == sum(len(p) for prompts in rounds() for p in prompts) + len(SYNC_PROMPT)
    assert fates["hit_l1"] + fates["hit_l2"] + fates["hit_l3"] == served["cached"], fates
    kinds = assert_same_decisions(log)
    assert kinds.count("plan") > 0 and "init_load_back" in " ".join(kinds)
    # each rank wrote its own shard of every stored page (KV heads 0..1 and 1..2 of 2)
    stored = [str(f.relative_to(l3)) for f in l3.rglob("*") if f.is_file()]
    assert any("h0-1of2" in n for n in stored) and any("h1-2of2" in n for n in stored), stored[:4]


def test_follower_applies_the_head_decisions(tmp_path: Path) -> None:
    options = HiCacheOptions(decision_timeout_s=30, decision_log=str(tmp_path))
    address = ("127.0.0.1", decision_address(f"127.0.0.1:{free_port_range()}")[1])
    head = CacheHead(options.head_config(page_size=4, num_pages=16))
    follower: list[FollowerTransport] = []
    joined = threading.Thread(target=lambda: follower.append(FollowerTransport(
        FollowerChannel(address, 1, timeout_s=30, log_folder=str(tmp_path)))))
    joined.start()
    leader = LeaderTransport(EmbeddedTransport(head), LeaderChannel(address, 1, timeout_s=30, log_folder=str(tmp_path)))
    joined.join(timeout=30)
    try:
        on_leader, on_follower = CacheClient(leader, 4), CacheClient(follower[0], 4)
        key = RadixKey(np.arange(12, dtype=np.int32))

        def serve(client: CacheClient) -> list:
            pages = client.alloc(12)
            client.insert(InsertParams(key, pages))
            return [pages.tolist(), client.match_prefix(key).device_pages.tolist(), client.stats().cached_tokens]

        answers: dict[str, list] = {}
        side = threading.Thread(target=lambda: answers.setdefault("follower", serve(on_follower)))
        side.start()
        answers["leader"] = serve(on_leader)
        side.join(timeout=30)
        assert answers["follower"] == answers["leader"] and answers["leader"][2] == 12
        assert decisions(tmp_path / "rank1.log")[1] == decisions(tmp_path / "rank0.log")[1]
        assert head.stats().cached_tokens == 12  # the one tree; the follower has none
        # a rank that makes another call than rank 0 stops instead of using rank 0's answer
        side = threading.Thread(target=lambda: answers.setdefault("diverged", _error(lambda: on_follower.evict(4))))
        side.start()
        on_leader.match_prefix(key)
        side.join(timeout=30)
        assert isinstance(answers["diverged"], RankDivergedError) and "match_prefix" in str(answers["diverged"])
    finally:
        leader.close()
        follower[0].close()


def _channel_pair(timeout_s: float) -> tuple[LeaderChannel, FollowerChannel]:
    address = ("127.0.0.1", decision_address(f"127.0.0.1:{free_port_range()}")[1])
    follower: list[FollowerChannel] = []
    joined = threading.Thread(target=lambda: follower.append(FollowerChannel(address, 1, timeout_s=timeout_s)))
    joined.start()
    leader = LeaderChannel(address, 1, timeout_s=30)
    joined.join(timeout=30)
    return leader, follower[0]


def test_a_rank_whose_peer_is_gone_stops_with_a_clear_error() -> None:
    """Rank 0 (the head) gone: a follower's next cache call raises TimeoutError naming rank 0 after its decision
    timeout, never a hang and never an answer of its own. A follower gone: rank 0's next gather (a transfer
    poll) raises TimeoutError naming the ranks that did not answer."""
    leader, follower = _channel_pair(timeout_s=3)
    leader.close()  # rank 0 is gone
    try:
        client = CacheClient(FollowerTransport(follower), 4)
        with pytest.raises(TimeoutError, match="is rank 0 gone"):
            client.match_prefix(RadixKey(np.arange(8, dtype=np.int32)))
    finally:
        follower.close()
    leader, follower = _channel_pair(timeout_s=30)
    follower.close()  # rank 1 is gone
    try:
        with pytest.raises(TimeoutError, match="1 sgl-jax rank.* did not answer 'poll'"):
            leader.gather("poll", timeout_s=1.0)
    finally:
        leader.close()


def _error(fn: object) -> BaseException | None:
    try:
        fn()  # type: ignore[operator]
    except BaseException as e:  # noqa: BLE001 - the test inspects it
        return e
    return None


def test_every_rank_moves_its_own_shard_as_the_head_plans(tmp_path: Path) -> None:
    """L2 on 2 ranks, without sgl-jax: rank 0's head drives both ranks' host workers (``RankWorkerGroup``), each
    over its own device pool holding other bytes (its shard). A prefix is backed up to L2, evicted from L1 and
    loaded back on both ranks: each rank gets its own bytes back at the head's new pages, both logs hold the same
    decisions and plans, and a repeated size query is sent once."""
    import jax
    from support.kv_pattern import page_rows

    from hicache.cluster.client import ResultRef
    from hicache.cluster.controller import LoadBackParams
    from hicache.cluster.head import Call, Method
    from hicache.cluster.worker_group import LocalWorkerGroup
    from hicache.sgl_jax.rank_workers import RankWorkerGroup
    from hicache.workers import HostWorker, KVCacheSpec

    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype="float32")
    options = HiCacheOptions(host_pages=16, decision_timeout_s=30, decision_log=str(tmp_path))
    config = options.head_config(page_size=4, num_pages=16)
    address = ("127.0.0.1", decision_address(f"127.0.0.1:{free_port_range()}")[1])
    workers = [HostWorker(spec, 17, 16, host_index=r, devices=[jax.devices()[r]]) for r in range(2)]
    key = RadixKey(np.arange(1, 13, dtype=np.int32))
    rows = [page_rows(key.token_ids + 1000 * r, 0, 3, workers[r].device_pool.host_row_shape, 4) for r in range(2)]

    def serve(client: CacheClient, rank: int) -> dict[str, Any]:
        pool = workers[rank].device_pool
        client.alloc(4)  # (sgl-jax's padding page)
        pages = client.alloc(12)
        pool.write_pages(pages, rows[rank])  # the forward that computed this rank's shard of the prefix
        client.insert(InsertParams(key, pages))
        client.flush_write_through_acks()  # the backup, acked by both ranks
        evicted = client.evict(12).evicted_tokens
        sizes = [client.stats().evictable_tokens for _ in range(3)]
        m = client.match_prefix(key)
        started, done = client.step([Call(Method.INIT_LOAD_BACK, LoadBackParams(m.best_match_node, m.host_hit_len)),
                                     Call(Method.WAIT_LOAD_BACK, ResultRef(0, "load_id"))])
        loaded = started.unwrap()
        return {"evicted": evicted, "host_hit": m.host_hit_len, "sizes": sizes, "done": done.unwrap(),
                "pages": loaded.device_pages.tolist(), "old_pages": pages.tolist(),
                "bytes_back": bool(np.array_equal(pool.read_pages(loaded.device_pages), rows[rank]))}

    follower: list[FollowerTransport] = []
    joined = threading.Thread(target=lambda: follower.append(FollowerTransport(
        FollowerChannel(address, 1, timeout_s=30, log_folder=str(tmp_path)), LocalWorkerGroup([workers[1]]))))
    joined.start()
    channel = LeaderChannel(address, 1, timeout_s=30, log_folder=str(tmp_path))
    joined.join(timeout=30)
    head = CacheHead(config, RankWorkerGroup(workers[0], channel))
    leader = LeaderTransport(EmbeddedTransport(head), channel)
    try:
        answers: dict[str, dict[str, Any]] = {}
        side = threading.Thread(target=lambda: answers.setdefault("follower", serve(CacheClient(follower[0], 4), 1)))
        side.start()
        answers["leader"] = serve(CacheClient(leader, 4), 0)
        side.join(timeout=60)
        ours, theirs = answers["leader"], answers["follower"]
        assert ours["evicted"] == 12 and ours["host_hit"] == 12 and ours["done"] is True
        assert ours["bytes_back"] and theirs["bytes_back"]  # each rank's own shard, from its own L2
        assert theirs == ours
        header0, on_leader = decisions(tmp_path / "rank0.log")
        _, on_follower = decisions(tmp_path / "rank1.log")
        assert on_follower == on_leader
        kinds = [line.split()[1] for line in on_leader]
        assert kinds.count("plan") >= 2  # the D->H backup and the H->D load, applied by both ranks
        assert kinds.count("stats") == 1  # three size queries in a row: one sent
        assert head.stats().cached_tokens == 12
    finally:
        leader.close()
        follower[0].close()
