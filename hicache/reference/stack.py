"""The embedded default stack in one process: head + one HostWorker + reference engine (+ L3 directory).

Who owns what: the ``HostWorker`` owns the L1 array (and L2 slots) and hosts the ``ModelRunner``
(``HostWorker.attach_model``), as on a TPU host (DESIGN.md §1); the scheduler reaches the model
through ``WorkerEngine``, which lends it the L1 array for each call (same thread as the transfers).
With ``l2_slots == 0`` there is no worker and no host tier: the runner owns L1 alone. L3, when set, is an fsspec URL shared by every
process that uses the same model fingerprint.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import jax
import numpy as np

from hicache.cluster import CacheHead, HeadConfig
from hicache.cluster.client import CacheClient, EmbeddedTransport
from hicache.cluster.policy import HiCacheConfig, WritePolicy
from hicache.cluster.storage_tier import PrefetchPolicy, StorageParams
from hicache.cluster.tree import TreeConfig
from hicache.cluster.worker_group import LocalWorkerGroup
from hicache.reference.engine.config import ForwardConfig, ModelConfig, numerics_key
from hicache.reference.engine.kv_layout import LAYOUT_VERSION
from hicache.reference.engine.runner import ModelRunner
from hicache.reference.engine_adapters import WorkerEngine
from hicache.reference.scheduler import Scheduler
from hicache.reference.serve_types import ServeRequest
from hicache.storage import ModelFingerprint


@dataclass(frozen=True)
class StackOptions:
    model: ModelConfig = field(default_factory=ModelConfig)
    forward: ForwardConfig = field(default_factory=ForwardConfig)
    l1_pages: int = 256
    l2_slots: int = 0  # 0: no host tier
    l3_url: str | None = None  # None: no L3 (needs l2_slots > 0)
    write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH
    prefetch_policy: PrefetchPolicy | str = PrefetchPolicy.WAIT_COMPLETE
    prefetch_min_tokens: int = 32
    # Pages per L3 object: fewer objects than one per page (L3 round trips are per object), but a
    # query that ends inside an object cannot name it, so small objects keep those misses short.
    pages_per_object: int = 4
    prefill_budget: int = 0

    def __post_init__(self) -> None:
        if self.l1_pages < 1 or self.l2_slots < 0:
            raise ValueError(f"need l1_pages >= 1 and l2_slots >= 0, got {self.l1_pages}, {self.l2_slots}")
        if self.l3_url is not None and self.l2_slots == 0:
            raise ValueError("L3 needs an L2 tier to stage through: set l2_slots > 0")


def fingerprint_for(model: ModelConfig, forward: ForwardConfig, mesh_shape: tuple[int, ...] = (1,),
                    backend: str | None = None) -> ModelFingerprint:
    """L3 identity of the reference engine's KV: everything its bits depend on (``numerics_key``),
    for a pool on a mesh of ``mesh_shape`` on ``backend`` (default: this process's)."""
    key = numerics_key(model, forward, backend or jax.default_backend(), mesh_shape)
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return ModelFingerprint(f"hicache-ref-{digest}", model.dtype, forward.page_size, model.num_layers,
                            model.num_kv_heads, model.head_dim, LAYOUT_VERSION)


@dataclass
class EmbeddedStack:
    options: StackOptions
    head: CacheHead
    client: CacheClient
    runner: ModelRunner
    scheduler: Scheduler
    worker: object | None = None  # hicache.workers.HostWorker


def build_stack(options: StackOptions, runner: ModelRunner | None = None) -> EmbeddedStack:
    """Builds the stack; pass ``runner`` to reuse compiled params across stacks (its pool is replaced)."""
    ps = options.forward.page_size
    tree = TreeConfig(page_size=ps, capacity_pages=options.l1_pages)
    if options.l2_slots == 0:
        head = CacheHead(HeadConfig(tree=tree))
        if runner is None or runner.num_pages != options.l1_pages:
            runner = ModelRunner(options.model, options.forward, num_pages=options.l1_pages,
                                 params=None if runner is None else runner.params)
        client = CacheClient(EmbeddedTransport(head), ps)
        sched = Scheduler(client, runner, prefill_budget=options.prefill_budget)
        return EmbeddedStack(options, head, client, runner, sched)
    from hicache.workers import HostWorker, KVCacheSpec

    m = options.model
    spec = KVCacheSpec(m.num_layers, m.num_kv_heads, m.head_dim, ps, m.dtype)
    worker = HostWorker(spec, options.l1_pages, options.l2_slots, devices=jax.devices()[:1])
    hicache = HiCacheConfig(host_slots=options.l2_slots, write_policy=options.write_policy)
    head = CacheHead(HeadConfig(tree=tree, hicache=hicache), LocalWorkerGroup([worker]))
    params = None if runner is None else runner.params
    attached = worker.attach_model(lambda kv: ModelRunner(m, options.forward, pool=kv, params=params))
    assert isinstance(attached, ModelRunner)
    if options.l3_url is not None:
        mesh_shape = tuple(worker.device_pool.mesh.devices.shape)
        head.attach_storage_backend(StorageParams(
            options.l3_url, fingerprint_for(m, options.forward, mesh_shape), prefetch_policy=options.prefetch_policy,
            prefetch_min_tokens=options.prefetch_min_tokens, pages_per_object=options.pages_per_object))
    client = CacheClient(EmbeddedTransport(head), ps)
    sched = Scheduler(client, WorkerEngine(worker), hicache=True,
                      storage=options.l3_url is not None, prefill_budget=options.prefill_budget,
                      l3_min_tokens=options.prefetch_min_tokens, hold_storage_writes=True)
    return EmbeddedStack(options, head, client, attached, sched, worker)


WARM_UP_SALT = "hicache-warm-up"


def warm_up(stack: EmbeddedStack, max_pages: int | None = None) -> list[int]:
    """Compiles, before anything is timed, what the first requests would otherwise compile inside
    their TTFT: the forward and, with a host tier, the L2->L1 load of every transfer bucket (powers
    of two up to ``max_pages``; default: what one request can hold in L1) with the L1->L2 backups
    before it. Each bucket: a request of that many pages, its backup flushed, L1 emptied, the request
    again (an L2 hit loaded back). Runs in a namespace of its own (``cache_salt=WARM_UP_SALT``): it
    shares no cache entry with real requests and its entries are evicted like any cold ones; its
    transfers count in ``cache_stats`` (snapshot them after the warm-up to leave them out).

    Returns the pages loaded back from L2 per bucket (``[]`` without a host tier)."""
    opts = stack.options
    ps = opts.forward.page_size
    fit = min(opts.forward.max_pages, opts.l1_pages) - 1  # its pages + the one its answer starts
    limit = fit if max_pages is None else min(max_pages, fit)
    if limit < 1:
        raise ValueError(f"warm_up: no request fits (max_pages={max_pages}, L1 {opts.l1_pages} pages)")
    rng = np.random.default_rng(0)
    loaded: list[int] = []
    n = 1
    while True:
        req = ServeRequest(rng.integers(0, opts.model.vocab_size, n * ps + 1, dtype=np.int32), 1,
                           cache_salt=WARM_UP_SALT)
        stack.scheduler.serve(req)
        if opts.l2_slots:
            stack.client.flush_write_through_acks()
            stack.client.evict(opts.l1_pages * ps)
            loaded.append(stack.scheduler.serve(req).loaded_tokens // ps)
        if n >= limit:
            return loaded
        n = min(2 * n, limit)
