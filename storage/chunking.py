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
  the store keeps a leading-page index (``leading_index``: ``resolve``'s ``leading``); (c)
  the later longer sequence writes the full chunk, the partial object stays until evicted or
  deleted (bounded duplication, ``<= C-1`` pages per sequence).

Pure functions of keys and positions, plus the caller's existence check; no I/O of its own, no
state. Keys may be a lazy ``ChainKeys``: only the keys of the objects named are read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol


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
    # objects found by their own name only (a hybrid model's values at a node end, one object each, written
    # at chunk position 0): no shorter partial object of a chunk is probed, no leading-page index is kept
    named: bool = False

    def path(self, key: str) -> str:
        return f"{self.prefix}/{key[0]}/{key}"

    def index_path(self, first_key: str, last_key: str) -> str:
        """Leading-page index entry of the object from the page keyed ``first_key`` to the page
        keyed ``last_key`` (``leading_index``); ``i`` is no hex digit, so no object folder."""
        return f"{self.index_dir(first_key)}/{last_key}"

    def index_dir(self, first_key: str) -> str:
        return f"{self.prefix}/i/{first_key}"

    @staticmethod
    def object_of_index_entry(path: str) -> str | None:
        """The object an index entry at ``path`` names (``index_path``), or None if ``path`` is
        no index entry (a listing's or a directory walk's path, ``/`` separated)."""
        parts = path.rsplit("/", 3)
        if len(parts) != 4 or parts[1] != "i" or len(parts[3]) < 2:
            return None
        return f"{parts[0]}/{parts[3][0]}/{parts[3]}"

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
        if self.named:
            return []
        shortest = max(1, first + min_pages - start)
        return [self.object(t, keys, first, start, mm) for mm in range(m - 1, shortest - 1, -1)]


class LeadingPages(Protocol):
    """The leading-page index as ``resolve`` uses it (``leading_index``; the store does the I/O)."""

    def folder(self, t: int, start: int) -> str | None:
        """The index folder of query ``t``'s chunk at page ``start`` (None: the key of that chunk's
        first page is unknown, so no lookup)."""

    def find(self, asks: list[tuple[int, int, int]], listed: list[Any]) -> list[ObjectRef | None]:
        """Per ask ``(t, start, have)`` and its folder's listing (paths, or the exception it
        raised): an object of that chunk whose leading pages (``ObjectRef.use`` of them, more than
        ``have`` from ``start``) match query ``t``'s chain, or None."""


# one probe round: a flag per object asked, and per folder asked its listing (paths or an exception)
Probe = Callable[[list[ObjectRef], list[str]], tuple[list[bool], list[Any]]]


def resolve(
    queries: Sequence[tuple[Chunking, Sequence[str], int]],
    probe: Probe,
    min_pages: int = 1,
    leading: LeadingPages | None = None,
) -> list[list[ObjectRef]]:
    """Objects that cover the longest stored prefix of each query ``(chunking, keys, first)``, in
    chain order, with at most two calls of ``probe`` (one flag per object asked). ``min_pages``:
    shorter partial objects that would end a hit before the query's page ``min_pages - 1`` are not
    asked about (the answer is then short of ``min_pages`` anyway).

    ``leading`` (optional): where a query's hit stops inside a chunk (short of its pages there)
    whose index folder it names, that folder is listed in the second ``probe`` round, beside the
    partial objects, so a miss costs no extra round; ``leading.find`` then may extend the hit with
    an object's matching leading pages (one more round of its own, only where something is listed)."""
    nats = [ch.naturals(t, keys, first) for t, (ch, keys, first) in enumerate(queries)]
    flags = iter(probe([o for ns in nats for o in ns], [])[0])
    found: list[list[ObjectRef]] = []
    probes: list[tuple[int, list[ObjectRef]]] = []
    asks: list[tuple[int, int]] = []  # (query, index of its cut chunk)
    folders: list[str] = []
    for t, ns in enumerate(nats):
        fl = [next(flags) for _ in ns]
        cut = fl.index(False) if False in fl else len(ns)
        found.append(ns[:cut])
        if cut == len(ns):
            continue
        ch, keys, first = queries[t]
        c = ns[cut]
        parts = ch.partials(t, keys, first, c.start, c.m, min_pages)
        if parts:
            probes.append((t, parts))
        folder = leading.folder(t, c.start) if leading is not None and c.stop() - first >= min_pages else None
        if folder is not None:
            asks.append((t, cut))
            folders.append(folder)
    if not probes and not folders:
        return found
    pflags, listed = probe([o for _, ps in probes for o in ps], folders)
    it = iter(pflags)
    for t, ps in probes:
        fl = [next(it) for _ in ps]
        if True in fl:
            found[t].append(ps[fl.index(True)])
    if asks:
        assert leading is not None
        _extend_by_leading(nats, found, leading, asks, listed)
    return found


def _extend_by_leading(nats: list[list[ObjectRef]], found: list[list[ObjectRef]], leading: LeadingPages,
                       asks: list[tuple[int, int]], listed: list[Any]) -> None:
    """Let ``leading`` extend each asked query's hit inside its cut chunk (``found[t]``: the naturals
    before the cut chunk, then possibly one partial object of it)."""
    full = [(t, nats[t][cut].start, found[t][cut].m if len(found[t]) > cut else 0) for t, cut in asks]
    for (t, start, have), o in zip(full, leading.find(full, listed)):
        if o is None or o.stop() - start <= have:
            continue
        if have:
            found[t].pop()
        found[t].append(o)
