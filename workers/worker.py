"""HostWorker: one per host of a replica; owns that host's L1 shard, L2 pool and transfer engine.

A hybrid model's other paged pools (``ComponentPool``: e.g. the sliding-window layers' KV, the recurrent
states) are this worker's too: each an L1 ``DevicePool`` on the same mesh, an L2 ``HostPool`` and a
``TransferEngine`` (``pools``), lent to the model with L1 (``run_model``) and moved by the ``PoolCopy``
parts of the same D2H/H2D op as the Full pages (one ack per op for every pool).

It executes ``TransferPlan``s strictly in ``seq`` order and answers one ``TransferAck`` per op; it
never decides anything (no imports of ``hicache.cluster``). A plan is validated as a whole before
any op runs (``ValueError``/``TypeError``, nothing touched). D2H/H2D ops are dispatched at once (JAX
async dispatch) and acked by ``poll``/``wait`` when ``is_ready()``; L2->L3 and L3->L2 ops run
through a pluggable ``storage_executor`` (the L3 integration provides it) on two background threads
per worker, one per direction (``storage-h2s-<host>``, ``storage-s2h-<host>``: a prefetch, which a
request may be waiting for, never queues behind write-backs), each in submission order, and are
acked through the same ``poll``/``wait`` (a ``StorageHandle``); without an executor they are acked
``ok=False``. ``submit`` never blocks on network storage I/O (it only may wait, bounded by the storage
timeout, when an op depends on the slots of a pending storage op, which the head never plans in
practice); an executor whose ``inline_reads`` is true (a local disk) runs a prefetch at dispatch
instead, since its read takes less than the hand-off.

Ordering (host side):

* an op that reads slots (H2D, H2S) first commits earlier pending ops that write those slots (D2H,
  S2H); waiting on an S2H is bounded by the storage timeout;
* a D2H first waits for earlier pending H2S ops that read its slots on the storage thread (its commit
  replaces the slot arrays they read); an H2D needs no such wait (it takes the slots' arrays at
  dispatch, and a later commit only replaces them);
* storage ops of one direction run one at a time in submission order; the two directions touch
  disjoint slots (the head pins a backup's slots until it is acked, a prefetch fills fresh slots, and
  an H2S reading slots an S2H fills first commits that S2H, as above).

Waiting: ``wait(timeout_s)`` waits for everything submitted; ``wait(timeout_s, op_ids=...)`` only
for the named ops (and, for a named D2H/H2D, the earlier ops of its kind, which are acked in order),
so a load-back never waits behind L2->L3 writes nor behind D2H backups (the slow direction on TPU:
a backup of the request before must not sit on the next one's time to first token). Both return
every ack that is ready.

An S2H never writes the pool from the storage thread: the executor may return ``(bytes, commit)``
and ``commit()`` (the one pool write) runs on the owner thread when the op is acked, like a D2H
commit; a failed or timed-out op commits nothing. Acks come in submission order except that an
unfinished storage op does not hold back later, independent ops (a hung L3 never delays D2H/H2D
acks), and D2H and H2D do not hold back each other; each device kind keeps its own order (a later
D2H to a slot commits after an earlier one). Nothing else depends on the order across kinds: an op
reading slots commits their pending writers at dispatch, and the runtime orders the device work on
the pool (donation).

Threading/ownership: call every method from the thread that owns the KV pool (the model runner's),
between forwards; only the executor call itself runs on the storage thread (it reads slots, and
fills private buffers). The Ray actor wraps the class as is. Multi-host: every host receives the
same plans and calls ``submit`` in the same order (the device-side work is SPMD); ``poll``/``wait``
are local.

Engine placement (DESIGN.md §1): the process that owns the devices runs the model. ``attach_model``
puts the engine's per-host model runner (any ``PoolModel``, e.g. the reference engine's
``ModelRunner``) into the worker, built over this worker's L1 array; ``run_model(fn)`` lends it the
current L1 array for ``fn`` (forwards donate it) and takes the result back before any transfer runs
again. Both run on the KV-owning thread, so forwards and plans are dispatched in that thread's
order, and the JAX runtime orders their device work (a donation waits for pending work on the
buffer): the worker needs no hand-over protocol beyond that. A forward may contain cross-host
collectives: every host must run the same model calls in the same order (the serving loop sends
each call to every host); transfers contain none, so plans may interleave with forwards
differently on each host.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh

from hicache.kernels.paged_copy import CopyImpl
from hicache.workers.device_pool import DevicePool, default_mesh
from hicache.workers.fused_pool import FusedLayerPool
from hicache.workers.host_pool import HostPool, HostPoolConfig, size_host_pool
from hicache.workers.plan import OpKind, TransferAck, TransferOp, TransferPlan
from hicache.workers.spec import ComponentPool, KVCacheSpec
from hicache.workers.transfer import TransferEngine, TransferHandle, join_handles

# (op, host_pool) -> bytes moved, or (bytes moved, commit) where ``commit()`` does the op's pool
# writes on the owner thread at ack time; raise to fail the op. Runs on the worker's storage thread:
# it may read slots, and must not write the pool there (return a commit instead) unless the pool is
# safe for that. Must leave the pool unchanged on failure.
StorageOpFn = Callable[[TransferOp, HostPool], "int | tuple[int, Callable[[], None]]"]


class PoolModel(Protocol):
    """A per-host model runner that forwards over the worker's L1 array (it donates it per forward).

    Contract: ``pool`` is the array after the model's last forward (the one it was given if it ran
    none), in the pool's shape, dtype and sharding; ``set_pool`` hands it the worker's current array
    (after a transfer replaced it)."""

    @property
    def pool(self) -> jax.Array: ...  # the L1 array after its last forward

    def set_pool(self, kv_pool: jax.Array) -> None: ...


class ComponentPoolModel(PoolModel, Protocol):
    """A ``PoolModel`` of a hybrid model whose component pools (``ComponentPool``) the worker owns too:
    ``component_pool(name)`` / ``set_component_pool(name, array)`` as ``pool`` / ``set_pool``."""

    def component_pool(self, name: str) -> jax.Array: ...

    def set_component_pool(self, name: str, array: jax.Array) -> None: ...


# Checked ids of a D2H/H2D op's component pools: (that pool's engine, device pages, host slots) each.
_PoolIds = list[tuple[TransferEngine, np.ndarray, np.ndarray]]

_T = TypeVar("_T")

_READS_SLOTS = (OpKind.LOAD_H2D, OpKind.BACKUP_H2S)
_WRITES_SLOTS = (OpKind.BACKUP_D2H, OpKind.PREFETCH_S2H)
_DEVICE_OPS = (OpKind.BACKUP_D2H, OpKind.LOAD_H2D)


class StorageHandle:
    """One storage op running on the worker's storage thread (same surface as ``TransferHandle``)."""

    __slots__ = ("kind", "future", "started", "finished_at", "_done")

    def __init__(self, kind: OpKind, future: cf.Future) -> None:
        self.kind = kind
        self.future = future
        self.started = time.perf_counter()
        self.finished_at: float | None = None
        self._done = False

    def is_ready(self) -> bool:
        return self._done or self.future.done()

    def block_until_ready(self, timeout_s: float | None = None) -> bool:
        if self.is_ready():
            return True
        cf.wait([self.future], timeout=timeout_s)
        return self.future.done()

    def finish(self) -> int:
        """Waits for the op, then commits its pool writes (owner thread); raises if it failed."""
        if self._done:
            raise RuntimeError("storage op already finished")
        self._done = True
        result, t_end = self.future.result()
        self.finished_at = t_end
        if isinstance(result, tuple):
            moved, commit = result
            commit()
            self.finished_at = time.perf_counter()
            return int(moved)
        return int(result)

    def abort(self) -> None:
        self.future.cancel()  # a running call ends by itself (bounded by the storage timeout)
        self._done = True

    @property
    def duration_s(self) -> float:
        end = self.finished_at if self.finished_at is not None else time.perf_counter()
        return end - self.started


