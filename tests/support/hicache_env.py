"""A real embedded HiCache setup for tests: head + one HostWorker (real JAX pools) + helpers.

``serve`` runs the scheduler's sequence for one request and writes the known KV pattern
(``kv_pattern``) into the pages the request computed, so loaded-back bytes can be checked exactly;
``serve_step`` does the same for a batch of requests in one scheduler step (their load-backs travel as
one op; a failed one falls back to recomputing).
With ``swa=SWAConfig(...)`` the head is a hybrid SWA+Full head and the worker keeps the SWA pool
(``ComponentPool("swa")``): requests write the pattern into their SWA pages too, and a hit is checked to
have exactly the right SWA KV in the window before its end (what an SWA layer reads).
``FaultyWorkers`` wraps the real worker group to delay acks and turn chosen acks into failures (a
host that failed its copy); the bytes still move on the real pools.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import numpy as np
from support.kv_pattern import page_rows

from hicache.cluster import CacheHead, HeadConfig
from hicache.cluster.builder import SWAConfig
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
                 load_lock: bool = False, swa: SWAConfig | None = None):
        self.ps = page_size
        self.load_lock = load_lock  # load-backs lock the prefix they return (LoadBackParams.lock)
        self.spec = make_spec(page_size)
        config = HeadConfig(
            tree=TreeConfig(page_size=page_size, capacity_pages=device_pages),
            hicache=HiCacheConfig(host_slots=host_slots, write_policy=write_policy,
                                  load_back_threshold=load_back_threshold, ack_timeout_s=10.0),
            components=() if swa is None else (swa,),
        )
        pools = ()
        self.swa = swa
        if swa is not None:
            assert swa.num_tokens is not None
            self.swa_spec = KVCacheSpec(1, 2, 4, page_size, "float32")  # one sliding-window layer
            pools = (ComponentPool("swa", self.swa_spec, swa.num_tokens // page_size,
                                   config.component_host_slots()["swa"]),)
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

    def serve(self, tokens, load_back: bool = True):
        """Match (+ load-back), lock, alloc, 'compute' the missing pages, finish. Returns stats."""
        tokens = np.asarray(tokens, dtype=np.int32)
        head, ps = self.head, self.ps
        key = RadixKey(tokens)
        m = head.match_prefix(key)
        prefetched = 0
        if self.storage and m.device_hit_len + m.host_hit_len < len(tokens) - len(tokens) % ps:
            self._req += 1
            req = f"r{self._req}"
            head.prefetch_from_storage(PrefetchParams(req, key, m.best_match_node))
            progress = head.check_prefetch_progress(req)
            if progress.state is PrefetchState.DONE:
                prefetched = progress.tokens
                m = head.match_prefix(key)
        pages, hit, node, loaded, load_failed = m.device_pages, m.device_hit_len, m.last_device_node, 0, False
        locked = False
        if load_back and m.host_hit_len:
            r = head.init_load_back(LoadBackParams(m.best_match_node, m.host_hit_len, lock=self.load_lock))
            locked = self.load_lock  # then r.last_node comes locked, loaded or not
            if r.load_id >= 0 or locked:
                pages, hit, node, loaded = r.device_pages, r.device_hit_len, r.last_node, r.loaded_tokens
            if r.load_id >= 0 and not head.wait_load_back(r.load_id):
                load_failed = True
                m = head.match_prefix(key)
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
        request in order. Returns ``serve``'s stats per request."""
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
            if failed:  # the loaded part is recomputed: the request keeps only its L1 hit
                head.inc_lock_ref(m.last_device_node)
                head.dec_lock_ref(node)
                own = np.concatenate([head.alloc(hit - m.device_hit_len), own])
                pages, hit, node, loaded = m.device_pages, m.device_hit_len, m.last_device_node, 0
            if hit:
                self._check_hit(tokens, pages, hit)
            if own.size:
                self._write(tokens, own, hit // ps)
            head.cache_finished_req(RequestState(RadixKey(tokens), np.concatenate([pages, own]), hit, node))
            out.append({"device_hit": hit - loaded, "loaded": loaded, "load_failed": failed,
                        "host_hit": m.host_hit_len})
        return out
