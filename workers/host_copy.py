"""Page copies between the L1 pool and the L2 slab when both are plain host memory (the CPU backend).

On XLA:CPU with one device the L1 pool's buffer is host memory, like the host pool's numpy slab, so
a D2H or H2D is a host memory copy on the KV-owning thread (a compiled loop, or numpy): no XLA
kernel, no staging array, no readiness polling. ``PageCopier`` does the copies; the transfer engine
decides when the pool buffer may be read or written (``hicache.workers.transfer``: reads need a
ready array, writes a buffer taken over by donation) and passes its address.

Who owns what: the host pool owns the slab and builds the copier over it; the pool buffer belongs to
the device pool (and the model forward donates it between plans): the copier only keeps a view of
it at the last address it was given, used again only when given that address again. The copier
owns one reused scratch buffer of ``CHUNK_BYTES`` (cache-sized) for the owner thread's numpy copies; a
copy run on another thread at the same time (the engine's copy thread, ``hicache.workers.copy_thread``)
passes its own (``new_scratch``). The copies release the GIL while they move bytes (the compiled
loops are ``nogil``; numpy's take and fancy-index store over void items need no Python API), so a
copy thread overlaps the owner thread; the numpy per-page strategy makes one numpy call per page
and holds the GIL between them.

Layouts, as *runs* (the contiguous pieces of a page, ``S*H*D`` elements each, viewed as one numpy
void item so that numpy moves each with one ``memmove``)::

    pool   [L, 2, P, S, H, D] -> pool_runs [L*2, P]   (a page = L*2 runs, P runs apart)
    slab   [N, L, 2, S, H, D] -> slab_runs [N, L*2]   (a slot = L*2 adjacent runs = one row)

Strategies (``CopyStrategy``, chosen once per copier; ``COMPILED`` where numba is installed):

* ``COMPILED``: one pass per page, slot to page or back, in a loop compiled by numba
  (``hicache.workers.page_loops``): no scratch, no Python step per page, GIL released. Numpy cannot
  copy from gathered rows to scattered ones without materialising them in between, so the numpy
  strategies below move every byte twice; on hicache_bench's plans this one took 0.6-0.7x their
  CPU time (see ``page_loops``).
* ``NUMPY``, per batch (measured here, 2 shared cores; fresh ids each time; see
  ``benchmarks/transfer_bench.py``):

  - vectorised, for many small pages: per chunk of pages, one ``np.take`` into the scratch buffer
    and one fancy-index store from it (two numpy calls per chunk, no Python step per page; the
    second pass reads the cache);
  - one copy per page (``slab_runs[s] = pool_runs[:, p]``) for big pages, where the memory pass
    dominates and one pass beats two, and for tiny batches, where the numpy calls dominate.

Contiguous runs (pages and slots both consecutive) were measured on hicache_bench's plans and do not
pay as a strategy: L1 pages come back from eviction in fragments (mean run 4.2 pages per load, half
the runs of length 1), so a slice copy per run costs more numpy calls than it saves.
"""

from __future__ import annotations

import ctypes
import enum

import numpy as np

from hicache.workers import page_loops

# Vectorised copy when a batch has at least VECTOR_MIN_PAGES pages of at most VECTOR_PAGE_MAX_BYTES.
VECTOR_PAGE_MAX_BYTES = 4 << 10
VECTOR_MIN_PAGES = 32
CHUNK_BYTES = 256 << 10  # scratch buffer: fits the per-core L2 cache


class CopyStrategy(str, enum.Enum):
    COMPILED = "compiled"  # one pass per page, compiled (numba)
    NUMPY = "numpy"  # vectorised or one copy per page, by batch


def default_strategy() -> CopyStrategy:
    """``COMPILED`` where numba is installed, else ``NUMPY``: the one place that looks."""
    return CopyStrategy.COMPILED if page_loops.available() else CopyStrategy.NUMPY


