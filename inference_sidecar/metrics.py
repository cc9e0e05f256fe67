"""Prometheus metrics of the router, in a registry of their own.

A registry per router (not the global one) lets tests build many routers in one process
and keeps the exposition free of unrelated collectors. Names start with
``inference_sidecar_``; the policy name is a label so runs of different policies can be
told apart on one dashboard.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)


class RouterMetrics:
    """The router's counters, gauges and histograms."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "inference_sidecar_requests",
            "Client requests by endpoint and final HTTP status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.admitted = Gauge(
            "inference_sidecar_requests_admitted",
            "Client completion requests being served (at most max_concurrent_requests).",
            registry=r,
        )
        self.worker_requests = Counter(
            "inference_sidecar_worker_requests",
            "Requests sent to each worker (attempts, retries included).",
            ["pool", "worker"],
            registry=r,
        )
        self.worker_errors = Counter(
            "inference_sidecar_worker_errors",
            "Failed attempts per worker: connect, timeout, status_5xx, invalid_response.",
            ["pool", "worker", "kind"],
            registry=r,
        )
        self.in_flight = Gauge(
            "inference_sidecar_worker_in_flight",
            "Requests in flight per worker through this router.",
            ["pool", "worker"],
            registry=r,
        )
        self.in_service = Gauge(
            "inference_sidecar_worker_in_service",
            "1 when the worker receives traffic, 0 when ejected or down.",
            ["pool", "worker"],
            registry=r,
        )
        self.decisions = Counter(
            "inference_sidecar_routing_decisions",
            "Routing decisions: sticky (the key's recent worker), placed (a key seen for the "
            "first time), spilled (its worker was over the load bound or dearer than another), "
            "failed_over (its worker out of service or failed), balanced (no affinity).",
            ["policy", "pool", "decision"],
            registry=r,
        )
        self.health_events = Counter(
            "inference_sidecar_health_events",
            "Health transitions per worker: ejected, readmitted, down, up.",
            ["pool", "worker", "event", "reason"],
            registry=r,
        )
        self.ejections = Counter(
            "inference_sidecar_ejections",
            "Outlier ejections per worker and reason.",
            ["pool", "worker", "reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "inference_sidecar_ttft_seconds",
            "Time to the first byte of a streamed answer (streaming requests only).",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "inference_sidecar_request_latency_seconds",
            "Total time of client requests, router overhead and retries included.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
