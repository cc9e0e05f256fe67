"""The model tier's shared fixtures: ``stack``, the router tests' clusters (``clusters.Stack``),
shared by every module that needs two workers of its own behind a router."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from inference_sidecar.workers import default_cache_dir
from tests.model.clusters import Stack


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    # Logs go under the cache, not pytest's tmp_path: concurrent pytest runs on this
    # machine rotate old tmp_path folders away while a run still writes to them.
    log_dir = default_cache_dir() / "logs" / "test-router-vllm" / str(os.getpid())
    log_dir.mkdir(parents=True, exist_ok=True)
    s = Stack(log_dir)
    yield s
    s.close()
