"""A scriptable stand-in for vLLM workers, behind ``httpx.MockTransport``.

Each worker URL gets a behaviour ("ok", "down", "error500", "garbage", "slow", "hang",
"break_stream", "stall_stream", "bad_request", "no_metrics"); every request a worker
receives is recorded so tests can check what the router sent where.

``GET /metrics`` answers as vLLM's does for the gauges of a worker's load: running (the
completions it holds now, or ``reported[worker]`` when set: requests other routers sent)
and waiting (0); "no_metrics" answers 404 there.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

KV_PARAMS_FROM_PREFILL = {"remote_engine_id": "engine-1", "remote_block_ids": [1, 2]}


@dataclass
class Received:
    worker: str
    path: str
    headers: dict[str, str]
    content: bytes

    @property
    def body(self) -> dict[str, Any]:
        return orjson.loads(self.content)


@dataclass
class FakeWorkers:
    behaviour: dict[str, str] = field(default_factory=dict)
    received: list[Received] = field(default_factory=list)
    delay_s: float = 0.0
    in_flight: dict[str, int] = field(default_factory=dict)
    max_in_flight: dict[str, int] = field(default_factory=dict)
    #: chunks of streamed answers the router has taken, per worker (counted when it asks
    #: for the next one)
    chunks_taken: dict[str, int] = field(default_factory=dict)
    #: requests running per worker as its /metrics reports them, where set
    reported: dict[str, int] = field(default_factory=dict)
    #: GET /metrics answered per worker
    metrics_reads: dict[str, int] = field(default_factory=dict)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def sent_to(self, worker: str, path: str | None = None) -> list[Received]:
        return [r for r in self.received if r.worker == worker and (path is None or r.path == path)]

    def completions_by_worker(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.received:
            if r.path.startswith("/v1/") and r.path != "/v1/models":
                counts[r.worker] = counts.get(r.worker, 0) + 1
        return counts

    async def handle(self, request: httpx.Request) -> httpx.Response:
        worker = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        mode = self.behaviour.get(worker, "ok")
        if mode == "down":
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200 if mode != "unhealthy" else 503)
        if request.url.path == "/metrics":
            return self._metrics(worker, mode)
        if request.url.path == "/v1/models":
            if mode == "hang":
                await asyncio.sleep(30)
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m"}]})
        content = await request.aread()
        self.received.append(Received(worker, request.url.path, dict(request.headers), content))
        self.in_flight[worker] = self.in_flight.get(worker, 0) + 1
        self.max_in_flight[worker] = max(self.max_in_flight.get(worker, 0), self.in_flight[worker])
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            return await self._answer(worker, mode, orjson.loads(content), request)
        finally:
            self.in_flight[worker] -= 1

    def _metrics(self, worker: str, mode: str) -> httpx.Response:
        if mode == "no_metrics":
            return httpx.Response(404, text="Not Found")
        self.metrics_reads[worker] = self.metrics_reads.get(worker, 0) + 1
        running = self.reported.get(worker, self.in_flight.get(worker, 0))
        labels = 'engine="0",model_name="m"'
        page = (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{labels}}} {float(running)}\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{{{labels}}} 0.0\n"
        )
        return httpx.Response(200, text=page, headers={"content-type": "text/plain"})

    async def _answer(
        self, worker: str, mode: str, body: dict[str, Any], request: httpx.Request
    ) -> httpx.Response:
        if mode == "error500":
            return httpx.Response(500, json={"error": {"message": "engine dead"}})
        if mode == "garbage":
            return httpx.Response(200, content=b"<html>oops", headers={"content-type": "text/html"})
        if mode == "bad_request":
            return httpx.Response(400, json={"error": {"message": "prompt too long"}})
        if mode == "hang":
            await asyncio.sleep(30)
        if mode == "slow":
            await asyncio.sleep(0.3)
        if body.get("stream"):
            return httpx.Response(
                200,
                content=self._stream(
                    worker,
                    broken=mode == "break_stream",
                    stalled=mode == "stall_stream",
                    request=request,
                ),
                headers={"content-type": "text/event-stream"},
            )
        reply: dict[str, Any] = {
            "id": "cmpl-1",
            "object": "chat.completion",
            "worker": worker,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
        }
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            reply["kv_transfer_params"] = {**KV_PARAMS_FROM_PREFILL, "from": worker}
        return httpx.Response(200, json=reply)

    async def _stream(
        self, worker: str, broken: bool, stalled: bool, request: httpx.Request
    ) -> AsyncIterator[bytes]:
        for i in range(3):
            yield f'data: {{"worker": "{worker}", "i": {i}}}\n\n'.encode()
            self.chunks_taken[worker] = self.chunks_taken.get(worker, 0) + 1
            if broken and i == 1:
                raise httpx.ReadError("connection reset", request=request)
            if stalled:  # alive but silent after its first chunk
                await asyncio.sleep(30)
        yield b"data: [DONE]\n\n"
