"""``HeadPageAllocator`` and the page map: sgl-jax's allocation calls answered by a real embedded head, with
sgl-jax's slot layout (token ``i`` of a request at offset ``i % page_size`` of its page)."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.cluster import embedded
from hicache.sgl_jax import HiCacheOptions
from hicache.sgl_jax.allocator import HeadPageAllocator
from hicache.sgl_jax.page_map import pages_to_slots, slots_to_pages, unique_pages


def allocator(num_pages: int, page_size: int) -> HeadPageAllocator:
    client = embedded(HiCacheOptions().head_config(page_size=page_size, num_pages=num_pages))
    return HeadPageAllocator(client, None, num_pages, page_size)  # (no KV buffers: allocation never reads them)


def test_page_zero_is_sgl_jax_padding_and_never_handed_out() -> None:
    alloc = allocator(num_pages=8, page_size=1)
    assert alloc.available_size() == 8 and alloc.size == 8
    slots = alloc.alloc(8)
    assert sorted(slots.tolist()) == list(range(1, 9))
    assert alloc.alloc(1) is None  # sgl-jax's contract: None when short
    alloc.free(slots)
    assert alloc.available_size() == 8


def test_page_map_round_trip_and_layout_check() -> None:
    slots = pages_to_slots(np.array([3, 1], np.int32), 4)
    assert slots.tolist() == [12, 13, 14, 15, 4, 5, 6, 7]
    assert slots_to_pages(slots[:6], 4).tolist() == [3, 1]
    assert unique_pages(np.array([7, 5, 13]), 4).tolist() == [1, 3]
    with pytest.raises(ValueError, match="token slot 6 at position 1"):
        slots_to_pages(np.array([12, 6], np.int32), 4)


@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_extend_and_decode_follow_sgl_jax_layout(page_size: int) -> None:
    alloc = allocator(num_pages=32, page_size=page_size)
    # Two requests: one continuing a partial page after a 6-token prefix, one starting from nothing.
    prefix_pages = alloc.alloc(-(-6 // page_size) * page_size)
    prefix_slots = pages_to_slots(slots_to_pages(prefix_pages, page_size), page_size)[:6]
    prefix_lens, seq_lens = [6, 0], [13, 5]
    out = alloc.alloc_extend(prefix_lens, seq_lens, [int(prefix_slots[-1]), -1], 7 + 5)
    first = np.concatenate([prefix_slots, out[:7]])
    second = out[7:]
    for slots in (first, second):
        pages = slots_to_pages(slots, page_size)  # raises unless token i sits at offset i % page_size
        assert len(set(pages.tolist())) == len(pages)
    assert not set(slots_to_pages(first, page_size).tolist()) & set(slots_to_pages(second, page_size).tolist())
    # One decode step for each: token 13 (and token 5) continue or start a page as the layout says.
    nxt = alloc.alloc_decode([14, 6], [int(first[-1]), int(second[-1])])
    for slots, new in ((first, nxt[0]), (second, nxt[1])):
        slots_to_pages(np.append(slots, new), page_size)
    assert alloc.client.stats().request_pages == 1 + len(
        set(unique_pages(np.concatenate([first, second, nxt]), page_size).tolist()))


def test_free_group_frees_once_at_the_end() -> None:
    alloc = allocator(num_pages=4, page_size=1)
    a, b = alloc.alloc(2), alloc.alloc(2)
    alloc.free_group_begin()
    alloc.free(a)
    alloc.free(b)
    assert alloc.available_size() == 0
    alloc.free_group_end()
    assert alloc.available_size() == 4
    with pytest.raises(ValueError, match="FREE"):  # the head catches a double free
        alloc.free(a)
