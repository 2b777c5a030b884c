"""The compact step wire format: same answers as the head called directly, less sent.

Two heads get the same calls: one directly (``CacheHead.step``), one through the wire format as the Ray
head actor runs it (encode -> pickle -> ``run_step`` -> pickle -> decode). Every result must be equal.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from hicache.cluster import CacheHead, Call, CallResult, HeadConfig, Method, wire
from hicache.cluster.begin import BeginParams, BeginResult
from hicache.cluster.client import ResultRef, run_with_refs
from hicache.cluster.key_history import DEFAULT_CAP_TOKENS, KeyHistories, KeyHistory, SentKeys
from hicache.cluster.tree import FinishResult, MatchPrefixParams, MatchResult, RadixKey, RequestState, TreeConfig
from hicache.workloads import MultiTurnSpec, multi_turn

PS = 4


def over_wire(head: CacheHead, calls: list[Call], sent: SentKeys, history: KeyHistory) -> tuple[list[CallResult], int]:
    """Results of ``calls`` through the wire format (pickled both ways, as between processes) with
    the client's and the head's key histories, and the int32 words the request carried."""
    header, buf, keys = wire.encode_calls(calls, sent)
    header, buf = pickle.loads(pickle.dumps((header, buf)))
    reply = wire.run_step(head, header, buf, history)
    assert reply is not None
    sent.commit_copies(keys)
    return wire.decode_results(*pickle.loads(pickle.dumps(reply)), calls), buf.size


def assert_same(a: CallResult, b: CallResult) -> None:
    assert a.ok == b.ok, (a, b)
    if not a.ok:
        assert type(a.error) is type(b.error) and str(a.error) == str(b.error)
        return
    va, vb = a.value, b.value
    assert type(va) is type(vb)
    if isinstance(va, BeginResult):  # (l3_s, alloc_s: the head's own timings)
        assert_same(CallResult(True, va.match), CallResult(True, vb.match))
        assert (va.fetched, va.prefetch, va.pages is None) == (vb.fetched, vb.prefetch, vb.pages is None)
        if va.pages is not None:
            assert_same(CallResult(True, va.pages), CallResult(True, vb.pages))
    elif isinstance(va, np.ndarray):
        np.testing.assert_array_equal(va, vb)
        assert va.dtype == vb.dtype
    elif isinstance(va, (MatchResult, RequestState)):
        for name in va.__dataclass_fields__:
            x, y = getattr(va, name), getattr(vb, name)
            if isinstance(x, np.ndarray):
                np.testing.assert_array_equal(x, y)
            elif isinstance(x, RadixKey):
                np.testing.assert_array_equal(x.token_ids, y.token_ids)
                assert x.namespace == y.namespace
            else:
                assert x == y, name
    else:
        assert va == vb


class Pair:
    """The same calls to two identical heads: directly and over the wire."""

    def __init__(self, capacity_pages: int = 4096, history_tokens: int = DEFAULT_CAP_TOKENS) -> None:
        config = HeadConfig(tree=TreeConfig(PS, capacity_pages))
        self.direct, self.remote = CacheHead(config), CacheHead(config)
        self.sent = SentKeys(history_tokens)
        self.history = KeyHistory(self.sent.session, history_tokens)
        self.words = 0

    def step(self, calls: list[Call]) -> list[CallResult]:
        expected = run_with_refs(self.direct, calls)
        got, words = over_wire(self.remote, calls, self.sent, self.history)
        self.words += words
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            assert_same(a, b)
        return got


@pytest.mark.parametrize("history_tokens", [DEFAULT_CAP_TOKENS, 3000])  # 3000: entries leave while in use
def test_multi_turn_scheduler_loop_gives_identical_results_and_sends_only_new_tokens(history_tokens):
    spec = MultiTurnSpec(conversations=12, turns=4, system_prompts=2, system_tokens=(40, 80), user_tokens=(5, 30),
                         output_tokens=(5, 30), vocab_size=500, seed=1)
    pair = Pair(capacity_pages=300, history_tokens=history_tokens)  # small L1: evictions, capacity errors
    full_words = 0  # int32 words of whole keys and pages
    finish: list[Call] = []
    for turns in multi_turn(spec):
        for i in range(0, len(turns), 5):
            group = turns[i : i + 5]
            full_words += sum(len(t.prompt) for t in group)
            nf, g = len(finish), len(group)
            res = pair.step(finish + [Call(Method.MATCH_PREFIX, RadixKey(t.prompt)) for t in group] + [
                c for j, t in enumerate(group) for c in (  # lock and alloc chained on the match results
                    Call(Method.INC_LOCK_REF, ResultRef(nf + j, "last_device_node")),
                    Call(Method.ALLOC, ResultRef(nf + j, "device_hit_len", scale=-1, offset=len(t.sequence))))])
            matches, locked = [r.value for r in res[nf : nf + g]], res[nf + g :]
            finish = []
            for j, (t, m) in enumerate(zip(group, matches)):
                assert locked[2 * j].ok
                own = locked[2 * j + 1]
                if not own.ok:
                    finish.append(Call(Method.DEC_LOCK_REF, m.last_device_node))
                    continue
                pages = np.concatenate([m.device_pages, own.value])
                finish.append(Call(Method.CACHE_FINISHED_REQ,
                                   RequestState(RadixKey(t.sequence), pages, m.device_hit_len, m.last_device_node)))
                full_words += len(t.sequence) + pages.size
    pair.step(finish)
    assert pair.direct.tree.stats() == pair.remote.tree.stats()
    assert pair.direct.stats().matched_tokens > 0
    # Finishes sent their new tokens, prompts their tokens past the previous turn's prompt.
    assert pair.words < (0.5 if history_tokens == DEFAULT_CAP_TOKENS else 0.9) * full_words


def test_request_state_prefix_comes_from_the_locked_path():
    pair = Pair()
    seq = np.arange(100, 140, dtype=np.int32)
    m, pages = pair.step([Call(Method.MATCH_PREFIX, RadixKey(seq[:20], "t")), Call(Method.ALLOC, 20)])
    pair.step([Call(Method.CACHE_FINISHED_REQ, RequestState(RadixKey(seq[:20], "t"), pages.value, 0,
                                                            m.value.last_device_node))])
    m = pair.step([Call(Method.MATCH_PREFIX, MatchPrefixParams(RadixKey(seq, "t")))])[0].value
    assert m.device_hit_len == 20
    own = pair.step([Call(Method.INC_LOCK_REF, m.last_device_node), Call(Method.ALLOC, 20)])[1].value
    state = RequestState(RadixKey(seq[:30], "t"), np.concatenate([m.device_pages, own]), 20, m.last_device_node)
    header, buf, _ = wire.encode_calls([Call(Method.CACHE_UNFINISHED_REQ, state)])
    assert buf.size == 10 + state.device_pages.size  # tokens past prefix_len, and the pages
    got = pair.step([Call(Method.CACHE_UNFINISHED_REQ, state)])[0].value
    assert got.key is state.key and got.prefix_len == 28  # the returned state carries the sent key
    done = pair.step([Call(Method.CACHE_FINISHED_REQ, RequestState(RadixKey(seq, "t"), np.concatenate(
        [got.device_pages, pair.step([Call(Method.ALLOC, 12)])[0].value]), got.prefix_len, got.last_node))])
    assert done[0].value == FinishResult(28, 3)  # 10 whole pages kept; the 3 extra ones freed
    assert pair.direct.tree.stats() == pair.remote.tree.stats()


@pytest.mark.parametrize("prefix_len, node", [(8, "last"), (0, "last"), (20, 987654), (20, "root")])
def test_a_wrong_prefix_or_node_fails_that_call_like_the_head(prefix_len, node):
    pair = Pair()
    seq = np.arange(40, dtype=np.int32)
    m, pages = pair.step([Call(Method.MATCH_PREFIX, RadixKey(seq[:20])), Call(Method.ALLOC, 20)])
    pair.step([Call(Method.CACHE_FINISHED_REQ, RequestState(RadixKey(seq[:20]), pages.value, 0,
                                                            m.value.last_device_node))])
    m = pair.step([Call(Method.MATCH_PREFIX, RadixKey(seq))])[0].value
    pair.step([Call(Method.INC_LOCK_REF, m.last_device_node)])
    node_id = {"last": m.last_device_node, "root": pair.direct.tree.roots()[(None, None)].id}.get(node, node)
    own = pair.step([Call(Method.ALLOC, 20)])[0].value
    bad = RequestState(RadixKey(seq), np.concatenate([m.device_pages, own]), prefix_len, node_id)
    res = pair.step([Call(Method.CACHE_FINISHED_REQ, bad), Call(Method.STATS)])
    assert not res[0].ok and isinstance(res[0].error, ValueError) and res[1].ok
    assert pair.direct.tree.stats() == pair.remote.tree.stats()


def test_generic_calls_and_errors_travel_unchanged():
    pair = Pair()
    res = pair.step([Call(Method.FREE, [12345]), Call(Method.ALLOC, np.int64(8)), Call(Method.STATS),
                     Call(Method.EVICT, 0), Call(Method.INC_LOCK_REF, 999), Call(Method.FREE, ResultRef(1)),
                     Call(Method.FREE, ResultRef(0)), Call(Method.ALLOC, ResultRef(2, "num_nodes"))])
    assert [r.ok for r in res] == [False, True, True, True, False, True, False, True]
    with pytest.raises(TypeError, match="index 1"):
        wire.encode_calls([Call(Method.STATS), "stats"])


def test_a_key_refers_to_an_earlier_one_and_the_copy_is_private():
    pair = Pair()
    tokens = np.arange(1000, 1100, dtype=np.int32)
    pair.step([Call(Method.MATCH_PREFIX, RadixKey(tokens))])
    header, buf, _ = wire.encode_calls([Call(Method.MATCH_PREFIX, RadixKey(np.r_[tokens, 7, 8]))], pair.sent)
    assert header[0][2:4] == (0, 96) and buf.size == 6  # entry 0's 6 whole blocks + 4 + 2 new tokens
    tokens[:50] = 5  # serving code reuses its array: the histories keep what was sent
    res = pair.step([Call(Method.MATCH_PREFIX, RadixKey(np.r_[tokens, 9]))])  # compared with the direct head
    assert res[0].ok


def test_a_reference_the_head_cannot_resolve_runs_nothing():
    pair = Pair()
    tokens = np.arange(1000, 1100, dtype=np.int32)
    pair.step([Call(Method.MATCH_PREFIX, RadixKey(tokens))])
    header, buf, _ = wire.encode_calls([Call(Method.ALLOC, 8), Call(Method.MATCH_PREFIX, RadixKey(tokens))], pair.sent)
    before = pair.remote.tree.stats()
    fresh = KeyHistory(pair.sent.session, DEFAULT_CAP_TOKENS)  # a head that lost the session
    assert wire.run_step(pair.remote, header, buf, fresh) is None
    assert pair.remote.tree.stats() == before and fresh.steps == 0


def test_the_head_serves_a_session_only_at_the_clients_step_count():
    histories = KeyHistories()
    assert histories.for_step(1, 3, 100) is None  # unknown session mid-stream: resync
    h = histories.for_step(1, 0, 100)
    assert h is not None and histories.for_step(1, 0, 100) is h
    h.commit([np.arange(5, dtype=np.int32)])
    assert histories.for_step(1, 0, 100) is None and histories.for_step(1, 1, 100) is h
    for session in range(2, 2 + 16):
        histories.for_step(session, 0, 100)
    assert histories.for_step(1, 1, 100) is None  # least recently used sessions leave
    with pytest.raises(ValueError):
        SentKeys(0)


def test_a_match_result_with_a_storage_hit_travels_compact_and_exact():
    m = MatchResult(np.arange(3, dtype=np.int32), 48, 16, 7, 9, 9, storage_hit_len=64)
    call = Call(Method.MATCH_PREFIX, MatchPrefixParams(RadixKey(np.arange(200, dtype=np.int32))))
    header, buf = wire.encode_results([m], [None], [call.arg])
    assert header[0][0] == wire._R_MATCH  # the compact form, not a pickled dataclass
    (back,) = wire.decode_results(header, buf, [call])
    assert_same(back, CallResult(True, m))
    assert back.value.storage_hit_len == 64


def test_a_finish_sends_its_output_and_the_next_turn_its_new_tokens():
    """Turn 2's prompt extends turn 1's finished sequence: with both keys in the key history, the finish
    carries the tokens past the prompt's whole blocks, the next prompt those past the sequence's."""
    pair = Pair()
    prompt1 = np.arange(1000, 1100, dtype=np.int32)  # 6 whole blocks + 4
    seq1 = np.r_[prompt1, np.arange(50, dtype=np.int32)]  # 150 tokens: 9 whole blocks + 6
    prompt2 = np.r_[seq1, np.arange(7000, 7030, dtype=np.int32)]
    m, own = (r.value for r in pair.step([Call(Method.MATCH_PREFIX, RadixKey(prompt1)), Call(Method.ALLOC, 152)]))
    finish = Call(Method.CACHE_FINISHED_REQ, RequestState(RadixKey(seq1), own, 0, m.last_device_node))
    header, _, keys = wire.encode_calls([finish], pair.sent)
    assert header[0][2:6] == (0, 96, 0, 150 - 96) and len(keys) == 1  # entry 0 (prompt1), 96 tokens; 54 sent
    pair.step([finish])
    header, _, _ = wire.encode_calls([Call(Method.MATCH_PREFIX, RadixKey(prompt2))], pair.sent)
    assert header[0][2:6] == (1, 144, 0, 180 - 144)  # entry 1 (seq1): 144 tokens; 36 sent
    assert pair.step([Call(Method.MATCH_PREFIX, RadixKey(prompt2))])[0].value.device_hit_len == 148  # whole pages of seq1


def test_a_request_start_travels_compact_with_its_key_history_and_gives_the_heads_answers():
    """``begin_request`` over the wire: the key as a match key (a later turn sends its new tokens), the
    match and the pages back compact; its lock + alloc and a capacity error (its lock released) equal
    the head's own."""
    pair = Pair(capacity_pages=40)
    prompt1 = np.arange(1000, 1041, dtype=np.int32)
    (r1,) = pair.step([Call(Method.BEGIN_REQUEST, BeginParams(RadixKey(prompt1), 50))])
    r1 = r1.value
    assert r1.pages.size == 13 and r1.match.device_hit_len == 0 and r1.prefetch is None
    seq1 = np.r_[prompt1, np.arange(9, dtype=np.int32)]
    pair.step([Call(Method.CACHE_FINISHED_REQ, RequestState(RadixKey(seq1), r1.pages, 0, r1.match.last_device_node))])
    prompt2 = np.r_[seq1, np.arange(7000, 7010, dtype=np.int32)]
    begin2 = Call(Method.BEGIN_REQUEST, BeginParams(RadixKey(prompt2), 64))
    header, _, keys = wire.encode_calls([begin2], pair.sent)
    assert header[0][0] == wire._BEGIN and header[0][5] == 60 - header[0][3] < 60 and len(keys) == 1
    (r2,) = pair.step([begin2])
    assert r2.value.match.device_hit_len == 48 and r2.value.pages.size == 4
    reply = wire.encode_results([r2.value], [None], [begin2.arg])
    assert reply[0][0][0] == wire._R_BEGIN  # not a pickled dataclass
    node = r2.value.match.last_device_node
    locks = pair.remote.tree.node(node).lock_ref
    (r3,) = pair.step([Call(Method.BEGIN_REQUEST, BeginParams(RadixKey(prompt2), 48 + 8 * 40))])  # > L1
    assert not r3.ok and "needs" in str(r3.error)
    assert pair.remote.tree.node(node).lock_ref == locks == pair.direct.tree.node(node).lock_ref
    assert pair.direct.tree.stats() == pair.remote.tree.stats()


