"""sgl-jax's HTTP server (its OpenAI-compatible and native API) serving through hicache.

``launch_server(server_args, options)`` checks the seams and the server args, then runs sgl-jax's own
``http_server.launch`` while ``hicache.sgl_jax.launch.launching(options)`` is active: sgl-jax starts its
scheduler subprocess through the same engine-module launcher the offline Engine uses, so the scheduler
gets hicache the same way. It blocks until the server exits and runs in the server's process (a process
of its own: the launcher rebinding stays active for the server's lifetime). ``main`` is the command
line: ``python -m hicache.sgl_jax [--hicache-eviction-policy P] [--hicache-replica NAME]
[--hicache-host-pages N] [--hicache-write-policy P] [--hicache-l3-url URL] <sgl-jax server arguments>``.
The head's statistics appear in ``/get_server_info`` under ``internal_states[0]["hicache"]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from hicache.cluster.policy import WritePolicy
from hicache.cluster.tree import EvictionPolicy
from hicache.sgl_jax import seams
from hicache.sgl_jax.launch import launching
from hicache.sgl_jax.options import HiCacheOptions, check_server_args


def launch_server(server_args: Any, options: HiCacheOptions | None = None) -> None:
    """Runs sgl-jax's HTTP server with hicache as its prefix cache (blocks; see the module docstring)."""
    seams.require(http=True)
    options = HiCacheOptions() if options is None else options
    if not isinstance(options, HiCacheOptions):
        raise TypeError(f"options must be a HiCacheOptions, got {type(options).__name__}")
    check_server_args(server_args, options)
    from sgl_jax.srt.entrypoints import http_server

    with launching(options):
        http_server.launch(server_args)


def parse_args(argv: Sequence[str]) -> tuple[HiCacheOptions, Any]:
    """hicache's own flags, then everything else as sgl-jax's server arguments (``--model-path`` required)."""
    parser = argparse.ArgumentParser(prog="python -m hicache.sgl_jax", add_help=False)
    parser.add_argument("--hicache-eviction-policy", default=EvictionPolicy.LRU.value,
                        choices=[p.value for p in EvictionPolicy])
    parser.add_argument("--hicache-replica", default=HiCacheOptions.replica)
    parser.add_argument("--hicache-host-pages", type=int, default=0, help="L2 pages (0: L1 only)")
    parser.add_argument("--hicache-write-policy", default=WritePolicy.WRITE_THROUGH.value,
                        choices=[p.value for p in WritePolicy])
    parser.add_argument("--hicache-l3-url", default=None, help="fsspec URL of L3 (file:///path, gs://bucket/prefix)")
    ours, rest = parser.parse_known_args(list(argv))
    options = HiCacheOptions(replica=ours.hicache_replica, eviction_policy=ours.hicache_eviction_policy,
                             host_pages=ours.hicache_host_pages, write_policy=ours.hicache_write_policy,
                             l3_url=ours.hicache_l3_url)
    if not rest:
        raise SystemExit("python -m hicache.sgl_jax: sgl-jax's server arguments are missing (--model-path ...)")
    seams.require()
    from sgl_jax.srt.server_args import ServerArgs

    return options, ServerArgs.from_cli(rest)


def main(argv: Sequence[str] | None = None) -> None:
    import sys

    options, server_args = parse_args(sys.argv[1:] if argv is None else argv)
    launch_server(server_args, options)
