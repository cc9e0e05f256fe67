"""A vLLM worker pool's configuration as ``inference_sidecar.workers`` resolves it, on
paths under a test's own folder, for the tests of the pool's plan and of its processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inference_sidecar.workers import ClusterConfig


def resolved(tmp_path: Path, **kw: Any) -> ClusterConfig:
    """A resolved configuration (interpreter, model, logs and cache under ``tmp_path``, two
    cores); ``kw`` sets any other field or overrides these."""
    kw.setdefault("python", tmp_path / "python")
    kw.setdefault("model_dir", tmp_path / "model")
    kw.setdefault("log_dir", tmp_path / "logs")
    kw.setdefault("cache_dir", tmp_path / "cache")
    kw.setdefault("cores", (0, 1))
    return ClusterConfig(**kw)
