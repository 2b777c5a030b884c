"""HostWorker: one per host of a replica; owns that host's L1 shard, L2 pool and transfer engine.

It executes ``TransferPlan``s strictly in ``seq`` order and answers one ``TransferAck`` per op; it
never decides anything (no imports of ``hicache.cluster``). A plan is validated as a whole before
any op runs (``ValueError``/``TypeError``, nothing touched). D2H/H2D ops are dispatched at once (JAX
async dispatch) and acked by ``poll``/``wait`` when ``is_ready()``; L2->L3 and L3->L2 ops run
through a pluggable ``storage_executor`` (the L3 integration provides it); without one they are
acked ``ok=False``.

Ordering: device-side order follows data dependencies on the pool array; host-side, an op that
reads slots (H2D, H2S) first commits earlier pending ops that write those slots (D2H, S2H).

Threading/ownership: a plain, single-threaded class. Call every method from the thread that owns
the KV pool (the model runner's), between forwards; the Ray actor (cluster issue) wraps it as is.
Multi-host: every host receives the same plans and calls ``submit`` in the same order (the
device-side work is SPMD); ``poll``/``wait`` are local.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh

from hicache.kernels.paged_copy import CopyImpl
from hicache.workers.device_pool import DevicePool, default_mesh
from hicache.workers.host_pool import HostPool, HostPoolConfig, HostPoolKind, make_host_pool, size_host_pool
from hicache.workers.plan import OpKind, TransferAck, TransferOp, TransferPlan
from hicache.workers.spec import KVCacheSpec
from hicache.workers.transfer import TransferEngine, TransferHandle

# (op, host_pool) -> bytes moved; raise to fail the op. Must leave the pool unchanged on failure
# (read all objects first, then one write_slots).
StorageExecutor = Callable[[TransferOp, HostPool], int]

_READS_SLOTS = (OpKind.LOAD_H2D, OpKind.BACKUP_H2S)
_WRITES_SLOTS = (OpKind.BACKUP_D2H, OpKind.PREFETCH_S2H)
_DEVICE_OPS = (OpKind.BACKUP_D2H, OpKind.LOAD_H2D)


@dataclass
class _Pending:
    seq: int
    op: TransferOp
    handle: TransferHandle | None
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
        host_pool_kind: HostPoolKind | str | None = None,
        storage_executor: StorageExecutor | None = None,
    ) -> None:
        if mesh is None:
            mesh = default_mesh(spec.num_kv_heads, devices)
        elif devices is not None:
            raise ValueError("pass either mesh or devices, not both")
        self.host_index = int(host_index)
        self.device_pool = DevicePool(spec, num_device_pages, mesh=mesh)
        if isinstance(host_pool, HostPoolConfig):
            device_share = self.device_pool.num_pages * int(np.prod(self.device_pool.host_row_shape)) * self.device_pool.dtype.itemsize
            row_bytes = int(np.prod(self.device_pool.host_row_shape)) * self.device_pool.dtype.itemsize
            num_slots = size_host_pool(host_pool, row_bytes, device_share)
            host_pool_kind = host_pool_kind or host_pool.kind
        else:
            num_slots = host_pool
        self.host_pool = make_host_pool(self.device_pool, num_slots, host_pool_kind)
        self.engine = TransferEngine(self.device_pool, self.host_pool, impl=impl)
        self.storage_executor = storage_executor
        self._last_seq: int | None = None
        self._pending: deque[_Pending] = deque()

    # -- plans ---------------------------------------------------------------------------------
    def validate(self, plan: TransferPlan) -> None:
        """Raises ``ValueError``/``TypeError`` naming the bad value; touches nothing."""
        self._check(plan)

    def _check(self, plan: TransferPlan) -> list[tuple[np.ndarray, np.ndarray] | None]:
        """``validate``, returning the checked (int32, in range, unique) ids of each D2H/H2D op."""
        if not isinstance(plan, TransferPlan):
            raise TypeError(f"expected a TransferPlan, got {type(plan).__name__}")
        if self._last_seq is not None and plan.seq <= self._last_seq:
            raise ValueError(f"plan seq {plan.seq} must be > last submitted seq {self._last_seq}")
        checked: list[tuple[np.ndarray, np.ndarray] | None] = []
        for op in plan.ops:
            try:
                if op.kind in _DEVICE_OPS:
                    checked.append(self.engine.check(op.device_pages, op.host_slots))
                else:
                    self.host_pool.check_slots(op.host_slots)
                    checked.append(None)
            except (ValueError, TypeError) as e:
                raise type(e)(f"plan {plan.seq} op {op.op_id} ({op.kind.value}): {e}") from None
        return checked

    def submit(self, plan: TransferPlan) -> None:
        """Validates the whole plan, then dispatches its ops in order (non-blocking for D2H/H2D)."""
        checked = self._check(plan)
        self._last_seq = plan.seq
        for op, ids in zip(plan.ops, checked):
            self._dispatch(plan.seq, op, ids)

    def _settle_writers(self, slots: np.ndarray) -> None:
        """Commits pending slot-writing ops that overlap ``slots`` (and all ops before them)."""
        last = -1
        wanted: set[int] | None = None
        for i, p in enumerate(self._pending):
            if p.ack is None and p.op.kind in _WRITES_SLOTS:
                if wanted is None:
                    wanted = set(slots.tolist())
                if not wanted.isdisjoint(p.op.host_slots.tolist()):
                    last = i
        for i in range(last + 1):
            self._finish(self._pending[i])

    def _dispatch(self, seq: int, op: TransferOp, ids: tuple[np.ndarray, np.ndarray] | None) -> None:
        entry = _Pending(seq, op, None, None)
        self._pending.append(entry)
        t0 = time.perf_counter()
        try:
            if op.kind in _READS_SLOTS and self._pending[0] is not entry:
                self._settle_writers(op.host_slots)
            if op.kind is OpKind.BACKUP_D2H:
                assert ids is not None
                entry.handle = self.engine.backup_checked(*ids)
            elif op.kind is OpKind.LOAD_H2D:
                assert ids is not None
                pages, slots = ids
                entry.handle = self.engine.load_checked(slots, pages)
            else:
                if self.storage_executor is None:
                    raise RuntimeError(f"no storage backend attached: cannot run {op.kind.value} ops")
                moved = int(self.storage_executor(op, self.host_pool))
                entry.ack = self._ack(entry, True, None, moved, time.perf_counter() - t0)
        except Exception as e:  # the op fails; pools unchanged (commit is the last step)
            entry.ack = self._ack(entry, False, f"{type(e).__name__}: {e}", 0, time.perf_counter() - t0)

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
        """Acks of finished ops, in submission order; never blocks on an unfinished transfer."""
        out: list[TransferAck] = []
        while self._pending:
            p = self._pending[0]
            if p.ack is None:
                if p.handle is None or not p.handle.is_ready():
                    break
                self._finish(p)
            out.append(p.ack)
            self._pending.popleft()
        return out

    def wait(self, timeout_s: float) -> list[TransferAck]:
        """Acks everything submitted, or what finished before ``timeout_s`` passed."""
        if timeout_s is None or timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s!r}")
        deadline = time.perf_counter() + timeout_s
        out = self.poll()
        while self._pending:
            p = self._pending[0]
            if p.handle is not None and p.ack is None and not p.handle.is_ready():
                left = deadline - time.perf_counter()
                if left <= 0 or not p.handle.block_until_ready(left):
                    break
            out += self.poll()
        return out

    @property
    def num_pending(self) -> int:
        return len(self._pending)
