"""Compiled page loops for the CPU data path: each page moves in one pass, straight from its L2 slot
to its L1 page or back (a ``memcpy`` per run), with no scratch buffer in between.

Why compiled: numpy has no gather-to-scatter copy. ``np.take`` writes only a C-contiguous ``out``
and a fancy-index store reads a materialised value array, so ``PageCopier``'s numpy strategies take
pages into a scratch buffer and store them from there: two passes over the bytes. These loops (numba,
``nogil``) make one. Measured here (2 shared cores, load 5-11; ``python benchmarks/transfer_bench.py
--hicache-replay --copy-strategy compiled numpy --reps 9``: hicache_bench's 302 plans of 1 KiB pages
replayed on fresh workers, the strategies alternating, best thread CPU), two runs: the whole trace
73.3 -> 51.1 and 66.5 -> 41.5 ms (0.6-0.7x), its loads (123.7K pages) 53.6 -> 33.9 and 41.8 -> 30.9
ms, its backups (42.9K pages) 21.5 -> 11.5 and 22.0 -> 13.6 ms. The second pass is what goes.

Each run's words move in an explicit loop rather than a slice store (``_copy_pages``). Measured (an
AMD EPYC box, 2 quiet cores; 4 MiB of random pages per call, the two loops alternating, median of
60): 0.42x the slice store's time with 128-byte runs, 0.55x at 512 B, 0.62-0.70x at 2 KiB and
0.73-0.75x at 8-32 KiB, both directions. The same hicache_bench replay went 20.0 -> 16.4 ms (loads
15.4 -> 11.5, backups 6.3 -> 4.9); ``hicache_bench.py --repeat 5``'s overhead ratio 0.47-0.50 ->
0.52-0.53 (4 runs each).

Who owns what: nothing here holds a buffer. The caller (``hicache.workers.host_copy.PageCopier``)
passes word views of the pool buffer ``[L*2, P, W]`` and of the slab ``[N, L*2, W]`` (``W`` words per
run) and guarantees the ids are valid (int32, in range, same size): the loops do no bounds checks.
They hold no GIL while they copy, so a copy thread overlaps the owner thread. ``first_bad_id`` is
the transfer engine's id check in one O(n) pass over a reused marks array (range and duplicates;
the sort-based ``validate_ids`` took ~5 ms per hicache_bench run for its 604 id arrays), with
``validate_ids`` still naming whatever it finds.

Compiled on first use per word type (seconds, once per machine: numba caches the machine code on
disk, ``__pycache__`` beside this file or its user cache when that is read-only). ``loops()`` is
``None`` where numba is not installed (``available()``); the copier then keeps to its numpy strategies.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

# (pool words [L*2, P, W], slab words [N, L*2, W], pages int32[n], slots int32[n], into_pool) -> None
PageLoop = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool], None]


def _copy_pages(pool: np.ndarray, slab: np.ndarray, pages: np.ndarray, slots: np.ndarray, into_pool: bool) -> None:
    """``pool[:, pages[i]] = slab[slots[i]]`` (H2D) if ``into_pool``, else the reverse (D2H).

    The words of a run move in a plain loop (one LLVM can vectorize), not as a slice assignment:
    numba lowers that one (``fancy_setslice``) to a shape check, a check whether source and
    destination memory may overlap (a copy of the source if so) and a generic indexed loop, per run,
    which took 1.3-2.4x this loop's time at every run size measured (see the module docstring)."""
    runs, words = pool.shape[0], pool.shape[2]
    for i in range(pages.shape[0]):
        page, slot = pages[i], slots[i]
        for j in range(runs):
            if into_pool:
                dst, src = pool[j, page], slab[slot, j]
            else:
                dst, src = slab[slot, j], pool[j, page]
            for k in range(words):
                dst[k] = src[k]


def _first_bad_id(ids: np.ndarray, upper: int, marks: np.ndarray) -> int:
    """Position of the first id outside ``[0, upper)`` or seen before in ``ids``, or -1. ``marks``
    (``u1[>= upper]``, all zero) is all zero again on return."""
    n = ids.shape[0]
    bad = -1
    i = 0
    while i < n:
        v = ids[i]
        if v < 0 or v >= upper or marks[v]:
            bad = i
            break
        marks[v] = 1
        i += 1
    for j in range(i):
        marks[ids[j]] = 0
    return bad


class Loops(NamedTuple):
    copy_pages: PageLoop
    # (ids int32[n], upper, marks u1[upper]) -> position of the first bad id, or -1
    first_bad_id: Callable[[np.ndarray, int, np.ndarray], int]


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """numba is installed (found without importing it: the import takes 0.3-1.5 s here, paid at the
    first copy, never by a process that builds a copier it does not use)."""
    return importlib.util.find_spec("numba") is not None


@functools.lru_cache(maxsize=1)
def loops() -> Loops | None:
    """The loops compiled (lazily, per argument types), or ``None`` without numba."""
    if not available():
        return None
    import numba

    jit = numba.njit(nogil=True, cache=True, boundscheck=False)
    return Loops(jit(_copy_pages), jit(_first_bad_id))


def word_dtype(run_bytes: int) -> np.dtype:
    """The widest unsigned word that divides a run (the loops move whole words)."""
    for size in (8, 4, 2):
        if run_bytes % size == 0:
            return np.dtype(f"u{size}")
    return np.dtype(np.uint8)
