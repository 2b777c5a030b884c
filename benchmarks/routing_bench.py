"""Routing benchmark: 4 replicas, one shared L3, four routers, on the Mooncake trace and on multi-turn chat.

``python -m benchmarks.routing_bench --json PATH [--quick]``

Replicas: 4 embedded stacks (``hicache.reference.stack.build_stack``: head + HostWorker + reference
engine in this process), the same L1/L2 each, one ``file://`` L3 directory shared by all four (fresh
stacks and a fresh L3 per router). Routers, each on the same request stream:

* ``round_robin``;
* ``power_of_two``: Ray Serve's ``PowerOfTwoChoicesRequestRouter`` (Serve's default), the real class;
* ``ray_prefix_affinity``: Ray Serve LLM's ``PrefixCacheAffinityRouter``, the real class with its real
  ``PrefixTreeActor`` (a local Ray instance), fed each prompt's equivalent text;
* ``hicache_tier_aware``: ``hicache.routing.TierAwareRouter`` asking each replica's head
  (``route_query``) and its load, with a ``TTFTModel`` calibrated here.

The Ray routers are driven from Python: ``TraceReplica`` stands for a Serve ``RunningReplica`` (its id,
its queue length) and Serve's own ``_select_from_candidate_replicas`` picks among the ranks they return.

Time is virtual (``benchmarks.workload``'s queue model, per replica): a request is sent at its trace
timestamp (time-scaled so the replicas would be ``--load`` busy if nothing were cached), or for chat
after its conversation's previous answer; it is routed then (loads are the virtual queues: requests
queued or running on each replica at that instant), served at once for real (one request at a time,
start to finish, ``Scheduler.serve``), and its measured TTFT and latency are placed on its replica's
virtual clock (FCFS): client TTFT = queue wait + measured TTFT. L3 writes land in real time, so a later
request on another replica may see a write that, in virtual time, would still be in flight.

Trace replay (``traces/README.md``): each hash id becomes ``--block-tokens`` synthetic tokens (a
deterministic function of the id; the trace's 512-token blocks scaled down to fit the reference
engine) and, for text routers, an equivalent 8-character text (two prompts share a text prefix exactly
when they share hash ids); prompts are cut to the engine's context; outputs are scaled like inputs.

JSON: ``{"workload", "routers": [{"name", "prefill_tokens_computed", "hit_rate", "ttft_mean_s",
"ttft_p90_s", "max_over_mean_load", ...}]}`` per workload (``max_over_mean_load``: requests served by
the busiest replica over the mean). Every router's outputs are compared with the first router's
(``outputs_agree``): each is exact.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import heapq
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.report import jsonable
from benchmarks.workload import MODEL, log, poisson_ticks
from hicache.cluster.tree import RadixKey
from hicache.reference.engine.config import ForwardConfig
from hicache.reference.engine.runner import ModelRunner
from hicache.reference.serve_types import ServeRequest, ServeResult
from hicache.reference.stack import EmbeddedStack, StackOptions, build_stack, warm_up
from hicache.routing import HeadProbe, ReplicaLoad, RouterOptions, TierAwareRouter, TTFTModel
from hicache.workloads import MultiTurnSpec, multi_turn

TRACE_NAME = Path("shared") / "traces" / "mooncake_synthetic_trace.jsonl"


def default_trace() -> Path:
    """``shared/traces/...`` in the checkout or the nearest folder above it that has one."""
    for d in Path(__file__).resolve().parents[1:]:
        if (d / TRACE_NAME).is_file():
            return d / TRACE_NAME
    return Path("/work") / TRACE_NAME

FWD = ForwardConfig(chunk_size=16, page_size=8, max_pages=128)  # max context 1024 tokens
REPLICAS = 4
ROUTERS = ("round_robin", "power_of_two", "ray_prefix_affinity", "hicache_tier_aware", "hicache_tier_aware_counts")


@dataclass(frozen=True)
class Request:
    index: int
    send_s: float  # trace: its arrival; chat: the earliest it may be sent (after its previous turn)
    prompt: np.ndarray  # i32[n]
    text: str  # the equivalent text a text-based router sees
    max_new_tokens: int
    conversation: int | None = None  # chat: the next turn of a conversation waits for this one


@dataclass(frozen=True)
class TextPrompt:
    """A request argument as Ray Serve LLM's routers read it (``.prompt``)."""

    prompt: str


