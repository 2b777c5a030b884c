"""How the head's L1 page ids and sgl-jax's KV slot indices map onto each other.

The head's L1 page ids ARE sgl-jax's page ids: page ``p`` holds the KV of sgl-jax token slots
``p * page_size .. p * page_size + page_size - 1`` in sgl-jax's device KV pool. sgl-jax never hands out
page 0 (slot 0 is its padding/"no slot" value in ``req_to_token``), so the head's pool has one page more
than sgl-jax's allocator and its owner takes page 0 once, for good (``HeadPageAllocator``). At
``page_size == 1`` pages and token slots are the same numbers and nothing is converted. Pure numpy;
runs in the scheduler process.
"""

from __future__ import annotations

import numpy as np

SLOT_DTYPE = np.int32


def pages_to_slots(pages: np.ndarray, page_size: int) -> np.ndarray:
    """Token slots of whole pages, in order (``page_size`` slots per page)."""
    pages = np.asarray(pages, dtype=SLOT_DTYPE)
    if page_size == 1:
        return pages
    return (pages[:, None] * page_size + np.arange(page_size, dtype=SLOT_DTYPE)).reshape(-1)


def slots_to_pages(slots: np.ndarray, page_size: int) -> np.ndarray:
    """The pages of a request's token slots (slot ``i`` of the request at offset ``i % page_size`` of its
    page, as sgl-jax's allocators lay them out): one page per ``page_size`` slots, the last maybe partial.
    ValueError if the slots are not laid out that way."""
    slots = np.asarray(slots, dtype=SLOT_DTYPE)
    if page_size == 1:
        return slots
    pages = slots[::page_size] // page_size
    expected = pages_to_slots(pages, page_size)[: slots.shape[0]]
    if not np.array_equal(expected, slots):
        i = int(np.flatnonzero(expected != slots)[0])
        raise ValueError(f"token slot {int(slots[i])} at position {i} is not at offset {i % page_size} "
                         f"of page {int(pages[i // page_size])} (page_size {page_size})")
    return pages


def unique_pages(slots: np.ndarray, page_size: int) -> np.ndarray:
    """The distinct pages that ``slots`` (any order, any subset of each page) touch."""
    slots = np.asarray(slots, dtype=SLOT_DTYPE)
    if page_size == 1:
        return slots
    return np.unique(slots // page_size)
