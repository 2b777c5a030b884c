"""The head of a replica as a Ray actor: ``hicache/head-<replica>``, the one decision point (DESIGN.md §1).

``CacheHeadActor`` wraps a plain ``CacheHead`` and owns the replica's ``RayWorkerGroup`` (its host
worker actors and placement group). Runs once per replica, on the head node (``hicache_head``).

Threads (Ray concurrency groups):
* "control" (1 thread): ``step``/``step_wire``, the Ray path of a step; it sends plans to the workers and
  applies their acks.
* the step channel (``hicache.cluster.step_channel``, started by the first ``step_channel`` call): one
  thread per connected client runs that client's wire-format steps, exactly as ``step_wire`` does.
* "health" (2 threads): ``health``, ``workers``, ``config``, ``step_channel``, ``set_step_channel``,
  ``shutdown``; read a few attributes, never the tree, so they never queue behind a transfer wait.
* a monitor thread pings the host workers; a builder thread starts (and restarts) the gang.
* with ``ReplicaConfig.preemption`` (the replica file's ``preemption:`` section), a watcher thread waits
  for a notice, then drains (``hicache.cluster.drain``) round by round, each round a call under the
  state lock, so steps and ``cache_stats`` are served between rounds and show its progress.
* test hooks (``ReplicaConfig.test_hooks``, off in production): ``hold_control_for_test`` occupies the
  control thread and the state lock until ``release_control_for_test`` (a step in flight on demand);
  ``hold_drain_for_test`` stops a drain between two rounds until ``release_drain_for_test``.
``_lock`` is held for a whole step by the thread that runs it (control or channel: only one step touches
the tree, the allocators and the HiCache controller at a time) and by the others only to swap state.
``_channel_lock`` guards the channel server (start, stop) and nothing else.

Epochs: every installed state (fresh tree + a started worker gang) gets a new, unique ``epoch``
(time-based, so a restarted head never reuses one). Clients send the epoch they last saw; a call
from another epoch is refused with ``status="reset"`` (the client raises
``HiCacheReplicaResetError``) and nothing runs, so node ids and pages from a lost state are never
applied to a new one.

Rebuild path (constructor state is lost on restart; a lost host loses its L1 and L2 shards):
* head restart (``max_restarts``): Ray re-runs ``__init__``; the old workers died with their owner
  (the old head process); the builder starts a new gang in the same (named) placement group, and the
  tree starts empty, L1 and L2 empty: never a stale hit. The L3 the lost incarnation had attached
  (the start configuration's ``ReplicaConfig.storage``, or what ``attach_storage_backend`` /
  ``detach_storage_backend`` made of it at runtime) is kept in Ray's GCS (``ray_storage_record``)
  and attached to the new gang before it serves: L3 content is persistent, so a restarted head gets
  L3 hits again (prefetch asks storage for every queued request; the tree keeps no L3-only nodes).
* host worker lost (died, hung, rejected a plan; seen by the group or by the monitor): the controller
  drops its host tier (``drop_host_tier``), the head state is discarded (L1 died too: all processes
  of the SPMD program restart), calls answer ``status="unavailable"`` while the builder kills the
  survivors and starts a new gang (fresh jax session, pools and seq state); then a fresh state with a
  new epoch is installed. The L3 the lost state had attached (``StorageParams``: URL and options) is
  attached to the new gang before the state serves, so L3 hits resume (prefetch) after the rebuild;
  if that attach fails the replica serves without L3, health says why, and the next rebuild tries again.
* ``reset`` (a client call) keeps the attached L3 (``CacheHead.reset``).

The head notes each attach/detach call that succeeded (``_track_storage``: one flag check per call) and
records the change in the GCS; ``stop_replica`` deletes the record, and a fresh (not restarted) head
starts from its configuration.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import ray

from hicache.cluster import ray_storage_record, wire
from hicache.cluster.drain import (
    DrainParams,
    DrainProgress,
    DrainState,
    Notice,
    PreemptionConfig,
    PreemptionWatcher,
    drive_drain,
)
from hicache.cluster.errors import HiCacheUnavailableError
from hicache.cluster.head import CacheHead, Call, CallResult, HeadConfig
from hicache.cluster.key_history import KeyHistories
from hicache.cluster.metrics import HeadMetrics
from hicache.cluster.ray_workers import NAMESPACE, RayWorkerGroup, WorkerGroupOptions
from hicache.cluster.step_channel import LOOPBACK, ChannelAddress, ChannelScope, StepChannelServer
from hicache.cluster.storage_tier import StorageParams
from hicache.cluster.tpu import HEAD_RESOURCE

log = logging.getLogger(__name__)

_epoch_counter = itertools.count()
_METRICS_INTERVAL_S = 1.0  # a counter snapshot goes to Ray metrics at most this often (control thread)


def _new_epoch() -> int:
    """Unique across head incarnations: wall-clock microseconds, strictly increasing in a process."""
    return (time.time_ns() // 1000) * 1000 + next(_epoch_counter) % 1000


def head_name(replica: str) -> str:
    return f"head-{replica}"


@dataclass(frozen=True)
class ReplicaConfig:
    """One replica: its head (tree, HiCache policy) and, with a host tier or L1 on workers, its host workers."""

    head: HeadConfig
    workers: WorkerGroupOptions | None = None  # None: control plane only (no data plane, no L2)
    head_resources: Mapping[str, float] = field(default_factory=lambda: {HEAD_RESOURCE: 0.01})
    max_restarts: int = 4  # head actor restarts (each rebuilds an empty state)
    detached: bool = True  # the head outlives the driver that started it
    health_interval_s: float = 0.5  # monitor pings of the host workers
    rebuild_backoff_s: float = 1.0  # between failed gang starts
    storage: StorageParams | None = None  # L3 attached when the replica starts (and after every restart)
    preemption: PreemptionConfig | None = None  # the head drains on a notice from there (hicache.cluster.drain)
    step_channel: bool = True  # clients send steps over the head's step channel socket (Ray calls: the fallback)
    # CLUSTER: the channel listens on the head node's address (serving processes on other hosts use it, behind
    # its token: README, security notes); NODE: on 127.0.0.1, for clients on the head's node only
    step_channel_scope: ChannelScope = ChannelScope.CLUSTER
    # TEST ONLY: enables the head's ``*_for_test`` methods (hold the control thread until released), so
    # tests have a step in flight for exactly as long as they need, whatever the box's speed.
    test_hooks: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.head, HeadConfig):
            raise TypeError(f"head must be a HeadConfig, got {type(self.head).__name__}")
        object.__setattr__(self, "head_resources", dict(self.head_resources))
        try:
            object.__setattr__(self, "step_channel_scope", ChannelScope(self.step_channel_scope))
        except ValueError:
            raise ValueError(f"step_channel_scope must be one of {[s.value for s in ChannelScope]}, "
                             f"got {self.step_channel_scope!r}") from None
        if self.head.hicache is not None and self.workers is None:
            raise ValueError("a replica with a host tier (HeadConfig.hicache) needs WorkerGroupOptions")
        if self.workers is not None:
            if self.workers.spec.page_size != self.head.tree.page_size:
                raise ValueError(f"spec.page_size {self.workers.spec.page_size} != tree page_size {self.head.tree.page_size}")
            if self.head.tree.capacity_pages is None:
                raise ValueError("workers hold the L1 pool: TreeConfig.capacity_pages must be set")
            self.head.component_pools(self.workers.component_specs)  # a hybrid head's pools: ValueError if unset
            extra = sorted(set(self.workers.component_specs) - set(self.head.component_host_slots()))
            if extra:  # a pool no head component fills: the model and the head disagree
                raise ValueError(f"component_specs {extra} name pools the head keeps no host tier for (its "
                                 f"components: {[c.kind.value for c in self.head.components] or 'none'}"
                                 f"{'' if self.head.hicache is not None else ', no HiCacheConfig'})")
        if self.max_restarts < -1:
            raise ValueError(f"max_restarts must be >= -1, got {self.max_restarts}")
        if not self.health_interval_s > 0 or not self.rebuild_backoff_s > 0:
            raise ValueError("health_interval_s and rebuild_backoff_s must be > 0")
        if self.storage is not None:
            self._check_storage(self.storage)
        if self.preemption is not None and not isinstance(self.preemption, PreemptionConfig):
            raise TypeError(f"preemption must be a PreemptionConfig, got {type(self.preemption).__name__}")

    def _check_storage(self, params: StorageParams) -> None:
        if not isinstance(params, StorageParams):
            raise TypeError(f"storage must be StorageParams, got {type(params).__name__}")
        if self.head.hicache is None:
            raise ValueError("L3 (storage) sits behind L2: it needs a host tier (HeadConfig.hicache)")
        fp, spec = params.fingerprint, self.workers.spec if self.workers is not None else None
        got = (fp.page_size, fp.num_layers, fp.num_kv_heads, fp.head_dim)
        want = (self.head.tree.page_size,) + ((spec.num_layers, spec.num_kv_heads, spec.head_dim) if spec else got[1:])
        if got != want:
            raise ValueError(f"storage fingerprint (page_size, num_layers, num_kv_heads, head_dim) {got} "
                             f"does not match the replica's {want}")

    @property
    def replica(self) -> str:
        return self.head.replica


class HeadState(str, Enum):
    STARTING = "starting"  # first gang being built
    READY = "ready"
    REBUILDING = "rebuilding"  # a host was lost; new gang being built
    STOPPED = "stopped"


@dataclass(frozen=True)
class Reply:
    """Answer of ``step``/``step_wire``: ``status`` is "ok" (``results`` valid), "reset" (the caller's
    epoch is gone; nothing ran), "unavailable" (no state to serve from right now; nothing ran) or,
    for ``step_wire`` only, "resync" (the client's key history must start over; nothing ran)."""

    status: str
    epoch: int | None
    results: Any = field(default_factory=list)  # list[CallResult]; ``step_wire``: wire.encode_results' (header, buffer)
    reason: str = ""


@dataclass(frozen=True)
class HeadHealth:
    replica: str
    state: HeadState
    epoch: int | None
    reason: str
    num_hosts: int
    page_size: int
    resets: int  # states discarded since this incarnation started
    reconstructed: bool  # this incarnation is a Ray restart of the head actor
    calls: int
    last_call_s: float | None  # seconds since the last control call


class _RecordingHead(CacheHead):
    """A ``CacheHead`` that notes the L3 attach/detach calls that succeeded (the actor records them)."""

    storage_changed = False

    def attach_storage_backend(self, params: StorageParams) -> None:
        super().attach_storage_backend(params)
        self.storage_changed = True

    def detach_storage_backend(self) -> None:
        super().detach_storage_backend()
        self.storage_changed = True


@ray.remote(concurrency_groups={"control": 1, "health": 2})  # type: ignore[call-overload]  # Ray's stubs lack it
class CacheHeadActor:
    def __init__(self, config: ReplicaConfig) -> None:
        self.config = config
        self._lock = threading.RLock()
        self._state = HeadState.STARTING
        self._epoch: int | None = None
        self._head: _RecordingHead | None = None
        self._group: RayWorkerGroup | None = None
        self._reason = ""
        self._resets = 0
        self._calls = 0
        self._last_call: float | None = None
        self._metrics: HeadMetrics | None = None
        self._histories = KeyHistories()  # match keys each client sent (control thread; survives rebuilds)
        self._last_publish = 0.0
        self._stop = threading.Event()
        self._channel: StepChannelServer | None = None
        self._channel_enabled = config.step_channel
        self._channel_lock = threading.Lock()
        self._test_held = threading.Event()  # (test hooks) the control thread is held
        self._test_release = threading.Event()  # (test hooks) lets it go
        self._notice: Notice | None = None  # a preemption notice came: no state admits requests any more
        self._drain_ended = threading.Event()
        self._test_drain_armed = threading.Event()  # (test hooks) hold the drain between two rounds
        self._test_drain_held = threading.Event()
        self._test_drain_release = threading.Event()
        with warnings.catch_warnings():  # Ray 2.60 warns from inside this property
            warnings.simplefilter("ignore", DeprecationWarning)
            self._reconstructed = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        self._storage: StorageParams | None = self._initial_storage()  # the L3 every new state gets
        if config.workers is None:
            self._install(None)
        else:
            self._start_builder(None)
        # host worker liveness (with workers) and the metrics of an idle replica
        threading.Thread(target=self._monitor, name="hicache-monitor", daemon=True).start()
        self._watcher = (PreemptionWatcher(config.preemption.build(), self._on_notice, poll_s=config.preemption.poll_s)
                         if config.preemption is not None else None)

    def _on_notice(self, notice: Notice) -> None:
        """The watcher's thread: drain the current state round by round, each round one call under the
        state lock like a client's (``drive_drain``), so other calls are served in between and show
        its progress. A state installed after the notice (a rebuild) admits nothing either."""
        with self._lock:
            self._notice = notice
        epoch: list[int | None] = [None]  # the state the drain started on; a later one is not drained

        def on_head(fn: Callable[[CacheHead], Any]) -> Any:
            reply = self._serve(epoch[0], 1, fn)
            if reply.status != "ok":
                raise HiCacheUnavailableError(f"the drained state is gone ({reply.status}: {reply.reason})")
            epoch[0] = reply.epoch
            res = reply.results
            if type(res) is list and len(res) == 1 and type(res[0]) is CallResult and res[0].error is not None:
                raise res[0].error
            return res

        try:
            prog = drive_drain(on_head, DrainParams(notice.deadline_s), between_rounds=self._between_drain_rounds)
            log.warning("replica %r: preemption notice (%s): drain %s", self.config.replica, notice.detail,
                        prog.snapshot())
        except Exception as e:  # no state, a lost host, L3 not attached: what L3 lacks is lost with the slice
            log.warning("replica %r: preemption notice (%s): drain failed: %s: %s", self.config.replica,
                        notice.detail, type(e).__name__, e)
        finally:
            self._drain_ended.set()

    def _between_drain_rounds(self, progress: DrainProgress) -> None:
        """(test hooks) Holds the drain between two rounds, once armed by ``hold_drain_for_test``, at the
        first round after which something is stored and something is left (progress worth showing)."""
        if self._test_drain_armed.is_set() and progress.drained_pages > 0 and progress.left_pages > 0:
            self._test_drain_armed.clear()
            self._test_drain_held.set()
            self._test_drain_release.wait(300.0)

    # -- state -------------------------------------------------------------------------------------
    def _fresh_head(self, group: RayWorkerGroup | None) -> _RecordingHead:
        """A new, empty head state (L1/L2 empty); its counters go to the replica's Ray metrics."""
        head = _RecordingHead(self.config.head, group if self.config.head.hicache is not None else None)
        if self._metrics is None:
            self._metrics = HeadMetrics(self.config.replica)
        head.attach_metrics(self._metrics)
        return head

    def _initial_storage(self) -> StorageParams | None:
        """The L3 this incarnation starts with: a restarted head takes the recorded attachment (a runtime
        attach or detach survives the restart); a fresh head takes its configuration and records it
        (replacing a record left by an earlier replica of the same name). Without the GCS: the config."""
        replica, params = self.config.replica, self.config.storage
        try:
            if self._reconstructed:
                record = ray_storage_record.attached(replica)
                return params if record is None else record.params
            ray_storage_record.remember(replica, params)
        except Exception as e:  # GCS unreachable: the configuration still says what to attach
            log.warning("replica %s: L3 attachment record unavailable: %s", replica, e)
        return params

    def _attach_storage(self, head: _RecordingHead) -> str:
        """Attaches the replica's L3 (same URL and options) to a fresh state; returns why that failed
        ("" when it did not): the replica then serves without L3 and says so in health."""
        params = self._storage
        if params is None or head.controller is None:
            return ""
        try:
            head.attach_storage_backend(params)
        except Exception as e:  # L3 is optional: serve with L1/L2 and recompute, report it
            log.warning("replica %s: attaching L3 %s failed: %s", self.config.replica, params.url, e)
            return f"L3 {params.url} not attached to the new state: {type(e).__name__}: {e}"
        head.storage_changed = False  # the replica's own L3, not a client's change
        log.info("replica %s: L3 %s attached to the host workers", self.config.replica, params.url)
        return ""

    def _track_storage(self) -> None:
        """After a control call (lock held): an ``attach_storage_backend``/``detach_storage_backend`` that
        succeeded changes what every later state (rebuild, restart) gets, and the GCS record. Nothing
        else does: a failed attach of a new state, or a failed re-attach in ``reset``, leaves the
        replica's L3 as configured, and the next state tries it again."""
        head = self._head
        if head is None or not head.storage_changed:
            return
        head.storage_changed = False
        ctl = head.controller
        now = None if ctl is None or ctl.storage is None else ctl.storage.params
        self._storage = now
        try:
            ray_storage_record.remember(self.config.replica, now)
        except Exception as e:  # the live state is right; only a head restart would miss the change
            log.warning("replica %s: recording the L3 attachment failed: %s", self.config.replica, e)
            self._reason = f"L3 attachment not recorded (a head restart would not see it): {type(e).__name__}: {e}"

    def _install(self, group: RayWorkerGroup | None) -> None:
        head = None if self._stop.is_set() else self._fresh_head(group)
        reason = "" if head is None else self._attach_storage(head)  # outside the lock: calls the workers
        with self._lock:
            if self._stop.is_set():
                if group is not None:
                    group.kill()
                return
            if self._notice is not None and head is not None:  # a rebuild after the notice admits nothing
                head.drain_progress = DrainProgress(DrainState.DONE, self._notice.deadline_s)
            self._head = head
            self._group = group
            self._epoch = _new_epoch()
            self._state = HeadState.READY
            self._reason = reason
        log.info("replica %s ready (epoch %x)", self.config.replica, self._epoch)

    def _start_builder(self, old: RayWorkerGroup | None) -> None:
        threading.Thread(target=self._build, args=(old,), name="hicache-builder", daemon=True).start()

    def _build(self, old: RayWorkerGroup | None) -> None:
        cfg = self.config
        assert cfg.workers is not None
        if old is not None:
            old.kill()
        capacity = cfg.head.tree.capacity_pages
        assert capacity is not None  # ReplicaConfig requires it with workers
        while not self._stop.is_set():
            group = RayWorkerGroup(cfg.replica, cfg.workers, capacity,
                                   cfg.head.hicache.host_slots if cfg.head.hicache else 1, detached=cfg.detached,
                                   component_pools=cfg.head.component_pools(cfg.workers.component_specs))
            try:
                group.start(_new_epoch())
            except Exception as e:  # placement, start or jax session failed: try again
                log.warning("replica %s: starting host workers failed: %s", cfg.replica, e)
                with self._lock:
                    self._reason = f"starting host workers failed: {type(e).__name__}: {e}"
                self._stop.wait(cfg.rebuild_backoff_s)
                continue
            self._install(group)
            return

    def _fail(self, reason: str) -> None:
        """A host was lost: discard the state (lock held); the builder brings a new gang."""
        if self._state is not HeadState.READY:
            return
        head, group = self._head, self._group
        if head is not None and head.controller is not None:
            head.controller.drop_host_tier(reason)  # in-flight transfers fail; nothing served from L2
        self._head, self._group, self._epoch = None, None, None
        self._state, self._reason = HeadState.REBUILDING, reason
        self._resets += 1
        log.warning("replica %s: %s; rebuilding", self.config.replica, reason)
        self._start_builder(group)

    def _monitor(self) -> None:
        while not self._stop.wait(self.config.health_interval_s):
            self._publish_if_stale()
            group = self._group
            if group is None or self._state is not HeadState.READY:
                continue
            if not group.check_alive():
                with self._lock:
                    if self._group is group:
                        self._fail(group.lost or "host worker lost")

    def _publish_if_stale(self) -> None:
        """(monitor thread) Calls came after the last metrics snapshot: publish one now, so a replica that
        goes idle exports its last calls' counters (the control thread publishes at most every
        ``_METRICS_INTERVAL_S``, and only while calls come). A step in progress defers it to the next tick."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            head = self._head
            if head is None or self._last_call is None or self._last_call <= self._last_publish:
                return
            self._last_publish = time.monotonic()
            head.publish_metrics()
        finally:
            self._lock.release()

    # -- control (one thread) ---------------------------------------------------------------------------
    def _run(self, epoch_seen: int | None, calls: Sequence[Call]) -> Reply:
        return self._serve(epoch_seen, len(calls), lambda head: head.step(calls))

    def _serve(self, epoch_seen: int | None, num_calls: int, execute: Callable[[CacheHead], Any]) -> Reply:
        """Runs ``execute(head)`` on the current state if the caller's epoch is current; its value
        becomes ``Reply.results`` (an unexpected error: that error for each of ``num_calls`` calls)."""
        with self._lock:
            self._calls += 1
            self._last_call = time.monotonic()
            if self._state is not HeadState.READY:
                return Reply("unavailable", None, reason=f"replica {self.config.replica!r} is {self._state.value}"
                             + (f": {self._reason}" if self._reason else ""))
            if epoch_seen is not None and epoch_seen != self._epoch:
                return Reply("reset", self._epoch, reason=self._last_reset_reason())
            group = self._group
            if group is not None and group.lost is not None:
                self._fail(group.lost)
                return Reply("unavailable", None, reason=self._reason)
            epoch, head = self._epoch, self._head
            assert head is not None  # READY: a state is installed
            try:
                results = execute(head)
            except Exception as e:  # not a per-call error the head knows: report it for every call
                results = [CallResult(False, error=e)] * num_calls
            self._track_storage()
            if self._last_call - self._last_publish >= _METRICS_INTERVAL_S:
                self._last_publish = self._last_call
                head.publish_metrics()
            if group is not None and group.lost is not None:
                reason = group.lost
                self._fail(reason)
                return Reply("reset", None, reason=reason)  # results refer to the state just lost
            return Reply("ok", epoch, results)

    def _last_reset_reason(self) -> str:
        return f"{self._resets} reset(s) in this head incarnation" if self._resets else "the head restarted"

    @ray.method(concurrency_group="control")
    def step(self, epoch_seen: int | None, calls: Sequence[Call]) -> Reply:
        return self._run(epoch_seen, list(calls))

    @ray.method(concurrency_group="control")
    def step_wire(self, *chunks: bytes) -> bytes:
        """``step`` in the compact wire format (``hicache.cluster.wire``): ``_run_wire_step`` of the request
        cut into chunks below Ray's inline-argument size (100 KB), so it rides in the task message itself
        (no object-store round trip, which costs more than the chunking)."""
        return self._run_wire_step(b"".join(chunks))

    def _run_wire_step(self, request: bytes | bytearray) -> bytes:
        """One wire-format step, from the Ray path or the step channel. The request is one pickle of
        (epoch seen, key-history session, steps it committed, its cap, header, int32 buffer). The reply
        is one pickle of a ``Reply`` whose ``results`` are the encoded (header, buffer); status "resync"
        (nothing ran) when the session's key history here is not the client's
        (``hicache.cluster.key_history``)."""
        epoch_seen, session, steps, cap_tokens, header, buf = pickle.loads(request)

        def execute(head: CacheHead) -> Any:
            history = self._histories.for_step(session, steps, cap_tokens)
            return None if history is None else wire.run_step(head, header, buf, history)

        reply = self._serve(epoch_seen, len(header), execute)
        if reply.status == "ok" and reply.results is None:
            reply = Reply("resync", reply.epoch)
        elif reply.status == "ok" and isinstance(reply.results, list):  # an unexpected error, one per call
            n = len(header)
            reply = Reply("ok", reply.epoch, wire.encode_results([None] * n, [r.error for r in reply.results], [None] * n))
        return pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)

    # -- health (never behind the control thread) ---------------------------------------------------------
    @ray.method(concurrency_group="health")
    def step_channel(self) -> ChannelAddress | None:
        """Where a client sends its steps directly (started on the first call; ``ReplicaConfig.step_channel_scope``
        says who can reach it); None when the channel is switched off (``ReplicaConfig.step_channel``, ``set_step_channel``) or the head stopped."""
        with self._channel_lock:
            if not self._channel_enabled or self._stop.is_set():
                return None
            if self._channel is None or self._channel.closed:
                host = LOOPBACK if self.config.step_channel_scope is ChannelScope.NODE else ray.util.get_node_ip_address()
                self._channel = StepChannelServer(self._run_wire_step, ray.get_runtime_context().get_node_id(), host=host)
            return self._channel.address

    @ray.method(concurrency_group="health")
    def set_step_channel(self, enabled: bool) -> None:
        """Switches the step channel on or off. Off closes it and every connection (a step running now
        finishes and its reply is lost: that client's call fails as unavailable); clients then send their
        steps as Ray calls and ask again for a channel from time to time."""
        if type(enabled) is not bool:
            raise TypeError(f"enabled must be a bool, got {enabled!r}")
        with self._channel_lock:
            self._channel_enabled = enabled
            if not enabled:
                self._close_channel()

    # -- test hooks (``ReplicaConfig.test_hooks``; refused otherwise) ----------------------------------------
    def _require_test_hooks(self) -> None:
        if not self.config.test_hooks:
            raise RuntimeError(f"replica {self.config.replica!r} was started without ReplicaConfig.test_hooks")

    @ray.method(concurrency_group="control")
    def hold_control_for_test(self, timeout_s: float) -> bool:
        """TEST ONLY: occupies the control thread with the state lock held, as a long step does (Ray
        steps queue behind it, channel steps wait for the lock), until ``release_control_for_test`` or
        ``timeout_s``; returns True if released. ``wait_control_held_for_test`` says when it holds."""
        self._require_test_hooks()
        with self._lock:
            self._test_held.set()
            released = self._test_release.wait(timeout_s)
            self._test_held.clear()
        self._test_release.clear()
        return released

    @ray.method(concurrency_group="health")
    def wait_control_held_for_test(self, timeout_s: float) -> bool:
        """TEST ONLY: True once ``hold_control_for_test`` holds the control thread (False: ``timeout_s``)."""
        self._require_test_hooks()
        return self._test_held.wait(timeout_s)

    @ray.method(concurrency_group="health")
    def release_control_for_test(self) -> None:
        """TEST ONLY: lets ``hold_control_for_test`` return (also if it has not started yet)."""
        self._require_test_hooks()
        self._test_release.set()

    @ray.method(concurrency_group="health")
    def hold_drain_for_test(self) -> None:
        """TEST ONLY: the next drain stops between two rounds (outside the state lock) once something is
        stored and something is left, until ``release_drain_for_test``; ``wait_drain_for_test("held")``
        says when."""
        self._require_test_hooks()
        self._test_drain_release.clear()
        self._test_drain_armed.set()

    @ray.method(concurrency_group="health")
    def release_drain_for_test(self) -> None:
        """TEST ONLY: lets a held drain go on."""
        self._require_test_hooks()
        self._test_drain_held.clear()
        self._test_drain_release.set()

    @ray.method(concurrency_group="health")
    def wait_drain_for_test(self, stage: str, timeout_s: float) -> bool:
        """TEST ONLY: True once the drain on a notice is ``held`` (``hold_drain_for_test``) or has
        ``ended`` (done or failed); False after ``timeout_s``."""
        self._require_test_hooks()
        events = {"held": self._test_drain_held, "ended": self._drain_ended}
        if stage not in events:
            raise ValueError(f"stage must be one of {sorted(events)}, got {stage!r}")
        return events[stage].wait(timeout_s)

    def _close_channel(self) -> None:
        """(``_channel_lock`` held)"""
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    @ray.method(concurrency_group="health")
    def health(self) -> HeadHealth:
        last = self._last_call
        return HeadHealth(
            self.config.replica, self._state, self._epoch, self._reason,
            self.config.workers.num_hosts if self.config.workers else 0, self.config.head.tree.page_size,
            self._resets, self._reconstructed, self._calls, None if last is None else time.monotonic() - last,
        )

    @ray.method(concurrency_group="health")
    def get_config(self) -> ReplicaConfig:
        return self.config

    @ray.method(concurrency_group="health")
    def workers(self) -> tuple[int, list[Any], list[tuple[int, int]]]:
        """(epoch, host worker handles in host order, KV-head range of each) of the current state."""
        group, epoch = self._group, self._epoch
        if self._state is not HeadState.READY or group is None or epoch is None:
            raise HiCacheUnavailableError(f"replica {self.config.replica!r} has no host workers now ({self._state.value})")
        return epoch, list(group.actors), list(group.head_ranges)

    @ray.method(concurrency_group="health")
    def shutdown(self) -> None:
        """Stops monitor and builder, kills the host workers and removes their placement group."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.close(timeout_s=1.0)
        with self._channel_lock:
            self._close_channel()
        with self._lock:
            self._state = HeadState.STOPPED
            group, self._group, self._head = self._group, None, None
        if group is not None:
            group.kill()
        cfg = self.config
        if cfg.workers is not None:
            RayWorkerGroup(cfg.replica, cfg.workers, 1, 1, detached=cfg.detached).remove_placement_group()
        try:
            ray_storage_record.forget(self.config.replica)  # a later replica of this name starts from its config
        except Exception as e:
            log.warning("replica %s: deleting the L3 attachment record failed: %s", self.config.replica, e)


# ------------------------------------------------------------------------------------------------
def get_head(replica: str) -> Any:
    """The head actor handle of ``replica`` (``HiCacheUnavailableError`` if there is none)."""
    try:
        return ray.get_actor(head_name(replica), namespace=NAMESPACE)
    except ValueError:
        raise HiCacheUnavailableError(f"no hicache replica {replica!r} in namespace {NAMESPACE!r}") from None


def wait_ready(head: Any, timeout_s: float) -> HeadHealth:
    deadline = time.monotonic() + timeout_s
    h = None
    while time.monotonic() < deadline:
        try:
            h = ray.get(head.health.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            h = None
        if h is not None and h.state is HeadState.READY:
            return h
        time.sleep(0.1)
    raise HiCacheUnavailableError(f"replica not ready within {timeout_s}s: {h}")


def start_replica(config: ReplicaConfig, *, timeout_s: float = 180.0, address: str | None = None) -> Any:
    """Creates (or finds) the head ``hicache/head-<replica>``, which starts its host workers; waits
    until it serves. Needs a running Ray cluster (``address``; default: this process's Ray).

    Returns the head's actor handle. With ``detached=False`` the head is owned by this process and
    Ray destroys it when the last handle goes away: keep the returned handle.
    """
    if not isinstance(config, ReplicaConfig):
        raise TypeError(f"expected a ReplicaConfig, got {type(config).__name__}")
    if not ray.is_initialized():
        ray.init(address=address or "auto", namespace=NAMESPACE)
    head = CacheHeadActor.options(  # type: ignore[attr-defined]  # a Ray actor class
        name=head_name(config.replica), namespace=NAMESPACE, get_if_exists=True,
        lifetime="detached" if config.detached else None, max_restarts=config.max_restarts, max_task_retries=0,
        num_cpus=0, resources=dict(config.head_resources),
    ).remote(config)
    existing = ray.get(head.get_config.remote(), timeout=timeout_s)
    if existing != config:
        raise ValueError(f"replica {config.replica!r} already runs with another config: {existing}")
    wait_ready(head, timeout_s)
    return head


def stop_replica(replica: str, timeout_s: float = 30.0) -> None:
    """Kills the workers, removes their placement group and kills the head (no restart)."""
    head = get_head(replica)
    try:
        ray.get(head.shutdown.remote(), timeout=timeout_s)
    finally:
        ray.kill(head, no_restart=True)


def worker_handles(replica: str, timeout_s: float = 30.0) -> tuple[int, list[Any], list[tuple[int, int]]]:
    """(epoch, host worker handles, KV-head range per host) of a running replica (data-plane access)."""
    return ray.get(get_head(replica).workers.remote(), timeout=timeout_s)
