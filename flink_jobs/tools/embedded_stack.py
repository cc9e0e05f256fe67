"""The default stack on one machine: a Kafka-protocol broker, Redis, vLLM workers on the CPU
and the router in front of them, all as local processes on loopback.

Used by ``shopper-intents demo`` and by the integration tests, so the demo runs exactly
what the tests check. Each part can also be started alone (the tests share one LLM tier
across the session). Nothing imports PyFlink here.
"""

from __future__ import annotations

import logging
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from flink_jobs.tools.local_services import (
    LocalProcess,
    create_topics,
    free_port,
    start_redis,
    start_tansu,
)

log = logging.getLogger(__name__)

ROUTER_READY_TIMEOUT_S = 30.0
# Room for every in-flight prompt's KV blocks: a cache that is nearly full makes vLLM
# preempt and recompute requests, which costs more than the memory.
KV_CACHE_BYTES = 1 << 30
# CPU workers are slow and their speed varies tenfold between hosts: SmolLM2-135M answers
# in about 1 s on a core with AMX, but takes 10-60 s under load on an AVX2-only core
# (prefill at ~70 tokens/s). A job timeout below that resends a prompt vLLM is still
# computing, doubling the load exactly when it is highest; the router's own per-attempt
# timeout (120 s) must also be shorter than the job's, so that the router fails over first.
CPU_REQUEST_TIMEOUT_S = 300.0


@dataclass
class LlmTier:
    """vLLM workers plus the router; ``base_url`` is what the job talks to."""

    base_url: str
    router_url: str
    worker_urls: list[str]
    _exit: ExitStack = field(repr=False)

    def job_settings(self) -> dict[str, Any]:
        """The job's ``llm`` settings for this tier."""
        return {"base_url": self.base_url, "request_timeout_s": CPU_REQUEST_TIMEOUT_S}

    def stop(self) -> None:
        self._exit.close()


def start_llm_tier(workdir: Path, workers: int = 2, ready_timeout_s: float = 300.0) -> LlmTier:
    """Start ``workers`` vLLM workers (one core each) and the router in front of them."""
    from inference_sidecar.workers import ClusterConfig, WorkerPool, find_free_port_range

    workdir.mkdir(parents=True, exist_ok=True)
    exit_stack = ExitStack()
    try:
        base_port = find_free_port_range(workers)
        pool = WorkerPool(
            ClusterConfig(
                mode="aggregated",
                workers=workers,
                base_port=base_port,
                log_dir=workdir / "logs",
                kv_cache_bytes=KV_CACHE_BYTES,
            ),
            ready_timeout_s=ready_timeout_s,
        )
        exit_stack.enter_context(pool)
        router_port = free_port()
        argv = [sys.executable, "-m", "inference_sidecar", "router", "--port", str(router_port)]
        for url in pool.urls:
            argv += ["--worker", url]
        router = LocalProcess("router", argv, workdir / "logs" / "router.log")
        exit_stack.enter_context(router)
        router_url = f"http://127.0.0.1:{router_port}"
        router.wait_ready(
            lambda: _answers(f"{router_url}/health"), timeout_s=ROUTER_READY_TIMEOUT_S
        )
    except BaseException:
        exit_stack.close()
        raise
    return LlmTier(f"{router_url}/v1", router_url, list(pool.urls), exit_stack)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class EmbeddedStack:
    bootstrap: str
    redis_url: str
    llm: LlmTier
    _exit: ExitStack = field(repr=False)

    def config_overrides(self) -> dict[str, dict[str, Any]]:
        return {
            "kafka": {"bootstrap_servers": self.bootstrap},
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
    workdir: Path, topics: list[str], llm_workers: int = 2, partitions: int = 2
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
        llm = start_llm_tier(workdir / "llm", llm_workers)
        exit_stack.callback(llm.stop)
        log.info("LLM tier ready at %s (workers %s)", llm.base_url, ", ".join(llm.worker_urls))
    except BaseException:
        exit_stack.close()
        raise
    log.info("embedded stack up in %.0f s", time.monotonic() - started)
    return EmbeddedStack(kafka.bootstrap, redis.url, llm, exit_stack)
