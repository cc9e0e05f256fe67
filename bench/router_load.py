"""The router under slow and large clients at once, with the kv_prefix policy.

A real router process (``python -m inference_sidecar router --policy kv_prefix``, the
model folder's tokenizer, block size and context given on the command line) in front of
two instant LLM stand-ins (``bench/standin_llm.py``: the model is not the subject), with,
for ``--seconds``:

* slow clients: as many connections as the router has admission slots, each sending a
  request's headers and then one byte of its body every half second, never finishing;
* large clients: two loops sending 4 MiB chat bodies (past the context: never tokenized)
  and bodies of about 320 KiB of text (within the byte bound, so tokenized in full: the
  most tokenizing one request can cost), one after the other;
* legitimate clients: four loops sending a shopper's ordinary prompt;
* a probe, in a process of its own, asking ``GET /health`` every 20 ms.

It runs once with the tokenizer in a process of its own (``--tokenizer-workers 1``, the
default) and once in a thread of the router (``0``), and reports per run the latency of
``/health`` (p50, p99, max) and the statuses every kind of client got. The targets are
judged on the default run: ``/health`` p99 under 100 ms, and no legitimate request
refused while the slow clients hold their connections.

Then, for ``--throughput-s``, the router as the embedded stack starts it (its default
policy, no tokenizer) in front of two stand-ins answers ordinary prompts from
``--throughput-clients`` loops, and its process's CPU time gives its cost per request
(``throughput.cpu_ms_per_request``: what ``shopper-intents plan`` sizes the router
replicas by). Figures go to ``bench/results/router_load.json``. CPU-bound for about a
minute: run it under the heavy lock::

    flock /tmp/si-heavy.lock .cache/venv/bin/python -m bench.router_load
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench._common import (
    CpuClock,
    percentile,
    ratio,
    result_doc,
    rounded,
    target,
    targets_table,
    write_result,
)
from flink_jobs.tools.embedded_stack import start_standin_tier, start_standin_workers
from flink_jobs.tools.local_services import LocalProcess, free_port, http_ok
from inference_sidecar.workers import default_cache_dir, find_model_dir, repo_root

SLOTS = 8
"""The router's --max-concurrent-requests: the slow clients open as many connections."""
LARGE_CLIENTS = 2
LEGIT_CLIENTS = 4
HEALTH_INTERVAL_S = 0.02
HUGE_BODY_BYTES = 4 * 1024 * 1024 - 4096
"""Just under the router's default --max-body-bytes (4 MiB), its JSON wrapper included."""
TOKENIZED_BODY_BYTES = 320 * 1024
"""Text a 4,096-token context lets through the byte bound (82 bytes a token at most):
tokenized in full, then found over the context."""
MAX_MODEL_LEN = 4096
BLOCK_SIZE = 16
HEALTH_P99_LIMIT_MS = 100.0


@dataclass
class LoadFigures:
    """What one run's clients saw."""

    health_ms: list[float] = field(default_factory=list)
    health_failures: int = 0
    legit: Counter[int] = field(default_factory=Counter)
    large: Counter[int] = field(default_factory=Counter)
    slow_opened: int = 0
    slow_answered_early: int = 0
    """Slow uploads the router answered before the run's end (they never finish)."""

    def summary(self) -> dict[str, Any]:
        return {
            "health_probes": len(self.health_ms),
            "health_failures": self.health_failures,
            "health_p50_ms": rounded(percentile(self.health_ms, 50)),
            "health_p99_ms": rounded(percentile(self.health_ms, 99)),
            "health_max_ms": rounded(max(self.health_ms, default=float("nan"))),
            "legit_statuses": {str(k): v for k, v in sorted(self.legit.items())},
            "legit_refused": self.legit_refused,
            "large_statuses": {str(k): v for k, v in sorted(self.large.items())},
            "slow_connections": self.slow_opened,
            "slow_answered_early": self.slow_answered_early,
        }

    @property
    def legit_refused(self) -> int:
        return sum(n for status, n in self.legit.items() if status != 200)


# ----- the router and its workers ------------------------------------------------------


class LoadStack:
    """Two stand-ins and a kv_prefix router in front of them, stopped on ``close``."""

    def __init__(self, workdir: Path, tokenizer_workers: int, slots: int = SLOTS) -> None:
        self._exit = ExitStack()
        try:
            workers = [w.url for w in start_standin_workers(workdir, self._exit, 2, "0.01")]
            self.router_url = self._start_router(workdir, workers, tokenizer_workers, slots)
        except BaseException:
            self._exit.close()
            raise

    def _start_router(
        self, workdir: Path, workers: list[str], tokenizer_workers: int, slots: int
    ) -> str:
        port = free_port()
        model = find_model_dir(cache_dir=default_cache_dir())
        argv = [
            sys.executable, "-m", "inference_sidecar", "router", "--port", str(port),
            "--policy", "kv_prefix", "--tokenizer", str(model),
            "--kv-block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
            "--tokenizer-workers", str(tokenizer_workers),
            "--max-concurrent-requests", str(slots), "--health-interval", "0.5",
            "--log-level", "warning",
        ]  # fmt: skip
        for worker in workers:
            # Stand-ins publish no KV events: nothing listens there, as for a quiet worker.
            argv += ["--worker", worker, "--kv-events", f"{worker}=tcp://127.0.0.1:{free_port()}"]
        router = LocalProcess(
            f"router-{port}", argv, workdir / "logs" / f"router-{port}.log", cwd=repo_root()
        )
        self._exit.enter_context(router)
        url = f"http://127.0.0.1:{port}"
        router.wait_ready(lambda: http_ok(f"{url}/health"), timeout_s=60.0, interval_s=0.2)
        return url

    def close(self) -> None:
        self._exit.close()


