"""A multi-replica Ray Serve app for the reference engine, routed by ``HiCacheRequestRouter``.

Each Serve replica (``HiCacheReplica``) runs one embedded stack (``hicache.reference.stack``: its own head,
host worker and engine, its own L1/L2) on the app's one shared L3 URL, and answers routers' probes on a
loopback ``ProbeServer`` whose address it publishes through Serve's routing stats. Start it with
``serve run hicache.routing.serve_app:app_builder l3_url=file:///tmp/hicache-l3 num_replicas=4`` (or
``serve run ray_configs/serve_routing.yaml``), then send ``GenerateRequest``s through the app's handle.

Threads in a replica: Serve's request threads call ``__call__``; one request is served at a time
(``_serve_lock``); the head is called under ``_head_lock`` one call at a time, by the serving thread and
by the probe server's connection threads (a probe waits for one head call, never for a whole request).
``ReplicaOptions.test_hooks`` lets the probe server take ``HoldProbes`` frames (answers wait, bounded,
until released): the hook the tests use for heads that do not answer in time.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from hicache.cluster.client import CacheClient, DoneStep, EmbeddedTransport
from hicache.cluster.head import CacheHead, Call, CallResult
from hicache.cluster.route_query import RouteQuery
from hicache.routing.probes import ProbeServer
from hicache.routing.router import ReplicaLoad, ReplicaView
from hicache.routing.serve_router import PROBE_STATS_KEY, GenerateRequest, HiCacheRequestRouter


class LockedTransport(EmbeddedTransport):
    """An in-process head shared by threads: every call and step under one lock."""

    def __init__(self, head: CacheHead, lock: threading.Lock) -> None:
        super().__init__(head)
        self._lock = lock

    def call(self, call: Call) -> Any:
        with self._lock:
            return super().call(call)

    def step(self, calls: Sequence[Call]) -> list[CallResult]:
        with self._lock:
            return super().step(calls)

    def submit(self, calls: Sequence[Call]) -> DoneStep:
        with self._lock:
            return super().submit(calls)


@dataclasses.dataclass(frozen=True)
class ReplicaOptions:
    """One replica's stack (``StackOptions`` fields; the model and shapes are the reference defaults)."""

    l3_url: str
    l1_pages: int = 128
    l2_slots: int = 256
    max_pages: int = 32
    prefetch_min_tokens: int = 8
    test_hooks: bool = False  # the probe server takes HoldProbes frames


class HiCacheReplica:
    def __init__(self, options: dict[str, Any]) -> None:
        from ray import get_runtime_context

        from hicache.reference.engine.config import ForwardConfig, ModelConfig
        from hicache.reference.stack import StackOptions, build_stack

        opts = ReplicaOptions(**options)
        fwd = ForwardConfig(chunk_size=16, page_size=8, max_pages=opts.max_pages)
        self.stack = build_stack(StackOptions(ModelConfig(), fwd, l1_pages=opts.l1_pages, l2_slots=opts.l2_slots,
                                              l3_url=opts.l3_url, prefetch_min_tokens=opts.prefetch_min_tokens))
        self._head_lock = threading.Lock()
        self._serve_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._queued = self._running = 0
        self.stack.scheduler.client = CacheClient(LockedTransport(self.stack.head, self._head_lock),
                                                  self.stack.client.page_size)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.probe_server = ProbeServer(self._answer, get_runtime_context().get_node_id(), test_hooks=opts.test_hooks)

    def _answer(self, query: RouteQuery) -> ReplicaView:
        with self._head_lock:
            answer = self.stack.head.route_query(query)
        with self._count_lock:
            load = ReplicaLoad(self._queued, self._running)
        return ReplicaView(answer, load)

    def record_routing_stats(self) -> dict[str, Any]:
        a = self.probe_server.address
        return {PROBE_STATS_KEY: {"node_id": a.node_id, "port": a.port, "token": a.token.hex()}}

    def __call__(self, req: GenerateRequest) -> dict[str, Any]:
        import numpy as np

        from hicache.reference.serve_types import ServeRequest

        if not isinstance(req, GenerateRequest):
            raise TypeError(f"expected a GenerateRequest, got {type(req).__name__}")
        with self._count_lock:
            self._queued += 1
        with self._serve_lock:
            with self._count_lock:
                self._queued -= 1
                self._running += 1
            try:
                res = self.stack.scheduler.serve(ServeRequest(np.asarray(req.prompt, dtype=np.int32),
                                                              req.max_new_tokens, req.extra_key, req.cache_salt))
            finally:
                with self._count_lock:
                    self._running -= 1
        return {"replica": self.replica_id, "output": list(res.output), "device_hit_tokens": res.device_hit_tokens,
                "loaded_tokens": res.loaded_tokens, "storage_tokens": res.storage_tokens,
                "computed_tokens": res.computed_tokens, "ttft_s": res.ttft_s,
                "tokens": res.tokens.as_dict() if res.tokens is not None else {}}  # by fate: hit tier or miss reason

    def __del__(self) -> None:
        server = getattr(self, "probe_server", None)
        if server is not None:
            server.close()


def deployment(num_replicas: int = 4, probe_timeout_s: float = 0.05, routing_stats_period_s: float = 0.5,
               max_ongoing_requests: int = 8, ray_actor_options: dict[str, Any] | None = None) -> Any:
    """``HiCacheReplica`` as a Serve deployment behind ``HiCacheRequestRouter``."""
    router: dict[str, Any] = {  # (RequestRouterConfig's __init__ is typed **kwargs: dict)
        "request_router_class": HiCacheRequestRouter,
        "request_router_kwargs": {"probe_timeout_s": probe_timeout_s},
        "request_routing_stats_period_s": routing_stats_period_s,
        "request_routing_stats_timeout_s": max(1.0, 4 * routing_stats_period_s),
    }
    return serve.deployment(
        HiCacheReplica,
        name="hicache",
        num_replicas=num_replicas,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options=ray_actor_options or {"num_cpus": 0},
        request_router_config=RequestRouterConfig(**router),
    )


def app_builder(args: dict[str, str]) -> Any:
    """``serve run hicache.routing.serve_app:app_builder l3_url=... [num_replicas=4] [probe_timeout_s=0.05]
    [l1_pages=128] [l2_slots=256]``: the app, every replica on the one L3 ``l3_url``."""
    if "l3_url" not in args:
        raise ValueError("app_builder needs l3_url=<fsspec URL every replica shares>")
    replica = {"l3_url": args["l3_url"]}
    for name in ("l1_pages", "l2_slots", "max_pages"):
        if name in args:
            replica[name] = int(args[name])  # type: ignore[assignment]
    dep = deployment(num_replicas=int(args.get("num_replicas", 4)),
                     probe_timeout_s=float(args.get("probe_timeout_s", 0.05)))
    return dep.bind(replica)
