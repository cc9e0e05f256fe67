"""A fault-injecting HTTP proxy in front of one worker: a real vLLM worker in
``tests/model``, an LLM stand-in in ``tests/service``.

The router sees the proxy as a worker. In ``pass`` mode every request is forwarded to the
real worker unchanged; :meth:`FaultProxy.inject` switches it, at runtime, to one of:

==============  ==========================================================================
mode            what a ``POST`` gets
==============  ==========================================================================
``slow``        the real worker's answer, ``delay_s`` late
``5xx``         ``503`` with an OpenAI-style error body, without reaching the worker
``invalid_json`` ``200`` whose body is cut-off JSON (what a worker dying mid-write sends)
``bad_intent``  the real worker's completion with its message replaced by prose, not the
                intent JSON the prompt asks for (a model or a server that ignores the
                response format); it takes as long as the real answer, so the router
                does not take the worker for a fast one
==============  ==========================================================================

A fault is bounded in count and in time: it applies to the next ``requests`` POSTs or
for ``max_s`` seconds, whichever ends first, then the proxy is back in ``pass`` mode on
its own; :meth:`wait_done` blocks until then. ``GET`` (``/health``, ``/metrics``) is
always forwarded at once, as a sick worker still answers its health check.

Every answer is counted per mode (``served``), and each faulty one names the shopper it
went to (``shoppers``, from the body's ``user``); ``changing`` is how many faulty answers
are still being made (a slow one takes its delay, a prose one the real answer's time). The
proxy runs uvicorn in a daemon thread of the test process, on a loopback port.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import orjson

from tests.support.waiting import passes_within, until

MODES = ("pass", "slow", "5xx", "invalid_json", "bad_intent")
BAD_INTENT_TEXT = "Sure! This shopper is probably looking for running shoes."


@dataclass(frozen=True)
class FaultWindow:
    """One injected fault: its mode, when it started and ended (epoch s), how many
    answers it changed."""

    mode: str
    started_at: float
    ended_at: float
    served: int


class FaultProxy:
    def __init__(self, target: str, port: int) -> None:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.routing import Route

        self.target = target.rstrip("/")
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.served: Counter[str] = Counter()  # answers per mode, "pass" included
        # mode -> the shoppers (the body's ``user``) whose requests that fault changed
        self.shoppers: dict[str, list[str]] = {}
        self.windows: list[FaultWindow] = []
        self._lock = threading.Lock()
        self._mode = "pass"
        self._delay_s = 0.0
        self._left = 0
        self._until = 0.0
        self._started_at = 0.0
        self._served_in_window = 0
        self._changing = 0
        self._client = httpx.AsyncClient(base_url=self.target, timeout=120)

        app = Starlette(routes=[Route("/{path:path}", self._handle, methods=["GET", "POST"])])
        self._server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        )
        self._thread = threading.Thread(target=self._server.run, name="fault-proxy", daemon=True)
        self._thread.start()
        until(
            lambda: self._server.started,
            f"the fault proxy to start on port {port}",
            timeout_s=10,
            interval_s=0.05,
            give_up=lambda: not self._thread.is_alive() and "its server thread ended",
        )

    # --- control -------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        with self._lock:
            self._expire(time.time())
            return self._mode

    @property
    def changing(self) -> int:
        """Faulty answers taken but not yet handed back."""
        with self._lock:
            return self._changing

    def inject(self, mode: str, requests: int, max_s: float, delay_s: float = 0.0) -> None:
        """Apply ``mode`` to the next ``requests`` POSTs, for at most ``max_s`` seconds."""
        if mode not in MODES or mode == "pass":
            raise ValueError(f"mode must be one of {MODES[1:]} (got {mode!r})")
        if requests < 1 or max_s <= 0:
            raise ValueError("a fault needs requests >= 1 and max_s > 0")
        with self._lock:
            self._expire(time.time())
            if self._mode != "pass":
                raise RuntimeError(f"a {self._mode} fault is still active")
            now = time.time()
            self._mode, self._delay_s, self._left = mode, delay_s, requests
            self._until, self._started_at, self._served_in_window = now + max_s, now, 0

    def wait_done(self, timeout_s: float) -> bool:
        """Wait until the current fault has ended (by count or by time); whether it has."""
        return passes_within(lambda: self.mode == "pass", timeout_s, interval_s=0.2)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    # --- serving -------------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        """Back to ``pass`` when the fault's count or time is used up (lock held)."""
        if self._mode != "pass" and (self._left <= 0 or now >= self._until):
            self.windows.append(
                FaultWindow(self._mode, self._started_at, now, self._served_in_window)
            )
            self._mode = "pass"

    def _take(self, body: bytes) -> tuple[str, float]:
        """The mode for this request, counting it against the fault's budget."""
        with self._lock:
            self._expire(time.time())
            mode, delay = self._mode, self._delay_s
            if mode != "pass":
                self._left -= 1
                self._served_in_window += 1
                self._changing += 1
                self.shoppers.setdefault(mode, []).append(_field(body, "user"))
            self.served[mode] += 1
            return mode, delay

    async def _handle(self, request):
        body = await request.body()
        if request.method == "GET":
            return await self._forward(request, body)
        mode, delay = self._take(body)
        if mode == "pass":
            return await self._forward(request, body)
        try:
            return await self._changed(mode, delay, request, body)
        finally:
            with self._lock:
                self._changing -= 1

    async def _changed(self, mode: str, delay: float, request, body: bytes):
        from starlette.responses import Response

        if mode == "5xx":
            error = {"error": {"message": "injected fault", "type": "server_error", "code": 503}}
            return Response(orjson.dumps(error), 503, media_type="application/json")
        if mode == "invalid_json":
            return Response(b'{"id": "chatcmpl-cut", "choices": [{"ind', 200,
                            media_type="application/json")  # fmt: skip
        if mode == "slow":
            await asyncio.sleep(delay)
        reply = await self._forward(request, body)
        if mode == "bad_intent" and reply.status_code == 200:
            return Response(_prose_completion(body), 200, media_type="application/json")
        return reply

    async def _forward(self, request, body: bytes):
        from starlette.responses import Response

        reply = await self._client.request(
            request.method,
            request.url.path,
            content=body or None,
            headers={"content-type": request.headers.get("content-type", "application/json")},
        )
        return Response(
            reply.content, reply.status_code, media_type=reply.headers.get("content-type")
        )


def _field(request_body: bytes, name: str) -> str:
    try:
        return str(orjson.loads(request_body).get(name, ""))
    except (orjson.JSONDecodeError, AttributeError):
        return ""


def _prose_completion(request_body: bytes) -> bytes:
    model = _field(request_body, "model")
    return orjson.dumps(
        {
            "id": "chatcmpl-injected",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": BAD_INTENT_TEXT},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 0, "completion_tokens": 12, "total_tokens": 12},
        }
    )
