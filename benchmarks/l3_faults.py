"""Multi-turn chat with L3 on a failing network (issue #23): gs:// on the GCS emulator behind the
seeded fault wrapper, one fault at a time.

The request stream is multiturn's (``multiturn.make_workload`` / ``build_stream``: N clients x R
rounds, each turn the whole history plus new tokens; the engine without cache decides the answers,
which are the reference outputs). For each fault, in its own prefix of the bucket:

1. fill: a stack with a healthy L3 serves the stream (L3 gets every turn's pages and the manifest);
2. serve: a cold stack (empty L1/L2, same L3) with the fault on serves the stream again, one
   request at a time; each output is compared with the reference (``wrong_outputs``), each TTFT is
   the stack's (``ServeResult.ttft_s``);
3. check: the fault off (hung calls released), the objects stored after the fill that are gone
   (``intact_objects_deleted``: no fault here changes stored bytes, so any missing object was
   deleted by hicache).

Faults (``FAULTS``): none, read bytes flipped (30% of reads), reads truncated (30%), 503s (30% of
every call), hangs (20% of every call), refused connections (every call), 200 ms latency (every
call), bucket deleted (every call). ``no_cache_ttft_mean_s``: the engine alone (no tree, no L3) on
the same stream, measured in the same run. Targets: 0 wrong outputs and 0 intact objects deleted
everywhere; under hangs and refused connections max TTFT <= 2 s and mean TTFT <= 1.1x no-cache.

    python -m benchmarks.l3_faults --json out.json [--quick]

The emulator runs in a child process (an in-process server would take the serving thread's GIL).
Storage runs with ``StorageConfig``'s defaults (deadlines, breaker), the stack's defaults otherwise
(prefetch wait_complete, bounded by ``StorageParams.prefetch_wait_max_s``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.chat_l3 import chat_sizes, close_stack, prepare_chat, serve_stream
from benchmarks.faulty_l3 import GS_OPTIONS, attach_faulty_l3, gcs_emulator, worker_storage
from benchmarks.report import jsonable
from benchmarks.workload import Stream, log
from hicache.reference.engine.runner import ModelRunner
from hicache.reference.stack import build_stack
from hicache.storage.fault_injection import FaultPlan, OpFaults

SEED = 23


@dataclass(frozen=True)
class Fault:
    name: str
    plan: FaultPlan


FAULTS = (
    Fault("none", FaultPlan()),
    Fault("flips_30pct", FaultPlan(read=OpFaults(corrupt_p=0.3), seed=SEED)),
    Fault("truncations_30pct", FaultPlan(read=OpFaults(truncate_p=0.3), seed=SEED)),
    Fault("errors_503_30pct", FaultPlan.every(OpFaults(error_p=0.3), seed=SEED)),
    Fault("hangs_20pct", FaultPlan.every(OpFaults(hang_p=0.2), seed=SEED)),
    Fault("refused", FaultPlan.every(OpFaults(refuse_p=1.0), seed=SEED)),
    Fault("latency_200ms", FaultPlan.every(OpFaults(latency_s=0.2), seed=SEED)),
    Fault("bucket_deleted", FaultPlan(bucket_deleted=True, seed=SEED)),
)
TIGHT = ("hangs_20pct", "refused")  # TTFT targets apply under these


def _objects(url: str) -> set[str]:
    import gcsfs  # (imported once the emulator set its environment)

    return set(gcsfs.GCSFileSystem(**GS_OPTIONS).find(url.removeprefix("gs://")))


def run_fault(fault: Fault, runner: ModelRunner, stream: Stream, options, bucket: str) -> dict:
    url = f"{bucket}/l3-faults-{fault.name}-{time.time_ns()}"
    warm = build_stack(options, runner)
    attach_faulty_l3(warm, url)
    wrong_fill, _, _ = serve_stream(warm, stream)
    close_stack(warm)
    stored = _objects(url)
    cold = build_stack(options, runner)
    fs = attach_faulty_l3(cold, url, fault.plan, settle=False)  # starts as a replica would: no wait
    wrong, ttfts, l3 = serve_stream(cold, stream)
    stats = worker_storage(cold).stats()
    cache = cold.head.cache_stats()
    fs.set_plan(FaultPlan())
    fs.release_hangs()
    close_stack(cold)
    gone = stored - _objects(url)
    return {
        "name": fault.name,
        "wrong_outputs": int(wrong + wrong_fill),
        "intact_objects_deleted": len(gone),
        "ttft_mean_s": sum(ttfts) / len(ttfts),
        "ttft_max_s": max(ttfts),
        "l3_hit_tokens": int(l3),
        "requests": len(ttfts),
        "objects_stored": len(stored),
        "injected": fs.injected(),
        "storage_errors": cache.get("storage_errors", {}),
        "l3_unavailable_miss_tokens": cache["miss_tokens"].get("l3_unavailable", 0),
        "breaker_opens": stats.breaker_opens,
        "corrupt_deleted": stats.corrupt_deleted,
    }


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, help="where to write the results")
    p.add_argument("--quick", action="store_true", help="a small stream (CI smoke test)")
    p.add_argument("--faults", nargs="*", default=[f.name for f in FAULTS], choices=[f.name for f in FAULTS])
    return chat_sizes(p.parse_args(argv), SEED)


def main(argv: Sequence[str] | None = None) -> dict:
    args = _args(argv)
    chat = prepare_chat(args, "memory://l3-faults-placeholder")  # L3 replaced by the faulty gs:// one per stack
    runner, stream, options, no_cache_mean = chat.runner, chat.stream, chat.options, chat.no_cache_ttft_mean_s
    out = []
    with gcs_emulator(own_process=True) as bucket:
        for fault in (f for f in FAULTS if f.name in args.faults):
            log(f"fault {fault.name}")
            rec = run_fault(fault, runner, stream, options, bucket)
            rec["no_cache_ttft_mean_s"] = no_cache_mean
            out.append(rec)
            log(f"  wrong {rec['wrong_outputs']}  deleted {rec['intact_objects_deleted']}  "
                f"ttft mean {rec['ttft_mean_s'] * 1e3:.1f} ms  max {rec['ttft_max_s'] * 1e3:.1f} ms  "
                f"(no cache {no_cache_mean * 1e3:.1f} ms)  l3 hit tokens {rec['l3_hit_tokens']}")
    result = {"faults": out, "targets": targets(out), "requests": len(stream.items), "quick": args.quick}
    with open(args.json, "w") as f:
        json.dump(jsonable(result), f, indent=2)
    print_table(out)
    return result


def targets(records: Sequence[dict]) -> dict:
    """Each #23 target, met or not, with the figure it was judged on."""
    out = {}
    for r in records:
        out[f"{r['name']}: 0 wrong outputs"] = r["wrong_outputs"] == 0
        out[f"{r['name']}: 0 intact objects deleted"] = r["intact_objects_deleted"] == 0
        if r["name"] in TIGHT:
            out[f"{r['name']}: max TTFT <= 2 s"] = r["ttft_max_s"] <= 2.0
            out[f"{r['name']}: mean TTFT <= 1.1x no-cache"] = r["ttft_mean_s"] <= 1.1 * r["no_cache_ttft_mean_s"]
    return out


def print_table(records: Sequence[dict]) -> None:
    print(f"{'fault':<20}{'wrong':>6}{'deleted':>8}{'ttft mean ms':>13}{'ttft max ms':>12}{'no-cache ms':>12}{'L3 hit tok':>11}")
    for r in records:
        print(f"{r['name']:<20}{r['wrong_outputs']:>6}{r['intact_objects_deleted']:>8}{r['ttft_mean_s'] * 1e3:>13.1f}"
              f"{r['ttft_max_s'] * 1e3:>12.1f}{r['no_cache_ttft_mean_s'] * 1e3:>12.1f}{r['l3_hit_tokens']:>11}")


if __name__ == "__main__":
    main()