def _id_set(op_ids: Collection[int]) -> set[int]:
    if isinstance(op_ids, (str, bytes)) or not isinstance(op_ids, Collection):
        raise TypeError(f"op_ids must be a collection of ints, got {type(op_ids).__name__}: {op_ids!r}")
    ids = set()
    for i in op_ids:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"op_ids must be ints, got {i!r}")
        ids.add(int(i))
    return ids


def _run_timed(fn: Callable, op: TransferOp, pool: HostPool):
    return fn(op, pool), time.perf_counter()


def run_now(fn: Callable[..., _T], *args: Any) -> cf.Future:
    """``fn(*args)`` on this thread, as a finished future (its value, or the error it raised): for a call
    that would go to another thread but is cheaper than the hand-off."""
    done: cf.Future = cf.Future()
    try:
        done.set_result(fn(*args))
    except Exception as e:
        done.set_exception(e)
    return done


@dataclass
class _Pending:
    seq: int
    op: TransferOp
    handle: TransferHandle | StorageHandle | None
    ack: TransferAck | None  # set once finished (or failed at dispatch)


class HostWorker:
    def __init__(
        self,
        spec: KVCacheSpec,
        num_device_pages: int,
        host_pool: int | HostPoolConfig,
        *,
        host_index: int = 0,
        mesh: Mesh | None = None,
        devices: list[jax.Device] | None = None,
        impl: CopyImpl | str | None = None,
        storage_executor: StorageOpFn | None = None,
        device_pool: FusedLayerPool | None = None,
        component_pools: tuple[ComponentPool, ...] = (),
    ) -> None:
        """``impl``: the paged-copy kernel implementation (default: ``select_impl()`` per backend);
        ``device_pool``: L1 is an engine's own arrays (``FusedLayerPool`` of ``spec`` and
        ``num_device_pages``, on its own mesh) instead of a ``DevicePool`` this worker allocates;
        ``component_pools``: a hybrid model's other paged pools (``ComponentPool``, e.g. its sliding-window
        layers' KV), each a ``DevicePool`` on the same mesh with an L2 pool of its own, moved by the ops'
        ``PoolCopy`` parts with the same transfer code."""
        if device_pool is not None:
            if device_pool.spec != spec or device_pool.num_pages != num_device_pages or mesh or devices:
                raise ValueError(f"device_pool ({device_pool.spec}, {device_pool.num_pages} pages) must match spec "
                                 f"{spec} and num_device_pages {num_device_pages}, with no mesh or devices")
        elif mesh is None:
            mesh = default_mesh(spec.num_kv_heads, devices)
        elif devices is not None:
            raise ValueError("pass either mesh or devices, not both")
        self.host_index = int(host_index)
        self.device_pool: DevicePool | FusedLayerPool = (
            device_pool if device_pool is not None else DevicePool(spec, num_device_pages, mesh=mesh))
        if isinstance(host_pool, HostPoolConfig):
            device_share = self.device_pool.num_pages * int(np.prod(self.device_pool.host_row_shape)) * self.device_pool.dtype.itemsize
            row_bytes = int(np.prod(self.device_pool.host_row_shape)) * self.device_pool.dtype.itemsize
            num_slots = size_host_pool(host_pool, row_bytes, device_share)
        else:
            num_slots = host_pool
        self.host_pool = HostPool(self.device_pool, num_slots)
        self.engine = TransferEngine(self.device_pool, self.host_pool, impl=impl)
        self.storage_executor = storage_executor
        # name -> (L1 pool, L2 pool, transfer engine) of each component pool
        self.pools: dict[str, tuple[DevicePool, HostPool, TransferEngine]] = {}
        for cp in component_pools:
            if not isinstance(cp, ComponentPool):
                raise TypeError(f"component_pools must hold ComponentPool, got {type(cp).__name__}")
            if cp.name in self.pools:
                raise ValueError(f"component pool {cp.name!r} given twice")
            if not isinstance(self.device_pool, DevicePool):
                raise ValueError("component pools need an L1 DevicePool of this worker (not an engine's own arrays)")
            dp = DevicePool(cp.spec, cp.num_device_pages, mesh=self.device_pool.mesh)
            hp = HostPool(dp, cp.host_slots)
            self.pools[cp.name] = (dp, hp, TransferEngine(dp, hp, impl=impl))
        self._last_seq: int | None = None
        self._pending: deque[_Pending] = deque()
        # one thread per direction: a prefetch (on a waiting request's path) never queues behind write-backs
        self._storage_lanes: dict[OpKind, cf.ThreadPoolExecutor] = {}
        self._model: PoolModel | None = None

    # -- the engine's model runner (on the KV-owning thread, between plans) -------------------------
    def attach_model(self, factory: Callable[[jax.Array], PoolModel]) -> PoolModel:
        """Builds the engine's per-host model runner over this worker's L1 array (``factory(kv)``)
        and keeps it; replaces any earlier one. Returns it."""
        model = factory(self._allocated_pool().kv)
        for name in ("pool", "set_pool", *(("component_pool", "set_component_pool") if self.pools else ())):
            if not hasattr(model, name):
                raise TypeError(f"attach_model: {type(model).__name__} has no {name!r} (not a PoolModel"
                                f"{' of component pools ' + str(sorted(self.pools)) if self.pools else ''})")
        self._model = model
        return model

    @property
    def model(self) -> PoolModel | None:
        return self._model

    def run_model(self, fn: Callable[[PoolModel], _T]) -> _T:
        """``fn(model)`` with the current L1 array lent to the model; the array the model holds
        afterwards (its last forward's output) becomes the worker's L1 again, also when ``fn`` raises.
        The model is handed the array only if it does not hold it already (its last call's output,
        no transfer since), and only an array other than the one lent is checked (``set_kv``)."""
        model = self._model
        if model is None:
            raise RuntimeError(f"host worker {self.host_index}: no model attached (attach_model first)")
        pool = self._allocated_pool()
        lent = pool.kv
        if model.pool is not lent:  # a transfer replaced the array since the model last held it
            model.set_pool(lent)
        if self.pools:
            return self._run_with_components(model, fn, pool, lent)
        try:
            return fn(model)
        finally:
            back = model.pool
            if back is not lent:  # forwards donated the lent array: ``back`` is the last one's output
                pool.set_kv(back)

    def _run_with_components(self, model: PoolModel, fn: Callable[[PoolModel], _T], pool: DevicePool,
                             lent: jax.Array) -> _T:
        """``run_model`` lending the component pools too (each as the L1 array)."""
        assert hasattr(model, "component_pool")  # attach_model checked it
        cmodel: ComponentPoolModel = model  # type: ignore[assignment]  # (checked by attach_model)
        lent_parts = {}
        for name, (dp, _, _) in self.pools.items():
            arr = lent_parts[name] = dp.kv
            if cmodel.component_pool(name) is not arr:
                cmodel.set_component_pool(name, arr)
        try:
            return fn(model)
        finally:
            back = model.pool
            if back is not lent:
                pool.set_kv(back)
            for name, (dp, _, _) in self.pools.items():
                part = cmodel.component_pool(name)
                if part is not lent_parts[name]:
                    dp.set_kv(part)

    def _allocated_pool(self) -> DevicePool:
        """L1 as this worker allocated it; an engine that owns its arrays (``FusedLayerPool``) runs its own
        model."""
        if not isinstance(self.device_pool, DevicePool):
            raise RuntimeError(f"host worker {self.host_index}: L1 is an engine's own arrays, not a model's pool")
        return self.device_pool

    # -- plans ---------------------------------------------------------------------------------
    def validate(self, plan: TransferPlan) -> None:
        """Raises ``ValueError``/``TypeError`` naming the bad value; touches nothing."""
        self._check(plan)

    def _check(self, plan: TransferPlan) -> tuple[list[tuple[np.ndarray, np.ndarray] | None], dict[int, _PoolIds]]:
        """``validate``, returning the checked (int32, in range, unique) ids of each D2H/H2D op, and those of
        the component pools of the ops that have some (by op id)."""
        if not isinstance(plan, TransferPlan):
            raise TypeError(f"expected a TransferPlan, got {type(plan).__name__}")
        if self._last_seq is not None and plan.seq <= self._last_seq:
            raise ValueError(f"plan seq {plan.seq} must be > last submitted seq {self._last_seq}")
        checked: list[tuple[np.ndarray, np.ndarray] | None] = []
        parts: dict[int, _PoolIds] = {}
        for op in plan.ops:
            try:
                if op.kind in _DEVICE_OPS:
                    checked.append(self.engine.check(op.device_pages, op.host_slots))
                    if op.pools:
                        parts[op.op_id] = self._check_pools(op)
                else:
                    if op.host_slots.size or not op.storage_parts:  # (a component value may go alone)
                        self.host_pool.check_slots(op.host_slots)
                    for part in op.storage_parts:
                        entry = self.pools.get(part.pool)
                        if entry is None:
                            raise ValueError(f"unknown component pool {part.pool!r} (this worker has {sorted(self.pools)})")
                        entry[1].check_slots(part.host_slots)
                    checked.append(None)
            except (ValueError, TypeError) as e:
                raise type(e)(f"plan {plan.seq} op {op.op_id} ({op.kind.value}): {e}") from None
        return checked, parts

    def _check_pools(self, op: TransferOp) -> _PoolIds:
        out: _PoolIds = []
        for copy in op.pools:
            entry = self.pools.get(copy.pool)
            if entry is None:
                raise ValueError(f"unknown component pool {copy.pool!r} (this worker has {sorted(self.pools)})")
            engine = entry[2]
            try:
                out.append((engine, *engine.check(copy.device_pages, copy.host_slots)))
            except (ValueError, TypeError) as e:
                raise type(e)(f"pool {copy.pool!r}: {e}") from None
        return out

    def submit(self, plan: TransferPlan) -> None:
        """Validates the whole plan, then dispatches its ops in order (non-blocking for D2H/H2D)."""
        checked, parts = self._check(plan)
        self._last_seq = plan.seq
        for op, ids in zip(plan.ops, checked):
            self._dispatch(plan.seq, op, ids, parts.get(op.op_id) if parts else None)

    @staticmethod
    def _overlaps(p: _Pending, wanted: set[int]) -> bool:
        return not wanted.isdisjoint(p.op.host_slots.tolist())

    def _settle_writers(self, slots: np.ndarray, entry: _Pending) -> None:
        """Commits pending slot-writing ops that overlap ``slots`` (and all slot writers before them)."""
        last = -1
        wanted: set[int] | None = None
        for i, p in enumerate(self._pending):
            if p is entry:
                break
            if p.ack is None and p.op.kind in _WRITES_SLOTS:
                if wanted is None:
                    wanted = set(slots.tolist())
                if self._overlaps(p, wanted):
                    last = i
        for i in range(last + 1):
            p = self._pending[i]
            if p.op.kind in _WRITES_SLOTS or p.op.kind in _DEVICE_OPS:
                self._finish(p)

    def _settle_readers(self, slots: np.ndarray, entry: _Pending) -> None:
        """Before a D2H: waits for pending H2S ops reading ``slots`` on their storage thread. (An H2D
        took its slots' arrays at dispatch; an S2H writes the pool only at its ack.)"""
        if entry.op.kind is not OpKind.BACKUP_D2H:
            return
        wanted: set[int] | None = None
        for p in self._pending:
            if p is entry:
                break
            if p.ack is not None or p.handle is None or p.op.kind is not OpKind.BACKUP_H2S:
                continue
            if wanted is None:
                wanted = set(slots.tolist())
            if self._overlaps(p, wanted):
                p.handle.block_until_ready(None)

    def _dispatch(self, seq: int, op: TransferOp, ids: tuple[np.ndarray, np.ndarray] | None,
                  parts: _PoolIds | None = None) -> None:
        entry = _Pending(seq, op, None, None)
        self._pending.append(entry)
        t0 = time.perf_counter()
        try:
            if self._pending[0] is not entry:
                if op.kind in _READS_SLOTS:
                    self._settle_writers(op.host_slots, entry)
                else:
                    self._settle_readers(op.host_slots, entry)
            if op.kind is OpKind.BACKUP_D2H:
                assert ids is not None
                entry.handle = self.engine.backup_checked(*ids)
                if parts:
                    entry.handle = self._with_parts(op.kind, entry.handle, parts)
            elif op.kind is OpKind.LOAD_H2D:
                assert ids is not None
                pages, slots = ids
                entry.handle = self.engine.load_checked(slots, pages)
                if parts:
                    entry.handle = self._with_parts(op.kind, entry.handle, parts)
            else:
                if self.storage_executor is None:
                    raise RuntimeError(f"no storage backend attached: cannot run {op.kind.value} ops")
                if op.kind is OpKind.PREFETCH_S2H and getattr(self.storage_executor, "inline_reads", False):
                    entry.handle = StorageHandle(op.kind, run_now(_run_timed, self.storage_executor, op, self.host_pool))
                    return
                lane = self._storage_lanes.get(op.kind)
                if lane is None:
                    lane = self._storage_lanes[op.kind] = cf.ThreadPoolExecutor(
                        1, thread_name_prefix=f"storage-{op.kind.value}-{self.host_index}")
                future = lane.submit(_run_timed, self.storage_executor, op, self.host_pool)
                entry.handle = StorageHandle(op.kind, future)
        except Exception as e:  # the op fails; pools unchanged (commit is the last step)
            entry.ack = self._ack(entry, False, f"{type(e).__name__}: {e}", 0, time.perf_counter() - t0)

    @staticmethod
    def _with_parts(kind: OpKind, main: TransferHandle, parts: _PoolIds) -> TransferHandle:
        """``main`` joined with the same copy in each component pool: one handle, committed together; a
        part that fails to dispatch aborts those dispatched before it (the op fails, no pool changed)."""
        handles = [main]
        try:
            for engine, pages, slots in parts:
                handles.append(engine.backup_checked(pages, slots) if kind is OpKind.BACKUP_D2H
                               else engine.load_checked(slots, pages))
        except BaseException:
            for h in handles:
                h.abort()
            raise
        return join_handles(kind, handles)

    def _ack(self, p: _Pending, ok: bool, error: str | None, moved: int, duration: float) -> TransferAck:
        return TransferAck(p.seq, p.op.op_id, self.host_index, ok, error, moved, duration)

    def _finish(self, p: _Pending) -> None:
        if p.ack is not None:
            return
        assert p.handle is not None
        try:
            moved = p.handle.finish()
            p.ack = self._ack(p, True, None, moved, p.handle.duration_s)
        except Exception as e:
            p.handle.abort()
            p.ack = self._ack(p, False, f"{type(e).__name__}: {e}", 0, p.handle.duration_s)

    # -- acks ------------------------------------------------------------------------------------
    def poll(self) -> list[TransferAck]:
        """Acks of finished ops, in submission order, never blocking on an unfinished transfer. An
        unfinished storage op does not hold back later ops, nor a D2H a later H2D (or the reverse); ops of
        one device kind keep their order."""
        out: list[TransferAck] = []
        keep: deque[_Pending] = deque()
        blocked: set[OpKind] = set()  # device op kinds with an unfinished op so far
        for p in self._pending:
            if p.ack is None:
                kind = p.op.kind
                if kind in blocked or p.handle is None or not p.handle.is_ready():
                    if kind in _DEVICE_OPS:
                        blocked.add(kind)
                    keep.append(p)
                    continue
                self._finish(p)
            assert p.ack is not None  # _finish always sets it
            out.append(p.ack)
        self._pending = keep
        return out

    def wait(self, timeout_s: float, op_ids: Collection[int] | None = None) -> list[TransferAck]:
        """Acks everything submitted, or what finished before ``timeout_s`` passed.

        With ``op_ids``, waits only until those ops are acked (e.g. a load-back waits for its load,
        not for L2->L3 writes in flight): for a device op also for the ops of its kind before it (they
        are acked in order), never for ops of another kind it does not name. Ids not pending (acked
        earlier, or never submitted) are done. Returns every ack that is ready, as ``poll``."""
        if timeout_s is None or isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s < 0:
            raise ValueError(f"timeout_s must be a number >= 0, got {timeout_s!r}")
        wanted = None if op_ids is None else _id_set(op_ids)
        deadline = time.perf_counter() + timeout_s
        out = self.poll()
        while self._pending:
            p = self._blocker(wanted)
            if p is not None:
                assert p.handle is not None  # _blocker returns only ops with a handle
                left = deadline - time.perf_counter()
                if left <= 0 or not p.handle.block_until_ready(left):
                    out += self.poll()
                    break
            out += self.poll()
            if p is None:
                break
        return out

    def _blocker(self, wanted: set[int] | None) -> _Pending | None:
        """The first unfinished op that a wait for ``wanted`` (None: everything) blocks on, or None
        when every op it needs is ready (the next ``poll`` acks them)."""
        last = len(self._pending) - 1  # ops after this one are not needed
        until: dict[OpKind, int] = {}  # device ops of a kind up to this index are needed
        if wanted is not None:
            last = -1
            for i, p in enumerate(self._pending):
                if p.ack is None and p.op.op_id in wanted:
                    last = i
                    if p.op.kind in _DEVICE_OPS:
                        until[p.op.kind] = i
        for i, p in enumerate(self._pending):
            if i > last:
                return None
            if p.ack is not None or p.handle is None or p.handle.is_ready():
                continue
            if wanted is None or p.op.op_id in wanted or i <= until.get(p.op.kind, -1):
                return p
        return None

    def close(self) -> None:
        """Stops the storage threads (each after the op it is running, which ends by the storage
        timeout; queued ones are cancelled). Device transfers in flight still complete and are acked
        by ``poll``/``wait``."""
        lanes, self._storage_lanes = self._storage_lanes, {}
        for lane in lanes.values():
            lane.shutdown(wait=False, cancel_futures=True)

    @property
    def num_pending(self) -> int:
        return len(self._pending)
