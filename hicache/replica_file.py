"""Replica config files for ``hicache up``: a small YAML (or JSON) mapping -> ``ReplicaConfig``.

Example (see ``ray_configs/replicas/``)::

    replica: chat
    page_size: 16
    l1_pages: 8192            # L1 pages per replica (on the workers' devices)
    l2_slots: 65536           # L2 slots; 0 or absent: no host tier
    write_policy: write_through
    eviction_policy: lru
    model: {num_layers: 32, num_kv_heads: 8, head_dim: 128, dtype: bfloat16}  # (+ swa_layers: N with an
                              # swa component and a host tier: the workers keep those layers' pool)
    components:               # absent: full attention only; else the model's other cache components
      swa: {window: 4096, num_tokens: 262144, host_tokens: 1048576}   # SWAConfig fields
      mamba: {num_slots: 512, state_shapes: [[4, 128]], dtype: float32}  # MambaConfig fields; with a host
                              # tier, one [layers, hidden] shape (the workers' state pool, hidden split
                              # over 2 x num_kv_heads)
    workers:                  # absent: control plane only (a head without data plane)
      platform: cpu           # cpu (fake hosts) | tpu
      num_hosts: 2            # cpu
      devices_per_host: 2     # cpu
      topology: 4x4           # tpu
      accelerator: v6e        # tpu
      call_timeout_s: 30      # a host that does not answer a ping or poll this long is lost (the gang rebuilds)
    l3:                       # absent: no L3 at start (attach_storage_backend can add one at runtime)
      url: gs://bucket/kv     # fsspec URL: file:///dir, gs://bucket/prefix, memory://x
      model_id: llama3-8b     # with the model's dtype and shape: the L3 fingerprint (replicas of one
                              # model share L3 objects only with equal fingerprints)
      prefetch_min_tokens: 256  # any other StorageParams field by name (policy, timeouts, caps)
      storage: {max_bytes: 1099511627776}  # StorageConfig fields (file:// byte cap, io_threads, ...)
    preemption:               # absent: no watch; else the head drains to L3 on a notice from here
      kind: gce               # gce (the TPU VM's metadata server) | file (a path; its content, if a number,
      deadline_s: 30          # is the deadline) | signal (location: its name, default SIGTERM, to the head's
                              # process); deadline_s when the source gives none; poll_s, location

The L3 of ``l3`` is attached when the replica starts and again after every head restart or rebuild
(``ReplicaConfig.storage``). Every problem is one ``ValueError`` naming the key and the value.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from hicache.cluster.builder import ComponentConfig, MambaConfig, SWAConfig
from hicache.cluster.head import HeadConfig
from hicache.cluster.policy import HiCacheConfig
from hicache.cluster.storage_tier import StorageParams
from hicache.cluster.tree import TreeConfig
from hicache.storage import ModelFingerprint, StorageConfig

_TOP = {"replica", "page_size", "l1_pages", "l2_slots", "write_policy", "eviction_policy", "model", "workers",
        "max_restarts", "detached", "l3", "components", "preemption"}
_PREEMPTION = {"kind", "location", "deadline_s", "poll_s"}
_MODEL = {"num_layers", "num_kv_heads", "head_dim", "dtype", "swa_layers"}
_WORKERS = {"platform", "num_hosts", "devices_per_host", "topology", "accelerator", "start_timeout_s", "call_timeout_s"}


def _check_keys(where: str, got: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(got) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def load_replica_file(path: str | Path):  # -> ReplicaConfig
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"config file {str(p)!r} does not exist")
    try:
        raw = json.loads(p.read_text()) if p.suffix == ".json" else yaml.safe_load(p.read_text())
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ValueError(f"{p}: not valid YAML/JSON: {str(exc).splitlines()[0]}") from None
    if not isinstance(raw, Mapping):
        raise ValueError(f"{p}: expected a mapping at the top level, got {type(raw).__name__}")
    return replica_config(raw, str(p))


def replica_config(raw: Mapping[str, Any], where: str = "config"):  # -> ReplicaConfig
    from hicache.cluster.ray_head import ReplicaConfig
    from hicache.cluster.ray_workers import WorkerGroupOptions
    from hicache.cluster.tpu import tpu_slice_placement
    from hicache.workers import KVCacheSpec

    _check_keys(where, raw, _TOP)
    try:
        page_size = int(raw.get("page_size", 16))
        l1_pages = raw.get("l1_pages")
        l2_slots = int(raw.get("l2_slots", 0) or 0)
        tree = TreeConfig(page_size, None if l1_pages is None else int(l1_pages), raw.get("eviction_policy", "lru"))
        hicache = HiCacheConfig(l2_slots, raw.get("write_policy", "write_through")) if l2_slots else None
        components = _components(raw.get("components"), where)
        head = HeadConfig(str(raw.get("replica", "default")), tree, hicache, components)
        workers = None
        if raw.get("workers") is not None:
            w = raw["workers"]
            if not isinstance(w, Mapping):
                raise ValueError(f"workers must be a mapping, got {w!r}")
            _check_keys(f"{where}: workers", w, _WORKERS)
            model = raw.get("model")
            if not isinstance(model, Mapping):
                raise ValueError("workers need a model: {num_layers, num_kv_heads, head_dim, dtype}")
            _check_keys(f"{where}: model", model, _MODEL)
            spec = KVCacheSpec(int(model["num_layers"]), int(model["num_kv_heads"]), int(model["head_dim"]),
                               page_size, str(model.get("dtype", "bfloat16")))
            platform = w.get("platform", "cpu")
            extra: dict[str, Any] = {k: float(w[k]) for k in ("start_timeout_s", "call_timeout_s") if k in w}
            if hicache is not None:  # the workers keep the pools of the components' host tiers
                extra["component_specs"] = _component_specs(model, spec, components)
            if platform == "cpu":
                workers = WorkerGroupOptions.fake_cpu_hosts(spec, int(w.get("num_hosts", 1)),
                                                            int(w.get("devices_per_host", 1)), **extra)
            elif platform == "tpu":
                if "topology" not in w or "accelerator" not in w:
                    raise ValueError("tpu workers need topology (e.g. 4x4) and accelerator (e.g. v6e)")
                workers = WorkerGroupOptions(spec, tpu_slice_placement(str(w["topology"]), str(w["accelerator"])),
                                             "tpu", **extra)
            else:
                raise ValueError(f"workers.platform must be cpu or tpu, got {platform!r}")
        storage = None if raw.get("l3") is None else _storage_params(raw["l3"], raw.get("model"), page_size, where)
        return ReplicaConfig(head, workers, max_restarts=int(raw.get("max_restarts", 4)),
                             detached=bool(raw.get("detached", True)), storage=storage,
                             preemption=_preemption(raw.get("preemption"), where))
    except KeyError as exc:
        raise ValueError(f"{where}: missing key {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def _component_specs(model: Mapping[str, Any], spec: Any, components: tuple[ComponentConfig, ...]) -> dict[str, Any]:
    """The layouts of the workers' component pools: ``swa`` (``model.swa_layers``: that many sliding-window
    layers, paged like L1) and ``mamba`` (the states, laid out as the reference engine keeps them: one
    ``[layers, hidden]`` state shape, ``hidden`` split into 2 x num_kv_heads parts, one state a page)."""
    out = {}
    if "swa_layers" in model:
        out["swa"] = dataclasses.replace(spec, num_layers=int(model["swa_layers"]))
    mamba = next((c for c in components if isinstance(c, MambaConfig)), None)
    if mamba is not None:
        heads = spec.num_kv_heads
        shapes = mamba.state_shapes
        if len(shapes) != 1 or len(shapes[0]) != 2 or shapes[0][1] % (2 * heads):
            raise ValueError(f"components.mamba.state_shapes {[list(s) for s in shapes]}: workers keep one state "
                             f"shape [layers, hidden] with hidden a multiple of 2 x num_kv_heads ({2 * heads})")
        layers, hidden = shapes[0]
        out["mamba"] = dataclasses.replace(spec, num_layers=layers, head_dim=hidden // (2 * heads), page_size=1,
                                           dtype=mamba.dtype)
    return out


def _preemption(raw: Any, where: str):  # -> PreemptionConfig | None
    """``preemption: {kind, location, deadline_s, poll_s}`` -> where the head watches for a notice."""
    from hicache.cluster.drain import PreemptionConfig

    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ValueError(f"preemption must be a mapping {sorted(_PREEMPTION)}, got {raw!r}")
    _check_keys(f"{where}: preemption", raw, _PREEMPTION)
    fields: dict[str, Any] = {k: float(raw[k]) for k in ("deadline_s", "poll_s") if k in raw}
    return PreemptionConfig(str(raw.get("kind", "gce")), str(raw.get("location", "")), **fields)


_COMPONENTS: dict[str, type[SWAConfig] | type[MambaConfig]] = {c.kind.value: c for c in (SWAConfig, MambaConfig)}


def _components(raw: Any, where: str) -> tuple[ComponentConfig, ...]:
    """``components: {swa: {...}, mamba: {...}}`` -> one config per kind (YAML lists become tuples)."""
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise ValueError(f"components must be a mapping of component name -> fields, got {raw!r}")
    _check_keys(f"{where}: components", raw, set(_COMPONENTS))
    out: list[ComponentConfig] = []
    for name, fields in raw.items():
        cls = _COMPONENTS[name]
        if fields is None:
            fields = {}
        if not isinstance(fields, Mapping):
            raise ValueError(f"components.{name} must be a mapping of fields, got {fields!r}")
        _check_keys(f"{where}: components.{name}", fields, {f.name for f in dataclasses.fields(cls)})
        kwargs = dict(fields)
        if "state_shapes" in kwargs:
            shapes = kwargs["state_shapes"]
            if not isinstance(shapes, (list, tuple)) or not all(isinstance(s, (list, tuple)) for s in shapes):
                raise ValueError(f"components.{name}.state_shapes must be a list of shapes, got {shapes!r}")
            kwargs["state_shapes"] = tuple(tuple(s) for s in shapes)
        out.append(cls(**kwargs))
    return tuple(out)


GCS_SCHEMES = ("gs", "gcs")  # fsspec's names for gcsfs


def _require_backend(url: str) -> None:
    """gs:// needs gcsfs, an extra (``hicache[gcs]``, in ``[tpu]`` too): say so when the file is read,
    not when the head first touches L3."""
    import importlib.util

    if url.split("://", 1)[0] in GCS_SCHEMES and importlib.util.find_spec("gcsfs") is None:
        raise ValueError(f"L3 url {url!r} needs gcsfs: install the gcs extra (pip install 'hicache[gcs]')")


def _storage_params(l3: Any, model: Any, page_size: int, where: str) -> StorageParams:
    """``l3`` (url, model_id, StorageParams fields, ``storage``: StorageConfig fields) -> ``StorageParams``."""
    if not isinstance(l3, Mapping):
        raise ValueError(f"l3 must be a mapping, got {l3!r}")
    if not isinstance(model, Mapping):
        raise ValueError("l3 needs a model: {num_layers, num_kv_heads, head_dim, dtype} (its L3 fingerprint)")
    scalar = {f.name for f in dataclasses.fields(StorageParams)} - {"url", "fingerprint", "storage"}
    _check_keys(f"{where}: l3", l3, {"url", "model_id", "storage"} | scalar)
    config = l3.get("storage") or {}
    if not isinstance(config, Mapping):
        raise ValueError(f"l3.storage must be a mapping, got {config!r}")
    _check_keys(f"{where}: l3.storage", config, {f.name for f in dataclasses.fields(StorageConfig)})
    _require_backend(str(l3["url"]))
    fingerprint = ModelFingerprint(str(l3["model_id"]), str(model.get("dtype", "bfloat16")), page_size,
                                   int(model["num_layers"]), int(model["num_kv_heads"]), int(model["head_dim"]))
    fields = {k: v for k, v in l3.items() if k in scalar}
    if "previous_fingerprints" in fields:  # [{model_id, dtype?}]: this model's earlier versions (same shape)
        fields["previous_fingerprints"] = tuple(
            _previous_fingerprint(e, fingerprint, f"{where}: l3.previous_fingerprints[{i}]")
            for i, e in enumerate(fields["previous_fingerprints"] or ()))
    return StorageParams(str(l3["url"]), fingerprint, storage=StorageConfig(**config), **fields)


def _previous_fingerprint(entry: Any, current: ModelFingerprint, where: str) -> ModelFingerprint:
    """``{model_id, dtype?}`` -> the fingerprint ``current``'s model had under that id (and dtype)."""
    if not isinstance(entry, Mapping) or "model_id" not in entry:
        raise ValueError(f"{where} must be a mapping with a model_id (and optionally a dtype), got {entry!r}")
    _check_keys(where, entry, {"model_id", "dtype"})
    return dataclasses.replace(current, model_id=str(entry["model_id"]), dtype=str(entry.get("dtype", current.dtype)))