# -- workloads -------------------------------------------------------------------------------------
def block_tokens(hash_id: int, n: int) -> np.ndarray:
    return np.random.default_rng([7, hash_id]).integers(0, MODEL.vocab_size, n, dtype=np.int32)


def block_text(hash_id: int) -> str:
    return f"{hash_id:08x}"


def trace_requests(path: Path, limit: int | None, block: int) -> tuple[list[Request], float]:
    """The trace's requests (the first ``limit``) and its duration in seconds."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = rows[:limit] if limit else rows
    max_blocks = (FWD.max_context - 64) // block
    reqs = []
    for i, r in enumerate(rows):
        ids = r["hash_ids"][:max_blocks]
        n = min(max(1, round(r["input_length"] * block / 512)), len(ids) * block)
        prompt = np.concatenate([block_tokens(h, block) for h in ids])[:n]
        text = "".join(block_text(h) for h in ids)[: max(1, n * 8 // block)]
        out = max(1, min(round(r["output_length"] * block / 512), 32))
        reqs.append(Request(i, r["timestamp"] / 1000.0, prompt, text, out))
    return reqs, rows[-1]["timestamp"] / 1000.0


def chat_requests(quick: bool) -> tuple[list[list[Request]], float]:
    """Multi-turn chat (``hicache.workloads.multi_turn``, shapes scaled to the engine): one list of
    turns per conversation; conversation c's first turn is sent at a Poisson tick."""
    spec = MultiTurnSpec(conversations=16 if quick else 48, turns=4 if quick else 6, system_prompts=4,
                         system_tokens=(96, 192), user_tokens=(8, 40), output_tokens=(4, 12),
                         vocab_size=MODEL.vocab_size, seed=3)
    rounds = multi_turn(spec)
    convs: list[list[Request]] = [[] for _ in range(spec.conversations)]
    ticks = poisson_ticks(spec.conversations, 1.0, seed=5)
    k = 0
    for rnd in rounds:
        for t in rnd:
            text = ",".join(map(str, t.prompt.tolist()))
            convs[t.conversation].append(Request(k, float(ticks[t.conversation]) if t.round == 0 else 0.0, t.prompt,
                                                 text, int(len(t.output)), t.conversation))
            k += 1
    return convs, float(ticks[-1])


@dataclass(frozen=True)
class ServiceClock:
    """How long a served request occupies its replica on the virtual clock. ``measured``: the wall
    times ``Scheduler.serve`` took (on a shared CPU, other processes' load is in them); ``model``: the
    calibrated per-token costs applied to how the request was really served (tokens computed, loaded
    from L2, fetched from L3, decoded), so routers are compared on their decisions, not on the noise."""

    mode: str
    cost: TTFTModel
    decode_s: float

    def times(self, res: ServeResult, max_new_tokens: int) -> tuple[float, float]:
        if self.mode == "measured":
            return res.ttft_s, res.latency_s
        c = self.cost
        l3 = res.storage_tokens
        ttft = (c.request_s + res.computed_tokens * c.compute_s_per_token + (res.loaded_tokens - l3) * c.l2_s_per_token
                + l3 * (c.l3_s_per_token + c.l2_s_per_token))
        return ttft, ttft + (max_new_tokens - 1) * self.decode_s


# -- the Ray routers' view of a replica -------------------------------------------------------------
class TraceReplica:
    """What Serve's request routers read of a ``RunningReplica``: its id, node, queue length (here: the
    requests queued or running on this replica's virtual clock)."""

    def __init__(self, deployment_id: Any, index: int, queue_len: Callable[[], int]) -> None:
        from ray.serve._private.common import ReplicaID

        self.replica_id = ReplicaID(f"replica-{index}", deployment_id)
        self.index = index
        self._queue_len = queue_len
        self.node_id = "node-0"
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()
        self.routing_stats: dict[str, Any] = {}
        self.max_ongoing_requests = 1 << 20
        self.is_cross_language = False

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self._queue_len()


