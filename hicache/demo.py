"""``hicache demo``: the README's main job on the embedded default (in-process head, no Ray needed).

Current scope: the multi-turn chat workload through the embedded ``CacheClient`` (the scheduler's call
sequence per request), one table of hit rates per round. The full L1/L2/L3 demo with the reference
engine replaces this as those tiers land.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from hicache.cluster import HeadConfig, embedded
from hicache.cluster.tree import RadixKey, RequestState, TreeConfig
from hicache.workloads import MultiTurnSpec, multi_turn


def run_demo(args: argparse.Namespace) -> int:
    console = Console()
    spec = MultiTurnSpec(conversations=args.conversations, turns=args.turns, seed=args.seed)
    rounds = multi_turn(spec)
    page_size = args.page_size
    capacity_pages = args.capacity_tokens // page_size if args.capacity_tokens else None
    client = embedded(HeadConfig(tree=TreeConfig(page_size=page_size, capacity_pages=capacity_pages)))
    table = Table(title=f"hicache demo: {spec.conversations} conversations x {spec.turns} turns, "
                        f"page size {page_size}, L1 {args.capacity_tokens or 'unbounded'} tokens")
    for col in ("round", "requests", "prompt tokens", "L1 hit tokens", "hit rate", "prefill computed", "req/s"):
        table.add_column(col, justify="right")
    total_hit = total_prompt = 0
    for r, turns in enumerate(rounds):
        hit = prompt = 0
        t0 = time.perf_counter()
        for turn in turns:
            key = RadixKey(turn.prompt)
            m = client.match_prefix(key)
            client.inc_lock_ref(m.last_device_node)
            seq = turn.sequence
            pages = client.alloc(len(seq) - m.device_hit_len)
            client.cache_finished_req(
                RequestState(RadixKey(seq), np.concatenate([m.device_pages, pages]), m.device_hit_len, m.last_device_node)
            )
            hit += m.device_hit_len
            prompt += len(turn.prompt)
        dt = time.perf_counter() - t0
        total_hit += hit
        total_prompt += prompt
        table.add_row(str(r), str(len(turns)), f"{prompt:,}", f"{hit:,}", f"{hit / prompt:.1%}",
                      f"{prompt - hit:,}", f"{len(turns) / dt:,.0f}")
    table.add_row("all", str(sum(len(t) for t in rounds)), f"{total_prompt:,}", f"{total_hit:,}",
                  f"{total_hit / total_prompt:.1%}", f"{total_prompt - total_hit:,}", "")
    console.print(table)
    stats = client.stats()
    console.print(f"L1: {stats.cached_tokens:,} tokens cached in {stats.num_nodes:,} nodes, "
                  f"{stats.evicted_tokens:,} evicted, {stats.free_pages:,}/{stats.capacity_pages:,} pages free")
    return 0
