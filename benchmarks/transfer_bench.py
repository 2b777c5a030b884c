"""L1 <-> L2 transfer throughput (HostWorker's engine) next to numpy memcpy of the same bytes.

    python benchmarks/transfer_bench.py --quick                      # ~1 min, 256 MiB pools
    python benchmarks/transfer_bench.py --json out/transfer.json     # 256 MiB and 4 GiB pools
    python benchmarks/transfer_bench.py --devices 4 --pool-mib 256   # heads sharded over 4 fake CPU devices

Each record: direction (d2h/h2d), batch_pages, page_bytes, pool_bytes (each of L1 and L2),
seconds (median per batch, ``submit`` to ack; plans are built before the clock starts), gbps, memcpy_gbps, pct_of_memcpy, backend, impl,
host_pool_kind, devices. The summary checks the issue's targets: per-batch cost at the largest pool
<= 1.25x the smallest, >= 25% of memcpy for batches >= 16 pages of >= 64 KiB, fixed cost <= 200 us,
peak RSS <= pools + 2 x batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--quick", action="store_true", help="256 MiB pools, fewer reps")
    ap.add_argument("--pool-mib", type=int, nargs="+", help="pool sizes in MiB (default 256 4096)")
    ap.add_argument("--page-kib", type=int, nargs="+", default=[16, 64, 1024])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--devices", type=int, default=1, help="fake CPU devices (CPU backend only)")
    ap.add_argument("--platform", default=None, help="JAX platform (cpu/gpu/tpu); default: JAX's choice")
    ap.add_argument("--host-pool-kind", default=None, choices=["numpy_slab", "pinned_pages"])
    ap.add_argument("--impl", default=None, choices=["xla", "pallas_tpu", "pallas_interpret"])
    return ap.parse_args()


ARGS = _parse()
if ARGS.platform:
    os.environ["JAX_PLATFORMS"] = ARGS.platform
if ARGS.devices > 1:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={ARGS.devices}").strip()

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import jax  # noqa: E402

from hicache.workers import HostWorker, KVCacheSpec, OpKind, TransferOp, TransferPlan  # noqa: E402

LAYERS, HEADS, HEAD_DIM, DTYPE = 4, 8, 64, "bfloat16"
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_DIM * 2  # 8 KiB per token


def _median_time(fn, reps: int) -> float:
    fn()
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def _memcpy_gbps(nbytes: int, reps: int) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    return nbytes / _median_time(lambda: np.copyto(dst, src), reps) / 1e9


def run() -> list[dict]:
    pools = ARGS.pool_mib or ([256] if ARGS.quick else [256, 4096])
    reps = ARGS.reps or (5 if ARGS.quick else 15)
    proc = psutil.Process()
    # Start the JAX runtime before the first RSS baseline (it is not a copy of any pool).
    jax.block_until_ready(jax.jit(lambda x: x + 1)(np.zeros(4, np.float32)))
    records: list[dict] = []
    seq = iter(range(1, 1 << 40))
    for pool_mib in pools:
        pool_bytes = pool_mib << 20
        for page_kib in ARGS.page_kib:
            page_bytes = page_kib << 10
            page_size = page_bytes // TOKEN_BYTES
            spec = KVCacheSpec(LAYERS, HEADS, HEAD_DIM, page_size, DTYPE)
            num = pool_bytes // page_bytes
            batches = [b for b in ARGS.batches if b <= num]
            rss0 = proc.memory_info().rss
            worker = HostWorker(spec, num, num, host_pool_kind=ARGS.host_pool_kind, impl=ARGS.impl)
            rng = np.random.default_rng(0)
            peak = proc.memory_info().rss
            for n in batches:
                # small batches are cheap: more reps make the fixed-cost median less noisy
                reps_n = reps * 8 if n * page_bytes <= 1 << 20 else reps
                memcpy = _memcpy_gbps(n * page_bytes, reps_n)
                for direction in ("d2h", "h2d"):
                    kind = OpKind.BACKUP_D2H if direction == "d2h" else OpKind.LOAD_H2D
                    # Plans (random ids, the head's work) are built before the clock starts: the
                    # timed part is submit -> ack, the worker's cost per batch.
                    plans = [
                        TransferPlan(next(seq), (TransferOp(0, kind, rng.choice(num, n, replace=False).astype(np.int32),
                                                            rng.choice(num, n, replace=False).astype(np.int32)),))
                        for _ in range(reps_n + 2)
                    ]
                    todo = iter(plans)

                    def one() -> None:
                        nonlocal peak
                        worker.submit(next(todo))
                        (ack,) = worker.wait(timeout_s=600)
                        assert ack.ok, ack.error
                        peak = max(peak, proc.memory_info().rss)

                    t = _median_time(one, reps_n)
                    gbps = n * page_bytes / t / 1e9
                    rec = dict(
                        direction=direction, batch_pages=n, page_bytes=page_bytes, pool_bytes=pool_bytes,
                        seconds=t, gbps=gbps, memcpy_gbps=memcpy, pct_of_memcpy=100 * gbps / memcpy,
                        backend=jax.default_backend(), impl=worker.engine.impl.value,
                        host_pool_kind=worker.host_pool.kind.value, devices=len(worker.device_pool.mesh.devices.flat),
                    )
                    records.append(rec)
                    print(f"pool={pool_mib:5d}MiB page={page_kib:5d}KiB n={n:4d} {direction}: "
                          f"{t * 1e6:9.0f} us {gbps:6.2f} GB/s  memcpy {memcpy:6.2f} GB/s ({rec['pct_of_memcpy']:5.1f}%)",
                          flush=True)
            budget = pool_bytes * 2 + 2 * max(batches) * page_bytes
            records.append(dict(direction="rss", batch_pages=max(batches), page_bytes=page_bytes, pool_bytes=pool_bytes,
                                peak_rss_over_start=peak - rss0, rss_budget=budget, gbps=None, memcpy_gbps=None))
            print(f"pool={pool_mib}MiB page={page_kib}KiB: peak RSS +{(peak - rss0) >> 20} MiB, "
                  f"budget (L1 + L2 + 2 x batch) {budget >> 20} MiB", flush=True)
            del worker
    return records


def summarize(records: list[dict]) -> dict:
    rows = [r for r in records if r["direction"] in ("d2h", "h2d")]
    pools = sorted({r["pool_bytes"] for r in rows})
    out: dict = {}
    if len(pools) > 1:
        small, big = pools[0], pools[-1]
        key = lambda r: (r["direction"], r["page_bytes"], r["batch_pages"])  # noqa: E731
        s = {key(r): r["seconds"] for r in rows if r["pool_bytes"] == small}
        ratios = {k: r["seconds"] / s[k] for r in rows if r["pool_bytes"] == big for k in [key(r)] if k in s}
        out["max_time_ratio_big_vs_small_pool"] = max(ratios.values())
        out["pool_growth_ok(<=1.25)"] = out["max_time_ratio_big_vs_small_pool"] <= 1.25
    big = [r for r in rows if r["batch_pages"] >= 16 and r["page_bytes"] >= 64 << 10]
    for d in ("d2h", "h2d"):
        pct = [r["pct_of_memcpy"] for r in big if r["direction"] == d]
        if pct:
            out[f"min_pct_of_memcpy_{d}(>=25)"] = min(pct)
    one = [r["seconds"] for r in rows if r["batch_pages"] == 1 and r["page_bytes"] == min(x["page_bytes"] for x in rows)]
    if one:
        out["fixed_cost_us(<=200)"] = 1e6 * max(one)
    rss = [r for r in records if r["direction"] == "rss"]
    out["rss_ok"] = all(r["peak_rss_over_start"] <= r["rss_budget"] for r in rss)
    return out


if __name__ == "__main__":
    recs = run()
    summary = summarize(recs)
    print(json.dumps(summary, indent=2))
    if ARGS.json:
        os.makedirs(os.path.dirname(os.path.abspath(ARGS.json)), exist_ok=True)
        with open(ARGS.json, "w") as f:
            json.dump(recs, f, indent=1)
    sys.exit(0)
