"""Multi-turn chat served by a running replica (the one ``hicache up`` started): hits by tier, TTFT,
exactness against the no-cache reference.

    hicache bench replica_chat --replica local -- --quick           # a Ray job on the replica's cluster
    python benchmarks/replica_chat.py --replica local --address 127.0.0.1:6379 --json out.json

Unlike the other serving benchmarks (embedded stacks they build themselves), this one drives replica
``--replica`` as serving code does: ``hicache.connect`` for the control plane (step channel or Ray
calls) and the reference engine attached to the replica's host workers (``RayEngine``: a tiny random
model shaped like the replica's KV spec, so it fits its L1 pool). Its requests carry their own
``cache_salt``, so their KV never mixes with other traffic's in the replica's tiers or its L3 (the salt
is part of every L3 key). Attaching the engine replaces a model attached to those workers before.

``--conversations`` x ``--turns`` chats, turn-major (every conversation's turn t before any turn
t+1), each turn the last one's history plus the reference answer and new tokens. First the no-cache
reference of every prompt (same workers, nothing reused), then each prompt served through the
replica's tiers; an output that differs from its reference in a token or a first-token logit bit
counts in ``wrong_outputs``. The hits show in ``hicache status`` and in the replica's ``hicache_*``
metrics (``ray_hicache_*`` on the head node's metrics endpoint) afterwards.

JSON (``--json``): ``replica``, ``requests``, ``wrong_outputs``, ``prompt_tokens``,
``hit_tokens`` ``{l1, l2, l3}`` (L2 counts loads from L2; L3 those fetched from L3 for the request),
``computed_tokens``, ``ttft_p50_ms``, ``ttft_p99_ms``, ``head_hits_before``/``head_hits_after`` (the
head's ``cache_stats`` hit counters around the run).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

import numpy as np

CACHE_SALT = "hicache-bench/replica_chat"  # this benchmark's namespace in the replica's tiers and L3


def model_for(config: Any) -> Any:
    """A reference model whose KV matches the replica's page layout (its workers' ``KVCacheSpec``) and whose
    hybrid layers match its components (``ReplicaConfig.head.components``): sliding-window layers, the first
    ones (as many as the workers' ``swa`` pool keeps, else every other layer), with the SWA window; recurrent
    layers, the last ones, as many and as wide as the ``mamba`` component's one ``[layers, hidden]`` state."""
    from hicache.cluster.builder import ComponentKind, components_of
    from hicache.reference.engine import ModelConfig

    spec, specs = config.workers.spec, config.workers.component_specs
    by_kind = components_of(config.head.components)
    swa, mamba = by_kind.get(ComponentKind.SWA), by_kind.get(ComponentKind.MAMBA)
    extra: dict[str, Any] = {}
    hidden = 32
    if swa is not None:
        extra["sliding_window"] = swa.window
        if "swa" in specs:
            extra["sliding_window_layers"] = tuple(range(specs["swa"].num_layers))
    if mamba is not None:
        if len(mamba.state_shapes) != 1 or len(mamba.state_shapes[0]) != 2:
            raise ValueError(f"replica_chat: the reference model keeps one [layers, hidden] state; the replica's "
                             f"mamba component has state_shapes={mamba.state_shapes}")
        layers, hidden = mamba.state_shapes[0]
        extra["recurrent_layers"] = tuple(range(spec.num_layers - layers, spec.num_layers))
    return ModelConfig(vocab_size=256, num_layers=spec.num_layers, num_q_heads=2 * spec.num_kv_heads,
                       num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, hidden=hidden, mlp_hidden=64,
                       dtype=spec.dtype, **extra)


def _connect(address: str | None) -> None:
    import ray

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if not ray.is_initialized():  # in a Ray job, RAY_ADDRESS names the job's cluster
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto", namespace="hicache",
                 logging_level=logging.ERROR, log_to_driver=False)


def _head_hits(client: Any) -> dict[str, int]:
    st = client.cache_stats()
    return {k: int(st.get(k, 0)) for k in ("queried_tokens", "device_hit_tokens", "host_hit_tokens")}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    import hicache
    from hicache.cli import replica_names
    from hicache.cluster.ray_head import get_head
    from hicache.testing.drivers import ServedReplica, chat_workload, is_exact

    _connect(args.address)
    if args.replica not in replica_names():
        raise SystemExit(f"replica_chat: unknown replica {args.replica!r}; running: {replica_names() or 'none'}")
    config = ray.get(get_head(args.replica).get_config.remote(), timeout=args.timeout)
    if config.workers is None:
        raise SystemExit(f"replica_chat: replica {args.replica!r} has no host workers: the engine needs a data plane")
    spec = config.workers.spec
    client = hicache.connect(args.replica, timeout_s=args.timeout)
    served = ServedReplica(args.replica, args.timeout, None, args.setup_timeout, model=model_for(config),
                           page=spec.page_size, cache_salt=CACHE_SALT,
                           storage="storage" in client.cache_stats())  # L3 attached (its file's ``l3``)
    before = _head_hits(served.client)
    served.engine.timeout_s = args.setup_timeout  # the references compile more programs
    work = chat_workload(served, args.conversations, args.turns, args.seed)
    served.engine.timeout_s = args.timeout
    order = [c * args.turns + t for t in range(args.turns) for c in range(args.conversations)]
    wrong, ttfts = 0, []
    hits = {"l1": 0, "l2": 0, "l3": 0}
    prompt_tokens = computed = 0
    for i in order:
        prompt, ref = work[i]
        res = served.serve(prompt)
        wrong += not is_exact(res, ref)
        ttfts.append(res.ttft_s)
        hits["l1"] += int(res.device_hit_tokens)
        hits["l2"] += int(res.loaded_tokens - res.storage_tokens)
        hits["l3"] += int(res.storage_tokens)
        prompt_tokens += int(res.prompt_len)
        computed += int(res.computed_tokens)
    served.client.flush_write_through_acks()
    return {"replica": args.replica, "requests": len(order), "wrong_outputs": wrong, "prompt_tokens": prompt_tokens,
            "hit_tokens": hits, "computed_tokens": computed,
            "ttft_p50_ms": round(float(np.percentile(ttfts, 50)) * 1e3, 2),
            "ttft_p99_ms": round(float(np.percentile(ttfts, 99)) * 1e3, 2),
            "head_hits_before": before, "head_hits_after": _head_hits(served.client)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replica", required=True, help="the running replica to serve through (hicache status lists them)")
    ap.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, set in a Ray job, or the local one)")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=30.0, help="per call (engine and client)")
    ap.add_argument("--setup-timeout", type=float, default=300.0, help="per call while the workers compile")
    ap.add_argument("--quick", action="store_true", help="2 conversations x 3 turns")
    ap.add_argument("--json", help="write the record here")
    args = ap.parse_args(argv)
    if args.quick:
        args.conversations, args.turns = 2, 3
    for name in ("conversations", "turns"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    out = run(args)
    l1, l2, l3 = (out["hit_tokens"][t] for t in ("l1", "l2", "l3"))
    print(f"replica {out['replica']!r}: {out['requests']} requests, {out['wrong_outputs']} wrong outputs; "
          f"hit tokens L1 {l1} L2 {l2} L3 {l3} of {out['prompt_tokens']} prompt tokens; "
          f"TTFT p50 {out['ttft_p50_ms']} ms p99 {out['ttft_p99_ms']} ms", flush=True)
    print(json.dumps(out), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 1 if out["wrong_outputs"] else 0


if __name__ == "__main__":
    sys.exit(main())
