"""Topology-free reads: a host's KV heads assembled from the shard objects another layout wrote.

A page object holds one shard of a page: KV heads ``[h0, h1)``, layers ``[l0, l1)`` (its
``ShardCoord`` is in the path), with ``C`` pages per object (``c{C}`` in the path). A replica with
another host count or another number of devices per host has other head ranges (and, by default,
another ``C``: it follows the slot size), so its own names miss what an earlier replica stored.
This module finds the other layouts stored under a pool and says which of their shard objects
give this host its heads:

- ``discover``: the shard directories under ``{base}/{pool}/`` that hold some of this host's heads
  at the same layers (two directory listings: tags, then their ``c{C}`` folders); each is a
  ``Source`` with its own chunking and per-page shape.
- ``cover``: given the stored prefix length of every source (one ``chunking.resolve`` over all of
  them, so still two existence rounds), the longest prefix for which every head of this host has a
  source, and the fewest sources giving it. A prefix is a miss only where a needed shard is missing.
- ``plan``: a chain a reshaped replica continued is stored under several layouts (its first pages
  under the old one, the pages it added under its own), so the cover is found segment by segment:
  after a covered prefix, the sources are asked again from where it ended (two more existence
  rounds per layout switch, only where other layouts exist, all under the call's deadline).
- ``HeadColumns``: the ``HostSlots`` view through which a source's pages land in their head columns
  of an assembly buffer; only pages every chosen source delivered (verified, prefix-ordered) are
  then written to the host pool, in one ``write_slots`` on the calling thread.

KV pages are ``[..., heads, head_dim]`` (the head axis is ``HEAD_AXIS``): the per-page shape of a
source is this host's with its head count. Other pool kinds (SWA windows, Mamba state) are not
assembled: they are read under their own shard only.

Pure functions and per-call buffers; the listing runs through the store's ``BatchIO`` under the
caller's deadline. Nothing here keeps a reference to the host pool after a call.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from hicache.storage.batch_io import BatchIO, Deadline
from hicache.storage.chunking import Chunking
from hicache.storage.keys import ShardCoord

HEAD_AXIS = -2  # KV pages are [L, 2, page, heads, head_dim]: heads are the second-last axis
_TAG_RE = re.compile(r"^h(\d+)-(\d+)of(\d+)\.l(\d+)-(\d+)of(\d+)$")
_CHUNK_RE = re.compile(r"^c(\d+)$")


def parse_tag(tag: str) -> ShardCoord | None:
    """The ``ShardCoord`` a path component names (``ShardCoord.tag``), or None if it names none."""
    m = _TAG_RE.match(tag)
    if m is None:
        return None
    try:
        return ShardCoord(*(int(g) for g in m.groups()))
    except (TypeError, ValueError):
        return None


@dataclasses.dataclass(frozen=True)
class Source:
    """A stored shard layout holding some of this host's heads: where its objects are, their
    per-page shape, and which heads of ours it holds."""

    coord: ShardCoord
    chunking: Chunking
    shape: tuple[int, ...]  # per-page shape of its objects
    heads: tuple[int, int]  # the heads of ours it holds, absolute [a, b)


def can_assemble(own: ShardCoord, shape: tuple[int, ...]) -> bool:
    """Whether pages of ``shape`` for shard ``own`` are head-split KV pages (``HEAD_AXIS``)."""
    return len(shape) >= 2 and shape[HEAD_AXIS] == own.head_end - own.head_start


def source_for(own: ShardCoord, own_shape: tuple[int, ...], coord: ShardCoord, chunking: Chunking) -> Source | None:
    """``coord``'s objects as a source of ``own``'s heads, or None if they hold none of them (other
    model shape, other layers, disjoint heads)."""
    if (coord.num_heads, coord.num_layers, coord.layer_start, coord.layer_end) != (
            own.num_heads, own.num_layers, own.layer_start, own.layer_end):
        return None
    a, b = max(own.head_start, coord.head_start), min(own.head_end, coord.head_end)
    if a >= b:
        return None
    shape = list(own_shape)
    shape[HEAD_AXIS] = coord.head_end - coord.head_start
    return Source(coord, chunking, tuple(shape), (a, b))


def discover(io: BatchIO, pool_dir: str, own: ShardCoord, own_chunking: Chunking, own_shape: tuple[int, ...],
             deadline: Deadline) -> tuple[Source, ...]:
    """Every stored layout under ``pool_dir`` (``{base}/{pool}``) other than this host's own that
    holds some of its heads, in name order. Raises the listing's error (the caller keeps what it
    knew)."""
    out: list[Source] = []
    for tag in sorted(io.list_dirs(pool_dir, deadline)):
        coord = parse_tag(tag)
        if coord is None or source_for(own, own_shape, coord, own_chunking) is None:
            continue
        for sub in sorted(io.list_dirs(f"{pool_dir}/{tag}", deadline)):
            m = _CHUNK_RE.match(sub)
            if m is None or int(m.group(1)) < 1:
                continue
            if own_chunking.named and int(m.group(1)) != own_chunking.pages_per_object:
                continue  # (named objects of another chunk size hold other runs of pages under the same names)
            chunking = Chunking(f"{pool_dir}/{tag}/{sub}", int(m.group(1)), own_chunking.named)
            src = source_for(own, own_shape, coord, chunking)
            if src is not None and chunking != own_chunking:
                out.append(src)
    return tuple(out)


def cover(own: ShardCoord, heads: Sequence[tuple[int, int]], hits: Sequence[int]) -> tuple[int, list[int]]:
    """``(pages, chosen)``: the longest prefix every head of ``own`` can be read for, from sources
    holding heads ``heads[i]`` (absolute ``[a, b)``) with stored prefixes ``hits[i]`` pages long, and
    the fewest sources to read it from (among those holding that many pages, at each uncovered head
    the one reaching furthest; the lowest index on a tie, so source 0, this host's own layout,
    wins when it holds as much). ``(0, [])`` when some head has no source."""
    if len(heads) != len(hits):
        raise ValueError(f"{len(heads)} head ranges but {len(hits)} hits")
    span = range(own.head_start, own.head_end)
    pages = min((max((n for (a, b), n in zip(heads, hits) if a <= h < b), default=0) for h in span), default=0)
    if pages <= 0:
        return 0, []
    chosen: list[int] = []
    h = own.head_start
    while h < own.head_end:
        best = max((i for i, (a, b) in enumerate(heads) if a <= h < b and hits[i] >= pages),
                   key=lambda i: (heads[i][1], -i))
        chosen.append(best)
        h = heads[best][1]
    return pages, chosen


class HeadColumns:
    """``HostSlots`` view of an assembly buffer ``[n, *own_shape]`` for one source: slot ``i`` is
    page ``i`` of the transfer; ``write_slots`` puts the source's columns of our heads into ours.
    Written on the calling thread only (no ``concurrent_slot_io``); never read."""

    def __init__(self, buf: np.ndarray, source: Source, own: ShardCoord) -> None:
        self.buf = buf
        self.slot_shape = source.shape
        self.dtype = buf.dtype
        self.slot_bytes = int(np.prod(source.shape)) * buf.dtype.itemsize
        a, b = source.heads
        self._src = slice(a - source.coord.head_start, b - source.coord.head_start)
        self._dst = slice(a - own.head_start, b - own.head_start)

    def read_slots(self, slots: np.ndarray) -> np.ndarray:
        raise TypeError("an assembly buffer is written by reads only, never gathered for a write")

    def write_slots(self, slots: np.ndarray, data: np.ndarray) -> None:
        idx = np.asarray(slots)
        self.buf[idx, ..., self._dst, :] = data[..., self._src, :]


class Segment(NamedTuple):
    """Pages ``[offset, offset + pages)`` of a query (relative to its first page), read from the
    flat transfers ``chosen`` (one: read straight into the pool; several: assembled)."""

    offset: int
    pages: int
    chosen: list[int]
    own: int  # the flat transfer of the query itself (its own layout) in this segment's round


def plan(queries: Sequence[Any], others: Callable[[Any], Sequence[Any]],
         resolve: Callable[[list[Any], int], list[list[Any]]], deadline: Deadline,
         min_pages: int = 1) -> tuple[list[Any], list[list[Any]], list[list[Segment]]]:
    """Segments covering the longest readable prefix of each query (the store's ``_Transfer``:
    ``reg`` with ``shard``, ``keys``, ``slots``, ``first``). ``others(reg)``: registrations of the
    other layouts holding its heads; ``resolve(transfers, min_pages)``: ``chunking.resolve`` over
    them. Returns the flat transfers asked about (a query's own first, then its other layouts',
    per round), the objects found for each (``ObjectRef.t`` indexes the flat list) and each query's
    segments in chain order."""
    flat: list[Any] = []
    found: list[list[Any]] = []
    segments: list[list[Segment]] = [[] for _ in queries]
    todo = [(i, 0, q) for i, q in enumerate(queries)]
    least = min_pages
    while todo:
        batch: list[Any] = []
        spans = []
        for i, offset, q in todo:
            alts = others(q.reg)
            spans.append((i, offset, len(flat) + len(batch), len(alts)))
            batch.append(q)
            batch += [q._replace(reg=r) for r in alts]
        base = len(flat)
        flat += batch
        found += [[o._replace(t=o.t + base) for o in objs] for objs in resolve(batch, least)]
        least = 1
        todo = []
        for i, offset, i0, k in spans:
            q = flat[i0]
            hits = [min(objs[-1].stop() - q.first, len(q.keys)) if objs else 0 for objs in found[i0 : i0 + 1 + k]]
            if not k:
                n, chosen = hits[0], [0]
            else:
                own = q.reg.shard
                heads = [(max(own.head_start, t.reg.shard.head_start), min(own.head_end, t.reg.shard.head_end))
                         for t in flat[i0 : i0 + 1 + k]]
                n, chosen = cover(own, heads, hits)
            if n <= 0:
                continue
            segments[i].append(Segment(offset, n, [i0 + c for c in chosen], i0))
            if k and n < len(q.keys) and deadline.left() > 0:  # another layout may continue the chain
                todo.append((i, offset + n, q._replace(keys=q.keys[n:], slots=q.slots[n:], first=q.first + n)))
    return flat, found, segments


def assemble(flat: list[Any], seg: Segment) -> np.ndarray | None:
    """For a segment read from other layouts' shards: its assembly buffer, with each chosen
    transfer (in ``flat``) pointed at its head columns there through a ``HeadColumns`` view. None
    for a segment read straight into the pool (its own layout)."""
    if seg.chosen == [seg.own]:
        return None
    own_t = flat[seg.own]
    own = own_t.reg.shard
    buf = np.zeros((seg.pages, *own_t.reg.shape), np.dtype(own_t.reg.pool.dtype))
    for c in seg.chosen:
        t = flat[c]
        heads = (max(own.head_start, t.reg.shard.head_start), min(own.head_end, t.reg.shard.head_end))
        view = HeadColumns(buf, Source(t.reg.shard, t.reg.chunking, t.reg.shape, heads), own)
        flat[c] = t._replace(reg=dataclasses.replace(t.reg, pool=view), keys=t.keys[: seg.pages],
                             slots=np.arange(seg.pages, dtype=np.int32))
    return buf


def combine(q: Any, segs: list[Segment], bufs: list[np.ndarray | None], flat_results: list[list[bool]]) -> list[bool]:
    """Per page of query ``q``: loaded, for the contiguous prefix whose every head arrived
    (verified). Assembled pages of that prefix are written to ``q``'s pool here, in one
    ``write_slots`` per segment, on the calling thread."""
    r = [False] * len(q.keys)
    for seg, buf in zip(segs, bufs):
        rows = [flat_results[c] for c in seg.chosen]
        got = rows[0] if len(rows) == 1 else [all(x) for x in zip(*rows)]
        ok = min(seg.pages, got.index(False) if False in got else len(got))
        if buf is not None and ok:
            q.reg.pool.write_slots(q.slots[seg.offset : seg.offset + ok], buf[:ok])
        r[seg.offset : seg.offset + ok] = [True] * ok
        if ok < seg.pages:
            break
    return r
