"""``hicache demo``: the README's main job on the embedded default.

One process: the cache head, one HostWorker (JAX on CPU), the reference engine and L3 in a local
directory. A multi-turn chat workload (conversations sharing system prompts) runs through the serving
loop with L1 at about a quarter of the working set, so hits come from every tier. Then a second,
cold replica (empty L1/L2, same L3 directory) serves the first round again: its hits come from L3.
Prints a per-round table (hit tokens per tier, prefill computed vs saved, TTFT p50/p90), bytes moved
per direction, and writes a PNG (hit rate per tier and TTFT per round).
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from hicache.reference.engine.config import ForwardConfig, ModelConfig
from hicache.reference.serve_types import ServeRequest, ServeResult
from hicache.reference.stack import StackOptions, build_stack, warm_up
from hicache.workloads import MultiTurnSpec, multi_turn


@dataclass
class RoundStats:
    name: str
    results: list[ServeResult] = field(default_factory=list)

    def total(self, attr: str) -> int:
        return sum(getattr(r, attr) for r in self.results)

    @property
    def prompt_tokens(self) -> int:
        return self.total("prompt_len")

    def tier_tokens(self) -> dict[str, int]:
        l3 = self.total("storage_tokens")
        return {"L1": self.total("device_hit_tokens"), "L2": self.total("loaded_tokens") - l3, "L3": l3}

    def ttft_ms(self, q: float) -> float:
        return float(np.percentile([r.ttft_s for r in self.results], q) * 1e3)


def _workload(args: argparse.Namespace, vocab: int):
    spec = MultiTurnSpec(conversations=args.conversations, turns=args.turns, system_prompts=4,
                         system_tokens=(96, 160), user_tokens=(16, 40), output_tokens=(args.output_tokens,) * 2,
                         vocab_size=vocab, seed=args.seed)
    return multi_turn(spec)


def run_demo(args: argparse.Namespace) -> int:
    console = Console()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    model = ModelConfig()
    fwd = ForwardConfig(chunk_size=16, page_size=8, max_pages=64)
    rounds = _workload(args, model.vocab_size)
    # Working set: every conversation's final length, in pages; L1 gets about a quarter of it.
    final = {t.conversation: len(t.prompt) + args.output_tokens for turns in rounds for t in turns}
    working_pages = sum(-(-n // fwd.page_size) for n in final.values())
    l1_pages = max(fwd.max_pages + 8, working_pages // 4)
    l2_slots = working_pages * 2
    l3_dir = Path(args.l3_dir).resolve()
    if l3_dir.exists() and not args.keep_l3:
        shutil.rmtree(l3_dir)
    opts = StackOptions(model, fwd, l1_pages=l1_pages, l2_slots=l2_slots, l3_url=f"file://{l3_dir}",
                        prefetch_min_tokens=fwd.page_size * 2)
    console.print(f"[bold]hicache demo[/]: {args.conversations} conversations x {args.turns} rounds; "
                  f"L1 {l1_pages * fwd.page_size:,} tokens (~25% of the working set), "
                  f"L2 {l2_slots * fwd.page_size:,} tokens, L3 {l3_dir}")
    t_start = time.perf_counter()
    stack = build_stack(opts)
    # Compile outside the measured rounds: the forward and the L2->L1 load of every transfer shape
    # (without this, the first load-backs of rounds 1-2 compile inside their TTFT).
    warm_up(stack)
    stack.client.flush_write_through_acks()
    moved_before = dict(stack.head.cache_stats()["bytes_moved"])
    stats: list[RoundStats] = []
    total = sum(len(t) for t in rounds) + len(rounds[0])
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("serving", total=total)
        for r, turns in enumerate(rounds):
            rs = RoundStats(str(r))
            for turn in turns:
                rs.results.append(stack.scheduler.serve(ServeRequest(turn.prompt, args.output_tokens)))
                progress.advance(task)
            stats.append(rs)
        stack.client.flush_write_through_acks()
        warm_stats = stack.head.cache_stats()
        cold = build_stack(opts, stack.runner)  # a restarted replica: empty L1/L2, same L3
        rs = RoundStats("cold 0")
        for turn in rounds[0]:
            rs.results.append(cold.scheduler.serve(ServeRequest(turn.prompt, args.output_tokens)))
            progress.advance(task)
        stats.append(rs)
    _print_table(console, stats)
    moved = {k: v - moved_before.get(k, 0) for k, v in warm_stats["bytes_moved"].items()}
    console.print("bytes moved (warm replica): " + ", ".join(
        f"{label} {moved.get(k, 0) / 2**20:.1f} MiB" for k, label in
        (("d2h", "L1->L2"), ("h2d", "L2->L1"), ("h2s", "L2->L3"), ("s2h", "L3->L2"))))
    png = Path(args.plot).resolve()
    _plot(stats, png)
    console.print(f"plot: {png}    wall time {time.perf_counter() - t_start:.1f} s")
    return 0


def _print_table(console: Console, stats: list[RoundStats]) -> None:
    table = Table(title="prompt tokens per round: cache hits per tier, computed, TTFT (ms; after a warm-up "
                        "that compiles the forward and every L2->L1 transfer shape)")
    for col in ("round", "reqs", "prompt", "L1", "L2", "L3", "computed", "saved", "p50", "p90"):
        table.add_column(col, justify="right")
    for rs in stats:
        tiers = rs.tier_tokens()
        prompt = rs.prompt_tokens
        computed = rs.total("computed_tokens")
        table.add_row(rs.name, str(len(rs.results)), f"{prompt:,}", f"{tiers['L1']:,}", f"{tiers['L2']:,}",
                      f"{tiers['L3']:,}", f"{computed:,}", f"{1 - computed / prompt:.0%}",
                      f"{rs.ttft_ms(50):.1f}", f"{rs.ttft_ms(90):.1f}")
    console.print(table)


def _plot(stats: list[RoundStats], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s.name if s.name.startswith("cold") else f"round {s.name}" for s in stats]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    bottom = np.zeros(len(stats))
    for tier, color in (("L1", "#2b8cbe"), ("L2", "#7bccc4"), ("L3", "#fdae61")):
        vals = np.array([s.tier_tokens()[tier] / s.prompt_tokens for s in stats])
        ax1.bar(names, vals, bottom=bottom, label=tier, color=color)
        bottom += vals
    ax1.set_ylabel("share of prompt tokens served from cache")
    ax1.set_ylim(0, 1)
    ax1.legend()
    ax1.tick_params(axis="x", rotation=30)
    ax2.plot(names, [s.ttft_ms(50) for s in stats], marker="o", label="p50")
    ax2.plot(names, [s.ttft_ms(90) for s in stats], marker="o", label="p90")
    ax2.set_ylabel("TTFT (ms)")
    ax2.legend()
    ax2.tick_params(axis="x", rotation=30)
    fig.suptitle("hicache demo: hit rate per tier and TTFT per round")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
