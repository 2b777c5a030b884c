"""``RayEngine``: the reference engine inside a Ray replica's host workers, SPMD (DESIGN.md §1).

On a multi-host replica the model must run in the processes that own the devices, i.e. in the
``HostWorkerActor`` of every host, over that host's shard of the L1 pool. ``RayEngine`` puts a
``ModelRunner`` there (``HostWorkerActor.attach_model``: params from the seed, replicated over the
replica's mesh; the pool is the worker's L1 array, sharded on KV heads) and forwards the scheduler's
calls to it (``run_model``).

Who owns what:
* each host worker owns its L1/L2 shards and its model runner; forwards run on its KV-owning thread
  (actor concurrency 1), so they are ordered with the transfer plans that thread executes;
* this object (serving process, next to the ``Scheduler`` and its ``CacheClient``) owns only actor
  handles. The head plans transfers; a load-back is acked by every host before ``wait_load_back``
  returns, so the forward that follows reads the loaded pages on every host.

Which calls run where: ``attach`` once per gang epoch, on every host; each model call goes to every
host in this object's order (a forward contains collectives over the mesh: all hosts must run the
same forwards in the same order; one thread per ``RayEngine``), waits for all of them (bounded by
``timeout_s``) and returns host 0's answer (every host computes the same replicated logits).

Failure: a lost or hung host surfaces as ``HiCacheUnavailableError``/``HiCacheTimeoutError``; the
head rebuilds the gang (fresh pools, no model); ``refresh()`` takes the new handles and attaches again.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import ray

from hicache.cluster.builder import ComponentKind, MambaConfig, SWAConfig, components_of
from hicache.cluster.errors import HiCacheTimeoutError, HiCacheUnavailableError
from hicache.cluster.ray_head import ReplicaConfig, get_head, worker_handles
from hicache.reference.engine.config import ForwardConfig, ModelConfig
from hicache.reference.engine.runner import ModelRunner
from hicache.reference.engine_adapters import RemoteModelEngine
from hicache.storage import ModelFingerprint


def build_runner(model: ModelConfig, forward: ForwardConfig, kv_pool: Any, swa_pages: int = 0,
                 state_slots: int = 0) -> ModelRunner:
    """The per-host model runner over a worker's L1 array (runs inside the host worker); ``swa_pages``: its
    sliding-window layers' pool, ``state_slots``: its recurrent state pool (the worker's ``"swa"`` and
    ``"mamba"`` component pools when the replica has a host tier, lent by ``run_model``; else the runner's own)."""
    return ModelRunner(model, forward, pool=kv_pool, swa_pages=swa_pages, state_slots=state_slots)


@dataclass(frozen=True)
class EnginePools:
    """The pools a replica's head gives the engine's hybrid layers: ``swa_pages`` (its SWA pool, the head's
    SWA page ids), ``state_slots`` (its Mamba pool, the head's state slots); 0: none."""

    swa_pages: int = 0
    state_slots: int = 0


def engine_pools(model: ModelConfig, config: ReplicaConfig) -> EnginePools:
    """The pools ``model`` uses on replica ``config``; ``ValueError`` naming the mismatch unless the head's
    components are the ones the model needs (``check_components``) and the workers' component pools have the
    model's layout (``component_specs``)."""
    from hicache.reference.stack import check_components, component_specs

    head = config.head
    try:
        check_components(model, head.components)
    except ValueError as e:
        raise ValueError(f"replica {head.replica!r}: {e}") from None
    if config.workers is not None:
        want = component_specs(model, head.tree.page_size)
        for pool in head.component_pools(config.workers.component_specs):
            if pool.spec != want[pool.name]:
                raise ValueError(f"replica {head.replica!r}: the workers' {pool.name} pool layout {pool.spec} "
                                 f"is not the model's {want[pool.name]}")
    by_kind = components_of(head.components)
    swa, mamba = by_kind.get(ComponentKind.SWA), by_kind.get(ComponentKind.MAMBA)
    return EnginePools(
        swa.num_tokens // head.tree.page_size if isinstance(swa, SWAConfig) and swa.num_tokens else 0,
        mamba.num_slots if isinstance(mamba, MambaConfig) and mamba.num_slots else 0)


class RayEngine(RemoteModelEngine):
    """The engine of Ray replica ``replica``: a ``ModelRunner`` in each of its host workers."""

    def __init__(self, replica: str, model: ModelConfig, forward: ForwardConfig = ForwardConfig(),
                 *, timeout_s: float = 120.0) -> None:
        """A hybrid model's layers use the pools of the replica's head components (``engine_pools``): its
        sliding-window layers the SWA pool, its recurrent layers the state pool; ``ValueError`` if the
        replica's components or the workers' pool layouts do not match the model."""
        if not isinstance(model, ModelConfig) or not isinstance(forward, ForwardConfig):
            raise TypeError(f"need a ModelConfig and a ForwardConfig, got {type(model).__name__}, "
                            f"{type(forward).__name__}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.replica = replica
        self.model = model
        self.forward = forward
        self.page_size = forward.page_size
        self.timeout_s = float(timeout_s)
        config = self._get([get_head(replica).get_config.remote()], "get_config")[0]
        self.pools = engine_pools(model, config)
        self.workers: list[Any] = []
        self.epoch: int | None = None
        self.mesh_shape: tuple[int, ...] = ()
        self.backend = ""
        self.refresh()

    def refresh(self) -> None:
        """Takes the replica's current host workers and attaches the model on every host (compiles
        nothing yet: the first forward does)."""
        epoch, workers, _ = worker_handles(self.replica, self.timeout_s)
        if not workers:
            raise ValueError(f"replica {self.replica!r} has no host workers: the model needs a data plane")
        factory = functools.partial(build_runner, self.model, self.forward, swa_pages=self.pools.swa_pages,
                                    state_slots=self.pools.state_slots)
        infos = self._get([w.attach_model.remote(factory) for w in workers], "attach_model")
        self.epoch, self.workers = epoch, workers
        self.mesh_shape, self.backend = tuple(infos[0]["mesh_shape"]), str(infos[0]["backend"])

    @property
    def swa_tables(self) -> bool:
        """The model's sliding-window layers use the head's SWA pool (``Scheduler(swa_tables=)``)."""
        return self.pools.swa_pages > 0

    @property
    def recurrent(self) -> bool:
        """The model's recurrent layers use the head's state pool (``Scheduler(recurrent=)``)."""
        return self.pools.state_slots > 0

    def fingerprint(self) -> ModelFingerprint:
        """L3 identity of this replica's KV (the workers' mesh and backend are part of the numerics)."""
        from hicache.reference.stack import fingerprint_for

        return fingerprint_for(self.model, self.forward, self.mesh_shape, self.backend)

    def call(self, method: str, *args: Any) -> Any:
        """``model.<method>(*args)`` on every host, in this engine's order; host 0's result."""
        return self._get(self._send(method, *args), method)[0]

    def _send(self, method: str, *args: Any) -> list[ray.ObjectRef]:
        return [w.run_model.remote(method, *args) for w in self.workers]

    def _get(self, refs: list[ray.ObjectRef], what: str) -> list[Any]:
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise HiCacheTimeoutError(
                f"replica {self.replica!r}: {what} got no answer from every host within {self.timeout_s}s"
            ) from None
        except (ray.exceptions.RayActorError, ray.exceptions.RaySystemError) as e:
            raise HiCacheUnavailableError(
                f"replica {self.replica!r}: a host worker is gone during {what}: {type(e).__name__}") from e
