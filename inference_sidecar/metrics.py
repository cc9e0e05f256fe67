"""Prometheus metrics of the router, in a registry of their own.

A registry per router (not the global one) lets tests build many routers in one process
and keeps the exposition free of unrelated collectors. Names start with
``inference_sidecar_``; the policy name is a label so runs of different policies can be
told apart on one dashboard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from inference_sidecar.kv.index import KVIndex
from inference_sidecar.load_view import LOAD_SOURCES, WorkerLoad

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

        self.kv_unhashed = Counter(
            "inference_sidecar_kv_unhashed_requests",
            "kv_prefix: requests routed without block hashes, by reason: unreproducible "
            "(a prompt the router cannot tokenize as the worker does), no_hashing (the "
            "workers' block size and hash algorithm not read yet), over_context (more "
            "tokens than the model's context: not tokenized), unknown_model (a model no "
            "worker lists), tokenizer_failed (a tokenizer process died).",
            ["reason"],
            registry=r,
        )

    def watch_kv_index(self, index: KVIndex, fallbacks: Callable[[], Mapping[str, int]]) -> None:
        """Export ``index``'s counters and the policy's per-worker fallbacks when scraped."""
        self.registry.register(_KVIndexCollector(index, fallbacks))

    def watch_loads(self, figures: Callable[[], Mapping[tuple[str, str], WorkerLoad]]) -> None:
        """Export the load each worker counts at (``figures()``: per pool and worker) and
        its source when scraped."""
        self.registry.register(_LoadCollector(figures))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _KVIndexCollector(Collector):
    """Reads the KV index at scrape time: its counters live in the pure index."""

    def __init__(self, index: KVIndex, fallbacks: Callable[[], Mapping[str, int]]) -> None:
        self.index = index
        self.fallbacks = fallbacks

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        prefix = "inference_sidecar_kv_"
        batches = CounterMetricFamily(
            prefix + "event_batches", "KV event batches applied per worker.", labels=["worker"]
        )
        events = CounterMetricFamily(
            prefix + "events", "KV events applied per worker.", labels=["worker"]
        )
        resyncs = CounterMetricFamily(
            prefix + "resyncs",
            "Times a worker's index entries were cleared, by reason: gap (missed batches not "
            "replayed), restart (its sequence went back), cleared (AllBlocksCleared), down "
            "(health checks), overflow (more blocks than max_blocks), stream_lost (its event "
            "stream cannot be subscribed to).",
            labels=["worker", "reason"],
        )
        mismatches = CounterMetricFamily(
            prefix + "hash_mismatches",
            "Published block chains whose hashes differ from the router's computation.",
            labels=["worker"],
        )
        unverifiable = CounterMetricFamily(
            prefix + "unverifiable_chains",
            "Published block chains with extra keys the router cannot rebuild (a LoRA "
            "adapter whose path it does not know): neither trusted nor distrusted.",
            labels=["worker"],
        )
        fallbacks = CounterMetricFamily(
            prefix + "fallbacks",
            "Routing choices in which a worker's cache was estimated by hashing because its "
            "events could not be trusted (stale or mismatched).",
            labels=["worker"],
        )
        blocks = GaugeMetricFamily(
            prefix + "blocks", "Blocks the index holds per worker.", labels=["worker"]
        )
        fresh = GaugeMetricFamily(
            prefix + "fresh",
            "1 when a worker's KV events are trusted, 0 when routing falls back to hashing.",
            labels=["worker"],
        )
        fallback_counts = self.fallbacks()
        for worker in self.index.workers:
            c = self.index.counters[worker]
            batches.add_metric([worker], c.batches)
            events.add_metric([worker], c.events)
            for reason, n in sorted(c.resyncs.items()):
                resyncs.add_metric([worker, reason], n)
            mismatches.add_metric([worker], c.mismatches)
            unverifiable.add_metric([worker], c.unverifiable)
            fallbacks.add_metric([worker], fallback_counts.get(worker, 0))
            blocks.add_metric([worker], self.index.block_count(worker))
            fresh.add_metric([worker], int(self.index.is_fresh(worker)))
        yield from (batches, events, resyncs, mismatches, unverifiable, fallbacks, blocks, fresh)


class _LoadCollector(Collector):
    """Reads the pools' load figures at scrape time: they change with every request and
    every poll, and a source is a state set (one series per source, 1 for the current
    one) so that a change of source moves a value rather than starting a new series."""

    def __init__(self, figures: Callable[[], Mapping[tuple[str, str], WorkerLoad]]) -> None:
        self.figures = figures

    def collect(self) -> Iterator[GaugeMetricFamily]:
        prefix = "inference_sidecar_worker_load"
        load = GaugeMetricFamily(
            prefix,
            "The load the policy weighs per worker: its requests in flight as the load view "
            "sees them.",
            labels=["pool", "worker"],
        )
        source = GaugeMetricFamily(
            prefix + "_source",
            "1 for where a worker's load comes from: workers (its own /metrics, polled, plus "
            "this router's requests since) or own (this router's requests in flight: the own "
            "load view, or no recent sample of the worker's).",
            labels=["pool", "worker", "source"],
        )
        age = GaugeMetricFamily(
            prefix + "_sample_age_seconds",
            "Age of the worker's last load sample in use (workers load view).",
            labels=["pool", "worker"],
        )
        for (pool, worker), figure in sorted(self.figures().items()):
            load.add_metric([pool, worker], figure.load)
            for name in LOAD_SOURCES:
                source.add_metric([pool, worker, name], int(figure.source == name))
            if figure.sample_age_s is not None:
                age.add_metric([pool, worker], figure.sample_age_s)
        yield from (load, source, age)
