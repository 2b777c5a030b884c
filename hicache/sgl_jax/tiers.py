"""The embedded head and its tiers over sgl-jax's device KV pool (runs in sgl-jax's scheduler process).

L1 is sgl-jax's own device pool (``MHATokenToKVPool``: one fused K/V array per layer, which sgl-jax's
forward donates and replaces every step); the head pages it with sgl-jax's page ids. With
``HiCacheOptions.host_pages`` a ``HostWorker`` in this process wraps those arrays
(``hicache.workers.fused_pool.FusedLayerPool``) and owns hicache's host pool (L2); with ``l3_url`` the
head also attaches hicache's fsspec store (L3) under a fingerprint of the model's files. The worker's
transfers run on the scheduler thread (the head dispatches them inside its calls), which with sgl-jax's
overlap scheduler disabled is the thread that runs every forward: transfers and forwards are ordered
by that thread and JAX's donation rules, as ``HostWorker`` requires.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

from hicache.cluster import CacheClient, CacheHead, EmbeddedTransport
from hicache.cluster.storage_tier import StorageParams
from hicache.cluster.worker_group import LocalWorkerGroup
from hicache.sgl_jax.options import HiCacheOptions
from hicache.storage import ModelFingerprint
from hicache.workers import HostWorker, KVCacheSpec
from hicache.workers.fused_pool import FusedLayerPool

LAYOUT_VERSION = 1  # of the L2/L3 page bytes written from sgl-jax's pool ([L, 2, S, H, D] of its dtype)
_HASHED_BYTES = 1 << 20  # of each weight file, with its name and size, in the model fingerprint


def kv_spec(kvcache: Any, page_size: int) -> KVCacheSpec:
    """The page shape of sgl-jax's fused pool; ValueError for a pool hicache's tiers cannot hold."""
    layers = getattr(kvcache, "kv_buffer", None)
    if type(kvcache).__name__ != "MHATokenToKVPool" or not isinstance(layers, list) or not layers:
        raise ValueError(f"hicache's host tier holds sgl-jax's MHATokenToKVPool only, this model has a "
                         f"{type(kvcache).__name__} (MLA / hybrid KV layouts are not supported yet)")
    pages, size, fused, packing, head_dim = layers[0].shape
    if size != page_size:
        raise ValueError(f"sgl-jax's KV pool has pages of {size} tokens, the scheduler uses {page_size}")
    return KVCacheSpec(len(layers), fused * packing // 2, head_dim, page_size, np.dtype(layers[0].dtype).name)


def fused_pool(kvcache: Any, spec: KVCacheSpec) -> FusedLayerPool:
    """sgl-jax's layer arrays as hicache's L1 pool: read from and handed back to its KV pool object."""
    return FusedLayerPool(spec, lambda: kvcache.kv_buffer, kvcache.replace_buffer, mesh=kvcache.mesh,
                          layer_spec=kvcache.kv_sharding.spec)


def model_id(model_path: str, spec: KVCacheSpec, tp_size: int) -> str:
    """An L3 namespace for the model at ``model_path``: its config, each weight file's name, size and first
    MiB, the KV spec, and what the KV bits depend on beyond the weights (backend, TP degree). The same
    files on another restart or replica give the same id."""
    folder = Path(model_path)
    h = hashlib.sha256()
    for name in ("config.json", "generation_config.json"):
        if (folder / name).is_file():
            h.update(name.encode() + b"\0" + (folder / name).read_bytes())
    weights = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin"))
    if not weights:
        h.update(f"no-weights:{folder.resolve()}".encode())  # (load_format="dummy": random weights per start)
    for f in weights:
        with open(f, "rb") as fh:
            h.update(f"{f.name}\0{f.stat().st_size}\0".encode() + fh.read(_HASHED_BYTES))
    h.update(json.dumps([spec.page_size, spec.dtype, jax.default_backend(), tp_size]).encode())
    return f"sgl-jax-{h.hexdigest()[:24]}"


def fingerprint(options: HiCacheOptions, spec: KVCacheSpec, model_path: str, tp_size: int) -> ModelFingerprint:
    mid = options.model_id or model_id(model_path, spec, tp_size)
    return ModelFingerprint(mid, spec.dtype, spec.page_size, spec.num_layers, spec.num_kv_heads, spec.head_dim,
                            LAYOUT_VERSION)


def rank_worker(options: HiCacheOptions, kvcache: Any, *, page_size: int, num_pages: int,
                rank: int = 0) -> HostWorker:
    """This process's host worker over its shard of sgl-jax's pool (``num_pages`` pages plus the padding page)
    with ``options.host_pages`` L2 slots; ``rank``: its host index (sgl-jax's ``node_rank``)."""
    spec = kv_spec(kvcache, page_size)
    pool = fused_pool(kvcache, spec)
    if pool.num_pages != num_pages + 1:
        raise ValueError(f"sgl-jax's KV pool has {pool.num_pages} pages, expected {num_pages} + its padding page")
    return HostWorker(spec, pool.num_pages, options.host_pages, host_index=rank, device_pool=pool)


def attach_storage(options: HiCacheOptions, worker: HostWorker, model_path: str, tp_size: int) -> Any:
    """``attach(head)``: attaches ``options.l3_url`` as the head's L3 (None without one)."""
    if options.l3_url is None:
        return None
    params = StorageParams(options.l3_url, fingerprint(options, worker.device_pool.spec, model_path, tp_size),
                           prefetch_policy="wait_complete", prefetch_min_tokens=options.l3_min_tokens,
                           pages_per_object=options.l3_pages_per_object)
    return lambda head: head.attach_storage_backend(params)


def build_client(options: HiCacheOptions, kvcache: Any, *, page_size: int, num_pages: int, model_path: str,
                 tp_size: int) -> tuple[CacheClient, HostWorker | None]:
    """The embedded head over sgl-jax's ``num_pages`` pages (ids 1..num_pages; see ``HiCacheOptions``), with
    L2 and L3 as ``options`` say, and its host worker (None for L1 only)."""
    config = options.head_config(page_size=page_size, num_pages=num_pages)
    if not options.host_pages:
        return CacheClient(EmbeddedTransport(CacheHead(config)), page_size), None
    worker = rank_worker(options, kvcache, page_size=page_size, num_pages=num_pages)
    head = CacheHead(config, LocalWorkerGroup([worker]))
    attach = attach_storage(options, worker, model_path, tp_size)
    if attach is not None:
        attach(head)
    return CacheClient(EmbeddedTransport(head), page_size), worker
