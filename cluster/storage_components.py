"""L3 objects of a hybrid model's component pools (issue #26 item 3): what the storage tier stores beside a
path's Full pages, and where an L3 hit may end.

Owned by the replica's ``StorageTier`` (the head's one thread; ``servable_end`` also runs on an L3 query
thread, on data it is handed). Per component with an L2 (``ComponentHostPool``) that keeps values in L3
(``TreeComponent.l3_value_pages`` > 0: Mamba, one state per node end; SWA, the window's pages before it):

- Objects: the values a pool keeps at a node end ``E`` (the pages ``[E - m, E)``, ``m = min(l3_value_pages, E)``:
  Mamba, the state; SWA, the window's pages before it) are ONE object of the component's pool (``PoolKind``: its
  own folder), named by the chain key of page ``E - 1`` (``StoragePart``; the key fixes ``E`` and so ``m``), in
  the same write-once + header + checksum format as Full pages (``hicache.storage.format``): one object write and
  one existence request per node end and pool, not one per page (GCS charges each). The pages of an SWA window
  come from the host copies on the path (a node's own tail, then its parents' where the node is shorter than
  the window); an end whose window is not whole in L2 is not sent (its Full pages are). They are written from
  L2 by the same L2->L3 op as the path's Full pages, so after the nodes' D->H acks; a value that reaches L2
  after its Full pages (a Mamba state cached at a node later) goes alone, at its own ack. Values sent or stored
  are remembered (bounded, by name): a path backed up again does not send them again.
- Hit rule: a fetch of the Full pages ``[0, found)`` past a match may end at page ``e`` only where every such
  component holds the object of the end ``e`` on every host; the fetch ends at the last such ``e``
  (``servable_end``) and brings that object into the components' L2 in the same op as the Full pages (one
  ack: the new host-only nodes get their host copies, the pages past the match, at the ack, or nothing on a
  failure; the object's pages before the match are read and dropped). A missing or corrupt object makes the
  hit shorter, or a miss, never wrong KV.
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


def servable_end(flags: Mapping[str, Sequence[bool]], found: int, least: int) -> int:
    """The last page end ``e`` in ``[least, found]`` where every pool's object of the end ``e`` is stored
    (``flags[pool][i]``: the object named by page ``i`` past the match, i.e. of the end ``i + 1``); 0 if none."""
    for e in range(found, max(least, 1) - 1, -1):
        if all(f[e - 1] for f in flags.values()):
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
    existence_requests: int = 0  # component objects asked about by L3 queries (names, each asked of every host)


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
        """The parts that store the values at the ends of ``path``'s nodes with a host copy, not sent yet (one
        per end and pool; ``keys_from(p)``: the chain keys of pages ``p ..`` of the path), the nodes to pin
        while they are read, and their names (``sent`` marks them; ``forget`` after a failure)."""
        ps = self.page_size
        ends: list[int] = []
        page = 0
        for node in path:
            page += node.num_tokens // ps
            ends.append(page)
        wanted: list[tuple[ComponentHostPool, int, int, np.ndarray, list[TreeNode]]] = []
        for i, node in enumerate(path):
            for pool in self.hosts:
                ids = pool.component.host_copy(node)
                if ids is None or not ids.size:
                    continue
                m = min(self.value_pages[pool.name], ends[i])
                if node.chain_key is not None and (pool.name, node.chain_key, m) in self._sent:
                    continue  # (known without hashing: the node's last page key is cached)
                got = self._values_before(pool, path, ends, i, m)
                if got is not None:
                    wanted.append((pool, ends[i], m, *got))
        if not wanted:
            return [], [], []
        lo = min(w[1] for w in wanted) - 1
        keys = keys_from(lo)
        parts: list[StoragePart] = []
        pinned: list[TreeNode] = []
        names: list[tuple[str, str, int]] = []
        for pool, end, m, ids, held in wanted:
            name = (pool.name, keys[end - 1 - lo], m)
            if name in self._sent:
                continue
            self._remember(name)
            parts.append(StoragePart(pool.name, end - m, name[1], ids))
            pinned.extend(held)
            names.append(name)
        return parts, pinned, names

    @staticmethod
    def _values_before(pool: ComponentHostPool, path: list[TreeNode], ends: list[int], i: int, m: int
                       ) -> tuple[np.ndarray, list[TreeNode]] | None:
        """The L2 ids of the ``m`` pages before the end of ``path[i]`` (its host copy, then its parents' where
        it is shorter), with the nodes they belong to; None where a page of them has no host copy."""
        runs: list[np.ndarray] = []
        held: list[TreeNode] = []
        need = m
        for j in range(i, -1, -1):
            ids = pool.component.host_copy(path[j])
            if ids is None or not ids.size:
                return None
            take = min(need, int(ids.size))
            runs.append(np.asarray(ids[ids.size - take:], dtype=np.int32))
            held.append(path[j])
            need -= take
            if not need:
                return np.concatenate(runs[::-1]).copy(), held
            if take < ends[j] - (ends[j - 1] if j else 0):
                return None  # the copy ends inside the node: the pages before it are not in L2
        return None

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
        """Runs on the query thread after the Full pages' answer (``found`` pages of ``keys``): at which of those
        pages' ends each pool holds an object (``into``, by pool), and the end a fetch may reach
        (``servable_end``)."""
        if found < least:
            return found
        some = list(keys[:found])
        for pool in self.value_pages:
            into[pool] = exists_each(pool, some)
        end = servable_end(into, found, least)
        return end if end >= least else 0

    def reserve(self, found: int, first_page: int, keys: Sequence[str]) -> FetchParts | None:
        """L2 ids for the object at the end of a fetch of ``found`` pages (a servable end; ``keys[i]``: page
        ``first_page + i``), with its parts; None when a pool has no room (nothing stays reserved)."""
        out = FetchParts()
        end = first_page + found
        for pool in self.hosts:
            m = min(self.value_pages[pool.name], end)
            ids = pool.reserve(m)
            if ids is None:
                self.release(out)
                return None
            out.reserved.append((pool, ids))
            out.parts.append(StoragePart(pool.name, end - m, keys[found - 1], ids))
        return out

    def adopt(self, nodes: list[TreeNode] | None, fetched: FetchParts) -> None:
        """The fetch was acked: ``nodes`` (the host-only nodes it made, root first, ending where it ended) hold
        the values, each node the part within its own pages (the fetch may end in former storage-only nodes
        shorter than a window); the object's pages before them (the match's) are freed; None: the pages were
        redundant or unusable (their ids are freed)."""
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
            if end > 0:
                pool.unreserve(ids[:end])
            pool.commit(ids[end:])
            self.counters.values_fetched += int(ids.size) - end
        fetched.reserved = []

    @staticmethod
    def release(fetched: FetchParts) -> None:
        for pool, ids in fetched.reserved:
            pool.unreserve(ids)
        fetched.reserved = []
