"""The inference sidecar: shopper-sticky, load-bounded routing in front of vLLM workers.

Public surface (the router's ASGI app lives in ``inference_sidecar.router``, imported on
demand so that importing this package stays cheap)::

    RouterConfig, ClusterConfig, WorkerProcesses  configuration and worker processes
    extract_routing_key, RoutingKey               which shopper a request belongs to
    make_policy, Policy                           routing policies by name
    SidecarError and subclasses                   see ``inference_sidecar.exceptions``

Run it with ``python -m inference_sidecar router ...`` or ``... cluster ...``.
"""

from inference_sidecar.config import RouterConfig
from inference_sidecar.exceptions import (
    ConfigError,
    NoWorkerAvailable,
    RequestError,
    SidecarError,
    UpstreamError,
    WorkerStartError,
)
from inference_sidecar.policies import Policy, make_policy
from inference_sidecar.routing_key import RoutingKey, extract_routing_key
from inference_sidecar.workers import ClusterConfig, WorkerProcesses

__all__ = [
    "ClusterConfig",
    "ConfigError",
    "NoWorkerAvailable",
    "Policy",
    "RequestError",
    "RouterConfig",
    "RoutingKey",
    "SidecarError",
    "UpstreamError",
    "WorkerProcesses",
    "WorkerStartError",
    "extract_routing_key",
    "make_policy",
]
