"""Transfer engine: L1 pages <-> L2 slots, asynchronous through JAX async dispatch.

``backup(device_pages, host_slots)`` (D2H) and ``load(host_slots, device_pages)`` (H2D) validate
their ids on the host, dispatch jitted work and return a ``TransferHandle`` at once; completion is
polled with ``is_ready()`` or awaited with ``block_until_ready(timeout_s)``, then ``finish()``
commits (for D2H, the write into the host pool happens at commit, so a failed transfer changes
nothing). No thread is involved, except the copy thread of ``HOST_THREAD`` below.

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

Data paths (``DataPath``, chosen once per engine by ``select_data_path``, the one place that
looks at the backend):

* ``HOST_MEMORY`` -- one CPU device (XLA impl) and a host pool that is one numpy slab: both tiers
  are plain host memory, so no jitted kernel runs. A D2H reads the pool array through its zero-copy
  numpy view (it must be ready: no pending writer) and copies into the slab at dispatch; an H2D
  first *takes the pool buffer over* by donating it to a jitted identity (``_take_over``: the
  runtime runs it only after every pending read or write of the buffer, and the old array is
  deleted, so the returned array is the only reference; on CPU it aliases the same memory, no
  copy), then writes the pages into that buffer with numpy and adopts it as the pool. The engine
  keeps holding that array (later loads and backups skip the take-over and every JAX call) until
  it is lent out: ``HostWorker`` calls ``release_pool`` before a model runs on it, and the async
  gather below drops it too. When the model hands back a new array (its forwards donated the one
  lent), the worker says so (``adopt_forward_output``): by the ``PoolModel`` contract nothing but
  the forward producing it can be pending on it, so once it is ready the next load adopts it as
  is, no take-over (no JAX dispatch on a load-back's critical path). Code that dispatches work on
  ``device_pool.kv`` outside ``run_model`` must wait for it (or call ``release_pool``) before the
  next plan. Both are ``hicache.workers.host_copy.PageCopier`` copies on the owner thread; the
  handle is born finished (no staging, no polling, no token). A D2H falls back to the async jitted gather below
  when the pool array is not ready, the batch is over ``SYNC_BACKUP_MAX_BYTES``, or an async
  backup is outstanding (slot writes keep dispatch order).
  Donation safety (DESIGN §4) on this path: the L1 buffer is host memory that numpy writes in
  place, so "between forwards, on the owner thread" is the whole rule -- a load writes only a buffer
  no computation is pending on (taken over, or a ready forward output), a backup reads only a ready
  one, and the next forward gets the array only through ``run_model`` (``release_pool``), after the
  copy returned.
* ``HOST_THREAD`` -- ``HOST_MEMORY`` with backups of ``ASYNC_MIN_PAGES`` or more on a copy thread
  (``hicache.workers.copy_thread``, FIFO), like a DMA engine: the handle is ready (and the op acked)
  only once the bytes are in the slab. Loads stay on the owner thread (a caller waits for them at
  once) and run alongside in-flight backups unless they touch the same pages or slots (then they
  wait for those first: order is kept). Donation safety: a backup's job holds the pool array and
  reads its buffer while the owner thread goes on, so the buffer must neither be donated nor
  written where the job reads until it finished: every hand-out of the array waits for the copy
  thread first (``drain_copies``: ``release_pool`` before a forward, a take-over, the jitted
  fallbacks, and ``DevicePool.kv``/``set_kv``/``read_pages``/``write_pages``), and the owner
  thread's own copies wait for conflicting jobs (``_settle_copies``). Waits are bounded by
  ``COPY_TIMEOUT_S`` (a job still queued is withdrawn and its op fails). Opt-in only: under
  CPython's GIL the thread needs the GIL three times per copy (to wake, and after each of its two
  numpy calls; twice with the compiled loops, measured before them) and gets it only when the
  owner thread blocks or after the 5 ms switch interval, so the owner's Python bookkeeping does not
  overlap the copies. Measured here (loaded 2-CPU VM): a
  268-page backup (~0.17 ms of copying) landed after a median 7.7 ms while the owner ran Python;
  hicache_bench paired in one process (7 alternating runs each): overhead ratio 0.383 inline vs
  0.375 threaded (0.365 with a 0.2 ms switch interval) -- noise; a load split over both threads
  took 5.7 ms vs 0.49 ms inline. And a forward must drain the thread first, so backups cannot
  overlap forwards either. It is the asynchronous semantics of the TPU path on CPU, tested; a
  native copy engine (no GIL per copy) would make it pay.
* ``JIT`` -- everything else (TPU: Pallas kernels and ``pinned_host`` pages; several devices):
  D2H = jitted gather into a donated staging buffer, committed into the host pool at ``finish``;
  H2D = the host pool stages the slots as a device array, then a jitted scatter into the donated
  pool.

Ids travel as one small packed numpy ``int32`` argument per call (``[count, ids...]``, padded to the
bucket), never as ``jnp`` arrays, and the jitted callables are built once per engine (the C++
dispatch fast path, ~20-40 us a call). Plans are validated once (``HostWorker`` passes the checked
ids to ``backup_checked``/``load_checked``).

Completion: every H2D also returns a tiny *token* output that nobody donates; readiness is polled on
it, not on the new pool array (the model forward may donate that before the transfer is polled).

Ownership: the engine is owned by the ``HostWorker``; it reads ``device_pool.kv`` at dispatch and
replaces it after a load, so it must run on the thread that owns the KV pool, between forwards.
Multi-host: every host dispatches the same transfers in the same order (SPMD); each commits only
its own shards.
"""

