"""Property test: random request streams through HiCache with delayed and failing transfers.

After every step: the tree and L2 invariants (pages and slots owned exactly once, L2 chains contiguous
from the root, in-flight nodes locked and pinned), no request-held pages left over, both tiers within
their bounds. Requests come one at a time (``serve``) or a few per scheduler step (``serve_step``: their
load-backs travel as one op, which the faults may fail as a whole). Every hit is checked to return
exactly the KV written for its tokens, and at the end everything cached in either tier is loaded and
checked once more. Seeds 6 and 13 run a hybrid SWA+Full head (an SWA pool smaller than L1, an SWA L2
smaller than the Full L2): every hit also needs exactly the right SWA KV in the window before its end.
Seeds 7 and 8 run a hybrid Mamba+Full head (fewer state slots than L1 pages, a state L2 smaller than the
Full L2): every hit also needs exactly the state of its tokens, loaded back with its L2 part. Seeds 9 (SWA)
and 10 (Mamba) add an L3 (file://) below them: what L1 and L2 lost comes back from L3 with the component's
values (the SWA window's pages, the state at the hit's end), checked as exactly as any other hit.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from support.hicache_env import HiCacheEnv

from hicache.cluster.builder import MambaConfig, SWAConfig
from hicache.cluster.cost_model import CostOptions
from hicache.cluster.tree import RadixKey
from hicache.workers import OpKind


def _stream(rng: random.Random, n: int) -> list[np.ndarray]:
    """Requests that share system prompts and grow conversations (lots of partial overlap)."""
    systems = [np.asarray([rng.randrange(50) for _ in range(rng.choice([4, 8, 12]))], np.int32) for _ in range(3)]
    convs: list[np.ndarray] = []
    out = []
    for _ in range(n):
        if convs and rng.random() < 0.6:
            i = rng.randrange(len(convs))
            convs[i] = np.concatenate([convs[i], np.asarray([rng.randrange(50) for _ in range(rng.randint(1, 9))], np.int32)])
            out.append(convs[i])
        else:
            conv = np.concatenate([rng.choice(systems), np.asarray([rng.randrange(50) for _ in range(rng.randint(1, 6))], np.int32)])
            convs.append(conv)
            out.append(conv)
    return out


# Seeds 3 and 4 start their load-backs with LoadBackParams(lock=True): the load holds the request's lock.
@pytest.mark.parametrize("seed,policy", [(0, "write_through"), (1, "write_through_selective"), (2, "write_back"),
                                         (3, "write_through"), (4, "write_back"),
                                         pytest.param(13, "write_through", marks=pytest.mark.slow), (6, "write_back"),
                                         (7, "write_through"), pytest.param(8, "write_back", marks=pytest.mark.slow),
                                         pytest.param(9, "write_through", marks=pytest.mark.slow), (10, "write_through")])
def test_random_stream_with_faults(seed, policy, tmp_path):
    rng = random.Random(seed)
    swa = SWAConfig(window=6, num_tokens=16 * 4, host_tokens=12 * 4) if seed in (6, 13, 9) else None
    mamba = MambaConfig(num_slots=10, host_slots=6) if seed in (7, 8, 10) else None
    l3 = {"storage_url": f"file://{tmp_path}/l3",  # (the cost model off: L3 hits whatever this box's speed)
          "storage_kwargs": {"cost": CostOptions(enabled=False), "prefetch_policy": "wait_complete"}} if seed in (9, 10) else {}
    env = HiCacheEnv(page_size=4, device_pages=24, host_slots=20, write_policy=policy,
                     faults={"fail_kinds": (OpKind.BACKUP_D2H, OpKind.LOAD_H2D), "fail_rate": 0.25,
                             "delay_polls": 3, "seed": seed}, load_lock=seed >= 3, swa=swa, mamba=mamba,
                     ack_timeout_s=60.0, **l3)  # (a loaded box: a first copy of a new shape compiles before its ack)
    head = env.head
    stream = _stream(rng, 45)
    while stream:
        action = rng.random()
        if action < 0.1:
            head.evict(rng.randint(0, 40))
        elif action < 0.2:
            head.check_hicache_events()
        elif action < 0.25:
            head.flush_write_through_acks()
        step = [stream.pop(0)]  # a step takes up to 3 requests of at most half of L1 together
        while stream and len(step) < rng.randint(1, 3) and sum(len(t) for t in step + stream[:1]) <= 12 * 4:
            step.append(stream.pop(0))
        if len(step) == 1:
            env.serve(step[0])  # asserts exact KV on every hit
        else:
            env.serve_step(step)
        head.tree.check_invariants()
        head.controller.check_invariants()
        st = head.stats()
        assert st.request_pages == 0
        assert head.cache_stats()["host_tokens"] <= 20 * 4
    head.flush_write_through_acks()
    assert head.controller.in_flight == 0
    assert head.stats().protected_tokens == 0
    # Everything still cached (either tier) loads back exactly; drop L1 first so L2 is exercised.
    # Odd seeds do it in steps of two requests (their load-backs share one op).
    head.evict(10**6)
    step = []
    for tokens in _stream(random.Random(seed), 45):
        m = head.match_prefix(RadixKey(tokens))
        if m.device_hit_len + m.host_hit_len:
            step.append(tokens)
        if len(step) == 1 + seed % 2 or (step and sum(len(t) for t in step) > 6 * 4):
            env.serve(step[0]) if len(step) == 1 else env.serve_step(step)
            step = []
            head.tree.check_invariants()
            head.controller.check_invariants()
    if step:
        env.serve_step(step)
    head.tree.check_invariants()
    head.controller.check_invariants()
    c = head.cache_stats()
    assert c["transfer_failures"] > 0  # the faults really happened
    assert c["loaded_tokens"] > 0 and c["backed_up_tokens"] > 0
    if swa is not None:  # SWA host tails were made, and L2 stayed within its bound
        assert 0 < c["swa"]["host_tokens"] <= c["swa"]["host_capacity_tokens"] == 48
    if mamba is not None:  # states went to L2 within its bound and came back with loads
        assert 0 < c["mamba"]["host_states"] <= c["mamba"]["host_capacity_states"] == 6
    if l3:  # L3 hits, the components' values came back with them (and were checked as hits since)
        assert c["storage"]["prefetch_pages"] > 0 and c["storage"]["component_values"]["values_fetched"] > 0
