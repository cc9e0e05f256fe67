"""The vLLM clusters of the model tier's router tests, started on demand, one at a time.

Two workers at most run here at once beside the session's LLM tier (this machine has 2
cores). The aggregated cluster's workers publish their KV cache events, so the KV-routing
tests (``test_router_kv_events_vllm.py``) put their ``kv_prefix`` router in front of the same
workers instead of starting a pool of their own (a pool's start was the longest part of
that module), and their file sorts just before the router tests' so the pool serves both
in a row. ``Stack.start_kv_router`` starts that router; ``KVEventLog`` hears what a worker
publishes, as the router would.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from inference_sidecar.exceptions import ConfigError
from inference_sidecar.kv import EventBatch, Stored, decode_batch
from inference_sidecar.workers import (
    ClusterConfig,
    WorkerProcesses,
    find_free_port_range,
    log_tail,
    port_is_free,
)
from tests.support.metrics_text import metric_sum
from tests.support.waiting import WaitFailed, until

MODEL = "SmolLM2-135M-Instruct"
CHAT = "/v1/chat/completions"
INSTRUCTIONS = (
    "You are a shopping assistant. From the shopper's recent events, name the shopper's "
    "most likely intent in a few words. " * 6
)


def shopper_messages(shopper: str, n_events: int) -> list[dict[str, str]]:
    events = "\n".join(
        f"- event {i}: shopper {shopper} viewed item {shopper}-{i} (running shoes, size {40 + i})"
        for i in range(n_events)
    )
    return [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": f"Shopper {shopper} events:\n{events}\nWhat is the intent?"},
    ]


def chat_body(messages: list[dict[str, str]], max_tokens: int = 16, **extra: object) -> dict:
    return {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class RouterProcess:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def post(self, body: dict, shopper: str | None = None, timeout: float = 120) -> httpx.Response:
        headers = {"X-Session-ID": shopper} if shopper else {}
        return httpx.post(f"{self.url}{CHAT}", json=body, headers=headers, timeout=timeout)

    def metric(self, name: str, **labels: str) -> float:
        return metric_sum(httpx.get(f"{self.url}/metrics", timeout=10).text, name, **labels)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


@dataclass
class Cluster:
    mode: str
    pool: WorkerProcesses
    router_url: str
    router: subprocess.Popen[bytes]
    router_log: Path
    reference: dict[str, str] = field(default_factory=dict)

    def post(self, body: dict, shopper: str | None = None, timeout: float = 120) -> httpx.Response:
        headers = {"X-Session-ID": shopper} if shopper else {}
        return httpx.post(f"{self.router_url}{CHAT}", json=body, headers=headers, timeout=timeout)

    def stop(self) -> None:
        RouterProcess(self.router_url, self.router, self.router_log).stop()
        self.pool.stop()


class Stack:
    """Starts a cluster on demand; one at a time."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.current: Cluster | None = None

    def get(self, mode: str) -> Cluster:
        current = self.current
        if current is not None and current.mode == mode and self._serving(current):
            return current
        self.close()
        n = 2
        base = find_free_port_range(n + 1)
        cfg = ClusterConfig(
            mode=mode,  # type: ignore[arg-type]
            workers=n,
            prefill=1,
            decode=1,
            base_port=base,
            max_model_len=2048,
            kv_events=mode == "aggregated",
            log_dir=self.log_dir / mode,
        )
        try:
            pool = WorkerProcesses(cfg, ready_timeout_s=300)
        except ConfigError as exc:
            # `make test` installs vLLM first: a missing one is a broken setup, never a pass.
            pytest.fail(f"vLLM is not installed here ({exc}): run `make setup`")
        with_pool = pool.start()
        try:
            with_pool.wait_ready()
            self.current = self._start_router(pool, mode, base + n)
        except BaseException:
            pool.stop()
            raise
        return self.current

    @staticmethod
    def _serving(cluster: Cluster) -> bool:
        """The router and every worker answer: a test that killed a worker (the router
        tests' last aggregated one) leaves a cluster the next user must not get."""
        if cluster.router.poll() is not None:
            return False
        try:
            return all(
                httpx.get(f"{url}/health", timeout=5).status_code == 200
                for url in cluster.pool.urls
            )
        except httpx.HTTPError:
            return False

    def _start_router(self, pool: WorkerProcesses, mode: str, port: int) -> Cluster:
        assert port_is_free("127.0.0.1", port)
        if mode == "aggregated":
            args = ["--worker", *pool.worker_urls]
        else:
            args = ["--prefill", *pool.prefill_urls, "--decode", *pool.decode_urls]
        router = self.start_router([], mode, args, port)
        return Cluster(mode, pool, router.url, router.proc, router.log)

    def start_router(
        self, workers: list[str], name: str, extra: Sequence[str] = (), port: int | None = None
    ) -> RouterProcess:
        """``python -m inference_sidecar router`` as the pipeline starts it; waits for
        ``/health``."""
        port = port or find_free_port_range(1)
        args = [sys.executable, "-m", "inference_sidecar", "router", "--port", str(port)]
        if workers:
            args += ["--worker", *workers]
        args += ["--health-interval", "0.5", *extra]
        log = self.log_dir / f"router-{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        router = RouterProcess(f"http://127.0.0.1:{port}", proc, log)
        try:
            until(
                lambda: _healthy(router.url),
                f"the {name} router's /health",
                timeout_s=30,
                interval_s=0.2,
                give_up=lambda: proc.poll() is not None and "the router exited",
                explain=lambda: log_tail(log),
            )
        except WaitFailed:
            router.stop()
            raise
        return router

    def start_kv_router(self, pool: WorkerProcesses, name: str) -> RouterProcess:
        """A ``kv_prefix`` router in front of ``pool``'s workers, fed the KV cache events
        they publish, once it holds some of their blocks."""
        assert pool.config.model_dir is not None
        extra = ["--policy", "kv_prefix", "--tokenizer", str(pool.config.model_dir)]
        for url, (events, replay) in pool.kv_event_sources.items():
            extra += ["--kv-events", f"{url}={events},{replay}"]
        router = self.start_router(pool.worker_urls, name, extra)
        try:
            until(
                lambda: bool(httpx.get(f"{router.url}/health", timeout=2).json()["kv_blocks"]),
                "the router to hold the workers' KV blocks",
                timeout_s=20,
                interval_s=0.1,
            )
        except BaseException:
            router.stop()
            raise
        return router

    def close(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current = None


class KVEventLog:
    """Every batch one worker publishes on its KV cache event endpoint, heard by a SUB
    socket of the test's own (from when it joins: a SUB socket hears nothing published
    before)."""

    def __init__(self, endpoint: str) -> None:
        self.batches: list[EventBatch] = []
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt_string(zmq.SUBSCRIBE, "")
        self._sub.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        decoder = msgspec.msgpack.Decoder()
        while not self._stop.is_set():
            if self._sub.poll(100):
                _, seq, payload = self._sub.recv_multipart()
                self.batches.append(
                    decode_batch(int.from_bytes(seq, "big"), decoder.decode(payload))
                )

    def stored(self) -> list[Stored]:
        return [e for b in list(self.batches) for e in b.events if isinstance(e, Stored)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sub.close(0)
        self._ctx.term()
