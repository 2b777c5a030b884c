"""Starting sgl-jax's scheduler subprocess with hicache inside it.

sgl-jax's Engine starts its scheduler with ``multiprocessing`` "spawn": the child imports the target
function by name and receives its arguments pickled, and inherits nothing else from the parent (no
monkeypatch survives). So, while one Engine starts, ``launching(options)`` rebinds the target sgl-jax's
``_launch_subprocesses`` passes to ``mp.Process`` (its module global ``run_scheduler_process``) to
``partial(run_scheduler_process, options)`` of this module; the child imports this module, checks the
seams, ``install``s hicache's scheduler and cache there and runs sgl-jax's own ``run_scheduler_process``.
The rebinding is undone as soon as the Engine has started (the parent keeps no patch).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hicache.sgl_jax.options import HiCacheOptions

_launch_lock = threading.Lock()  # one Engine start at a time rebinds sgl-jax's launcher global


def run_scheduler_process(options: HiCacheOptions, server_args: Any, port_args: Any, dp_rank: Any,
                          pipe_writer: Any) -> None:
    """The scheduler subprocess's entry point (spawn target): hicache in, then sgl-jax's own entry point."""
    from hicache.sgl_jax import seams

    seams.require()
    from sgl_jax.srt.managers import scheduler as sgl_scheduler

    from hicache.sgl_jax.scheduler import install

    install(options)
    sgl_scheduler.run_scheduler_process(server_args, port_args, dp_rank, pipe_writer)


@contextmanager
def launching(options: HiCacheOptions) -> Iterator[None]:
    """While active, sgl-jax Engines start their scheduler subprocess with hicache (see the docstring)."""
    from sgl_jax.srt.entrypoints import engine as sgl_engine

    with _launch_lock:
        original = sgl_engine.run_scheduler_process
        sgl_engine.run_scheduler_process = functools.partial(run_scheduler_process, options)
        try:
            yield
        finally:
            sgl_engine.run_scheduler_process = original
