"""The fault-injecting fsspec wrapper over real filesystems (memory://, file://, gs:// on the
emulator): each fault kind observed, stored objects never touched by in-transit faults, hangs
bounded and releasable, seeded sequences reproducible, the async wrapper never blocking its loop."""

from __future__ import annotations

import asyncio
import errno
import threading
import time
import uuid
from collections import Counter

import fsspec
import fsspec.asyn
import pytest
from fsspec.asyn import AsyncFileSystem

from hicache.storage.fault_injection import (
    AsyncFaultyFileSystem,
    FaultKind,
    FaultPlan,
    FaultyFileSystem,
    Op,
    OpFaults,
    SyncFaultyFileSystem,
    request_op,
)

PAYLOAD = bytes(range(256)) * 8  # 2 KiB, every byte value
JOIN_S = 60.0  # generous bound for a thread that must finish; never a timing assertion


def _options(scheme: str) -> dict:
    return {"token": "anon"} if scheme == "gs" else {}


@pytest.fixture
def target(scheme, make_url):
    """(a real filesystem for ``scheme``, a fresh root path on it, the root's URL)."""
    url = make_url(scheme)
    fs, root = fsspec.core.url_to_fs(url, **_options(scheme))
    if scheme == "file":
        fs.makedirs(root, exist_ok=True)
    return fs, root.rstrip("/"), url


def _stored(fs, path: str) -> bytes:
    """The object's bytes as stored, read past the wrapper."""
    if isinstance(fs, AsyncFileSystem):
        fs.invalidate_cache()
    return bytes(fs.cat_file(path))


def _one_bit_apart(a: bytes, b: bytes) -> bool:
    return len(a) == len(b) and sum(bin(x ^ y).count("1") for x, y in zip(a, b)) == 1


def test_wrapper_has_the_targets_surface(target, scheme):
    fs, root, _ = target
    w = FaultyFileSystem(fs, FaultPlan())
    assert isinstance(w, FaultyFileSystem)
    if scheme == "gs":
        assert isinstance(w, AsyncFaultyFileSystem) and isinstance(w, AsyncFileSystem)
        assert w.loop is fs.loop
    else:
        assert isinstance(w, SyncFaultyFileSystem) and not isinstance(w, AsyncFileSystem)
    # without faults every call is the target's
    w.pipe_file(f"{root}/a", PAYLOAD)
    assert bytes(w.cat_file(f"{root}/a")) == PAYLOAD
    assert bytes(w.cat_file(f"{root}/a", start=10, end=20)) == PAYLOAD[10:20]
    assert w.info(f"{root}/a")["size"] == len(PAYLOAD)
    assert w.exists(f"{root}/a") and not w.exists(f"{root}/b")
    assert [p.rstrip("/").rsplit("/", 1)[-1] for p in w.find(root)] == ["a"]
    with w.open(f"{root}/a", "rb") as f:
        assert f.read() == PAYLOAD
    w.rm_file(f"{root}/a")
    assert not fs.exists(f"{root}/a")
    assert set(w.injected().values()) == {0} and set(w.injected()) == {k.value for k in FaultKind}


def test_read_corruption_is_in_transit_only(target):
    fs, root, _ = target
    fs.pipe_file(f"{root}/obj", PAYLOAD)
    w = FaultyFileSystem(fs, FaultPlan(read=OpFaults(corrupt_p=1.0), seed=1))
    for _ in range(3):
        got = bytes(w.cat_file(f"{root}/obj"))
        assert _one_bit_apart(got, PAYLOAD)
    with w.open(f"{root}/obj", "rb") as f:
        assert _one_bit_apart(f.read(), PAYLOAD)
    assert w.injected()[FaultKind.CORRUPT] == 4
    assert _stored(fs, f"{root}/obj") == PAYLOAD
    w.set_plan(FaultPlan())
    assert bytes(w.cat_file(f"{root}/obj")) == PAYLOAD


