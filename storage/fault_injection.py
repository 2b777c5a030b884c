"""A seeded fault-injecting fsspec filesystem: L3 on a failing network, for tests and benchmarks.

``FaultyFileSystem(target_fs, plan)`` (or the chained URL ``faulty::memory://bucket/root`` with
``faulty={"plan": plan}``, the protocol registered when this module is imported) wraps any fsspec
filesystem and makes its calls suffer what a ``FaultPlan`` says, per operation class (``Op``):
added latency, a bandwidth cap on payload bytes, hangs, transient errors, refused connections,
read payloads corrupted or truncated in transit, and a deleted bucket. The target's stored objects
are never changed by a fault: corruption and truncation apply to the bytes handed to the caller.

The wrapper has the target's surface kind, so code that picks a path by ``isinstance(fs,
AsyncFileSystem)`` takes the same one with or without it: an async target (gcsfs) gets an
``AsyncFaultyFileSystem`` whose coroutines (``_cat_file``, ``_pipe_file``, ``_info``, ...) inject
faults on the target's event loop without blocking it (hangs and delays are ``asyncio`` waits); a
sync target (memory://, file://) gets a ``SyncFaultyFileSystem`` whose methods block the calling
thread. Anything not overridden is the target's (attribute delegation) or fsspec's default built on
the overridden primitives. A ``file://`` target is wrapped as a plain fsspec filesystem, not a
``LocalFileSystem``, so local fast paths keyed on that class are not taken.

Errors raised, by fault: ``OSError(EIO, "503 Service Unavailable ...")`` for transient errors (also
for gcsfs targets, which raise ``gcsfs.retry.HttpError`` themselves after their retries),
``ConnectionRefusedError(ECONNREFUSED)`` for refused connections, ``TimeoutError`` when a hang
reaches ``FaultPlan.hang_max_s``, ``FileNotFoundError(ENOENT, ..., root)`` for every call on a
deleted bucket except ``exists``, which returns False as fsspec's backends do.

Observation (what a test asserts a code path costs): ``calls()`` counts the wrapper's calls by
operation class, whatever the plan; ``requests()`` counts the HTTP requests the target itself
sent, by the class of each request, for targets that send them through an async ``_call(method,
path, ...)`` (gcsfs): a target's internal requests (gcsfs' ``_info`` lists the parent prefix beside
its object GET) show there, never in ``calls()``. The wrapper observes, never changes, those
requests (it rebinds the target instance's ``_call`` to a counting pass-through).

Threads. One ``FaultInjector`` per wrapper holds the plan, its ``random.Random(plan.seed)``, the
counters and the hang gate under one lock: any thread (and the target's loop) may call the wrapper
and ``set_plan`` / ``release_hangs`` / ``injected`` concurrently. Calls made in the same order draw
the same faults; concurrent calls draw in the order they reach the lock.
"""

from __future__ import annotations

import asyncio
import errno
import io
import math
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

import fsspec
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.chained import ChainedFileSystem

PROTOCOL = "faulty"


class Op(str, Enum):
    """Operation classes a plan sets faults for."""

    READ = "read"  # cat_file, open for reading, get_file
    WRITE = "write"  # pipe_file, open for writing, put_file, cp_file, mkdir, touch
    METADATA = "metadata"  # info, exists, created, modified
    LIST = "list"  # ls, find
    DELETE = "delete"  # rm_file, rm, rmdir


class FaultKind(str, Enum):
    """Keys of ``FaultyFileSystem.injected()``."""

    LATENCY = "latency"
    BANDWIDTH = "bandwidth"
    HANG = "hang"
    ERROR = "error"
    REFUSED = "refused"
    CORRUPT = "corrupt"
    TRUNCATE = "truncate"
    BUCKET_DELETED = "bucket_deleted"


