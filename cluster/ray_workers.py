"""The host workers of one replica as Ray actors, and the head's ``WorkerGroup`` over them.

Topology (DESIGN.md §1): a replica is ONE SPMD program over H hosts. Each host runs one
``HostWorkerActor``, placed by a placement group with one bundle per host (STRICT_SPREAD; the bundle
asks for the per-host resource ``hicache_host`` on fake hosts, ``{"TPU": chips_per_host}`` on a slice,
see ``hicache.cluster.tpu``). Each actor is process ``i`` of a ``jax.distributed`` session whose
coordinator runs in worker 0, on worker 0's own node address (every host dials that address;
on the loopback test cluster it is 127.0.0.1 because that is the node's address there); CPU uses gloo
collectives and fake devices from ``XLA_FLAGS``. The replica's mesh spans every device of every host; the L1 pool is one global
``jax.Array`` sharded on KV heads, so host ``i`` holds heads ``host_head_range`` of every page.

Who owns what:
* each actor owns its host's ``HostWorker``: the L1 shard (device pool), the L2 shard (host pool),
  the transfer engine and, once attached, the engine's model runner; all of it lives on the actor's
  default-group thread (max_concurrency 1), which is the KV-owning thread of DESIGN.md §4. ``ping``
  runs in a separate "health" group and touches none of it.
* the head actor owns the ``RayWorkerGroup`` (the actor handles and the placement group) and is the
  only caller of ``submit``/``poll``/``wait``.

Which calls run on every host vs once:
* every host, same order (SPMD): ``init_jax``, ``begin_epoch`` (builds the pools), every plan
  (``submit``), the engine's model calls (``attach_model``, ``run_model``: the per-host model runner
  forwarding over this host's L1 shard, DESIGN.md §1) and the data-plane helpers
  ``write_pages``/``read_pages``. The group sends each plan to all hosts in ``seq`` order; plans
  contain no cross-host collectives (head-sharded pages never cross devices), so hosts need not
  interleave plans and other callers' calls identically. Forwards do (attention heads are split over
  hosts): their caller (``hicache.reference.ray_engine``) sends every model call to every host in one order.
* once (worker 0): ``coordinator_address``. Per host, local: ``poll``, ``wait``, ``ping``.

Failure model: a replica's hosts fail together. A host that dies takes its L1 *and* L2 shards with
it, and ``jax.distributed`` cannot re-admit a restarted process into a running session, so the
group is marked ``lost`` and the head rebuilds the whole gang: kill the survivors, start new actors
in the same bundles, new coordinator port, fresh pools and a fresh ``seq`` state.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hicache.cluster.builder import ComponentKind
from hicache.cluster.errors import HiCacheUnavailableError
from hicache.cluster.tpu import WorkerPlacement, cpu_placement
from hicache.workers.plan import TransferAck, TransferPlan
from hicache.workers.spec import ComponentPool, KVCacheSpec

if TYPE_CHECKING:  # (imported where it is built: jax loads with it)
    from hicache.storage import ModelFingerprint
    from hicache.workers import HostWorker

log = logging.getLogger(__name__)
_BREAKER_REFRESH_S = 0.5  # how stale the head's view of the hosts' L3 breakers may be

NAMESPACE = "hicache"


@dataclass(frozen=True)
class WorkerGroupOptions:
    """How a replica's host workers are placed and started (everything but the pool sizes, which come
    from the head's ``TreeConfig.capacity_pages`` and ``HiCacheConfig.host_slots``)."""

    spec: KVCacheSpec
    placement: WorkerPlacement
    platform: str = "cpu"  # JAX_PLATFORMS of the workers; "cpu" also selects gloo collectives
    env_vars: Mapping[str, str] = field(default_factory=dict)  # runtime_env of the worker actors
    # where worker 0 serves the jax.distributed coordinator; None: worker 0's Ray node address (what every
    # host can dial). A fixed value only for a cluster whose hosts all reach it (never loopback on many nodes).
    coordinator_host: str | None = None
    start_timeout_s: float = 120.0  # actors up + jax.distributed + pools
    call_timeout_s: float = 30.0  # bound on any single poll/ping answer; longer = host lost
    impl: str | None = None  # paged-copy implementation (None: per backend)
    # A hybrid model's other paged pools by component name ("swa": its sliding-window layers' K/V, pages of
    # ``spec.page_size``; "mamba": its recurrent states, one a page of size 1); their sizes come from the
    # head's component configs (``HeadConfig.component_pools``)
    component_specs: Mapping[str, KVCacheSpec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.spec, KVCacheSpec):
            raise TypeError(f"spec must be a KVCacheSpec, got {type(self.spec).__name__}")
        object.__setattr__(self, "component_specs", dict(self.component_specs))
        for name, cspec in self.component_specs.items():
            # a paged pool (SWA) has L1's pages; the state pool's page is one state (``ComponentPool``)
            page = 1 if name == ComponentKind.MAMBA.value else self.spec.page_size
            if not isinstance(cspec, KVCacheSpec) or cspec.page_size != page:
                raise ValueError(f"component_specs[{name!r}] must be a KVCacheSpec with page_size {page}, got {cspec!r}")
        if not isinstance(self.placement, WorkerPlacement):
            raise TypeError(f"placement must be a WorkerPlacement, got {type(self.placement).__name__}")
        if self.platform not in ("cpu", "tpu", "gpu", "cuda"):
            raise ValueError(f"unknown platform {self.platform!r}")
        object.__setattr__(self, "env_vars", dict(self.env_vars))
        if self.coordinator_host is not None and (not isinstance(self.coordinator_host, str) or not self.coordinator_host):
            raise ValueError(f"coordinator_host must be None or a host address, got {self.coordinator_host!r}")
        for name in ("start_timeout_s", "call_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def num_hosts(self) -> int:
        return self.placement.num_hosts

    @classmethod
    def fake_cpu_hosts(cls, spec: KVCacheSpec, num_hosts: int, devices_per_host: int = 2, **kw: Any) -> WorkerGroupOptions:
        """H fake hosts on this machine, each a process with ``devices_per_host`` fake CPU devices."""
        env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_host}"}
        env.update(kw.pop("env_vars", {}))
        return cls(spec, kw.pop("placement", None) or cpu_placement(num_hosts), "cpu", env, **kw)


