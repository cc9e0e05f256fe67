"""The router's HTTP surface: routes, body reading, admission, errors as responses.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics``, and the admin routes ``POST /workers`` (a worker that
joined at runtime) and ``DELETE /workers`` (one that leaves).

The admin routes change where prompts go, so they are off unless configured
(``admin_guard``): with an admin token a request must carry ``Authorization: Bearer
<token>`` (compared in constant time); with an admin port they answer only on that port,
which listens on the loopback interface. A worker added at runtime never gets the
client's credentials (``Upstream.headers_for``).

A completion request is refused with a 429 before its body is read when the router
already serves ``max_concurrent_requests``; its body is read up to ``max_body_bytes``
within ``body_timeout_s``, holding no slot meanwhile (``admission``); then it takes a
slot and ``Router.prepare`` and ``Router.answer`` route it. Every error is an
OpenAI-style JSON body; no path waits without a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import httpx
import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from inference_sidecar.config import RouterConfig
from inference_sidecar.exceptions import ConfigError, NoWorkerAvailable, RequestError, UpstreamError
from inference_sidecar.kv.sources import EventSource
from inference_sidecar.router.admission import Admission
from inference_sidecar.router.bodies import (
    JSON,
    error_response,
    json_object,
    request_error_response,
)
from inference_sidecar.router.core import Router
from inference_sidecar.router.streaming import RelayedStream
from intent_reader.config_errors import redact_url

log = logging.getLogger(__name__)

#: Seconds a client refused by the admission limit is asked to wait (``Retry-After``).
RETRY_AFTER_S = 1


class Body:
    """A request body read within its deadline; its bytes count against ``admission``'s
    budget until ``release``."""

    def __init__(self, admission: Admission | None = None) -> None:
        self.raw = b""
        self.held = 0
        self._admission = admission

    async def read(self, request: Request, limit: int, timeout_s: float) -> bytes:
        """The request's body: a 413 past ``limit`` bytes (declared or sent), a 408 when
        it has not all arrived within ``timeout_s``, a 429 past the admission's budget."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RequestError(
                f"the request body ({declared} bytes) exceeds the limit of {limit} bytes",
                status=413,
                code="request_too_large",
            )
        parts: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise RequestError(
                            f"the request body exceeds the limit of {limit} bytes",
                            status=413,
                            code="request_too_large",
                        )
                    self._hold(len(chunk))
                    parts.append(chunk)
        except TimeoutError:
            raise RequestError(
                f"the request body did not arrive within {timeout_s:g} s; send it faster "
                "or raise --body-timeout",
                status=408,
                code="request_timeout",
            ) from None
        self.raw = b"".join(parts)
        return self.raw

    def _hold(self, n: int) -> None:
        if self._admission is None:
            return
        if not self._admission.hold(n):
            raise RequestError(
                "the router holds its limit of request bodies; retry later",
                status=429,
                code=429,
                error_type="rate_limit_exceeded",
            )
        self.held += n

    def release(self) -> None:
        if self._admission is not None:
            self._admission.release(self.held)
        self.held = 0


async def read_body(request: Request, config: RouterConfig) -> bytes:
    """A body outside admission (the admin routes): its size and deadline only."""
    return await Body().read(request, config.max_body_bytes, config.body_timeout_s)


def _busy(limit: int) -> Response:
    return error_response(
        429,
        f"the router is serving its limit of {limit} requests; retry later",
        "rate_limit_exceeded",
        code=429,
        headers={"retry-after": str(RETRY_AFTER_S)},
    )


async def completion(router: Router, request: Request, endpoint: str) -> Response:
    """Handle ``POST /v1/{endpoint}``; never raises (errors become JSON bodies).

    Refused at once when every slot is taken; otherwise the body is read without a slot
    (``admission``), then the request takes one, or is refused if none is left.
    """
    admission, metrics = router.admission, router.metrics
    received = router.clock()
    if admission.full:
        return _counted(router, endpoint, _busy(admission.slots), received)
    body = Body(admission)
    try:
        raw = await body.read(request, router.config.max_body_bytes, router.config.body_timeout_s)
    except RequestError as exc:
        body.release()
        return _counted(router, endpoint, _refusal(exc), received)
    except ClientDisconnect:
        body.release()
        return _counted(router, endpoint, _gone(), received)
    except BaseException:  # cancelled (the server shuts down): give the bytes back
        body.release()
        raise
    if not admission.take_slot():
        body.release()
        return _counted(router, endpoint, _busy(admission.slots), received)
    metrics.admitted.set(admission.serving)

    def release() -> None:
        admission.release_slot()
        body.release()
        metrics.admitted.set(admission.serving)

    response: Response | None = None
    try:
        answer = await _answer(router, request, endpoint, raw, received)
        response = _counted(router, endpoint, answer, received)
        return response
    finally:
        if isinstance(response, RelayedStream):  # its slot is held until it ends
            response.on_close.append(release)
        else:
            release()


def _refusal(exc: RequestError) -> Response:
    response = request_error_response(exc)
    if exc.status == 429:
        response.headers["retry-after"] = str(RETRY_AFTER_S)
    return response


def _gone() -> Response:
    return error_response(400, "the client disconnected", "invalid_request_error")


async def _answer(
    router: Router, request: Request, endpoint: str, raw: bytes, received: float
) -> Response:
    try:
        routed = await router.prepare(endpoint, raw, request.headers, received)
        return await _unless_disconnected(request, router.answer(routed))
    except RequestError as exc:
        return request_error_response(exc)
    except NoWorkerAvailable as exc:
        return error_response(503, exc.message, "service_unavailable", code=503)
    except UpstreamError as exc:
        return error_response(502, exc.message, "upstream_error", code=502)
    except ClientDisconnect:
        return _gone()


