"""One sgl-jax host of a multi-host test: starts an Engine with ``node_rank`` >= 1 in this process and keeps it
until stdin closes (then stops its own subprocesses). Run as a script by ``sgl_jax_hosts.other_ranks``.

    python sgl_jax_rank.py MODEL RANK NNODES DIST_INIT_ADDR {sgl-jax,hicache} OVERRIDES_JSON [HICACHE_OPTIONS_JSON]
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    model, rank, nnodes, dist, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    overrides = json.loads(sys.argv[6])  # server args beyond host_kwargs': the same on every rank
    hicache = json.loads(sys.argv[7]) if len(sys.argv) > 7 else {}  # HiCacheOptions' fields: rank 0's
    os.environ["SGLANG_BLOCK_NONZERO_RANK_CHILDREN"] = "0"  # the Engine returns once its scheduler is ready
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from support.sgl_jax_hosts import host_kwargs

    from hicache.sgl_jax.engine import start_recording_processes, stop_processes

    kwargs = host_kwargs(model, rank, nnodes, dist, **overrides)
    if mode == "hicache":
        from hicache.sgl_jax import Engine, HiCacheOptions

        options = HiCacheOptions(**hicache)
        _, processes = start_recording_processes(lambda: Engine(**kwargs, hicache=options))
    else:
        from sgl_jax.srt.entrypoints.engine import Engine as SglEngine

        _, processes = start_recording_processes(lambda: SglEngine(**kwargs))
    print("ready", flush=True)
    sys.stdin.read()  # until the test closes it
    stop_processes(processes)


if __name__ == "__main__":
    main()
