"""sgl-jax on 2 hosts (nnodes=2, one scheduler process per host, gloo on CPU) with one hicache head.

Rank 0 holds the head; rank 1 holds no head and no tree and applies rank 0's decisions
(``hicache.sgl_jax.ranks``). Asserted: greedy outputs token for token equal to sgl-jax on the same 2 hosts
without a cache, prefix hits > 0, and both ranks applied the same decisions (``decision_log``: the same
sequence of calls with the same answers; rank 1's log says it is a follower with no head). The Engine test
is slow (two 2-host starts); ``test_follower_applies_the_head_decisions`` checks the channel itself fast:
a real head behind ``LeaderTransport``, a follower in another thread, the decisions compared.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.sgl_jax_env import SAMPLING, rounds, running
from support.sgl_jax_hosts import free_port_range, host_kwargs, other_ranks

from hicache.cluster import CacheClient, CacheHead, EmbeddedTransport
from hicache.cluster.tree import InsertParams, RadixKey
from hicache.sgl_jax import HiCacheOptions
from hicache.sgl_jax.ranks import FollowerTransport, LeaderTransport, RankDivergedError, decision_address

ROUNDS = 3  # the shared-prefix rounds: L1 hits on both hosts


def decisions(log: Path) -> tuple[str, list[str]]:
    header, *lines = log.read_text().splitlines()
    return header, lines


def generate(engine: object) -> tuple[list[list[int]], int]:
    outputs, cached = [], 0
    for prompts in rounds()[:ROUNDS]:
        for out in engine.generate(input_ids=prompts, sampling_params=SAMPLING):  # type: ignore[attr-defined]
            outputs.append(out["output_ids"])
            cached += out["meta_info"]["cached_tokens"]
    return outputs, cached


def serve_two_hosts(model: Path, mode: str, log: Path | None = None, **overrides: Any) -> tuple[list, int]:
    from sgl_jax.srt.entrypoints.engine import Engine as SglEngine

    from hicache.sgl_jax import Engine

    dist = f"127.0.0.1:{free_port_range()}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAX_CPU_COLLECTIVES_IMPLEMENTATION", "gloo")
        with other_ranks(model, 2, dist, mode, overrides, log):
            kwargs = host_kwargs(model, 0, 2, dist, **overrides)
            if mode == "hicache":
                with running(Engine, **kwargs, hicache=HiCacheOptions(decision_log=str(log))) as engine:
                    return generate(engine)
            with running(SglEngine, **kwargs) as engine:
                return generate(engine)


@pytest.mark.slow
def test_two_hosts_one_head_exact_and_same_decisions(tiny_model: Path, tmp_path: Path) -> None:
    reference, cached = serve_two_hosts(tiny_model, "sgl-jax", disable_radix_cache=True)
    assert cached == 0
    outputs, cached = serve_two_hosts(tiny_model, "hicache", tmp_path)
    assert outputs == reference
    assert cached > 0
    header0, leader = decisions(tmp_path / "rank0.log")
    header1, follower = decisions(tmp_path / "rank1.log")
    assert "leader (head)" in header0 and "follower of rank 0 (no head)" in header1
    # rank 1 applied exactly rank 0's decisions, in order, every one up to the last request's (after it, the
    # idle loops' size queries may still be on their way at shutdown)
    assert follower == leader[: len(follower)]
    last_request_decision = max(i for i, line in enumerate(leader) if line.split()[1] != "stats")
    assert len(follower) > last_request_decision
    applied = {line.split()[1] for line in follower}
    assert {"match_prefix", "alloc", "cache_finished_req", "inc_lock_ref"} <= applied


def test_follower_applies_the_head_decisions(tmp_path: Path) -> None:
    options = HiCacheOptions(decision_timeout_s=30, decision_log=str(tmp_path))
    address = ("127.0.0.1", decision_address(f"127.0.0.1:{free_port_range()}")[1])
    head = CacheHead(options.head_config(page_size=4, num_pages=16))
    follower: list[FollowerTransport] = []
    joined = threading.Thread(target=lambda: follower.append(FollowerTransport(address, 1, timeout_s=30,
                                                                               log_folder=str(tmp_path))))
    joined.start()
    leader = LeaderTransport(EmbeddedTransport(head), address, 1, timeout_s=30, log_folder=str(tmp_path))
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


def _error(fn: object) -> BaseException | None:
    try:
        fn()  # type: ignore[operator]
    except BaseException as e:  # noqa: BLE001 - the test inspects it
        return e
    return None
