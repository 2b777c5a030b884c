"""Page copies between the L1 pool and the L2 slab when both are plain host memory (the CPU backend).

On XLA:CPU with one device the L1 pool's buffer is host memory, like the host pool's numpy slab, so
a D2H or H2D is a numpy copy on the KV-owning thread: no jitted kernel, no staging array, no
readiness polling. ``PageCopier`` does the copies; the transfer engine decides when the pool buffer
may be read or written (``hicache.workers.transfer``: reads need a ready array, writes a buffer taken
over by donation) and passes its address.

Who owns what: the host pool owns the slab and builds the copier over it; the pool buffer belongs to
the device pool (and the model forward donates it between plans): the copier only keeps a view of
it at the last address it was given, used again only when given that address again. The copier
owns one reused scratch buffer of ``CHUNK_BYTES`` (cache-sized) for the owner thread; a copy run on
another thread at the same time (the engine's copy thread, ``hicache.workers.copy_thread``) passes
its own (``new_scratch``). The copies release the GIL while they move bytes (numpy's take and
fancy-index store over void items need no Python API), so a copy thread overlaps the owner thread;
the per-page strategy makes one numpy call per page and holds the GIL between them.

Layouts, as *runs* (the contiguous pieces of a page, ``S*H*D`` elements each, viewed as one numpy
void item so that numpy moves each with one ``memmove``)::

    pool   [L, 2, P, S, H, D] -> pool_runs [L*2, P]   (a page = L*2 runs, P runs apart)
    slab   [N, L, 2, S, H, D] -> slab_runs [N, L*2]   (a slot = L*2 adjacent runs = one row)

Strategies (measured here, 2 shared cores; fresh ids each time; see ``benchmarks/transfer_bench.py``):

* vectorised, for many small pages: per chunk of pages, one ``np.take`` into the scratch buffer and
  one fancy-index store from it (two numpy calls per chunk, no Python step per page; the second
  pass reads the cache);
* one copy per page (``slab_runs[s] = pool_runs[:, p]``) for big pages, where the memory pass
  dominates and one pass beats two, and for tiny batches, where the numpy calls dominate.
"""

from __future__ import annotations

import ctypes

import numpy as np

# Vectorised copy when a batch has at least VECTOR_MIN_PAGES pages of at most VECTOR_PAGE_MAX_BYTES.
VECTOR_PAGE_MAX_BYTES = 4 << 10
VECTOR_MIN_PAGES = 32
CHUNK_BYTES = 256 << 10  # scratch buffer: fits the per-core L2 cache


def _runs(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``a`` (C-contiguous) reshaped to ``shape + (run,)`` and viewed as one void item per run."""
    run = a.size // int(np.prod(shape, dtype=np.int64))
    flat = a.reshape(*shape, run)
    return flat.view(np.dtype((np.void, run * a.itemsize))).reshape(shape)


class PageCopier:
    """Copies pages between the L1 pool ``[L, 2, P, S, H, D]`` and the slab ``[N, L, 2, S, H, D]``
    (same item size, both C-contiguous). The pool is passed by the address of its buffer (row-major,
    ``pool_bytes`` long), which the caller guarantees may be read (D2H) or written (H2D) during the
    call. Ids are validated by the caller (int32, in range, unique, same size); an id out of range
    would be clipped by ``np.take``, never read out of bounds."""

    def __init__(self, slab: np.ndarray, num_pages: int) -> None:
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
        self._pool_at: tuple[int, np.ndarray] | None = None  # (address, runs view) of the last pool

    def _pool_runs(self, address: int) -> np.ndarray:
        """The pool buffer at ``address`` as ``[L*2, P]`` runs (cached: the pool usually keeps its
        address across donations)."""
        cached = self._pool_at
        if cached is not None and cached[0] == address:
            return cached[1]
        raw = (ctypes.c_char * self.pool_bytes).from_address(address)
        runs = np.frombuffer(raw, self._run).reshape(self.runs_per_page, self.num_pages)
        self._pool_at = (address, runs)
        return runs

    def vectorised(self, n: int) -> bool:
        """True when a copy of ``n`` pages takes the vectorised strategy (a few GIL-free numpy calls)."""
        return n >= VECTOR_MIN_PAGES and self.slot_bytes <= VECTOR_PAGE_MAX_BYTES

    def new_scratch(self, chunk_bytes: int = CHUNK_BYTES) -> np.ndarray:
        """A scratch buffer for copies run on another thread than the owner's (at least one page)."""
        return np.empty(max(1, int(chunk_bytes) // self.slot_bytes) * self.slot_bytes, np.uint8)

    def _chunk(self, scratch: np.ndarray | None) -> tuple[np.ndarray, int]:
        if scratch is None:
            return self._scratch, self.chunk_pages
        return scratch, scratch.size // self.slot_bytes

    def to_slab(self, pool_address: int, pages: np.ndarray, slots: np.ndarray,
                scratch: np.ndarray | None = None) -> None:
        """``slab[slots[i]] = pool[:, :, pages[i]]`` (D2H). ``scratch``: the caller's own buffer
        (``new_scratch``) when it runs on another thread than the owner's."""
        src, dst = self._pool_runs(pool_address), self._slab_runs
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
        dst, src = self._pool_runs(pool_address), self._slab_runs
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