# ----- the clients ---------------------------------------------------------------------


def chat_body(text: str, shopper: str) -> bytes:
    return orjson.dumps(
        {
            "model": "stand-in-model",
            "messages": [
                {"role": "system", "content": "Infer the shopper's intent."},
                {"role": "user", "content": text},
            ],
            "max_tokens": 16,
            "user": shopper,
        }
    )


def _shopper_prompt(i: int) -> str:
    return " ".join(f"viewed item {j} in category {j % 7} at {10 + j} EUR" for j in range(60 + i))


async def _slow_upload(host: str, port: int, stop: asyncio.Event, figures: LoadFigures) -> None:
    """Headers, then a byte of the body every half second, until ``stop``."""
    reader, writer = await asyncio.open_connection(host, port)
    figures.slow_opened += 1
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: router\r\n"
        b"content-type: application/json\r\ncontent-length: 100000\r\n\r\n{"
    )
    try:
        while not stop.is_set():
            await writer.drain()
            with_answer = asyncio.ensure_future(reader.read(1))
            done, _ = await asyncio.wait({with_answer}, timeout=0.5)
            if done:
                if with_answer.result():  # answered (or closed) before the end
                    figures.slow_answered_early += 1
                return
            with_answer.cancel()
            writer.write(b" ")
    finally:
        writer.close()


