"""The default stack on one machine: a Kafka-protocol broker, Redis, vLLM workers on the CPU
and the router in front of them, all as local processes on loopback.

Used by ``shopper-intents demo`` and by the tests, so the demo runs exactly what the
tests check. Each part can also be started alone (the tests share one LLM tier across the
session). ``start_standin_tier`` puts LLM STAND-INS (``bench/standin_llm.py``, a repository
file, not part of the package) behind the same router, for the service tests whose
subject is the stream, not the model. Nothing imports PyFlink here.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from flink_jobs.tools.local_services import (
    LOCAL_BROKER_SOURCE_PROPERTIES,
    LocalProcess,
    create_topics,
    free_port,
    http_ok,
    start_redis,
    start_tansu,
)

log = logging.getLogger(__name__)

ROUTER_READY_TIMEOUT_S = 30.0
#: Room for every in-flight prompt's KV blocks: a cache that is nearly full makes vLLM
#: preempt and recompute requests, which costs more than the memory.
KV_CACHE_BYTES = 1 << 30
#: The job's LLM timeout on CPU workers: above the slowest answer a loaded CPU worker gives,
#: since a timeout below it resends a prompt vLLM is still computing and doubles the load
#: exactly when it is highest; and above the router's own per-attempt timeout
#: (``DEFAULT_REQUEST_TIMEOUT_S``), so that the router fails over first
#: (docs/decisions.md#cpu-request-timeout).
CPU_REQUEST_TIMEOUT_S = 300.0
#: The vLLM workers' scheduling niceness on this shared host: the job's rules-only records
#: and event handling need the cores for milliseconds at a time, the model for seconds, so
#: the job goes first and the model's calls lose little (docs/decisions.md#llm-niceness).
LLM_NICENESS = 19
#: A stand-in answers within its configured latency (seconds); a call still waiting after
#: this has met an injected hang.
STANDIN_REQUEST_TIMEOUT_S = 20.0
STANDIN_READY_TIMEOUT_S = 30.0
_STANDIN_MODULE = "bench.standin_llm"
#: Partitions of the events topic unless the job's parallelism needs more (a source
#: subtask without a partition idles). No more than that at the demo's rate: the watermark
#: is the slowest partition's, and the sparser each partition, the longer every prompt
#: waits for it (docs/decisions.md#events-partitions).
EVENTS_PARTITIONS = 2
_REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ServedModel:
    """What the vLLM workers serve: a model folder under a name (default: the cache's
    SmolLM2-135M-Instruct), and LoRA adapters by name (``{name: folder}``), which a request
    selects with ``"model": name``."""

    name: str = ""
    model_dir: Path | None = None
    lora: tuple[tuple[str, Path], ...] = ()
    max_lora_rank: int = 16

    def worker_args(self) -> tuple[str, ...]:
        if not self.lora:
            return ()
        modules = [f"{name}={path}" for name, path in self.lora]
        return (
            "--enable-lora",
            "--lora-modules",
            *modules,
            "--max-lora-rank",
            str(self.max_lora_rank),
            "--max-loras",
            str(len(self.lora)),
        )


@dataclass
class LlmTier:
    """vLLM workers plus the router; ``base_url`` is what the job talks to."""

    base_url: str
    router_url: str
    worker_urls: list[str]
    _exit: ExitStack = field(repr=False)
    request_timeout_s: float = CPU_REQUEST_TIMEOUT_S

    def job_settings(self) -> dict[str, Any]:
        """The job's ``llm`` settings for this tier."""
        return {"base_url": self.base_url, "request_timeout_s": self.request_timeout_s}

    def stop(self) -> None:
        self._exit.close()


