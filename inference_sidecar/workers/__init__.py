"""Launching vLLM workers from one config: aggregated or prefill/decode pools.

Modules, by role::

    config   ClusterConfig: the cluster's description, validated, and where its
             defaults are found (cache folder, vLLM venv, model folder)
    cpu      where a CPU worker runs and what it preloads (cores, dtype, TCMalloc,
             Intel OpenMP)
    launch   the launch plan: each worker's command line, environment and ports
             (``plan_workers``, pure), and free port ranges for tests
    pool     WorkerProcesses: the plan's processes, launched, watched and stopped
"""

from inference_sidecar.workers.config import (
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_MODEL_NAME,
    DEFAULT_STRUCTURED_OUTPUTS,
    KV_EVENTS_OFFSET,
    KV_REPLAY_OFFSET,
    NIXL_SIDE_CHANNEL_OFFSET,
    ClusterConfig,
    Connector,
    Mode,
    Profile,
    Role,
    default_cache_dir,
    find_model_dir,
    find_vllm_python,
    repo_root,
)
from inference_sidecar.workers.cpu import (
    IOMP_FILES,
    TCMALLOC_FILES,
    available_cores,
    check_preload,
    cpu_dtype,
    find_cpu_preload,
    find_library,
    host_cpu_dtype,
    library_dirs,
)
from inference_sidecar.workers.launch import (
    PORT_OFFSETS,
    VLLM_CLI,
    WorkerSpec,
    find_free_port_range,
    kv_events_config,
    kv_transfer_config,
    plan_workers,
    port_is_free,
    specs_summary,
)
from inference_sidecar.workers.pool import (
    LOG_TAIL_LINES,
    WorkerProcesses,
    log_tail,
    prune_older_than,
)

__all__ = [
    "DEFAULT_KV_CACHE_BYTES",
    "DEFAULT_MODEL_NAME",
    "DEFAULT_STRUCTURED_OUTPUTS",
    "IOMP_FILES",
    "KV_EVENTS_OFFSET",
    "KV_REPLAY_OFFSET",
    "LOG_TAIL_LINES",
    "NIXL_SIDE_CHANNEL_OFFSET",
    "PORT_OFFSETS",
    "TCMALLOC_FILES",
    "VLLM_CLI",
    "ClusterConfig",
    "Connector",
    "Mode",
    "Profile",
    "Role",
    "WorkerProcesses",
    "WorkerSpec",
    "available_cores",
    "check_preload",
    "cpu_dtype",
    "default_cache_dir",
    "find_cpu_preload",
    "find_free_port_range",
    "find_library",
    "find_model_dir",
    "find_vllm_python",
    "host_cpu_dtype",
    "kv_events_config",
    "kv_transfer_config",
    "library_dirs",
    "log_tail",
    "plan_workers",
    "port_is_free",
    "prune_older_than",
    "repo_root",
    "specs_summary",
]