def test_read_truncation_is_in_transit_only(target):
    fs, root, _ = target
    fs.pipe_file(f"{root}/obj", PAYLOAD)
    w = FaultyFileSystem(fs, FaultPlan(read=OpFaults(truncate_p=1.0), seed=2))
    got = bytes(w.cat_file(f"{root}/obj"))
    assert len(got) < len(PAYLOAD) and PAYLOAD.startswith(got)
    with w.open(f"{root}/obj", "rb") as f:
        streamed = f.read()
    assert len(streamed) < len(PAYLOAD) and PAYLOAD.startswith(streamed)
    assert w.injected()[FaultKind.TRUNCATE] == 2
    assert _stored(fs, f"{root}/obj") == PAYLOAD
    w.set_plan(FaultPlan())
    assert bytes(w.cat_file(f"{root}/obj")) == PAYLOAD


def _calls(w, root: str) -> dict[Op, list]:
    """One call of each kind per operation class, on an object ``root/obj`` that exists."""
    return {
        Op.READ: [lambda: w.cat_file(f"{root}/obj")],
        Op.WRITE: [lambda: w.pipe_file(f"{root}/new", b"x")],
        Op.METADATA: [lambda: w.info(f"{root}/obj"), lambda: w.exists(f"{root}/obj")],
        Op.LIST: [lambda: w.find(root)],
        Op.DELETE: [lambda: w.rm_file(f"{root}/obj")],
    }


@pytest.mark.parametrize("kind", ["error", "refused"])
@pytest.mark.parametrize("op", list(Op))
def test_errors_and_refusals_per_operation_class(target, kind, op):
    fs, root, _ = target
    fs.pipe_file(f"{root}/obj", PAYLOAD)
    faults = OpFaults(error_p=1.0) if kind == "error" else OpFaults(refuse_p=1.0)
    w = FaultyFileSystem(fs, FaultPlan(**{_field(op): faults}))
    calls = _calls(w, root)
    for call in calls[op]:
        if kind == "error":
            with pytest.raises(OSError, match="503") as info:
                call()
            assert info.value.errno == errno.EIO
        else:
            with pytest.raises(ConnectionRefusedError) as info:
                call()
            assert info.value.errno == errno.ECONNREFUSED
    assert w.injected()[kind] == len(calls[op])
    # the call did not reach the target; the other classes are untouched
    assert _stored(fs, f"{root}/obj") == PAYLOAD and not fs.exists(f"{root}/new")
    other = Op.METADATA if op is not Op.METADATA else Op.READ
    for call in calls[other]:
        call()


def _field(op: Op) -> str:
    return "listing" if op is Op.LIST else op.value


def test_bucket_deleted_fails_every_call_and_comes_back(target):
    fs, root, url = target
    fs.pipe_file(f"{root}/obj", PAYLOAD)
    w = FaultyFileSystem(fs, FaultPlan(bucket_deleted=True), root=url)
    calls = _calls(w, root)
    for op, fns in calls.items():
        for fn in fns:
            if fn is calls[Op.METADATA][1]:
                assert fn() is False  # exists: False, as fsspec answers for a missing bucket
                continue
            with pytest.raises(FileNotFoundError) as info:
                fn()
            assert info.value.filename == root, op
    assert w.injected()[FaultKind.BUCKET_DELETED] == 6
    assert not fs.exists(f"{root}/new") and _stored(fs, f"{root}/obj") == PAYLOAD
    w.set_plan(FaultPlan())
    assert bytes(w.cat_file(f"{root}/obj")) == PAYLOAD


def test_latency_and_bandwidth_delay_the_call(target):
    fs, root, _ = target
    fs.pipe_file(f"{root}/obj", PAYLOAD)
    w = FaultyFileSystem(fs, FaultPlan(metadata=OpFaults(latency_s=0.05)))
    t0 = time.monotonic()
    assert w.info(f"{root}/obj")["size"] == len(PAYLOAD)
    assert time.monotonic() - t0 >= 0.05
    bps = len(PAYLOAD) / 0.05  # the payload takes 50 ms
    w.set_plan(FaultPlan(read=OpFaults(bandwidth_bps=bps), write=OpFaults(bandwidth_bps=bps)))
    t0 = time.monotonic()
    assert bytes(w.cat_file(f"{root}/obj")) == PAYLOAD
    assert time.monotonic() - t0 >= 0.05
    t0 = time.monotonic()
    w.pipe_file(f"{root}/copy", PAYLOAD)
    assert time.monotonic() - t0 >= 0.05
    assert _stored(fs, f"{root}/copy") == PAYLOAD
    assert w.injected()[FaultKind.LATENCY] == 1 and w.injected()[FaultKind.BANDWIDTH] == 2


