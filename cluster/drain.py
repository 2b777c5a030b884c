"""Drain on preemption: when a spot / preemptible slice gets its notice, store what is hot and not
yet in L3 before the slice is taken.

Spot and preemptible TPU VMs get tens of seconds of notice (GCE: ~30 s) before they are stopped;
everything a replica holds in HBM and host DRAM and L3 does not have is lost with them. A drain:

1. stops admitting: ``CacheHead.begin_request`` refuses new requests with ``HiCacheDrainingError``
   (requests already running finish as usual);
2. writes to L3, within the deadline, the prefixes L3 does not hold yet, most valuable first:
   ``expected_value`` = (hits + 1) x recency, recency = 1 / (1 + tree operations since the node's last
   use). L2-backed nodes go L2 -> L3 (``StorageTier.on_host_committed``, the path from its first
   unstored page); L1-only ones go L1 -> L2 first (``HiCacheController.backup_to_host``), and the
   storage tier stores them at the D->H ack. Sending is paced by the storage tier's in-flight cap, so
   nothing is skipped for being over it; acks are pumped until the deadline;
3. flushes the manifest (the next replica's warm restart lists what was drained).

What did not fit is counted (``DrainProgress.not_fitted_pages``); objects are write-once and
checksummed, so a write cut off by the slice going away is never read as data.

Notice sources (``PreemptionSource``): the GCE metadata server (``instance/preempted``,
``instance/maintenance-event``; tests run a stand-in on 127.0.0.1), a signal, or a file. A source's
``wait(timeout_s)`` returns a ``Notice`` or None; ``PreemptionWatcher`` polls one on a thread and
calls back once. A Ray replica watches by itself with ``ReplicaConfig.preemption`` (a
``PreemptionConfig``, the replica file's ``preemption:`` section): its head actor runs the watcher and
drains round by round (below).

Who runs what: a drain runs in rounds (``DrainRun``), each inside one head call, on the thread that
owns the head then (its state lock held): nothing else touches the tree, the pools or the controller
during a round, and each round is bounded (sends, then waits for acks at most ``ack_wait_s``). The
embedded head runs all rounds in one call (``CacheHead.drain``: its caller owns it; a client's
``drain`` call to a Ray head is such a call too). On a notice, the Ray head actor runs them as
separate calls (``drive_drain``), so ``cache_stats``, ``hicache status`` and the
finishes of running requests are served between rounds and show the progress while it runs
(``DrainProgress``: sent, drained, left pages); the ``hicache_drain_pages`` gauge is published every
round. Admission stops at the first round's start (``CacheHead.drain_progress`` is set under the
lock), so no request is admitted after it. Sources and the watcher run on the caller's threads and
never touch the head.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from hicache.cluster.head import CacheHead
    from hicache.cluster.tree import TreeNode

GCE_METADATA_URL = "http://metadata.google.internal/computeMetadata/v1/instance"
GCE_NOTICE_S = 30.0  # GCE's preemption notice


class NoticeKind(str, enum.Enum):
    PREEMPTED = "preempted"  # GCE instance/preempted = TRUE
    MAINTENANCE = "maintenance"  # GCE instance/maintenance-event other than NONE
    SIGNAL = "signal"
    FILE = "file"


@dataclasses.dataclass(frozen=True)
class Notice:
    kind: NoticeKind
    detail: str  # what the source saw (metadata value, signal name, file path)
    deadline_s: float  # seconds left, from when the notice was seen, until the slice is taken


class PreemptionSource(Protocol):
    def wait(self, timeout_s: float) -> Notice | None:
        """A notice, if one came within ``timeout_s`` (else None). Never raises for a source that
        cannot be reached: that is no notice."""


def _check_deadline(deadline_s: float) -> float:
    if isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)) or not deadline_s > 0:
        raise ValueError(f"deadline_s must be a number > 0, got {deadline_s!r}")
    return float(deadline_s)


class _PolledSource:
    """A source that looks (``check``) every ``poll_s`` until a notice, the timeout or ``close``."""

    poll_s: float
    _stop: threading.Event

    def check(self) -> Notice | None:
        raise NotImplementedError

    def wait(self, timeout_s: float) -> Notice | None:
        end = time.monotonic() + timeout_s
        while True:
            notice = self.check()
            left = end - time.monotonic()
            if notice is not None or left <= 0 or self._stop.wait(min(self.poll_s, left)):
                return notice

    def close(self) -> None:
        self._stop.set()


class GceMetadataSource(_PolledSource):
    """Polls the metadata server's ``preempted`` and ``maintenance-event`` values, each GET bounded
    by ``request_timeout_s``, every ``poll_s`` (``Metadata-Flavor: Google``, as the server requires)."""

    def __init__(self, base_url: str = GCE_METADATA_URL, *, deadline_s: float = GCE_NOTICE_S,
                 poll_s: float = 1.0, request_timeout_s: float = 1.0) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        for name, v in (("poll_s", poll_s), ("request_timeout_s", request_timeout_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a number > 0, got {v!r}")
        self.base_url = base_url.rstrip("/")
        self.deadline_s = _check_deadline(deadline_s)
        self.poll_s = float(poll_s)
        self.request_timeout_s = float(request_timeout_s)
        self._stop = threading.Event()

    def _get(self, name: str) -> str | None:
        req = urllib.request.Request(f"{self.base_url}/{name}", headers={"Metadata-Flavor": "Google"})
        try:
            with urllib.request.urlopen(req, timeout=self.request_timeout_s) as r:
                return r.read(256).decode("ascii", "replace").strip()
        except (OSError, urllib.error.URLError, ValueError):
            return None  # unreachable or refused: no notice

    def check(self) -> Notice | None:
        """One look at both values."""
        if (self._get("preempted") or "").upper() == "TRUE":
            return Notice(NoticeKind.PREEMPTED, "instance/preempted=TRUE", self.deadline_s)
        event = self._get("maintenance-event")
        if event and event.upper() != "NONE":
            return Notice(NoticeKind.MAINTENANCE, f"instance/maintenance-event={event}", self.deadline_s)
        return None



class FileSource(_PolledSource):
    """A notice when ``path`` exists; its content, if a number, is the deadline in seconds."""

    def __init__(self, path: str | os.PathLike, *, deadline_s: float = GCE_NOTICE_S, poll_s: float = 0.5) -> None:
        self.path = os.fspath(path)
        self.deadline_s = _check_deadline(deadline_s)
        self.poll_s = float(poll_s)
        self._stop = threading.Event()

    def check(self) -> Notice | None:
        try:
            with open(self.path) as f:
                text = f.read(64).strip()
        except FileNotFoundError:
            return None
        try:
            deadline = _check_deadline(float(text)) if text else self.deadline_s
        except ValueError:
            deadline = self.deadline_s
        return Notice(NoticeKind.FILE, self.path, deadline)



class SignalSource:
    """A notice when the process gets ``signum`` (default SIGTERM, what a VM shutdown sends). Install
    from the main thread (Python's rule for signal handlers); ``close`` restores the old handler. It
    replaces the process's own handler (in a Ray worker, Ray's exit on SIGTERM): the process drains
    instead of exiting, and goes with the VM or a SIGKILL."""

    def __init__(self, signum: int = signal.SIGTERM, *, deadline_s: float = GCE_NOTICE_S) -> None:
        self.signum = signal.Signals(signum)
        self.deadline_s = _check_deadline(deadline_s)
        self._got = threading.Event()
        self._old = signal.signal(self.signum, lambda *_: self._got.set())

    def wait(self, timeout_s: float) -> Notice | None:
        if self._got.wait(timeout_s):
            return Notice(NoticeKind.SIGNAL, self.signum.name, self.deadline_s)
        return None

    def close(self) -> None:
        """Restores the old handler, from the main thread only (Python's rule; a Ray actor's ``shutdown``
        runs elsewhere): there the handler stays, setting an event nobody waits on any more."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(self.signum, self._old)


