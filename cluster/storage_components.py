"""L3 objects of a hybrid model's component pools (issue #26 item 3): what the storage tier stores beside a
path's Full pages, and where an L3 hit may end.

Owned by the replica's ``StorageTier`` (the head's one thread; ``servable_end`` also runs on an L3 query
thread, on data it is handed). Per component with an L2 (``ComponentHostPool``) that keeps values in L3
(``TreeComponent.l3_value_pages`` > 0: Mamba, one state per node end; SWA, the window's pages before it):

- Objects: a node's host copy (the values of its last ``k`` pages) is stored as ``k`` one-page objects of the
  component's pool (``PoolKind``: its own folder), named by the chain keys of those pages, in the same
  write-once + header + checksum format as Full pages (``hicache.storage.format``). They are written from L2
  by the same L2->L3 op as the path's Full pages (``StoragePart``), so after the node's D->H ack; a value
  that reaches L2 after its Full pages (a Mamba state cached at a node later) goes alone, at its own ack.
  Values sent or stored are remembered (bounded, by name): a path backed up again does not send them again.
- Hit rule: a fetch of the Full pages ``[0, found)`` past a match may end at page ``e`` only where every such
  component holds objects for pages ``[e - l3_value_pages, e)`` (those past the match) on every host; the
  fetch ends at the last such ``e`` (``servable_end``) and brings those pages' values into the components'
  L2 in the same op as the Full pages (one ack: the new host-only node gets its host copies at the ack, or
  nothing on a failure). A missing or corrupt object makes the hit shorter, or a miss, never wrong KV.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from hicache.cluster.component_host import ComponentHostPool
from hicache.cluster.tree import TreeNode
from hicache.workers.plan import StoragePart

__all__ = ["ComponentObjects", "FetchParts", "servable_end"]

_REMEMBERED = 1 << 16  # names of values sent or stored that a head remembers (beyond: sent again, write-once)


def servable_end(flags: Mapping[str, Sequence[bool]], value_pages: Mapping[str, int], found: int, least: int) -> int:
    """The last page end ``e`` in ``[least, found]`` where, for every pool, the objects of pages
    ``[e - value_pages[pool], e)`` (clipped at 0: earlier pages are the match's, served by the tree) are
    stored (``flags[pool][i]``: page ``i`` past the match); 0 if none."""
    for e in range(found, least - 1, -1):
        if e <= 0:
            break
        if all(all(flags[pool][max(0, e - n) : e]) for pool, n in value_pages.items()):
            return e
    return 0


@dataclass
class FetchParts:
    """The component values a fetch brings: per pool, its reserved L2 ids and the op's part."""

    reserved: list[tuple[ComponentHostPool, np.ndarray]] = field(default_factory=list)
    parts: list[StoragePart] = field(default_factory=list)


@dataclass
class ComponentCounters:
    values_stored: int = 0  # component values (pages, states) sent to L3 with an acked backup
    values_fetched: int = 0  # component values brought back into L2 by an acked fetch
    fetches_cut: int = 0  # fetches that ended before the Full pages found: a component's objects stopped earlier
    fetches_without_values: int = 0  # fetches not sent: no end with every component's objects (or no L2 room)


class ComponentObjects:
    """The L3 side of a hybrid tree's component pools (module docstring); empty for a Full-only tree."""

    def __init__(self, hosts: Mapping[str, ComponentHostPool], page_size: int) -> None:
        self.hosts = [p for p in hosts.values() if p.component.l3_value_pages > 0]
        self.value_pages = {p.name: int(p.component.l3_value_pages) for p in self.hosts}
        self.page_size = page_size
        self._sent: OrderedDict[tuple[str, str, int], None] = OrderedDict()  # (pool, last page key, pages)
        self.counters = ComponentCounters()

    def __bool__(self) -> bool:
        return bool(self.hosts)

    # -- L2 -> L3 --------------------------------------------------------------------------------------
    def backup(self, path: list[TreeNode], keys_from: Callable[[int], list[str]]
               ) -> tuple[list[StoragePart], list[TreeNode], list[tuple[str, str, int]]]:
        """The parts that store the host copies on ``path`` not sent yet (``keys_from(p)``: the chain keys of
        pages ``p ..`` of the path), the nodes to pin while they are read, and their names (``sent`` marks
        them; ``forget`` after a failure)."""
        ps = self.page_size
        wanted: list[tuple[ComponentHostPool, TreeNode, int, np.ndarray]] = []
        page = 0
        for node in path:
            page += node.num_tokens // ps
            for pool in self.hosts:
                ids = pool.component.host_copy(node)
                if ids is None or not ids.size:
                    continue
                if node.chain_key is not None and (pool.name, node.chain_key, int(ids.size)) in self._sent:
                    continue  # (known without hashing: the node's last page key is cached)
                wanted.append((pool, node, page - int(ids.size), ids))
        if not wanted:
            return [], [], []
        lo = min(w[2] for w in wanted)
        keys = keys_from(lo)
        parts, pinned, names = [], [], []
        for pool, node, start, ids in wanted:
            ks = tuple(keys[start - lo : start - lo + int(ids.size)])
            name = (pool.name, ks[-1], len(ks))
            if name in self._sent:
                continue
            self._remember(name)
            parts.append(StoragePart(pool.name, start, ks, np.asarray(ids, dtype=np.int32).copy()))
            pinned.append(node)
            names.append(name)
        return parts, pinned, names

    def _remember(self, name: tuple[str, str, int]) -> None:
        self._sent[name] = None
        self._sent.move_to_end(name)
        while len(self._sent) > _REMEMBERED:
            self._sent.popitem(last=False)

    def stored(self, names: list[tuple[str, str, int]]) -> None:
        self.counters.values_stored += sum(n[2] for n in names)

    def forget(self, names: list[tuple[str, str, int]]) -> None:
        """A backup failed: its values are not in L3 (a later backup sends them again)."""
        for name in names:
            self._sent.pop(name, None)

    # -- L3 -> L2 --------------------------------------------------------------------------------------
    def query(self, exists_each: Callable[[str, Sequence[str]], list[bool]], keys: Sequence[str], found: int,
              least: int, into: dict[str, list[bool]]) -> int:
        """Runs on the query thread after the Full pages' answer (``found`` pages of ``keys``): which of those
        pages each pool holds (``into``, by pool), and the end a fetch may reach (``servable_end``)."""
        if found < least:
            return found
        some = list(keys[:found])
        for pool in self.value_pages:
            into[pool] = exists_each(pool, some)
        end = servable_end(into, self.value_pages, found, least)
        return end if end >= least else 0

    def reserve(self, flags: Mapping[str, Sequence[bool]], found: int, first_page: int, keys: Sequence[str]
                ) -> FetchParts | None:
        """L2 ids for the values a fetch of ``found`` pages (ending at a servable end) brings, with its parts;
        None when a pool has no room (nothing stays reserved)."""
        out = FetchParts()
        for pool in self.hosts:
            k = min(self.value_pages[pool.name], found)
            ids = pool.reserve(k)
            if ids is None:
                self.release(out)
                return None
            out.reserved.append((pool, ids))
            out.parts.append(StoragePart(pool.name, first_page + found - k, tuple(keys[found - k : found]), ids))
        return out

    def adopt(self, nodes: list[TreeNode] | None, fetched: FetchParts) -> None:
        """The fetch was acked: ``nodes`` (the host-only nodes it made, root first, ending where it ended) hold
        the values, each node the part within its own pages (the fetch may end in former storage-only nodes
        shorter than a window); None: the pages were redundant or unusable (their ids are freed)."""
        if not nodes:
            self.release(fetched)
            return
        ps = self.page_size
        for pool, ids in fetched.reserved:
            end = int(ids.size)
            for node in reversed(nodes):
                if end <= 0:
                    break
                k = min(end, node.num_tokens // ps)
                pool.component.adopt_host_copy(node, ids[end - k : end])
                end -= k
            pool.commit(ids)
            self.counters.values_fetched += int(ids.size)

    @staticmethod
    def release(fetched: FetchParts) -> None:
        for pool, ids in fetched.reserved:
            pool.unreserve(ids)
        fetched.reserved = []
