"""Drivers that run inside a rehearsal cluster's namespaces (``python -m hicache.testing.drivers NAME``).

Each is a Ray driver on the host it is started on (the client host in tests and benchmarks) and
prints one JSON line as its result (``rehearsal.last_json_line``):

* ``probe --replica R``: the cluster's nodes, the replica's host workers (node address, jax.distributed
  coordinator) and where its step channel listens; then ``--steps`` control-plane steps, with how
  many went over the step channel and how many as Ray calls.
* ``serve --replica R``: the reference engine in the replica's host workers, L3 on the rehearsal's
  ``gs://`` bucket, a multi-turn workload whose every output is compared with the no-cache reference
  (computed first, on the same mesh). With ``--drill``: serves the first half, prints
  ``{"event": "warm"}`` and waits for one line on stdin (the caller injects a fault meanwhile), then
  serves the second half as a scheduler does across a lost host: a request that fails is dropped and
  redone (fresh engine handles, a fresh scheduler). It prints ``{"event": "failed"}`` after the first
  failure (a hook for the caller, e.g. to heal a partition) and last the drill's figures.

One process, one thread; every wait is bounded by ``--timeout`` (per call) or ``--deadline`` (drill).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

PAGE = 4


def _emit(obj: Any) -> None:
    print(json.dumps(obj), flush=True)


def _connect_ray() -> Any:
    from hicache.testing.rehearsal import connect_driver

    return connect_driver()


def probe(args: argparse.Namespace) -> dict[str, Any]:
    ray = _connect_ray()
    import hicache
    from hicache.cluster.ray_head import get_head, worker_handles
    from hicache.cluster.tree import RadixKey

    out: dict[str, Any] = {"driver_ip": ray.util.get_node_ip_address(),
                           "nodes": [{"ip": n["NodeManagerAddress"], "alive": n["Alive"],
                                      "resources": n["Resources"]} for n in ray.nodes()]}
    if args.replica:
        _, workers, ranges = worker_handles(args.replica, args.timeout)
        out["workers"] = ray.get([w.ping.remote() for w in workers], timeout=args.timeout)
        out["head_ranges"] = [list(r) for r in ranges]
        channel = ray.get(get_head(args.replica).step_channel.remote(), timeout=args.timeout)
        out["channel"] = None if channel is None else {"host": channel.host, "port": channel.port}
        client = hicache.connect(args.replica, timeout_s=args.timeout)
        rng = np.random.default_rng(0)
        hits = 0
        for _ in range(args.steps):
            tokens = rng.integers(0, 100, 2 * PAGE, dtype=np.int32)
            m = client.match_prefix(RadixKey(tokens))
            hits += m.device_hit_len
        from hicache.cluster.ray_client import RayTransport

        transport = client._transport  # (the Ray transport's counters)
        assert isinstance(transport, RayTransport)
        out["steps"] = {"channel": transport.channel_steps, "ray": transport.ray_steps}
    return out


# -- the served workload -------------------------------------------------------------------------------
def _model(head_dim: int) -> Any:
    from hicache.reference.engine import ModelConfig

    return ModelConfig(vocab_size=256, num_layers=2, num_q_heads=8, num_kv_heads=4, head_dim=head_dim,
                       hidden=32, mlp_hidden=64)


class ServedReplica:
    """The engine, client and scheduler of one replica, rebuilt after a lost host."""

    def __init__(self, replica: str, timeout_s: float, gs_url: str | None, setup_timeout_s: float,
                 model: Any = None, page: int = PAGE, cache_salt: str | None = None,
                 storage: bool | None = None, wait_for_l3: bool = False) -> None:
        """``storage``: the scheduler asks L3 per request (default: when ``gs_url`` names one to attach).
        ``wait_for_l3``: requests wait for their L3 query and fetch up to ``timeout_s / 2`` and the cost model
        is off, so that what L3 holds is served from L3 however slow this box is (a drill that asserts
        L3 hits); otherwise the replica's policy decides, as in serving. ``model``: the reference model
        (default: 2 Full layers); a hybrid one's sliding-window and recurrent layers use the pools of the
        replica's components (``RayEngine``), and the scheduler serves it with them."""
        self.replica, self.timeout_s, self.gs_url = replica, timeout_s, gs_url
        self.setup_timeout_s, self.wait_for_l3 = setup_timeout_s, wait_for_l3
        self.model = _model(8) if model is None else model
        self.page, self.cache_salt = page, cache_salt
        self.storage = gs_url is not None if storage is None else storage
        self.client: Any = None
        self._warm_seed = 10_000
        self.attach()

    def attach(self) -> None:
        import hicache
        from hicache.reference.engine import ForwardConfig
        from hicache.reference.ray_engine import RayEngine
        from hicache.reference.scheduler import Scheduler

        self.engine = RayEngine(self.replica, self.model,
                                ForwardConfig(chunk_size=16, page_size=self.page, max_pages=24),
                                timeout_s=self.setup_timeout_s)
        first = self.client is None
        if first:
            self.client = hicache.connect(self.replica, timeout_s=self.timeout_s)
        if self.gs_url is not None and (first or "storage" not in self.client.cache_stats()):
            self.attach_l3()  # before any request asks L3; again if a rebuilt state's re-attach failed
        self.scheduler = Scheduler(self.client, self.engine, hicache=True, storage=self.storage,
                                   prefill_budget=max(16, self.page), swa_tables=self.engine.swa_tables,
                                   recurrent=self.engine.recurrent)
        # A new gang compiles its forwards on first use: that happens here, under the setup bound, on a
        # throwaway prompt; the served requests then run under the serving bound (``timeout_s``).
        self._warm_seed += 1
        prompt = np.random.default_rng(self._warm_seed).integers(0, 256, 5 * self.page + 1, dtype=np.int32)
        self.engine.generate_no_cache(prompt, 3)
        self.serve(prompt)
        self.engine.timeout_s = self.timeout_s

    def attach_l3(self) -> None:
        from hicache.cluster.cost_model import CostOptions
        from hicache.cluster.storage_tier import PrefetchPolicy, StorageParams
        from hicache.storage import StorageConfig

        if self.gs_url is None:
            return
        waits: dict[str, Any] = {}
        if self.wait_for_l3:  # half the call bound: the head's answer comes back before the client's call gives up
            wait = self.timeout_s / 2
            waits = dict(prefetch_policy=PrefetchPolicy.WAIT_COMPLETE, prefetch_wait_max_s=wait,
                         query_wait_max_s=wait, cost=CostOptions(enabled=False))
        self.client.detach_storage_backend()  # the replica file's L3 (another fingerprint), if any
        self.client.attach_storage_backend(StorageParams(
            f"{self.gs_url}/drills", self.engine.fingerprint(), prefetch_min_tokens=PAGE,
            storage=StorageConfig(pages_per_object=2, storage_options={"token": "anon"},
                                  timeout_s=self.timeout_s, exists_timeout_s=self.timeout_s), **waits))

    def serve(self, prompt: np.ndarray) -> Any:
        from hicache.reference.serve_types import ServeRequest

        return self.scheduler.serve(ServeRequest(prompt, max_new_tokens=3, cache_salt=self.cache_salt))