def _signal_named(name: str) -> signal.Signals:
    try:
        return signal.Signals[name or "SIGTERM"]
    except KeyError:
        raise ValueError(f"unknown signal {name!r} for a signal notice source (e.g. SIGTERM, SIGUSR1)") from None


class PreemptionWatcher:
    """Waits on ``source`` on a daemon thread; calls ``on_notice(notice)`` once, then stops."""

    def __init__(self, source: PreemptionSource, on_notice: Callable[[Notice], Any], *, poll_s: float = 5.0) -> None:
        self.source, self.on_notice, self.poll_s = source, on_notice, float(poll_s)
        self.notice: Notice | None = None
        self.done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hicache-preemption-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            notice = self.source.wait(self.poll_s)
            if notice is not None:
                self.notice = notice
                try:
                    self.on_notice(notice)
                finally:
                    self.done.set()
                return

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        close = getattr(self.source, "close", None)
        if close is not None:
            close()
        self._thread.join(timeout_s)


class NoticeSourceKind(str, enum.Enum):
    GCE = "gce"  # the metadata server (``location``: its instance URL; "" = GCE_METADATA_URL)
    FILE = "file"  # a file (``location``: its path)
    SIGNAL = "signal"  # a signal to the head's process (``location``: its name; "" = SIGTERM)


