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

from hicache.cluster import CacheHead, HeadConfig
from hicache.cluster.client import CacheClient, EmbeddedTransport
from hicache.cluster.policy import HiCacheConfig, WritePolicy
from hicache.cluster.storage_tier import PrefetchPolicy, StorageParams
from hicache.cluster.transfers import LocalWorkerGroup
from hicache.cluster.tree import TreeConfig
from hicache.engine.config import ForwardConfig, ModelConfig, numerics_key
from hicache.engine.kv_layout import LAYOUT_VERSION
from hicache.engine.runner import ModelRunner
from hicache.serving import Scheduler, WorkerEngine
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
    pages_per_object: int = 4  # L3 object = 4 pages: a prefix query finds all but < 4 pages of it
    prefill_budget: int = 0
    l3_overlap_pages: int = 0  # prefill pages computed while L3 is asked (Scheduler); 2 loses L3 hits in long_doc_qa (open)

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
    runner = worker.attach_model(lambda kv: ModelRunner(m, options.forward, pool=kv, params=params))
    if options.l3_url is not None:
        mesh_shape = tuple(worker.device_pool.mesh.devices.shape)
        head.attach_storage_backend(StorageParams(
            options.l3_url, fingerprint_for(m, options.forward, mesh_shape), prefetch_policy=options.prefetch_policy,
            prefetch_min_tokens=options.prefetch_min_tokens, pages_per_object=options.pages_per_object))
    client = CacheClient(EmbeddedTransport(head), ps)
    sched = Scheduler(client, WorkerEngine(worker), hicache=True,
                      storage=options.l3_url is not None, prefill_budget=options.prefill_budget,
                      l3_overlap_pages=options.l3_overlap_pages)
    return EmbeddedStack(options, head, client, runner, sched, worker)
