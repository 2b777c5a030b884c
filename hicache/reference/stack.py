"""The embedded default stack in one process: head + one HostWorker + reference engine (+ L3 directory).

Who owns what: the ``HostWorker`` owns the L1 array (and L2 slots) and hosts the ``ModelRunner``
(``HostWorker.attach_model``), as on a TPU host (DESIGN.md §1); the scheduler reaches the model
through ``WorkerEngine``, which lends it the L1 array for each call (same thread as the transfers).
With ``l2_slots == 0`` there is no worker and no host tier: the runner owns L1 alone. L3, when set, is an fsspec URL shared by every
process that uses the same model fingerprint.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace

import jax
import numpy as np

from hicache.cluster import CacheHead, HeadConfig
from hicache.cluster.builder import ComponentConfig, ComponentKind, MambaConfig, SWAConfig, components_of
from hicache.cluster.client import CacheClient, EmbeddedTransport
from hicache.cluster.cost_model import CostOptions
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
from hicache.workers.storage_exec import OpenStorage


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
    # The head's load-or-recompute choice for what L3 holds (None: ``CostOptions()``, measured on this
    # machine); a replay on a virtual clock turns it off, as its wall times are not that clock's.
    l3_cost: CostOptions | None = None
    # How long a request waits for its L3 existence answer (None: ``StorageParams.query_wait_max_s``); tests that
    # assert L3 hits wait long, so that the answer never loses to a busy box's thread scheduling.
    l3_query_wait_s: float | None = None
    prefill_budget: int = 0
    # The head's cache components besides Full; None: the model's (``model_components``: SWA for a model
    # with ``sliding_window``, sized ``swa_tokens``; Mamba for one with ``recurrent_layers``, ``state_slots``).
    components: tuple[ComponentConfig, ...] | None = None
    swa_tokens: int | None = None  # SWA pool tokens (None: as many as L1 holds)
    swa_host_tokens: int | None = None  # the SWA pages' L2 in tokens, with l2_slots (None: as many as Full's L2)
    state_slots: int | None = None  # recurrent state slots (None: l1_pages)
    state_host_slots: int | None = None  # the states' L2 in slots, with l2_slots (None: as many as Full's L2 pages)
    # How the worker opens L3 (None: ``FsspecStorage``); a replay passes a subclass that gates what this
    # replica sees of other replicas' writes by its virtual clock (benchmarks/routing_bench.py).
    open_storage: OpenStorage | None = None

    def __post_init__(self) -> None:
        if self.l1_pages < 1 or self.l2_slots < 0:
            raise ValueError(f"need l1_pages >= 1 and l2_slots >= 0, got {self.l1_pages}, {self.l2_slots}")
        check_components(self.model, self.head_components)  # ValueError naming what does not match
        if self.l3_url is not None and self.l2_slots == 0:
            raise ValueError("L3 needs an L2 tier to stage through: set l2_slots > 0")

    @property
    def head_components(self) -> tuple[ComponentConfig, ...]:
        if self.components is not None:
            return tuple(self.components)
        swa_tokens = self.l1_pages * self.forward.page_size if self.swa_tokens is None else self.swa_tokens
        return model_components(self.model, swa_tokens, self.l1_pages if self.state_slots is None else self.state_slots,
                                self.swa_host_tokens, self.state_host_slots)


def model_components(model: ModelConfig, swa_tokens: int | None = None, state_slots: int | None = None,
                     swa_host_tokens: int | None = None,
                     state_host_slots: int | None = None) -> tuple[ComponentConfig, ...]:
    """The cache components a reference model needs besides Full: SWA (the model's window) for sliding-
    window layers, Mamba (one f32[R, hidden] state per slot) for recurrent layers."""
    out: list[ComponentConfig] = []
    if model.swa_layers:
        assert model.sliding_window is not None  # swa_layers are those with a window
        out.append(SWAConfig(model.sliding_window, swa_tokens, swa_host_tokens))
    if model.recurrent_layers:
        out.append(MambaConfig(state_slots, ((len(model.recurrent_layers), model.hidden),), "float32",
                               state_host_slots))
    return tuple(out)


def check_components(model: ModelConfig, components: tuple[ComponentConfig, ...]) -> None:
    """``ValueError`` unless ``components`` hold what ``model`` reads when it continues a cached prefix:
    an SWA window >= the model's, a state per slot of the model's recurrent layers, and nothing else."""
    by_kind = components_of(components)
    swa, mamba = by_kind.get(ComponentKind.SWA), by_kind.get(ComponentKind.MAMBA)
    window = model.sliding_window or 0
    want = ((len(model.recurrent_layers), model.hidden),)
    checks = (  # (the model needs it, its config, the config fits, the layers, what the model needs, bound field)
        (bool(model.swa_layers), swa, isinstance(swa, SWAConfig) and swa.window >= window, "sliding-window layers",
         f"its sliding-window layers {model.swa_layers} read {window} tokens back: a swa component keeping them",
         "num_tokens"),
        (bool(model.recurrent_layers), mamba,
         isinstance(mamba, MambaConfig) and mamba.state_shapes == want and mamba.dtype == "float32", "recurrent layers",
         f"its recurrent layers {model.recurrent_layers} need a mamba component with state_shapes={want}, float32",
         "num_slots"),
    )
    for needed, config, fits, layers, need, bound in checks:
        if not needed:
            if config is not None:
                raise ValueError(f"{config.kind.value} component {config!r} given for a model without {layers}")
        elif config is None or not fits:
            raise ValueError(f"the model does not match the components: {need}; got {config!r}")
        elif getattr(config, bound) is None:
            raise ValueError(f"the engine's pools are bounded: the {config.kind.value} component needs {bound}")


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
    components = options.head_components
    by_kind = components_of(components)
    mamba, swa = by_kind.get(ComponentKind.MAMBA), by_kind.get(ComponentKind.SWA)
    swa_pages = swa.num_tokens // ps if isinstance(swa, SWAConfig) and swa.num_tokens else 0
    if options.l2_slots == 0:
        head = CacheHead(HeadConfig(tree=tree, components=components))
        slots = mamba.num_slots if isinstance(mamba, MambaConfig) and mamba.num_slots else 0
        if runner is None or _pools(runner) != (options.l1_pages, slots, swa_pages):
            runner = ModelRunner(options.model, options.forward, num_pages=options.l1_pages,
                                 params=None if runner is None else runner.params, state_slots=slots,
                                 swa_pages=swa_pages)
        client = CacheClient(EmbeddedTransport(head), ps)
        sched = Scheduler(client, runner, prefill_budget=options.prefill_budget, swa_tables=swa_pages > 0)
        return EmbeddedStack(options, head, client, runner, sched)
    from hicache.workers import HostWorker, KVCacheSpec

    m = options.model
    hicache = HiCacheConfig(host_slots=options.l2_slots, write_policy=options.write_policy)
    config = HeadConfig(tree=tree, hicache=hicache, components=components)  # (checked before a worker starts)
    spec = KVCacheSpec(m.num_layers, m.num_kv_heads, m.head_dim, ps, m.dtype)
    # the SWA layers' pool, paged like L1 (the head's SWA page ids), and the recurrent state pool (a state is
    # one page of it: ``recurrent.state_shape``), each with its own L2
    pools = config.component_pools(component_specs(m, ps))
    worker = HostWorker(spec, options.l1_pages, options.l2_slots, devices=jax.devices()[:1], component_pools=pools)
    head = CacheHead(config, LocalWorkerGroup([worker], options.open_storage))
    params = None if runner is None else runner.params
    slots = mamba.num_slots if isinstance(mamba, MambaConfig) and mamba.num_slots else 0
    attached = worker.attach_model(lambda kv: ModelRunner(m, options.forward, pool=kv, params=params,
                                                          swa_pages=swa_pages, state_slots=slots))
    assert isinstance(attached, ModelRunner)
    if options.l3_url is not None:
        mesh_shape = tuple(worker.device_pool.mesh.devices.shape)
        l3 = StorageParams(
            options.l3_url, fingerprint_for(m, options.forward, mesh_shape), prefetch_policy=options.prefetch_policy,
            prefetch_min_tokens=options.prefetch_min_tokens, pages_per_object=options.pages_per_object,
            cost=CostOptions() if options.l3_cost is None else options.l3_cost)
        if options.l3_query_wait_s is not None:
            l3 = replace(l3, query_wait_max_s=options.l3_query_wait_s)
        head.attach_storage_backend(l3)
    client = CacheClient(EmbeddedTransport(head), ps)
    sched = Scheduler(client, WorkerEngine(worker), hicache=True,
                      storage=options.l3_url is not None, prefill_budget=options.prefill_budget,
                      l3_min_tokens=options.prefetch_min_tokens, hold_storage_writes=True, swa_tables=swa_pages > 0,
                      recurrent=slots > 0)
    return EmbeddedStack(options, head, client, attached, sched, worker)


def component_specs(model: ModelConfig, page_size: int) -> dict:
    """The layouts of a reference model's component pools as a worker keeps them (``KVCacheSpec`` by name):
    ``"swa"``, its sliding-window layers' pages; ``"mamba"``, its recurrent states, one state a page."""
    from hicache.reference.engine.recurrent import state_shape
    from hicache.workers import KVCacheSpec

    out = {}
    if model.swa_layers:
        out["swa"] = KVCacheSpec(len(model.swa_layers), model.num_kv_heads, model.head_dim, page_size, model.dtype)
    if model.recurrent_layers:
        r, _, _, one, heads, part = state_shape(model, 1)
        out["mamba"] = KVCacheSpec(r, heads, part, one, "float32")
    return out


def _pools(runner: ModelRunner) -> tuple[int, int, int]:
    """(L1 pages, state slots, SWA pages) of a runner's pools."""
    state, swa = runner.state_pool, runner.swa_pool
    return runner.num_pages, 0 if state is None else state.shape[2], 0 if swa is None else swa.shape[2]


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