class RayRouterDriver:
    """One of Ray Serve's request routers, driven per request: ``choose_replicas`` then Serve's own
    ``_select_from_candidate_replicas`` (lowest queue among the first rank that has one), then
    ``on_request_routed``."""

    def __init__(self, name: str, replicas: int, queue_len: Callable[[int], int]) -> None:
        from ray.serve._private.common import DeploymentHandleSource, DeploymentID

        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        dep = DeploymentID(name="bench", app_name="routing")
        if name == "power_of_two":
            from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter as cls
            kwargs: dict[str, Any] = {}
        else:
            from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
                PrefixCacheAffinityRouter as cls,
            )
            from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTreeActor

            self.tree = PrefixTreeActor.remote()
            kwargs = {"tree_actor": self.tree}
        self.replicas = [TraceReplica(dep, i, (lambda i=i: queue_len(i))) for i in range(replicas)]

        async def start() -> Any:  # the router binds to the running loop
            router = cls(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN, self_node_id="node-0")
            router.initialize_state(**kwargs)
            router.update_replicas(self.replicas)
            return router

        self.router = self.loop.run_until_complete(start())

    def route(self, req: Request) -> int:
        return self.loop.run_until_complete(self._route(req))

    async def _route(self, req: Request) -> int:
        from ray.serve._private.common import RequestMetadata
        from ray.serve._private.request_router.common import PendingRequest

        pending = PendingRequest([TextPrompt(req.text)], {}, RequestMetadata(str(req.index), str(req.index)))
        ranks = await self.router.choose_replicas(self.replicas, pending)
        chosen = None
        for rank in ranks:
            if rank:
                chosen = await self.router._select_from_candidate_replicas(rank, 0)
                if chosen is not None:
                    break
        if chosen is None:
            raise RuntimeError(f"{type(self.router).__name__} chose no replica for request {req.index}")
        self.router.on_request_routed(pending, chosen.replica_id, None)
        return chosen.index

    def close(self) -> None:
        self.loop.close()


# -- replay ---------------------------------------------------------------------------------------
class Replicas:
    """4 fresh stacks on one fresh L3 directory, with their virtual clocks (FCFS per replica)."""

    def __init__(self, options: StackOptions, runner: ModelRunner, l3_dir: Path | None) -> None:
        opts = dataclasses.replace(options, l3_url=None if l3_dir is None else f"file://{l3_dir}")
        self.stacks: list[EmbeddedStack] = [build_stack(opts, runner) for _ in range(REPLICAS)]
        self.finishes: list[list[tuple[float, float]]] = [[] for _ in range(REPLICAS)]  # (start, finish)
        self.free_at = [0.0] * REPLICAS
        self.now = 0.0

    def load(self, r: int, backlog: bool = True) -> ReplicaLoad:
        """Requests queued and running on replica r now; with ``backlog``, its time until they are done
        (what a replica's loop estimates from its queue; here its virtual clock knows it)."""
        queued = running = 0
        for start, finish in self.finishes[r][-64:]:
            if finish > self.now:
                if start > self.now:
                    queued += 1
                else:
                    running += 1
        return ReplicaLoad(queued, running, max(0.0, self.free_at[r] - self.now) if backlog else None)

    def outstanding(self, r: int) -> int:
        return self.load(r).outstanding

    def serve(self, r: int, req: Request, clock: ServiceClock) -> tuple[ServeResult, float, float, float]:
        """Serves ``req`` on replica ``r`` now (real), places it on r's clock; (result, client TTFT, finish,
        service time)."""
        res = self.stacks[r].scheduler.serve(ServeRequest(req.prompt, req.max_new_tokens))
        ttft_s, latency_s = clock.times(res, req.max_new_tokens)
        start = max(self.now, self.free_at[r])
        finish = start + latency_s
        self.free_at[r] = finish
        self.finishes[r].append((start, finish))
        return res, start - self.now + ttft_s, finish, latency_s

    def close(self) -> None:
        for s in self.stacks:
            s.client.flush_write_through_acks()