def test_find_looks_near_the_end_first_and_then_further_back():
    sent = SentKeys()
    old = np.arange(5000, 5100, dtype=np.int32)  # 6 whole blocks
    sent.commit_copies([old, np.arange(9000, 9040, dtype=np.int32)])
    far = np.r_[old, np.arange(100, 1100, dtype=np.int32)]  # its end is 62 blocks before the new key's
    assert sent.find(far) == (0, 96) and sent.find(far[:95]) == (-1, 0)  # a key shorter than its blocks cannot use it
    assert sent.find(np.r_[old, 1, 2]) == (0, 96)
    assert sent.find(np.r_[old[:50], np.arange(200, dtype=np.int32)]) == (-1, 0)


def test_a_bad_token_fails_its_call_and_every_key_that_refers_to_it():
    """Every decoded key is a checked ``RadixKey``: a buffer with a bad id (a client bypassing ``RadixKey``)
    fails that key's call as the head does, and keys that refer to it later fail too."""
    head = CacheHead(HeadConfig(tree=TreeConfig(PS, 64)))
    sent, history = SentKeys(), KeyHistory(0, DEFAULT_CAP_TOKENS)
    first = np.arange(1, 33, dtype=np.int32)
    header, buf, keys = wire.encode_calls([Call(Method.MATCH_PREFIX, RadixKey(first))], sent)
    buf[3] = -7  # as if the client had sent an id RadixKey refuses
    (entry,) = wire.decode_results(*wire.run_step(head, header, buf, history), [None])
    assert not entry.ok and isinstance(entry.error, ValueError) and "-7" in str(entry.error)
    sent.commit_copies(keys)
    longer = np.arange(1, 49, dtype=np.int32)  # refers to the tainted entry, clean buffer of its own
    header, buf, _ = wire.encode_calls([Call(Method.MATCH_PREFIX, RadixKey(longer))], sent)
    assert header[0][2] >= 0 and not (buf < 0).any()
    (entry,) = wire.decode_results(*wire.run_step(head, header, buf, history), [None])
    assert not entry.ok and isinstance(entry.error, ValueError) and "-7" in str(entry.error)
    assert head.tree.stats() == CacheHead(HeadConfig(tree=TreeConfig(PS, 64))).tree.stats()  # nothing inserted
    # A clean session answers exactly as the head does.
    clean = KeyHistory(1, DEFAULT_CAP_TOKENS)
    header, buf, _ = wire.encode_calls([Call(Method.MATCH_PREFIX, RadixKey(longer, "t"))], SentKeys())
    (entry,) = wire.decode_results(*wire.run_step(head, header, buf, clean), [None])
    assert entry.ok and entry.value.device_hit_len == 0


