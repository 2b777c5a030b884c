"""L2<->L3 throughput of ``FsspecStorage`` next to raw fsspec on the same bytes, in the same run.

    python benchmarks/storage_bench.py [--scheme file|memory|gs] [--quick] [--json PATH]

For each scheme: fill a numpy host pool (``hicache.storage.testing.NumpyHostPool``, a real buffer)
with random pages, then

- put: ``batch_set`` (L2→L3: pool gather, checksum, header, write-once publish) vs raw fsspec
  ``pipe_file`` of byte strings of the same sizes and count (already in memory, no checksum);
- get: ``batch_get`` (L3→L2: existence, read, verify, scatter into slots) vs raw fsspec
  ``cat_file`` of those raw objects.

Each direction is measured ``--repeat`` times, alternating raw and ours, best time kept.
Records (``--json``): direction, scheme, gbps, raw_gbps, ratio, bytes, pages, page_bytes,
pages_per_object, objects, objects_per_page, header_bytes_per_object, per_object_overhead_us
(``(t_ours - t_raw) / objects``). gs:// runs against an in-process emulator (functional only:
the emulator is not a performance model of GCS). Target: ratio >= 0.7 on file://.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import uuid

import fsspec
import numpy as np

from hicache.storage import FsspecStorage, ModelFingerprint, Namespace, ShardCoord, StorageConfig, page_keys
from hicache.storage.testing import NumpyHostPool


def _emulator() -> tuple[object, str]:
    from gcp_storage_emulator.server import create_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    srv = create_server("127.0.0.1", port, in_memory=True, default_bucket="bench")
    srv.start()
    return srv, "gs://bench"


def run_scheme(scheme: str, args: argparse.Namespace, base: str) -> list[dict]:
    page_bytes = args.page_kib * 1024
    head_dim = 128
    # slot = [layers, 2, page, heads, head_dim] float16 → page_bytes
    tokens_per_page = 16
    heads = max(1, page_bytes // (2 * tokens_per_page * head_dim * 2 * 2))
    layers = 2
    fp = ModelFingerprint("bench", "float16", tokens_per_page, layers, heads, head_dim)
    slot_shape = (layers, 2, tokens_per_page, heads, head_dim)
    n_pages = max(1, (args.total_mib << 20) // (int(np.prod(slot_shape)) * 2))
    pool = NumpyHostPool(2 * n_pages, slot_shape, np.float16)
    pool.fill_random(np.arange(n_pages, dtype=np.int32), 0)
    opts = {"token": "anon"} if scheme == "gs" else {}
    cfg = StorageConfig(
        pages_per_object=args.pages_per_object,
        target_object_bytes=args.object_mib << 20,
        io_threads=args.threads,
        timeout_s=600,
        storage_options=opts,
    )
    src = np.arange(n_pages, dtype=np.int32)
    dst = np.arange(n_pages, 2 * n_pages, dtype=np.int32)
    best: dict[str, float] = {}
    info: dict[str, int] = {}
    for rep in range(args.repeat):
        tag = uuid.uuid4().hex[:8]
        url = f"{base}/bench-{tag}"
        raw_url = f"{base}/raw-{tag}"
        st = FsspecStorage(url, fp, cfg)
        st.register_host_pool(pool, shard=ShardCoord.full(fp))
        ppo = st.pages_per_object()
        ns = Namespace(fp, cache_salt=tag)
        keys = page_keys(ns, np.arange(n_pages * tokens_per_page) % 32000)
        # raw objects: same count and sizes as ours (header included), bytes prepared up front
        n_obj = -(-n_pages // ppo)
        sizes = [min(ppo, n_pages - i * ppo) * pool.slot_bytes for i in range(n_obj)]
        hdr = 124 + 4 * len(slot_shape) + 4
        payloads = [os.urandom(hdr) + pool.buf[i * ppo : i * ppo + sizes[i] // pool.slot_bytes].tobytes() for i in range(n_obj)]
        raw_fs, raw_root = fsspec.core.url_to_fs(raw_url, **({"skip_instance_cache": True, "use_listings_cache": False, **opts} if scheme == "gs" else opts))
        raw_paths = [f"{raw_root}/{k[:2]}/{k}" for k in (keys[min(n_pages, (i + 1) * ppo) - 1] for i in range(n_obj))]
        if scheme == "file":
            for d in {os.path.dirname(p) for p in raw_paths}:
                os.makedirs(d, exist_ok=True)
        batch = args.batch_pages - args.batch_pages % ppo or ppo

        t0 = time.perf_counter()
        for p, b in zip(raw_paths, payloads):
            raw_fs.pipe_file(p, b)
        t_raw_put = time.perf_counter() - t0

        t0 = time.perf_counter()
        for s in range(0, n_pages, batch):
            ok = st.batch_set(keys[s : s + batch], src[s : s + batch], first_page=s)
            assert all(ok), "batch_set failed"
        t_put = time.perf_counter() - t0

        t0 = time.perf_counter()
        for p in raw_paths:
            raw_fs.cat_file(p)
        t_raw_get = time.perf_counter() - t0

        t0 = time.perf_counter()
        for s in range(0, n_pages, batch):
            ok = st.batch_get(keys[s : s + batch], dst[s : s + batch], first_page=s)
            assert all(ok), "batch_get failed"
        t_get = time.perf_counter() - t0
        assert np.array_equal(pool.buf[:n_pages].view(np.uint8), pool.buf[n_pages:].view(np.uint8))

        for name, t in (("put", t_put), ("raw_put", t_raw_put), ("get", t_get), ("raw_get", t_raw_get)):
            best[name] = min(best.get(name, float("inf")), t)
        info = dict(ppo=ppo, n_obj=n_obj, hdr=hdr)
        st.clear()
        st.close()
        try:
            raw_fs.rm(raw_root, recursive=True)
        except FileNotFoundError:
            pass
    nbytes = n_pages * pool.slot_bytes
    out = []
    for d in ("put", "get"):
        t, tr = best[d], best["raw_" + d]
        out.append(
            dict(
                direction=d,
                scheme=scheme,
                gbps=nbytes / t / 1e9,
                raw_gbps=nbytes / tr / 1e9,
                ratio=tr / t,
                bytes=nbytes,
                pages=n_pages,
                page_bytes=pool.slot_bytes,
                pages_per_object=info["ppo"],
                objects=info["n_obj"],
                objects_per_page=info["n_obj"] / n_pages,
                header_bytes_per_object=info["hdr"],
                per_object_overhead_us=(t - tr) / info["n_obj"] * 1e6,
                threads=args.threads,
                repeat=args.repeat,
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scheme", action="append", choices=["file", "memory", "gs"], help="repeatable; default: file, memory, gs")
    ap.add_argument("--quick", action="store_true", help="small sizes, one repeat (smoke test)")
    ap.add_argument("--total-mib", type=int, default=256, help="bytes moved per direction")
    ap.add_argument("--page-kib", type=int, default=256, help="bytes per page (host slot)")
    ap.add_argument("--object-mib", type=int, default=4, help="target object size")
    ap.add_argument("--pages-per-object", type=int, default=None, help="overrides --object-mib")
    ap.add_argument("--batch-pages", type=int, default=256, help="pages per batch_set/batch_get call")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="directory for file:// (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write the records here")
    args = ap.parse_args(argv)
    if args.quick:
        args.total_mib, args.repeat = min(args.total_mib, 32), 1
    schemes = args.scheme or ["file", "memory", "gs"]
    records: list[dict] = []
    tmp = tempfile.mkdtemp(prefix="hicache-bench-", dir=args.dir)
    try:
        for scheme in schemes:
            a = argparse.Namespace(**vars(args))
            if scheme == "gs":  # functional only: keep it small
                a.total_mib, a.repeat = min(a.total_mib, 16), 1
                srv, base = _emulator()
            else:
                srv, base = None, (f"file://{tmp}" if scheme == "file" else f"memory://hicache-bench")
            try:
                recs = run_scheme(scheme, a, base)
            finally:
                if srv is not None:
                    srv.stop()
            for r in recs:
                print(
                    f"{r['scheme']:>6} {r['direction']:>3}: {r['gbps']:6.2f} GB/s  raw {r['raw_gbps']:6.2f} GB/s  "
                    f"ratio {r['ratio']:.2f}  {r['objects']} objects x {r['pages_per_object']} pages of "
                    f"{r['page_bytes'] >> 10} KiB  overhead {r['per_object_overhead_us']:.0f} us/object"
                )
            records += recs
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