def start_llm_tier(
    workdir: Path,
    workers: int = 2,
    ready_timeout_s: float = 300.0,
    niceness: int = LLM_NICENESS,
    cores: tuple[int, ...] = (),
    model: ServedModel | None = None,
) -> LlmTier:
    """Start ``workers`` vLLM workers (at ``niceness``, pinned round-robin to ``cores``,
    default every core we may use) and the router in front of them; ``model``: what they
    serve (default: the cache's SmolLM2-135M-Instruct alone)."""
    from inference_sidecar.workers import (
        DEFAULT_MODEL_NAME,
        ClusterConfig,
        WorkerProcesses,
        find_free_port_range,
    )

    model = model or ServedModel()

    workdir.mkdir(parents=True, exist_ok=True)
    exit_stack = ExitStack()
    try:
        base_port = find_free_port_range(workers)
        pool = WorkerProcesses(
            ClusterConfig(
                mode="aggregated",
                workers=workers,
                base_port=base_port,
                log_dir=workdir / "logs",
                kv_cache_bytes=KV_CACHE_BYTES,
                niceness=niceness,
                cores=cores,
                model_dir=model.model_dir,
                served_model_name=model.name or DEFAULT_MODEL_NAME,
                extra_args=model.worker_args(),
            ),
            ready_timeout_s=ready_timeout_s,
        )
        exit_stack.enter_context(pool)
        router_url = _start_router(workdir, list(pool.urls), exit_stack)
    except BaseException:
        exit_stack.close()
        raise
    return LlmTier(f"{router_url}/v1", router_url, list(pool.urls), exit_stack)


@dataclass
class StandInTier(LlmTier):
    """LLM stand-ins behind the real router: answers valid against the request's schema,
    latency and failures set per worker (``configure``, ``inject``)."""

    request_timeout_s: float = STANDIN_REQUEST_TIMEOUT_S

    def configure(self, worker_url: str | None = None, **settings: Any) -> None:
        """Change ``latency``, ``seed``, ``fail_5xx``, ``fail_invalid_json``, ``fail_hang``
        on one worker, or on every worker."""
        for url in [worker_url] if worker_url else self.worker_urls:
            httpx.post(f"{url}/admin/config", json=settings, timeout=5).raise_for_status()

    def inject(self, fault: str, count: int, worker_url: str | None = None) -> None:
        """The next ``count`` requests of one worker (or of each) get ``fault``: ``5xx``,
        ``invalid_json`` or ``hang``; a count of 0 clears it."""
        for url in [worker_url] if worker_url else self.worker_urls:
            body = {"fault": fault, "count": count}
            httpx.post(f"{url}/admin/inject", json=body, timeout=5).raise_for_status()

    def stats(self, worker_url: str) -> dict[str, Any]:
        stats: dict[str, Any] = httpx.get(f"{worker_url}/stats", timeout=5).json()
        return stats

    @contextmanager
    def configured(self, **settings: Any) -> Iterator[StandInTier]:
        """``configure(**settings)`` on every worker for a block; afterwards each worker's
        settings are put back and its injected faults cleared."""
        saved = {
            url: httpx.get(f"{url}/admin/config", timeout=5).json() for url in self.worker_urls
        }
        try:
            self.configure(**settings)
            yield self
        finally:
            for url, before in saved.items():
                before.pop("injected", None)
                self.configure(url, **before)
                for fault in ("5xx", "invalid_json", "hang"):
                    self.inject(fault, 0, url)


def standin_process(workdir: Path, port: int, *settings: str) -> LocalProcess:
    """``python -m bench.standin_llm --port PORT SETTINGS...`` (not started), run from the
    repository, where the stand-in lives."""
    if not (_REPO_ROOT / "bench" / "standin_llm.py").is_file():
        raise FileNotFoundError(
            f"the LLM stand-in (bench/standin_llm.py) is not under {_REPO_ROOT}"
        )
    argv = [sys.executable, "-m", _STANDIN_MODULE, "--port", str(port), *settings]
    return LocalProcess(
        f"standin-{port}", argv, workdir / "logs" / f"standin-{port}.log", cwd=_REPO_ROOT
    )


@dataclass
class StandInWorker:
    url: str
    process: LocalProcess


