"""Shared fixtures: one in-process GCS emulator per session (127.0.0.1 only), a fresh store per
test for each URL scheme, and a numpy host pool (a real buffer)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from hicache.storage import FsspecStorage, ModelFingerprint, ShardCoord, StorageConfig
from hicache.storage.testing import NumpyHostPool

FP = ModelFingerprint("tiny-test", "float32", page_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
SLOT_SHAPE = (2, 2, 4, 2, 8)  # [layers, K/V, page, heads, head_dim]
PPO = 4  # pages per object in the suite
BUCKET = "hicache-test"


@pytest.fixture(scope="session")
def gcs_emulator():
    """gcp-storage-emulator in-process on 127.0.0.1 (``benchmarks.faulty_l3.gcs_emulator``); yields
    the bucket URL prefix ``gs://BUCKET``."""
    from benchmarks.faulty_l3 import gcs_emulator as emulator

    with emulator(BUCKET) as url:
        yield url


SCHEMES = ["memory", "file", "gs"]


@pytest.fixture
def make_url(request, tmp_path):
    """``make_url(scheme)`` → a fresh, empty root for that scheme."""

    def make(scheme: str) -> str:
        tag = uuid.uuid4().hex[:10]
        if scheme == "memory":
            return f"memory://hicache-{tag}"
        if scheme == "file":
            return f"file://{tmp_path}/l3-{tag}"
        if scheme == "gs":
            return f"{request.getfixturevalue('gcs_emulator')}/run-{tag}"
        raise ValueError(scheme)

    return make


def storage_options(scheme: str) -> dict:
    return {"token": "anon"} if scheme == "gs" else {}


@pytest.fixture
def make_store(make_url):
    """``make_store(scheme, url=None, fp=FP, **config)`` with a registered KV pool of 64 slots."""
    made: list[FsspecStorage] = []

    def make(scheme: str, url: str | None = None, fp: ModelFingerprint = FP, pool: NumpyHostPool | None = None, **cfg):
        cfg.setdefault("pages_per_object", PPO)
        cfg.setdefault("timeout_s", 20.0)
        cfg.setdefault("exists_timeout_s", 20.0)  # the suite checks answers, not the short bound
        st = FsspecStorage(url or make_url(scheme), fp, StorageConfig(storage_options=storage_options(scheme), **cfg))
        pool = pool or NumpyHostPool(64, SLOT_SHAPE, np.dtype(fp.dtype))
        st.register_host_pool(pool, shard=ShardCoord.full(fp))
        st.pool = pool  # for the tests' convenience
        made.append(st)
        return st

    yield make
    for st in made:
        st.close()


@pytest.fixture(params=SCHEMES)
def scheme(request) -> str:
    return request.param


@pytest.fixture
def fp() -> ModelFingerprint:
    return FP
