"""What a benchmark run is checked against: exactness and the offline-optimal hit rate.

Exactness: every output must equal the reference (no-cache) output of its request
(``serve_items``), and a few requests per config also match ``generate_no_cache`` bit for bit, tokens
and logits (``spot_check``); a mismatch raises ``ExactnessError``.

Offline-optimal hit rate (``belady_hit_tokens``): pages are the chain keys of full pages (key of page
k = hash of every token up to the end of page k, namespaced by ``cache_salt``), the same unit as the
radix tree. Request i *reads* the full pages of ``prompt[:-1]`` (hits = its leading pages that are
cached) and then *writes* the full pages of ``prompt + output[:-1]`` (what ``cache_finished_req``
inserts). A cache of C pages keeps, after each request, the C pages with the nearest next read among
what it held plus what the request wrote (Belady/MIN with bypass; pages never read again are dropped).
A page's next read is never later than its children's (a read of a child reads the whole chain), and
ties evict the deeper page first, so the cache stays prefix-closed and page hits are prefix hits:
MIN is optimal for this model. It is an upper bound: it ignores the L1 room a running request needs
and that the real tiers hold disjoint copies or duplicates (L1 + L2 is modelled as one cache of their
summed size).
"""

from __future__ import annotations

import hashlib
import heapq
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from benchmarks.workload import FWD, Item, Served
from hicache.reference.engine.runner import ModelRunner
from hicache.reference.serve_types import ServeRequest, ServeResult


class ExactnessError(AssertionError):
    pass


def serve_items(serve: Callable[[ServeRequest], ServeResult], items: Sequence[Item],
                reference: Sequence[tuple[int, ...]] | None, config: str,
                salt: Callable[[Item], str | None] = lambda it: None) -> list[Served]:
    """Serves ``items`` in order; with ``reference``, every output must equal the no-cache output."""
    out = []
    for it in items:
        res = serve(ServeRequest(it.prompt, it.max_new_tokens, cache_salt=salt(it)))
        if reference is not None and tuple(res.output) != tuple(reference[it.index]):
            raise ExactnessError(f"[{config}] request {it.index} (client {it.client}, round {it.round}): output "
                                 f"{res.output} != no-cache output {reference[it.index]}")
        out.append(Served(it, res))
    return out


def spot_check(runner: ModelRunner, served: Sequence[Served], config: str, k: int = 3) -> int:
    """Compares output tokens and last logits, bit for bit, with ``generate_no_cache`` on up to ``k``
    requests (those with the most L3, L2 and L1 hit tokens first). Raises ``ExactnessError``."""
    picks: list[Served] = []
    for key in (lambda s: s.result.storage_tokens, lambda s: s.result.loaded_tokens - s.result.storage_tokens,
                lambda s: s.result.device_hit_tokens, lambda s: s.result.computed_tokens):
        for s in sorted(served, key=key, reverse=True):
            if key(s) > 0 and all(s is not p for p in picks):
                picks.append(s)
                break
        if len(picks) >= k:
            break
    for s in picks:
        ref = runner.generate_no_cache(s.item.prompt, s.item.max_new_tokens)
        if tuple(s.result.output) != tuple(ref.tokens) or not np.array_equal(s.result.last_logits, ref.logits[0]):
            raise ExactnessError(f"[{config}] request {s.item.index}: cached output/logits differ from "
                                 f"generate_no_cache (tokens {s.result.output} vs {ref.tokens})")
    return len(picks)


def page_chain(tokens: np.ndarray, page_size: int, salt: str | None) -> list[bytes]:
    h = hashlib.blake2b(f"ns:{salt}".encode(), digest_size=16).digest()
    toks = np.asarray(tokens, dtype=np.int32)
    keys = []
    for p in range(len(toks) // page_size):
        h = hashlib.blake2b(h + toks[p * page_size:(p + 1) * page_size].tobytes(), digest_size=16).digest()
        keys.append(h)
    return keys


@dataclass(frozen=True)
class Access:
    reads: list[bytes]  # chain of prompt[:-1] full pages
    writes: list[bytes]  # chain of prompt + output[:-1] full pages


def accesses(served_or_items: Sequence[tuple[np.ndarray, Sequence[int]]], page_size: int,
             salts: Sequence[str | None]) -> list[Access]:
    out = []
    for (prompt, output), salt in zip(served_or_items, salts):
        seq = np.concatenate([prompt, np.asarray(output[:-1], dtype=np.int32)])
        out.append(Access(page_chain(prompt[:-1], page_size, salt), page_chain(seq, page_size, salt)))
    return out


def belady_hit_tokens(stream: Sequence[Access], capacity_pages: float, page_size: int,
                      preload: Sequence[Access] = ()) -> list[int]:
    """Optimal hit tokens per request of ``stream`` for a cache of ``capacity_pages`` (``inf`` allowed),
    starting with every page ``preload`` wrote (a warm replica's L3)."""
    uses: dict[bytes, list[int]] = {}
    for i, a in enumerate(stream):
        for k in a.reads:
            uses.setdefault(k, []).append(i)
    inf = float("inf")

    def next_use(k: bytes, i: int) -> float:
        u = uses.get(k)
        if not u:
            return inf
        j = bisect_right(u, i)
        return u[j] if j < len(u) else inf

    cache: dict[bytes, float] = {}  # key -> next read
    heap: list[tuple[float, int, bytes]] = []  # (-next read, -depth, key), lazy

    def put(k: bytes, depth: int, i: int) -> None:
        nu = next_use(k, i)
        if nu == inf:
            cache.pop(k, None)
            return
        cache[k] = nu
        heapq.heappush(heap, (-nu, -depth, k))

    def shrink() -> None:
        while len(cache) > capacity_pages:
            nnu, _, k = heapq.heappop(heap)
            if cache.get(k) == -nnu:
                del cache[k]

    for a in preload:
        for d, k in enumerate(a.writes):
            put(k, d, -1)
    shrink()
    hits = []
    for i, a in enumerate(stream):
        n = 0
        for k in a.reads:
            if k not in cache:
                break
            n += 1
        hits.append(n * page_size)
        for d, k in enumerate(a.writes):
            put(k, d, i)
        shrink()
    return hits


def working_set(items: Sequence[Item], outputs: Sequence[Sequence[int]]) -> tuple[list[Access], int]:
    """The page accesses of the served stream and its working set in pages."""
    acc = accesses([(it.prompt, o) for it, o in zip(items, outputs)], FWD.page_size, [None] * len(items))
    return acc, len({k for a in acc for k in a.writes})
