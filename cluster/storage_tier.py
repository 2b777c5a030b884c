"""L3 policy on the head: L2->L3 backups after D->H acks, L3->L2 prefetch, the manifest.

Runs inside the head (one per replica). Keys are the storage chain keys of each page (namespace =
model fingerprint + ``extra_key`` + ``cache_salt``), cached per node as the key of its last page.
Workers hold the storage clients (one per host, over that host's shard) and execute the ops; the
head asks them for existence (MIN over hosts) and never touches bytes.

- Backup: when a chain of nodes is committed to L2, the pages from the first not-yet-stored page on
  the path (rounded down to an object boundary) go to L3 in one op; the nodes are host-pinned until
  every host acked; then they are marked ``stored`` and the path is queued for the manifest. Pending
  backups are capped (``max_inflight_backup_pages``); beyond, backups are skipped and counted.
- Manifest (warm restart): off the hot path. Stored paths are coalesced (a path replaces its queued
  ancestors) and written by a background thread at most every ``manifest_interval_s``, and fully on
  ``flush_manifest()`` / detach, so ``list_prefixes`` finds every stored prefix after a flush.
- Warm restart: on attach (start, runtime attach, reset, head restart all attach through here) the
  manifest of every namespace the tree has a root for (the default one at least) is read in the
  background (``Availability`` below: attach returns at once), longest prefixes first, into
  storage-only tree entries (``tree.storage_only``; no L1 pages, no L2 slots),
  at most ``warm_restart_max_tokens`` tokens (also their cap afterwards; 0: off). Matches report them
  as ``storage_hit_len``; a prefetch covered by whole objects of them skips the existence query,
  still reads with checksums, turns them into host-only nodes, and on a failed read drops them.
  Detach drops them all.
- Write hold (``pause_writes``/``resume_writes``, the serving loop's calls): while a prefill is
  next or running, new L2->L3 writes wait here (pinned, bounded by ``max_inflight_backup_pages``
  and ``write_hold_max_s``), so their CPU (file creation, checksum, the GIL) lands in decodes, not
  in a request's TTFT; a due manifest write waits for the resume too, and a manifest write already
  running stops between entries while a hold is on (up to what is left of that hold's bound: a
  few hundred entries take the manifest thread hundreds of ms, over many requests' prefills). Reads are never held; a
  detach drops held writes (later misses, never data).
- Prefetch: for a queued request, the pages after its matched prefix that L3 has (prefix-ordered,
  all hosts) are fetched into fresh L2 slots below the deepest matched node (pinned meanwhile). When
  every host acked, they become one host-only node; a request then loads them back like any L2 hit.
  Two steps, neither on the head's thread: the existence query (MIN over hosts) runs on a small
  thread pool (``hicache-l3-query``) and its answer is applied by ``advance`` at the head's next
  call (``check_events`` every scheduler step, a prefetch check); if L3 holds enough, the fetch is
  queued then, with L2 slots reserved for exactly what was found. So no head call does storage I/O:
  an arrival's query overlaps the request's wait in the queue, and a slow or hung L3 holds no one.
  The one exception is a local disk in this process (``WorkerGroup.storage_local``): its query is a
  few stat calls, answered in the head call that asks it, cheaper than the hand-off.
  Stop policies decide how long ``check_prefetch_progress`` lets a request wait: for an unanswered
  query at most ``query_wait_max_s`` (``begin_request`` waits that long in its own call, so a miss
  still starts a request in one head call), then for the fetch. The existence
  query carries the prefetch minimum in pages (``prefetch_min_tokens``): storage leaves out the
  objects that could only make a shorter hit (a miss asks fewer names; a hit is found as before).
  A miss (too little in
  L3) is remembered for ``negative_cache_ttl_s`` in a bounded LRU keyed by the chain key of the
  first page after the matched prefix, so repeated misses skip the existence lookup; a remembered
  miss is dropped early when this head stores that page. Hits are never cached: a prefetch always
  asks storage. A miss of the very first candidate page is checked once more, in the same query
  thread right after the query's own answer, under ``previous_fingerprints`` (the object holding that
  page): found there, the miss (and its remembered entry) reads "fingerprint differs" instead of "never
  cached". A request waits for that check only while it would wait for its query; past that it goes on
  as a plain miss and the remembered entry takes the check's answer when it comes.
  The match may end on a node with no L2 copy yet (L1 only, or its L1->L2 copy in flight): L3 is asked
  all the same. When the fetch starts, that node's L1->L2 copy is started unless one is on its way
  (``back_up``, the controller's); a fetch acked before the copy is parked and its pages hang below the
  node at the copy's ack (``on_host_committed``), so L2 copies stay a chain from the root.
- Availability (L3 on a failing network): the workers' storage clients keep a breaker per location
  (``FsspecStorage.breaker``); before every L3 query the head asks their worst state
  (``WorkerGroup.storage_breaker_state``, no storage I/O). Not closed: the query is skipped at once,
  its tokens count as misses with reason ``l3_unavailable`` (the controller moves them there), and
  when the cooldown has passed (``half_open``) one background probe (``storage_probe``) runs off the
  request path, so no request is ever the probe. A warm restart that found L3 unreachable stays due
  and runs again in the background once the breaker is closed. The background thread
  (``hicache-l3-attach``: probe, then manifest listing) touches no tree state: the head applies its
  result at its next call into this tier (``_poll_background``), so the tree stays single-threaded.
  A request waits on its prefetch at most ``prefetch_wait_max_s`` under every stop policy (the
  existence query itself ends by the storage's ``exists_timeout_s``).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from hicache.cluster.component_host import ComponentHostPool
from hicache.cluster.cost_model import CostModel, CostOptions, PendingFetch
from hicache.cluster.host_tier import HostTier
from hicache.cluster.inflight import PendingTransfer
from hicache.cluster.storage_components import ComponentObjects, FetchParts, servable_end
from hicache.cluster.tree import RadixKey, RadixTree, TreeNode
from hicache.cluster.worker_group import WorkerGroup
from hicache.storage import ChainKeys, ModelFingerprint, Namespace, StorageConfig, page_keys
from hicache.workers.plan import OpKind, TransferOp
from hicache.workers.storage_exec import StorageAttachment
from hicache.workers.worker import run_now

L3_UNAVAILABLE = "L3 unavailable"  # PrefetchProgress.reason: L3 down (query skipped, unanswered, or fetch failed)
COST_SKIPPED = "skipped by the cost model"  # PrefetchProgress.reason: recomputing the pages found is faster
FINGERPRINT_DIFFERS = "L3 holds it under a previous fingerprint"  # PrefetchProgress.reason (previous_fingerprints)
NOT_ENOUGH = "not enough pages in L3"  # PrefetchProgress.reason: L3 answered, short of prefetch_min_tokens
NO_ANCHOR_COPY = "matched prefix has no L2 copy to hang fetched pages below"  # its L1->L2 copy could not start
VALUES_MISSING = "L3 lacks a component's values (SWA window / Mamba state) at every end of what it holds"
_QUERY_THREADS = 4  # existence queries in flight at once (each ends by the storage's existence deadline)
_QUERY_SLACK_S = 1.0  # past the storage's existence deadline, an unanswered query is a miss


class PrefetchPolicy(str, Enum):
    BEST_EFFORT = "best_effort"  # never wait: use whatever arrived
    WAIT_COMPLETE = "wait_complete"  # wait until the prefetch finished (bounded by the ack timeout)
    TIMEOUT = "timeout"  # wait up to min(max_s, base_s + per_1k_s * tokens / 1000)


@dataclass(frozen=True)
class StorageParams:
    url: str
    fingerprint: ModelFingerprint
    prefetch_policy: PrefetchPolicy | str = PrefetchPolicy.TIMEOUT
    prefetch_min_tokens: int = 256
    prefetch_timeout_base_s: float = 0.5
    prefetch_timeout_per_1k_s: float = 0.25
    prefetch_timeout_max_s: float = 5.0
    max_inflight_prefetch_pages: int = 8192
    max_inflight_backup_pages: int = 8192
    storage: StorageConfig = field(default_factory=StorageConfig)
    pages_per_object: int | None = None
    negative_cache_ttl_s: float = 1.0  # remember an L3 miss this long (0: off)
    negative_cache_size: int = 4096  # LRU bound on remembered misses
    manifest_interval_s: float = 2.0  # write queued manifest entries at most this often (background)
    warm_restart_max_tokens: int = 1 << 20  # storage-only tree entries read from the manifest (0: off)
    write_hold_max_s: float = 0.5  # pause_writes() holds L2->L3 writes at most this long (0: never holds)
    prefetch_wait_max_s: float = 0.5  # a request waits on its prefetch at most this long, under any policy
    # a request waits on its prefetch's unanswered existence query at most this long, under any policy, and
    # at most the cost model's wait bound for the candidate pages once it has measured a prefill and either a
    # fetch or a query that outlived this wait (the query goes on: what it finds is still fetched into L2)
    query_wait_max_s: float = 0.05
    cost: CostOptions = field(default_factory=CostOptions)  # load or recompute (``hicache.cluster.cost_model``)
    # fingerprints this model's KV was stored under before (an earlier model version, another dtype): on an L3
    # miss, one existence check of the first missing page under them tells "fingerprint differs" from "never
    # cached" (off the head's thread, remembered with the miss; never loaded). Same page size, shard layout
    # and pages_per_object as ``fingerprint``; others are never found.
    previous_fingerprints: tuple[ModelFingerprint, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or "://" not in self.url:
            raise ValueError(f"url must be a fsspec URL like file:///path, memory://x or gs://bucket, got {self.url!r}")
        if not isinstance(self.fingerprint, ModelFingerprint):
            raise TypeError(f"fingerprint must be a ModelFingerprint, got {type(self.fingerprint).__name__}")
        try:
            object.__setattr__(self, "prefetch_policy", PrefetchPolicy(self.prefetch_policy))
        except ValueError:
            raise ValueError(f"unknown prefetch policy {self.prefetch_policy!r}; "
                             f"choose one of {[p.value for p in PrefetchPolicy]}") from None
        for name in ("prefetch_min_tokens", "max_inflight_prefetch_pages", "max_inflight_backup_pages",
                     "negative_cache_size", "warm_restart_max_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("prefetch_timeout_base_s", "prefetch_timeout_per_1k_s", "prefetch_timeout_max_s",
                     "negative_cache_ttl_s", "manifest_interval_s", "write_hold_max_s", "prefetch_wait_max_s",
                     "query_wait_max_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not isinstance(self.cost, CostOptions):
            raise TypeError(f"cost must be a CostOptions, got {type(self.cost).__name__}")
        if isinstance(self.previous_fingerprints, ModelFingerprint) or not isinstance(
                self.previous_fingerprints, (tuple, list)):
            raise TypeError(f"previous_fingerprints must be a tuple of ModelFingerprint, got {self.previous_fingerprints!r}")
        previous = tuple(self.previous_fingerprints)
        for fp in previous:
            if not isinstance(fp, ModelFingerprint):
                raise TypeError(f"previous_fingerprints must hold ModelFingerprints, got {fp!r}")
            if fp == self.fingerprint or fp.page_size != self.fingerprint.page_size:
                raise ValueError(f"previous_fingerprints: {fp!r} is the fingerprint itself or has another page size")
        object.__setattr__(self, "previous_fingerprints", previous)

    def attachment(self) -> StorageAttachment:
        return StorageAttachment(self.url, self.fingerprint, self.storage, self.pages_per_object)

    def prefetch_timeout_s(self, tokens: int) -> float:
        return min(self.prefetch_timeout_max_s,
                   self.prefetch_timeout_base_s + self.prefetch_timeout_per_1k_s * tokens / 1000)


@dataclass(frozen=True, eq=False)
class PrefetchParams:
    req_id: str
    key: RadixKey
    node_id: int  # MatchResult.best_match_node: fetched pages hang below it


class PrefetchState(str, Enum):
    NOT_STARTED = "not_started"  # nothing worth fetching (or no storage attached)
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


@dataclass(slots=True)
class PrefetchProgress:
    """One per L3 query: slotted, not frozen (a frozen dataclass's __init__ costs more)."""

    req_id: str
    state: PrefetchState
    tokens: int  # tokens fetched (DONE) or being fetched (RUNNING)
    may_proceed: bool  # the stop policy lets the request go on now
    reason: str = ""


@dataclass
class _Prefetch:
    req_id: str
    anchor: TreeNode  # host-pinned from the query's start to the fetch's ack
    tokens: np.ndarray  # i32[n * page_size]: the candidate pages' tokens, then the fetched pages'
    keys: Sequence[str]  # the candidates' chain keys (lazy ChainKeys), then the fetched pages'
    first_page: int  # chain index of keys[0]
    started: float
    wait_until: float  # no request waits past this (prefetch_wait_max_s)
    query: cf.Future | None = None  # the existence query in flight (None: answered, or none needed)
    base: int = 0  # leading candidate pages known stored without asking (whole objects of storage-only entries)
    query_until: float = 0.0  # no request waits on the unanswered query past this (query_wait_max_s)
    op_id: int = -1  # the fetch's op, once the query answered (-1: not sent)
    slots: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    deadline: float = 0.0  # the TIMEOUT policy's, set when the fetch starts
    fetch_started: float = 0.0  # monotonic time the fetch was queued (its age bounds L3's speed: ``_pending_fetch``)
    state: PrefetchState = PrefetchState.RUNNING
    reason: str = ""  # why nothing was fetched (NOT_STARTED after the query)
    queued: bool = False  # started when its request entered the queue (``prefetch``), not at its start
    # on a miss from the first candidate page: whether L3 holds it under a previous fingerprint (query thread)
    elsewhere: Callable[[], bool] | None = None
    elsewhere_answer: cf.Future | None = None  # its answer (set after the query's own: a miss is known first)
    # first_page inside an L3 object's chunk: the key of that chunk's first page (the leading-page index's folder)
    chunk_key: str | None = None
    # hybrid trees: per component pool, which candidate pages L3 holds its objects of (set by the query thread)
    value_flags: dict[str, list[bool]] = field(default_factory=dict)
    values: FetchParts | None = None  # the component values the fetch brings (their L2 ids reserved)


@dataclass
class _Backup:
    op_id: int
    pinned: list[TreeNode]
    last: TreeNode
    num_pages: int
    keys: tuple[str, ...] = ()
    values: list[tuple[str, str, int]] = field(default_factory=list)  # component values it stores (by name)


@dataclass
class StorageCounters:
    backup_pages: int = 0
    backup_skipped_pages: int = 0  # over the in-flight cap
    backup_failures: int = 0
    prefetch_started: int = 0  # fetches sent (after an existence query found enough, or on storage-only entries)
    l3_queries: int = 0  # existence queries started (off the head's thread)
    query_waits_expired: int = 0  # requests that stopped waiting on an unanswered existence query
    prefetch_pages: int = 0
    prefetch_failures: int = 0
    prefetch_redundant_pages: int = 0  # arrived but the tree already had those tokens
    prefetch_negative_hits: int = 0  # existence lookups skipped: a recent miss for the same page
    manifest_records: int = 0  # manifest entries written
    manifest_hold_waits: int = 0  # manifest entries that waited for a write hold to end (a prefill's first token)
    manifest_coalesced: int = 0  # queued entries replaced by a longer stored path before a write
    warm_restart_prefixes: int = 0  # manifest entries turned into storage-only tree entries on attach
    warm_restart_tokens: int = 0  # tokens those entries added
    warm_restart_failures: int = 0  # namespaces whose manifest could not be listed
    prefetch_known_stored: int = 0  # prefetches sized by storage-only entries (no existence lookup)
    storage_only_dropped_tokens: int = 0  # storage-only entries dropped after a failed read
    backup_held_ops: int = 0  # L2->L3 writes held by pause_writes() until resume_writes() (or the bound)
    backup_held_dropped_pages: int = 0  # held writes dropped on detach (never sent: later misses)
    unavailable_skips: int = 0  # L3 queries skipped: the hosts' storage breaker was not closed
    probes: int = 0  # background probes of an unavailable L3 started
    cost_skips: int = 0  # fetches not sent: the cost model expected recompute to be faster
    cost_skipped_pages: int = 0  # pages L3 held that those skips left to recompute
    cost_partial: int = 0  # fetches cut to a leading part (the rest would be back after the request's wait)
    cost_explored: int = 0  # fetches sent although the model said recompute (``CostOptions.explore_every``)
    prefetch_parked: int = 0  # fetches acked before their anchor's L2 copy: held until that copy's ack

    def snapshot(self) -> dict:
        return dataclasses.asdict(self)


def _stored_elsewhere(exists: Callable[..., int], fingerprints: tuple[ModelFingerprint, ...], extra_key: str | None,
                      cache_salt: str | None, tokens: np.ndarray, first: int) -> bool:
    """Whether L3 holds page ``first`` of ``tokens`` (whole pages up to the end of that page's object) under
    one of ``fingerprints``: one existence check each, keys in that fingerprint's namespace. Runs on the query
    thread after a miss; a diagnostic only, so storage trouble is a no."""
    for fp in fingerprints:
        try:
            keys = ChainKeys(Namespace(fp, extra_key, cache_salt), tokens)[first:]
            if exists(keys, first, 1, fp) > 0:
                return True
        except Exception:
            continue
    return False


def _with_values(exists: Callable[..., int], values: ComponentObjects, exists_each: Callable[..., list[bool]],
                 candidates: Sequence[str], base: int, least: int, into: dict[str, list[bool]],
                 keys: Sequence[str], first: int, min_pages: int) -> int:
    """``exists`` (the Full pages past ``base`` of ``candidates``), then cut to the last end where every
    component's objects are there (``ComponentObjects.query``; runs on the query thread)."""
    found = base + int(exists(keys, first, min_pages))
    return values.query(exists_each, candidates, found, least, into) - base


class StorageTier:
    def __init__(self, tree: RadixTree, host: HostTier, workers: WorkerGroup, params: StorageParams,
                 queue_op: Callable[[TransferOp, list[TreeNode]], PendingTransfer], op_ids: itertools.count,
                 back_up: Callable[[TreeNode], bool] | None = None,
                 component_hosts: Mapping[str, ComponentHostPool] | None = None) -> None:
        """``back_up``: starts the L1 -> L2 copy of a node and its ancestors without one (the controller's);
        a fetch below a match that ends on an L1-only node asks it (its pages hang below that node's L2
        copy). None: such a fetch is not sent. ``component_hosts``: a hybrid tree's component L2 pools (the
        controller's): their values go to L3 and come back with the Full pages (``storage_components``)."""
        if params.fingerprint.page_size != tree.page_size:
            raise ValueError(f"fingerprint page_size {params.fingerprint.page_size} != tree page_size {tree.page_size}")
        self.tree, self.host, self.workers, self.params = tree, host, workers, params
        self._queue_op = queue_op
        self._op_ids = op_ids
        self._back_up = back_up
        self._parked: list[_Prefetch] = []  # fetched, waiting for their anchor's L2 copy (``_settle_parked``)
        self.counters = StorageCounters()
        self.values = ComponentObjects(component_hosts or {}, tree.page_size)
        if tree.extra_components and any(c.l3_value_pages > 0 and c.name not in (component_hosts or {})
                                         for c in tree.extra_components):
            raise ValueError("an L3 of a hybrid tree needs an L2 for every component: its values reach L3 from L2")
        self.cost = CostModel(params.cost)
        self._backups: dict[int, _Backup] = {}
        self._prefetches: dict[int, _Prefetch] = {}  # op_id -> task
        self._by_req: dict[str, _Prefetch] = {}
        self._inflight_backup_pages = 0
        self._inflight_prefetch_pages = 0
        self._misses: OrderedDict[str, tuple[float, str]] = OrderedDict()  # first-page chain key -> (expiry, reason)
        # remembered misses whose previous-fingerprint check answers after their request went on
        self._late_reasons: list[tuple[str, cf.Future]] = []
        self._querying: list[_Prefetch] = []  # prefetches whose existence query is unanswered, in start order
        self._query_pool: cf.ThreadPoolExecutor | None = None
        # an unanswered query past this is a miss (the storage's own deadline ends it; the slack covers the hop)
        self._query_deadline_s = params.storage.exists_timeout_s + _QUERY_SLACK_S
        # fewest pages a prefetch fetches (prefetch_min_tokens): an L3 query leaves out objects that
        # could only make a shorter hit (on a miss, fewer existence checks)
        self._exists_min_pages = max(1, -(-params.prefetch_min_tokens // tree.page_size))
        self._manifest: dict[int, tuple[Namespace, np.ndarray]] = {}  # node id -> queued entry
        self._manifest_next = 0.0  # monotonic time of the next background write
        self._manifest_thread: cf.ThreadPoolExecutor | None = None
        self._manifest_job: cf.Future | None = None
        self._held: list[TransferOp] = []  # L2->L3 writes held by pause_writes(), in queue order
        self._paused_at: float | None = None  # monotonic start of the current pause (None: not paused)
        self._writes_open = threading.Event()  # clear while a pause is on: the manifest thread waits on it
        self._writes_open.set()
        # A pause clears the event only while a manifest write is submitted and not done (nothing else waits
        # on it, and none starts during a pause but a flush's, which opens it): an idle pause takes no lock.
        self._manifest_jobs: list[None] = []  # one entry per manifest write submitted and not done (append
        # on the head thread, pop by the job as it ends: both atomic)
        self._gate_closed = False  # this tier cleared ``_writes_open`` (the resume sets it again)
        self._stopped = threading.Event()  # detached: background work ends at its next step
        self._bg: cf.ThreadPoolExecutor | None = None  # probe + manifest listing (module docstring)
        self._bg_job: cf.Future | None = None
        self._bg_lists = False  # the running job lists the manifest (else: a probe only)
        workers.attach_storage(params.attachment())  # builds clients (no storage I/O)
        self.pages_per_object = workers.storage_pages_per_object()
        tree.storage_only.cap_tokens = params.warm_restart_max_tokens
        tree.storage_only.trim()
        self._warm_due = bool(tree.storage_only.cap_tokens)  # a warm restart is still to be done
        if self._warm_due:
            self._start_background(probe=True)

    # -- background: probe, warm restart -----------------------------------------------------------------
    def _start_background(self, *, probe: bool) -> None:
        """Starts the background job unless one runs: a probe of every host's client (``probe``), then,
        if a warm restart is due and L3 answered, the manifest listing of every namespace the tree has
        a root for now. Its result is applied by ``_poll_background`` on the head's thread."""
        if self._bg_job is not None or self._stopped.is_set():
            return
        namespaces = [Namespace(self.params.fingerprint, ek, salt) for ek, salt in self.tree.roots()] if self._warm_due else []
        if not probe and not namespaces:
            return
        workers, stopped = self.workers, self._stopped

        def job() -> list | None:  # None: L3 did not answer
            if probe and not workers.storage_probe():
                return None
            out = []
            for ns in namespaces:
                if stopped.is_set():
                    return None
                out.append((ns, workers.storage_list_prefixes(ns)))  # bounded by list_timeout_s
            return out

        if self._bg is None:
            self._bg = cf.ThreadPoolExecutor(1, thread_name_prefix="hicache-l3-attach")
        self._bg_lists = bool(namespaces)
        if probe:
            self.counters.probes += 1
        self._bg_job = self._bg.submit(job)

    def _poll_background(self) -> None:
        """Applies a finished background job (head thread): storage-only entries of a warm restart."""
        job = self._bg_job
        if job is None or not job.done():
            return
        self._bg_job = None
        try:
            result = job.result()
        except Exception:  # an outage while listing: still due, tried again once L3 answers
            result = None
        if not self._bg_lists:
            return
        if result is None:
            self.counters.warm_restart_failures += 1
            return
        self._warm_due = False
        self._warm_restart(result)

    def settle(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for the background job (attach's warm restart, a probe) and the
        existence queries, and applies them; True if none is left running. For callers that want them
        done before they go on (tests, a benchmark's setup); serving never waits on them."""
        jobs = [f for t in self._querying for f in (t.query, t.elsewhere_answer) if f is not None]
        if self._bg_job is not None:
            jobs.append(self._bg_job)
        if jobs:
            cf.wait(jobs, timeout=timeout_s)
        self._poll_background()
        self.advance()
        return self._bg_job is None and not self._querying

    @property
    def warm_restart_due(self) -> bool:
        """A warm restart has not run yet (L3 has not answered since attach)."""
        return self._warm_due

    def _available(self) -> bool:
        """Whether an L3 query may go to storage now: the hosts' breakers are closed. Otherwise, once the
        cooldown has passed, starts a background probe (no request is the probe). With L3 up, a warm
        restart still due starts in the background."""
        self._poll_background()
        state = self.workers.storage_breaker_state()
        if state == "closed":
            if self._warm_due:
                self._start_background(probe=True)
            return True
        if state == "half_open":
            self._start_background(probe=True)
        return False

    def _warm_restart(self, listed: list) -> None:
        """Storage-only tree entries from the manifest listings (``(namespace, prefixes)``; bounded),
        below each namespace's root as the tree has it now."""
        entries = self.tree.storage_only
        roots = self.tree.roots()
        for ns, prefixes in listed:
            root = roots.get((ns.extra_key, ns.cache_salt))
            if root is None:  # the namespace's root went (idle) meanwhile: its entries wait for no one
                continue
            if entries.tokens >= entries.cap_tokens:
                return
            for sp in prefixes:  # longest first
                added = entries.add_path(root, np.asarray(sp.tokens, dtype=np.int32), tuple(sp.keys))
                if added:
                    self.counters.warm_restart_prefixes += 1
                    self.counters.warm_restart_tokens += added
                if entries.tokens >= entries.cap_tokens:
                    return

    # -- keys --------------------------------------------------------------------------------------
    def _namespace(self, node: TreeNode) -> Namespace:
        extra_key, salt = self.tree.namespace_of(node)
        return Namespace(self.params.fingerprint, extra_key, salt)

    def _path(self, node: TreeNode) -> list[TreeNode]:
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        return path[::-1]

    def _page_keys(self, path: list[TreeNode], ns: Namespace, from_page: int) -> list[str]:
        """Chain keys of pages [from_page, end of path), filling nodes' cached last-page keys."""
        ps = self.tree.page_size
        out: list[str] = []
        prev: str | None = None
        page = 0
        for node in path:
            n = node.num_tokens // ps
            if node.chain_key is not None and page + n <= from_page:
                prev = node.chain_key
            else:
                keys = page_keys(ns, node.key, parent=prev)
                node.chain_key = keys[-1]
                prev = keys[-1]
                lo = max(0, from_page - page)
                out += keys[lo:]
            page += n
        return out

    def _page_key(self, path: list[TreeNode], ns: Namespace, page: int) -> str:
        """Chain key of page ``page`` of ``path``, whose nodes' last-page keys are cached (``_page_keys``):
        only the pages of its node up to it are hashed."""
        ps = self.tree.page_size
        prev, at = None, 0
        for node in path:
            n = node.num_tokens // ps
            if page < at + n:
                return node.chain_key if page == at + n - 1 and node.chain_key else ChainKeys(
                    ns, node.key[: (page - at + 1) * ps], parent=prev)[page - at]
            prev, at = node.chain_key, at + n
        raise ValueError(f"page {page} is past the path's {at} pages")

    # -- L2 -> L3 backups ----------------------------------------------------------------------------
    def on_host_committed(self, nodes: list[TreeNode]) -> None:
        """A chain of nodes just got its L2 copy: store what L3 does not have yet; fetches parked below one
        of them hang their pages below it now."""
        self._back_up_to_l3(nodes)
        self._settle_parked()

    def _back_up_to_l3(self, nodes: list[TreeNode]) -> None:
        last = nodes[-1]
        if last.parent is None or last.host_slots is None:
            return
        path = self._path(last)
        ps, C = self.tree.page_size, self.pages_per_object
        first_new, page = None, 0
        for node in path:
            if not node.stored and first_new is None:
                first_new = page
            page += node.num_tokens // ps
        if first_new is None and not self.values:
            return
        start = page if first_new is None else first_new - first_new % C
        pinned, slots, page = [], [], 0
        for node in path:
            n = node.num_tokens // ps
            if page + n > start:
                if node.host_slots is None:
                    return  # chain broken (cannot happen while backups stay contiguous)
                lo = max(0, start - page)
                slots.append(node.host_slots[lo:])
                pinned.append(node)
            page += n
        num_pages = page - start
        if self._inflight_backup_pages + num_pages > self.params.max_inflight_backup_pages:
            self.counters.backup_skipped_pages += num_pages
            return
        ns = self._namespace(last)
        keys = self._page_keys(path, ns, start) if num_pages else []
        parts: list = []
        names: list = []
        if self.values:  # a hybrid tree: the host copies of its components' values on the path go too
            parts, held, names = self.values.backup(path, lambda p: self._page_keys(path, ns, p))
            pinned += [n for n in held if all(n is not m for m in pinned)]
            if not parts and not num_pages:
                return
        op = TransferOp(next(self._op_ids), OpKind.BACKUP_H2S, np.empty(0, np.int32),
                        np.concatenate(slots) if slots else np.empty(0, np.int32), tuple(keys), first_page=start,
                        storage_parts=tuple(parts))
        for node in pinned:
            node.host_pin += 1
        self._backups[op.op_id] = _Backup(op.op_id, pinned, last, num_pages, tuple(keys), names)
        self._inflight_backup_pages += num_pages
        if self._holding():
            self._held.append(op)
            self.counters.backup_held_ops += 1
        else:
            self._queue_op(op, [])

    # -- write hold (the serving loop's latency-critical window) ------------------------------------
    def pause_writes(self) -> None:
        """Host CPU becomes latency-critical: a prefill is next (a request's work up to its first
        token: L3 query, load-back, prefill). A serving loop pauses at the end of a decode when a
        request waits (that decode's ``cache_finished_req`` queues its writes) or before the next
        request's match, and resumes once that request's first token is out, so L2->L3 writes run
        during decodes, not prefills. L2->L3 writes queued from now on are held here, not sent:
        their nodes stay host-pinned and count against ``max_inflight_backup_pages`` (beyond it
        backups are skipped, as always). ``resume_writes()`` sends them; a pause also ends by itself
        ``write_hold_max_s`` after it began (at the next call into this tier), so a loop that never
        resumes delays writes, never stops them. Reads (prefetches) are never held. Writes already
        sent run on; a manifest write in progress stops before its next entry until the resume (or
        the bound). Idempotent; a pause in progress keeps its start time."""
        if self._paused_at is None and self.params.write_hold_max_s > 0:
            self._paused_at = time.monotonic()
            if self._manifest_jobs:
                self._gate_closed = True
                self._writes_open.clear()

    def resume_writes(self) -> int:
        """Ends the pause: held writes are queued in their order (the caller's controller sends them
        with its next plan). Returns how many were held."""
        self._paused_at = None
        if self._gate_closed:
            self._gate_closed = False
            self._writes_open.set()
        held, self._held = self._held, []
        for op in held:
            self._queue_op(op, [])
        self._maybe_write_manifest()
        return len(held)

    @property
    def writes_paused(self) -> bool:
        return self._paused_at is not None

    def _holding(self) -> bool:
        """Whether a write queued now is held (an expired pause ends first, its writes go first)."""
        self._expire_pause()
        return self._paused_at is not None

    def _hold_left_s(self) -> float:
        """How much longer the current pause may hold writes (0.0: none on, or past its bound). Read by
        the manifest thread (one attribute read)."""
        at = self._paused_at
        return 0.0 if at is None else max(0.0, at + self.params.write_hold_max_s - time.monotonic())

    def _expire_pause(self) -> None:
        if self._paused_at is not None and time.monotonic() - self._paused_at >= self.params.write_hold_max_s:
            self.resume_writes()

    # -- L3 -> L2 prefetch ---------------------------------------------------------------------------
    def prefetch(self, params: PrefetchParams) -> PrefetchProgress:
        if not isinstance(params, PrefetchParams):
            raise TypeError(f"prefetch_from_storage expects PrefetchParams, got {type(params).__name__}")
        if not isinstance(params.key, RadixKey):
            raise TypeError(f"PrefetchParams.key must be a RadixKey, got {type(params.key).__name__}")
        anchor = self.tree.node(params.node_id)
        if not self.tree.in_namespace(anchor, params.key.namespace):
            raise ValueError(f"node {params.node_id} is not in the key's namespace")
        depth = self.tree.depth(anchor)
        tokens = params.key.token_ids
        if depth > len(tokens) - len(tokens) % self.tree.page_size or (
                depth and not np.array_equal(tokens[:depth], self._tokens_of(anchor))):
            raise ValueError(f"node {params.node_id} is not a prefix of the request's tokens")
        return self._prefetch(params.req_id, params.key, anchor, depth, queued=True)

    def prefetch_matched(self, req_id: str, key: RadixKey, anchor: TreeNode, depth: int) -> PrefetchProgress:
        """``prefetch`` below ``anchor``, the deepest node of the tree's own match of ``key`` (``depth``
        tokens: its L1+L2 hit), taken in the same head call: in the key's namespace and a prefix of its
        tokens by construction, so not checked again. The request is about to start (``begin_request``):
        unless the policy is best effort, its existence query is waited for here (``query_wait_max_s``), so
        a miss answers in this call and the request goes on in it (one head call for a miss)."""
        progress = self._prefetch(req_id, key, anchor, depth, queued=False)
        if progress.state is PrefetchState.RUNNING and req_id in self._by_req and self._by_req[req_id].query:
            self.wait_query(req_id, self.query_budget_s(req_id))
            return self.progress(req_id)  # a miss is reported (once) as not started: the request goes on
        return progress

    @staticmethod
    def _skip(req_id: str, reason: str) -> PrefetchProgress:
        return PrefetchProgress(req_id, PrefetchState.NOT_STARTED, 0, True, reason)

    def _prefetch(self, req_id: str, key: RadixKey, anchor: TreeNode, depth: int, *,
                  queued: bool) -> PrefetchProgress:
        """The pages of ``key`` past ``anchor`` (``depth`` tokens deep, a checked prefix) that L3 holds,
        fetched into L2 below it (see the module docstring). Both entries (``prefetch``,
        ``prefetch_matched``) come through here: the request's one prefetch, an expired write hold ended."""
        if req_id in self._by_req:
            raise ValueError(f"request {req_id!r} already has a prefetch")
        self._expire_pause()  # its writes go with this call's plan
        ps = self.tree.page_size
        tokens = key.token_ids
        whole = len(tokens) - len(tokens) % ps
        if self.values:  # a hybrid match ends where its components can serve: fetch below the Full KV only
            anchor, depth = self.tree.storage_only.fetch_anchor(anchor, tokens, depth)
        skip = self._skip
        if whole - depth < max(self.params.prefetch_min_tokens, ps):
            return skip(req_id, "below prefetch_min_tokens")
        if not self._available():  # down: no request waits on it (module docstring)
            self.counters.unavailable_skips += 1
            return skip(req_id, L3_UNAVAILABLE)
        ns = Namespace(self.params.fingerprint, key.extra_key, key.cache_salt)
        prev = None
        if depth:
            path = self._path(anchor)
            parent_key = self._page_keys(path, ns, depth // ps)  # fills chain keys; nothing new to return
            assert not parent_key
            prev = path[-1].chain_key
        # lazy: a miss hashes only the pages storage asks about (a few), not the whole prompt's
        keys = ChainKeys(ns, tokens[depth:whole], parent=prev)
        first_key = keys[0]
        # (a hybrid tree still asks: the manifest knows the Full pages, not which component values are stored)
        known = self.tree.storage_only.known_tokens(anchor, tokens[depth:whole]) // ps \
            if anchor.children and not self.values else 0
        if known * ps < self.params.prefetch_min_tokens:
            known = 0
        if not known and first_key in self._misses:
            if self._late_reasons:
                self._apply_late_reasons()
            why = self._recent_miss(first_key)
            if why:
                self.counters.prefetch_negative_hits += 1
                return skip(req_id, why)
        room = self.params.max_inflight_prefetch_pages - self._inflight_prefetch_pages
        if room < len(keys):
            keys = keys[: max(0, room)]
        if len(keys) < self._exists_min_pages:  # not L3's answer: no miss to remember
            return skip(req_id, "prefetch pages in flight at max_inflight_prefetch_pages")
        first = depth // ps
        now = time.monotonic()
        task = _Prefetch(req_id, anchor, tokens[depth : depth + len(keys) * ps].copy(), keys, first, now,
                         now + self.params.prefetch_wait_max_s, queued=queued)
        if first % self.pages_per_object:  # L3 can find that chunk's objects by its first page (``leading_index``)
            task.chunk_key = self._page_key(path, ns, first - first % self.pages_per_object)
        anchor.host_pin += 1  # (a root too: it stays while the query and fetch run, RadixTree._drop_idle_roots)
        self._by_req[req_id] = task
        if known:
            self.counters.prefetch_known_stored += 1
            # Objects sit at fixed page positions and a stored path's tail object ends where that path
            # ended, so only whole objects are certain: a tail inside one is asked about like any page.
            known = min(known, len(keys))
            end = first + known
            task.base = max(first, end - end % self.pages_per_object) - first
            if task.base == known:
                self._start_fetch(task, known)
                return self.progress(req_id, expire=not queued)
            task.keys, task.tokens = task.keys[:known], task.tokens[: known * ps]
        if self.params.previous_fingerprints and not task.base:
            end = min(whole // ps, (first // self.pages_per_object + 1) * self.pages_per_object)
            task.elsewhere = functools.partial(_stored_elsewhere, self.workers.storage_exists,
                                               self.params.previous_fingerprints, key.extra_key, key.cache_salt,
                                               tokens[: end * ps], first)
        task.query = self._ask(task)
        self.counters.l3_queries += 1
        # waiting on the answer longer than recomputing its candidates would take is a loss whatever it says;
        # bounded on evidence only: a measured fetch, or a query that already kept a request waiting in vain
        evidence = self.cost.measured or self.counters.query_waits_expired > 0
        bound = self.cost.wait_bound_s(len(task.keys) - task.base, ps) if evidence else None
        wait = self.params.query_wait_max_s if bound is None else min(self.params.query_wait_max_s, bound)
        task.query_until = now + wait
        self._querying.append(task)
        return self.progress(req_id, expire=not queued)

    def _ask(self, task: _Prefetch) -> cf.Future:
        """Starts the existence query of ``task``'s candidates past its certain base, off the head's thread:
        a request never waits on storage I/O in a head call (it may wait on the answer, bounded by
        ``query_wait_max_s``). The answer is applied by ``advance`` on the head's thread. Where every
        host's storage is a local disk in this process (``storage_local``), the query is answered here:
        a few local stat calls cost less than the hand-off to a query thread."""
        keys, first = task.keys[task.base:], task.first_page + task.base
        least = 1 if task.base else self._exists_min_pages
        exists = functools.partial(self.workers.storage_exists, chunk_start_key=None if task.base else task.chunk_key)
        if self.values:  # a hybrid tree: the hit ends where every component's objects are there too
            exists = functools.partial(_with_values, exists, self.values, self.workers.storage_exists_each,
                                       task.keys, task.base, self._exists_min_pages, task.value_flags)
        elsewhere = task.elsewhere
        if elsewhere is None:
            if self.workers.storage_local:  # (an error is a miss, as from the query thread: ``advance``)
                return run_now(exists, keys, first, least)
            return self._query_threads().submit(exists, keys, first, least)
        answer: cf.Future = cf.Future()
        other = task.elsewhere_answer = cf.Future()

        def query() -> None:  # the query's answer first, then (on a miss of every page) the previous fingerprints'
            try:
                found = exists(keys, first, least)
            except BaseException as e:
                other.set_result(False)
                answer.set_exception(e)
                return
            answer.set_result(found)
            try:
                other.set_result(not found and elsewhere())
            except BaseException:  # (a diagnostic: never an error)
                other.set_result(False)

        if self.workers.storage_local:
            query()
        else:
            self._query_threads().submit(query)
        return answer

    def _query_threads(self) -> cf.ThreadPoolExecutor:
        if self._query_pool is None:
            # a few threads: a query stuck until its storage deadline does not hold up the ones behind it
            self._query_pool = cf.ThreadPoolExecutor(_QUERY_THREADS, thread_name_prefix="hicache-l3-query")
        return self._query_pool

    def advance(self) -> int:
        """Applies answered existence queries (head thread): a query that found enough starts its fetch
        (queued with the next plan), one that found too little is a remembered miss. A query past the
        storage's existence deadline (plus the ack slack) counts as a miss. Returns fetches started."""
        self._settle_parked()
        if not self._querying:
            return 0
        started = 0
        now = time.monotonic()
        waiting: list[_Prefetch] = []
        tasks, self._querying = self._querying, waiting
        for task in tasks:
            q, other = task.query, task.elsewhere_answer
            assert q is not None
            if not q.done() and now < task.started + self._query_deadline_s:
                waiting.append(task)
                continue
            # a miss whose previous-fingerprint check still runs waits for it while its request may wait
            if other is not None and not other.done() and q.done() and q.exception() is None and not q.result() \
                    and now < task.query_until and now < task.started + self._query_deadline_s:
                waiting.append(task)
                continue
            task.query = task.elsewhere_answer = None
            found, failed = 0, not q.done()
            if q.done():
                try:
                    found = task.base + int(q.result())
                except Exception:  # storage trouble is a miss, never an error for a request
                    found, failed = task.base, True
                if self.values:  # (the answer is complete once the query is done)
                    self.values.counters.existence_requests += sum(len(f) for f in task.value_flags.values())
            if found < self._exists_min_pages:
                # the request's miss reason (token_account): L3 did not answer, or its breaker opened meanwhile
                down = failed or self.workers.storage_breaker_state() != "closed"
                elsewhere = other is not None and other.done() and other.result()
                why = L3_UNAVAILABLE if down else FINGERPRINT_DIFFERS if elsewhere else NOT_ENOUGH
                first_key = task.keys[0]
                self._note_miss(first_key, FINGERPRINT_DIFFERS if elsewhere else f"{NOT_ENOUGH} (recent miss)")
                if other is not None and not other.done() and not down:  # later requests get its answer
                    self._late_reasons.append((first_key, other))
                    del self._late_reasons[: -self.params.negative_cache_size or None]
                self._end_without_fetch(task, why)
            else:
                started += self._start_fetch(task, found)
        return started

    def _apply_late_reasons(self) -> None:
        """Remembered misses whose previous-fingerprint check answered after their request went on: a found
        one now reads "fingerprint differs" for the requests that hit the remembered miss."""
        keep = []
        for key, other in self._late_reasons:
            if not other.done():
                keep.append((key, other))
            elif other.result() and key in self._misses:
                self._misses[key] = (self._misses[key][0], FINGERPRINT_DIFFERS)
        self._late_reasons = keep

    @property
    def querying(self) -> bool:
        """Existence queries are unanswered (``advance`` has work)."""
        return bool(self._querying)

    def wait_query(self, req_id: str, timeout_s: float) -> None:
        """Waits up to ``timeout_s`` for the existence query of ``req_id``'s prefetch (if one runs)."""
        task = self._by_req.get(req_id)
        if task is not None and task.query is not None and timeout_s > 0:
            until = time.monotonic() + timeout_s
            cf.wait([task.query], timeout=timeout_s)
            other = task.elsewhere_answer
            if other is not None and task.query.done() and time.monotonic() < until:
                cf.wait([other], timeout=until - time.monotonic())  # (answered at once unless it was a miss)
        self.advance()

    def _end_without_fetch(self, task: _Prefetch, reason: str) -> None:
        task.anchor.host_pin -= 1
        task.state, task.reason = PrefetchState.NOT_STARTED, reason
        task.tokens, task.keys = task.tokens[:0], []

    def _start_fetch(self, task: _Prefetch, found: int) -> bool:
        """Queues the L3->L2 fetch of ``task``'s first ``found`` candidate pages into fresh L2 slots;
        False (the task ends with its reason) when the in-flight bound or L2 leaves no room."""
        found = min(found, self.params.max_inflight_prefetch_pages - self._inflight_prefetch_pages, len(task.keys))
        if found < self._exists_min_pages:
            self._end_without_fetch(task, "prefetch pages in flight at max_inflight_prefetch_pages")
            return False
        found = self._worth_fetching(task, found)
        if not found:
            return False
        if self.values:  # (cut above by the in-flight bound or the cost model: end where the values are)
            cut = found
            found = servable_end(task.value_flags, found, self._exists_min_pages)
            if found < cut:
                self.values.counters.fetches_cut += 1
            if not found:
                self.values.counters.fetches_without_values += 1
                self._end_without_fetch(task, VALUES_MISSING)
                return False
        if not self._l2_copy_coming(task.anchor, start=True):
            self._end_without_fetch(task, NO_ANCHOR_COPY)
            return False
        slots = self.host.reserve(found)
        if slots is None:
            self._end_without_fetch(task, "no L2 room")
            return False
        parts: tuple = ()
        if self.values:
            task.values = self.values.reserve(found, task.first_page, task.keys)
            if task.values is None:
                self.host.unreserve(slots)
                self.values.counters.fetches_without_values += 1
                self._end_without_fetch(task, "no L2 room for the components' values")
                return False
            parts = tuple(task.values.parts)
        ps = self.tree.page_size
        task.keys, task.tokens, task.slots = task.keys[:found], task.tokens[: found * ps], slots
        op = TransferOp(next(self._op_ids), OpKind.PREFETCH_S2H, np.empty(0, np.int32), slots,
                        tuple(task.keys), first_page=task.first_page, chunk_start_key=task.chunk_key,
                        storage_parts=parts)
        task.op_id = op.op_id
        task.fetch_started = time.monotonic()
        task.deadline = task.fetch_started + self.params.prefetch_timeout_s(found * ps)
        self._prefetches[op.op_id] = task
        self._inflight_prefetch_pages += found
        self.counters.prefetch_started += 1
        self._queue_op(op, [])
        return True

    def _worth_fetching(self, task: _Prefetch, found: int) -> int:
        """How many of the ``found`` leading pages the cost model fetches; 0 ends ``task`` (its request
        recomputes them). A request still waiting bounds the fetch by what is back before it stops waiting.
        A prefetch its request started on entering the queue fetches all: the queue wait hides it."""
        ps = self.tree.page_size
        budget = None
        if self._by_req.get(task.req_id) is task and self.params.prefetch_policy is not PrefetchPolicy.BEST_EFFORT:
            now = time.monotonic()
            until = task.wait_until
            if self.params.prefetch_policy is PrefetchPolicy.TIMEOUT:
                until = min(until, now + self.params.prefetch_timeout_s(found * ps))
            budget = max(0.0, until - now)
        if task.queued:
            # The fetch overlaps the request's wait in the queue: free unless the request starts before it
            # is back, and then the request waits at most the model's bound before it recomputes.
            bound = self.cost.wait_bound_s(found, ps)
            if bound is not None:
                task.wait_until = min(task.wait_until, time.monotonic() + bound)
            return found
        plan = self.cost.choose(found, ps, self._exists_min_pages, budget, self._pending_fetch())
        c = self.counters
        if plan.explored:
            c.cost_explored += 1
        elif not plan.pages:
            c.cost_skips += 1
            c.cost_skipped_pages += found
            self._end_without_fetch(task, COST_SKIPPED)
        elif plan.pages < found:
            c.cost_partial += 1
        bound = self.cost.wait_bound_s(plan.pages, ps) if plan.pages and budget is not None else None
        if bound is not None:  # waiting longer than this is slower than recomputing: the request goes on
            task.wait_until = min(task.wait_until, time.monotonic() + bound)
        return plan.pages

    def _pending_fetch(self) -> PendingFetch | None:
        """The oldest fetch in flight (dicts keep insertion order: the first one is the oldest sent)."""
        for task in self._prefetches.values():
            return PendingFetch(len(task.keys), time.monotonic() - task.fetch_started)
        return None

    def observe_ack(self, kind: OpKind, num_pages: int, nbytes: int, duration_s: float) -> None:
        """One host's ack of an L3 -> L2 fetch or an L2 -> L1 load: a sample for the cost model."""
        if kind is OpKind.PREFETCH_S2H:
            self.cost.observe_fetch(num_pages, nbytes, duration_s)
        elif kind is OpKind.LOAD_H2D:
            self.cost.observe_load(num_pages, nbytes, duration_s)

    # -- negative cache ------------------------------------------------------------------------------
    def _recent_miss(self, key: str) -> str:
        """The reason of a remembered miss of ``key`` ("": none, or expired)."""
        entry = self._misses.get(key)
        if entry is None:
            return ""
        if time.monotonic() >= entry[0]:
            del self._misses[key]
            return ""
        self._misses.move_to_end(key)
        return entry[1]

    def _note_miss(self, key: str, reason: str) -> None:
        ttl, cap = self.params.negative_cache_ttl_s, self.params.negative_cache_size
        if ttl <= 0 or cap <= 0:
            return
        self._misses[key] = (time.monotonic() + ttl, reason)
        self._misses.move_to_end(key)
        while len(self._misses) > cap:
            self._misses.popitem(last=False)

    # -- manifest ------------------------------------------------------------------------------------
    def _queue_manifest(self, node: TreeNode) -> None:
        """Queues the stored path ending at ``node``; replaces queued entries of its ancestors."""
        a = node.parent
        while a is not None:
            if self._manifest.pop(a.id, None) is not None:
                self.counters.manifest_coalesced += 1
            a = a.parent
        self._manifest[node.id] = (self._namespace(node), self._tokens_of(node))
        self._maybe_write_manifest()

    def _maybe_write_manifest(self) -> None:
        """Starts the background manifest write if one is due and none runs; not during a write hold
        (``resume_writes`` starts it then)."""
        now = time.monotonic()
        if (self._manifest and self._paused_at is None and now >= self._manifest_next
                and (self._manifest_job is None or self._manifest_job.done())):
            self._manifest_next = now + self.params.manifest_interval_s
            self._write_manifest(wait=False)

    def _write_manifest(self, wait: bool) -> None:
        entries = list(self._manifest.values())
        self._manifest.clear()
        if entries:
            if self._manifest_thread is None:
                self._manifest_thread = cf.ThreadPoolExecutor(1, thread_name_prefix="hicache-manifest")
            record = self.workers.storage_record_prefix
            counters, hold_left, writes_open, stopped = self.counters, self._hold_left_s, self._writes_open, self._stopped

            def write() -> None:
                try:
                    for ns, tokens in entries:
                        if stopped.is_set():  # detached past the flush's bound: the rest is lost (best effort)
                            return
                        left = hold_left()
                        if left:  # a prefill runs: this entry waits for its first token (bounded by the hold)
                            counters.manifest_hold_waits += 1
                            writes_open.wait(left)
                        record(ns, tokens)
                        counters.manifest_records += 1
                finally:
                    jobs.pop()

            jobs = self._manifest_jobs
            jobs.append(None)
            if self._paused_at is not None and not self._gate_closed:  # (a flush opens it again below)
                self._gate_closed = True
                self._writes_open.clear()
            self._manifest_job = self._manifest_thread.submit(write)
        if wait and self._manifest_job is not None:
            self._gate_closed = False
            self._writes_open.set()  # a flush writes now, pause or not (the next pause holds again)
            try:
                # one data call's deadline for the whole flush: a hung L3 never holds a detach or close longer
                self._manifest_job.result(timeout=self.params.storage.timeout_s)
            except cf.TimeoutError:
                pass
            except Exception:  # an outage: the manifest is best effort (prefixes stay in L3)
                pass

    def flush_manifest(self) -> None:
        """Writes every queued manifest entry now and waits (bounded by the storage timeout)."""
        self._write_manifest(wait=True)

    @staticmethod
    def _tokens_of(node: TreeNode) -> np.ndarray:
        parts = []
        while node.parent is not None:
            parts.append(node.key)
            node = node.parent
        return np.concatenate(parts[::-1]) if parts else np.empty(0, np.int32)

    def progress(self, req_id: str, *, expire: bool = True) -> PrefetchProgress:
        """Where ``req_id``'s prefetch stands; a result other than RUNNING, or RUNNING once the request may go
        on without it, is reported once. ``expire=False`` (the arrival's own report: no request waits yet)
        never ends the wait, so the request's check at its start reports why it went on."""
        self.advance()
        task = self._by_req.get(req_id)
        if task is None:
            return PrefetchProgress(req_id, PrefetchState.NOT_STARTED, 0, True, "no prefetch for this request")
        tokens = task.tokens.shape[0]
        if task.state is not PrefetchState.RUNNING:
            del self._by_req[req_id]  # reported once; the request matches again now
            ok = task.state is PrefetchState.DONE
            return PrefetchProgress(req_id, task.state, tokens if ok else 0, True, task.reason)
        policy = self.params.prefetch_policy
        now = time.monotonic()
        querying = task.query is not None
        may = expire and (policy is PrefetchPolicy.BEST_EFFORT or now >= task.wait_until or (
            now >= task.query_until if querying else policy is PrefetchPolicy.TIMEOUT and now >= task.deadline))
        if may:
            del self._by_req[req_id]  # the request goes on without it; what its fetch finds still lands in L2
            if querying and policy is not PrefetchPolicy.BEST_EFFORT:
                self.counters.query_waits_expired += 1
        # while the query runs, nothing is known to be fetched yet: 0 tokens
        return PrefetchProgress(req_id, PrefetchState.RUNNING, 0 if querying else tokens, may,
                                "timed out" if may else "")

    def wait_budget_s(self, req_id: str, ack_timeout_s: float) -> float:
        """How long the head may block for this request's fetch under the stop policy (its query waited
        for first: ``wait_query``)."""
        task = self._by_req.get(req_id)
        if task is None or task.state is not PrefetchState.RUNNING or task.query is not None:
            return 0.0
        left = task.wait_until - time.monotonic()  # the bound under every policy
        if self.params.prefetch_policy is PrefetchPolicy.WAIT_COMPLETE:
            return max(0.0, min(ack_timeout_s, left))
        if self.params.prefetch_policy is PrefetchPolicy.TIMEOUT:
            return max(0.0, min(task.deadline - time.monotonic(), left))
        return 0.0

    def fetch_op(self, req_id: str) -> int | None:
        """The op id of ``req_id``'s L3->L2 fetch while it runs (None: no fetch started)."""
        task = self._by_req.get(req_id)
        if task is None or task.state is not PrefetchState.RUNNING or task.op_id < 0:
            return None
        if task.op_id not in self._prefetches:  # acked, parked: its anchor's L1->L2 copy is what it waits on
            return self._copy_op(task.anchor)
        return task.op_id

    def query_budget_s(self, req_id: str) -> float:
        """How long the head may block for this request's unanswered existence query (0: none runs, or
        the policy does not wait)."""
        task = self._by_req.get(req_id)
        if task is None or task.query is None or self.params.prefetch_policy is PrefetchPolicy.BEST_EFFORT:
            return 0.0
        return max(0.0, min(task.query_until, task.wait_until) - time.monotonic())

    # -- acks --------------------------------------------------------------------------------------
    def owns(self, op_id: int) -> bool:
        return op_id in self._backups or op_id in self._prefetches

    def complete(self, p: PendingTransfer) -> None:
        self._expire_pause()
        self._poll_background()
        assert p.op is not None  # L3 ops are built when queued
        op_id = p.op.op_id
        if p.kind is OpKind.BACKUP_H2S:
            b = self._backups.pop(op_id)
            self._inflight_backup_pages -= b.num_pages
            for node in b.pinned:
                node.host_pin -= 1
                if p.ok and node.host_slots is not None:
                    node.stored = True
                self.host.maybe_push(node)
            if b.values:
                (self.values.stored if p.ok else self.values.forget)(b.values)
            if p.ok:
                self.counters.backup_pages += b.num_pages
                if self._misses:
                    for key in b.keys:
                        self._misses.pop(key, None)
                if b.last.parent is not None:
                    self._queue_manifest(b.last)
            else:
                self.counters.backup_failures += 1
            return
        task = self._prefetches.pop(op_id)
        self._inflight_prefetch_pages -= len(task.keys)
        anchor = task.anchor
        if p.ok and anchor.parent is not None and anchor.host_slots is None and self._l2_copy_coming(anchor):
            # fetched below an L1-only match: its pages hang below the anchor's L2 copy once that is acked
            self.counters.prefetch_parked += 1
            self._parked.append(task)
            return
        self._finish_fetch(task, p.ok)

    def _l2_copy_coming(self, anchor: TreeNode, *, start: bool = False) -> bool:
        """Whether ``anchor`` has an L2 copy or one is on its way (its own or an ancestor's L1->L2 copy in
        flight: the controller backs up the rest after that ack). ``start``: if none is, starts one."""
        if anchor.parent is None:
            return self.tree.is_root(anchor)
        if anchor.host_slots is not None:
            return True
        if start and anchor.staged_slots is None and self._back_up is not None:
            self._back_up(anchor)
        node: TreeNode | None = anchor
        while node is not None and node.parent is not None and node.host_slots is None:
            if node.staged_slots is not None:
                return True
            node = node.parent
        return False

    def _settle_parked(self) -> None:
        """Fetches parked until their anchor's L2 copy: adopted once it is acked, dropped (their slots
        freed, a redundant fetch) once none is on its way any more or past their deadline."""
        if not self._parked:
            return
        now = time.monotonic()
        keep: list[_Prefetch] = []
        for task in self._parked:
            anchor = task.anchor
            if anchor.host_slots is None and anchor.parent is not None and now < task.deadline + _QUERY_SLACK_S \
                    and self._l2_copy_coming(anchor):
                keep.append(task)
            else:
                self._finish_fetch(task, True)
        self._parked = keep

    def fetch_parked(self, req_id: str) -> bool:
        """Whether ``req_id``'s fetch is back and waits for its anchor's L1->L2 copy (``fetch_op`` is then
        that copy's op: the controller sends it at once)."""
        task = self._by_req.get(req_id)
        return task is not None and task.state is PrefetchState.RUNNING and any(t is task for t in self._parked)

    @staticmethod
    def _copy_op(anchor: TreeNode) -> int | None:
        """The op id of the L1->L2 copy that ``anchor``'s L2 copy waits on (its own or the nearest
        ancestor's in flight), once sent."""
        node: TreeNode | None = anchor
        while node is not None and node.parent is not None and node.host_slots is None:
            p = node.pending
            if node.staged_slots is not None and p is not None and p.op is not None:
                return p.op.op_id
            node = node.parent
        return None

    def _finish_fetch(self, task: _Prefetch, ok: bool) -> None:
        """Applies an acked (``ok``) or failed fetch to the tree: its pages become host-only nodes below its
        anchor (if the anchor still has an L2 copy to hang them below), or its slots are freed."""
        anchor = task.anchor
        anchor.host_pin -= 1
        alive = anchor.parent is not None or self.tree.is_root(anchor)
        usable = ok and alive and (anchor.parent is None or anchor.host_slots is not None)
        nodes = self.tree.storage_only.adopt(anchor, task.tokens) if usable else None
        if not ok and alive:  # a missing or corrupt object: what the tree thought stored is not
            self.counters.storage_only_dropped_tokens += self.tree.storage_only.drop_path(anchor, task.tokens)
        if task.values is not None:  # the values' ids: the new last node's host copies, or freed
            self.values.adopt(nodes, task.values)
            task.values = None
        if nodes is None:
            self.host.unreserve(task.slots)
            if ok:
                self.counters.prefetch_redundant_pages += len(task.keys)
            else:
                self.counters.prefetch_failures += 1
                # the request's miss reason (token_account): L3 went down, else the objects were unreadable
                task.reason = L3_UNAVAILABLE if self.workers.storage_breaker_state() != "closed" else "fetch failed"
            task.state = PrefetchState.DONE if ok else PrefetchState.FAILED
            if ok:
                task.tokens = task.tokens[:0]
            return
        k = 0
        for node in nodes:
            n = node.num_tokens // self.tree.page_size
            node.staged_slots = task.slots[k : k + n].copy()
            node.stored = True
            k += n
        self.host.commit_many(nodes)
        nodes[-1].chain_key = task.keys[-1]
        self.counters.prefetch_pages += len(task.keys)
        task.state = PrefetchState.DONE
        self.host.maybe_push(anchor)

    @property
    def backup_room_pages(self) -> int:
        """Pages of L2->L3 backups that may be sent before new ones are skipped (a drain's pacing)."""
        return self.params.max_inflight_backup_pages - self._inflight_backup_pages

    @property
    def in_flight(self) -> int:
        """Storage ops sent and not acked (held writes and unanswered queries are not: ``detach`` drops
        them)."""
        return len(self._backups) - len(self._held) + len(self._prefetches)

    def detach(self) -> None:
        self._paused_at = None  # (the flush below opens the gate)
        for op in self._held:  # never sent: unpin, nothing stored (later queries miss them)
            b = self._backups.pop(op.op_id)
            self._inflight_backup_pages -= b.num_pages
            self.counters.backup_held_dropped_pages += b.num_pages
            for node in b.pinned:
                node.host_pin -= 1
                self.host.maybe_push(node)
        self._held = []
        for task in self._querying:  # unanswered: nothing was reserved; the answer is dropped
            self._end_without_fetch(task, "storage detached")
        self._querying = []
        self._late_reasons = []
        parked, self._parked = self._parked, []
        for task in parked:  # the fetch is valid: adopted if the anchor's L2 copy came meanwhile, else freed
            self._finish_fetch(task, True)
        self.flush_manifest()
        self._stopped.set()  # background work still running ends at its next step, unapplied
        self.tree.storage_only.drop_all()  # nothing left to fetch them from
        self.tree.storage_only.cap_tokens = 0
        for pool in (self._manifest_thread, self._bg, self._query_pool):  # none is waited for: each ends by
            if pool is not None:  # its own deadline
                pool.shutdown(wait=False, cancel_futures=True)
        self._manifest_thread = self._bg = self._query_pool = None
        self._bg_job = None
        self.workers.attach_storage(None)  # closes the clients (each within its close_timeout_s)
