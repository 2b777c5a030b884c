"""Transfer engine: L1 pages <-> L2 slots, asynchronous through JAX async dispatch.

One data path on every backend (TPU, GPU, and the CPU backend CI runs):

* D2H (``backup``): a jitted ``gather_pages`` of the pages into a *donated*, reused staging buffer
  ``[m, L, 2, S, H, D]`` (m = batch bucketed to a power of two), then the host pool's
  ``begin_backup`` moves the rows to ``pinned_host`` memory. The slots change only at ``finish``
  (the commit), so a failed transfer changes nothing. One staging batch per call, no per-page round
  trip.
* H2D (``load``): the host pool stages the slots as a device array (``stage_load``), then a jitted
  ``scatter_pages`` writes them into the *donated* pool, in place. ``optimization_barrier`` pins
  the staged rows before the pool is overwritten, so XLA cannot sink a read of them past the write.

Per shard, inside ``shard_map`` over the pool's mesh (a plain jit on one device); the kernel
implementation is picked in one place, ``hicache.kernels.select_impl`` (Pallas DMA kernels on TPU,
portable XLA elsewhere; Pallas in interpret mode runs the TPU kernels on CPU in tests). Separate
jits (a backup dispatched before a load of the same page) are ordered by the runtime: donation waits
for pending reads of the buffer, and a forward that donates the pool waits for a pending gather.

Ids travel as one small packed numpy ``int32`` argument per call (``[count, ids...]``, padded to the
bucket), never as ``jnp`` arrays, and the jitted callables are built once per engine. Plans are
validated once (``HostWorker`` passes the checked ids to ``backup_checked``/``load_checked``).

Completion: ``backup``/``load`` return a ``TransferHandle`` at once; poll ``is_ready()`` or wait with
``block_until_ready(timeout_s)``, then ``finish()`` commits. Every H2D also returns a tiny *token*
output that nobody donates; readiness is polled on it, not on the new pool array (a model forward
may donate that before the transfer is polled).

Ownership: the ``HostWorker`` owns the engine, and every call runs on its owner thread, between
forwards: a load replaces ``device_pool.kv`` (``adopt_kv``). The engine owns its staging buffers (one
free list per bucket); the host pool owns the slot arrays. Multi-host: every host dispatches the
same transfers in the same order (SPMD, no collectives inside); each commits only its own shards.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import jax
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hicache.kernels.paged_copy import CopyImpl, gather_pages, scatter_pages, select_impl, validate_ids
from hicache.workers.device_pool import DevicePool, zeros_fn
from hicache.workers.fused_pool import FusedLayerPool
from hicache.workers.host_pool import HostPool
from hicache.workers.plan import OpKind

# Readiness polling: a small transfer finishes within tens of microseconds, while one ``time.sleep``
# costs more than that on Linux, so ``block_until_ready`` spins on ``is_ready`` this long first.
_SPIN_S = 300e-6


# Pages per compiled transfer program: a larger batch runs as several programs of at most this many
# rows. The host pool's programs take or return one array per row, and their compile time grows with
# the row count, so an unbounded bucket would compile for seconds in the middle of serving.
MAX_BATCH_PAGES = 16


def bucket(n: int) -> int:
    """Rows of the compiled staging shape for a batch of ``n`` pages (next power of two)."""
    return 1 << max(0, int(n) - 1).bit_length()


def chunks(n: int, max_pages: int) -> list[slice]:
    """``[0, n)`` cut into consecutive slices of at most ``max_pages``."""
    return [slice(i, min(i + max_pages, n)) for i in range(0, n, max_pages)]


def _all_ready(parts: list[Callable[[], bool]]) -> Callable[[], bool]:
    return parts[0] if len(parts) == 1 else lambda: all(ready() for ready in parts)


def _each(parts: list[Callable[[], object]]) -> Callable[[], None]:
    def run() -> None:
        for part in parts:
            part()

    return run


def _noop() -> None:
    pass


class TransferHandle:
    """One in-flight D2H or H2D."""

    __slots__ = ("kind", "num_pages", "bytes_moved", "started", "finished_at", "_ready", "_block", "_commit",
                 "_release", "_done")

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
        if self._done or self._ready():
            return True
        if timeout_s is None:
            self._block()
            return True
        now = time.perf_counter()
        deadline = now + timeout_s
        spin_end = min(deadline, now + _SPIN_S)
        ready = self._ready
        while time.perf_counter() < spin_end:
            if ready():
                return True
        delay = 50e-6
        while not ready():
            left = deadline - time.perf_counter()
            if left <= 0:
                return False
            time.sleep(min(delay, left))
            delay = min(delay * 2, 2e-3)
        return True

    def finish(self) -> int:
        """Commits (blocking until ready); idempotent. Returns bytes moved."""
        if not self._done:
            if not self._ready():
                self._block()
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
    def __init__(self, device_pool: DevicePool | FusedLayerPool, host_pool: HostPool, *, impl: CopyImpl | str | None = None,
                 max_batch_pages: int = MAX_BATCH_PAGES) -> None:
        """``impl``: the kernel implementation (default: ``select_impl()`` for this backend);
        ``max_batch_pages``: pages per compiled program (a power of two; larger batches are cut)."""
        if host_pool.device_pool is not device_pool:
            raise ValueError("host_pool was built for another device pool")
        if type(max_batch_pages) is not int or max_batch_pages < 1 or bucket(max_batch_pages) != max_batch_pages:
            raise ValueError(f"max_batch_pages must be a power of two >= 1, got {max_batch_pages!r}")
        self.max_batch_pages = max_batch_pages
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.impl = CopyImpl(impl) if impl is not None else select_impl()
        self._staging: dict[int, list[jax.Array]] = {}  # rows -> free D2H staging buffers
        self.single_device = device_pool.mesh.devices.size == 1
        if isinstance(device_pool, FusedLayerPool):  # an engine's own layer arrays: their layout's programs
            self._gather, self._scatter = device_pool.transfer_fns()
        elif self.single_device:
            token_sharding = NamedSharding(device_pool.mesh, P())
            self._gather = _gather_single_fn(self.impl, device_pool.sharding)
            self._scatter = _scatter_single_fn(self.impl, device_pool.array_sharding, token_sharding)
        else:
            self._gather = _gather_fn(device_pool.mesh, device_pool.partition_spec, self.impl)
            self._scatter = _scatter_fn(device_pool.mesh, device_pool.partition_spec, self.impl)
        self._slot_bytes = host_pool.slot_bytes
        self._num_pages = device_pool.num_pages

    # -- validation (host side, before any buffer is touched) -----------------------------------
    def check(self, device_pages: object, host_slots: object) -> tuple[np.ndarray, np.ndarray]:
        """Private int32 copies of the ids once in range, unique and paired (``ValueError``/``TypeError``
        naming the bad value otherwise)."""
        pages = validate_ids(device_pages, self._num_pages, name="device_pages")
        slots = self.host_pool.check_slots(host_slots)
        if pages.size != slots.size:
            raise ValueError(f"{pages.size} device_pages vs {slots.size} host_slots")
        return pages, slots

    def _take_staging(self, rows: int) -> jax.Array:
        free = self._staging.get(rows)
        if free:
            return free.pop()
        pool = self.device_pool
        shape = (rows, *pool.spec.page_shape)
        return zeros_fn(shape, pool.storage_dtype, pool.sharding)()

    @staticmethod
    def _packed_ids(rows: int, *id_lists: np.ndarray) -> np.ndarray:
        """``[count, *ids_0 padded to rows, *ids_1 padded to rows, ...]`` as one ``int32`` numpy
        argument (each numpy argument of a jitted call costs a host->device conversion)."""
        n = id_lists[0].size
        ids = np.zeros(1 + rows * len(id_lists), np.int32)
        ids[0] = n
        for k, a in enumerate(id_lists):
            ids[1 + k * rows : 1 + k * rows + n] = a
        return ids

    # -- transfers --------------------------------------------------------------------------------
    def backup(self, device_pages: object, host_slots: object) -> TransferHandle:
        """L1 pages -> L2 slots (D2H). Async; commit into the host pool at ``finish``."""
        pages, slots = self.check(device_pages, host_slots)
        return self.backup_checked(pages, slots)

    def backup_checked(self, pages: np.ndarray, slots: np.ndarray) -> TransferHandle:
        """``backup`` for ids already validated by ``check`` (int32, in range, unique, same size)."""
        return self._in_batches(OpKind.BACKUP_D2H, self._backup_batch, pages, slots)

    def _backup_batch(self, pages: np.ndarray, slots: np.ndarray) -> TransferHandle:
        n = pages.size
        rows = bucket(n)
        staging = self._take_staging(rows)
        staged = self._gather(self.device_pool.kv, self._packed_ids(rows, pages), staging)
        free = self._staging.setdefault(rows, [])
        try:
            pending = self.host_pool.begin_backup(slots, staged, n)
        except BaseException:
            free.append(staged)
            raise

        def release() -> None:
            pending.release()
            free.append(staged)  # reused (donated) by the next gather of this size

        return TransferHandle(OpKind.BACKUP_D2H, n, n * self._slot_bytes, pending.is_ready, pending.block,
                              pending.commit, release)

    def load(self, host_slots: object, device_pages: object) -> TransferHandle:
        """L2 slots -> L1 pages (H2D). Async; the pool array is replaced at dispatch."""
        pages, slots = self.check(device_pages, host_slots)
        return self.load_checked(slots, pages)

    def load_checked(self, slots: np.ndarray, pages: np.ndarray) -> TransferHandle:
        """``load`` for ids already validated by ``check``."""
        return self._in_batches(OpKind.LOAD_H2D, self._load_batch, slots, pages)

    def _in_batches(self, kind: OpKind, run: Callable[[np.ndarray, np.ndarray], TransferHandle],
                    first: np.ndarray, second: np.ndarray) -> TransferHandle:
        """``run(first, second)``, cut into batches of at most ``max_batch_pages`` behind one handle; a
        batch that fails to dispatch aborts those dispatched before it (their buffers go back)."""
        if first.size <= self.max_batch_pages:
            return run(first, second)
        parts: list[TransferHandle] = []
        try:
            for c in chunks(first.size, self.max_batch_pages):
                parts.append(run(first[c], second[c]))
        except BaseException:
            for part in parts:
                part.abort()
            raise
        return join_handles(kind, parts)

    def _load_batch(self, slots: np.ndarray, pages: np.ndarray) -> TransferHandle:
        n = pages.size
        rows = bucket(n)
        staged, release = self.host_pool.stage_load(slots, rows)
        try:
            new_kv, token = self._scatter(self.device_pool.kv, self._packed_ids(rows, pages), staged)
        except BaseException:
            release()
            raise
        self.device_pool.adopt_kv(new_kv)
        return TransferHandle(OpKind.LOAD_H2D, n, n * self._slot_bytes, token.is_ready, token.block_until_ready,
                              _noop, release)


def join_handles(kind: OpKind, parts: list[TransferHandle]) -> TransferHandle:
    """One handle over the batches of a cut transfer (or the pools of one copy): ready when all are,
    committed together (a failure before the commit changes nothing, as for one batch)."""
    handle = TransferHandle(kind, sum(p.num_pages for p in parts), sum(p.bytes_moved for p in parts),
                            _all_ready([p.is_ready for p in parts]),
                            _each([functools.partial(p.block_until_ready, None) for p in parts]),
                            _each([p.finish for p in parts]), _each([p.abort for p in parts]))
    handle.started = parts[0].started
    return handle


def _with_token(new_kv: jax.Array, count: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(new_kv, token)``: a scalar output that exists only once the scatter is done (the barrier
    ties them), a completion marker nobody donates."""
    return lax.optimization_barrier((new_kv, count))


