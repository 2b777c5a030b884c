"""Sliding-window attention (SWA) component: a second KV pool that only needs the last ``window`` tokens.

Runs on the head, inside the replica's radix tree (DESIGN.md §1); workers only see page ids.

Pools and mapping (SGLang's SWA radix cache idea). Every L1 full-attention page has at most one SWA page:
``swa_of[full_page]`` is its SWA page id or -1. ``RadixTree.alloc`` hands out full pages and SWA pages
together (the SWA component installs a ``MappedPageAllocator`` as the Full component's allocator), and
releasing a full page releases its SWA page. The model reads SWA KV through ``translate(full_pages)``,
so scheduler code never deals with SWA page ids. An SWA page's owner is the owner of the full page that
maps to it (FREE when none does), so the SWA pool (``SWAPagePool``, capacity ``num_tokens // page_size``;
None = unbounded) keeps only a free stack and derives owners from the mapping: moving a full page between
REQUEST and TREE costs the SWA side nothing.

Window rule. The query at position ``p`` attends to keys in ``(p - window, p]``; we keep it one token
conservative: continuing a sequence at position ``p`` needs the SWA KV of ``[p - window, p)``.

- Requests: ``trim_request`` makes the SWA pages of the request's own pages that end at or before
  ``e - window`` (``e``: the request's last whole-page boundary, where it will be cached) *spare*: no
  step of the request reads them again, so they are the first SWA pages reclaimed (freed, the full page
  unmapped) when the SWA pool is short or ``evict(swa_num_tokens=...)`` asks; until then they stay
  mapped and a finished request caches them as live SWA KV (lazy, not eager: a shared prefix such as a
  system prompt keeps its SWA KV and later requests can hit it). ``release_spare`` frees them at once.
- Tombstones: a node whose full pages have no SWA pages is a tombstone (full KV kept, SWA gone). A node's
  live SWA pages are always a suffix of its pages: wholly live, wholly tombstone, or a tombstoned head
  and a live tail (what a trimmed request inserts: one node, not a tombstone node plus a live node, so
  the tree holds, splits and evicts half as many nodes). An insert cuts a new run only where a live page
  is followed by a dead one (``insert_boundaries``); a revived node with mixed pages is tombstoned whole
  (conservative). A match may end at a node end whose window lies in the node's live tail.
- An insert passing through a tombstone whose pages the request holds with live SWA gives the node the
  request's SWA pages (``swa_of`` is re-pointed, no data moves).
- Match: accepted only at node ends whose window ``[p - window, p)`` is live (or live back to the root).
- Eviction: ``evict(swa_num_tokens=n)`` (and SWA allocation when short) first frees spare request pages,
  then is window-aware (``swa_window``): it frees the heads of cached nodes that no hit point reads, then
  the pages only past turns' ends read (nodes with one live child), and only then tombstones unlocked
  nodes with a live tail in LRU order, each followed by the pages only its window read. A tombstoned
  leaf is deleted outright, and so is a parent left as an unlocked tombstone leaf after a Full eviction
  (it could never end a match). Full eviction frees SWA with the full pages.
- Locks: a request lock on node N (position p) locks, for SWA, only the nodes intersecting
  ``[p - window, p)``. Unlock recomputes the same walk; exactness across later splits comes from
  ``bounds``: the topmost (partially covered) node records the lock's window start ``q``, and a split
  gives the prefix exactly the locks that reach into it. No unlock handle is needed.

HiCache (see ``component.py``): a node's SWA host copy is a *host tail*: its last ``k`` pages, at most the
``window_pages`` a hit at its end reads (the window before a node end lies in that node's tail and, when
the node is shorter than the window, in its ancestors' tails), so L2 holds only what hits need. BACKUP
copies the live tail of a node in L1, capped at ``window_pages``, to host ids the host tier chooses;
LOAD_BACK restores the host tails of the loading nodes within the window before the loaded node's end
(on commit, the pages not restored become a tombstoned head, or the whole node a tombstone); an L2 hit
needs a window of host tails (``limit_host_match``); host eviction drops host tails in LRU order,
independently of the Full host chain. Splits divide a host tail between the two nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.cluster.tree.allocator import (
    PAGE_DTYPE,
    CacheCapacityError,
    PageAllocator,
    PageOwner,
    as_index,
    count_true,
)
from hicache.cluster.tree.component import ComponentTransfer, HiCachePhase, HostEvictionTracker, TreeComponent
from hicache.cluster.tree.eviction import ComponentQueue, QueuedValue
from hicache.cluster.tree.node import TreeNode
from hicache.cluster.tree.params import InsertParams, RequestState
from hicache.cluster.tree.swa_window import WindowTrims

if TYPE_CHECKING:
    from hicache.cluster.tree.radix import RadixTree


def check_positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")


class _SWANode(QueuedValue):
    __slots__ = ("lock", "bounds", "host_slots", "end")

    def __init__(self) -> None:
        self.version = 0  # ``QueuedValue`` fields, set here (no super call per node)
        self.queued = False
        self.lock = 0  # SWA locks covering (part of) this node
        self.bounds: dict[int, int] | None = None  # window start q -> locks whose topmost node is this one
        self.host_slots: np.ndarray | None = None  # i32[k]: host copy of the node's last k SWA pages
        self.end = -1  # the node's end position (depth), once known: fixed for the node's life (a split
        # moves the node's start, never its end; the prefix is a new node)


@dataclass(frozen=True)
class SWAStats:
    window: int
    capacity_pages: int
    free_pages: int
    tree_pages: int
    request_pages: int
    tombstone_nodes: int
    live_nodes: int
    evicted_tokens: int


class SWAPagePool(PageAllocator):
    """The SWA page pool: a free stack only; owners (``owners``/``count``) derive from the full pages."""

    def __init__(self, capacity: int | None, swa: SWAComponent) -> None:
        super().__init__(capacity)
        self.swa = swa

    def alloc(self, num_pages: int, owner: int = PageOwner.REQUEST) -> np.ndarray:
        """No owner to record (``owner`` is the full page's): the int32 copy of the stack's top slice."""
        return self._pop_free(num_pages).astype(PAGE_DTYPE)  # (grows an unbounded pool, or raises)

    def alloc_indexed(self, num_pages: int) -> tuple[np.ndarray, np.ndarray]:
        pages = self.alloc(num_pages)
        return pages, pages  # no owner array to index (callers only use the ids)

    def transfer(self, pages: np.ndarray, new_owner: PageOwner, index: np.ndarray | None = None) -> None:
        """Nothing to record: the owner follows the full page."""

    def release(self, pages: np.ndarray, index: np.ndarray | None = None) -> None:
        n = pages.shape[0]
        if n:
            nf = self.num_free + n
            top = self._size - nf
            self._free[top : top + n] = pages  # the stack's order (see ``PageAllocator.release``)
            self.num_free = nf

    def release_one(self, page: int) -> None:
        self.num_free += 1
        self._free[self._size - self.num_free] = page  # no owner to record

    def _derived_owners(self) -> np.ndarray:
        mapped = self.swa.mapped
        full = np.flatnonzero((mapped.swa_of >= 0) & (mapped._owner != PageOwner.FREE))  # free: stale entries
        owners = np.zeros(self.capacity, dtype=np.int8)  # FREE unless a full page maps here
        owners[mapped.swa_of[full]] = mapped.owners(full)
        return owners

    def owners(self, pages: np.ndarray) -> np.ndarray:
        return self._derived_owners()[np.asarray(pages).astype(np.intp)]

    def count(self, owner: PageOwner) -> int:
        return int(np.count_nonzero(self._derived_owners() == owner))

    def check(
        self, pages: np.ndarray, expected: PageOwner, what: str = "pages", index: np.ndarray | None = None
    ) -> np.ndarray:
        raise TypeError("SWA pages are checked through their full pages (MappedPageAllocator.check)")

    def free_pages(self) -> np.ndarray:
        return self._free[self._size - self.num_free :]


class MappedPageAllocator(PageAllocator):
    """The Full L1 allocator with an SWA page attached to every handed-out full page.

    An SWA page's owner follows its full page. ``spare`` counts only on REQUEST pages that map an SWA
    page: a page the tree takes or frees, or whose SWA page went, keeps a stale flag (no store on the hot
    paths), cleared when it is handed out again. Likewise a FREE full page keeps a stale ``swa_of`` entry
    (its SWA page went back to the pool when it was freed; ``alloc`` rewrites it): only entries of pages a
    request or the tree holds mean anything."""

    def __init__(self, capacity: int | None, swa: SWAComponent) -> None:
        super().__init__(capacity)
        self.swa = swa
        self.swa_of = np.full(self.capacity, -1, dtype=np.int32)  # full page -> SWA page or -1
        self.spare = np.zeros(self.capacity, dtype=bool)  # on a mapped REQUEST page: out of the window

    def _grow(self, needed: int) -> None:
        old = self.capacity
        super()._grow(needed)
        swa_of = np.full(self.capacity, -1, dtype=np.int32)
        swa_of[:old] = self.swa_of
        self.swa_of = swa_of
        spare = np.zeros(self.capacity, dtype=bool)
        spare[:old] = self.spare
        self.spare = spare

    def alloc(self, num_pages: int, owner: int = PageOwner.REQUEST) -> np.ndarray:
        if self.bounded and num_pages > self.num_free:
            raise CacheCapacityError(f"need {num_pages} pages, {self.num_free} free")
        pool = self.swa.allocator
        if pool.bounded and num_pages > pool.num_free:
            self.swa.make_room(num_pages)  # may tombstone; raises before any full page is taken
        swa_pages = pool.alloc(num_pages)
        pages, idx = super().alloc_indexed(num_pages)
        self.swa_of[idx] = swa_pages
        self.spare[idx] = False
        if owner != PageOwner.REQUEST:
            self._owner[idx] = owner
        return pages

    def spare_pages(self) -> np.ndarray:
        """The full pages (``intp``) whose SWA page is spare: REQUEST pages trimmed out of the window that
        still map an SWA page."""
        idx = np.flatnonzero(self.spare)
        return idx[(self._owner[idx] == PageOwner.REQUEST) & (self.swa_of[idx] >= 0)] if idx.shape[0] else idx

    def release(self, pages: np.ndarray, index: np.ndarray | None = None) -> None:
        n = pages.shape[0]
        if n == 0:
            return
        idx = pages.astype(np.intp) if index is None else index
        if n == 1:  # a request's partial tail page: Python ints, no SWA array work
            sp = self.swa_of.item(pages.item(0))
            if sp >= 0:
                self.swa.allocator.release_one(sp)
        else:
            self.unmap(idx, keep_stale=True)  # the freed full pages' entries go stale: no store per page
        super().release(pages, idx)

    def unmap(self, idx: np.ndarray, keep_stale: bool = False) -> int:
        """Frees the SWA pages of the full pages ``idx`` (``intp``) and unmaps them (``keep_stale``: the
        full pages are being freed, their entries may stay); returns how many SWA pages were freed."""
        sp = self.swa_of[idx]
        live = sp >= 0
        c = count_true(live)  # one count tells none, some and all live apart
        if c:  # tombstoned pages map nothing: no SWA work at all
            self.swa.allocator.release(sp if c == sp.shape[0] else sp[live])
            if not keep_stale:
                self.swa_of[idx] = -1
        return int(c)

    def reset(self) -> None:
        super().reset()
        self.swa_of[:] = -1
        self.spare[:] = False


class SWAComponent(TreeComponent):
    name = "swa"
    evict_param = "swa_num_tokens"
    value_type = _SWANode

    def __init__(self, window: int, num_tokens: int | None = None) -> None:
        check_positive_int("sliding window", window)
        check_positive_int("swa_num_tokens", num_tokens, allow_none=True)
        self.window = int(window)
        self.num_tokens = None if num_tokens is None else int(num_tokens)
        self.queue = ComponentQueue(self.name, self.is_evictable)
        self.trims = WindowTrims(self)  # window-aware eviction's candidates (pages no hit point reads)
        self.evicted_tokens = 0
        self.released_host_copies: list[tuple[str, int, np.ndarray]] = []

    def attach(self, tree: RadixTree) -> None:
        ps = tree.page_size
        if self.num_tokens is not None and self.num_tokens < ps:
            raise ValueError(f"swa_num_tokens {self.num_tokens} is less than one page ({ps} tokens)")
        old = tree.full.allocator
        if type(old) is not PageAllocator or old.num_free != old.capacity:
            raise ValueError("the SWA component must be attached to a fresh tree (its allocator is in use)")
        super().attach(tree)
        self.queue.tree = tree
        self.page_size = ps
        self.window_pages = -(-self.window // ps)  # pages a hit at a (page-aligned) node end reads
        self.l3_value_pages = self.window_pages
        self.allocator = SWAPagePool(None if self.num_tokens is None else self.num_tokens // ps, self)
        self.mapped = MappedPageAllocator(old.capacity if old.bounded else None, self)
        tree.full.allocator = self.mapped

    # -- node values ---------------------------------------------------------------------------------
    @staticmethod
    def _state(node: TreeNode) -> _SWANode:
        return node.component_data["swa"]

    def is_live(self, node: TreeNode) -> bool:
        """True when the node's full KV is in L1 and all its SWA pages are present (first page: live
        pages are a suffix)."""
        pages = node.device_pages
        return pages is not None and pages.shape[0] > 0 and self.mapped.swa_of.item(pages.item(0)) >= 0

    def has_live(self, node: TreeNode) -> bool:
        """True when the node is in L1 and has a live SWA tail (its last page has an SWA page)."""
        pages = node.device_pages
        return pages is not None and pages.shape[0] > 0 and self.mapped.swa_of.item(pages.item(-1)) >= 0

    def _live_tail(self, node: TreeNode) -> int:
        """Tokens at the end of an L1 node whose SWA KV is present (0 for a tombstone)."""
        pages = node.device_pages
        assert pages is not None, f"{node} is not in L1"
        swa_of = self.mapped.swa_of
        if swa_of.item(pages.item(0)) >= 0:
            return node.num_tokens
        if swa_of.item(pages.item(-1)) < 0:
            return 0
        return int(count_true(swa_of[pages] >= 0)) * self.page_size

    def is_evictable(self, node: TreeNode) -> bool:
        # ``staged_slots``: the node's L1->L2 copy (its SWA pages with it) may be queued, not yet dispatched
        if node.parent is None or node.loading or node.staged_slots is not None or not self.has_live(node):
            return False
        return self._state(node).lock == 0

    def translate(self, full_pages: np.ndarray) -> np.ndarray:
        """SWA page ids of full pages (-1 where the SWA KV is gone): what the model's SWA layers read.
        Only pages a request or the tree holds (a free page's entry is stale)."""
        return self.mapped.swa_of[np.asarray(full_pages, dtype=np.int32)]

    def make_room(self, num_pages: int) -> None:
        """Evicts SWA (spare pages first, then LRU tombstones) until ``num_pages`` SWA pages are free;
        CacheCapacityError if it cannot."""
        alloc = self.allocator
        short = num_pages - alloc.num_free
        if short > 0:
            self.evict_component(short * self.page_size)
            if alloc.num_free < num_pages:
                raise CacheCapacityError(
                    f"SWA pool: need {num_pages} pages, {alloc.num_free} free and nothing more to tombstone"
                )

    def _tombstone(self, node: TreeNode) -> int:
        """Frees the node's SWA pages (full KV stays); returns SWA pages freed."""
        pages = node.device_pages
        assert pages is not None, f"{node} is not in L1"
        return self.mapped.unmap(pages.astype(np.intp))

    # -- structure hooks -------------------------------------------------------------------------------
    def insert_boundaries(
        self, params: InsertParams, page_start: int, page_end: int, index: np.ndarray
    ) -> Sequence[int]:
        live = self.mapped.swa_of[index] >= 0
        n = live.shape[0]
        c = count_true(live)
        if c == n or c == 0 or count_true(live[n - c :]) == c:
            return ()  # all dead, all live, or a dead head and a live tail: one node
        return (np.flatnonzero(live[:-1] & ~live[1:]) + 1 + page_start).tolist()  # cut after each live run

    def on_create(self, node: TreeNode, params: InsertParams, page_start: int, page_end: int) -> None:
        pages = node.device_pages
        assert pages is not None  # the tree attached the new node's pages first
        if self.mapped.swa_of.item(pages.item(-1)) >= 0:  # a live tail: an SWA candidate
            self.queue.push(node)
        self.trims.mark_up(node)  # its parent's end may be a past turn's now

    def on_revive(self, node: TreeNode, params: InsertParams, page_start: int, page_end: int) -> None:
        pages = node.device_pages
        assert pages is not None  # the tree attached the revived node's pages first
        self.trims.mark_up(node)
        c = count_true(self.mapped.swa_of[pages.astype(np.intp)] >= 0)
        if c == pages.shape[0]:
            self.queue.push(node)
        elif c:
            self._tombstone(node)

    def on_insert_existing(self, params: InsertParams, nodes: Sequence[tuple[TreeNode, int, int]]) -> None:
        swa_of = self.mapped.swa_of
        for node, page_start, page_end in nodes:
            pages = node.device_pages
            assert pages is not None  # the tree passes nodes in L1 only
            if node.loading or swa_of.item(pages.item(-1)) >= 0:
                continue  # only a wholly tombstoned node can adopt (a live tail keeps its own SWA pages)
            theirs = params.device_pages[page_start:page_end]
            if theirs.item(0) != pages.item(0):  # the same first page: the request holds the tree's pages
                self._adopt_request_swa(node, theirs)

    def _adopt_request_swa(self, node: TreeNode, theirs: np.ndarray) -> None:
        """A tombstone whose KV the request recomputed (``theirs``: its pages there) takes their SWA
        pages if every one is live and the request's own (``swa_of`` is re-pointed, no data moves)."""
        swa_of = self.mapped.swa_of
        idx = theirs.astype(np.intp)
        sp = swa_of[idx]
        n = sp.shape[0]
        if count_true(sp >= 0) != n or node.device_pages is None or np.array_equal(theirs, node.device_pages):
            return
        if count_true(self.mapped.owners(theirs) == PageOwner.REQUEST) != n:
            return
        swa_of[node.device_pages] = sp
        swa_of[idx] = -1
        self.mapped.spare[idx] = False
        self.trims.mark(node)
        if self._state(node).lock == 0:
            self.queue.push(node)

    def on_split(self, prefix: TreeNode, suffix: TreeNode) -> None:
        st = self._state(suffix)
        pst = self._state(prefix)
        pst.lock = st.lock
        host = st.host_slots
        if host is not None:  # the host tail splits with the pages: the prefix keeps what reaches into it
            n = suffix.num_tokens // self.page_size  # the whole node: its key is cut after the hooks ran
            into_prefix = host.shape[0] - (n - prefix.num_tokens // self.page_size)
            if into_prefix > 0:
                pst.host_slots, st.host_slots = host[:into_prefix].copy(), host[into_prefix:].copy()
        if st.bounds:
            assert prefix.parent is not None  # the tree linked the prefix in before this hook
            split_at = self.tree.depth(prefix.parent) + prefix.num_tokens
            inside = {q: c for q, c in st.bounds.items() if q < split_at}
            rest = {q: c for q, c in st.bounds.items() if q >= split_at}
            pst.lock = st.lock - sum(rest.values())
            pst.bounds = inside or None
            st.bounds = rest or None
        if pst.lock == 0 and self.has_live(prefix):
            self.queue.push(prefix)
        self.trims.mark(prefix)
        self.trims.mark(suffix)

    def on_remove(self, node: TreeNode) -> None:
        self.trims.forget(node)  # (the ancestors its hits read may keep less now)
        st = node.component_data["swa"]
        if st.host_slots is not None:
            self.released_host_copies.append((self.name, node.id, st.host_slots))
            st.host_slots = None

    def take_released_host_copies(self) -> list[tuple[str, int, np.ndarray]]:
        """(component, node id, host ids) of removed nodes' SWA host copies, for the host tier to free."""
        out, self.released_host_copies = self.released_host_copies, []
        return out

    # -- locks -----------------------------------------------------------------------------------------
    def _lock_walk(self, node: TreeNode, delta: int) -> None:
        st = node.component_data["swa"]
        end = st.end
        if end < 0:  # the node's depth, cached in its SWA value
            end = st.end = self.tree.depth(node)
        q = end - self.window
        swa_of = self.mapped.swa_of
        while node.parent is not None:
            st = node.component_data["swa"]
            lock = st.lock = st.lock + delta
            start = end - node.num_tokens
            if start <= q:
                bounds = st.bounds
                if delta > 0:
                    if bounds is None:
                        bounds = st.bounds = {}
                    bounds[q] = bounds.get(q, 0) + 1
                else:
                    c = bounds[q] - 1
                    if c:
                        bounds[q] = c
                    else:
                        del bounds[q]
                        if not bounds:
                            st.bounds = None
            if lock == 0:
                if delta < 0:
                    self.trims.unlocked(node)  # no longer kept whole for the lock
                if not st.queued:
                    pages = node.device_pages
                    if pages is not None and swa_of.item(pages.item(-1)) >= 0:
                        self.queue.push(node)  # unlocked with a live tail: an SWA eviction candidate
            if start <= q:
                return
            end = start
            node = node.parent

    def on_lock(self, node: TreeNode) -> None:
        self._lock_walk(node, 1)

    def on_unlock(self, node: TreeNode) -> None:
        self._lock_walk(node, -1)

    def window_nodes(self, node: TreeNode) -> list[TreeNode]:
        """The nodes intersecting ``[p - window, p)`` for node end ``p`` (what a lock on ``node`` covers)."""
        q = self.tree.depth(node) - self.window
        end, out = q + self.window, []
        while node.parent is not None:
            out.append(node)
            end -= node.num_tokens
            if end <= q:
                break
            node = node.parent
        return out

    # -- match -----------------------------------------------------------------------------------------
    def limit_match(self, path: list[TreeNode]) -> int:
        """The deepest node end whose window is live, walking back from the path's end (the last node's
        window, found after a node or two, is the common answer)."""
        swa_of = self.mapped.swa_of
        w = self.window
        for j in range(len(path) - 1, -1, -1):
            run, i = 0, j
            while True:
                node = path[i]
                pages = node.device_pages
                assert pages is not None  # a matched L1 path
                if swa_of.item(pages.item(0)) < 0:  # not wholly live: its live tail ends the run
                    if run + self._live_tail(node) >= w:
                        return j + 1
                    break
                run += node.num_tokens
                if run >= w or i == 0:  # the window, or live back to the root
                    return j + 1
                i -= 1
        return 0

    def limit_host_match(self, device_path: list[TreeNode], host_path: list[TreeNode]) -> int:
        if not host_path:
            return 0
        swa_of = self.mapped.swa_of
        run, from_root = 0, True
        for node in device_path:
            pages = node.device_pages
            assert pages is not None  # a matched L1 path
            if swa_of.item(pages.item(0)) >= 0:
                run += node.num_tokens
            else:
                run, from_root = self._live_tail(node), False
        best = 0
        ps = self.page_size
        for j, node in enumerate(host_path):
            data = node.component_data
            st = data.get("swa") if data else None
            tail = 0 if st is None or st.host_slots is None else st.host_slots.shape[0] * ps
            if tail == node.num_tokens:
                run += tail
            else:  # a host tail (or none) ends the run behind it
                run, from_root = tail, False
            if from_root or run >= self.window:
                best = j + 1
        return best

    # -- requests --------------------------------------------------------------------------------------
    def trim_request(self, state: RequestState) -> int:
        """Marks the request's own pages out of its window spare; returns how many pages are out of the
        window (spare, or reclaimed by an earlier trim's eviction)."""
        ps = self.page_size
        end = state.key.token_ids.shape[0] // ps * ps
        cut = (end - self.window) // ps
        k = state.prefix_len // ps
        if cut <= k:
            return 0
        pages = np.asarray(state.device_pages, dtype=np.int32)[k:cut]
        if pages.shape[0] < cut - k:
            raise ValueError(f"{len(state.device_pages)} pages cannot hold {end} tokens at page_size {ps}")
        idx = as_index(pages)  # negative ids wrap around and fail the bound
        self.mapped.check_owner(pages, idx, PageOwner.REQUEST, "trimmed request pages")  # repeats: harmless
        self.mapped.spare[idx] = True  # counts where the page still maps an SWA page (``spare_pages``)
        return cut - k

    def release_spare(self, max_pages: int | None = None) -> int:
        """Frees spare SWA pages (out of their running request's window), at most ``max_pages``; returns
        how many. The first thing SWA eviction does: it costs no cached SWA KV."""
        idx = self.mapped.spare_pages()
        if max_pages is not None:
            idx = idx[:max_pages]
        if idx.shape[0]:
            swa_of = self.mapped.swa_of
            self.allocator.release(swa_of[idx])
            swa_of[idx] = -1
            self.mapped.spare[idx] = False
        return int(idx.shape[0])

    # -- eviction --------------------------------------------------------------------------------------
    def evict_component(self, amount: int) -> int:
        """Frees at least ``amount`` SWA tokens if it can, cheapest first: spare request pages, then cached
        pages no hit point needs, then pages only secondary hit points need (``swa_window``), then whole
        live tails in LRU order (each followed by the pages only its hit point needed)."""
        ps = self.page_size
        freed = self.release_spare(-(-amount // ps)) * ps if amount > 0 else 0
        if freed < amount:
            freed += self.trim_unneeded(amount - freed, with_secondary=True)
        rebuilt = False
        while freed < amount:
            node = self.queue.pop()
            if node is None:
                if rebuilt:
                    break
                self.queue.rebuild(self.tree)  # candidates nobody pushed (e.g. after a load-back)
                rebuilt = True
                continue
            freed += self._tombstone(node) * ps
            self.trims.mark_up(node)  # the window pages in its ancestors and children only its hit read
            self.trims.mark_down(node)
            self._drop_dead_leaves(node)  # a tombstoned leaf goes entirely (full pages too)
            if freed < amount:
                freed += self.trim_unneeded(amount - freed, with_secondary=False)
        self.evicted_tokens += freed
        self.queue.maybe_compact(self.tree)
        return freed

    def trim_unneeded(self, amount: int, with_secondary: bool) -> int:
        """Frees the heads of cached nodes that no hit point needs (``with_secondary``: then those only
        secondary hit points need), in ``WindowTrims.pop``'s order, until ``amount`` tokens; returns the
        tokens freed. A node trimmed to nothing is a tombstone (a tombstoned leaf goes entirely)."""
        ps, freed, trims = self.page_size, 0, self.trims
        while freed < amount:
            got = trims.pop(with_secondary)
            if got is None:
                break
            node, phase, keep = got
            pages = node.device_pages
            assert pages is not None  # ``pop`` checked it
            freed += self.mapped.unmap(pages[: pages.shape[0] - keep].astype(np.intp)) * ps
            trims.mark(node)  # (its phase-2 trim next)
            if phase == 2:  # its end is no hit now: what only that window read, above and below, goes next
                trims.mark_up(node)
                trims.mark_down(node)
            if keep == 0:
                self._drop_dead_leaves(node)
        return freed

    def _drop_dead_leaves(self, node: TreeNode) -> int:
        """Deletes ``node`` and then its ancestors while each is an unlocked tombstone leaf in L1 only.

        A tombstone leaf can never end a match (its window has no SWA KV), so its full KV is dead weight
        (SGLang deletes tombstone leaves the same way). Returns the full tokens freed.
        """
        tree, freed = self.tree, 0
        while (
            node.parent is not None
            and not node.children
            and node.device_pages is not None
            and node.host_slots is None
            and node.staged_slots is None
            and node.pending is None
            and not node.lock_ref
            and not node.loading
            and not self.has_live(node)
        ):
            parent = node.parent
            freed += tree.full.drop_device(node)
            for on_device_drop in tree.hooks.on_device_drop:
                on_device_drop(node)
            if tree.listener is not None:
                tree.listener.on_removed(node, "device")
            tree._remove_leaf(node)
            node = parent
        if freed and node.parent is not None:
            tree.full.maybe_push(node)  # it may have become a leaf (nothing dropped: nothing changed for Full)
        return freed

    def after_device_evict(self, parent: TreeNode) -> int:
        """A child of ``parent`` left L1: ``parent`` may be a dead leaf now."""
        if parent.parent is not None:
            self.trims.mark_up(parent)
        return self._drop_dead_leaves(parent)

    # -- HiCache ---------------------------------------------------------------------------------------
    def _loading_chain(self, node: TreeNode) -> list[TreeNode]:
        chain = []
        while node.parent is not None and node.loading:
            chain.append(node)
            node = node.parent
        return chain

    def build_hicache_transfers(self, node: TreeNode, phase: HiCachePhase) -> tuple[ComponentTransfer, ...]:
        if not isinstance(phase, HiCachePhase):
            raise TypeError(f"phase must be a HiCachePhase, got {phase!r}")
        if phase is HiCachePhase.BACKUP:
            st = self._state(node)
            if node.parent is None or node.device_pages is None or node.loading or st.host_slots is not None:
                return ()
            k = min(self._live_tail(node) // self.page_size, self.window_pages)
            if k == 0:
                return ()
            src = self.mapped.swa_of[node.device_pages[-k:]].copy()
            return (ComponentTransfer(self.name, phase, node.id, src, None, k * self.page_size),)
        window = {n.id for n in self.window_nodes(node)} if node.parent is not None else set()
        out = []
        for n in reversed(self._loading_chain(node)):
            host, pages = self._state(n).host_slots, n.device_pages
            if n.id in window and host is not None and pages is not None:  # (a loading node has its pages)
                k = host.shape[0]
                dst = self.mapped.swa_of[pages[-k:]].copy()
                if (dst >= 0).all():
                    out.append(ComponentTransfer(self.name, phase, n.id, host.copy(), dst, k * self.page_size))
        return tuple(out)

    def commit_hicache_transfer(
        self, node: TreeNode, phase: HiCachePhase, transfers: Sequence[ComponentTransfer], ok: bool = True
    ) -> None:
        for t in transfers:
            if t.component != self.name or t.phase is not phase:
                raise ValueError(f"transfer for {t.component}/{t.phase.value} given to swa/{phase.value}")
            if ok and t.dst is None:
                raise ValueError(f"swa transfer for node {t.node_id} has no destination ids")
        if not ok:
            return  # BACKUP: nothing recorded; LOAD_BACK: the controller drops the chain's pages
        covers = [self._covered(t) for t in transfers]  # (all checked before any is recorded)
        if phase is HiCachePhase.BACKUP:
            for t, cover in zip(transfers, covers):
                dst = np.asarray(t.dst, dtype=np.int32)
                end = dst.shape[0]
                for n, k in cover:
                    self._state(n).host_slots = dst[end - k : end].copy()
                    end -= k
            return
        # Contract: called before the controller clears ``loading`` on the chain.
        restored = {n.id: k for cover in covers for n, k in cover}
        self.trims.mark_up(node)  # no longer kept whole for the load
        for n in self._loading_chain(node):
            self.trims.mark(n)
            pages = n.device_pages
            assert pages is not None  # a loading node has its pages attached
            head = pages.shape[0] - restored.get(n.id, 0)
            if head:  # outside the window or no host SWA copy: full KV only there (a tombstoned head)
                self.mapped.unmap(pages[:head].astype(np.intp))

    def _covered(self, t: ComponentTransfer) -> list[tuple[TreeNode, int]]:
        """``(node, pages)`` for the nodes whose last pages ``t`` moved, deepest first: its node, and the
        prefixes a split cut off it since ``build_hicache_transfers`` (they lie right above it; the copy
        keeps them locked); the topmost may be covered in part (a host tail)."""
        n = self.tree.node(t.node_id)
        left = t.src.shape[0]
        out = []
        while left > 0 and n.parent is not None and n.device_pages is not None:
            k = min(left, n.device_pages.shape[0])
            out.append((n, k))
            left -= k
            n = n.parent
        if left:
            raise ValueError(f"swa {t.phase.value} of node {t.node_id}: {t.src.shape[0]} pages do not end a run of "
                             "nodes in L1 there")
        return out

    def drive_host_eviction(self, num_tokens: int, tracker: HostEvictionTracker) -> int:
        if not isinstance(num_tokens, (int, np.integer)) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        victims = []
        for node in self.tree.iter_nodes():
            data = node.component_data
            st = data.get("swa") if data else None
            if st is not None and st.host_slots is not None and not tracker.pinned(node.id):
                victims.append((node.last_access, node.id, node, st))
        victims.sort(key=lambda v: (v[0], v[1]))
        freed = 0
        for _, _, node, st in victims:
            if freed >= num_tokens:
                break
            tokens = st.host_slots.shape[0] * self.page_size
            tracker.release(self.name, node.id, st.host_slots, tokens)
            st.host_slots = None
            freed += tokens
        return freed

    def host_copy(self, node: TreeNode) -> np.ndarray | None:
        return self._state(node).host_slots

    def adopt_host_copy(self, node: TreeNode, host_ids: np.ndarray) -> None:
        st = self._state(node)
        k = np.shape(host_ids)[0] if np.ndim(host_ids) == 1 else 0
        if not 0 < k <= min(self.window_pages, node.num_tokens // self.page_size) or st.host_slots is not None:
            raise ValueError(f"node {node.id}: an SWA host tail is 1..{self.window_pages} of its pages, got {host_ids!r}")
        st.host_slots = np.asarray(host_ids, dtype=np.int32).copy()

    def host_copies(self) -> list[np.ndarray]:
        """The host ids of every SWA host copy in the tree (host tier checks)."""
        out = []
        for node in self.tree.iter_nodes():
            data = node.component_data
            st = data.get("swa") if data else None
            if st is not None and st.host_slots is not None:
                out.append(st.host_slots)
        return out

    # -- checks and reporting ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        mapped, swa = self.mapped, self.allocator
        owners = mapped.owners(np.arange(mapped.capacity))
        swa_of = np.where(owners == PageOwner.FREE, -1, mapped.swa_of)  # a free page's entry is stale
        sp = swa_of[swa_of >= 0]
        assert np.unique(sp).size == sp.size, "an SWA page is mapped from two full pages"
        for owner in (PageOwner.REQUEST, PageOwner.TREE):
            mine = swa_of[(owners == owner) & (swa_of >= 0)]
            assert (swa.owners(mine) == owner).all(), f"SWA page owner disagrees with its {owner.name} full page"
            assert mine.size == swa.count(owner), f"{owner.name} SWA pages leaked"
        assert swa.num_free == swa.count(PageOwner.FREE)
        free = swa.free_pages()
        assert np.unique(free).size == free.size, "an SWA page is on the free stack twice"
        assert np.intersect1d(free, sp).size == 0, "an SWA page is both free and mapped"
        assert free.size + sp.size == swa.capacity, "an SWA page is neither free nor mapped (leaked)"
        assert (swa_of[mapped.spare_pages()] >= 0).all(), "a spare page maps no SWA page"
        for node in self.tree.iter_nodes():
            st = self._state(node)
            assert st.lock >= 0 and st.lock <= node.lock_ref, f"{node}: SWA lock {st.lock} outside the Full lock"
            assert st.bounds is None or (sum(st.bounds.values()) <= st.lock and all(st.bounds.values()))
            assert st.end < 0 or st.end == self.tree.depth(node), f"{node}: cached end {st.end} is stale"
            if node.device_pages is not None:
                live = swa_of[node.device_pages] >= 0
                assert not (live[:-1] & ~live[1:]).any(), f"{node}: a live SWA page before a tombstoned one"

    def stats(self) -> dict[str, Any]:
        live = tomb = 0
        for node in self.tree.iter_nodes():
            if node.device_pages is not None:
                if self.has_live(node):
                    live += 1
                else:
                    tomb += 1
        a = self.allocator
        return {
            "swa": SWAStats(
                self.window, a.capacity, a.num_free, a.count(PageOwner.TREE), a.count(PageOwner.REQUEST),
                tomb, live, self.evicted_tokens,
            )
        }

    def reset(self) -> None:
        self.allocator.reset()
        self.queue.clear()
        self.trims.clear()
        self.evicted_tokens = 0
        self.released_host_copies = []
