"""Property tests per composition ([Full, SWA], [Full, Mamba], [Full, SWA, Mamba]) against brute force.

Random scheduler traffic (match, lock, begin_request, alloc, trim, chunked and finished caching, every
kind of eviction, bad input). Checked at every step:

- SWA: every hit's window [p - window, p) has SWA KV (page-level mapping), and the hit is the longest
  node end on the key's L1 path with that property; windows of running requests stay live; the Full hit
  before the SWA limit equals the prefix model's.
- Mamba: a simulated state store (slot -> the token sequence its state summarises) is driven by the
  copies the tree emits and by decode steps (the engine's track copy: before the forward at a page end,
  the track slot takes the working state): a hit's state is exactly the state of ``device_hit_len``
  tokens, every cached state is its node's prefix (so the tree adopted the right slot, working or
  track), the hit ends at the deepest L1 node with a state, a finished request whose working or track
  slot holds its last whole page's state leaves that page end a hit, two running requests never hold or
  write the same slot, and no copy writes a cached slot.
- Page ownership per pool (full pages, SWA pages, state slots): tree + requests + free = capacity.
- Bad input raises ValueError/TypeError and changes nothing.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from support.hybrid_model import node_pages, node_prefix, path_ends, root_ns, window_live
from support.tree_model import model_hit, snapshot, tree_prefixes

from hicache.cluster.builder import KVCacheConfig, MambaConfig, SWAConfig, build_kv_cache
from hicache.cluster.tree import (
    CacheCapacityError,
    MambaRequest,
    PageOwner,
    RadixKey,
    RequestState,
    TreeConfig,
)

NAMESPACES = [(None, None), ("lora", None)]
tokens_st = st.lists(st.integers(0, 2), min_size=0, max_size=16)


class HybridMachine(RuleBasedStateMachine):
    components: tuple[str, ...] = ("full", "swa")

    @initialize(
        page_size=st.sampled_from([1, 2]),
        capacity=st.integers(10, 40),
        window=st.integers(1, 6),
        swa_cap=st.sampled_from([None, 6, 12]),
        slots=st.sampled_from([None, 3, 6]),
    )
    def setup(self, page_size, capacity, window, swa_cap, slots):
        self.ps = page_size
        self.capacity = capacity
        self.has_swa = "swa" in self.components
        self.has_mamba = "mamba" in self.components
        cfg = KVCacheConfig(
            TreeConfig(page_size, capacity),
            self.components,
            swa=SWAConfig(window, swa_cap * page_size if swa_cap else None) if self.has_swa else None,
            mamba=MambaConfig(slots) if self.has_mamba else None,
        )
        self.tree = build_kv_cache(cfg)
        self.swa = self.tree.component("swa") if self.has_swa else None
        self.mamba = self.tree.component("mamba") if self.has_mamba else None
        self.requests: list[RequestState] = []
        self.granted: list[bool] = []  # True: the request's lock came from a match (its SWA window is live)
        self.tracked: list[int] = []  # per request: tokens whose state its decode last copied to its track slot
        self.content: dict[int, tuple] = {}  # simulated Mamba state store: slot -> (ns, tokens...)

    # -- helpers --------------------------------------------------------------------------------------
    def _run_copies(self, value: MambaRequest, ns, expect_src: tuple | None) -> None:
        for src, dst in value.copies:
            assert self.mamba.allocator.owners(np.array([dst]))[0] == PageOwner.REQUEST, "a copy writes a cached slot"
            if expect_src is not None:
                assert self.content.get(src) == expect_src, "copied state is not the matched length's"
            self.content[dst] = self.content[src]

    def _compute(self, state: RequestState) -> None:
        """The model forward: the request's working state now summarises all of its tokens."""
        if self.has_mamba:
            value = state.components["mamba"]
            self.content[value.slot] = (state.key.namespace, *(int(t) for t in state.key.token_ids))

    # -- rules ----------------------------------------------------------------------------------------
    @rule(tokens=tokens_st, ns=st.sampled_from(NAMESPACES), extra=st.integers(0, 4))
    def start_request(self, tokens, ns, extra):
        key = RadixKey(np.asarray(tokens, dtype=np.int32), *ns)
        full_hit = model_hit(tree_prefixes(self.tree), ns, tokens, self.ps)
        m = self.tree.match_prefix(key)
        p = m.device_hit_len
        assert p <= full_hit and m.device_pages.size * self.ps == p
        ends = path_ends(self.tree, ns, tokens, full_hit)
        assert (ends[-1][0] if ends else 0) == full_hit
        pages = node_pages(ends)
        np.testing.assert_array_equal(m.device_pages, pages[: p // self.ps])
        ok = [e for e, node in ends]
        if self.has_swa:
            assert window_live(self.swa, pages, p, self.ps), "SWA hit whose window KV is gone"
            ok = [e for e in ok if window_live(self.swa, pages, e, self.ps)]
        if self.has_mamba:
            mm = m.components["mamba"]
            assert mm.branching_seqlen == full_hit
            with_state = {e for e, node in ends if self.mamba.state_slot(node) >= 0}
            ok = [e for e in ok if e in with_state]
            if p:
                assert self.content[mm.state_slot] == (ns, *tokens[:p]), "state is not of the matched length"
            else:
                assert mm.state_slot == -1
        assert p == max([e for e in ok], default=0), f"hit {p} is not the longest acceptable end {ok}"
        self.tree.inc_lock_ref(m.last_device_node)
        try:
            values = self.tree.begin_request(m)
            try:
                own = self.tree.alloc(len(tokens) + extra - p)
            except CacheCapacityError:
                if self.has_mamba:
                    self.mamba.free_slot(values["mamba"].slot)
                    if values["mamba"].track >= 0:
                        self.mamba.free_slot(values["mamba"].track)
                raise
        except CacheCapacityError:
            self.tree.dec_lock_ref(m.last_device_node)
            return
        state = RequestState(key, np.r_[m.device_pages, own].astype(np.int32), p, m.last_device_node, 0, values)
        if self.has_mamba:
            self._run_copies(values["mamba"], ns, (ns, *tokens[:p]))
        self._compute(state)
        self.requests.append(state)
        self.granted.append(True)
        self.tracked.append(0)

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 100))
    def trim_request(self, i):
        state = self.requests[i % len(self.requests)]
        self.tree.trim_request(state)
        if self.has_swa:
            end = len(state.key) // self.ps * self.ps
            cut = max(0, (end - self.swa.window) // self.ps)
            k = state.prefix_len // self.ps
            if cut > k:  # out of the window: freed already, or spare (the first SWA pages reclaimed)
                out = np.asarray(state.device_pages[k:cut], dtype=np.intp)
                assert ((self.swa.translate(out) == -1) | self.swa.mapped.spare[out]).all()
            assert (self.swa.translate(state.device_pages[max(k, cut) : end // self.ps]) >= 0).all()

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 100), trim=st.booleans())
    def finish_request(self, i, trim):
        j = i % len(self.requests)
        state = self.requests.pop(j)
        self.granted.pop(j)
        tracked = self.tracked.pop(j)
        if trim:
            self.tree.trim_request(state)
        if self.has_mamba and tracked:  # the scheduler's claim: the state its decode left in the track slot
            value = dataclasses.replace(state.components["mamba"], track_len=tracked)
            state = dataclasses.replace(state, components={**state.components, "mamba": value})
        self.tree.cache_finished_req(state)
        whole = len(state.key) // self.ps * self.ps
        if self.has_mamba and whole and (whole == len(state.key) or tracked == whole):
            # its working (aligned key) or track slot held the last whole page's state: that end is a hit now
            assert self.tree.match_prefix(state.key.prefix(whole)).device_hit_len == whole

    @precondition(lambda self: self.requests and self.has_mamba)
    @rule(i=st.integers(0, 100), n=st.integers(1, 6))
    def decode_request(self, i, n):
        """The engine decodes ``n`` tokens one forward each: before the forward at a page end, the request's
        track slot (if it has one) takes a copy of its working state."""
        j = i % len(self.requests)
        state = self.requests[j]
        value = state.components["mamba"]
        tokens = [int(t) for t in state.key.token_ids]
        have = state.device_pages.size
        try:
            more = self.tree.alloc(max(0, -(-(len(tokens) + n) // self.ps) - have) * self.ps)
        except CacheCapacityError:
            return
        for k in range(n):
            pos = len(tokens)
            if value.track >= 0 and pos % self.ps == 0:
                assert self.mamba.allocator.owners(np.array([value.track]))[0] == PageOwner.REQUEST
                self.content[value.track] = self.content[value.slot]
                self.tracked[j] = pos
            tokens.append((i + k) % 3)
            self.content[value.slot] = (state.key.namespace, *tokens)
        key = RadixKey(np.asarray(tokens, dtype=np.int32), *state.key.namespace)
        self.requests[j] = RequestState(key, np.r_[state.device_pages, more].astype(np.int32), state.prefix_len,
                                        state.last_node, 0, state.components)

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 100), grow=tokens_st)
    def chunk_request(self, i, grow):
        j = i % len(self.requests)
        state = self.requests[j]
        new = self.tree.cache_unfinished_req(state)
        whole = len(state.key) // self.ps * self.ps
        assert new.prefix_len == whole
        np.testing.assert_array_equal(new.device_pages[whole // self.ps :], state.device_pages[whole // self.ps :])
        if self.has_mamba:
            old, value = state.components["mamba"], new.components["mamba"]
            self._run_copies(value, state.key.namespace, None)
            assert value.slot == old.slot or value.copies == ((old.slot, value.slot),)
            if value.track != old.track:  # the pool had no other slot: the request continues in its track slot
                assert value.track == -1 and value.slot == old.track
                self.tracked[j] = 0
        # the request grows: its key gets more tokens and it allocates pages for them
        tokens = [int(t) for t in state.key.token_ids] + list(grow)
        have = new.device_pages.size
        try:
            more = self.tree.alloc(max(0, -(-len(tokens) // self.ps) - have) * self.ps)
        except CacheCapacityError:
            more = np.empty(0, np.int32)
            tokens = tokens[: have * self.ps]
        key = RadixKey(np.asarray(tokens, dtype=np.int32), *state.key.namespace)
        grown = RequestState(key, np.r_[new.device_pages, more].astype(np.int32), new.prefix_len, new.last_node, 0,
                             new.components)
        self._compute(grown)
        self.requests[j] = grown
        self.granted[j] = False

    @rule(n=st.integers(0, 20), swa_n=st.integers(0, 12), mamba_n=st.integers(0, 3))
    def evict(self, n, swa_n, mamba_n):
        amounts = {}
        if self.has_swa:
            amounts["swa_num_tokens"] = swa_n
        if self.has_mamba:
            amounts["mamba_num"] = mamba_n
        res = self.tree.evict(n, **amounts)
        assert res.evicted_tokens >= 0

    @precondition(lambda self: self.has_swa)
    @rule(data=st.data(), secondary=st.booleans())
    def evict_swa_pages_no_hit_reads(self, data, secondary):
        """Window-aware SWA eviction, checked by brute force: freeing at most what its first phase offers
        (pages no hit point reads) keeps every node end that was a hit a hit; freeing at most what the
        first two offer (also pages only secondary hit points read) keeps every primary end a hit."""
        swa, ps = self.swa, self.ps
        offered = 0  # pages the first phase (or the first two) may free: live pages beyond the keep
        for _node, live, keep_all, keep_primary in swa.trims.scan():
            offered += max(0, live - (keep_primary if secondary else keep_all))
        if not offered:
            return
        amount = data.draw(st.integers(1, offered * ps))
        kept = {node.id: node for node, hit, primary in self._node_ends() if hit and (primary or not secondary)}
        res = self.tree.evict(0, swa_num_tokens=amount)
        assert res.components["swa_num_tokens"] >= amount
        ends = {node.id: hit for node, hit, _ in self._node_ends()}
        lost = [node for i, node in kept.items() if not ends.get(i)]
        assert not lost, f"an SWA eviction of {amount} tokens that no {'primary ' if secondary else ''}hit needed lost {lost}"

    def _node_ends(self):
        """(node, its end is a hit: the window before it has SWA KV, its end is primary: not one L1 child
        that goes on, with live SWA pages or children) for every L1 node (brute force over the path's pages)."""
        out = []
        for ns, root in self.tree.roots().items():
            stack = [(c, np.empty(0, np.int32)) for c in root.children.values()]
            while stack:
                node, above = stack.pop()
                if node.device_pages is None:
                    continue
                pages = np.r_[above, node.device_pages].astype(np.int32)
                end = pages.size * self.ps
                hit = window_live(self.swa, pages, end, self.ps) and self.swa.translate(pages[-1:])[0] >= 0
                kids = list(node.children.values())
                goes_on = len(kids) == 1 and kids[0].device_pages is not None and not kids[0].loading and (
                    bool(kids[0].children) or self.swa.translate(kids[0].device_pages[-1:])[0] >= 0)
                primary = not goes_on
                out.append((node, hit, primary))
                stack.extend((c, pages) for c in kids)
        return out

    @rule(kind=st.integers(0, 6))
    def bad_input(self, kind):
        before = snapshot(self.tree)
        swa_before = self.swa.mapped.swa_of.copy() if self.has_swa else None
        m_before = self.mamba.allocator.owners(np.arange(self.mamba.allocator.capacity)).copy() if self.has_mamba else None
        try:
            if kind == 0:
                self.tree.evict(1, bogus_num=1)
            elif kind == 1 and self.requests:
                s = self.requests[0]
                self.tree.cache_finished_req(RequestState(s.key, s.device_pages, s.prefix_len, s.last_node, 0,
                                                          {**s.components, "nope": 1}))
            elif kind == 2 and self.requests and self.has_mamba:
                s = self.requests[0]
                self.tree.cache_finished_req(RequestState(s.key, s.device_pages, s.prefix_len, s.last_node, 0,
                                                          {"mamba": "slot"}))
            elif kind == 3 and self.requests and self.has_mamba:
                s = self.requests[0]
                bad = MambaRequest(np.array([s.components["mamba"].slot, 0]))
                self.tree.cache_unfinished_req(RequestState(s.key, s.device_pages, s.prefix_len, s.last_node, 0,
                                                            {"mamba": bad}))
            elif kind == 4:
                self.tree.evict(-1)
            elif kind == 5 and self.has_swa:
                self.tree.evict(0, swa_num_tokens=-2)
            elif kind == 6 and self.requests and self.has_mamba:
                s = self.requests[0]
                bad = dataclasses.replace(s.components["mamba"], track_len=len(s.key) // self.ps * self.ps + self.ps)
                self.tree.cache_finished_req(RequestState(s.key, s.device_pages, s.prefix_len, s.last_node, 0,
                                                          {**s.components, "mamba": bad}))
            else:
                return
        except (ValueError, TypeError):
            pass
        else:
            raise AssertionError(f"bad input kind {kind} was accepted")
        assert snapshot(self.tree) == before
        if self.has_swa:
            np.testing.assert_array_equal(self.swa.mapped.swa_of, swa_before)
        if self.has_mamba:
            np.testing.assert_array_equal(self.mamba.allocator.owners(np.arange(self.mamba.allocator.capacity)), m_before)

    # -- invariants -------------------------------------------------------------------------------------
    @invariant()
    def ownership(self):
        if not hasattr(self, "tree"):
            return
        tree = self.tree
        tree.check_invariants()
        alloc = tree.full.allocator
        owners = alloc.owners(np.arange(alloc.capacity))
        held = [s.device_pages[s.prefix_len // self.ps :] for s in self.requests]
        held = np.concatenate(held) if held else np.empty(0, np.int32)
        assert np.unique(held).size == held.size, "a page is held twice"
        assert np.all(owners[held] == PageOwner.REQUEST)
        assert np.count_nonzero(owners == PageOwner.REQUEST) == held.size, "a request page leaked"
        st_ = tree.stats()
        assert st_.evictable_tokens + st_.protected_tokens + (held.size + st_.free_pages) * self.ps == (
            self.capacity * self.ps
        )
        if self.has_swa:
            swa = self.swa.allocator
            assert swa.count(PageOwner.REQUEST) == int((self.swa.translate(held) >= 0).sum())
            for s, granted in zip(self.requests, self.granted):  # a match-granted window keeps its SWA KV
                if s.prefix_len and granted:
                    ends = path_ends(tree, s.key.namespace, s.key.token_ids, s.prefix_len)
                    assert window_live(self.swa, node_pages(ends), s.prefix_len, self.ps), "a locked window lost SWA"
        if self.has_mamba:
            pool = self.mamba.allocator
            slots = [s.components["mamba"].slot for s in self.requests]
            slots += [t for s in self.requests if (t := s.components["mamba"].track) >= 0]  # their track slots
            assert len(set(slots)) == len(slots), "two running requests (or a working and a track slot) share a slot"
            assert all(pool.owners(np.array(slots, dtype=np.int32)) == PageOwner.REQUEST) if slots else True
            assert pool.count(PageOwner.REQUEST) == len(slots), "a request state slot leaked"
            for node in tree.iter_nodes():
                slot = self.mamba.state_slot(node)
                if slot >= 0:
                    assert self.content.get(slot) == (root_ns(tree, node), *node_prefix(node)), "cached state drifted"
            for s in self.requests:  # the state a request copies from is locked, so never evicted
                node = tree.node(s.last_node)
                if node.parent is not None and s.components["mamba"].copies and s.prefix_len:
                    assert self.mamba.state_slot(node) >= 0


class SWAMachine(HybridMachine):
    components = ("full", "swa")


class MambaMachine(HybridMachine):
    components = ("full", "mamba")


class SWASmallPoolMachine(HybridMachine):
    """SWA pools of a few pages (the Full pool larger): most allocations evict SWA KV, so every phase of the
    window-aware eviction runs (heads no hit reads, secondary ends, LRU windows)."""

    components = ("full", "swa")

    @initialize(page_size=st.sampled_from([1, 2]), capacity=st.integers(24, 40), window=st.integers(1, 6),
                swa_cap=st.integers(3, 9))
    def setup(self, page_size, capacity, window, swa_cap):
        HybridMachine.setup(self, page_size, capacity, window, swa_cap, None)


class SWAMambaMachine(HybridMachine):
    components = ("full", "swa", "mamba")


_settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
SWAMachine.TestCase.settings = _settings
MambaMachine.TestCase.settings = _settings
SWAMambaMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=30, deadline=None,
                                             suppress_health_check=[HealthCheck.too_slow])
SWASmallPoolMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None,
                                                 suppress_health_check=[HealthCheck.too_slow])
test_swa_matches_model = SWAMachine.TestCase
test_swa_small_pool_matches_model = SWASmallPoolMachine.TestCase
test_mamba_matches_model = MambaMachine.TestCase
test_swa_mamba_matches_model = SWAMambaMachine.TestCase
