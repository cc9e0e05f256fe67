"""The benchmark's client side: streamed chat requests through a router, timed, and a
sampler of each worker's in-flight requests.

Every request carries ``X-Session-ID: <shopper>`` (our router and vllm-router's
consistent_hash both key on it), streams so the first chunk gives the TTFT, and asks for
a few tokens only, so a run measures prefill and caching rather than decoding. The last
chunk carries vLLM's usage (``stream_options.include_usage``); with the workers'
``--enable-prompt-tokens-details`` it says how many of the prompt's tokens the prefix
cache served, so each request's recompute is known, not only the phase's total.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
import orjson

from bench._metrics import INFLIGHT_GAUGES, parse_samples
from bench._workload import Request

log = logging.getLogger(__name__)

WORKER_HEADER = "x-sidecar-worker"

#: Where requests go: one router's URL, or a choice made per request (the replicas
#: phase's spreading client, ``bench._replicas.RoundRobin``).
Target = str | Callable[[], str]


def base_url(target: Target) -> str:
    """The router a request goes to: ``target`` itself, or its choice for this request."""
    return target if isinstance(target, str) else target()


@dataclass(frozen=True, slots=True)
class Outcome:
    seq: int
    shopper: str
    ok: bool
    ttft_s: float
    total_s: float
    worker: str
    """The worker that served it, when the router says (our router's response header)."""
    error: str = ""
    started: float = 0.0
    """Monotonic time the request was sent."""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    """Prompt tokens the worker's prefix cache served (vLLM's usage), when it says."""


async def send(
    client: httpx.AsyncClient, target: Target, model: str, request: Request, max_tokens: int
) -> Outcome:
    body = {
        "model": model,
        "messages": list(request.messages),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"X-Session-ID": request.shopper}
    url = base_url(target)
    sent = time.monotonic()
    started = time.perf_counter()
    ttft = float("nan")
    usage: dict = {}
    try:
        async with client.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers=headers
        ) as reply:
            worker = reply.headers.get(WORKER_HEADER, "")
            if reply.status_code != 200:
                text = (await reply.aread()).decode(errors="replace")[:200]
                return Outcome(
                    request.seq, request.shopper, False, ttft,
                    time.perf_counter() - started, worker, f"HTTP {reply.status_code}: {text}",
                    sent,
                )  # fmt: skip
            async for line in reply.aiter_lines():
                if not line.startswith("data:"):
                    continue
                if ttft != ttft:  # first chunk: NaN != NaN
                    ttft = time.perf_counter() - started
                usage = chunk_usage(line) or usage
    except httpx.HTTPError as exc:
        return Outcome(
            request.seq, request.shopper, False, ttft, time.perf_counter() - started, "",
            f"{type(exc).__name__}: {exc}", sent,
        )  # fmt: skip
    details = usage.get("prompt_tokens_details") or {}
    return Outcome(
        request.seq, request.shopper, True, ttft, time.perf_counter() - started, worker, "",
        sent, usage.get("prompt_tokens"), details.get("cached_tokens"),
    )  # fmt: skip


def chunk_usage(line: str) -> dict | None:
    """The ``usage`` of one server-sent-events line, if it has one (the last chunk does;
    the others carry ``"usage": null`` or none)."""
    if '"usage"' not in line or not line.startswith("data:"):
        return None
    try:
        usage = orjson.loads(line[5:]).get("usage")
    except orjson.JSONDecodeError:
        return None
    return usage if isinstance(usage, dict) else None


async def run_ordered(
    url: Target,
    model: str,
    requests: Sequence[Request],
    concurrency: int,
    max_tokens: int,
    deadline: float,
) -> tuple[list[Outcome], bool]:
    """Send ``requests`` in schedule order with ``concurrency`` in flight; a shopper's next
    request waits for its previous one (the pipeline never has two prompts of one shopper
    in flight in the steady state). Stops taking new requests at ``deadline`` (monotonic);
    returns the outcomes and whether it was cut short."""
    queue: asyncio.Queue[Request] = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)
    locks: dict[str, asyncio.Lock] = {}
    outcomes: list[Outcome] = []
    cut = False

    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=5.0)) as client:

        async def loop() -> None:
            nonlocal cut
            while True:
                try:
                    r = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                if time.monotonic() > deadline:
                    cut = True
                    return
                lock = locks.setdefault(r.shopper, asyncio.Lock())
                async with lock:
                    outcomes.append(await send(client, url, model, r, max_tokens))

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    outcomes.sort(key=lambda o: o.seq)
    return outcomes, cut


async def run_lanes(
    url: Target, model: str, lanes: Sequence[Sequence[Request]], max_tokens: int, deadline: float
) -> tuple[list[Outcome], bool, float]:
    """All lanes at once, each sending its requests one after the other. Returns the
    outcomes, whether the deadline cut it short, and when (monotonic) the first lane ran
    out of requests: until then the offered load was the full, constant skew."""
    outcomes: list[Outcome] = []
    cut = False
    first_done = math.inf
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(300.0, connect=5.0), limits=httpx.Limits(max_connections=200)
    ) as client:

        async def lane(requests: Sequence[Request]) -> None:
            nonlocal cut, first_done
            for r in requests:
                if time.monotonic() > deadline:
                    cut = True
                    break
                outcomes.append(await send(client, url, model, r, max_tokens))
            first_done = min(first_done, time.monotonic())

        await asyncio.gather(*(lane(requests) for requests in lanes))
    outcomes.sort(key=lambda o: o.seq)
    return outcomes, cut, first_done


#: Seconds between two in-flight samples: often enough for requests of 1-20 s, rare
#: enough that three workers' ``/metrics`` pages (~100 kB each) do not load the machine.
SAMPLE_INTERVAL_S = 0.2


class InflightSampler:
    """Polls every worker's ``/metrics`` for running + waiting requests every ``interval_s``
    (a fixed schedule: the next poll is due ``interval_s`` after the previous one began)."""

    def __init__(self, workers: Sequence[str], interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.workers = list(workers)
        self.interval_s = interval_s
        self.rows: list[list[float]] = []
        self.times: list[float] = []
        """Monotonic time of each row."""
        self._task: asyncio.Task[None] | None = None

    async def _poll(self) -> None:
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                started = time.monotonic()
                replies = await asyncio.gather(
                    *(client.get(f"{w}/metrics") for w in self.workers), return_exceptions=True
                )
                row = []
                for reply in replies:
                    if isinstance(reply, BaseException):
                        row.append(0.0)
                        continue
                    gauges = parse_samples(reply.text, INFLIGHT_GAUGES)
                    row.append(sum(gauges.values()))
                self.rows.append(row)
                self.times.append(started)
                await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> list[list[float]]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        return self.rows