def test_find_verifies_every_token_and_keeps_private_copies():
    """The index only narrows candidates (an entry's length and last token): a key that ends a block with the
    same token at the same place but differs earlier is not matched to it; a committed array may be reused."""
    sent = SentKeys()
    base = np.arange(100, 164, dtype=np.int32)  # 4 whole blocks
    entry = np.r_[base, np.arange(500, 532, dtype=np.int32)]  # 6 whole blocks
    sent.commit_copies([base, entry])
    entry[:] = -1  # serving code reuses its array: the history kept its own copy
    twin = np.r_[base, np.arange(500, 532, dtype=np.int32)]
    twin[70] = 1  # same length, same last token, differs inside block 4
    assert sent.find(np.r_[twin, 7, 8, 9]) == (0, 64)  # only ``base`` is a prefix
    assert sent.find(np.r_[base, np.arange(500, 532, dtype=np.int32), 7]) == (1, 96)
    assert sent.find(np.r_[base[:-1], 0, np.arange(500, 532, dtype=np.int32)]) == (-1, 0)


def test_the_heads_history_keys_are_private_copies_of_the_request():
    """A step's keys are resolved into new arrays (not views of the request buffer, which also holds
    pages): the buffer may be reused, the history's entries stay the tokens that were sent."""
    head = CacheHead(HeadConfig(tree=TreeConfig(PS, 256)))
    sent, history = SentKeys(), KeyHistory(0, DEFAULT_CAP_TOKENS)
    first, second = np.arange(1, 41, dtype=np.int32), np.arange(100, 133, dtype=np.int32)
    calls = [Call(Method.MATCH_PREFIX, RadixKey(first)), Call(Method.ALLOC, 8), Call(Method.MATCH_PREFIX, RadixKey(second))]
    header, buf, keys = wire.encode_calls(calls, sent)
    assert wire.run_step(head, header, buf, history) is not None
    sent.commit_copies(keys)
    buf[:] = 0
    np.testing.assert_array_equal(history.get(0, 40), first)
    np.testing.assert_array_equal(history.get(1, 33), second)
    longer = np.r_[second, np.arange(7, 30, dtype=np.int32)]  # refers to entry 1 (32 tokens) + 24 literal
    header, buf, keys = wire.encode_calls([Call(Method.MATCH_PREFIX, RadixKey(longer))], sent)
    assert header[0][2:4] == (1, 32)
    (res,) = wire.decode_results(*wire.run_step(head, header, buf, history), [None])
    assert res.ok and res.value.device_hit_len == 0
    buf[:] = 0
    np.testing.assert_array_equal(history.get(2, longer.shape[0]), longer)