from __future__ import annotations

import enum
import functools
import os
import time
import weakref
from collections import deque
from collections.abc import Callable

import jax
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from hicache.kernels.paged_copy import CopyImpl, gather_pages, scatter_pages, select_impl, validate_ids
from hicache.workers import page_loops
from hicache.workers.copy_thread import CopyJob, CopyThread
from hicache.workers.device_pool import DevicePool, zeros_fn
from hicache.workers.host_pool import HostPool, PendingBackup
from hicache.workers.plan import OpKind

# HOST_MEMORY D2H: batches up to this many bytes are copied into the slab at dispatch when the pool
# array is ready; larger ones take the async gather path. On CPU the async path costs the owner
# thread the same pass (its commit copies staging -> slab) *plus* an XLA pass and a staging buffer,
# so the sync path is preferred; the bound only caps how long one ``submit`` stalls the owner thread
# (~0.1 s per 256 MiB here).
SYNC_BACKUP_MAX_BYTES = 256 << 20

# HOST_THREAD: backups of at least this many pages run on the copy thread; smaller ones are copied
# at dispatch (a hand-over to the thread costs ~10-50 us, and the per-page strategy under
# ``host_copy.VECTOR_MIN_PAGES`` holds the GIL between its numpy calls).
ASYNC_MIN_PAGES = 32
# The copy thread's scratch: its vectorised copies make two GIL-free numpy calls per chunk, and each
# return to Python waits for the GIL (up to the interpreter's switch interval, 5 ms, while the owner
# thread runs Python): one chunk per batch of up to 1024 pages of 1 KiB.
THREAD_CHUNK_BYTES = 1 << 20
# Bound of every wait for the copy thread (a copy of a few MiB takes milliseconds).
COPY_TIMEOUT_S = 60.0

# Readiness polling: a CPU transfer of a few pages finishes within tens of microseconds, while one
# ``time.sleep`` costs ~60+ us on Linux. Spin on ``is_ready`` this long before sleeping.
_SPIN_S = 300e-6


class DataPath(str, enum.Enum):
    HOST_MEMORY = "host_memory"  # one CPU device + one numpy slab: numpy copies on the owner thread
    HOST_THREAD = "host_thread"  # as HOST_MEMORY, but backups (D2H) run on the engine's copy thread
    JIT = "jit"  # jitted kernels (Pallas on TPU, portable XLA elsewhere) + the host pool's staging


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def select_data_path(device_pool: DevicePool, host_pool: HostPool, impl: CopyImpl,
                     requested: DataPath | str | None = None) -> DataPath:
    """How an engine moves bytes (see the module docstring); the one place that decides it.

    Both tiers in plain host memory (one CPU device, the XLA impl, a one-slab host pool): numpy
    copies on the owner thread (``HOST_MEMORY``). ``HOST_THREAD`` (backups on a copy thread) only
    when requested: under CPython's GIL it measured no gain (see the module docstring). Anything
    else: ``JIT``. ``requested`` forces a path (``ValueError`` if a host-memory path is asked for
    where it cannot run, or the copy thread on a process limited to one CPU)."""
    devices = device_pool.mesh.devices
    copier = host_pool.page_copier()
    host_memory = (
        impl is CopyImpl.XLA
        and devices.size == 1
        and devices.flat[0].platform == "cpu"
        and copier is not None
        and copier.pool_bytes == device_pool.kv_unsynced.nbytes
    )
    if requested is not None:
        path = DataPath(requested)
        if path is not DataPath.JIT and not host_memory:
            raise ValueError(
                f"data path {path.value!r} needs one CPU device, the XLA impl and a one-slab host pool "
                f"(got {devices.size} {devices.flat[0].platform} device(s), impl {impl.value!r}, "
                f"host pool {type(host_pool).__name__})"
            )
        if path is DataPath.HOST_THREAD and _usable_cpus() < 2:
            raise ValueError("data path 'host_thread' needs a second CPU for its copy thread")
        return path
    return DataPath.HOST_MEMORY if host_memory else DataPath.JIT


