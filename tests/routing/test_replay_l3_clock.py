"""The routing replay's L3 follows its virtual clock: a page one replica stores is seen by another only
once, in virtual time, the writing request has finished and its write time has passed."""

from __future__ import annotations

import numpy as np
import pytest
from support.reference_shapes import FWD, MODEL

from benchmarks import routing_bench
from hicache.cluster.cost_model import CostOptions
from hicache.reference.stack import StackOptions
from hicache.routing import TTFTModel
from hicache.storage import ModelFingerprint, Namespace, ShardCoord, StorageConfig, page_keys
from hicache.storage.testing import NumpyHostPool, same_bytes, slot_range

COST = TTFTModel(compute_s_per_token=1e-3, l2_s_per_token=1e-4, l3_s_per_token=2e-4, request_s=1e-3, service_s=0.1)
RNG = np.random.default_rng(5)
PROMPT = RNG.integers(0, MODEL.vocab_size, 8 * FWD.page_size + 1, dtype=np.int32)
OTHERS = [RNG.integers(0, MODEL.vocab_size, 2 * FWD.page_size + 1, dtype=np.int32) for _ in range(4)]
KEY_TOKENS = PROMPT.size - 1  # every prompt token but the last is matched (whole pages here)


@pytest.mark.parametrize("write_s_per_token", [0.0, 1.0])
def test_replay_shows_l3_writes_from_their_virtual_completion(tmp_path, runner, write_s_per_token):
    # Round robin over 4 replicas. Request 0 (replica 0) stores PROMPT in L3 and finishes at ~0.066 s
    # virtual; requests 1-4 are short others (4 puts replica 0 to work again, in real time right away);
    # request 5 (replica 1) asks for PROMPT at ~0.019 s, when replica 1 is done with request 1 but
    # request 0 still runs; request 6 (replica 2) long after. With no write time only request 6 may
    # fetch PROMPT from L3; with 1 s per token (64 s) not even request 6.
    options = StackOptions(MODEL, FWD, l1_pages=32, l2_slots=64, prefetch_min_tokens=8,
                           l3_cost=CostOptions(enabled=False))  # L3 hits are loaded, however busy the box
    clock = routing_bench.ServiceClock("model", COST, 1e-3, write_s_per_token)
    prompts = [PROMPT, *OTHERS, PROMPT, PROMPT]
    sends = [0.0, 1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 10.0]
    streams = [[routing_bench.Request(i, t, p, "", 1)] for i, (p, t) in enumerate(zip(prompts, sends))]
    out = routing_bench.replay("round_robin", streams, 1.0, options, runner, clock, tmp_path)
    rec = out["record"]
    assert rec["requests_per_replica"] == [2, 2, 2, 1]
    seen = KEY_TOKENS if write_s_per_token == 0 else 0
    assert rec["reused_tokens"] == {"l1": 0, "l2_loaded": 0, "l3_fetched": seen}
    assert rec["prefill_tokens_computed"] == sum(p.size for p in prompts) - seen
    assert out["outputs"][0] == out["outputs"][5] == out["outputs"][6]


@pytest.mark.parametrize("leading_page_index", [True, False])
def test_virtual_time_storage_answers_only_what_is_visible_and_readable(tmp_path, leading_page_index):
    fp = ModelFingerprint("tiny-test", "float32", page_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
    l3 = routing_bench.VirtualL3(write_s_per_token=0.0, page_size=4)
    st = l3.open(f"file://{tmp_path}/l3", fp, StorageConfig(pages_per_object=4, leading_page_index=leading_page_index))
    pool = NumpyHostPool(16, (2, 2, 2, 4, 8))
    st.register_host_pool(pool, shard=ShardCoord.full(fp))
    try:
        pool.fill_random(slot_range(0, 8), seed=1)
        keys = page_keys(Namespace(fp), np.arange(8 * 4))
        assert st.batch_set(keys[:4], slot_range(0, 4)) == [True] * 4
        assert l3.publish(1.0) == 1.0  # pages 0-3 (one object) seen from t=1
        assert st.batch_set(keys[4:], slot_range(4, 8), first_page=4) == [True] * 4
        assert l3.publish(3.0) == 3.0  # pages 4-7 from t=3
        for now, seen in ((0.5, 0), (2.0, 4), (3.0, 8)):
            l3.now = now
            assert st.batch_exists(keys) == seen
            assert st.batch_get(keys, slot_range(8, 16)) == [True] * seen + [False] * (8 - seen)
        # Pages 4-5 seen earlier (as another replica's write of them would make them): with the leading-page
        # index a fetch of 6 pages reads them from the object of pages 4-7; without it, it could not name
        # that object, so the answer stops at the readable 4.
        l3.visible_at.update({keys[4]: 1.0, keys[5]: 1.0})
        l3.now = 2.0
        n = 6 if leading_page_index else 4
        assert st.batch_exists(keys) == n
        assert st.batch_get(keys[:n], slot_range(8, 8 + n)) == [True] * n
        assert same_bytes(pool.read_slots(slot_range(8, 8 + n)), pool.read_slots(slot_range(0, n)))
    finally:
        st.close()
