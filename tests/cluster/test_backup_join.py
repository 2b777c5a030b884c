"""L1->L2 backups of nodes cached below an ancestor whose backup is still queued: they join that op.

A chunked prefill caches a node end per chunk while the first chunk's backup waits in the open batch.
Deferring the later chunks to the ancestor's ack loses their copies when L1 evicts them first; joining the
queued op (one ack commits every chain, ancestors first; a failed op rolls every chain back) keeps them.
These tests hold on a Full-only head; the hybrid heads' joins are covered in ``test_hybrid_host_tier``.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.hicache_env import HiCacheEnv
from support.token_accounting import assert_tokens_accounted

from hicache.cluster.tree import RadixKey
from hicache.reference.engine.config import ForwardConfig, ModelConfig
from hicache.reference.engine.runner import ModelRunner
from hicache.reference.serve_types import ServeRequest
from hicache.reference.stack import StackOptions, build_stack
from hicache.workers import OpKind

PS = 8
MODEL = ModelConfig()
FWD = ForwardConfig(chunk_size=16, page_size=PS, max_pages=32)


def seq(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def check(env: HiCacheEnv) -> None:
    env.head.tree.check_invariants()
    env.head.controller.check_invariants()


def test_chunked_prefills_under_l1_pressure_back_up_every_chunk_and_hit_l2_exactly():
    """Four conversations of 41-token first turns, prefilled a page per step (a node per chunk), into an
    L1 of 16 pages with no flush between requests: every chunk gets its L2 copy, so each second turn hits
    its whole cached prefix (L1 + L2), and every output equals the no-cache run."""
    runner = ModelRunner(MODEL, FWD, num_pages=96)
    stack = build_stack(StackOptions(MODEL, FWD, l1_pages=16, l2_slots=128, prefill_budget=PS), runner)
    rng = np.random.default_rng(0)
    convs, new_tokens = 4, 3
    prompts = [rng.integers(0, MODEL.vocab_size, 5 * PS + 1, dtype=np.int32) for _ in range(convs)]
    loaded = 0
    cached = []  # per conversation: the tokens its first turn left in the cache (whole pages with KV)
    for turn in range(2):
        for c in range(convs):
            res = stack.scheduler.serve(ServeRequest(prompts[c], new_tokens))
            assert_tokens_accounted(res)
            ref = runner.generate_no_cache(prompts[c], new_tokens)
            assert res.output == ref.tokens
            np.testing.assert_array_equal(res.last_logits, ref.logits[0])
            if turn == 0:
                # (the last output token's KV is never computed)
                cached.append((len(prompts[c]) + new_tokens - 1) // PS * PS)
                prompts[c] = np.concatenate([prompts[c], np.asarray(res.output, np.int32),
                                             rng.integers(0, MODEL.vocab_size, PS + 2, dtype=np.int32)])
            else:
                # Deferred chunk backups (waiting for the first chunk's ack) were evicted from L1 before it
                # came: those turns recomputed most of their prefix.
                assert (res.device_hit_tokens + res.loaded_tokens, c) == (cached[c], c)
                loaded += res.loaded_tokens
    assert loaded > 0  # L1 holds 16 pages: the first conversations come back from L2
    stack.client.flush_write_through_acks()
    st = stack.head.stats()
    assert st.protected_tokens == 0 and st.request_pages == 0
    stack.head.tree.check_invariants()
    stack.head.controller.check_invariants()


@pytest.mark.parametrize("ok", [True, False])
def test_a_chain_below_a_queued_backup_joins_its_op_and_commits_or_rolls_back_with_it(ok):
    """``a``'s backup waits in the open batch when ``a`` + ``b`` is cached below it: ``b``'s chain joins that
    batch (no deferral). The one op's ack commits both chains; a failed op rolls both back (slots freed,
    locks released, nodes device-only) and nothing leaks."""
    faults = None if ok else {"fail_kinds": (OpKind.BACKUP_D2H,), "fail_rate": 1.0}
    env = HiCacheEnv(page_size=4, device_pages=32, host_slots=64, faults=faults)
    ctl = env.head.controller
    a = seq(0, 16)
    ab = np.concatenate([a, seq(500, 8)])
    env.serve(a)
    env.serve(ab)
    batch = ctl.outbox.open_backups
    assert [[n.num_tokens for n in chain] for chain in batch.chains] == [[16], [8]]
    assert not ctl._deferred and all(n.pending is batch for chain in batch.chains for n in chain)
    check(env)
    env.head.flush_write_through_acks()
    st = env.head.cache_stats()
    assert st["in_flight"] == 0 and env.head.stats().protected_tokens == 0
    if ok:
        assert st["host_tokens"] == st["backed_up_tokens"] == 24 and ctl.host.num_free == 64 - 6
        check(env)
        env.head.evict(100)
        r = env.serve(ab)  # serve checks the loaded pages hold ab's KV
        assert (r["device_hit"], r["loaded"]) == (0, 24)
    else:
        assert st["host_tokens"] == 0 and st["transfer_failures"] == 2 and ctl.host.num_free == 64
        assert all(n.host_slots is None and n.staged_slots is None and n.pending is None
                   for n in env.head.tree.iter_nodes())
        m = env.head.match_prefix(RadixKey(ab))
        assert (m.device_hit_len, m.host_hit_len) == (24, 0)
    check(env)



def test_a_lost_host_tier_rolls_back_a_joined_op_that_was_never_sent():
    """The worker is lost while ``a``'s op, with ``a`` + ``b``'s chain joined to it, waits unsent: both chains
    go back to device-only, every slot is free, no lock is left, and L2 fills again afterwards."""
    env = HiCacheEnv(page_size=4, device_pages=32, host_slots=64)
    ctl = env.head.controller
    a = seq(0, 16)
    ab = np.concatenate([a, seq(500, 8)])
    env.serve(a)
    env.serve(ab)
    assert len(ctl.outbox.open_backups.chains) == 2
    assert ctl.drop_host_tier() == 0  # nothing was in L2 yet
    st = env.head.cache_stats()
    assert st["in_flight"] == 0 and st["host_tokens"] == 0 and ctl.host.num_free == 64
    assert env.head.stats().protected_tokens == 0
    assert all(n.host_slots is None and n.staged_slots is None and n.pending is None
               for n in env.head.tree.iter_nodes())
    check(env)
    env.serve(ab)  # a hit: nothing new to back up; a new leaf below it is backed up with its path
    env.serve(np.concatenate([ab, seq(900, 4)]))
    env.head.flush_write_through_acks()
    assert env.head.cache_stats()["host_tokens"] == 28
    check(env)
