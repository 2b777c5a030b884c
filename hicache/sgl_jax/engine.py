"""``Engine``: sgl-jax's offline Engine, serving with hicache as its prefix cache.

The same class and API as ``sgl_jax.srt.entrypoints.engine.Engine`` (``generate``, ``shutdown``, ...),
plus one keyword, ``hicache=HiCacheOptions(...)``, and ``hicache_stats()``. Options and server args are
checked here, in the caller's process, before sgl-jax starts anything; the scheduler subprocess gets
hicache through ``hicache.sgl_jax.launch``. Runs in the caller's process (the tokenizer side).

``shutdown`` stops this Engine's own subprocesses (scheduler, detokenizer) only: sgl-jax's kills every
child of the calling process, which would take down anything else the caller started (Ray, other
Engines, a test session's services).
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

from sgl_jax.srt.entrypoints import engine as sgl_engine
from sgl_jax.srt.server_args import ServerArgs

from hicache.sgl_jax import seams
from hicache.sgl_jax.hits import hit_tokens_by_tier
from hicache.sgl_jax.launch import launching
from hicache.sgl_jax.options import HiCacheOptions, check_server_args
from hicache.sgl_jax.scheduler import STATS_KEY

T = TypeVar("T")
log = logging.getLogger(__name__)


def start_recording_processes(start: Callable[[], T]) -> tuple[T, list[BaseProcess]]:
    """Runs ``start`` and returns its result with the ``multiprocessing`` children it started."""
    before = {p.pid for p in multiprocessing.active_children()}
    result = start()
    return result, [p for p in multiprocessing.active_children() if p.pid not in before]


def stop_processes(processes: list[BaseProcess]) -> None:
    """Kills each process with its descendants, and reaps it."""
    from sgl_jax.srt.utils import kill_process_tree

    for proc in processes:
        if proc.pid is not None and proc.is_alive():
            kill_process_tree(proc.pid)
        proc.join(timeout=30)


class Engine(sgl_engine.Engine):
    def __init__(self, *, hicache: HiCacheOptions | None = None, **kwargs: Any) -> None:
        seams.require()
        options = HiCacheOptions() if hicache is None else hicache
        if not isinstance(options, HiCacheOptions):
            raise TypeError(f"hicache must be a HiCacheOptions, got {type(options).__name__}")
        server_args = kwargs.pop("server_args", None)
        if server_args is None:
            server_args = ServerArgs(**{"log_level": "error", **kwargs})  # sgl-jax's own default log level
        elif kwargs:
            raise ValueError(f"pass either server_args or server arguments, not both (got {sorted(kwargs)})")
        check_server_args(server_args, options)
        self._processes: list[BaseProcess] = []
        self.hicache_options = options
        with launching(options):
            _, self._processes = start_recording_processes(lambda: super(Engine, self).__init__(server_args=server_args))

    def shutdown(self) -> None:
        """Stops this Engine's subprocesses (see the module docstring); with L3, first flushes the cache
        (sgl-jax's ``flush_cache``: the head waits for its L2->L3 writes and writes its manifest), so that a
        later engine on the same L3 finds everything this one stored."""
        processes, self._processes = self._processes, []
        if processes and self.hicache_options.l3_url is not None and all(p.is_alive() for p in processes):
            try:
                self.flush_cache()
            except Exception as e:  # a scheduler that is gone loses only writes not yet stored: later misses
                log.warning("hicache: could not flush the cache before shutdown (%s: %s)", type(e).__name__, e)
        stop_processes(processes)

    def hit_tokens_by_tier(self, cached_tokens: int) -> dict[str, int]:
        """Prompt tokens served from each tier since start (``hits.hit_tokens_by_tier``); ``cached_tokens``:
        the sum of sgl-jax's ``meta_info["cached_tokens"]`` over the outputs."""
        return hit_tokens_by_tier(self.hicache_stats(), cached_tokens)

    def hicache_stats(self) -> dict[str, Any]:
        """The head's statistics (tree, L1 occupancy, hits), read from the scheduler process."""
        states = self.get_server_info()["internal_states"]
        return states[0][STATS_KEY]
