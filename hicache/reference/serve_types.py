"""What a serving driver hands the reference ``Scheduler`` and gets back: ``ServeRequest`` in,
``ServeResult`` (with its ``ServePhases`` timings) out. Plain values, built on the serving thread."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hicache.cluster.token_account import TokenAccount


@dataclass(frozen=True)
class ServeRequest:
    prompt: np.ndarray  # i32[n], n >= 1
    max_new_tokens: int
    extra_key: str | None = None
    cache_salt: str | None = None


@dataclass(frozen=True)
class ServePhases:
    """Where a request's service time went (seconds, ``time.perf_counter`` deltas on the serving
    thread). Up to the first token: ``match`` (the request's first head call, ``begin_request``, less
    its head-side L3 query and lock + alloc: the write hold, the arrival prefetch's check, the match),
    ``l3`` (the L3 query; a started prefetch's wait and the match after it), ``load_back`` (lock the
    reused prefix, load its L2 part back and wait for it, allocate pages for the rest), ``prefill`` (every forward of the prompt,
    logits on the host). After it: ``decode`` and ``finish`` (``cache_finished_req`` and, with a host
    tier, ``check_hicache_events``). In a ``ServingLoop``, ``decode`` sums the request's own decode
    steps (other requests' iterations run in between)."""

    match: float = 0.0
    l3: float = 0.0
    load_back: float = 0.0
    prefill: float = 0.0
    decode: float = 0.0
    finish: float = 0.0


@dataclass(frozen=True, eq=False)
class ServeResult:
    output: tuple[int, ...]
    last_logits: np.ndarray  # f32[vocab]: logits of the last prompt token
    ttft_s: float
    latency_s: float
    prompt_len: int
    device_hit_tokens: int  # prefix found in L1
    loaded_tokens: int  # prefix brought back from L2 (including what L3 prefetched into L2)
    computed_tokens: int  # prompt tokens prefilled past the reused prefix (prompt_len - reused)
    storage_tokens: int = 0  # of loaded_tokens, fetched from L3 for this request
    load_failed: bool = False
    phases: ServePhases = ServePhases()
    logits: np.ndarray | None = None  # f32[len(output), vocab]: row i gave output[i] (row 0 = last_logits)
    tokens: TokenAccount | None = None  # where each prompt token came from: hit tier or miss reason