def make_router(name: str, reps: Replicas, cost: TTFTModel) -> tuple[Callable[[Request], int], Callable[[float], None], Any]:
    """(route(request) -> replica, observe(service seconds), the router object)."""
    if name == "round_robin":
        turn = iter(range(1 << 62))
        return (lambda req: next(turn) % REPLICAS), (lambda s: None), None
    if name in ("power_of_two", "ray_prefix_affinity"):
        drv = RayRouterDriver(name, REPLICAS, reps.outstanding)
        return drv.route, (lambda s: None), drv
    if name in ("hicache_tier_aware", "hicache_tier_aware_counts"):
        router = TierAwareRouter(RouterOptions(cost=cost, parallel=False))
        backlog = name == "hicache_tier_aware"
        probes = [HeadProbe(f"replica-{i}", s.client, (lambda i=i: reps.load(i, backlog)))
                  for i, s in enumerate(reps.stacks)]
        return (lambda req: router.route(RadixKey(req.prompt), probes).index), router.observe_service, router
    raise ValueError(f"unknown router {name!r}; choose from {ROUTERS}")


def replay(name: str, streams: Sequence[Sequence[Request]], scale: float, options: StackOptions,
           runner: ModelRunner, clock: ServiceClock, tmp: Path, shared_l3: bool = True) -> dict[str, Any]:
    """Routes and serves ``streams`` (each a chain: a request is sent after the previous one finished,
    or a single request) with router ``name``; returns its record (and outputs, for the exactness check)."""
    l3 = tmp / f"l3-{name}" if shared_l3 else None
    reps = Replicas(options, runner, l3)
    route, observe, router = make_router(name, reps, clock.cost)
    heap = [(s[0].send_s * scale, s[0].index, k, 0) for k, s in enumerate(streams) if s]
    heapq.heapify(heap)
    ttfts, computed, prompt_tokens, served = [], 0, 0, [0] * REPLICAS
    tiers = {"l1": 0, "l2_loaded": 0, "l3_fetched": 0}
    outputs: dict[int, tuple[int, ...]] = {}
    route_s: list[float] = []
    while heap:
        sent, _, k, j = heapq.heappop(heap)
        req = streams[k][j]
        reps.now = sent
        t = time.perf_counter()
        r = route(req)
        route_s.append(time.perf_counter() - t)
        reps.now = sent + route_s[-1]  # the routing call delays the request
        res, ttft, finish, service_s = reps.serve(r, req, clock)
        ttft += route_s[-1]
        observe(service_s)
        ttfts.append(ttft)
        computed += res.computed_tokens
        prompt_tokens += res.prompt_len
        tiers["l1"] += res.device_hit_tokens
        tiers["l2_loaded"] += res.loaded_tokens - res.storage_tokens
        tiers["l3_fetched"] += res.storage_tokens
        served[r] += 1
        outputs[req.index] = res.output
        if j + 1 < len(streams[k]):
            nxt = streams[k][j + 1]
            heapq.heappush(heap, (max(finish, nxt.send_s * scale), nxt.index, k, j + 1))
    reps.close()
    if router is not None and hasattr(router, "close"):
        router.close()
    if l3 is not None:
        shutil.rmtree(l3, ignore_errors=True)
    tt = np.asarray(ttfts)
    lat = np.asarray(route_s)
    bare = tt - lat
    rec: dict[str, Any] = {
        "name": name,
        "prefill_tokens_computed": int(computed),
        "hit_rate": 1.0 - computed / prompt_tokens,
        "ttft_mean_s": float(tt.mean()),
        "ttft_p90_s": float(np.percentile(tt, 90)),
        "max_over_mean_load": max(served) / (sum(served) / REPLICAS),
        "requests": len(ttfts),
        "prompt_tokens": int(prompt_tokens),
        "reused_tokens": tiers,
        "requests_per_replica": served,
        "route_latency_mean_s": float(lat.mean()),
        "route_latency_p99_s": float(np.percentile(lat, 99)),
        "ttft_mean_excl_route_s": float(bare.mean()),  # the same requests, the routing call not counted
        "ttft_p90_excl_route_s": float(np.percentile(bare, 90)),
    }
    if isinstance(router, TierAwareRouter):
        rec["router_stats"] = router.stats.summary()
    return {"record": rec, "outputs": outputs}