def test_hang_ends_at_hang_max_s(target):
    fs, root, _ = target
    fs.pipe_file(f"{root}/obj", PAYLOAD)
    w = FaultyFileSystem(fs, FaultPlan(read=OpFaults(hang_p=1.0), hang_max_s=0.05))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        w.cat_file(f"{root}/obj")
    assert time.monotonic() - t0 >= 0.05
    # fsspec's sync mirror of a coroutine re-raises a TimeoutError as FSTimeoutError from it
    assert "hang_max_s=0.05" in (str(info.value) or str(info.value.__cause__))
    assert w.injected()[FaultKind.HANG] == 1
    assert w.exists(f"{root}/obj")  # metadata does not hang


def test_release_hangs_frees_a_blocked_caller(target):
    fs, root, _ = target
    fs.pipe_file(f"{root}/obj", PAYLOAD)
    w = FaultyFileSystem(fs, FaultPlan(read=OpFaults(hang_p=1.0), hang_max_s=600.0))
    got: list = []
    t = threading.Thread(target=lambda: got.append(bytes(w.cat_file(f"{root}/obj"))), daemon=True)
    t.start()
    assert w.wait_for_hangs(1, timeout=JOIN_S)
    assert w.release_hangs() == 1
    t.join(JOIN_S)
    assert not t.is_alive() and got == [PAYLOAD]  # freed long before hang_max_s, then answered


def _outcomes(w, path: str, n: int) -> list:
    out = []
    for _ in range(n):
        try:
            out.append(bytes(w.cat_file(path)))
        except OSError as e:
            out.append(type(e).__name__)
    return out


def test_same_seed_same_fault_sequence(target):
    fs, root, _ = target
    fs.pipe_file(f"{root}/obj", PAYLOAD)
    read = OpFaults(error_p=0.3, refuse_p=0.2, corrupt_p=0.3, truncate_p=0.3)
    a = FaultyFileSystem(fs, FaultPlan(read=read, seed=7))
    b = FaultyFileSystem(fs, FaultPlan(read=read, seed=7))
    c = FaultyFileSystem(fs, FaultPlan(read=read, seed=8))
    seq_a = _outcomes(a, f"{root}/obj", 30)
    assert seq_a == _outcomes(b, f"{root}/obj", 30)
    assert seq_a != _outcomes(c, f"{root}/obj", 30)
    assert a.injected() == b.injected()
    assert {"OSError", "ConnectionRefusedError", PAYLOAD} <= set(seq_a)
    a.set_plan(FaultPlan(read=read, seed=7))  # a swapped plan draws from its seed again
    assert _outcomes(a, f"{root}/obj", 30) == seq_a


def test_chained_url(target, scheme):
    fs, root, url = target
    plan = FaultPlan(read=OpFaults(truncate_p=1.0))
    w, path = fsspec.core.url_to_fs(f"faulty::{url}", faulty={"plan": plan}, **({scheme: _options(scheme)}))
    assert isinstance(w, FaultyFileSystem) and path.rstrip("/") == root
    assert isinstance(w, AsyncFileSystem) == (scheme == "gs")
    assert w.plan is plan
    w.pipe_file(f"{path}/obj", PAYLOAD)
    assert len(w.cat_file(f"{path}/obj")) < len(PAYLOAD)
    assert _stored(fs, f"{root}/obj") == PAYLOAD
    with pytest.raises(ValueError, match="exactly one"):
        FaultyFileSystem(fs, plan, target_protocol="memory")