def chat_workload(served: ServedReplica, conversations: int, turns: int, seed: int) -> list[tuple[np.ndarray, Any]]:
    """Prompts and their no-cache references; each turn extends the last with the reference output."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(conversations):
        history = rng.integers(0, 256, 5 * served.page + 1, dtype=np.int32)
        for _ in range(turns):
            ref = served.engine.generate_no_cache(history, 3)
            out.append((history, ref))
            history = np.concatenate([history, np.asarray(ref.tokens, np.int32),
                                      rng.integers(0, 256, served.page + 2, dtype=np.int32)])
    return out


def is_exact(res: Any, ref: Any) -> bool:
    """The served output and first-token logits equal the no-cache reference's, bit for bit."""
    return tuple(res.output) == tuple(ref.tokens) and np.array_equal(res.last_logits, ref.logits[0])


def hit_tokens(res: Any) -> int:
    return int(res.device_hit_tokens + res.loaded_tokens)


def serve(args: argparse.Namespace) -> dict[str, Any]:
    ray = _connect_ray()
    from hicache.cluster.errors import HiCacheError

    retryable = (HiCacheError, ray.exceptions.RayError)
    served = ServedReplica(args.replica, args.timeout, args.gs_url, args.setup_timeout, wait_for_l3=args.wait_for_l3)
    served.engine.timeout_s = args.setup_timeout  # the references: more programs to compile
    work = chat_workload(served, args.conversations, args.turns, args.seed)
    served.engine.timeout_s = args.timeout
    # turn-major order: a conversation's next turn comes after every conversation's previous one
    order = [c * args.turns + t for t in range(args.turns) for c in range(args.conversations)]
    split = len(order) // 2 if args.drill else len(order)
    wrong, results = 0, []
    for i in order[:split]:
        res = served.serve(work[i][0])
        wrong += not is_exact(res, work[i][1])
        results.append(hit_tokens(res))
    out: dict[str, Any] = {"requests": split, "wrong_outputs": wrong, "hit_tokens": sum(results)}
    if not args.drill:
        return out
    served.client.flush_write_through_acks()  # what the warm half stored reaches L3 before the fault
    _emit({"event": "warm"})
    if not sys.stdin.readline():
        raise RuntimeError("stdin closed before the fault was injected")
    t_fault = time.monotonic()
    deadline = t_fault + args.deadline
    recomputed, failures, max_blocked = 0, 0, 0.0
    last_failure, hit_times = t_fault, []  # hit_times: when each request served with hits ended
    storage_hits = 0  # requests after the fault that reused KV fetched from L3 (the storage host)
    # the second half, then the first again (hits after recovery: L3, or L1/L2 once refilled)
    for i in order[split:] + order[:split]:
        prompt, ref = work[i]
        while True:
            t = time.monotonic()
            try:
                res = served.serve(prompt)
            except retryable as e:
                last_failure = time.monotonic()
                max_blocked = max(max_blocked, last_failure - t)
                failures += 1
                if failures == 1:
                    _emit({"event": "failed", "error": f"{type(e).__name__}: {str(e)[:200]}"})
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no recovery within {args.deadline}s: {type(e).__name__}: {e}") from e
                _reattach(served, retryable, deadline)
                continue
            max_blocked = max(max_blocked, time.monotonic() - t)
            break
        wrong += not is_exact(res, ref)
        storage_hits += res.storage_tokens > 0
        if hit_tokens(res) == 0:
            recomputed += 1
        else:
            hit_times.append(time.monotonic())
    after = [t for t in hit_times if t > last_failure]
    recovery = after[0] - t_fault if after else None
    out.update(wrong_outputs=wrong, requests=split + len(order), failures=failures, max_blocked_s=round(max_blocked, 3),
               recomputed_requests=recomputed, storage_hit_requests=storage_hits, recovery_s=None if recovery is None else round(recovery, 3))
    out["l3"] = served.client.cache_stats().get("storage", {})  # why a request after the fault did not fetch
    return out