# ------------------------------------------------------------------------------------------------
@ray.remote(concurrency_groups={"health": 1})  # type: ignore[call-overload]  # Ray's stubs lack the option
class HostWorkerActor:
    """One host of a replica (see the module docstring for threads and ownership)."""

    def __init__(self, replica: str, host_index: int, num_hosts: int) -> None:
        self.replica, self.host_index, self.num_hosts = replica, host_index, num_hosts
        self._worker: HostWorker | None = None  # built by begin_epoch
        self._epoch: int | None = None
        self._jax_session: str | None = None

    @ray.method(concurrency_group="health")
    def ping(self) -> dict[str, Any]:
        return {"host": self.host_index, "pid": os.getpid(), "epoch": self._epoch, "jax": self._jax_session,
                "node_ip": ray.util.get_node_ip_address()}

    # -- once per gang (worker 0) / every host -----------------------------------------------------
    def coordinator_address(self, host: str | None) -> str:
        """``host:port`` for the replica's jax.distributed coordinator; ``host`` None: this node's address."""
        host = host or ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        return f"{host}:{port}"

    def init_jax(self, coordinator: str, platform: str, timeout_s: float) -> dict[str, int]:
        """Joins the replica's ``jax.distributed`` session as process ``host_index`` (every host)."""
        import jax

        if self.num_hosts > 1:
            if platform == "cpu":
                jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(
                coordinator_address=coordinator, num_processes=self.num_hosts, process_id=self.host_index,
                initialization_timeout=max(1, int(timeout_s)),
            )
        self._jax_session = coordinator
        return {"process_index": jax.process_index(), "devices": jax.device_count(),
                "local_devices": jax.local_device_count()}

    def begin_epoch(self, epoch: int, spec: KVCacheSpec, num_device_pages: int, host_slots: int,
                    impl: str | None, component_pools: tuple[ComponentPool, ...] = ()) -> dict[str, Any]:
        """Builds fresh pools over the global mesh (every host): empty L1/L2 shards (and the component
        pools' L1/L2, a hybrid model's), fresh seq state."""
        import jax

        from hicache.workers import HostWorker, default_mesh

        self._worker = None
        mesh = default_mesh(spec.num_kv_heads, jax.devices())
        procs = {d.process_index for d in mesh.devices.flat}
        if len(procs) != jax.process_count():
            raise ValueError(
                f"num_kv_heads={spec.num_kv_heads} cannot be sharded over the {jax.device_count()} devices of "
                f"{jax.process_count()} hosts (the mesh would leave hosts {set(range(jax.process_count())) - procs} idle)"
            )
        worker = HostWorker(spec, num_device_pages, host_slots, host_index=self.host_index, mesh=mesh,
                            impl=impl, component_pools=component_pools)
        self._worker = worker
        self._epoch = epoch
        pool = worker.device_pool
        return {"host": self.host_index, "head_range": pool.host_head_range, "mesh_devices": int(mesh.devices.size)}

    def _w(self) -> HostWorker:
        if self._worker is None:
            raise RuntimeError(f"host worker {self.host_index} of {self.replica!r} has no pools yet")
        return self._worker

    # -- plans and acks (the head) -------------------------------------------------------------------
    def submit(self, plan: TransferPlan) -> None:
        self._w().submit(plan)

    def poll(self) -> list[TransferAck]:
        return self._w().poll()

    def wait(self, timeout_s: float, op_ids: list[int] | None = None) -> list[TransferAck]:
        return self._w().wait(timeout_s, op_ids)

    # -- data plane (SPMD: every host, same ids; the engine's forward in a real deployment) ------------
    def head_range(self) -> tuple[int, int]:
        return self._w().device_pool.host_head_range

    def write_pages(self, pages: np.ndarray, rows: np.ndarray) -> None:
        """This host's heads of ``pages`` := ``rows [n, L, 2, S, H_host, D]``."""
        self._w().device_pool.write_pages(pages, rows)

    def read_pages(self, pages: np.ndarray) -> np.ndarray:
        return self._w().device_pool.read_pages(pages)

    def read_slots(self, slots: np.ndarray) -> np.ndarray:
        return self._w().host_pool.read_slots(slots)

    # -- the engine's model runner on this host (SPMD: every host, same calls, same order) ------------
    def attach_model(self, factory: Any) -> dict[str, Any]:
        """Builds the engine's per-host model runner over this host's L1 shard (``HostWorker.attach_model``);
        it lives as long as this epoch's pools (``begin_epoch`` drops it with them)."""
        import jax

        w = self._w()
        model = w.attach_model(factory)
        return {"host": self.host_index, "epoch": self._epoch, "model": type(model).__name__,
                "mesh_shape": tuple(w.device_pool.mesh.devices.shape), "backend": jax.default_backend()}

    def run_model(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``model.<method>(*args, **kwargs)`` on the L1 array, on the KV-owning thread (ordered with
        the plans this actor executes). Every host must get the same calls in the same order: a forward
        runs collectives over the replica's mesh."""
        if not isinstance(method, str) or method.startswith("_"):
            raise ValueError(f"run_model: method must be a public method name, got {method!r}")
        return self._w().run_model(lambda model: getattr(model, method)(*args, **kwargs))

    # -- L3 (this host's storage client over its shard of every page) -------------------------------
    def attach_storage(self, attachment: Any) -> None:
        from hicache.workers.storage_exec import StorageExecutor

        w = self._w()
        if isinstance(w.storage_executor, StorageExecutor):
            w.storage_executor.close()
        from hicache.cluster.worker_group import component_host_pools

        w.storage_executor = None if attachment is None else StorageExecutor(attachment, w.host_pool,
                                                                             component_pools=component_host_pools(w))

    def _storage(self) -> Any:
        from hicache.workers.storage_exec import StorageExecutor

        executor = self._w().storage_executor
        if not isinstance(executor, StorageExecutor):
            raise RuntimeError(f"host {self.host_index}: no storage backend attached")
        return executor.storage

    def storage_pages_per_object(self) -> int:
        return self._storage().pages_per_object()

    def storage_exists(self, keys: Sequence[str], first_page: int, min_pages: int = 1,
                       fingerprint: ModelFingerprint | None = None, chunk_start_key: str | None = None) -> int:
        return self._storage().batch_exists(keys, first_page=first_page, min_pages=min_pages, fingerprint=fingerprint,
                                            chunk_start_key=chunk_start_key)

    def storage_exists_each(self, pool: str, keys: Sequence[str]) -> list[bool]:
        from hicache.storage import PoolKind

        return self._storage().exists_each(keys, pool=PoolKind(pool))

    def storage_record_prefix(self, namespace: Any, tokens: np.ndarray) -> None:
        self._storage().record_prefix(namespace, tokens)

    def storage_list_prefixes(self, namespace: Any) -> list:
        return self._storage().list_prefixes(namespace)

    def storage_errors(self) -> dict[str, int]:
        from hicache.cluster.worker_group import storage_error_counts

        return storage_error_counts(self._storage().stats())

    def storage_breaker_state(self) -> str:
        return self._storage().breaker.state.value

    def storage_probe(self) -> bool:
        return self._storage().probe()


# ------------------------------------------------------------------------------------------------
def _actor_resources(bundle: Mapping[str, float]) -> dict[str, Any]:
    res = dict(bundle)
    out: dict[str, Any] = {"num_cpus": res.pop("CPU", 0), "num_gpus": res.pop("GPU", 0)}
    if res:
        out["resources"] = res
    return out


def placement_group_name(replica: str) -> str:
    return f"hicache-workers-{replica}"


class RayWorkerGroup:
    """The head's view of its replica's host workers (implements ``WorkerGroup``).

    Never raises from ``submit``/``poll``/``wait``: a dead, hung or diverged host sets ``lost`` (a
    reason) and from then on no ack arrives; the head sees ``lost`` after the call and rebuilds.
    """

    def __init__(self, replica: str, options: WorkerGroupOptions, num_device_pages: int, host_slots: int,
                 *, detached: bool = False, component_pools: tuple[ComponentPool, ...] = ()) -> None:
        self.replica = replica
        self.component_pools = tuple(component_pools)
        self.options = options
        self.num_device_pages = int(num_device_pages)
        self.host_slots = int(host_slots)
        self.detached = detached
        self.actors: list[Any] = []
        self.epoch: int | None = None
        self.lost: str | None = None
        self.head_ranges: list[tuple[int, int]] = []
        self._submits: list[ray.ObjectRef] = []
        self._wire_seq = itertools.count()
        self._slice_reservation: Any = None  # the TPU slice head's placement group, once reserved
        self._breaker = "closed"  # the hosts' worst L3 breaker state when last asked
        self._breaker_next = 0.0  # monotonic time of the next refresh of ``_breaker``

    @property
    def num_hosts(self) -> int:
        return self.options.num_hosts

    # -- lifecycle (head's builder thread) -------------------------------------------------------------
    def placement_group(self) -> PlacementGroup:
        """The replica's placement group (one bundle per host), reused across gang and head restarts."""
        name = placement_group_name(self.replica)
        try:
            pg = ray.util.get_placement_group(name)
        except ValueError:
            pl = self.options.placement.resolved()  # a TPU slice is reserved here, on the head, not at parse
            self._slice_reservation = pl.slice_reservation  # kept alive with the group
            kw: dict[str, Any] = {}
            if pl.bundle_label_selector is not None:
                kw["bundle_label_selector"] = [dict(s) for s in pl.bundle_label_selector]
            pg = placement_group([dict(b) for b in pl.bundles], strategy=pl.strategy, name=name,
                                 lifetime="detached" if self.detached else None, **kw)
        ready, _ = ray.wait([pg.ready()], timeout=self.options.start_timeout_s)
        if not ready:
            raise HiCacheUnavailableError(
                f"replica {self.replica!r}: placement group {name} ({self.options.placement.bundles}, "
                f"{self.options.placement.strategy}) not placed within {self.options.start_timeout_s}s"
            )
        return pg

    def start(self, epoch: int) -> None:
        """Starts every host (actors, jax.distributed session, pools). Blocks; kills what it started on failure."""
        opts = self.options
        deadline = time.monotonic() + opts.start_timeout_s
        left = lambda: max(1.0, deadline - time.monotonic())  # noqa: E731
        pg = self.placement_group()
        actors = []
        try:
            for i, bundle in enumerate(opts.placement.bundles):
                actors.append(HostWorkerActor.options(  # type: ignore[attr-defined]  # a Ray actor class
                    name=f"worker-{self.replica}-{epoch:x}-{i}", namespace=NAMESPACE,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
                    runtime_env={"env_vars": dict(opts.env_vars)} if opts.env_vars else None,
                    max_restarts=0, max_concurrency=1, **_actor_resources(bundle),
                ).remote(self.replica, i, opts.num_hosts))
            ray.get([a.ping.remote() for a in actors], timeout=left())
            coordinator = ray.get(actors[0].coordinator_address.remote(opts.coordinator_host), timeout=left())
            ray.get([a.init_jax.remote(coordinator, opts.platform, left()) for a in actors], timeout=left())
            infos = ray.get([a.begin_epoch.remote(epoch, opts.spec, self.num_device_pages, self.host_slots,
                                                  opts.impl, self.component_pools) for a in actors], timeout=left())
        except BaseException:
            for a in actors:
                _kill(a)
            raise
        self.actors, self.epoch, self.lost, self._submits = actors, epoch, None, []
        self.head_ranges = [tuple(info["head_range"]) for info in infos]
        log.info("replica %s: %d host workers up (epoch %x, heads %s)", self.replica, len(actors), epoch, self.head_ranges)

    def kill(self) -> None:
        """Kills every host worker (the placement group stays for the next gang)."""
        for a in self.actors:
            _kill(a)
        self.actors, self._submits = [], []

    def remove_placement_group(self) -> None:
        try:
            remove_placement_group(ray.util.get_placement_group(placement_group_name(self.replica)))
        except ValueError:
            pass

    # -- WorkerGroup ------------------------------------------------------------------------------------
    def _lose(self, reason: str) -> None:
        if self.lost is None:
            self.lost = reason
            log.warning("replica %s: host workers lost: %s", self.replica, reason)

    def submit(self, plan: TransferPlan) -> None:
        """Sends ``plan`` to every host (each actor runs its calls in the order this thread sent them).

        The plan travels under this gang's own strictly increasing ``seq`` (same order as the
        controller's): a head ``reset`` starts a new controller whose seqs restart at 0, while the
        workers' seq state lives as long as the gang. Acks are matched by ``op_id``; ``reset`` is only
        allowed with nothing in flight, so no ack of an old op can meet a new op with the same id.
        """
        if self.lost is not None:
            return
        wire = TransferPlan(next(self._wire_seq), plan.ops)
        self._submits += [a.submit.remote(wire) for a in self.actors]
        if len(self._submits) > 1024:  # bound the refs kept when the head rarely polls
            self._check_submits()

    def _check_submits(self) -> None:
        if not self._submits:
            return
        ready, self._submits = ray.wait(self._submits, num_returns=len(self._submits), timeout=0)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                self._lose(f"a host worker died: {type(e).__name__}")
            except Exception as e:  # a rejected plan: that host's state diverged from the head's
                self._lose(f"a host worker rejected a plan: {e}")

    def _gather(self, refs: list[ray.ObjectRef], timeout_s: float, what: str) -> list[TransferAck]:
        try:
            per_host = ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            self._lose(f"{what}: a host worker did not answer within {timeout_s:.1f}s")
            return []
        except ray.exceptions.RayActorError as e:
            self._lose(f"{what}: a host worker died: {type(e).__name__}")
            return []
        except Exception as e:
            self._lose(f"{what}: {type(e).__name__}: {e}")
            return []
        return [ack for acks in per_host for ack in acks]

    def poll(self) -> list[TransferAck]:
        if self.lost is not None:
            return []
        self._check_submits()
        if self.lost is not None:
            return []
        return self._gather([a.poll.remote() for a in self.actors], self.options.call_timeout_s, "poll")

    def wait(self, timeout_s: float, op_ids: Collection[int] | None = None) -> list[TransferAck]:
        if self.lost is not None:
            return []
        self._check_submits()
        if self.lost is not None:
            return []
        ids = None if op_ids is None else list(op_ids)
        acks = self._gather([a.wait.remote(timeout_s, ids) for a in self.actors],
                            timeout_s + self.options.call_timeout_s, "wait")
        self._check_submits()
        return acks

    # -- L3: every host keeps its own storage client (its shard of each page) -------------------------
    def attach_storage(self, attachment: Any) -> None:
        ray.get([a.attach_storage.remote(attachment) for a in self.actors], timeout=self.options.call_timeout_s)

    def storage_pages_per_object(self) -> int:
        return ray.get(self.actors[0].storage_pages_per_object.remote(), timeout=self.options.call_timeout_s)

    @property
    def storage_local(self) -> bool:
        return False  # every question is a remote call to the host actors

    def storage_exists(self, keys: Sequence[str], first_page: int, min_pages: int = 1,
                       fingerprint: ModelFingerprint | None = None, chunk_start_key: str | None = None) -> int:
        """MIN over hosts of the stored prefix length; a host that cannot answer counts as 0 (a miss)."""
        try:
            found = ray.get([a.storage_exists.remote(keys, first_page, min_pages, fingerprint, chunk_start_key)
                             for a in self.actors],
                            timeout=self.options.call_timeout_s)
        except Exception as e:  # storage trouble is a miss, never an error for the request
            log.warning("replica %s: L3 existence check failed: %s", self.replica, e)
            return 0
        return min(found)

    def storage_exists_each(self, pool: str, keys: Sequence[str]) -> list[bool]:
        """AND over hosts; a host that cannot answer holds none (a shorter hit)."""
        try:
            per_host = ray.get([a.storage_exists_each.remote(pool, list(keys)) for a in self.actors],
                               timeout=self.options.call_timeout_s)
        except Exception as e:  # storage trouble is a miss, never an error for the request
            log.warning("replica %s: L3 existence check of %s failed: %s", self.replica, pool, e)
            return [False] * len(keys)
        return [all(flags) for flags in zip(*per_host)] if per_host else []

    def storage_record_prefix(self, namespace: Any, tokens: np.ndarray) -> None:
        try:
            ray.get(self.actors[0].storage_record_prefix.remote(namespace, tokens), timeout=self.options.call_timeout_s)
        except Exception as e:  # the manifest is an optimization: a failed record loses nothing
            log.warning("replica %s: manifest record failed: %s", self.replica, e)

    def storage_list_prefixes(self, namespace: Any) -> list:
        return ray.get(self.actors[0].storage_list_prefixes.remote(namespace), timeout=self.options.call_timeout_s)

    def storage_errors(self) -> dict[str, int]:
        from hicache.cluster.worker_group import sum_error_counts

        try:
            per_host = ray.get([a.storage_errors.remote() for a in self.actors], timeout=self.options.call_timeout_s)
        except Exception as e:  # metrics only: an unreachable host reports nothing this time
            log.warning("replica %s: L3 error counts unavailable: %s", self.replica, e)
            per_host = []
        return sum_error_counts(per_host)

    def storage_breaker_state(self) -> str:
        """The worst breaker state over hosts, asked at most every ``_BREAKER_REFRESH_S`` (the head asks
        before every L3 query; one round trip per refresh, not per request). An unreachable host: open."""
        from hicache.cluster.worker_group import worst_breaker_state

        now = time.monotonic()
        if now >= self._breaker_next:
            self._breaker_next = now + _BREAKER_REFRESH_S
            try:
                states = ray.get([a.storage_breaker_state.remote() for a in self.actors],
                                 timeout=self.options.call_timeout_s)
                self._breaker = worst_breaker_state(states)
            except Exception as e:
                log.warning("replica %s: L3 breaker state unavailable: %s", self.replica, e)
                self._breaker = "open"
        return self._breaker

    def storage_probe(self) -> bool:
        try:
            ok = all(ray.get([a.storage_probe.remote() for a in self.actors], timeout=self.options.call_timeout_s))
        except Exception as e:
            log.warning("replica %s: L3 probe failed: %s", self.replica, e)
            ok = False
        self._breaker_next = 0.0  # the next question sees the probe's outcome
        return ok

    def check_alive(self) -> bool:
        """Pings every host (health group, never queued behind transfers); False once lost."""
        if self.lost is not None or not self.actors:
            return self.lost is None
        refs = [a.ping.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.options.call_timeout_s)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as e:
                self._lose(f"health check: a host worker is gone: {type(e).__name__}")
        if len(ready) < len(refs):
            self._lose(f"health check: a host worker did not answer within {self.options.call_timeout_s}s")
        return self.lost is None


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # already gone
        pass
