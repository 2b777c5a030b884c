"""A real embedded HiCache setup for tests: head + one HostWorker (real JAX pools) + helpers.

``serve`` runs the scheduler's sequence for one request and writes the known KV pattern
(``kv_pattern``) into the pages the request computed, so loaded-back bytes can be checked exactly;
``serve_step`` does the same for a batch of requests in one scheduler step (their load-backs travel as
one op; a failed one falls back to recomputing).
With ``swa=SWAConfig(...)`` the head is a hybrid SWA+Full head and the worker keeps the SWA pool
(``ComponentPool("swa")``): requests write the pattern into their SWA pages too, and a hit is checked to
have exactly the right SWA KV in the window before its end (what an SWA layer reads).
With ``mamba=MambaConfig(...)`` the head is a hybrid Mamba+Full head and the worker keeps a state pool
(``ComponentPool("mamba")``, one state a page): a request starts from ``begin_request`` (after its
load-back, a match of L1 only), runs the copies the tree hands it on the real pool, writes the known state
of its last whole page into its working slot and caches it there (``cache_unfinished_req``); a hit is
checked to come with exactly the state of its tokens (``state_rows``).
``FaultyWorkers`` wraps the real worker group to delay acks and turn chosen acks into failures (a
host that failed its copy); the bytes still move on the real pools.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import numpy as np
from support.kv_pattern import page_rows, prefix_codes

from hicache.cluster import CacheHead, HeadConfig
from hicache.cluster.begin import BeginParams
from hicache.cluster.builder import MambaConfig, SWAConfig
from hicache.cluster.controller import LoadBackParams
from hicache.cluster.policy import HiCacheConfig
from hicache.cluster.storage_tier import PrefetchParams, PrefetchState, StorageParams
from hicache.cluster.tree import RadixKey, RequestState, TreeConfig
from hicache.cluster.worker_group import LocalWorkerGroup
from hicache.storage import ModelFingerprint
from hicache.workers import ComponentPool, HostWorker, KVCacheSpec, OpKind, TransferAck, TransferPlan


def make_spec(page_size: int) -> KVCacheSpec:
    return KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, page_size=page_size, dtype="float32")


@dataclass
class FaultyWorkers:
    """Real workers; acks may be held back for a few polls and chosen op kinds may fail."""

    inner: LocalWorkerGroup
    fail_kinds: tuple[OpKind, ...] = ()
    fail_rate: float = 0.0
    delay_polls: int = 0
    seed: int = 0
    _kinds: dict[int, OpKind] = field(default_factory=dict)
    _held: list[list] = field(default_factory=list)  # [polls left, ack]

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    @property
    def num_hosts(self) -> int:
        return self.inner.num_hosts

    def __getattr__(self, name: str):  # the L3 calls (attach_storage, storage_exists, ...) pass through
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def submit(self, plan: TransferPlan) -> None:
        for op in plan.ops:
            self._kinds[op.op_id] = op.kind
        self.inner.submit(plan)

    def _filter(self, acks: list[TransferAck], flush: bool) -> list[TransferAck]:
        for ack in acks:
            kind = self._kinds.pop(ack.op_id, None)
            if kind in self.fail_kinds and self._rng.random() < self.fail_rate:
                ack = replace(ack, ok=False, error="injected failure")
            self._held.append([self._rng.randint(0, self.delay_polls), ack])
        out, keep = [], []
        for item in self._held:
            if flush or item[0] <= 0:
                out.append(item[1])
            else:
                item[0] -= 1
                keep.append(item)
        self._held = keep
        return out

    def poll(self) -> list[TransferAck]:
        return self._filter(self.inner.poll(), flush=False)

    def wait(self, timeout_s: float, op_ids=None) -> list[TransferAck]:
        return self._filter(self.inner.wait(timeout_s, op_ids), flush=True)


class HiCacheEnv:
    def __init__(self, page_size: int = 4, device_pages: int = 32, host_slots: int = 64,
                 write_policy: str = "write_through", load_back_threshold: int = 0, faults: dict | None = None,
                 storage_url: str | None = None, model_id: str = "test-model", storage_kwargs: dict | None = None,
                 load_lock: bool = False, swa: SWAConfig | None = None, mamba: MambaConfig | None = None,
                 ack_timeout_s: float = 10.0):
        self.ps = page_size
        self.load_lock = load_lock  # load-backs lock the prefix they return (LoadBackParams.lock)
        self.spec = make_spec(page_size)
        config = HeadConfig(
            tree=TreeConfig(page_size=page_size, capacity_pages=device_pages),
            hicache=HiCacheConfig(host_slots=host_slots, write_policy=write_policy,
                                  load_back_threshold=load_back_threshold, ack_timeout_s=ack_timeout_s),
            components=tuple(c for c in (swa, mamba) if c is not None),
        )
        pools: tuple[ComponentPool, ...] = ()
        self.swa = swa
        self.mamba = mamba
        if swa is not None:
            assert swa.num_tokens is not None
            self.swa_spec = KVCacheSpec(1, 2, 4, page_size, "float32")  # one sliding-window layer
            pools = (ComponentPool("swa", self.swa_spec, swa.num_tokens // page_size,
                                   config.component_host_slots()["swa"]),)
        if mamba is not None:
            assert mamba.num_slots is not None
            self.state_spec = KVCacheSpec(1, 2, 2, 1, "float32")  # one recurrent layer, a state a page
            pools += (ComponentPool("mamba", self.state_spec, mamba.num_slots,
                                    config.component_host_slots()["mamba"]),)
        self.worker = HostWorker(self.spec, device_pages, host_slots, component_pools=pools)
        group = LocalWorkerGroup([self.worker])
        self.workers = FaultyWorkers(group, **faults) if faults else group
        self.head = CacheHead(config, self.workers)
        self.row_shape = self.spec.page_shape
        self.fingerprint = ModelFingerprint(model_id, "float32", page_size, self.spec.num_layers,
                                            self.spec.num_kv_heads, self.spec.head_dim)
        self.storage = storage_url is not None
        self._req = 0
        if self.storage:
            kwargs = {"prefetch_min_tokens": page_size, "pages_per_object": 2, **(storage_kwargs or {})}
            self.head.attach_storage_backend(StorageParams(storage_url, self.fingerprint, **kwargs))
            self.settle_l3()

    def settle_l3(self) -> None:
        """Waits for L3's background attach work (warm restart) and applies it: the tests see the tree
        as a head whose background listing finished before the next request."""
        storage = self.head.controller.storage
        assert storage is None or storage.settle(60.0)

    def rows(self, tokens: np.ndarray, first_page: int, num_pages: int) -> np.ndarray:
        return page_rows(tokens, first_page, num_pages, self.row_shape, self.ps)

    def _write(self, tokens: np.ndarray, own: np.ndarray, first_page: int) -> None:
        """'Computes' the request's own pages: Full KV, and SWA KV in their SWA pages (hybrid)."""
        self.worker.device_pool.write_pages(own, self.rows(tokens, first_page, own.size))
        if self.swa is not None:
            swa_pages = self.head.swa_pages(own)
            assert (swa_pages >= 0).all()  # a request's own pages all map an SWA page
            self.worker.pools["swa"][0].write_pages(
                swa_pages, page_rows(tokens, first_page, own.size, self.swa_spec.page_shape, self.ps))

    def _check_hit(self, tokens: np.ndarray, pages: np.ndarray, hit: int) -> None:
        """The cached prefix holds exactly the KV of these tokens (and, hybrid, the window's SWA KV)."""
        ps = self.ps
        np.testing.assert_array_equal(self.worker.device_pool.read_pages(pages), self.rows(tokens, 0, hit // ps))
        if self.swa is not None:
            first = max(0, hit - self.swa.window) // ps
            swa_pages = self.head.swa_pages(pages[first:])
            assert (swa_pages >= 0).all(), f"SWA KV of the window before {hit} is gone: {swa_pages}"
            np.testing.assert_array_equal(
                self.worker.pools["swa"][0].read_pages(swa_pages),
                page_rows(tokens, first, hit // ps - first, self.swa_spec.page_shape, ps))

    # -- Mamba (``mamba=``) ------------------------------------------------------------------------------
    def state_rows(self, tokens: np.ndarray, n: int) -> np.ndarray:
        """The known 'state' after ``tokens[:n]``: [1, L, 2, 1, H, D] (a function of the whole prefix)."""
        row = np.zeros((1, *self.state_spec.page_shape), dtype=np.float32)
        row[..., 0] = 0 if n == 0 else prefix_codes(tokens[:n])[-1]
        row[..., 1] = n
        return row

    def _states(self):
        return self.worker.pools["mamba"][0]

    def _copy_states(self, copies) -> None:
        pool = self._states()
        for src, dst in copies:
            pool.write_pages([dst], pool.read_pages([src]))

    def serve_mamba(self, tokens, load_back: bool = True):
        """``serve`` for a Mamba+Full head: match; load the L2 part back (its state with it); start the request
        from a match of L1 only (``BeginParams.l1_only``), check its Full KV and the state it copies; compute
        and cache its last whole page's state (``cache_unfinished_req``), finish. Returns ``serve``'s stats."""
        tokens = np.asarray(tokens, dtype=np.int32)
        head, ps = self.head, self.ps
        key = RadixKey(tokens)
        m, prefetched = self._prefetch(key, head.match_prefix(key))
        loaded, load_failed, load_node = 0, False, None
        if load_back and m.host_hit_len:
            r = head.init_load_back(LoadBackParams(m.best_match_node, m.host_hit_len, lock=self.load_lock))
            if self.load_lock:
                load_node = r.last_node  # locked, loaded or not: released once the request holds its own lock
            if r.load_id >= 0:
                load_failed = not head.wait_load_back(r.load_id)
                loaded = 0 if load_failed else r.loaded_tokens
        if load_node is not None:  # (before the request's own lock and alloc, as the scheduler does)
            head.dec_lock_ref(load_node)
        b = head.begin_request(BeginParams(key, len(tokens), l1_only=True))
        pages, hit, node, comps = b.match.device_pages, b.match.device_hit_len, b.match.last_device_node, b.components
        value = comps["mamba"]
        assert hit == 0 or value.copies, f"a hit of {hit} tokens without a state to continue from"
        assert not value.copies or value.copies[0][1] == value.slot
        if hit:
            self._check_hit(tokens, pages, hit)
            np.testing.assert_array_equal(self._states().read_pages([value.copies[0][0]]), self.state_rows(tokens, hit))
        self._copy_states(value.copies)
        own = b.pages
        assert own is not None
        if own.size:
            self._write(tokens, own, hit // ps)
        table = np.concatenate([pages, own])
        whole = len(tokens) - len(tokens) % ps
        # the request's state where its key leaves the tree (siblings share it) and after its last whole page,
        # each cached at that node end (as the scheduler's ``_state_cuts``)
        for cut in sorted({value.branching_seqlen // ps * ps, whole}):
            if not hit < cut <= whole:
                continue
            self._states().write_pages([value.slot], self.state_rows(tokens, cut))
            state = head.cache_unfinished_req(RequestState(RadixKey(tokens[:cut]), table, hit, node, 0, comps))
            self._copy_states(state.components["mamba"].copies)
            table, hit, node, comps = state.device_pages, state.prefix_len, state.last_node, state.components
            value = comps["mamba"]
        head.cache_finished_req(RequestState(key, table, hit, node, 0, comps))
        return {"device_hit": b.match.device_hit_len - loaded, "loaded": loaded, "load_failed": load_failed,
                "host_hit": m.host_hit_len, "prefetched": prefetched}

    def _prefetch(self, key: RadixKey, m):
        """With L3: the pages past the match that L3 holds, fetched into L2 (waited for); the match again."""
        ps = self.ps
        tokens = key.token_ids
        if not self.storage or m.device_hit_len + m.host_hit_len >= len(tokens) - len(tokens) % ps:
            return m, 0
        self._req += 1
        req = f"r{self._req}"
        self.head.prefetch_from_storage(PrefetchParams(req, key, m.best_match_node))
        # the existence query answered before the check: a request's query wait (``query_wait_max_s``) ends
        # on a busy box before a thread answers, and the test would then fetch nothing, by timing
        assert self.head.controller.storage.settle(60.0)
        progress = self.head.check_prefetch_progress(req)
        if progress.state is PrefetchState.DONE:
            return self.head.match_prefix(key), progress.tokens
        return m, 0

    def serve(self, tokens, load_back: bool = True):
        """Match (+ load-back), lock, alloc, 'compute' the missing pages, finish. Returns stats."""
        if self.mamba is not None:
            return self.serve_mamba(tokens, load_back)
        tokens = np.asarray(tokens, dtype=np.int32)
        head, ps = self.head, self.ps
        key = RadixKey(tokens)
        m, prefetched = self._prefetch(key, head.match_prefix(key))
        pages, hit, node, loaded, load_failed = m.device_pages, m.device_hit_len, m.last_device_node, 0, False
        locked = False
        if load_back and m.host_hit_len:
            r = head.init_load_back(LoadBackParams(m.best_match_node, m.host_hit_len, lock=self.load_lock))
            locked = self.load_lock  # then r.last_node comes locked, loaded or not
            if r.load_id >= 0 or locked:
                pages, hit, node, loaded = r.device_pages, r.device_hit_len, r.last_node, r.loaded_tokens
            if r.load_id >= 0 and not head.wait_load_back(r.load_id):
                load_failed = True
                m = head.tree.match_prefix(key, use_host=False)  # what L1 serves alone (hybrid: a live window)
                pages, hit, node, loaded = m.device_pages, m.device_hit_len, m.last_device_node, 0
                if locked:  # the lock moves to the prefix that is left
                    head.inc_lock_ref(node)
                    head.dec_lock_ref(r.last_node)
        if not locked:
            head.inc_lock_ref(node)
        # The cached prefix must hold exactly the KV of these tokens.
        if hit:
            self._check_hit(tokens, pages, hit)
        own = head.alloc(len(tokens) - hit)
        if own.size:
            self._write(tokens, own, hit // ps)
        head.cache_finished_req(RequestState(key, np.concatenate([pages, own]), hit, node))
        return {"device_hit": hit - loaded, "loaded": loaded, "load_failed": load_failed,
                "host_hit": m.host_hit_len, "prefetched": prefetched}

    def serve_step(self, requests) -> list[dict]:
        """One scheduler step: match, start the load-back and lock every request, send the step's loads,
        allocate every request's own pages, wait for the loads, then check, 'compute' and finish each
        request in order. Returns ``serve``'s stats per request. (Mamba: one ``serve`` per request.)"""
        if self.mamba is not None:
            return [self.serve(tokens) for tokens in requests]
        head, ps = self.head, self.ps
        batch = []
        for tokens in requests:
            tokens = np.asarray(tokens, dtype=np.int32)
            m = head.match_prefix(RadixKey(tokens))
            pages, hit, node, loaded, load_id = m.device_pages, m.device_hit_len, m.last_device_node, 0, -1
            locked = False
            if m.host_hit_len:
                r = head.init_load_back(LoadBackParams(m.best_match_node, m.host_hit_len, lock=self.load_lock))
                locked = self.load_lock  # then r.last_node comes locked, loaded or not
                if r.load_id >= 0 or locked:
                    pages, hit, node, loaded, load_id = (r.device_pages, r.device_hit_len, r.last_node,
                                                         r.loaded_tokens, r.load_id)
            if not locked:
                head.inc_lock_ref(node)
            batch.append([tokens, m, pages, hit, node, loaded, load_id])
        head.ready_to_load_host_cache()
        owns = [head.alloc(len(req[0]) - req[3]) for req in batch]
        out = []
        for (tokens, m, pages, hit, node, loaded, load_id), own in zip(batch, owns):
            failed = load_id >= 0 and not head.wait_load_back(load_id)
            if failed:  # the loaded part is recomputed: the request keeps only what L1 serves alone
                served = head.tree.servable_end(head.tree.node(m.last_device_node))
                head.inc_lock_ref(served.id)
                head.dec_lock_ref(node)
                served_len = head.tree.depth(served)
                own = np.concatenate([head.alloc(hit - served_len), own])
                pages, hit, node, loaded = m.device_pages[: served_len // ps], served_len, served.id, 0
            if hit:
                self._check_hit(tokens, pages, hit)
            if own.size:
                self._write(tokens, own, hit // ps)
            head.cache_finished_req(RequestState(RadixKey(tokens), np.concatenate([pages, own]), hit, node))
            out.append({"device_hit": hit - loaded, "loaded": loaded, "load_failed": failed,
                        "host_hit": m.host_hit_len})
        return out
