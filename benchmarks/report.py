"""A benchmark's results: one ``ConfigRecord`` per config, printed as a table, written as JSON (the
keys are the records' fields) and plotted (hit rate per tier against the offline optimum, TTFT, prefill
tokens computed).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from benchmarks.workload import Served, log, simulate_arrivals
from hicache.reference.serve_types import ServePhases, ServeResult


@dataclass(frozen=True)
class ConfigRecord:
    config: str
    requests: int
    prompt_tokens: int
    output_tokens: int
    prefill_tokens_computed: int
    ttft_mean_s: float  # client view: queue wait (Poisson arrivals) + service TTFT
    ttft_p90_s: float
    service_ttft_mean_s: float  # the stack alone, no queueing
    service_ttft_p90_s: float
    queue_wait_mean_s: float
    throughput_requests_per_s: float  # over the simulated makespan (arrivals at request_rate)
    throughput_tokens_per_s: float  # (prompt + output tokens) over the makespan
    capacity_requests_per_s: float  # requests / summed service latency (server never idle)
    capacity_tokens_per_s: float
    request_rate: float
    hit_rate_by_tier: dict[str, float]  # share of prompt tokens served by each tier
    hit_tokens_by_tier: dict[str, int]
    hit_rate_total: float
    optimal_hit_rate: float | None  # Belady/MIN with the same capacity (None: not applicable)
    optimal_capacity_tokens: float | None
    l1_tokens: int
    l2_tokens: int
    l3: bool
    load_failed: int
    exact_outputs_checked: int  # requests whose output tokens were compared with the no-cache run
    exact_spot_checks: int  # requests also compared (tokens + logits) with generate_no_cache
    hit_rate_by_round: list[float]
    service_ttft_mean_by_round_s: list[float]
    notes: dict = field(default_factory=dict)


def make_record(config: str, served: Sequence[Served], ticks: np.ndarray, rate: float, *, l1_tokens: int,
                l2_tokens: int, l3: bool, optimal_hits: Sequence[int] | None, optimal_capacity: float | None,
                exact_checked: int, spot: int, notes: dict | None = None) -> ConfigRecord:
    res = [s.result for s in served]
    if all(s.timing is not None for s in served):  # a VirtualTimeRun: the loop's own queue
        ttft = np.array([s.timing.client_ttft_s for s in served])
        wait = np.array([s.timing.queue_wait_s for s in served])
        svc = ttft - wait  # the prefill iteration on the clock (scaled by its speed)
        makespan = max(s.timing.finish_s for s in served) - min(s.timing.sent_s for s in served)
        queue_model = "iteration_loop"
    else:
        ttft, wait, makespan = simulate_arrivals(served, ticks)
        queue_model = "fcfs_whole_request"
    steps = sum(len(r.output) - 1 for r in res)
    prompt = sum(r.prompt_len for r in res)
    outputs = sum(len(r.output) for r in res)
    l3t = sum(r.storage_tokens for r in res)
    tiers = {"l1": sum(r.device_hit_tokens for r in res), "l2": sum(r.loaded_tokens for r in res) - l3t, "l3": l3t}
    busy = sum(r.latency_s for r in res)
    rounds = sorted({s.item.round for s in served})
    by_round_hit, by_round_ttft = [], []
    for rd in rounds:
        rs = [s.result for s in served if s.item.round == rd]
        by_round_hit.append(sum(r.prompt_len - r.computed_tokens for r in rs) / sum(r.prompt_len for r in rs))
        by_round_ttft.append(statistics.fmean(r.ttft_s for r in rs))
    if queue_model != "iteration_loop":
        svc = np.array([r.ttft_s for r in res])
    return ConfigRecord(
        config=config, requests=len(res), prompt_tokens=prompt, output_tokens=outputs,
        prefill_tokens_computed=sum(r.computed_tokens for r in res),
        ttft_mean_s=float(ttft.mean()), ttft_p90_s=float(np.percentile(ttft, 90)),
        service_ttft_mean_s=float(svc.mean()), service_ttft_p90_s=float(np.percentile(svc, 90)),
        queue_wait_mean_s=float(wait.mean()),
        throughput_requests_per_s=len(res) / makespan, throughput_tokens_per_s=(prompt + outputs) / makespan,
        capacity_requests_per_s=len(res) / busy, capacity_tokens_per_s=(prompt + outputs) / busy,
        request_rate=rate,
        hit_rate_by_tier={k: v / prompt for k, v in tiers.items()}, hit_tokens_by_tier=tiers,
        hit_rate_total=sum(tiers.values()) / prompt,
        optimal_hit_rate=None if optimal_hits is None else sum(optimal_hits) / prompt,
        optimal_capacity_tokens=optimal_capacity,
        l1_tokens=l1_tokens, l2_tokens=l2_tokens, l3=l3, load_failed=sum(r.load_failed for r in res),
        exact_outputs_checked=exact_checked, exact_spot_checks=spot,
        hit_rate_by_round=by_round_hit, service_ttft_mean_by_round_s=by_round_ttft,
        notes={"service_phases_mean_ms": phase_means_ms(res), "queue_model": queue_model,
               "decode_step_ms": 1e3 * sum(r.phases.decode for r in res) / max(1, steps), **(notes or {})})


def phase_means_ms(results: Sequence[ServeResult]) -> dict[str, float]:
    """Mean time per request in each ``ServePhases`` phase, in ms (the phases of one run: best-of-N
    replaces only the TTFT and latency)."""
    return {f.name: 1e3 * statistics.fmean(getattr(r.phases, f.name) for r in results) for f in fields(ServePhases)}


def print_records(records: Sequence[ConfigRecord]) -> None:
    cols = ("config", "reqs", "computed", "hit", "l1", "l2", "l3", "optimal", "ttft ms", "p90", "wait ms",
            "svc ms", "svc p90", "decode ms", "req/s cap")
    log(" ".join(f"{c:>15}" if i == 0 else f"{c:>9}" for i, c in enumerate(cols)))
    for r in records:
        opt = "-" if r.optimal_hit_rate is None else f"{r.optimal_hit_rate:.1%}"
        vals = (r.config, r.requests, r.prefill_tokens_computed, f"{r.hit_rate_total:.1%}",
                f"{r.hit_rate_by_tier['l1']:.1%}", f"{r.hit_rate_by_tier['l2']:.1%}",
                f"{r.hit_rate_by_tier['l3']:.1%}", opt, f"{r.ttft_mean_s * 1e3:.1f}", f"{r.ttft_p90_s * 1e3:.1f}",
                f"{r.queue_wait_mean_s * 1e3:.1f}", f"{r.service_ttft_mean_s * 1e3:.1f}",
                f"{r.service_ttft_p90_s * 1e3:.1f}", f"{r.notes.get('decode_step_ms', 0.0):.2f}",
                f"{r.capacity_requests_per_s:.1f}")
        log(" ".join(f"{v:>15}" if i == 0 else f"{v!s:>9}" for i, v in enumerate(vals)))
    names = [f.name for f in fields(ServePhases)]
    log("service phases, mean ms per request: " + " ".join(f"{n:>9}" for n in names))
    for r in records:
        phases = r.notes.get("service_phases_mean_ms", {})
        log(f"{r.config:>15}" + " " * 22 + " ".join(f"{phases.get(n, 0.0):9.2f}" for n in names))


def write_json(records: Sequence[ConfigRecord], path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps([asdict(r) for r in records], indent=1))
        log(f"json: {Path(path).resolve()}")


def plot(records: Sequence[ConfigRecord], path: str | None, title: str) -> None:
    if not path:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.config for r in records]
    x = np.arange(len(records))
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5))
    bottom = np.zeros(len(records))
    for tier, color in (("l1", "#2b8cbe"), ("l2", "#7bccc4"), ("l3", "#fdae61")):
        vals = np.array([r.hit_rate_by_tier[tier] for r in records])
        ax1.bar(x, vals, bottom=bottom, label=tier.upper(), color=color)
        bottom += vals
    opt = [r.optimal_hit_rate for r in records]
    ax1.scatter([i for i, o in enumerate(opt) if o is not None], [o for o in opt if o is not None], marker="_",
                s=600, color="k", label="offline optimal", zorder=3)
    ax1.set_xticks(x, names, rotation=30, ha="right")
    ax1.set_ylim(0, 1.05)
    ax1.set_ylabel("share of prompt tokens served from cache")
    ax1.legend(fontsize=8)
    w = 0.2
    for k, (attr, label) in enumerate((("service_ttft_mean_s", "service mean"), ("service_ttft_p90_s", "service p90"),
                                       ("ttft_mean_s", "with queue mean"), ("ttft_p90_s", "with queue p90"))):
        ax2.bar(x + (k - 1.5) * w, [getattr(r, attr) * 1e3 for r in records], w, label=label)
    ax2.set_xticks(x, names, rotation=30, ha="right")
    ax2.set_ylabel("TTFT (ms)")
    ax2.set_yscale("log")
    ax2.legend(fontsize=8)
    ax3.bar(x, [r.prefill_tokens_computed for r in records], color="#636363")
    ax3.set_xticks(x, names, rotation=30, ha="right")
    ax3.set_ylabel("prefill tokens computed")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    log(f"png: {Path(path).resolve()}")


def report(records: Sequence[ConfigRecord], targets: dict, attach_to: Sequence[str], rate: float,
           json_path: str | None, png_path: str | None, title: str, t_start: float) -> None:
    """The end of a serving benchmark: targets into the named records' notes, the table, the target line,
    JSON, PNG and the wall time."""
    by = {r.config: r for r in records}
    for name in attach_to:
        by[name].notes["targets"] = targets
    print_records(records)
    log(f"request rate {rate:.2f} req/s (Poisson); targets: " + ", ".join(
        f"{k} {v:.3f}" for k, v in targets.items() if k != "met") + f"; met {targets['met']}")
    write_json(records, json_path)
    plot(records, png_path, title)
    log(f"wall time {time.perf_counter() - t_start:.1f} s")


def jsonable(obj):
    return json.loads(json.dumps(obj, default=str))
