"""Calls to the workers: attempts, retries over the key's workers, deadlines, streaming.

Per request: the policy picks a worker (``RoutingState.choose``); a worker that fails
before any byte reached the client (connection error, timeout, 5xx, a body that is not
JSON) is charged with the failure and the request goes to the key's next worker, up to
``max_attempts`` workers. Nothing else (the client leaving, a fault of the router) is
charged to a worker. Every attempt has a total deadline, its stream included: httpx's
read timeout bounds each read, not a worker that trickles bytes.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

import httpx
import orjson
from starlette.responses import Response

from inference_sidecar.config import RouterConfig
from inference_sidecar.exceptions import NoWorkerAvailable, RequestError, UpstreamError
from inference_sidecar.metrics import RouterMetrics
from inference_sidecar.router.attempts import (
    WORKER_FAILURES,
    Attempt,
    AttemptFailed,
    Reply,
    RoutedRequest,
    describe_failure,
)
from inference_sidecar.router.bodies import JSON, error_response
from inference_sidecar.router.streaming import RelayedStream, relay
from inference_sidecar.routing_key import RoutingKey
from inference_sidecar.routing_state import RoutingState

log = logging.getLogger(__name__)

WORKER_HEADER = "x-sidecar-worker"
PREFILL_WORKER_HEADER = "x-sidecar-prefill-worker"
#: Client headers worth passing to a worker; hop-by-hop and length headers are not.
FORWARDED_HEADERS = ("authorization", "x-request-id", "accept")
#: Forwarded headers that carry the client's credentials: configured workers only.
CREDENTIAL_HEADERS = ("authorization",)
#: A header value as HTTP/1.1 can carry it: visible ASCII, spaces and tabs.
_SENDABLE_HEADER_VALUE = re.compile(r"[\t\x20-\x7e]*")
#: Bytes of an upstream error body kept when a 5xx is retried (for the error message).
_ERROR_SNIPPET = 300

_T = TypeVar("_T")


class Upstream:
    """Sends requests to a pool's workers and accounts for every attempt.

    ``urls`` maps a worker's shown name (its URL without credentials) to the URL to send
    to; ``clock`` is the router's; ``on_served(worker, since)`` hears of every successful
    attempt whose prompt had full KV blocks (the worker must publish events about them).

    Which client headers reach which worker (``FORWARDED_HEADERS``): ``accept``,
    ``x-request-id`` and the routing key's headers go to every worker; the client's
    ``authorization`` (its credential for the workers, e.g. vLLM's ``--api-key``) only to
    workers configured at start (``RouterConfig``'s URLs), never to one that joined at
    runtime, whoever added it. Nothing else the client sends is forwarded.
    """

    def __init__(
        self,
        config: RouterConfig,
        metrics: RouterMetrics,
        client: httpx.AsyncClient,
        urls: Mapping[str, str],
        clock: Callable[[], float],
        on_served: Callable[[str, float], None] | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.client = client
        self.urls = urls
        self._configured = frozenset((*config.workers, *config.prefill, *config.decode))
        self._clock = clock
        self._on_served = on_served

    def forwarded_headers(self, request_headers: Mapping[str, str]) -> dict[str, str]:
        """The client headers a worker gets; one no worker can be sent (not visible ASCII)
        is the client's error, found here before any worker is chosen and charged."""
        headers = {"content-type": JSON}
        for name in (*FORWARDED_HEADERS, *self.config.key_headers):
            value = request_headers.get(name)
            if value is None:
                continue
            if not _SENDABLE_HEADER_VALUE.fullmatch(value):
                raise RequestError(
                    f"the {name} header must be printable ASCII (RFC 9110 field value)",
                    param=name,
                    code="invalid_header",
                )
            headers[name] = value
        return headers

    def headers_for(self, worker: str, headers: Mapping[str, str]) -> Mapping[str, str]:
        """``headers`` (``forwarded_headers``) as ``worker`` may get them: without the
        client's credential unless the worker was configured at start."""
        if "authorization" not in headers or self.urls.get(worker) in self._configured:
            return headers
        return {k: v for k, v in headers.items() if k not in CREDENTIAL_HEADERS}

    # ----- one attempt ---------------------------------------------------------------

    def _begin(self, pool: RoutingState, worker: str, key: RoutingKey) -> Attempt:
        """Account for a request sent to ``worker``."""
        ticket = pool.start(worker, key.value, key.size, key.blocks)
        self.metrics.worker_requests.labels(pool.name, worker).inc()
        self.metrics.in_flight.labels(pool.name, worker).set(pool.in_flight[worker])
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout_s
        return Attempt(pool, worker, self._clock(), deadline, ticket, len(key.blocks))

    def _end(self, attempt: Attempt) -> None:
        pool, worker = attempt.pool, attempt.worker
        now = self._clock()
        if self.config.health_interval_s <= 0:
            pool.expire(now)
        pool.finish(worker, attempt.ok, now - attempt.started, now, attempt.ticket)
        if attempt.ok is True and attempt.blocks and self._on_served is not None:
            self._on_served(worker, attempt.started)
        if worker in pool.in_flight:
            self.metrics.in_flight.labels(pool.name, worker).set(pool.in_flight[worker])

    def _fail(self, attempt: Attempt, kind: str) -> None:
        self.metrics.worker_errors.labels(attempt.pool.name, attempt.worker, kind).inc()

    def _choose(self, pool: RoutingState, key: RoutingKey, tried: list[str]) -> str | None:
        choice = pool.choose(key.value, exclude=tried, size=key.size, blocks=key.blocks)
        if choice is None:
            return None
        decision = "failed_over" if tried else choice.decision
        self.metrics.decisions.labels(self.config.policy, pool.name, decision).inc()
        log.debug(
            "key %r (%s, %d tokens) -> %s [%s]; in flight %s",
            key.value,
            key.source,
            key.size,
            choice.worker,
            decision,
            pool.in_flight,
        )
        tried.append(choice.worker)
        return choice.worker

    async def _on_workers(
        self,
        pool: RoutingState,
        key: RoutingKey,
        attempt_once: Callable[[Attempt], Awaitable[_T]],
    ) -> _T:
        """Run ``attempt_once`` on the key's workers in turn until one does not fail,
        up to ``max_attempts`` workers; each failure is charged to its worker."""
        tried: list[str] = []
        failures: list[tuple[str, str]] = []
        while len(tried) < self.config.max_attempts:
            worker = self._choose(pool, key, tried)
            if worker is None:
                break
            attempt = self._begin(pool, worker, key)
            try:
                return await attempt_once(attempt)
            except WORKER_FAILURES as exc:
                attempt.ok = False
                kind, text = describe_failure(exc)
                failures.append((worker, text))
                self._fail(attempt, kind)
            except BaseException:
                # The client went away (cancellation) or the router failed: the worker
                # is not to blame, so outlier detection hears nothing of it.
                attempt.ok = None
                raise
            finally:
                if not attempt.handed_over:
                    self._end(attempt)
            log.info("worker %s failed (%s); trying another", worker, failures[-1][1])
        raise exhausted(pool, failures)

    # ----- requests ------------------------------------------------------------------

    async def exchange(self, pool: RoutingState, request: RoutedRequest, content: bytes) -> Reply:
        """POST ``content`` and read the whole answer, retrying other workers on failure.

        A 2xx answer must be JSON (else the worker is faulty); a 4xx is the client's
        problem and is returned as is, without retry and without blaming the worker.
        """

        async def post(attempt: Attempt) -> Reply:
            async with asyncio.timeout_at(attempt.deadline):
                reply = await self.client.post(
                    f"{self.urls[attempt.worker]}{request.path}",
                    content=content,
                    headers=self.headers_for(attempt.worker, request.headers),
                )
            if reply.status_code >= 500:
                raise AttemptFailed(
                    "status_5xx", f"HTTP {reply.status_code}: {reply.text[:_ERROR_SNIPPET]}"
                )
            if reply.status_code < 300:
                try:
                    orjson.loads(reply.content)
                except orjson.JSONDecodeError as exc:
                    raise AttemptFailed(
                        "invalid_response", f"HTTP {reply.status_code} body is not JSON"
                    ) from exc
                attempt.ok = True
            else:
                attempt.ok = None
            content_type = reply.headers.get("content-type", JSON)
            return Reply(reply.status_code, reply.content, content_type, attempt.worker)

        return await self._on_workers(pool, request.key, post)

    async def stream(
        self,
        pool: RoutingState,
        request: RoutedRequest,
        content: bytes,
        extra_headers: Mapping[str, str] | None = None,
    ) -> Response:
        """POST a streaming request; retry until a worker yields its first chunk, then
        pass the rest through (``streaming``)."""

        async def open_stream(attempt: Attempt) -> Response:
            req = self.client.build_request(
                "POST",
                f"{self.urls[attempt.worker]}{request.path}",
                content=content,
                headers=self.headers_for(attempt.worker, request.headers),
            )
            upstream: httpx.Response | None = None
            try:
                async with asyncio.timeout_at(attempt.deadline):
                    upstream = await self.client.send(req, stream=True)
                    if upstream.status_code >= 500:
                        body = await upstream.aread()
                        raise AttemptFailed(
                            "status_5xx", f"HTTP {upstream.status_code}: {body[:_ERROR_SNIPPET]!r}"
                        )
                    if upstream.status_code >= 300:
                        attempt.ok = None
                        body = await upstream.aread()
                        return Response(
                            body,
                            status_code=upstream.status_code,
                            media_type=upstream.headers.get("content-type", JSON),
                        )
                    chunks = upstream.aiter_raw()
                    first = await anext(chunks, b"")
                if not first:
                    raise AttemptFailed("invalid_response", "the stream ended before any data")
                pool.prefilled(attempt.worker, attempt.ticket)
                self.metrics.ttft.labels(request.endpoint).observe(self._clock() - request.received)
                attempt.handed_over = True
                attempt.ok = None  # until the relay starts: a client gone first is no fault
                return RelayedStream(
                    relay(
                        attempt,
                        first,
                        chunks,
                        timeout_s=self.config.request_timeout_s,
                        on_failure=self._fail,
                    ),
                    upstream,
                    on_close=[lambda: self._stream_ended(attempt, request)],
                    status_code=upstream.status_code,
                    media_type=upstream.headers.get("content-type", "text/event-stream"),
                    headers={WORKER_HEADER: attempt.worker, **(extra_headers or {})},
                )
            finally:
                if upstream is not None and not attempt.handed_over:
                    await upstream.aclose()

        return await self._on_workers(pool, request.key, open_stream)

    def _stream_ended(self, attempt: Attempt, request: RoutedRequest) -> None:
        self._end(attempt)
        self.metrics.latency.labels(request.endpoint).observe(self._clock() - request.received)

    async def serve(
        self, pool: RoutingState, request: RoutedRequest, content: bytes, extra: dict[str, str]
    ) -> Response:
        """Send the answering request to ``pool``, streamed or not."""
        if request.streaming:
            return await self.stream(pool, request, content, extra)
        reply = await self.exchange(pool, request, content)
        return Response(
            reply.body,
            status_code=reply.status,
            media_type=reply.content_type,
            headers={WORKER_HEADER: reply.worker, **extra},
        )

    async def models(self, pool: RoutingState) -> Response:
        """``GET /v1/models`` from the first of ``pool``'s workers that answers."""
        attempts: list[tuple[str, str]] = []
        timeout_s = self.config.request_timeout_s
        for worker in pool.candidates()[: self.config.max_attempts]:
            try:
                async with asyncio.timeout(timeout_s):
                    reply = await self.client.get(f"{self.urls[worker]}/v1/models")
                if reply.status_code < 500:
                    orjson.loads(reply.content)
                    return Response(reply.content, reply.status_code, media_type=JSON)
                attempts.append((worker, f"HTTP {reply.status_code}"))
            except TimeoutError:
                attempts.append((worker, f"no answer within {timeout_s} s"))
            except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
                attempts.append((worker, f"{type(exc).__name__}: {exc}"))
        error = exhausted(pool, attempts)
        status = 503 if isinstance(error, NoWorkerAvailable) else 502
        return error_response(status, error.message, "upstream_error", code=status)


def exhausted(pool: RoutingState, attempts: list[tuple[str, str]]) -> UpstreamError:
    """The error of a request no worker of ``pool`` answered, naming each one tried."""
    if not attempts:
        return NoWorkerAvailable(f"no worker available in the {pool.name} pool")
    detail = "; ".join(f"{w}: {reason}" for w, reason in attempts)
    return UpstreamError(
        f"all {len(attempts)} worker(s) tried in the {pool.name} pool failed: {detail}",
        tuple(attempts),
    )
