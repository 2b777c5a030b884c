"""Object chunking: which objects hold which pages of a chain (pages <-> multi-page objects).

Chunking rule (``C`` = pages per object, per pool)
-------------------------------------------------
Chunks are aligned to absolute page positions in the chain: chunk ``j`` covers pages
``[jC, (j+1)C)``. Every sequence that shares a prefix therefore shares chunk boundaries. An object
holds pages ``[jC, jC+m)``, ``1 <= m <= C`` and is named by the key of its last page
``jC+m-1`` (the key fixes the position, so ``m`` is implied). ``C`` is in the path
(``.../c{C}/{key[0]}/{key}``: sixteen fan-out directories by the key's first hex digit), so
stores with different chunk sizes never misread each other.

- Write: a write starts at a chunk boundary. Every full chunk is one object; the tail of a
  sequence that ends mid-chunk is a partial object of ``m < C`` pages.
- Read (``resolve``), prefix-ordered: for each chunk in order the natural candidate is the object
  ending at ``min(chunk end, query end)``. At the first chunk whose natural candidate is missing,
  the shorter partial objects of that chunk that lie inside the query are probed (one batched
  round, at most ``C-1`` names) and the longest one extends the hit. Consequences: (a) a prefix
  stored mid-chunk (partial object) is found by any later *longer* query through the probe; (b) a
  later *shorter* query that ends inside a chunk stored only as a full object cannot name that
  object (its name is the key of a page beyond the query) and loses at most ``C-1`` pages, unless
  the store keeps a leading-page index (``leading_index``, opt-in: ``resolve``'s ``leading``); (c)
  the later longer sequence writes the full chunk, the partial object stays until evicted or
  deleted (bounded duplication, ``<= C-1`` pages per sequence).

Pure functions of keys and positions, plus the caller's existence check; no I/O of its own, no
state. Keys may be a lazy ``ChainKeys``: only the keys of the objects named are read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple


class ObjectRef(NamedTuple):
    """One object = pages ``[start, start+m)`` of the chain of query ``t``; ``key`` names its last
    page. (A tuple: a query builds one per chunk and probe.)"""

    t: int  # index of the query (transfer) it belongs to
    start: int
    m: int
    key: str
    path: str
    use: int = 0  # its leading pages the query uses, where fewer than ``m`` (found by ``leading``)

    def stop(self) -> int:
        """One past the last page of it the query uses."""
        return self.start + (self.use or self.m)


@dataclasses.dataclass(frozen=True)
class Chunking:
    """The objects of one pool: under ``prefix``, ``pages_per_object`` pages each at most."""

    prefix: str
    pages_per_object: int

    def path(self, key: str) -> str:
        return f"{self.prefix}/{key[0]}/{key}"

    def index_path(self, first_key: str, last_key: str) -> str:
        """Leading-page index entry of the object from the page keyed ``first_key`` to the page
        keyed ``last_key`` (``leading_index``); ``i`` is no hex digit, so no object folder."""
        return f"{self.index_dir(first_key)}/{last_key}"

    def index_dir(self, first_key: str) -> str:
        return f"{self.prefix}/i/{first_key}"

    def spans(self, n: int, first: int) -> Iterator[tuple[int, int]]:
        """``(start, pages)`` of the natural candidate of every chunk intersecting pages
        ``[first, first + n)``, in order (no key read)."""
        C = self.pages_per_object
        if n == 0:
            return
        for j in range(first // C, (first + n - 1) // C + 1):
            s = j * C
            yield s, min(s + C, first + n) - s

    def object(self, t: int, keys: Sequence[str], first: int, start: int, m: int) -> ObjectRef:
        """The object holding pages ``[start, start + m)`` (``keys[0]`` is page ``first``)."""
        k = keys[start + m - 1 - first]
        return ObjectRef(t, start, m, k, self.path(k))

    def naturals(self, t: int, keys: Sequence[str], first: int) -> list[ObjectRef]:
        """Natural candidate object of every chunk intersecting the query, in chain order."""
        return [self.object(t, keys, first, s, m) for s, m in self.spans(len(keys), first)]

    def partials(self, t: int, keys: Sequence[str], first: int, start: int, m: int, min_pages: int = 1) -> list[ObjectRef]:
        """Objects of the chunk at ``start`` shorter than ``m`` pages that end inside the query at
        its page ``min_pages - 1`` or later (a shorter hit is of no use to the caller), longest
        first."""
        shortest = max(1, first + min_pages - start)
        return [self.object(t, keys, first, start, mm) for mm in range(m - 1, shortest - 1, -1)]


def resolve(
    queries: Sequence[tuple[Chunking, Sequence[str], int]],
    exists: Callable[[list[ObjectRef]], list[bool]],
    min_pages: int = 1,
    leading: Callable[[list[tuple[int, int, int]]], list[ObjectRef | None]] | None = None,
) -> list[list[ObjectRef]]:
    """Objects that cover the longest stored prefix of each query ``(chunking, keys, first)``, in
    chain order, with at most two calls of ``exists`` (one flag per object asked). ``min_pages``:
    shorter partial objects that would end a hit before the query's page ``min_pages - 1`` are not
    asked about (the answer is then short of ``min_pages`` anyway).

    ``leading`` (optional, one call): asked ``(t, start, have)`` for every query whose hit stops
    ``have`` pages into the chunk at ``start``, short of the query's pages there, where the query
    holds that chunk's first page; answers, per ask, an object of that chunk whose leading pages
    (``ObjectRef.use`` of them, more than ``have``) match the query's chain, or None."""
    nats = [ch.naturals(t, keys, first) for t, (ch, keys, first) in enumerate(queries)]
    flags = iter(exists([o for ns in nats for o in ns]))
    found: list[list[ObjectRef]] = []
    probes: list[tuple[int, list[ObjectRef]]] = []
    for t, ns in enumerate(nats):
        fl = [next(flags) for _ in ns]
        cut = fl.index(False) if False in fl else len(ns)
        found.append(ns[:cut])
        if cut < len(ns):
            ch, keys, first = queries[t]
            parts = ch.partials(t, keys, first, ns[cut].start, ns[cut].m, min_pages)
            if parts:
                probes.append((t, parts))
    if probes:
        pflags = iter(exists([o for _, ps in probes for o in ps]))
        for t, ps in probes:
            fl = [next(pflags) for _ in ps]
            if True in fl:
                found[t].append(ps[fl.index(True)])
    if leading is not None:
        _extend_by_leading(queries, nats, found, leading, min_pages)
    return found