# -- calibration ------------------------------------------------------------------------------------
def calibrate(options: StackOptions, runner: ModelRunner, tmp: Path, reps: int = 5) -> tuple[TTFTModel, float]:
    """The router's ``TTFTModel`` from this machine: per-token TTFT of a prompt computed, loaded back
    from L2 and fetched from L3, a request's fixed cost; and the decode time per output token. The
    fastest of ``reps`` runs each (other processes on a shared CPU only ever add time)."""
    rng = np.random.default_rng(11)
    n = 256
    rows: dict[str, list[float]] = {"compute": [], "l2": [], "l3": [], "fixed": [], "decode": []}
    for i in range(reps):
        l3 = tmp / f"calib-{i}"
        opts = dataclasses.replace(options, l3_url=f"file://{l3}")
        a, b = build_stack(opts, runner), build_stack(opts, runner)
        small = ServeRequest(rng.integers(0, MODEL.vocab_size, 9, dtype=np.int32), 1)
        rows["fixed"].append(a.scheduler.serve(small).ttft_s)
        p = ServeRequest(rng.integers(0, MODEL.vocab_size, n + 1, dtype=np.int32), 9)
        first = a.scheduler.serve(p)
        rows["compute"].append(first.ttft_s / n)
        rows["decode"].append((first.latency_s - first.ttft_s) / 8)
        a.client.flush_write_through_acks()
        a.client.evict(options.l1_pages * FWD.page_size)
        rows["l2"].append(a.scheduler.serve(p).ttft_s / n)
        a.client.flush_write_through_acks()
        rows["l3"].append(b.scheduler.serve(p).ttft_s / n)
        b.client.flush_write_through_acks()
        shutil.rmtree(l3, ignore_errors=True)
    med = {k: float(np.min(v)) for k, v in rows.items()}
    l2 = max(0.0, med["l2"] - med["fixed"] / n)
    l3 = max(0.0, med["l3"] - med["fixed"] / n - l2)
    cost = TTFTModel(compute_s_per_token=med["compute"], l2_s_per_token=l2, l3_s_per_token=l3,
                     request_s=med["fixed"], service_s=med["compute"] * n)
    return cost, med["decode"]


def time_scale(streams: Sequence[Sequence[Request]], duration_s: float, cost: TTFTModel, decode_s: float,
               load: float) -> float:
    """The factor on send times that keeps the replicas ``load`` busy if nothing were cached."""
    work = sum(cost.request_s + len(r.prompt) * cost.compute_s_per_token + (r.max_new_tokens - 1) * decode_s
               for s in streams for r in s)
    return work / (REPLICAS * load) / max(duration_s, 1e-9)


# -- main -------------------------------------------------------------------------------------------
def run_workload(label: str, streams: Sequence[Sequence[Request]], scale: float, options: StackOptions,
                 runner: ModelRunner, clock: ServiceClock, routers: Sequence[str], tmp: Path,
                 shared_l3: bool) -> dict[str, Any]:
    records, first_outputs, agree = [], None, True
    for name in routers:
        t = time.perf_counter()
        out = replay(name, streams, scale, options, runner, clock, tmp, shared_l3)
        rec = out["record"]
        if first_outputs is None:
            first_outputs = out["outputs"]
        else:
            agree = agree and out["outputs"] == first_outputs
        log(f"{label} {name}: computed {rec['prefill_tokens_computed']} hit {rec['hit_rate']:.3f} "
            f"ttft mean {rec['ttft_mean_s'] * 1e3:.1f} ms p90 {rec['ttft_p90_s'] * 1e3:.1f} ms "
            f"load max/mean {rec['max_over_mean_load']:.2f} ({time.perf_counter() - t:.0f} s)")
        records.append(rec)
    return {"workload": label, "time_scale": scale, "outputs_agree": agree, "routers": records}