def _reattach(served: ServedReplica, retryable: tuple[type[BaseException], ...], deadline: float) -> None:
    """New engine handles and scheduler once the replica has a gang again (bounded by ``deadline``)."""
    errors: tuple[type[BaseException], ...] = (*retryable, ValueError)  # ValueError: no host workers yet
    while True:
        try:
            served.attach()
            return
        except errors:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)  # polls the head's rebuild; bounded by the drill's deadline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("probe")
    p.add_argument("--replica")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--timeout", type=float, default=30.0)
    s = sub.add_parser("serve")
    s.add_argument("--replica", required=True)
    s.add_argument("--gs-url", help="L3 bucket URL (the rehearsal's emulator); absent: no L3")
    s.add_argument("--conversations", type=int, default=3)
    s.add_argument("--turns", type=int, default=4)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--timeout", type=float, default=10.0, help="per call (engine and client)")
    s.add_argument("--setup-timeout", type=float, default=180.0,
                   help="per call while a (new) gang compiles its forwards: the warm-up, the references")
    s.add_argument("--drill", action="store_true")
    s.add_argument("--wait-for-l3", action="store_true",
                   help="requests wait for L3 (up to --timeout / 2), cost model off: L3's hits are served from L3")
    s.add_argument("--deadline", type=float, default=120.0, help="drill: recovery must happen within this")
    args = parser.parse_args(argv)
    _emit(probe(args) if args.cmd == "probe" else serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