def row_major_address(arr: jax.Array) -> int | None:
    """The address of a single-device CPU array's buffer when it is laid out row-major (numpy's C
    order, as every jit output is by default), else ``None``. Unlike ``np.asarray`` this takes no
    external reference on the buffer: an array viewed by numpy can no longer be donated (the runtime
    then copies it), which would make every later forward and load copy the whole pool."""
    if arr.format.layout.major_to_minor != tuple(range(arr.ndim)):
        return None
    return arr.unsafe_buffer_pointer()


def _take_over(kv: jax.Array) -> jax.Array:
    """The pool array donated to an identity and returned ready: once this returns, no computation
    reads or writes its buffer and no other array refers to it (the argument is deleted), so the
    caller may write the buffer in place and adopt the result as the pool."""
    out = _identity_donated(kv.sharding)(kv)
    out.block_until_ready()
    return out


@functools.lru_cache(maxsize=None)
def _identity_donated(sharding):
    return jax.jit(lambda kv: kv, donate_argnums=0, out_shardings=sharding)


def bucket(n: int) -> int:
    """Rows of the compiled staging shape for a batch of ``n`` pages (next power of two)."""
    return 1 << max(0, int(n) - 1).bit_length()


def _noop() -> None:
    pass


def _no_array() -> None:  # stands for a dead weak reference: holds no array
    return None


def _true() -> bool:
    return True