def targets(wl: dict[str, Any]) -> dict[str, Any]:
    recs = {r["name"]: r for r in wl["routers"]}
    ours = recs.get("hicache_tier_aware")
    others = [r for n, r in recs.items() if not n.startswith("hicache_")]
    if ours is None or not others:
        return {}
    best = min(others, key=lambda r: r["prefill_tokens_computed"])
    return {
        "best_other": best["name"],
        "prefill_ratio": best["prefill_tokens_computed"] / max(1, ours["prefill_tokens_computed"]),
        "ttft_mean_vs_best_other": ours["ttft_mean_s"] / min(r["ttft_mean_s"] for r in others),
        "ttft_p90_vs_best_other": ours["ttft_p90_s"] / min(r["ttft_p90_s"] for r in others),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="the first 1000 trace requests, a small chat")
    ap.add_argument("--trace", type=Path, default=None, help="default: shared/traces/ above the checkout")
    ap.add_argument("--requests", type=int, default=0, help="trace requests (0: all; --quick: 1000)")
    ap.add_argument("--block-tokens", type=int, default=8, help="tokens per trace hash id")
    ap.add_argument("--load", type=float, default=0.9, help="replica utilization if nothing were cached")
    ap.add_argument("--l1-pages", type=int, default=256)
    ap.add_argument("--l2-slots", type=int, default=1024)
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--clock", choices=("model", "measured"), default="model",
                    help="service times on the virtual clock: calibrated per-token costs, or the wall times")
    ap.add_argument("--l3", choices=("shared", "none"), default="shared",
                    help="one file:// L3 shared by the replicas, or none (L1+L2 per replica only)")
    ap.add_argument("--workloads", default="trace,chat")
    args = ap.parse_args(argv)
    routers = [r for r in args.routers.split(",") if r]
    for r in routers:
        if r not in ROUTERS:
            raise SystemExit(f"unknown router {r!r}; choose from {ROUTERS}")
    import ray

    if "ray_prefix_affinity" in routers and not ray.is_initialized():
        # The prefix router's tree actor: in a Ray job, on the job's cluster (a private instance would lack
        # the job's runtime env package, kept in that cluster's GCS); else a private local instance (never
        # a cluster already running here).
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        else:
            ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    runner = ModelRunner(MODEL, FWD, num_pages=args.l1_pages)
    options = StackOptions(MODEL, FWD, l1_pages=args.l1_pages, l2_slots=args.l2_slots, prefetch_min_tokens=8)
    tmp = Path(tempfile.mkdtemp(prefix="routing-bench-"))
    try:
        log("warm-up (compiles)")
        warm = build_stack(dataclasses.replace(options, l3_url=f"file://{tmp}/warm"), runner)
        warm_up(warm)
        warm.client.flush_write_through_acks()
        cost, decode_s = calibrate(options, runner, tmp)
        log(f"calibrated: {cost}, decode {decode_s * 1e3:.2f} ms/token")
        clock = ServiceClock(args.clock, cost, decode_s)
        result: dict[str, Any] = {"replicas": REPLICAS, "replica_kind": "embedded stacks in one process",
                                  "l3": "one file:// directory shared by the replicas" if args.l3 == "shared" else "none",
                                  "l1_pages": args.l1_pages, "l2_slots": args.l2_slots, "page_size": FWD.page_size,
                                  "block_tokens": args.block_tokens, "load": args.load, "clock": args.clock,
                                  "cost_model": dataclasses.asdict(cost), "decode_s_per_token": decode_s,
                                  "workloads": []}
        wls = [w for w in args.workloads.split(",") if w]
        if "trace" in wls:
            limit = args.requests or (1000 if args.quick else None)
            reqs, duration = trace_requests(args.trace or default_trace(), limit, args.block_tokens)
            streams = [[r] for r in reqs]
            scale = time_scale(streams, duration, cost, decode_s, args.load)
            wl = run_workload("mooncake_trace", streams, scale, options, runner, clock, routers, tmp,
                              args.l3 == "shared")
            wl["requests"] = len(reqs)
            wl["targets"] = targets(wl)
            result["workloads"].append(wl)
        if "chat" in wls:
            convs, duration = chat_requests(args.quick)
            scale = time_scale(convs, duration, cost, decode_s, args.load)
            wl = run_workload("multi_turn_chat", convs, scale, options, runner, clock, routers, tmp,
                              args.l3 == "shared")
            wl["requests"] = sum(len(c) for c in convs)
            wl["targets"] = targets(wl)
            result["workloads"].append(wl)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(jsonable(result), indent=1))
        for wl in result["workloads"]:
            log(f"{wl['workload']}: {wl['targets']} outputs agree: {wl['outputs_agree']}")
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if ray.is_initialized():
            ray.shutdown()


if __name__ == "__main__":
    main()
