"""Page allocator with ownership tracking, for L1 pages (and reused for L2 slots by the head).

Owned by the tree's owner (the head). Every page is in exactly one state: FREE (on the free stack),
REQUEST (handed out by ``alloc``, held by a running request) or TREE (referenced by a tree node).
The free list is a numpy stack, so alloc/free of n pages is O(n) numpy work, not Python loops. Page
arrays are int32 everywhere; they are cast to ``intp`` once before fancy indexing (numpy's int32 index
path is slower than the cast plus an ``intp`` index). The stack itself holds ``intp`` ids and grows
downwards (its top is its lowest used index), so ``alloc`` indexes the owners with a slice of it and
hands out one int32 copy, with no reversal.
``capacity=None`` means unbounded: the pool grows by doubling (benchmarks, tests of the tree alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

import numpy as np

PAGE_DTYPE = np.int32


class PageOwner(IntEnum):
    FREE = 0
    REQUEST = 1
    TREE = 2


_FREE, _REQUEST, _TREE = int(PageOwner.FREE), int(PageOwner.REQUEST), int(PageOwner.TREE)
_OWNER_BYTE = {int(o): bytes([int(o)]) for o in PageOwner}
_INTP = np.intp
# Short names the tree and the HiCache tiers (host_tier, controller) join and count id arrays with.
concat = np.concatenate
count_true = np.count_nonzero


def as_index(pages: np.ndarray) -> np.ndarray:
    """``intp`` copy of int32 ids for fancy indexing; negative ids wrap to >= 2**31 (out of any bound)."""
    return pages.view(np.uint32).astype(_INTP)


class CacheCapacityError(RuntimeError):
    """Not enough free plus evictable pages for an allocation; nothing was changed."""


# Page ids as callers may pass them; ``as_page_array`` makes them one int32 array.
PageIds = np.ndarray | Sequence[int]


def as_page_array(pages: PageIds, what: str = "pages") -> np.ndarray:
    """Returns page ids as a 1-D int32 array or raises TypeError naming the value."""
    if isinstance(pages, np.ndarray):
        arr = pages
    elif isinstance(pages, (list, tuple)) or (isinstance(pages, Sequence) and not isinstance(pages, (str, bytes))):
        arr = np.asarray(pages, dtype=np.int64) if len(pages) else np.empty(0, dtype=PAGE_DTYPE)
    else:
        raise TypeError(f"{what} must be a numpy integer array or a sequence of ints, got {type(pages).__name__}")
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=PAGE_DTYPE)


def _owner_error(what: str, page: int, owner: int, expected: PageOwner) -> ValueError:
    state = PageOwner(owner).name
    hint = " (double free?)" if state == "FREE" else ""
    return ValueError(f"{what}: page {page} is {state}, expected {expected.name}{hint}")


class PageAllocator:
    def __init__(self, capacity: int | None, initial: int = 1024) -> None:
        if capacity is not None and (not isinstance(capacity, int) or capacity <= 0):
            raise ValueError(f"capacity must be a positive int or None (unbounded), got {capacity!r}")
        self.bounded = capacity is not None
        size = capacity if capacity is not None else initial
        self._owner = np.zeros(size, dtype=np.int8)
        self._size = size
        # Free stack: the ids in _free[_size - num_free:], in hand-out order (the top is the lowest index, so a
        # pop is a forward slice); pops low ids first.
        self._free = np.arange(size, dtype=_INTP)
        self.num_free = size  # free ids on the stack (read it; only this class changes it)
        self._scratch = np.zeros(size, dtype=PAGE_DTYPE)  # duplicate detection without sorting
        self._positions = np.arange(size, dtype=PAGE_DTYPE)

    @property
    def capacity(self) -> int:
        return int(self._owner.shape[0])

    def count(self, owner: PageOwner) -> int:
        return int(np.count_nonzero(self._owner == owner))

    def owners(self, pages: np.ndarray) -> np.ndarray:
        return self._owner[np.asarray(pages).astype(_INTP)]

    def _grow(self, needed: int) -> None:
        old = self.capacity
        new = max(old * 2, old + needed)
        owner = np.zeros(new, dtype=np.int8)
        owner[:old] = self._owner
        nf = self.num_free
        free = np.empty(new, dtype=_INTP)
        free[new - nf :] = self._free[old - nf :]  # the old free ids stay below the new ones (handed out after)
        free[old - nf : new - nf] = np.arange(old, new, dtype=_INTP)
        self._owner, self._free, self._size = owner, free, new
        self.num_free = nf + new - old
        self._scratch = np.zeros(new, dtype=PAGE_DTYPE)
        self._positions = np.arange(new, dtype=PAGE_DTYPE)

    def _pop_free(self, num_pages: int) -> np.ndarray:
        """Takes ``num_pages`` ids off the free stack (growing an unbounded pool); owners untouched. Returns
        them as an ``intp`` view of the stack: use it before the next release (that may overwrite it)."""
        nf = self.num_free
        if num_pages > nf:
            if self.bounded:
                raise CacheCapacityError(f"need {num_pages} pages, {nf} free")
            self._grow(num_pages - nf)
            nf = self.num_free
        top = self._size - nf
        self.num_free = nf - num_pages
        return self._free[top : top + num_pages]

    def alloc(self, num_pages: int, owner: int = _REQUEST) -> np.ndarray:
        """Hands out ``num_pages`` pages to a request (``owner``: or straight to the tree, for pages a node takes
        at once: a load-back's); raises CacheCapacityError if short (nothing changed). (The fast path inline,
        one call less: L2 slots for every backup and load come from here.)"""
        nf = self.num_free
        if num_pages > nf:
            idx = self._pop_free(num_pages)  # grows an unbounded pool, or raises
        else:
            top = self._size - nf
            self.num_free = nf - num_pages
            idx = self._free[top : top + num_pages]
        self._owner[idx] = owner
        return idx.astype(PAGE_DTYPE)

    def alloc_indexed(self, num_pages: int) -> tuple[np.ndarray, np.ndarray]:
        """``alloc`` that also returns the pages as an ``intp`` index (for the caller's next fancy indexing)."""
        idx = self._pop_free(num_pages).copy()
        self._owner[idx] = _REQUEST
        return idx.astype(PAGE_DTYPE), idx

    def check(
        self, pages: np.ndarray, expected: PageOwner, what: str = "pages", index: np.ndarray | None = None
    ) -> np.ndarray:
        """Raises ValueError unless every page is in range, unique and owned by ``expected``.

        Returns the pages as an ``intp`` index (for the caller's next fancy indexing).
        ``index``: that index when the caller already has it (``as_index(pages)``).
        """
        n = pages.shape[0]
        idx = as_index(pages) if index is None else index
        if n == 0:
            return idx
        self.check_owner(pages, idx, expected, what)
        if n > 1:
            # Scatter each page's position, gather back: a duplicate page reads another position.
            positions = self._positions[:n]
            scratch = self._scratch
            scratch[idx] = positions
            back = scratch[idx]
            if back.tobytes() != positions.tobytes():
                i = int(np.flatnonzero(back != positions)[0])
                raise ValueError(f"{what}: page {int(pages[i])} appears more than once")
        return idx

    def check_owner(self, pages: np.ndarray, idx: np.ndarray, expected: PageOwner, what: str = "pages") -> None:
        """Raises ValueError unless every page is in range and owned by ``expected`` (``idx``: the pages as
        ``intp``, from ``as_index``, so negative ids fail the bound)."""
        try:
            owners = self._owner[idx]
        except IndexError:
            bad = int(pages.min()) if int(pages.min()) < 0 else int(pages.max())
            raise ValueError(f"{what}: page id {bad} out of range [0, {self.capacity})") from None
        want = int(expected)
        if owners.tobytes() != _OWNER_BYTE[want] * owners.shape[0]:  # one memcmp, no ufunc + reduce
            i = int(np.flatnonzero(owners != want)[0])
            raise _owner_error(what, int(pages[i]), int(owners[i]), expected)

    # -- one id at a time (Mamba state slots): Python ints, no array per call ----------------------------
    def alloc_one(self) -> int:
        """``alloc(1)[0]`` without the arrays."""
        if self.num_free == 0:
            if self.bounded:
                raise CacheCapacityError(f"need 1 page, 0 free of {self.capacity}")
            self._grow(1)
        page = self._free.item(self._size - self.num_free)
        self.num_free -= 1
        self._owner[page] = _REQUEST
        return page

    def check_one(self, page: int, expected: PageOwner, what: str = "page") -> None:
        """``check`` of one id (a Python int)."""
        if not 0 <= page < self._owner.shape[0]:
            raise ValueError(f"{what}: page id {page} out of range [0, {self.capacity})")
        owner = self._owner.item(page)
        if owner != expected:
            raise _owner_error(what, page, owner, expected)

    def transfer_one(self, page: int, new_owner: PageOwner) -> None:
        """``transfer`` of one already-checked id."""
        self._owner[page] = int(new_owner)

    def release_one(self, page: int) -> None:
        """``release`` of one already-checked id."""
        self._owner[page] = _FREE
        self.num_free += 1
        self._free[self._size - self.num_free] = page

    def transfer(self, pages: np.ndarray, new_owner: PageOwner, index: np.ndarray | None = None) -> None:
        """Changes ownership of already-checked pages between REQUEST and TREE (``index``: the same ids
        as ``intp``, e.g. from ``check``; computed here when None)."""
        self._owner[pages.astype(_INTP) if index is None else index] = int(new_owner)

    def release(self, pages: np.ndarray, index: np.ndarray | None = None) -> None:
        """Returns already-checked pages to the free stack (``index`` as in ``transfer``)."""
        n = pages.shape[0]
        if n == 0:
            return
        if index is None:
            index = pages.astype(_INTP)
        self._owner[index] = _FREE
        nf = self.num_free + n
        top = self._size - nf
        self._free[top : top + n] = index  # on top in this order: the next alloc of n hands out ``pages``
        self.num_free = nf

    def free(self, pages: np.ndarray, expected: PageOwner = PageOwner.REQUEST) -> None:
        self.check(pages, expected)
        self.release(pages)

    def reset(self) -> None:
        size = self.capacity
        self._owner[:] = PageOwner.FREE
        self._free = np.arange(size, dtype=_INTP)
        self.num_free = size