def start_standin_workers(
    workdir: Path, exit_stack: ExitStack, workers: int = 2, latency: str = "0.05", seed: int = 0
) -> list[StandInWorker]:
    """``workers`` stand-ins, each seeded apart (``seed + i``), stopped by ``exit_stack``."""
    started = []
    for i in range(workers):
        port = free_port()
        process = standin_process(workdir, port, "--latency", latency, "--seed", str(seed + i))
        exit_stack.enter_context(process)
        url = f"http://127.0.0.1:{port}"
        health = functools.partial(http_ok, f"{url}/health")
        process.wait_ready(health, timeout_s=STANDIN_READY_TIMEOUT_S)
        started.append(StandInWorker(url, process))
    return started


def start_standin_tier(
    workdir: Path, workers: int = 2, latency: str = "0.05", seed: int = 0
) -> StandInTier:
    """``workers`` LLM stand-ins and the real router in front of them, as ``start_llm_tier``
    starts vLLM workers: for tests whose subject is the stream, not the model."""
    workdir.mkdir(parents=True, exist_ok=True)
    exit_stack = ExitStack()
    try:
        urls = [w.url for w in start_standin_workers(workdir, exit_stack, workers, latency, seed)]
        router_url = _start_router(workdir, urls, exit_stack)
    except BaseException:
        exit_stack.close()
        raise
    return StandInTier(f"{router_url}/v1", router_url, urls, exit_stack)


def _start_router(workdir: Path, worker_urls: list[str], exit_stack: ExitStack) -> str:
    """The router (``python -m inference_sidecar router``) in front of ``worker_urls``."""
    router_port = free_port()
    argv = [sys.executable, "-m", "inference_sidecar", "router", "--port", str(router_port)]
    for url in worker_urls:
        argv += ["--worker", url]
    router = LocalProcess("router", argv, workdir / "logs" / "router.log")
    exit_stack.enter_context(router)
    router_url = f"http://127.0.0.1:{router_port}"
    router.wait_ready(lambda: http_ok(f"{router_url}/health"), timeout_s=ROUTER_READY_TIMEOUT_S)
    return router_url


@dataclass
class EmbeddedStack:
    bootstrap: str
    redis_url: str
    llm: LlmTier
    _exit: ExitStack = field(repr=False)

    def config_overrides(self) -> dict[str, dict[str, Any]]:
        return {
            "kafka": {
                "bootstrap_servers": self.bootstrap,
                "source_properties": LOCAL_BROKER_SOURCE_PROPERTIES,
            },
            "redis": {"url": self.redis_url},
            "llm": self.llm.job_settings(),
        }

    def stop(self) -> None:
        self._exit.close()

    def __enter__(self) -> EmbeddedStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_embedded_stack(
    workdir: Path,
    topics: list[str],
    llm_workers: int = 2,
    partitions: int = EVENTS_PARTITIONS,
    llm_niceness: int = LLM_NICENESS,
    llm_cores: tuple[int, ...] = (),
    llm_model: ServedModel | None = None,
) -> EmbeddedStack:
    exit_stack = ExitStack()
    started = time.monotonic()
    try:
        redis = exit_stack.enter_context(start_redis(workdir=workdir / "redis"))
        log.info("redis ready at %s", redis.url)
        kafka = exit_stack.enter_context(start_tansu(workdir=workdir / "broker"))
        create_topics(kafka.bootstrap, topics, partitions)
        log.info("broker ready at %s with topics %s", kafka.bootstrap, ", ".join(topics))
        log.info(
            "starting %d vLLM worker(s) and the router (about a minute on a CPU)...", llm_workers
        )
        llm = start_llm_tier(
            workdir / "llm", llm_workers, niceness=llm_niceness, cores=llm_cores, model=llm_model
        )
        exit_stack.callback(llm.stop)
        log.info("LLM tier ready at %s (workers %s)", llm.base_url, ", ".join(llm.worker_urls))
    except BaseException:
        exit_stack.close()
        raise
    log.info("embedded stack up in %.0f s", time.monotonic() - started)
    return EmbeddedStack(kafka.bootstrap, redis.url, llm, exit_stack)
