"""L3 on gs:// (the in-process GCS emulator) behind the seeded fault wrapper, for an embedded stack.

Used by ``benchmarks/l3_faults.py`` and ``tests/cluster/test_l3_faults.py``: ``gcs_emulator()``
serves a bucket on 127.0.0.1 for the duration of a ``with``; ``attach_faulty_l3`` gives a built
stack (``hicache.reference.stack.build_stack``) the L3 ``faulty::gs://...`` with a ``FaultPlan``, and
returns the worker's ``FaultyFileSystem`` (``set_plan`` / ``release_hangs`` / ``wait_for_hangs`` /
``injected``) so a caller switches faults while the stack serves.

Runs on the caller's thread; the wrapper and the emulator are safe to drive from any thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from hicache.cluster.storage_tier import StorageParams
from hicache.storage import StorageConfig
from hicache.storage.fault_injection import FaultPlan

BUCKET = "hicache-faults"
# The emulator serves one request at a time over HTTP/1.0 (a connection per request) with
# socketserver's listen backlog of 5: a 6th concurrent connection's SYN is dropped and retried by
# the kernel 1 s later, a stall no GCS endpoint has. A deeper backlog queues them instead.
EMULATOR_BACKLOG = 1024
# gcsfs options of every client: anonymous (the emulator), no caches (other stacks' writes are seen)
GS_OPTIONS = {"token": "anon", "skip_instance_cache": True, "use_listings_cache": False}


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gcs_emulator(bucket: str = BUCKET, *, own_process: bool = False) -> Iterator[str]:
    """Starts gcp-storage-emulator in memory on 127.0.0.1 (``STORAGE_EMULATOR_HOST`` set meanwhile);
    yields ``gs://BUCKET``. Enter it before gcsfs is imported: gcsfs reads
    ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` (off here: the emulator speaks no gRPC) on import.
    ``own_process``: the emulator runs in a child process (timings: an in-process server's threads
    take the serving thread's GIL). Either way its listen backlog is ``EMULATOR_BACKLOG``. Reuses one already named by ``STORAGE_EMULATOR_HOST`` (it
    creates ``bucket`` there)."""
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        import gcsfs

        fs = gcsfs.GCSFileSystem(**GS_OPTIONS)
        if not fs.exists(bucket):
            fs.mkdir(bucket)
        yield f"gs://{bucket}"
        return
    port = _free_loopback_port()
    saved = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")}
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    try:
        if own_process:
            with _emulator_process(port, bucket):
                yield f"gs://{bucket}"
        else:
            from http import server as http_server

            from gcp_storage_emulator.server import create_server

            server = create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
            saved_backlog = http_server.HTTPServer.request_queue_size
            http_server.HTTPServer.request_queue_size = EMULATOR_BACKLOG  # (read when it listens, in start)
            try:
                server.start()
            finally:
                http_server.HTTPServer.request_queue_size = saved_backlog
            try:
                yield f"gs://{bucket}"
            finally:
                server.stop()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _emulator_process(port: int, bucket: str, start_timeout_s: float = 60.0) -> Iterator[None]:
    code = (f"import sys; from http import server; server.HTTPServer.request_queue_size = {EMULATOR_BACKLOG}; "
            "from gcp_storage_emulator.__main__ import main; sys.exit(main())")
    cmd = [sys.executable, "-c", code,
           "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory", "--default-bucket", bucket, "-q"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:  # setup, not synchronisation of the code under test: wait until it listens
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"gcp-storage-emulator did not start on 127.0.0.1:{port}") from None
                time.sleep(0.1)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def faulty_storage_config(plan: FaultPlan, **config: Any) -> StorageConfig:
    """``StorageConfig(**config)`` whose client reads and writes through the wrapper with ``plan``."""
    return StorageConfig(storage_options={"faulty": {"plan": plan}, "gs": dict(GS_OPTIONS)}, **config)


def attach_faulty_l3(stack: Any, gs_url: str, plan: FaultPlan | None = None, *,
                     clock: Callable[[], float] | None = None, settle: bool = True,
                     storage: StorageConfig | None = None, **params: Any) -> Any:
    """Replaces the L3 of ``stack`` (an ``EmbeddedStack`` built with any ``l3_url``) with
    ``faulty::<gs_url>`` under ``plan``: same ``StorageParams`` but the URL, the storage config
    (``storage``'s fields, or defaults, with the wrapper's options) and ``params``. ``clock``: the
    breaker's (tests move it past the cooldown). ``settle``: wait for the attach's background warm
    restart (a healthy L3: a benchmark's setup). Returns the worker's ``FaultyFileSystem``."""
    plan = plan or FaultPlan()
    head = stack.head
    old = head.controller.storage.params
    head.detach_storage_backend()
    fields = {} if storage is None else {f.name: getattr(storage, f.name) for f in dataclasses.fields(storage)
                                         if f.name != "storage_options"}
    new = dataclasses.replace(old, url=f"faulty::{gs_url}", storage=faulty_storage_config(plan, **fields), **params)
    head.attach_storage_backend(StorageParams(**{f.name: getattr(new, f.name) for f in dataclasses.fields(new)}))
    store = stack.worker.storage_executor.storage
    if clock is not None:  # (attach's background probe may have run on the real clock already)
        store.breaker.use_clock(clock)
    if settle:
        head.controller.storage.settle(new.storage.list_timeout_s + new.storage.exists_timeout_s + 5.0)
    return store.fs


def worker_storage(stack: Any) -> Any:
    """The ``FsspecStorage`` of the stack's host worker (its stats, its breaker)."""
    return stack.worker.storage_executor.storage
