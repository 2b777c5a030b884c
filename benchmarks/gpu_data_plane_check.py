"""GPU data-plane check: L1 (device HBM) <-> L2 (``pinned_host``) round trips are bit-identical.

Runs on whatever backend JAX picks (meant for a machine with a GPU; on CPU it checks the CPU paths).
For each page layout below, one ``HostWorker`` on the first device: random pages are written into L1,
backed up to random L2 slots (D2H), L1 is overwritten with other data, and the slots are loaded back
into other L1 pages (H2D); the loaded pages must equal what was written, bit for bit. Mixed plans
(D2H and H2D in one plan) and a long chain of alternating plans check the seq-order rule. Prints the
kernel implementation that was chosen, and exits non-zero on any mismatch.

    python benchmarks/gpu_data_plane_check.py [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from hicache.workers import HostWorker, KVCacheSpec, OpKind, TransferOp, TransferPlan  # noqa: E402

SPECS = {
    "bf16_small": KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, dtype="bfloat16"),
    "f32_1k": KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, page_size=16, dtype="float32"),
    "bf16_128k": KVCacheSpec(num_layers=4, num_kv_heads=8, head_dim=64, page_size=16, dtype="bfloat16"),
}
NUM_PAGES, NUM_SLOTS, WAIT_S = 256, 192, 120.0
_ids = itertools.count(1)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.dtype(f"u{a.dtype.itemsize}"))


def _pages(worker: HostWorker, n: int, rng: np.random.Generator) -> np.ndarray:
    shape = (n, *worker.device_pool.host_row_shape)
    return rng.standard_normal(shape, dtype=np.float32).astype(worker.device_pool.dtype)


def _run(worker: HostWorker, *ops: tuple[str, np.ndarray, np.ndarray]) -> None:
    plan = TransferPlan(next(_ids), tuple(
        TransferOp(next(_ids), OpKind(kind), np.asarray(p, np.int32), np.asarray(s, np.int32)) for kind, p, s in ops))
    worker.submit(plan)
    acks = worker.wait(timeout_s=WAIT_S)
    bad = [a for a in acks if not a.ok]
    if bad:
        raise RuntimeError(f"failed acks: {bad}")


def check(name: str, spec: KVCacheSpec, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    worker = HostWorker(spec, NUM_PAGES, NUM_SLOTS, devices=[jax.devices()[0]])
    dp = worker.device_pool
    try:
        n = 96
        src = rng.choice(NUM_PAGES, n, replace=False)
        slots = rng.choice(NUM_SLOTS, n, replace=False)
        data = _pages(worker, n, rng)
        dp.write_pages(src, data)
        t0 = time.perf_counter()
        _run(worker, ("d2h", src, slots))
        d2h_s = time.perf_counter() - t0
        dp.write_pages(np.arange(NUM_PAGES), _pages(worker, NUM_PAGES, rng))  # L1 overwritten
        dst = rng.permutation(NUM_PAGES)[:n]
        t0 = time.perf_counter()
        _run(worker, ("h2d", dst, slots))
        h2d_s = time.perf_counter() - t0
        round_trip = bool(np.array_equal(_bits(dp.read_pages(dst)), _bits(data)))
        # mixed plans in seq order (a D2H of pages a, then an H2D of the same slots into pages b),
        # against a numpy shadow of the whole L1 pool
        shadow = dp.read_pages(np.arange(NUM_PAGES))
        for _ in range(8):
            pages = rng.choice(NUM_PAGES, 8, replace=False)
            s = rng.choice(NUM_SLOTS, 4, replace=False)
            fresh = _pages(worker, 4, rng)
            dp.write_pages(pages[:4], fresh)
            shadow[pages[:4]] = fresh
            _run(worker, ("d2h", pages[:4], s), ("h2d", pages[4:], s))
            shadow[pages[4:]] = fresh
        mixed = bool(np.array_equal(_bits(dp.read_pages(np.arange(NUM_PAGES))), _bits(shadow)))
        nbytes = data.nbytes
        return {
            "layout": name, "backend": jax.default_backend(), "device": str(jax.devices()[0]),
            "impl": worker.engine.impl.value, "page_bytes": nbytes // n,
            "round_trip_bit_identical": round_trip, "mixed_plans_bit_identical": mixed,
            "d2h_ms_first": round(d2h_s * 1e3, 2), "h2d_ms_first": round(h2d_s * 1e3, 2),
        }
    finally:
        worker.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print("devices:", jax.devices(), "memory kinds:",
          [m.kind for m in jax.devices()[0].addressable_memories()], flush=True)
    records = [check(name, spec, seed) for seed, (name, spec) in enumerate(SPECS.items())]
    for r in records:
        print(json.dumps(r), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    ok = all(r["round_trip_bit_identical"] and r["mixed_plans_bit_identical"] for r in records)
    print("GPU data plane check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
