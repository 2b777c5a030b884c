"""Shared by the routing tests: one compiled reference runner per module."""

from __future__ import annotations

import pytest
from support.reference_shapes import FWD, MODEL

from hicache.reference.engine.runner import ModelRunner


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(MODEL, FWD, num_pages=32)