@dataclasses.dataclass(frozen=True)
class PreemptionConfig:
    """Where a replica's head watches for a notice (``ReplicaConfig.preemption``); picklable, built
    into a source in the head's process."""

    kind: NoticeSourceKind | str = NoticeSourceKind.GCE
    location: str = ""
    deadline_s: float = GCE_NOTICE_S  # when the source does not say
    poll_s: float = 1.0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", NoticeSourceKind(self.kind))
        except ValueError:
            raise ValueError(f"unknown notice source {self.kind!r}; choose one of "
                             f"{[k.value for k in NoticeSourceKind]}") from None
        _check_deadline(self.deadline_s)
        if isinstance(self.poll_s, bool) or not isinstance(self.poll_s, (int, float)) or not self.poll_s > 0:
            raise ValueError(f"poll_s must be a number > 0, got {self.poll_s!r}")
        if self.kind is NoticeSourceKind.FILE and not self.location:
            raise ValueError("a file notice source needs its path (location)")
        if self.kind is NoticeSourceKind.SIGNAL:
            _signal_named(self.location)

    def build(self) -> PreemptionSource:
        """The source, in the process that watches (a signal source: from its main thread)."""
        if self.kind is NoticeSourceKind.SIGNAL:
            return SignalSource(_signal_named(self.location), deadline_s=self.deadline_s)
        if self.kind is NoticeSourceKind.FILE:
            return FileSource(self.location, deadline_s=self.deadline_s, poll_s=self.poll_s)
        return GceMetadataSource(self.location or GCE_METADATA_URL, deadline_s=self.deadline_s, poll_s=self.poll_s)


# -- the drain (head side) --------------------------------------------------------------------------
class DrainState(str, enum.Enum):
    IDLE = "idle"
    DRAINING = "draining"
    DONE = "done"


@dataclasses.dataclass(frozen=True)
class DrainOptions:
    """``reserve_s``: of the deadline, kept for the manifest flush (at most a quarter of it);
    ``ack_wait_s``: longest single wait for acks (the loop sends more as room frees up)."""

    reserve_s: float = 1.0
    ack_wait_s: float = 0.25

    def __post_init__(self) -> None:
        for name in ("reserve_s", "ack_wait_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")