def test_find_picks_the_longest_of_entries_that_share_an_anchor_and_checks_each():
    """Entries are indexed at their last block at a multiple of ``ANCHOR``: a prompt and its finished
    sequence share one, as do conversations with a common system prompt; a find checks each candidate
    (longest valid wins) and an entry dropped from a full anchor list is never used, never wrong."""
    from hicache.cluster.key_history import ANCHOR, BLOCK, MAX_CANDIDATES

    sent = SentKeys()
    system = np.arange(1, 1 + 4 * ANCHOR * BLOCK, dtype=np.int32)  # 4 anchors' worth of shared prefix
    prompt = np.r_[system, np.arange(5000, 5000 + 2 * BLOCK, dtype=np.int32)]  # 2 blocks past the last anchor
    seq = np.r_[prompt, np.arange(6000, 6000 + 3 * BLOCK, dtype=np.int32)]  # same anchor as ``prompt``
    other = np.r_[system, np.arange(7000, 7000 + 4 * BLOCK, dtype=np.int32)]  # same anchor block, other tokens
    sent.commit_copies([prompt, seq, other])
    assert sent.find(np.r_[seq, 1, 2, 3]) == (1, seq.size)
    assert sent.find(np.r_[prompt, 9, 9]) == (0, prompt.size)
    assert sent.find(np.r_[other, np.arange(40 * BLOCK, dtype=np.int32)]) == (2, other.size)  # 5 anchors back
    assert sent.find(np.r_[system, 3, 3]) == (-1, 0)  # no entry ends inside ``system``
    # A full anchor list: the oldest candidates leave the index (they may still be entries).
    twins = [np.r_[system, np.full(BLOCK, 100, np.int32), np.full(BLOCK, 200 + i, np.int32)]  # one anchor block
              for i in range(MAX_CANDIDATES + 2)]
    sent.commit_copies(twins)
    first, last = 3, 3 + MAX_CANDIDATES + 1
    assert sent.find(np.r_[twins[0], 5]) == (-1, 0) and sent.get(first, 4) is not None
    assert sent.find(np.r_[twins[-1], 5]) == (last, twins[-1].size)


def test_a_history_of_short_or_empty_keys_stays_within_its_cap_on_both_sides():
    """Every entry is charged ``ENTRY_TOKENS`` besides its tokens, so empty keys cannot grow either side's
    history past ``cap_tokens / ENTRY_TOKENS`` entries; both sides keep the same ids."""
    from hicache.cluster.key_history import ENTRY_TOKENS

    cap = 10 * ENTRY_TOKENS
    sent, history = SentKeys(cap), KeyHistory(0, cap)
    empty = np.empty(0, np.int32)
    for _ in range(100):
        sent.commit_copies([empty, empty])
        history.commit([empty, empty])
    assert len(sent._entries) == len(history._entries) == 10 and sent.tokens == history.tokens == cap
    assert list(sent._entries) == list(history._entries) == list(range(190, 200))
    tokens = np.arange(1, 2 * ENTRY_TOKENS + 1, dtype=np.int32)
    sent.commit_copies([tokens])
    history.commit([tokens])
    assert sent.tokens == history.tokens <= cap and list(sent._entries) == list(history._entries)
    assert sent.find(np.r_[tokens, 5]) == (200, tokens.size)
    np.testing.assert_array_equal(history.get(200, tokens.size), tokens)