@functools.lru_cache(maxsize=None)
def _gather_fn(mesh, spec: P, impl: CopyImpl):
    def local(kv, ids, out):  # ids = [count, *page_ids]
        return gather_pages(kv, ids[1:], ids[0], out, impl=impl)

    mapped = jax.shard_map(local, mesh=mesh, in_specs=(spec, P(), spec), out_specs=spec, check_vma=False)
    return jax.jit(mapped, donate_argnums=(2,))


@functools.lru_cache(maxsize=None)
def _scatter_fn(mesh, spec: P, impl: CopyImpl):
    def local(kv, ids, pages):  # ids = [count, *page_ids]
        pages, kv = lax.optimization_barrier((pages, kv))
        return scatter_pages(kv, ids[1:], ids[0], pages, impl=impl)

    mapped = jax.shard_map(local, mesh=mesh, in_specs=(spec, P(), spec), out_specs=spec, check_vma=False)
    return jax.jit(lambda kv, ids, pages: _with_token(mapped(kv, ids, pages), ids[0]), donate_argnums=(0,))


@functools.lru_cache(maxsize=None)
def _gather_single_fn(impl: CopyImpl, sharding):
    def gather(kv, ids, out):  # ids = [count, *page_ids]
        return gather_pages(kv, ids[1:], ids[0], out, impl=impl)

    return jax.jit(gather, donate_argnums=(2,), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _scatter_single_fn(impl: CopyImpl, sharding, token_sharding):
    def scatter(kv, ids, pages):  # ids = [count, *page_ids]
        pages, kv = lax.optimization_barrier((pages, kv))
        return _with_token(scatter_pages(kv, ids[1:], ids[0], pages, impl=impl), ids[0])

    return jax.jit(scatter, donate_argnums=(0,), out_shardings=(sharding, token_sharding))