def _counted(router: Router, endpoint: str, response: Response, received: float) -> Response:
    """``response``, counted by status; its latency observed unless it is a stream (a
    stream observes it when it ends)."""
    router.metrics.requests.labels(endpoint, str(response.status_code)).inc()
    if not isinstance(response, StreamingResponse):
        router.metrics.latency.labels(endpoint).observe(router.clock() - received)
    return response


async def _unless_disconnected(request: Request, answer: Awaitable[Response]) -> Response:
    """``answer``, unless the client hangs up first: then it is cancelled, which closes the
    worker's connection and vLLM aborts the request instead of computing an answer nobody
    will read (the job drops a call that a newer prompt of the same shopper supersedes).
    A stream, once it has started, watches for the hang-up itself (``StreamingResponse``)."""
    work = asyncio.ensure_future(answer)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled: nothing is left running
        gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise ClientDisconnect()
    return work.result()


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def admin_guard(config: RouterConfig, request: Request) -> Response | None:
    """The refusal of an admin request that may not pass, or None when it may: the admin
    routes must be on, reached on the admin port when there is one, with the token when
    there is one."""
    if not config.admin_enabled:
        return error_response(
            403,
            "the admin routes are off; start the router with --admin-token-file (or "
            "$SI_ROUTER_ADMIN_TOKEN) or --admin-port to use them",
            "permission_error",
            code=403,
        )
    if config.admin_port is not None and _local_port(request) != config.admin_port:
        return error_response(
            403,
            f"the admin routes answer on the admin port ({config.admin_port}) only",
            "permission_error",
            code=403,
        )
    token = config.admin_token
    if token is not None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.matches(given.strip()):
            return error_response(
                401,
                "the admin routes need 'Authorization: Bearer <admin token>'",
                "authentication_error",
                code=401,
                headers={"www-authenticate": "Bearer"},
            )
    return None


def _local_port(request: Request) -> int | None:
    server = request.scope.get("server")
    return server[1] if server else None


async def _admin_doc(router: Router, request: Request) -> tuple[dict[str, Any], str]:
    """The admin request's body (a JSON object with a string ``url``) and its role."""
    doc = json_object(await read_body(request, router.config))
    if not isinstance(doc.get("url"), str):
        raise ConfigError("url", "give the worker's URL as a string")
    return doc, str(doc.get("role", "worker"))


async def join(router: Router, request: Request) -> Response:
    """``POST /workers`` with ``{"url": ..., "role": "worker", "kv_events": {"endpoint":
    ..., "replay": ...}}``: 201 when added, 200 when it already was a worker."""
    refused = admin_guard(router.config, request)
    if refused is not None:
        return refused
    try:
        doc, role = await _admin_doc(router, request)
        events = doc.get("kv_events")
        source = EventSource(**events) if isinstance(events, dict) else None
        added = router.add_worker(doc["url"], role, source)
    except RequestError as exc:
        return request_error_response(exc)
    except TypeError as exc:  # kv_events with fields EventSource does not have
        return error_response(400, f"kv_events: {exc}", "invalid_request_error")
    except ConfigError as exc:
        return error_response(400, str(exc), "invalid_request_error", param=exc.key)
    _, health = router.readiness()
    return Response(orjson.dumps(health), status_code=201 if added else 200, media_type=JSON)


async def leave(router: Router, request: Request) -> Response:
    """``DELETE /workers`` with ``{"url": ..., "role": "worker"}``: 200 when removed, 404
    when it is no worker of that pool."""
    refused = admin_guard(router.config, request)
    if refused is not None:
        return refused
    try:
        doc, role = await _admin_doc(router, request)
        removed = router.membership.remove_worker(doc["url"], role)
    except RequestError as exc:
        return request_error_response(exc)
    except ConfigError as exc:
        return error_response(400, str(exc), "invalid_request_error", param=exc.key)
    if not removed:
        return error_response(
            404, f"{redact_url(doc['url'])} is no worker of the {role} pool", "not_found_error"
        )
    _, health = router.readiness()
    return Response(orjson.dumps(health), status_code=200, media_type=JSON)


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(
        exc.status_code, str(exc.detail), "invalid_request_error", code=exc.status_code
    )


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error while handling %s %s", request.method, request.url.path)
    return error_response(
        500, f"internal router error: {type(exc).__name__}", "internal_error", code=500
    )


def build_app(router: Router) -> Starlette:
    """The ASGI app of ``router``; its lifespan starts health checks and closes the pool."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.aclose()

    async def chat(request: Request) -> Response:
        return await completion(router, request, "chat/completions")

    async def completions(request: Request) -> Response:
        return await completion(router, request, "completions")

    async def models(request: Request) -> Response:
        return await router.upstream.models(router.serving_pool)

    async def health(request: Request) -> Response:
        ready, doc = router.readiness()
        return Response(orjson.dumps(doc), status_code=200 if ready else 503, media_type=JSON)

    async def metrics(request: Request) -> Response:
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4")

    async def workers(request: Request) -> Response:
        if request.method == "DELETE":
            return await leave(router, request)
        return await join(router, request)

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/workers", workers, methods=["POST", "DELETE"]),
        ],
        exception_handlers={HTTPException: _http_exception, Exception: _unexpected},
        lifespan=lifespan,
    )
    app.state.router = router
    return app


def create_app(
    config: RouterConfig, *, transport: httpx.AsyncBaseTransport | None = None
) -> Starlette:
    """Build a router and its app in one call (what ``cli router`` serves)."""
    return build_app(Router(config, transport=transport))
