"""Engine micro-benchmark: the per-request cost of ``ModelRunner.prefill`` and of a batched decode
iteration (``hicache.reference.engine.batched.decode_steps``), in the multiturn benchmark's model and forward
shape (``benchmarks.workload.MODEL`` / ``FWD``, an L1 of 118 pages).

Cases: prefills after a cached prefix (1, 3 and 8 chunks of 16 tokens) and from position 0 (26
chunks, a no-reuse request), and decode iterations of B = 1, 3, 4, 5, 7, 8 requests of ~300 tokens. Each case
runs ``--reps`` rounds of ``--calls`` calls, the cases interleaved round by round; printed: the median
call (wall and this process's CPU time, ms) over all calls, and the best round's median. Compare two
trees by running this file from each, alternated (A B A B ...): one run on a shared 2-CPU machine
proves little.

``--scan-chunks N``: the runner's ``scan_chunks`` (default: ``runner.SCAN_CHUNKS_DEFAULT``; 32 dispatches a
prefill's chunks in power-of-two scans).

    python benchmarks/engine_bench.py [--reps 5] [--calls 40] [--scan-chunks 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks.workload import FWD, MODEL  # noqa: E402
from hicache.reference.engine import batched  # noqa: E402
from hicache.reference.engine.runner import ModelRunner  # noqa: E402

L1_PAGES = 118
PREFILLS = {  # name: (prompt length, start position)
    "prefill_1chunk": (200, 192),
    "prefill_3chunks": (181, 144),
    "prefill_8chunks": (192, 64),
    "prefill_26chunks_no_prefix": (400, 0),
}
DECODE_BATCHES = (1, 3, 4, 5, 7, 8)


def cases(runner: ModelRunner, rng: np.random.Generator) -> dict:
    """name -> a zero-argument call. Prefills write pages 0..50; decode request ``i`` (300 - 9i
    tokens) reads pages 51..90 and writes its own page 100 + i."""
    toks = rng.integers(0, MODEL.vocab_size, 512).astype(np.int32)
    table = rng.permutation(51).astype(np.int32)
    out = {}
    for name, (n, start) in PREFILLS.items():
        out[name] = lambda n=n, start=start: runner.prefill(toks[:n], table, start)
    seqs = [rng.integers(0, MODEL.vocab_size, 300 - 9 * i).astype(np.int32) for i in range(8)]
    tables = []
    for i, s in enumerate(seqs):
        t = np.arange(51, 51 + 40, dtype=np.int32) if i == 0 else tables[0].copy()
        last = (s.size - 1) // FWD.page_size
        t[last] = 100 + i
        tables.append(t)
    for b in DECODE_BATCHES:
        out[f"decode_steps_B{b}"] = lambda b=b: batched.decode_steps(runner, seqs[:b], tables[:b])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--scan-chunks", type=int, default=None)
    p.add_argument("--json")
    args = p.parse_args()
    scan = {} if args.scan_chunks is None else {"scan_chunks": args.scan_chunks}  # (older runners: no such option)
    runner = ModelRunner(MODEL, FWD, num_pages=L1_PAGES, **scan)
    batched.compile_batches(runner, max(DECODE_BATCHES))
    calls = cases(runner, np.random.default_rng(0))
    for fn in calls.values():  # compiles
        fn()
    wall: dict[str, list[list[float]]] = {k: [] for k in calls}
    cpu: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(args.reps):
        for name, fn in calls.items():
            rnd = []
            for _ in range(args.calls):
                c0, t0 = time.process_time(), time.perf_counter()
                fn()
                rnd.append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
            wall[name].append(rnd)
    rows = []
    print(f"{'case':28s} {'wall ms':>9s} {'best rnd':>9s} {'cpu ms':>9s}")
    for name in calls:
        all_wall = [w for rnd in wall[name] for w in rnd]
        row = {"case": name, "wall_ms": 1e3 * float(np.median(all_wall)),
               "best_round_ms": 1e3 * min(float(np.median(r)) for r in wall[name]),
               "cpu_ms": 1e3 * float(np.median(cpu[name]))}
        rows.append(row)
        print(f"{name:28s} {row['wall_ms']:9.3f} {row['best_round_ms']:9.3f} {row['cpu_ms']:9.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