class TransferHandle:
    """One in-flight D2H or H2D."""

    __slots__ = ("kind", "num_pages", "bytes_moved", "started", "finished_at", "_ready", "_block", "_commit",
                 "_release", "_wait", "_done")

    def __init__(
        self,
        kind: OpKind,
        num_pages: int,
        bytes_moved: int,
        ready: Callable[[], bool],
        block: Callable[[], None],
        commit: Callable[[], None],
        release: Callable[[], None],
        wait: Callable[[float], bool] | None = None,
    ) -> None:
        """``wait(timeout_s) -> ready``: a blocking wait that gives the GIL away (a copy thread's
        job); without it ``block_until_ready`` polls ``ready`` (a JAX transfer)."""
        self.kind = kind
        self.num_pages = num_pages
        self.bytes_moved = bytes_moved
        self.started = time.perf_counter()
        self.finished_at: float | None = None
        self._ready, self._block, self._commit, self._release = ready, block, commit, release
        self._wait = wait
        self._done = False

    def is_ready(self) -> bool:
        return self._done or self._ready()

    def block_until_ready(self, timeout_s: float | None = None) -> bool:
        """Waits until ready; ``False`` if ``timeout_s`` passed first."""
        if self._done or self._ready():
            return True
        if self._wait is not None:  # spinning would hold the GIL the copy thread needs to finish
            return self._wait(COPY_TIMEOUT_S if timeout_s is None else timeout_s)
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
    def __init__(self, device_pool: DevicePool, host_pool: HostPool, *, impl: CopyImpl | str | None = None,
                 data_path: DataPath | str | None = None) -> None:
        """``data_path``: force a path (see ``select_data_path``, which picks it by default)."""
        if host_pool.device_pool is not device_pool:
            raise ValueError("host_pool was built for another device pool")
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.impl = CopyImpl(impl) if impl is not None else select_impl()
        self._staging: dict[int, list[jax.Array]] = {}  # rows -> free D2H staging buffers
        self._async_backups = 0  # dispatched gathers not yet committed or aborted
        self.single_device = device_pool.mesh.devices.size == 1
        if self.single_device:
            token_sharding = NamedSharding(device_pool.mesh, P())
            self._gather = _gather_single_fn(self.impl, device_pool.sharding)
            self._scatter = _scatter_single_fn(self.impl, device_pool.sharding, token_sharding)
        else:
            self._gather = _gather_fn(device_pool.mesh, device_pool.partition_spec, self.impl)
            self._scatter = _scatter_fn(device_pool.mesh, device_pool.partition_spec, self.impl)
        self.data_path = select_data_path(device_pool, host_pool, self.impl, data_path)
        self._copier = host_pool.page_copier() if self.data_path is not DataPath.JIT else None
        # Weak references only: a pool array dropped by everyone else must not stay alive here.
        self._pool_address: tuple[weakref.ref, int | None] | None = None  # (kv, row_major_address(kv))
        self._lent_address: int | None = None  # row-major address of the array last lent out, if known
        # HOST_MEMORY: the pool array this engine took over last and holds exclusively (ready, row-major,
        # nothing dispatched on it since), and its buffer address. ``release_pool`` forgets it.
        self._owned: Callable[[], jax.Array | None] = _no_array
        self._owned_address = 0
        # HOST_MEMORY: a pool array a model's forward produced and handed back (``adopt_forward_output``):
        # once ready, nothing else can be pending on it, so the next load owns it without a take-over.
        self._forward_output: Callable[[], jax.Array | None] = _no_array
        # HOST_THREAD: the copy thread, its scratch buffer, and its jobs not known finished, with the
        # pages they read and the slots they write (oldest first).
        self._copies: CopyThread | None = None
        self._in_flight: deque[tuple[CopyJob, np.ndarray, np.ndarray]] = deque()
        if self._copier is not None and self._take_pool() is None:  # jit outputs must be row-major
            self.data_path, self._copier = DataPath.JIT, None
        self._slot_bytes = host_pool.slot_bytes
        self._num_pages = device_pool.num_pages
        # The CPU data path (numba loaded anyway): ids checked in one compiled pass (``check``).
        self._id_loops = page_loops.loops() if self._copier is not None else None
        if self._id_loops is not None:
            self._page_id_marks = np.zeros(self._num_pages, np.uint8)
            self._slot_id_marks = np.zeros(host_pool.num_slots, np.uint8)
        if self.data_path is DataPath.HOST_THREAD:
            assert self._copier is not None
            self._copies = CopyThread(f"copy-{id(self):x}")
            self._thread_scratch = self._copier.new_scratch(THREAD_CHUNK_BYTES)
            self._page_marks = np.zeros(self._num_pages, np.bool_)  # conflict checks (owner thread)
            self._slot_marks = np.zeros(host_pool.num_slots, np.bool_)
            device_pool.set_sync(self.drain_copies)

    # -- the copy thread (HOST_THREAD) ---------------------------------------------------------------
    def drain_copies(self) -> None:
        """Waits (bounded by ``COPY_TIMEOUT_S``) until no copy of this engine is in flight: after it,
        nothing but the caller touches the pool buffer or the slab. Called before the pool array is
        lent out, taken over or written by a jitted call, and by every ``DevicePool`` access."""
        if self._in_flight:
            _await_job(self._in_flight[-1][0])
            self._in_flight.clear()

    def _settle_copies(self, pages: np.ndarray, slots: np.ndarray) -> None:
        """Before a copy on the owner thread: waits for the in-flight copies that touch any of ``pages``
        or ``slots`` (and the ones before them, FIFO); copies of other pages and slots go on."""
        flight = self._in_flight
        while flight and flight[0][0].is_ready():
            flight.popleft()
        if not flight:
            return
        page_marks, slot_marks = self._page_marks, self._slot_marks
        page_marks[pages] = True
        slot_marks[slots] = True
        try:
            last = -1
            for i, (_, p, s) in enumerate(flight):
                if page_marks[p].any() or slot_marks[s].any():
                    last = i
        finally:
            page_marks[pages] = False
            slot_marks[slots] = False
        if last >= 0:
            _await_job(flight[last][0])
            for _ in range(last + 1):
                flight.popleft()

    def _backup_on_thread(self, kv: jax.Array, address: int, pages: np.ndarray, slots: np.ndarray,
                          started: float) -> TransferHandle:
        """D2H on the copy thread: the job holds ``kv`` (its buffer stays alive) until it has copied."""
        job = self._copies.submit(_to_slab, self._copier, kv, address, pages, slots, self._thread_scratch)
        self._in_flight.append((job, pages, slots))
        n = pages.size
        handle = TransferHandle(OpKind.BACKUP_D2H, n, n * self._slot_bytes, job.is_ready,
                                functools.partial(_await_job, job), functools.partial(_raise_job_error, job),
                                _noop, job.wait)
        handle.started = started
        return handle

    def close(self, timeout_s: float = COPY_TIMEOUT_S) -> bool:
        """Ends the copy thread after its queued copies (bounded); True if they all finished. The
        engine copies on the owner thread afterwards (``HOST_MEMORY``)."""
        copies, self._copies = self._copies, None
        if copies is None:
            return True
        self.data_path = DataPath.HOST_MEMORY  # the pool's sync stays: copies may still be queued
        done = copies.close(timeout_s)
        if done:
            self._in_flight.clear()
        return done

    def release_pool(self) -> None:
        """The pool array is lent out (a model forward, anything that may dispatch work on it): the
        next load takes it over again. ``HostWorker`` calls this whenever it hands the array out.
        Waits for the copy thread first: a forward may donate the array."""
        self.drain_copies()
        known = self._pool_address
        lent = self.device_pool.kv_unsynced
        if known is not None and known[0]() is lent:
            self._lent_address = known[1]
        elif lent is not self._forward_output():
            self._lent_address = None
        elif self._lent_address is not None and lent.unsafe_buffer_pointer() != self._lent_address:
            # The last forward's output is lent on (forwards in a row) but is not the buffer lent
            # before: that forward returned a new buffer (nothing aliased), the old one may be freed,
            # and a later output allocated at its address must not pass for it (``_address``).
            self._lent_address = None
        # else: the last forward's output, lent on, is the buffer lent before (its donation aliased
        # it, in its layout): the address stays known. (The pointer query does not wait for the
        # forward: ~0.2 us on a ready array.)
        self._owned = self._forward_output = _no_array

    def adopt_forward_output(self, kv: jax.Array) -> None:
        """``kv`` (the pool now) is the output of a forward that donated the array lent out, and the
        model dispatched nothing else over it (the ``PoolModel`` contract): the one computation that
        may be pending on its buffer is the one producing it. Once ``kv.is_ready()``, the next load
        writes it in place without a take-over (a JAX dispatch: ~100-150 us on the critical path of
        a load-back right after a forward, on this machine)."""
        self._owned = _no_array
        self._forward_output = weakref.ref(kv) if self._copier is not None else _no_array

    def _take_pool(self) -> int | None:
        """HOST_MEMORY: the address of the pool buffer, held exclusively (taken over by donation
        unless this engine holds it already or it is a finished forward's output), or ``None`` if it
        is not row-major."""
        kv = self.device_pool.kv_unsynced
        if kv is self._owned():
            return self._owned_address
        forward_output = kv is self._forward_output()
        if not forward_output or not kv.is_ready():
            self.drain_copies()  # a take-over donates the buffer the copies use
            kv = _take_over(kv)
            self.device_pool.adopt_kv(kv)  # the old array is deleted: adopt before anything can fail
            forward_output = False
        self._forward_output = _no_array
        address = self._address(kv, forward_output)
        if address is None:
            return None
        self._owned, self._owned_address = weakref.ref(kv), address
        return address

    def _address(self, kv: jax.Array, forward_output: bool = False) -> int | None:
        """``row_major_address(kv)``, checked once per pool array. The layout query costs ~10 us warm
        and ~80 us with cold caches, as right after a forward (with the pointer and readiness
        queries it made a load-back's submit cost 140-200 us there). A forward's output whose buffer
        is the one lent to the model is known by its pointer alone: the forward's donation aliased
        it, and XLA aliases an output to a donated input only in that input's layout (``PoolModel``:
        the model returns the pool in the layout it was given). ``forward_output``: ``kv`` is the
        output ``adopt_forward_output`` announced."""
        known = self._pool_address
        if known is not None and known[0]() is kv:
            return known[1]
        lent = self._lent_address
        if forward_output and lent is not None and kv.unsafe_buffer_pointer() == lent:
            address: int | None = lent
        else:
            address = row_major_address(kv)
        self._pool_address = (weakref.ref(kv), address)
        return address

    # -- validation (host side, before any buffer is touched) -----------------------------------
    def check(self, device_pages: object, host_slots: object) -> tuple[np.ndarray, np.ndarray]:
        """Private int32 copies of the ids once in range, unique and paired (``ValueError``/``TypeError``
        naming the bad value otherwise)."""
        loops = self._id_loops
        if (loops is not None and _plain_ids(device_pages) and _plain_ids(host_slots)
                and device_pages.size == host_slots.size  # type: ignore[union-attr]
                and loops.first_bad_id(device_pages, self._num_pages, self._page_id_marks) < 0
                and loops.first_bad_id(host_slots, self.host_pool.num_slots, self._slot_id_marks) < 0):
            return device_pages.copy(), host_slots.copy()  # type: ignore[union-attr]
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
        n = pages.size
        kv = self.device_pool.kv_unsynced
        if self._copier is not None and not self._async_backups and n * self._slot_bytes <= SYNC_BACKUP_MAX_BYTES:
            # No async gather is outstanding, so slot writes still land in dispatch order. Reading
            # needs no pending writer (pending readers may run alongside).
            if kv is self._owned():
                address: int | None = self._owned_address
            else:
                address = self._address(kv, kv is self._forward_output()) if kv.is_ready() else None
            if address is not None:
                started = time.perf_counter()
                if self._copies is not None and n >= ASYNC_MIN_PAGES:
                    return self._backup_on_thread(kv, address, pages, slots, started)
                if self._in_flight:
                    self._settle_copies(pages, slots)
                self._copier.to_slab(address, pages, slots)
                return _finished(OpKind.BACKUP_D2H, n, n * self._slot_bytes, started)
        self.drain_copies()  # the gather's commit writes slots after them
        rows = 1 << (n - 1).bit_length()  # bucket(n)
        staging = self._take_staging(rows)
        self._owned = _no_array  # a computation reads the pool now
        staged = self._gather(kv, self._packed_ids(rows, pages), staging)
        pending: PendingBackup = self.host_pool.begin_backup(slots, staged, n)
        free = self._staging.setdefault(rows, [])
        self._async_backups += 1

        def release() -> None:
            self._async_backups -= 1
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
        n = pages.size
        if self._copier is not None:
            started = time.perf_counter()
            address = self._take_pool()
            if address is not None:
                if self._in_flight:  # backups of other pages and slots go on alongside
                    self._settle_copies(pages, slots)
                self._copier.to_pool(address, pages, slots)
                return _finished(OpKind.LOAD_H2D, n, n * self._slot_bytes, started)
        self.drain_copies()  # the scatter donates the pool buffer
        rows = 1 << (n - 1).bit_length()  # bucket(n)
        staged, release = self.host_pool.stage_load(slots, rows)
        try:
            new_kv, token = self._scatter(self.device_pool.kv_unsynced, self._packed_ids(rows, pages), staged)
        except BaseException:
            release()
            raise
        self.device_pool.adopt_kv(new_kv)
        return TransferHandle(OpKind.LOAD_H2D, n, n * self._slot_bytes, token.is_ready, token.block_until_ready,
                              _noop, release)