def _runs(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``a`` (C-contiguous) reshaped to ``shape + (run,)`` and viewed as one void item per run."""
    run = a.size // int(np.prod(shape, dtype=np.int64))
    flat = a.reshape(*shape, run)
    return flat.view(np.dtype((np.void, run * a.itemsize))).reshape(shape)


class PageCopier:
    """Copies pages between the L1 pool ``[L, 2, P, S, H, D]`` and the slab ``[N, L, 2, S, H, D]``
    (same item size, both C-contiguous). The pool is passed by the address of its buffer (row-major,
    ``pool_bytes`` long), which the caller guarantees may be read (D2H) or written (H2D) during the
    call. Ids are validated by the caller (int32, in range, unique, same size): the compiled loops
    do no bounds checks (the numpy strategies would clip an id out of range)."""

    def __init__(self, slab: np.ndarray, num_pages: int, strategy: CopyStrategy | str | None = None) -> None:
        """``strategy``: ``None`` picks ``default_strategy()``."""
        if not slab.flags.c_contiguous or slab.ndim != 6:
            raise ValueError(f"slab must be a C-contiguous [N, L, 2, S, H, D] array, got shape {slab.shape}")
        if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)) or num_pages <= 0:
            raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
        self.num_slots, L, two, S, H, D = slab.shape
        self.num_pages = int(num_pages)
        self.runs_per_page = k = L * two
        self.slot_bytes = slab.nbytes // self.num_slots
        self.pool_bytes = self.num_pages * self.slot_bytes
        self._run = np.dtype((np.void, self.slot_bytes // k))
        self._slab_runs = _runs(slab, (self.num_slots, k))
        self._slab_rows = _runs(slab, (self.num_slots,))
        self.chunk_pages = max(1, CHUNK_BYTES // self.slot_bytes)  # pages per vectorised step
        self._scratch = np.empty(self.chunk_pages * self.slot_bytes, np.uint8)
        self._pool_at: tuple[int, np.ndarray, np.ndarray] | None = None  # (address, runs, words) of the last pool
        self.set_strategy(strategy)
        self._word = page_loops.word_dtype(self._run.itemsize)
        self._words_per_run = self._run.itemsize // self._word.itemsize
        self._slab_words = slab.view(np.uint8).reshape(-1).view(self._word).reshape(self.num_slots, k, -1)

    def set_strategy(self, strategy: CopyStrategy | str | None) -> None:
        """How the next copies run (``None``: ``default_strategy()``); ``ValueError`` for an unknown
        strategy or ``COMPILED`` without numba (the strategy stays as it was)."""
        strategy = default_strategy() if strategy is None else CopyStrategy(strategy)
        compiled = strategy is CopyStrategy.COMPILED
        if compiled and not page_loops.available():
            raise ValueError("strategy 'compiled' needs numba, which is not installed")
        self.strategy, self._compiled = strategy, compiled  # compiled on the first copy

    def _pool_views(self, address: int) -> tuple[np.ndarray, np.ndarray]:
        """The pool buffer at ``address`` as ``[L*2, P]`` runs and as ``[L*2, P, W]`` words (cached:
        the pool usually keeps its address across donations)."""
        cached = self._pool_at
        if cached is not None and cached[0] == address:
            return cached[1], cached[2]
        raw = (ctypes.c_char * self.pool_bytes).from_address(address)
        runs = np.frombuffer(raw, self._run).reshape(self.runs_per_page, self.num_pages)
        words = np.frombuffer(raw, self._word).reshape(self.runs_per_page, self.num_pages, self._words_per_run)
        self._pool_at = (address, runs, words)
        return runs, words

    def vectorised(self, n: int) -> bool:
        """True when a copy of ``n`` pages takes few GIL-free calls: compiled, or numpy vectorised."""
        return self._compiled or (n >= VECTOR_MIN_PAGES and self.slot_bytes <= VECTOR_PAGE_MAX_BYTES)

    def new_scratch(self, chunk_bytes: int = CHUNK_BYTES) -> np.ndarray:
        """A scratch buffer for copies run on another thread than the owner's (at least one page)."""
        return np.empty(max(1, int(chunk_bytes) // self.slot_bytes) * self.slot_bytes, np.uint8)

    def _chunk(self, scratch: np.ndarray | None) -> tuple[np.ndarray, int]:
        if scratch is None:
            return self._scratch, self.chunk_pages
        return scratch, scratch.size // self.slot_bytes

    def _copy_compiled(self, pool_words: np.ndarray, pages: np.ndarray, slots: np.ndarray, into_pool: bool) -> None:
        if pages.shape != slots.shape:  # the one check here (the caller validated the ids): the loop
            raise ValueError(f"{pages.size} pages vs {slots.size} slots")  # reads slots[i] for each pages[i]
        page_loops.loops().copy_pages(pool_words, self._slab_words, pages, slots, into_pool)

    def to_slab(self, pool_address: int, pages: np.ndarray, slots: np.ndarray,
                scratch: np.ndarray | None = None) -> None:
        """``slab[slots[i]] = pool[:, :, pages[i]]`` (D2H). ``scratch``: the caller's own buffer
        (``new_scratch``) when it runs on another thread than the owner's."""
        src, words = self._pool_views(pool_address)
        if self._compiled:
            return self._copy_compiled(words, pages, slots, into_pool=False)
        dst = self._slab_runs
        n = pages.size
        if not self.vectorised(n):
            for s, p in zip(slots.tolist(), pages.tolist()):
                dst[s] = src[:, p]
            return
        k = self.runs_per_page
        buffer, chunk = self._chunk(scratch)
        scratch = buffer.view(self._run)
        for i in range(0, n, chunk):
            ids = pages[i : i + chunk]
            buf = scratch[: k * ids.size].reshape(k, ids.size)
            np.take(src, ids, axis=1, out=buf, mode="clip")  # "clip": no buffered copy (ids are valid)
            dst[slots[i : i + chunk]] = buf.T

    def to_pool(self, pool_address: int, pages: np.ndarray, slots: np.ndarray,
                scratch: np.ndarray | None = None) -> None:
        """``pool[:, :, pages[i]] = slab[slots[i]]`` (H2D); ``scratch`` as for ``to_slab``."""
        dst, words = self._pool_views(pool_address)
        if self._compiled:
            return self._copy_compiled(words, pages, slots, into_pool=True)
        src = self._slab_runs
        n = pages.size
        if not self.vectorised(n):
            for s, p in zip(slots.tolist(), pages.tolist()):
                dst[:, p] = src[s]
            return
        k = self.runs_per_page
        buffer, chunk = self._chunk(scratch)
        rows = buffer.view(self._slab_rows.dtype)
        for i in range(0, n, chunk):
            ids = slots[i : i + chunk]
            buf = rows[: ids.size]
            np.take(self._slab_rows, ids, out=buf, mode="clip")
            dst[:, pages[i : i + chunk]] = buf.view(self._run).reshape(ids.size, k).T