def _check_probability(owner: str, name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{owner}.{name} must be a probability in [0, 1], got {value!r}")


def _check_seconds(owner: str, name: str, value: float, *, positive: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{owner}.{name} must be a finite number of seconds {bound}, got {value!r}")


@dataclass(frozen=True)
class OpFaults:
    """What calls of one operation class suffer. Each ``*_p`` is the probability per call."""

    latency_s: float = 0.0  # added before the call, with probability latency_p
    latency_p: float = 1.0
    bandwidth_bps: float | None = None  # cap on payload bytes (read or written); None: no cap
    hang_p: float = 0.0  # block until release_hangs() (then go on) or hang_max_s (TimeoutError)
    error_p: float = 0.0  # OSError(EIO, "503 ...") instead of the call
    refuse_p: float = 0.0  # ConnectionRefusedError at once
    corrupt_p: float = 0.0  # reads only: one seeded bit of the returned bytes flipped
    truncate_p: float = 0.0  # reads only: a seeded strict prefix of the returned bytes

    def __post_init__(self) -> None:
        for name in ("latency_p", "hang_p", "error_p", "refuse_p", "corrupt_p", "truncate_p"):
            _check_probability("OpFaults", name, getattr(self, name))
        _check_seconds("OpFaults", "latency_s", self.latency_s, positive=False)
        bw = self.bandwidth_bps
        if bw is not None and (
            isinstance(bw, bool) or not isinstance(bw, (int, float)) or not math.isfinite(bw) or bw <= 0
        ):
            raise ValueError(f"OpFaults.bandwidth_bps must be None or a finite number > 0, got {bw!r}")


NO_FAULTS = OpFaults()


@dataclass(frozen=True)
class FaultPlan:
    """Faults per operation class, the seed of their draws, and the plan-wide faults.

    ``FaultPlan()`` injects nothing. ``FaultPlan.every(OpFaults(hang_p=0.2))`` gives every class
    the same faults (corruption and truncation are for ``read`` only)."""

    read: OpFaults = NO_FAULTS
    write: OpFaults = NO_FAULTS
    metadata: OpFaults = NO_FAULTS
    listing: OpFaults = NO_FAULTS
    delete: OpFaults = NO_FAULTS
    seed: int = 0
    hang_max_s: float = 30.0  # a hang not released by then raises TimeoutError
    bucket_deleted: bool = False  # every call: FileNotFoundError for the root (exists: False)

    def __post_init__(self) -> None:
        for op in Op:
            faults = self.faults(op)
            if not isinstance(faults, OpFaults):
                raise ValueError(f"FaultPlan.{_FIELD[op]} must be an OpFaults, got {faults!r}")
            if op is not Op.READ and (faults.corrupt_p or faults.truncate_p):
                raise ValueError(
                    f"FaultPlan.{_FIELD[op]}: corrupt_p/truncate_p apply to reads only, got "
                    f"corrupt_p={faults.corrupt_p!r}, truncate_p={faults.truncate_p!r}"
                )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"FaultPlan.seed must be an int, got {self.seed!r}")
        _check_seconds("FaultPlan", "hang_max_s", self.hang_max_s, positive=True)
        if not isinstance(self.bucket_deleted, bool):
            raise ValueError(f"FaultPlan.bucket_deleted must be a bool, got {self.bucket_deleted!r}")

    def faults(self, op: Op) -> OpFaults:
        return getattr(self, _FIELD[Op(op)])

    @classmethod
    def every(cls, faults: OpFaults, *, ops: tuple[Op, ...] = tuple(Op), **plan: Any) -> FaultPlan:
        """The same ``faults`` for each class in ``ops``; ``plan``: the other fields (seed ...)."""
        per_op: dict[str, Any] = {_FIELD[Op(op)]: faults for op in ops}
        return cls(**per_op, **plan)


_FIELD = {Op.READ: "read", Op.WRITE: "write", Op.METADATA: "metadata", Op.LIST: "listing", Op.DELETE: "delete"}


@dataclass(frozen=True, slots=True)
class _Draw:
    """What the plan decided for one call (all random draws made at once, under the lock)."""

    op: Op
    hang_max_s: float
    bucket_deleted: bool = False
    refused: bool = False
    hang: bool = False
    latency_s: float = 0.0
    error: bool = False
    bandwidth_bps: float | None = None
    corrupt_at: float | None = None  # fraction of the payload length: the byte whose bit flips
    corrupt_bit: int = 0
    truncate_at: float | None = None  # fraction of the payload length kept

    @property
    def touches_payload(self) -> bool:
        return self.bandwidth_bps is not None or self.corrupt_at is not None or self.truncate_at is not None


class _HangGate:
    """Where hung calls wait: threads on a condition, coroutines on a future of their own loop.
    ``release()`` frees every call hanging now (later hangs wait for the next release)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._generation = 0
        self._hanging = 0
        self._futures: set[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = set()

    def wait(self, max_s: float) -> bool:
        """Block until released (True) or ``max_s`` passed (False)."""
        with self._cond:
            gen = self._generation
            self._hanging += 1
            self._cond.notify_all()
            try:
                return self._cond.wait_for(lambda: self._generation != gen, timeout=max_s)
            finally:
                self._hanging -= 1
                self._cond.notify_all()

    async def await_release(self, max_s: float) -> bool:
        """As ``wait``, without blocking the running loop."""
        loop = asyncio.get_running_loop()
        entry = (loop, loop.create_future())
        with self._cond:
            self._futures.add(entry)
            self._hanging += 1
            self._cond.notify_all()
        try:
            await asyncio.wait({entry[1]}, timeout=max_s)
            return entry[1].done()
        finally:
            with self._cond:
                self._futures.discard(entry)
                self._hanging -= 1
                self._cond.notify_all()

    def release(self) -> int:
        with self._cond:
            self._generation += 1
            freed, futures = self._hanging, list(self._futures)
            self._futures.clear()
            self._cond.notify_all()
        for loop, fut in futures:
            try:
                loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:  # that loop is closed: its waiter is gone with it
                pass
        return freed

    def wait_for_hanging(self, count: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._hanging >= count, timeout=timeout)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _nbytes(value: Any) -> int:
    try:
        return memoryview(value).nbytes
    except TypeError:
        return len(value)


class FaultInjector:
    """The plan, its seeded draws, the counters and the hang gate of one wrapper (thread-safe)."""

    def __init__(self, plan: FaultPlan, root: str | None = None) -> None:
        if not isinstance(plan, FaultPlan):
            raise ValueError(f"plan must be a FaultPlan, got {plan!r}")
        self.root = root
        self._lock = threading.Lock()
        self._plan = plan
        self._rng = random.Random(plan.seed)
        self._counts = dict.fromkeys(FaultKind, 0)
        self._calls = dict.fromkeys(Op, 0)  # wrapper calls by operation class
        self._requests = dict.fromkeys(Op, 0)  # the target's HTTP requests by class (gcsfs)
        self.gate = _HangGate()

    @property
    def plan(self) -> FaultPlan:
        return self._plan

    def set_plan(self, plan: FaultPlan) -> None:
        """Use ``plan`` from the next call on, its draws starting again from its seed; counters
        and calls hanging now are kept (``release_hangs`` frees those)."""
        if not isinstance(plan, FaultPlan):
            raise ValueError(f"plan must be a FaultPlan, got {plan!r}")
        with self._lock:
            self._plan, self._rng = plan, random.Random(plan.seed)

    def _snapshot(self, counts: dict[Any, int]) -> dict[str, int]:
        with self._lock:
            return {k.value: n for k, n in counts.items()}

    def injected(self) -> dict[str, int]:
        return self._snapshot(self._counts)

    def calls(self) -> dict[str, int]:
        return self._snapshot(self._calls)

    def requests(self) -> dict[str, int]:
        return self._snapshot(self._requests)

    def count(self, kind: FaultKind) -> None:
        with self._lock:
            self._counts[kind] += 1

    def note_request(self, op: Op) -> None:
        with self._lock:
            self._requests[op] += 1

    def draw(self, op: Op) -> _Draw:
        with self._lock:
            self._calls[op] += 1
            plan, rng = self._plan, self._rng
            f = plan.faults(op)

            def hit(p: float) -> bool:
                return p > 0 and rng.random() < p

            refused, hang, late, error = hit(f.refuse_p), hit(f.hang_p), hit(f.latency_p), hit(f.error_p)
            corrupt_at: float | None = None
            truncate_at: float | None = None
            corrupt_bit = 0
            if hit(f.corrupt_p):
                corrupt_at, corrupt_bit = rng.random(), rng.randrange(8)
            if hit(f.truncate_p):
                truncate_at = rng.random()
            return _Draw(
                op,
                plan.hang_max_s,
                bucket_deleted=plan.bucket_deleted,
                refused=refused,
                hang=hang,
                latency_s=f.latency_s if late else 0.0,
                error=error,
                bandwidth_bps=f.bandwidth_bps,
                corrupt_at=corrupt_at,
                corrupt_bit=corrupt_bit,
                truncate_at=truncate_at,
            )

    # -- the faults, in the order a call meets them ------------------------------------------
    def missing_root(self, path: str) -> FileNotFoundError:
        self.count(FaultKind.BUCKET_DELETED)
        root = self.root or _bucket_of(path)
        return FileNotFoundError(errno.ENOENT, "bucket deleted (injected fault)", root)

    def before_hang(self, d: _Draw, path: str) -> None:
        """Faults that end the call before it could hang: a deleted bucket, a refusal."""
        if d.bucket_deleted:
            raise self.missing_root(path)
        if d.refused:
            self.count(FaultKind.REFUSED)
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"Connection refused (injected fault): {path}")

    def hang_timeout(self, d: _Draw, path: str) -> TimeoutError:
        return TimeoutError(f"no answer within hang_max_s={d.hang_max_s} s (injected hang): {d.op.value} {path}")

    def after_delay(self, d: _Draw, path: str) -> None:
        if d.error:
            self.count(FaultKind.ERROR)
            raise OSError(errno.EIO, f"503 Service Unavailable (injected fault): {d.op.value} {path}")

    def bandwidth_delay(self, d: _Draw, nbytes: int) -> float:
        if d.bandwidth_bps is None or nbytes <= 0:
            return 0.0
        self.count(FaultKind.BANDWIDTH)
        return nbytes / d.bandwidth_bps

    def mangle(self, d: _Draw, data: Any) -> Any:
        """The bytes the caller gets: a copy with a bit flipped and/or cut short, per the draw;
        ``data`` itself (possibly the target's own buffer) is never written."""
        if (d.corrupt_at is None and d.truncate_at is None) or _nbytes(data) == 0:
            return data
        out = bytearray(data)
        if d.corrupt_at is not None:
            self.count(FaultKind.CORRUPT)
            out[int(d.corrupt_at * len(out))] ^= 1 << d.corrupt_bit
        if d.truncate_at is not None:
            self.count(FaultKind.TRUNCATE)
            del out[int(d.truncate_at * len(out)) :]
        return bytes(out)

    # -- whole-call application ---------------------------------------------------------------
    def enter(self, op: Op, path: str) -> _Draw:
        """Draw and apply the call-level faults on this thread (sync callers)."""
        d = self.draw(op)
        self.before_hang(d, path)
        if d.hang:
            self.count(FaultKind.HANG)
            if not self.gate.wait(d.hang_max_s):
                raise self.hang_timeout(d, path)
        if d.latency_s:
            self.count(FaultKind.LATENCY)
            time.sleep(d.latency_s)
        self.after_delay(d, path)
        return d

    async def aenter(self, op: Op, path: str) -> _Draw:
        """As ``enter``, waiting with asyncio (coroutines on the target's loop)."""
        d = self.draw(op)
        self.before_hang(d, path)
        if d.hang:
            self.count(FaultKind.HANG)
            if not await self.gate.await_release(d.hang_max_s):
                raise self.hang_timeout(d, path)
        if d.latency_s:
            self.count(FaultKind.LATENCY)
            await asyncio.sleep(d.latency_s)
        self.after_delay(d, path)
        return d


def request_op(method: str, path: str) -> Op:
    """The operation class of one JSON-API request (gcsfs' ``_call(method, path, ...)``: ``path``
    a template such as ``b/{}/o/{}``, or a full URL): a GET of ``.../o`` (objects) or ``b``
    (buckets) is a listing, a GET with ``alt=media`` a read, any other GET metadata."""
    method = method.upper()
    if method == "DELETE":
        return Op.DELETE
    if method != "GET":
        return Op.WRITE  # uploads, compose, rewrite, patch
    if "alt=media" in path:
        return Op.READ
    rest = path.split("?", 1)[0].rstrip("/")
    rest = rest.split("/storage/v1/", 1)[-1]
    return Op.LIST if rest == "b" or rest.endswith("/o") else Op.METADATA


def _observe_requests(target: Any, faults: FaultInjector) -> None:
    """Count every request ``target`` sends through its async ``_call`` (gcsfs), by class."""
    call = getattr(target, "_call", None)
    if call is None or not asyncio.iscoroutinefunction(call):
        return

    async def counted(method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        faults.note_request(request_op(method, path))
        return await call(method, path, *args, **kwargs)

    target._call = counted


def _bucket_of(path: str) -> str:
    path = str(path)
    lead = "/" if path.startswith("/") else ""
    return lead + path.lstrip("/").split("/", 1)[0]


def _first_path(path: Any) -> str:
    if isinstance(path, (list, tuple)):
        return str(path[0]) if path else ""
    return str(path)


class _FaultyFileSystemMeta(type(ChainedFileSystem)):  # type: ignore[misc]  # fsspec's _Cached
    """``FaultyFileSystem(...)`` builds the sync or async wrapper, as the target is."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is not FaultyFileSystem:
            return super().__call__(*args, **kwargs)
        fs, plan, root, rest = _resolve_target(args, kwargs)
        impl = AsyncFaultyFileSystem if isinstance(fs, AsyncFileSystem) else SyncFaultyFileSystem
        return impl(fs, plan, root=root, **rest)


def _resolve_target(args: tuple, kwargs: dict[str, Any]) -> tuple[Any, FaultPlan, str | None, dict[str, Any]]:
    """(target filesystem, plan, root, other kwargs) from the explicit or chained-URL arguments."""
    kw = dict(kwargs)
    names = ("fs", "plan")
    if len(args) > len(names):
        raise TypeError(f"FaultyFileSystem takes at most {len(names)} positional arguments, got {len(args)}")
    for name, value in zip(names, args):
        if name in kw:
            raise TypeError(f"FaultyFileSystem got multiple values for {name!r}")
        kw[name] = value
    fs, plan = kw.pop("fs", None), kw.pop("plan", None)
    target_protocol, target_options = kw.pop("target_protocol", None), kw.pop("target_options", None)
    root, fo = kw.pop("root", None), kw.pop("fo", None)
    root = root or fo or None  # fo: the path of a chained URL, the wrapper's root
    if (fs is None) == (target_protocol is None):
        raise ValueError("FaultyFileSystem needs exactly one of a target filesystem (fs) and target_protocol")
    if fs is None:
        fs = fsspec.filesystem(target_protocol, **(target_options or {}))
    if plan is None:
        plan = FaultPlan()
    if root is not None:
        root = fs._strip_protocol(root).rstrip("/") or None
    return fs, plan, root, kw


class FaultyFileSystem(ChainedFileSystem, metaclass=_FaultyFileSystemMeta):
    """A fault-injecting wrapper around ``fs`` (module docstring). Constructing this class gives a
    ``SyncFaultyFileSystem`` or an ``AsyncFaultyFileSystem``, as ``fs`` is sync or async.

    ``FaultyFileSystem(fs, plan=None, *, root=None)``, or through fsspec's chaining:
    ``target_protocol`` + ``target_options`` instead of ``fs``, ``fo`` (the chained URL's path)
    as ``root``. ``root`` only names the bucket in a deleted bucket's FileNotFoundError (default:
    the path's first component)."""

    protocol = PROTOCOL
    cachable = False  # each wrapper has its own draws and counters

    def __init__(self, fs: Any, plan: FaultPlan | None = None, *, root: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fs = fs
        self.faults = FaultInjector(plan if plan is not None else FaultPlan(), root)
        # paths are the target's: strip its protocol, use its root marker and separator
        self._strip_protocol = fs._strip_protocol
        self.unstrip_protocol = fs.unstrip_protocol
        self.root_marker, self.sep = fs.root_marker, fs.sep

    def __getattr__(self, name: str) -> Any:
        # only reached for names this class and fsspec's defaults lack: the target's
        fs = self.__dict__.get("fs")
        if fs is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(fs, name)

    # -- control ---------------------------------------------------------------------------------
    @property
    def plan(self) -> FaultPlan:
        return self.faults.plan

    def set_plan(self, plan: FaultPlan) -> None:
        """Swap the plan at runtime (draws restart from ``plan.seed``; counters kept)."""
        self.faults.set_plan(plan)

    def injected(self) -> dict[str, int]:
        """Faults injected so far, by ``FaultKind`` value (every kind present)."""
        return self.faults.injected()

    def calls(self) -> dict[str, int]:
        """Calls made through the wrapper so far, by ``Op`` value (every class present)."""
        return self.faults.calls()

    def requests(self) -> dict[str, int]:
        """HTTP requests the target sent so far, by ``Op`` value (module docstring; all 0 for a
        target that sends none through ``_call``: memory://, file://)."""
        return self.faults.requests()

    def release_hangs(self) -> int:
        """Free every call hanging now (each goes on to the target); the number freed."""
        return self.faults.gate.release()

    def wait_for_hangs(self, count: int = 1, timeout: float = 30.0) -> bool:
        """Block until at least ``count`` calls are hanging (a test's synchronisation point);
        False if ``timeout`` passed first."""
        return self.faults.gate.wait_for_hanging(count, timeout)

    # -- sync calls every wrapper makes on its caller's thread -----------------------------------
    def _call(self, op: Op, path: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        self.faults.enter(op, _first_path(path))
        return getattr(self.fs, method)(path, *args, **kwargs)

    def _open(
        self,
        path: str,
        mode: str = "rb",
        block_size: Any = None,
        autocommit: bool = True,
        cache_options: Any = None,
        **kwargs: Any,
    ) -> Any:
        op = Op.READ if "r" in mode and "+" not in mode else Op.WRITE
        d = self.faults.enter(op, path)
        inner = self.fs.open(
            path, mode, block_size=block_size, cache_options=cache_options, autocommit=autocommit, **kwargs
        )
        if not d.touches_payload:
            return inner
        size = self.fs.size(path) if op is Op.READ and (d.corrupt_at is not None or d.truncate_at is not None) else 0
        return _FaultyStream(inner, self.faults, d, size or 0)

    def invalidate_cache(self, path: str | None = None) -> None:
        self.fs.invalidate_cache(path)

    def sign(self, path: str, expiration: int = 100, **kwargs: Any) -> Any:
        return self.fs.sign(path, expiration, **kwargs)

    def created(self, path: str) -> Any:
        return self._call(Op.METADATA, path, "created")

    def modified(self, path: str) -> Any:
        return self._call(Op.METADATA, path, "modified")

    def rmdir(self, path: str) -> Any:
        return self._call(Op.DELETE, path, "rmdir")

    def touch(self, path: str, truncate: bool = True, **kwargs: Any) -> Any:
        return self._call(Op.WRITE, path, "touch", truncate=truncate, **kwargs)


class SyncFaultyFileSystem(FaultyFileSystem):
    """The wrapper of a sync filesystem (memory://, file://): faults on the calling thread."""

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> Any:
        d = self.faults.enter(Op.READ, path)
        data = self.fs.cat_file(path, start=start, end=end, **kwargs)
        data = self.faults.mangle(d, data)
        delay = self.faults.bandwidth_delay(d, _nbytes(data))
        if delay:
            time.sleep(delay)
        return data

    def pipe_file(self, path: str, value: Any, *args: Any, **kwargs: Any) -> Any:
        d = self.faults.enter(Op.WRITE, path)
        delay = self.faults.bandwidth_delay(d, _nbytes(value))
        if delay:
            time.sleep(delay)
        return self.fs.pipe_file(path, value, *args, **kwargs)

    def info(self, path: str, **kwargs: Any) -> Any:
        return self._call(Op.METADATA, path, "info", **kwargs)

    def exists(self, path: str, **kwargs: Any) -> bool:
        if self.faults.plan.bucket_deleted:  # fsspec's exists answers False for a missing bucket
            self.faults.missing_root(path)
            return False
        return bool(self._call(Op.METADATA, path, "exists", **kwargs))

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        return self._call(Op.LIST, path, "ls", detail=detail, **kwargs)

    def find(
        self, path: str, maxdepth: int | None = None, withdirs: bool = False, detail: bool = False, **kwargs: Any
    ) -> Any:
        return self._call(Op.LIST, path, "find", maxdepth=maxdepth, withdirs=withdirs, detail=detail, **kwargs)

    def rm_file(self, path: str, **kwargs: Any) -> Any:
        return self._call(Op.DELETE, path, "rm_file", **kwargs)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None, **kwargs: Any) -> Any:
        return self._call(Op.DELETE, path, "rm", recursive=recursive, maxdepth=maxdepth, **kwargs)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> Any:
        return self._call(Op.WRITE, path, "mkdir", create_parents=create_parents, **kwargs)

    def makedirs(self, path: str, exist_ok: bool = False) -> Any:
        return self._call(Op.WRITE, path, "makedirs", exist_ok=exist_ok)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> Any:
        return self._call(Op.WRITE, path1, "cp_file", path2, **kwargs)

    def get_file(self, rpath: str, lpath: str, **kwargs: Any) -> Any:
        return self._call(Op.READ, rpath, "get_file", lpath, **kwargs)

    def put_file(self, lpath: str, rpath: str, **kwargs: Any) -> Any:
        self.faults.enter(Op.WRITE, rpath)
        return self.fs.put_file(lpath, rpath, **kwargs)


class AsyncFaultyFileSystem(FaultyFileSystem, AsyncFileSystem):
    """The wrapper of an async filesystem (gcsfs): its coroutines run on the target's loop and
    wait there with asyncio; fsspec mirrors them as sync methods on that loop."""

    def __init__(self, fs: Any, plan: FaultPlan | None = None, *, root: str | None = None, **kwargs: Any) -> None:
        if fs.asynchronous:
            kwargs.setdefault("asynchronous", True)
        else:
            kwargs.setdefault("loop", fs.loop)
        super().__init__(fs, plan, root=root, **kwargs)
        _observe_requests(fs, self.faults)

    async def _acall(self, op: Op, path: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        await self.faults.aenter(op, _first_path(path))
        return await getattr(self.fs, method)(path, *args, **kwargs)

    async def _cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> Any:
        d = await self.faults.aenter(Op.READ, path)
        data = await self.fs._cat_file(path, start=start, end=end, **kwargs)
        data = self.faults.mangle(d, data)
        delay = self.faults.bandwidth_delay(d, _nbytes(data))
        if delay:
            await asyncio.sleep(delay)
        return data

    async def _pipe_file(self, path: str, value: Any, *args: Any, **kwargs: Any) -> Any:
        d = await self.faults.aenter(Op.WRITE, path)
        delay = self.faults.bandwidth_delay(d, _nbytes(value))
        if delay:
            await asyncio.sleep(delay)
        return await self.fs._pipe_file(path, value, *args, **kwargs)

    async def _info(self, path: str, **kwargs: Any) -> Any:
        return await self._acall(Op.METADATA, path, "_info", **kwargs)

    async def _get_object(self, path: str) -> Any:
        """gcsfs' one-request object metadata (``GET b/{bucket}/o/{name}``), under the metadata
        faults; ``FileNotFoundError`` if there is no such object."""
        return await self._acall(Op.METADATA, path, "_get_object")

    async def _do_list_objects(self, path: str, **kwargs: Any) -> Any:
        """gcsfs' one-request objects listing, under the listing faults."""
        return await self._acall(Op.LIST, path, "_do_list_objects", **kwargs)

    async def _exists(self, path: str, **kwargs: Any) -> bool:
        if self.faults.plan.bucket_deleted:  # fsspec's exists answers False for a missing bucket
            self.faults.missing_root(path)
            return False
        return bool(await self._acall(Op.METADATA, path, "_exists", **kwargs))

    async def _ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        return await self._acall(Op.LIST, path, "_ls", detail=detail, **kwargs)

    async def _find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, **kwargs: Any) -> Any:
        return await self._acall(Op.LIST, path, "_find", maxdepth=maxdepth, withdirs=withdirs, **kwargs)

    async def _rm_file(self, path: str, **kwargs: Any) -> Any:
        return await self._acall(Op.DELETE, path, "_rm_file", **kwargs)

    async def _rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None, **kwargs: Any) -> Any:
        kwargs.pop("batch_size", None)  # fsspec's own bulk rm passes it; targets name it differently
        return await self._acall(Op.DELETE, path, "_rm", recursive=recursive, maxdepth=maxdepth, **kwargs)

    async def _mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> Any:
        return await self._acall(Op.WRITE, path, "_mkdir", create_parents=create_parents, **kwargs)

    async def _makedirs(self, path: str, exist_ok: bool = False) -> Any:
        return await self._acall(Op.WRITE, path, "_makedirs", exist_ok=exist_ok)

    async def _cp_file(self, path1: str, path2: str, **kwargs: Any) -> Any:
        return await self._acall(Op.WRITE, path1, "_cp_file", path2, **kwargs)

    async def _get_file(self, rpath: str, lpath: str, **kwargs: Any) -> Any:
        return await self._acall(Op.READ, rpath, "_get_file", lpath, **kwargs)

    async def _put_file(self, lpath: str, rpath: str, **kwargs: Any) -> Any:
        await self.faults.aenter(Op.WRITE, rpath)
        return await self.fs._put_file(lpath, rpath, **kwargs)


class _FaultyStream(io.BufferedIOBase):
    """A file opened through the wrapper with payload faults: reads see the draw's corruption
    (at a fixed byte of the object) and truncation (the object ends early), reads and writes the
    bandwidth cap. The target's file does the I/O; it is never written with mangled bytes."""

    def __init__(self, inner: Any, faults: FaultInjector, draw: _Draw, size: int) -> None:
        super().__init__()
        self._inner, self._faults, self._draw = inner, faults, draw
        self._flip = int(draw.corrupt_at * size) if draw.corrupt_at is not None and size else None
        self._end = int(draw.truncate_at * size) if draw.truncate_at is not None and size else None
        self._counted: set[FaultKind] = set()

    def _once(self, kind: FaultKind) -> None:
        if kind not in self._counted:
            self._counted.add(kind)
            self._faults.count(kind)

    def _throttle(self, n: int) -> None:
        bps = self._draw.bandwidth_bps
        if bps is not None and n > 0:
            self._once(FaultKind.BANDWIDTH)
            time.sleep(n / bps)

    def read(self, size: int | None = -1) -> bytes:
        pos = self._inner.tell()
        if self._end is not None:
            left = max(0, self._end - pos)
            if size is None or size < 0 or size > left:  # this read meets the cut
                size = left
                self._once(FaultKind.TRUNCATE)
        data = self._inner.read(-1 if size is None else size)
        if self._flip is not None and pos <= self._flip < pos + len(data):
            self._once(FaultKind.CORRUPT)
            out = bytearray(data)
            out[self._flip - pos] ^= 1 << self._draw.corrupt_bit
            data = bytes(out)
        self._throttle(len(data))
        return bytes(data)

    def read1(self, size: int = -1) -> bytes:
        return self.read(size)

    def write(self, data: Any) -> int:
        self._throttle(_nbytes(data))
        return self._inner.write(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._inner.seek(offset, whence)

    def tell(self) -> int:
        return self._inner.tell()

    def readable(self) -> bool:
        return bool(self._inner.readable())

    def writable(self) -> bool:
        return bool(self._inner.writable())

    def seekable(self) -> bool:
        return bool(self._inner.seekable())

    def flush(self) -> None:
        if not self.closed:
            self._inner.flush()

    def close(self) -> None:
        if not self.closed:
            try:
                super().close()  # flushes the target's file first
            finally:
                self._inner.close()

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.readline, b"")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.__dict__["_inner"], name)


fsspec.register_implementation(PROTOCOL, FaultyFileSystem, clobber=True)

__all__ = [
    "PROTOCOL",
    "AsyncFaultyFileSystem",
    "FaultInjector",
    "FaultKind",
    "FaultPlan",
    "FaultyFileSystem",
    "NO_FAULTS",
    "Op",
    "OpFaults",
    "SyncFaultyFileSystem",
    "request_op",
]