def _plain_ids(ids: object) -> bool:
    """A non-empty 1-D int32 numpy array (what plans carry): the compiled check's input."""
    return type(ids) is np.ndarray and ids.dtype == np.int32 and ids.ndim == 1 and ids.size > 0


def _to_slab(copier, kv: jax.Array, address: int, pages: np.ndarray, slots: np.ndarray, scratch: np.ndarray) -> None:
    """The copy thread's D2H; ``kv`` rides along so that its buffer outlives the copy."""
    copier.to_slab(address, pages, slots, scratch)


def _copy_timeout(job: CopyJob) -> None:
    """A copy-thread wait ran out: withdraw the job if it has not started, and fail loudly."""
    state = "withdrawn" if job.cancel() else "still running"
    raise TimeoutError(f"copy thread: a copy did not finish within {COPY_TIMEOUT_S} s ({state})")


def _await_job(job: CopyJob) -> None:
    if not job.wait(COPY_TIMEOUT_S):
        _copy_timeout(job)


def _raise_job_error(job: CopyJob) -> None:
    """The handle's commit: the bytes are in place unless the copy raised."""
    if job.error is not None:
        raise job.error


def _finished(kind: OpKind, n: int, nbytes: int, started: float) -> TransferHandle:
    """The handle of a transfer done at dispatch (begun at ``started``): its duration is the copy's."""
    handle = TransferHandle(kind, n, nbytes, _true, _noop, _noop, _noop)
    handle.finished_at = handle.started
    handle.started = started
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
