"""Property test: random scheduler traffic against a brute-force prefix model.

Checked after every step: hit lengths equal the model's; every L1 page is owned exactly once (tree,
a running request, or the free list); evictable + protected = tree pages; tree + request + free pages =
capacity; prefixes locked by running requests are never evicted; eviction removes only unlocked
extensions (the cached set stays prefix-closed); bad input changes nothing.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from support.tree_model import model_hit, snapshot, tree_prefixes

from hicache.cluster.tree import (
    CacheCapacityError,
    EvictionPolicy,
    InsertParams,
    PageOwner,
    RadixKey,
    RadixTree,
    RequestState,
    TreeConfig,
)

NAMESPACES = [(None, None), ("lora", None), (None, "salt")]
tokens_st = st.lists(st.integers(0, 3), min_size=0, max_size=14)


class TreeMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        capacity=st.integers(6, 40),
        policy=st.sampled_from(list(EvictionPolicy)),
    )
    def setup(self, page_size, capacity, policy):
        self.ps = page_size
        self.capacity = capacity
        self.tree = RadixTree(TreeConfig(page_size, capacity, policy))
        self.model: dict[tuple, int] = {}  # cached whole-page prefixes -> page id
        self.requests: list[RequestState] = []  # running requests (locked, holding pages)
        self.loose: list[np.ndarray] = []  # pages from bare alloc() calls

    # -- rules ----------------------------------------------------------------------------------
    @rule(tokens=tokens_st, ns=st.sampled_from(NAMESPACES), extra=st.integers(0, 5))
    def start_request(self, tokens, ns, extra):
        key = RadixKey(np.asarray(tokens, dtype=np.int32), *ns)
        m = self.tree.match_prefix(key)
        assert m.device_hit_len == model_hit(self.model, ns, tokens, self.ps)
        assert m.host_hit_len == 0
        assert m.device_pages.size * self.ps == m.device_hit_len
        assert [self.model[(ns, *tokens[: (i + 1) * self.ps])] for i in range(m.device_pages.size)] == list(
            m.device_pages
        )
        self.tree.inc_lock_ref(m.last_device_node)
        try:
            own = self.tree.alloc(len(tokens) + extra - m.device_hit_len)
        except CacheCapacityError:
            self.tree.dec_lock_ref(m.last_device_node)
            self._resync_after_eviction()
            return
        self._resync_after_eviction()
        self.requests.append(RequestState(key, np.r_[m.device_pages, own].astype(np.int32), m.device_hit_len,
                                          m.last_device_node))

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 100), grow=tokens_st)
    def finish_request(self, i, grow):
        state = self.requests.pop(i % len(self.requests))
        ns = state.key.namespace
        tokens = [int(t) for t in state.key.token_ids]
        expected_prefix = model_hit(self.model, ns, tokens, self.ps)
        res = self.tree.cache_finished_req(state)
        assert res.new_prefix_len == expected_prefix
        self._model_insert(ns, tokens)

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 100))
    def chunk_request(self, i):
        j = i % len(self.requests)
        state = self.requests[j]
        ns = state.key.namespace
        tokens = [int(t) for t in state.key.token_ids]
        new = self.tree.cache_unfinished_req(state)
        self._model_insert(ns, tokens)
        whole = len(tokens) // self.ps * self.ps
        assert new.prefix_len == whole
        assert new.device_pages.size == state.device_pages.size
        self.requests[j] = new

    @rule(n=st.integers(0, 30))
    def evict(self, n):
        res = self.tree.evict(n)
        before = len(self.model)
        self._resync_after_eviction()
        assert (before - len(self.model)) * self.ps == res.evicted_tokens

    @rule(n=st.integers(0, 12))
    def bare_alloc(self, n):
        try:
            self.loose.append(self.tree.alloc(n))
        except CacheCapacityError:
            pass
        self._resync_after_eviction()

    @precondition(lambda self: self.loose)
    @rule(i=st.integers(0, 100))
    def bare_free(self, i):
        self.tree.free(self.loose.pop(i % len(self.loose)))

    @rule(kind=st.integers(0, 5), tokens=tokens_st)
    def bad_input(self, kind, tokens):
        before = snapshot(self.tree)
        tree_pages = list(self.model.values())
        try:
            if kind == 0:
                self.tree.dec_lock_ref(10**9)
            elif kind == 1 and tree_pages:
                self.tree.free([tree_pages[0]])
            elif kind == 2:
                free = np.flatnonzero(self.tree.full.allocator.owners(np.arange(self.capacity)) == PageOwner.FREE)
                if free.size == 0:
                    return
                self.tree.free(free[:1])
            elif kind == 3:
                self.tree.insert(InsertParams(RadixKey(np.asarray(tokens, dtype=np.int32)), np.zeros(0, np.int32)))
                if len(tokens) < self.ps:
                    return  # nothing to insert: legal no-op
            elif kind == 4 and self.requests:
                s = self.requests[0]
                self.tree.cache_finished_req(RequestState(s.key, s.device_pages, s.prefix_len + self.ps, s.last_node))
            elif kind == 5 and self.loose and self.loose[0].size:
                self.tree.free(np.r_[self.loose[0], self.loose[0][:1]])
            else:
                return
        except ValueError:
            pass
        else:
            raise AssertionError(f"bad input kind {kind} was accepted")
        assert snapshot(self.tree) == before

    # -- model --------------------------------------------------------------------------------------
    def _model_insert(self, ns, tokens):
        """The model's view after an insert is the tree's (page ids are the tree's choice); check it grew right."""
        now = tree_prefixes(self.tree)
        for p in range(1, len(tokens) // self.ps + 1):
            assert (ns, *tokens[: p * self.ps]) in now
        assert set(self.model) <= set(now)
        self.model = now

    def _resync_after_eviction(self):
        now = tree_prefixes(self.tree)
        assert set(now) <= set(self.model), "eviction added prefixes"
        for k, page in now.items():
            assert self.model[k] == page, "a cached page moved"
        for state in self.requests:  # locked prefixes survive
            ns = state.key.namespace
            toks = [int(t) for t in state.key.token_ids]
            for p in range(1, state.prefix_len // self.ps + 1):
                assert (ns, *toks[: p * self.ps]) in now
        for k in now:  # prefix-closed
            if len(k) - 1 > self.ps:
                assert k[: len(k) - self.ps] in now
        self.model = now

    # -- invariants ---------------------------------------------------------------------------------
    @invariant()
    def ownership(self):
        self.tree.check_invariants()
        alloc = self.tree.full.allocator
        owners = alloc.owners(np.arange(alloc.capacity))
        held = [s.device_pages[s.prefix_len // self.ps :] for s in self.requests] + self.loose
        held = np.concatenate(held) if held else np.empty(0, np.int32)
        assert np.unique(held).size == held.size, "a page is held twice"
        assert np.all(owners[held] == PageOwner.REQUEST)
        assert np.count_nonzero(owners == PageOwner.REQUEST) == held.size, "a request page leaked"
        tree_pages = np.asarray(list(self.model.values()), dtype=np.int64)
        assert np.all(owners[tree_pages] == PageOwner.TREE)
        st_ = self.tree.stats()
        assert st_.evictable_tokens + st_.protected_tokens == tree_pages.size * self.ps
        assert tree_pages.size + held.size + st_.free_pages == self.capacity


TreeMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_tree_matches_model = TreeMachine.TestCase