def _extend_by_leading(queries: Sequence[tuple[Chunking, Sequence[str], int]], nats: list[list[ObjectRef]],
                       found: list[list[ObjectRef]], leading: Callable[[list[tuple[int, int, int]]], list[ObjectRef | None]],
                       min_pages: int) -> None:
    """Where a query's hit ends inside a chunk whose first page it holds, let ``leading`` extend it
    (``found[t]``: the naturals before the cut chunk, then possibly one partial object of it)."""
    asks: list[tuple[int, int, int]] = []
    for t, ns in enumerate(nats):
        first = queries[t][2]
        cut = next((i for i, o in enumerate(found[t]) if o.start != ns[i].start or o.m != ns[i].m), len(found[t]))
        if cut >= len(ns) or ns[cut].start < first:  # all found, or the chunk's first key is not the query's
            continue
        have = found[t][cut].m if cut < len(found[t]) else 0
        if have < ns[cut].m and ns[cut].start + ns[cut].m - first >= min_pages:
            asks.append((t, ns[cut].start, have))
    if not asks:
        return
    for (t, start, have), o in zip(asks, leading(asks)):
        if o is None or o.stop() - start <= have or o.stop() - queries[t][2] < min_pages:
            continue
        if have:
            found[t].pop()
        found[t].append(o)
