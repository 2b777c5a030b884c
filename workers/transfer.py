"""Transfer engine: L1 pages <-> L2 slots, asynchronous through JAX async dispatch.

``backup(device_pages, host_slots)`` (D2H) and ``load(host_slots, device_pages)`` (H2D) validate
their ids on the host, dispatch jitted work and return a ``TransferHandle`` at once; completion is
polled with ``is_ready()`` or awaited with ``block_until_ready(timeout_s)``, then ``finish()``
commits (for D2H, the write into the host pool happens at commit, so a failed transfer changes
nothing). No thread is involved.

Device side (per shard, inside ``shard_map`` over the pool's mesh; kernel picked by
``hicache.kernels.select_impl``):

* D2H: ``gather_pages`` into a *donated*, reused staging buffer ``[m, L, 2, S, H, D]`` (m = batch
  bucketed to a power of two), then the host pool's ``begin_backup`` (numpy copy at commit, or a
  batched ``device_put`` to ``pinned_host``). One staging batch per call: no per-page round trips,
  which matters on TPU where D2H is ~16x slower than H2D.
* H2D: the host pool stages the slots as a device array, then ``scatter_pages`` into the *donated*
  pool (in place). ``optimization_barrier`` pins the staged rows before the pool is overwritten, so
  XLA cannot sink a read of them past the write. Separate jits (a backup dispatched before a load
  of the same page) are ordered by the runtime: donation waits for pending reads of the buffer.

Ownership: the engine is owned by the ``HostWorker``; it reads ``device_pool.kv`` at dispatch and
replaces it after a load, so it must run on the thread that owns the KV pool, between forwards.
Multi-host: every host dispatches the same transfers in the same order (SPMD); each commits only
its own shards.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from hicache.kernels.paged_copy import CopyImpl, gather_pages, scatter_pages, select_impl
from hicache.workers.device_pool import DevicePool
from hicache.workers.host_pool import HostPool, PendingBackup
from hicache.workers.plan import OpKind


def bucket(n: int) -> int:
    """Rows of the compiled staging shape for a batch of ``n`` pages (next power of two)."""
    return 1 << max(0, int(n) - 1).bit_length()


class TransferHandle:
    """One in-flight D2H or H2D."""

    def __init__(
        self,
        kind: OpKind,
        num_pages: int,
        bytes_moved: int,
        ready: Callable[[], bool],
        block: Callable[[], None],
        commit: Callable[[], None],
        release: Callable[[], None],
    ) -> None:
        self.kind = kind
        self.num_pages = num_pages
        self.bytes_moved = bytes_moved
        self.started = time.perf_counter()
        self.finished_at: float | None = None
        self._ready, self._block, self._commit, self._release = ready, block, commit, release
        self._done = False

    def is_ready(self) -> bool:
        return self._done or self._ready()

    def block_until_ready(self, timeout_s: float | None = None) -> bool:
        """Waits until ready; ``False`` if ``timeout_s`` passed first."""
        if timeout_s is None:
            if not self._done:
                self._block()
            return True
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s
        delay = 20e-6
        while not self.is_ready():
            if deadline is not None and time.perf_counter() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 2e-3)
        return True

    def finish(self) -> int:
        """Commits (blocking until ready); idempotent. Returns bytes moved."""
        if not self._done:
            self.block_until_ready()
            try:
                self._commit()
            finally:
                self._release()
            self._done = True
            self.finished_at = time.perf_counter()
        return self.bytes_moved

    def abort(self) -> None:
        """Drops the transfer without committing (host pool unchanged)."""
        if not self._done:
            self._release()
            self._done = True

    @property
    def duration_s(self) -> float:
        end = self.finished_at if self.finished_at is not None else time.perf_counter()
        return end - self.started


class TransferEngine:
    def __init__(self, device_pool: DevicePool, host_pool: HostPool, *, impl: CopyImpl | str | None = None) -> None:
        if host_pool.device_pool is not device_pool:
            raise ValueError("host_pool was built for another device pool")
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.impl = CopyImpl(impl) if impl is not None else select_impl()
        self._staging: dict[int, list[jax.Array]] = {}  # rows -> free D2H staging buffers
        self._gather = _gather_fn(device_pool.mesh, device_pool.partition_spec, self.impl)
        self._scatter = _scatter_fn(device_pool.mesh, device_pool.partition_spec, self.impl)

    # -- validation (host side, before any buffer is touched) -----------------------------------
    def check(self, device_pages: object, host_slots: object) -> tuple[np.ndarray, np.ndarray]:
        from hicache.kernels.paged_copy import validate_ids

        pages = validate_ids(device_pages, self.device_pool.num_pages, name="device_pages")
        slots = self.host_pool.check_slots(host_slots)
        if pages.size != slots.size:
            raise ValueError(f"{pages.size} device_pages vs {slots.size} host_slots")
        return pages, slots

    def _take_staging(self, rows: int) -> jax.Array:
        free = self._staging.setdefault(rows, [])
        if free:
            return free.pop()
        pool = self.device_pool
        shape = (rows, *pool.spec.page_shape)
        return _zeros_fn(shape, pool.storage_dtype, pool.sharding)()

    def _padded_ids(self, pages: np.ndarray, rows: int) -> np.ndarray:
        ids = np.zeros(rows, np.int32)  # numpy args: no per-call jnp dispatch
        ids[: pages.size] = pages
        return ids

    # -- transfers --------------------------------------------------------------------------------
    def backup(self, device_pages: object, host_slots: object) -> TransferHandle:
        """L1 pages -> L2 slots (D2H). Async; commit into the host pool at ``finish``."""
        pages, slots = self.check(device_pages, host_slots)
        n, rows = pages.size, bucket(pages.size)
        staging = self._take_staging(rows)
        staged = self._gather(self.device_pool.kv, self._padded_ids(pages, rows), np.int32(n), staging)
        pending: PendingBackup = self.host_pool.begin_backup(slots, staged, n)

        def release() -> None:
            pending.release()
            self._staging[rows].append(staged)  # reused (donated) by the next gather of this size

        return TransferHandle(OpKind.BACKUP_D2H, n, n * self.host_pool.slot_bytes, pending.is_ready, pending.block, pending.commit, release)

    def load(self, host_slots: object, device_pages: object) -> TransferHandle:
        """L2 slots -> L1 pages (H2D). Async; the pool array is replaced at dispatch."""
        pages, slots = self.check(device_pages, host_slots)
        n, rows = pages.size, bucket(pages.size)
        staged, release = self.host_pool.stage_load(slots, rows)
        try:
            new_kv = self._scatter(self.device_pool.kv, self._padded_ids(pages, rows), np.int32(n), staged)
        except BaseException:
            release()
            raise
        self.device_pool.set_kv(new_kv)
        return TransferHandle(OpKind.LOAD_H2D, n, n * self.host_pool.slot_bytes, new_kv.is_ready, new_kv.block_until_ready, lambda: None, release)


@functools.lru_cache(maxsize=None)
def _zeros_fn(shape: tuple[int, ...], dtype: np.dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _gather_fn(mesh, spec: P, impl: CopyImpl):
    def local(kv, ids, count, out):
        return gather_pages(kv, ids, count, out, impl=impl)

    mapped = jax.shard_map(local, mesh=mesh, in_specs=(spec, P(), P(), spec), out_specs=spec, check_vma=False)
    return jax.jit(mapped, donate_argnums=(3,))


@functools.lru_cache(maxsize=None)
def _scatter_fn(mesh, spec: P, impl: CopyImpl):
    def local(kv, ids, count, pages):
        pages, kv = lax.optimization_barrier((pages, kv))
        return scatter_pages(kv, ids, count, pages, impl=impl)

    mapped = jax.shard_map(local, mesh=mesh, in_specs=(spec, P(), P(), spec), out_specs=spec, check_vma=False)
    return jax.jit(mapped, donate_argnums=(0,))