@dataclasses.dataclass
class DrainProgress:
    """What a drain did (``CacheHead.cache_stats()["drain"]``, the metrics and ``hicache status``)."""

    state: DrainState = DrainState.IDLE
    deadline_s: float = 0.0
    candidate_pages: int = 0  # pages not in L3 when it started (L1 and L2)
    sent_pages: int = 0  # pages sent L2 -> L3 (or L1 -> L2 -> L3)
    # pages the drain's L3 writes stored (acked by every host) before the deadline; an op starts at an object
    # boundary, so the stored pages before a path's first unstored one count again: it can exceed candidate_pages
    drained_pages: int = 0
    left_pages: int = 0  # not in L3 yet (L1 or L2 holds them): updated every round
    not_fitted_pages: int = 0  # still not in L3 when it ended (left_pages then)
    # of those, pages of paths longer than one L2 -> L3 backup may be (``StorageParams.max_inflight_backup_pages``):
    # they never fit, whatever the deadline
    oversized_pages: int = 0
    rounds: int = 0
    elapsed_s: float = 0.0
    manifest_flushed: bool = False

    def snapshot(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["state"] = self.state.value
        return d


def expected_value(node: TreeNode, now_tick: int) -> float:
    """(hits + 1) x recency, recency = 1 / (1 + tree operations since the node was last used)."""
    return (node.hit_count + 1) / (1 + max(0, now_tick - node.last_access))


def _unstored(head: CacheHead) -> list[TreeNode]:
    """Nodes L3 lacks that L1 or L2 holds (the root and storage-only entries excluded)."""
    return [n for n in head.tree.iter_nodes()
            if n.parent is not None and not n.stored and (n.host_slots is not None or n.device_pages is not None)]


def _pages(nodes: list[TreeNode], page_size: int) -> int:
    return sum(n.num_tokens // page_size for n in nodes)


@dataclasses.dataclass(frozen=True)
class DrainParams:
    deadline_s: float  # seconds until the slice is taken (``Notice.deadline_s``)
    options: DrainOptions = DrainOptions()

    def __post_init__(self) -> None:
        _check_deadline(self.deadline_s)
        if not isinstance(self.options, DrainOptions):
            raise TypeError(f"options must be DrainOptions, got {type(self.options).__name__}")


class DrainRun:
    """One drain, in rounds (module docstring). Every method runs inside a head call, on the thread that
    owns the head then (the lock holder): ``__init__`` stops admission and counts the candidates; each
    ``round`` sends what fits the storage tier's in-flight cap, waits for acks at most
    ``DrainOptions.ack_wait_s`` and updates the progress; the last round flushes the manifest. Between
    rounds the owner serves other calls (``cache_stats``, finishes of running requests), so progress is
    visible while the drain runs; the head state in between is whatever those calls made of it, so each
    round looks at the tree afresh."""

    def __init__(self, head: CacheHead, params: DrainParams, clock: Callable[[], float] = time.monotonic) -> None:
        ctl = head.controller
        if ctl is None or ctl.storage is None:
            raise RuntimeError("drain needs a host tier and an attached L3 (nothing could be stored)")
        self.head, self.params, self.clock = head, params, clock
        self._ctl, self._st = ctl, ctl.storage  # what it drains through; another call may detach or reset them
        self._t0 = clock()
        self._end = self._t0 + params.deadline_s - min(params.options.reserve_s, params.deadline_s / 4)  # a short deadline still sends
        self.progress = DrainProgress(DrainState.DRAINING, params.deadline_s)
        head.drain_progress = self.progress  # from here on begin_request refuses
        self._stored_before = ctl.storage.counters.backup_pages
        self._sent: set[int] = set()
        self._oversized: set[int] = set()  # unstored nodes on a path that never fits one backup
        self._via_l1: dict[int, tuple[TreeNode, int]] = {}  # node id -> (node, L3 pages) of L1 -> L2 sends in flight
        self.progress.candidate_pages = self.progress.left_pages = _pages(_unstored(head), head.page_size)

    @property
    def done(self) -> bool:
        return self.progress.state is DrainState.DONE

    def round(self) -> bool:
        """One round; True while another is due (False: the drain is done)."""
        if self.done:
            return False
        ctl = self._ctl
        attached = self.head.controller is ctl and ctl.storage is self._st  # (a detach or reset between rounds ends it)
        if attached:
            self._st.resume_writes()  # writes another call held since the last round go now
        more = False
        if attached and self.clock() < self._end:
            issued, waiting = self._send_what_fits()
            ctl.flush_write_through_acks(timeout_s=max(0.0, min(self.params.options.ack_wait_s, self._end - self.clock())))
            self._count()
            more = bool(issued or waiting or ctl.in_flight) and self.clock() < self._end
        if not more:
            self._finish(attached)
        self.progress.rounds += 1
        self.head.publish_metrics()
        return more

    def _send_what_fits(self) -> tuple[int, bool]:
        """Sends the unstored paths, most valuable first, until the in-flight cap; returns how many, and
        whether one waits for acks (room under the cap, or a backup on its way)."""
        head, prog, sent = self.head, self.progress, self._sent
        ctl, st, ps = self._ctl, self._st, head.page_size
        unstored = _unstored(head)
        self._resend_ended(unstored)
        # L1 -> L2 backups the drain started take their L3 room only at their D->H ack: keep it for them
        self._via_l1 = {i: (n, k) for i, (n, k) in self._via_l1.items() if n.staged_slots is not None}
        room = st.backup_room_pages - sum(k for _, k in self._via_l1.values())
        todo = [n for n in unstored if n.id not in sent]
        tick = max((n.last_access for n in todo), default=0)
        todo.sort(key=lambda n: expected_value(n, tick), reverse=True)
        issued, waiting = 0, False
        acks_due = ctl.in_flight > 0  # only acks free room or unpin a path: without any, waiting would spin
        for node in todo:
            if node.id in sent:
                continue  # covered by a deeper node's path this round
            full = _path(node)
            path = [p for p in full if not p.stored]
            if any(p.host_pin or p.staged_slots is not None for p in path):
                waiting = acks_due  # a backup (write-through's) is on its way: a second one would write it twice
                continue
            need = _pages(full, ps) - _pages([p for p in full if p.stored], ps)
            need += (_pages(full, ps) - need) % st.pages_per_object  # the op starts at an object boundary
            if need > room:
                if need > st.params.max_inflight_backup_pages:
                    self._oversized.update(p.id for p in path)
                    continue  # never fits one backup (counted as not fitted)
                return issued, acks_due  # wait for acks: the storage tier would skip it now
            if node.host_slots is not None:
                before = st.backup_room_pages
                st.on_host_committed([node])
                if st.backup_room_pages == before:
                    continue  # not sent (a broken chain): left for a later round
            elif ctl.backup_to_host(node):
                self._via_l1[node.id] = (node, need)
            else:
                continue
            room -= need
            sent.update(p.id for p in path)
            prog.sent_pages += need
            issued += 1
        return issued, waiting

    def _resend_ended(self, unstored: list[TreeNode]) -> None:
        """Sent nodes with an L2 copy, still not in L3 and pinned by no backup: theirs ended without
        storing them (skipped at the D->H ack for lack of room, or failed), so they go again."""
        for n in unstored:
            if n.id in self._sent and n.host_slots is not None and n.host_pin == 0 and n.staged_slots is None:
                self._sent.discard(n.id)

    def _count(self) -> list[TreeNode]:
        """Updates the progress; returns the nodes still not in L3."""
        unstored = _unstored(self.head)
        self.progress.drained_pages = self._st.counters.backup_pages - self._stored_before
        self.progress.left_pages = _pages(unstored, self.head.page_size)
        self.progress.elapsed_s = self.clock() - self._t0
        return unstored

    def _finish(self, attached: bool) -> None:
        prog = self.progress
        if attached and self.clock() < self._t0 + self.params.deadline_s:
            self._st.flush_manifest()
            prog.manifest_flushed = True
        unstored = self._count()
        prog.not_fitted_pages = prog.left_pages
        prog.oversized_pages = _pages([n for n in unstored if n.id in self._oversized], self.head.page_size)
        prog.state = DrainState.DONE


def run_drain(head: CacheHead, params: DrainParams, clock: Callable[[], float] = time.monotonic) -> DrainProgress:
    """Runs a whole drain on ``head`` in one call (the embedded head: its caller owns it); returns its
    progress (also kept on the head)."""
    run = DrainRun(head, params, clock)
    while run.round():
        pass
    return run.progress


def drive_drain(on_head: Callable[[Callable[[CacheHead], Any]], Any], params: DrainParams, *,
                between_rounds: Callable[[DrainProgress], Any] | None = None,
                clock: Callable[[], float] = time.monotonic) -> DrainProgress:
    """Runs a drain as a sequence of head calls, for a head that serves other callers meanwhile (the
    Ray head actor). ``on_head(fn)`` runs ``fn(head)`` the way the head's owner runs any call (under
    its state lock) and returns its value, or raises if the head state it started on is gone; other
    calls run between two of them. ``between_rounds(progress)`` runs after each round, outside the
    head (a test's hook). Returns the progress; the drain stops early when ``on_head`` raises."""
    run: DrainRun = on_head(lambda head: DrainRun(head, params, clock))
    while on_head(lambda head: run.round()):
        if between_rounds is not None:
            between_rounds(run.progress)
    return run.progress


def _path(node: TreeNode) -> list[TreeNode]:
    out = []
    while node.parent is not None:
        out.append(node)
        node = node.parent
    return out[::-1]
