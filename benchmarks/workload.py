"""The request stream of the end-to-end benchmarks (``multiturn.py``, ``long_doc_qa.py``).

The model and forward shapes every config shares (``MODEL``, ``FWD``; ``MODELS`` by name for the
benchmarks that choose), a stream's records (``Item`` in,
``Served`` out, ``Timing`` in virtual time), and arrivals: request i is sent at a Poisson tick ``t_i``
(rate ``request_rate``), or later if the same client's previous request has not finished yet (a chat
client sends its next turn after the answer). ``simulate_arrivals`` is the queue model of requests
served one at a time (the bare engine, the no-reuse pair, long_doc_qa): one FCFS server, a request
starts at ``max(sent, server free)`` and its service time is what the stack really took. The other
queue model, ``stacks.VirtualTimeRun``, runs the stack's own iteration-level loop.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from hicache.reference.engine.config import ForwardConfig, ModelConfig  # noqa: E402
from hicache.reference.serve_types import ServeResult  # noqa: E402

MODEL = ModelConfig()

# "tiny" (MODEL) is sized for tests; "small" has 8x the MLP work per token over the same KV bytes. A
# real LLM computes ~10^5 FLOPs per KV byte it caches (Llama-3-8B: 16 GFLOP per token over 128 KiB of
# KV); tiny computes ~10^3, small ~7x10^3. On tiny a page's prefill costs about what the data path's
# fixed per-request work does, which no deployment sees; small is still far below a real model.
MODELS: dict[str, ModelConfig] = {"tiny": MODEL, "small": ModelConfig(hidden=256, mlp_hidden=2048)}


FWD = ForwardConfig(chunk_size=16, page_size=8, max_pages=64)  # max context 512 tokens


_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {msg}", flush=True)  # plain lines: no TTY (ray job submit)


@dataclass(frozen=True)
class Item:
    """One request of the stream: ``client`` is ``None`` when it depends on no earlier request."""

    index: int
    client: int | None
    round: int
    prompt: np.ndarray  # i32[n]
    max_new_tokens: int


@dataclass(frozen=True)
class Stream:
    items: tuple[Item, ...]
    outputs: tuple[tuple[int, ...], ...]  # reference (no cache) output of each item

    @property
    def prompt_tokens(self) -> int:
        return sum(len(it.prompt) for it in self.items)


@dataclass(frozen=True)
class Timing:
    """One request seen from its client in a ``VirtualTimeRun`` (seconds on its virtual clock)."""

    sent_s: float
    queue_wait_s: float  # sent -> its pre-first-token work started
    client_ttft_s: float  # sent -> first token (queue wait + service TTFT)
    finish_s: float


@dataclass
class Served:
    item: Item
    result: ServeResult
    timing: Timing | None = None  # None: served one at a time, no clock (``simulate_arrivals`` models the queue)


def poisson_ticks(n: int, rate: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1.0 / rate, size=n))


def simulate_arrivals(served: Sequence[Served], ticks: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """(client-seen TTFT per request, queue wait per request, makespan) under the module's model."""
    free = 0.0
    last_finish: dict[int, float] = {}
    ttft, wait = np.zeros(len(served)), np.zeros(len(served))
    first_sent, end = None, 0.0
    for i, s in enumerate(served):
        sent = float(ticks[i])
        if s.item.client is not None:
            sent = max(sent, last_finish.get(s.item.client, 0.0))
        start = max(sent, free)
        finish = start + s.result.latency_s
        wait[i] = start - sent
        ttft[i] = wait[i] + s.result.ttft_s
        free = finish
        if s.item.client is not None:
            last_finish[s.item.client] = finish
        first_sent = sent if first_sent is None else min(first_sent, sent)
        end = max(end, finish)
    return ttft, wait, end - (first_sent or 0.0)


def tier_sizes(est_pages: int, longest_tokens: int, l1_fraction: float, l2_fraction: float) -> tuple[int, int]:
    """L1 pages (a fraction of the estimated working set, but room for the longest request, its prefix
    locked + its new pages, with some to spare) and L2 slots."""
    ps = FWD.page_size
    return max(-(-longest_tokens // ps) + 4, round(est_pages * l1_fraction)), max(1, round(est_pages * l2_fraction))