def test_async_hang_does_not_block_the_loop(make_url):
    fs, root = fsspec.core.url_to_fs(make_url("gs"), **_options("gs"))
    fs.pipe_file(f"{root}/obj", PAYLOAD)
    w = FaultyFileSystem(fs, FaultPlan(read=OpFaults(hang_p=1.0), hang_max_s=600.0))

    async def scenario():
        hung = asyncio.ensure_future(w._cat_file(f"{root}/obj"))
        info = await w._info(f"{root}/obj")  # a network call on the same loop, while one hangs
        still_hanging = not hung.done()
        w.release_hangs()
        return info["size"], still_hanging, await asyncio.wait_for(hung, JOIN_S)

    size, still_hanging, data = fsspec.asyn.sync(w.loop, scenario, timeout=JOIN_S)
    assert size == len(PAYLOAD) and still_hanging and bytes(data) == PAYLOAD
    assert w.injected()[FaultKind.HANG] == 1

    async def cancelled():  # a caller's deadline cancels the hung coroutine: it stops hanging
        hung = asyncio.ensure_future(w._cat_file(f"{root}/obj"))
        await asyncio.wait({hung}, timeout=0)  # let it start and reach the hang
        hung.cancel()
        await asyncio.wait({hung}, timeout=JOIN_S)
        return hung.cancelled()

    assert fsspec.asyn.sync(w.loop, cancelled, timeout=JOIN_S)
    assert w.injected()[FaultKind.HANG] == 2 and w.release_hangs() == 0


def test_async_hang_released_from_another_thread(make_url):
    fs, root = fsspec.core.url_to_fs(make_url("gs"), **_options("gs"))
    fs.pipe_file(f"{root}/obj", PAYLOAD)
    w = FaultyFileSystem(fs, FaultPlan(listing=OpFaults(hang_p=1.0), hang_max_s=600.0))
    got: list = []
    t = threading.Thread(target=lambda: got.append(w.find(root)), daemon=True)  # sync mirror
    t.start()
    assert w.wait_for_hangs(1, timeout=JOIN_S)
    assert w.exists(f"{root}/obj")  # the loop serves other calls meanwhile
    assert w.release_hangs() == 1
    t.join(JOIN_S)
    assert not t.is_alive() and got == [[f"{root}/obj"]]


@pytest.mark.parametrize(
    "make, value",
    [
        (lambda: OpFaults(hang_p=1.5), "1.5"),
        (lambda: OpFaults(error_p=-0.1), "-0.1"),
        (lambda: OpFaults(corrupt_p=True), "True"),
        (lambda: OpFaults(latency_s=-1.0), "-1.0"),
        (lambda: OpFaults(latency_s=float("nan")), "nan"),
        (lambda: OpFaults(bandwidth_bps=0), "0"),
        (lambda: FaultPlan(hang_max_s=0), "0"),
        (lambda: FaultPlan(seed="x"), "'x'"),  # type: ignore[arg-type]
        (lambda: FaultPlan(read="fast"), "'fast'"),  # type: ignore[arg-type]
        (lambda: FaultPlan(write=OpFaults(corrupt_p=0.1)), "corrupt_p=0.1"),
        (lambda: FaultPlan.every(OpFaults(truncate_p=0.5)), "truncate_p=0.5"),
    ],
)
def test_bad_plans_name_the_value(make, value):
    with pytest.raises(ValueError, match=f"got .*{value}"):
        make()


def test_set_plan_rejects_a_non_plan_and_keeps_the_old_one():
    w = FaultyFileSystem(fsspec.filesystem("memory"), FaultPlan(seed=3))
    with pytest.raises(ValueError, match="'nope'"):
        w.set_plan("nope")  # type: ignore[arg-type]
    assert w.plan == FaultPlan(seed=3)


def test_every_sets_each_class():
    plan = FaultPlan.every(OpFaults(hang_p=0.2), seed=5, hang_max_s=1.0)
    assert all(plan.faults(op).hang_p == 0.2 for op in Op) and plan.seed == 5
    only = FaultPlan.every(OpFaults(error_p=1.0), ops=(Op.WRITE, Op.DELETE))
    assert [op for op in Op if only.faults(op).error_p] == [Op.WRITE, Op.DELETE]


