"""Streaming pass-through: a worker's stream relayed to the client chunk by chunk.

The first chunk is read before the response starts (``Upstream.stream``), so a worker
that fails before producing anything is retried on another one. Once bytes have reached
the client a retry would duplicate them, so a failure after that ends the client's
stream with an SSE error event instead.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import httpx
from starlette.responses import StreamingResponse

from inference_sidecar.router.attempts import Attempt
from inference_sidecar.router.bodies import error_body

log = logging.getLogger(__name__)


class RelayedStream(StreamingResponse):
    """A worker's stream passed on to the client. When the response is over, however it
    ended (finished, broken, the client gone, or never started), the relay and the
    worker's stream are closed and ``on_close`` runs: the attempt is accounted for and
    the admission slot given back."""

    def __init__(
        self,
        relay: AsyncGenerator[bytes, None],
        upstream: httpx.Response,
        *,
        on_close: list[Callable[[], None]],
        **kwargs: Any,
    ) -> None:
        super().__init__(relay, **kwargs)
        self._relay = relay
        self._upstream = upstream
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._relay.aclose()  # a relay stopped at a yield records its outcome
                await self._upstream.aclose()
            finally:
                for callback in self.on_close:
                    callback()


async def relay(
    attempt: Attempt,
    first: bytes,
    chunks: AsyncIterator[bytes],
    *,
    timeout_s: float,
    on_failure: Callable[[Attempt, str], None],
) -> AsyncGenerator[bytes, None]:
    """The worker's chunks, until its stream ends, breaks or passes the attempt's
    deadline; the last two end the client's stream with an SSE error event and call
    ``on_failure(attempt, kind)``."""
    attempt.ok = False
    try:
        yield first
        while True:
            async with asyncio.timeout_at(attempt.deadline):
                chunk = await anext(chunks, None)
            if chunk is None:
                break
            yield chunk
        attempt.ok = True
    except (httpx.HTTPError, TimeoutError) as exc:
        if isinstance(exc, TimeoutError):
            kind, status = "timeout", 504
            message = f"the worker did not finish within {timeout_s} s"
        else:
            kind, status = "stream_broken", 502
            message = f"the worker failed mid-stream: {type(exc).__name__}"
        on_failure(attempt, kind)
        log.warning("stream from %s failed after the first chunk: %s", attempt.worker, kind)
        yield b"data: " + error_body(message, "upstream_error", code=status) + b"\n\n"
    except BaseException:
        attempt.ok = None  # client disconnected (cancellation) or generator closed early
        raise
