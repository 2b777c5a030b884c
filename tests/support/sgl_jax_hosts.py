"""sgl-jax on several "hosts" of this machine (``nnodes`` processes, gloo collectives on CPU): rank 0's Engine
in the test process, the other ranks' in subprocesses (``sgl_jax_rank.py``), one CPU device each."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from support.sgl_jax_env import engine_kwargs, single_device_env

RANK_SCRIPT = Path(__file__).with_name("sgl_jax_rank.py")
START_TIMEOUT_S = 300


def host_kwargs(model: str | Path, rank: int, nnodes: int, dist_init_addr: str, **overrides: Any) -> dict[str, Any]:
    return engine_kwargs(Path(model), nnodes=nnodes, node_rank=rank, tp_size=nnodes, dist_init_addr=dist_init_addr,
                         **overrides)


def free_port_range(width: int = 8) -> int:
    """A port p with p .. p + width - 1 free now (sgl-jax and hicache use dist_init_addr's port + 0 .. + 7)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + width > 65535:
            continue
        try:
            held = []
            for p in range(base, base + width):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError("no range of free ports found")


@contextmanager
def other_ranks(model: Path, nnodes: int, dist_init_addr: str, mode: str, overrides: dict[str, Any],
                hicache: dict[str, Any] | None = None) -> Iterator[None]:
    """Ranks 1 .. nnodes - 1 (``mode``: "sgl-jax" or "hicache"; ``overrides``: server args, ``hicache``:
    ``HiCacheOptions`` fields, both rank 0's too) while the block runs; rank 0 is the caller's."""
    procs = []
    with single_device_env():
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("JAX_CPU_COLLECTIVES_IMPLEMENTATION", "gloo")
            for rank in range(1, nnodes):
                args = [sys.executable, str(RANK_SCRIPT), str(model), str(rank), str(nnodes), dist_init_addr, mode,
                        json.dumps(overrides)]
                procs.append(subprocess.Popen([*args, json.dumps(hicache or {})], stdin=subprocess.PIPE,
                                              env=dict(os.environ), text=True))
    try:
        yield
    finally:
        for proc in procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