def test_streamed_writes_pass_through_unchanged(tmp_path):
    root = f"{tmp_path}/w-{uuid.uuid4().hex[:6]}"
    w, path = fsspec.core.url_to_fs(
        f"faulty::file://{root}", faulty={"plan": FaultPlan(write=OpFaults(bandwidth_bps=1e9))}
    )
    w.fs.makedirs(path, exist_ok=True)
    with w.open(f"{path}/s", "wb") as f:
        f.write(PAYLOAD[:100])
        f.write(PAYLOAD[100:])
    assert open(f"{path}/s", "rb").read() == PAYLOAD
    assert w.injected()[FaultKind.BANDWIDTH] == 1


def test_other_calls_go_through_the_plan(target, tmp_path):
    fs, root, _ = target
    fs.pipe_file(f"{root}/obj", PAYLOAD)
    local = str(tmp_path / "local")
    w = FaultyFileSystem(fs, FaultPlan())
    calls = {
        Op.READ: [lambda: w.get_file(f"{root}/obj", local), lambda: w.open(f"{root}/obj", "rb").close()],
        Op.WRITE: [
            lambda: w.cp_file(f"{root}/obj", f"{root}/copy"),
            lambda: w.put_file(local, f"{root}/put"),
            lambda: w.touch(f"{root}/touched"),
            lambda: w.pipe({f"{root}/piped": b"p"}),
        ],
        Op.METADATA: [lambda: w.size(f"{root}/obj"), lambda: w.modified(f"{root}/obj")],
        Op.LIST: [lambda: w.ls(root), lambda: w.glob(f"{root}/*")],
        Op.DELETE: [lambda: w.rm(f"{root}/copy")],
    }
    for op, fns in calls.items():
        w.set_plan(FaultPlan(**{_field(op): OpFaults(error_p=1.0)}))
        for fn in fns:
            with pytest.raises(OSError, match="503"):
                fn()
    assert w.injected()[FaultKind.ERROR] == sum(map(len, calls.values()))
    assert not fs.exists(f"{root}/copy") and not fs.exists(f"{root}/touched")
    w.set_plan(FaultPlan())
    for fns in calls.values():
        for fn in fns:
            fn()
    assert open(local, "rb").read() == PAYLOAD and _stored(fs, f"{root}/put") == PAYLOAD
    assert not fs.exists(f"{root}/copy")  # copied, then removed
    names = {p.rstrip("/").rsplit("/", 1)[-1] for p in w.glob(f"{root}/*")}
    assert names == {"obj", "put", "touched", "piped"}


def test_concurrent_callers_draw_the_seeded_sequence_between_them():
    fs = fsspec.filesystem("memory")
    path = f"/conc-{uuid.uuid4().hex[:8]}/obj"
    fs.pipe_file(path, PAYLOAD)
    plan = FaultPlan(read=OpFaults(error_p=0.3, corrupt_p=0.3, truncate_p=0.3), seed=11)
    threads, per_thread = 4, 50
    expected = _outcomes(FaultyFileSystem(fs, plan), path, threads * per_thread)
    w = FaultyFileSystem(fs, plan)
    results: list[list] = [[] for _ in range(threads)]
    start = threading.Barrier(threads)

    def run(i: int) -> None:
        start.wait()
        results[i] = _outcomes(w, path, per_thread)

    pool = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in pool)
    # each call takes the next draws under the lock: together the threads saw the sequential run
    assert Counter(o for r in results for o in r) == Counter(expected)
    assert w.injected()[FaultKind.ERROR] == expected.count("OSError")


@pytest.mark.parametrize(("method", "path", "op"), [
    ("GET", "b/{}/o", Op.LIST),
    ("GET", "b", Op.LIST),
    ("GET", "b/{}/o/{}", Op.METADATA),
    ("GET", "b/hicache-test", Op.METADATA),
    ("GET", "http://127.0.0.1:9023/download/storage/v1/b/bkt/o/a%2Fb?alt=media", Op.READ),
    ("GET", "http://127.0.0.1:9023/storage/v1/b/bkt/o?prefix=a", Op.LIST),
    ("POST", "http://127.0.0.1:9023/upload/storage/v1/b/bkt/o", Op.WRITE),
    ("DELETE", "b/{}/o/{}", Op.DELETE),
])
def test_request_classes(method, path, op):
    assert request_op(method, path) is op