async def _large(client: httpx.AsyncClient, stop: asyncio.Event, figures: LoadFigures) -> None:
    bodies = [
        chat_body("x " * (HUGE_BODY_BYTES // 2), "large-huge"),
        chat_body("shoes " * (TOKENIZED_BODY_BYTES // 6), "large-tokenized"),
    ]
    n = 0
    while not stop.is_set():
        reply = await client.post("/v1/chat/completions", content=bodies[n % 2])
        figures.large[reply.status_code] += 1
        n += 1


async def _legit(
    client: httpx.AsyncClient, lane: int, stop: asyncio.Event, figures: LoadFigures
) -> None:
    n = 0
    while not stop.is_set():
        body = chat_body(_shopper_prompt(n % 20), f"shopper-{lane}-{n % 20}")
        reply = await client.post("/v1/chat/completions", content=body)
        figures.legit[reply.status_code] += 1
        n += 1


def _probe_health(url: str, seconds: float, out: Any) -> None:
    """In a process of its own: ``GET /health`` latencies (ms), None for a failure."""
    latencies: list[float | None] = []
    deadline = time.monotonic() + seconds
    with httpx.Client(timeout=10.0) as client:
        while time.monotonic() < deadline:
            started = time.perf_counter()
            try:
                ok = client.get(f"{url}/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append((time.perf_counter() - started) * 1000 if ok else None)
            time.sleep(HEALTH_INTERVAL_S)
    out.send(latencies)
    out.close()


async def run_load(router_url: str, seconds: float, slots: int = SLOTS) -> LoadFigures:
    """Slow, large and legitimate clients and a health probe against ``router_url``."""
    figures = LoadFigures()
    stop = asyncio.Event()
    host, port = router_url.removeprefix("http://").split(":")
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    probe = context.Process(target=_probe_health, args=(router_url, seconds, send))
    limits = httpx.Limits(max_connections=LARGE_CLIENTS + LEGIT_CLIENTS)
    async with httpx.AsyncClient(base_url=router_url, timeout=60.0, limits=limits) as client:
        slow = [
            asyncio.create_task(_slow_upload(host, int(port), stop, figures)) for _ in range(slots)
        ]
        while figures.slow_opened < slots:
            await asyncio.sleep(0.01)
        probe.start()
        lanes = [asyncio.create_task(_large(client, stop, figures)) for _ in range(LARGE_CLIENTS)]
        lanes += [
            asyncio.create_task(_legit(client, i, stop, figures)) for i in range(LEGIT_CLIENTS)
        ]
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.gather(*lanes, *slow)
    latencies = await asyncio.to_thread(receive.recv)
    await asyncio.to_thread(probe.join)
    figures.health_ms = [ms for ms in latencies if ms is not None]
    figures.health_failures = sum(1 for ms in latencies if ms is None)
    return figures


# ----- the router's cost per request ----------------------------------------------------


THROUGHPUT_CLIENTS = 8
STANDIN_LATENCY = "0.01"


def throughput_figures(requests: int, wall_s: float, router_cpu_s: float) -> dict[str, Any]:
    """Requests/s, the router's CPU ms per request and the requests/s one core of it
    would carry at that cost; None for the last two when no router CPU was read."""
    per_request = ratio(1000 * router_cpu_s, requests) if router_cpu_s > 0 else None
    return {
        "requests": requests,
        "wall_s": rounded(wall_s),
        "requests_per_s": rounded(ratio(requests, wall_s), 1),
        "router_cpu_s": rounded(router_cpu_s),
        "router_cores": rounded(ratio(router_cpu_s, wall_s)),
        "cpu_ms_per_request": rounded(per_request, 4),
        "requests_per_s_per_core": rounded(ratio(1000, per_request), 0),
    }


async def _answered(router_url: str, seconds: float, clients: int) -> tuple[int, int, float]:
    """Ordinary prompts from ``clients`` loops for ``seconds``: (answered, refused, wall s)."""
    counts: Counter[bool] = Counter()
    stop = asyncio.Event()

    async def lane(client: httpx.AsyncClient, i: int) -> None:
        n = 0
        while not stop.is_set():
            body = chat_body(_shopper_prompt(n % 20), f"shopper-{i}-{n % 50}")
            reply = await client.post("/v1/chat/completions", content=body)
            counts[reply.status_code == 200] += 1
            n += 1

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=router_url, timeout=60.0, limits=limits) as client:
        started = time.monotonic()
        lanes = [asyncio.create_task(lane(client, i)) for i in range(clients)]
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.gather(*lanes)
        wall = time.monotonic() - started
    return counts[True], counts[False], wall


def run_throughput(workdir: Path, seconds: float, clients: int) -> dict[str, Any]:
    """The default router in front of two stand-ins under ``clients`` loops of ordinary
    prompts: its CPU per request (the ``router`` processes under this one)."""
    tier = start_standin_tier(workdir, workers=2, latency=STANDIN_LATENCY)
    try:
        clock = CpuClock()
        mark = clock.mark()
        answered, refused, wall = asyncio.run(_answered(tier.router_url, seconds, clients))
        cpu_s = clock.since(mark).get("router", 0.0)
    finally:
        tier.stop()
    return {
        **throughput_figures(answered, wall, cpu_s),
        "refused": refused,
        "clients": clients,
        "standin_latency_s": float(STANDIN_LATENCY),
    }


# ----- the benchmark -------------------------------------------------------------------


MODES = {"process": 1, "thread": 0}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.router_load", description=__doc__)
    p.add_argument("--seconds", type=float, default=20.0, help="load per run (default 20)")
    p.add_argument("--modes", default="process,thread", help="tokenizer in: process,thread")
    p.add_argument(
        "--throughput-s", type=float, default=20.0, help="the cost-per-request run (0: none)"
    )
    p.add_argument("--throughput-clients", type=int, default=THROUGHPUT_CLIENTS)
    p.add_argument("--workdir", type=Path, default=default_cache_dir() / "bench" / "router_load")
    a = p.parse_args(argv)
    started = time.monotonic()
    runs: dict[str, dict[str, Any]] = {}
    for mode in a.modes.split(","):
        stack = LoadStack(a.workdir / mode, MODES[mode])
        try:
            figures = asyncio.run(run_load(stack.router_url, a.seconds))
        finally:
            stack.close()
        runs[mode] = figures.summary()
        print(f"{mode:8s} {runs[mode]}")
    throughput: dict[str, Any] = {}
    if a.throughput_s > 0:
        throughput = run_throughput(a.workdir / "throughput", a.throughput_s, a.throughput_clients)
        print(f"throughput {throughput}")
    default = runs.get("process", {})
    targets = [
        target(
            "health_p99_ms_under_slow_and_large_clients",
            default.get("health_p99_ms"),
            "<=",
            HEALTH_P99_LIMIT_MS,
            "kv_prefix, tokenizer in its own process (the default)",
        ),
        target(
            "legitimate_requests_refused_while_slow_uploads_hold_connections",
            default.get("legit_refused"),
            "<=",
            0,
            f"{SLOTS} slow uploads, as many as the router's admission slots",
        ),
    ]
    notes = [
        f"{SLOTS} slow uploads (a byte every 0.5 s), {LARGE_CLIENTS} large clients (4 MiB and "
        f"{TOKENIZED_BODY_BYTES // 1024} KiB bodies in turn), {LEGIT_CLIENTS} legitimate clients,"
        f" /health probed every {HEALTH_INTERVAL_S * 1000:.0f} ms from its own process",
        "runs: 'process' tokenizes in a process of its own (--tokenizer-workers 1), 'thread' "
        "in a thread of the router (--tokenizer-workers 0)",
    ]
    if throughput:
        notes.append(
            f"throughput: the router with its default policy before two stand-ins answering"
            f" after {STANDIN_LATENCY} s, {a.throughput_clients} clients of ordinary prompts;"
            " CPU of the router process only (the clients and stand-ins share the host)"
        )
    figures: dict[str, Any] = {"seconds": a.seconds, "runs": runs}
    if throughput:
        figures["throughput"] = throughput
    doc = result_doc("router_load", started, targets, notes, **figures)
    path = write_result(doc)
    print(targets_table(targets))
    print(f"written to {path}")
    return 0 if doc["all_targets_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
