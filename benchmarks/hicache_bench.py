"""HiCache L1+L2 benchmark on the multi-turn chat workload (issue: HiCache L1<->L2).

Configs, same request stream, same scheduler steps (``--step-requests`` requests each), page size 16:
  * bare tree, L1 only (tree ops only)            -> bare_tree_requests_per_s, hit_rate_l1_only
  * single LRU tier of L1 + L2 tokens (tree only)   -> hit_rate_single_lru
  * HiCache: L1 + L2 with a real HostWorker (JAX pools; every backup and load-back really moves the KV
    bytes through the worker, write_through; a step waits for its loads before its requests run)
                                                    -> requests_per_s, hit_rate_total

Like with like: the bare tree and HiCache run the same loop over the same requests and steps (the bare
tree skips only the HiCache calls); they are interleaved per repeat (best of ``--repeat`` each) after one
HiCache warm-up run that compiles the transfer sizes the stream uses. Wall and process-CPU seconds are
both reported. ``--step-requests 1`` serves one request at a time (each load-back dispatched and waited
alone); larger steps also share prefix misses inside a step, so the hit rates move a little with it.

    python benchmarks/hicache_bench.py [--json out.json] [--quick] [--step-requests N]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from dataclasses import asdict, dataclass

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from hicache.cluster import CacheHead, HeadConfig  # noqa: E402
from hicache.cluster.controller import LoadBackParams  # noqa: E402
from hicache.cluster.policy import HiCacheConfig  # noqa: E402
from hicache.cluster.tree import RadixKey, RequestState, TreeConfig  # noqa: E402
from hicache.cluster.worker_group import LocalWorkerGroup  # noqa: E402
from hicache.workers import HostWorker, KVCacheSpec  # noqa: E402
from hicache.workloads import MultiTurnSpec, multi_turn  # noqa: E402


@dataclass(frozen=True)
class HiCacheBenchRecord:
    page_size: int
    l1_tokens: int
    l2_tokens: int
    write_policy: str
    page_bytes: int
    step_requests: int  # requests per scheduler step (both configs run the same steps)
    requests: int
    hit_rate_l1_only: float
    hit_rate_single_lru: float
    hit_rate_total: float  # L1 hits + tokens loaded back from L2, over prompt tokens
    hit_rate_l1_part: float
    hit_rate_l2_part: float
    requests_per_s: float
    bare_tree_requests_per_s: float
    overhead_ratio: float  # requests_per_s / bare_tree_requests_per_s
    backed_up_tokens: int
    loaded_tokens: int
    bytes_d2h: int
    bytes_h2d: int
    hicache_run_s: float  # the best HiCache run, split below
    worker_s: float  # inside WorkerGroup calls (submit/poll/wait: the data plane, embedded)
    head_s: float  # the rest: tree + controller + this loop (compare with bare_tree_run_s)
    bare_tree_run_s: float  # the best bare-tree run (same requests, same steps)
    # CPU seconds of the process (JAX threads included), best of each: steadier than wall time on a busy box
    hicache_cpu_s: float
    bare_tree_cpu_s: float
    overhead_ratio_cpu: float  # bare_tree_cpu_s / hicache_cpu_s


class TimedWorkers(LocalWorkerGroup):
    """``LocalWorkerGroup`` that adds up the seconds spent in the workers (data plane vs head split)."""

    def __init__(self, workers) -> None:
        super().__init__(workers)
        self.seconds = 0.0

    def submit(self, plan) -> None:
        t = time.perf_counter()
        super().submit(plan)
        self.seconds += time.perf_counter() - t

    def poll(self):
        t = time.perf_counter()
        acks = super().poll()
        self.seconds += time.perf_counter() - t
        return acks

    def wait(self, timeout_s: float, op_ids=None):
        t = time.perf_counter()
        acks = super().wait(timeout_s, op_ids)
        self.seconds += time.perf_counter() - t
        return acks


def run_stream(head: CacheHead, rounds, hicache: bool, step_requests: int) -> tuple[int, int, int, int, float]:
    """Serves the stream as a scheduler does, ``step_requests`` requests per step (never across a round,
    so a conversation's next turn always sees its previous one cached). A step (SGLang's order): match and
    lock every request (HiCache: and start its L2 load-back), send the step's loads, allocate every
    request's pages, wait for the loads (the forward would), then cache each finished request. The bare
    tree runs the same loop without the HiCache calls.

    Returns (requests, L1 hit tokens, loaded tokens, prompt tokens, seconds, CPU seconds of this process)."""
    requests = l1_hits = loaded_total = prompt_tokens = 0
    # No garbage of earlier runs (their trees are reference cycles) is left for the collector to bill to this one.
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    for turns in rounds:
        for s in range(0, len(turns), step_requests):
            if hicache:
                head.check_hicache_events()
            batch = []
            for turn in turns[s : s + step_requests]:
                key = RadixKey(turn.prompt)
                m = head.match_prefix(key)
                pages, hit, node, loaded, load_id = m.device_pages, m.device_hit_len, m.last_device_node, 0, -1
                if hicache and m.host_hit_len:  # the load-back locks the prefix it returns (lock=True)
                    r = head.init_load_back(LoadBackParams(m.best_match_node, m.host_hit_len, lock=True))
                    pages, hit, node, loaded, load_id = (r.device_pages, r.device_hit_len, r.last_node,
                                                         r.loaded_tokens, r.load_id)
                else:
                    head.inc_lock_ref(node)
                batch.append([turn.sequence, m, pages, hit, node, loaded, load_id, len(turn.prompt)])
            if hicache:
                head.ready_to_load_host_cache()  # the step's loads go out as one op
            owns = [head.alloc(len(req[0]) - req[3]) for req in batch]
            for i, (_, m, _, hit, node, _, load_id, _) in enumerate(batch):
                if load_id >= 0 and not head.wait_load_back(load_id):  # failed: recompute the loaded part
                    head.inc_lock_ref(m.last_device_node)
                    head.dec_lock_ref(node)
                    owns[i] = np.concatenate([head.alloc(hit - m.device_hit_len), owns[i]])
                    batch[i][2:6] = m.device_pages, m.device_hit_len, m.last_device_node, 0
            for (seq, m, pages, hit, node, loaded, _, prompt_len), own in zip(batch, owns):
                head.cache_finished_req(RequestState(RadixKey(seq), np.concatenate([pages, own]), hit, node))
                requests += 1
                l1_hits += hit - loaded
                loaded_total += loaded
                prompt_tokens += prompt_len
    if hicache:
        head.flush_write_through_acks()
    return requests, l1_hits, loaded_total, prompt_tokens, time.perf_counter() - t0, time.process_time() - c0


def bare_run(rounds, page_size: int, capacity_tokens: int, step: int) -> tuple[int, int, int, int, float, float]:
    head = CacheHead(HeadConfig(tree=TreeConfig(page_size, capacity_tokens // page_size)))
    return run_stream(head, rounds, False, step)


def hicache_run(rounds, kv: KVCacheSpec, l1: int, l2: int, policy: str, step: int):
    """One HiCache run on fresh pools; returns (run_stream's tuple, cache_stats, seconds in the workers)."""
    ps = kv.page_size
    group = TimedWorkers([HostWorker(kv, l1 // ps, l2 // ps)])
    head = CacheHead(HeadConfig(tree=TreeConfig(ps, l1 // ps), hicache=HiCacheConfig(l2 // ps, policy)), group)
    out = run_stream(head, rounds, True, step)
    return out, head.cache_stats(), group.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--quick", action="store_true", help="60 conversations x 4 turns, capacities / 4")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--l1-tokens", type=int, default=200_000)
    parser.add_argument("--l2-tokens", type=int, default=800_000)
    parser.add_argument("--write-policy", default="write_through")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--step-requests", type=int, default=8,
                        help="requests per scheduler step (1 = one request at a time, each load waited alone)")
    args = parser.parse_args()
    ps, step = args.page_size, args.step_requests
    if step < 1:
        raise SystemExit(f"--step-requests must be >= 1, got {step}")
    l1, l2 = args.l1_tokens, args.l2_tokens
    spec = MultiTurnSpec()
    if args.quick:
        spec = MultiTurnSpec(conversations=60, turns=4)
        l1, l2 = l1 // 4, l2 // 4
    rounds = multi_turn(spec)
    kv = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, page_size=ps, dtype="float32")
    _, lru_hits, _, lru_prompt, _, _ = bare_run(rounds, ps, l1 + l2, step)
    hit_lru = lru_hits / lru_prompt
    hicache_run(rounds, kv, l1, l2, args.write_policy, step)  # warm-up: compiles the transfer sizes used
    # Paired and interleaved (bare tree, then HiCache, per repeat) so machine noise hits both alike.
    bare_best = bare_cpu = hicache_cpu = float("inf")
    best = None
    for _ in range(args.repeat):
        n, hits, _, prompt, bare_secs, cpu = bare_run(rounds, ps, l1, step)
        bare_best, bare_cpu, hit_l1 = min(bare_best, bare_secs), min(bare_cpu, cpu), hits / prompt
        run = hicache_run(rounds, kv, l1, l2, args.write_policy, step)
        hicache_cpu = min(hicache_cpu, run[0][5])
        if best is None or run[0][4] < best[0][4]:
            best = run
    bare_rps = n / bare_best
    (n, hits, loaded, prompt, secs, _), stats, worker_s = best
    rec = HiCacheBenchRecord(
        page_size=ps, l1_tokens=l1, l2_tokens=l2, write_policy=args.write_policy, page_bytes=kv.page_bytes,
        step_requests=step, requests=n, hit_rate_l1_only=hit_l1, hit_rate_single_lru=hit_lru,
        hit_rate_total=(hits + loaded) / prompt, hit_rate_l1_part=hits / prompt, hit_rate_l2_part=loaded / prompt,
        requests_per_s=n / secs, bare_tree_requests_per_s=bare_rps, overhead_ratio=(n / secs) / bare_rps,
        backed_up_tokens=stats["backed_up_tokens"], loaded_tokens=stats["loaded_tokens"],
        bytes_d2h=stats["bytes_moved"].get("d2h", 0), bytes_h2d=stats["bytes_moved"].get("h2d", 0),
        hicache_run_s=secs, worker_s=worker_s, head_s=secs - worker_s, bare_tree_run_s=bare_best,
        hicache_cpu_s=hicache_cpu, bare_tree_cpu_s=bare_cpu, overhead_ratio_cpu=bare_cpu / hicache_cpu,
    )
    for k, v in asdict(rec).items():
        print(f"{k:>26}: {v:.4f}" if isinstance(v, float) else f"{k:>26}: {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(rec), f, indent=1)


if __name__ == "__main__":
    main()
