"""The router service: an OpenAI-compatible front for a pool of vLLM workers.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics``, and ``POST /workers`` to add a worker that joined at
runtime (an operator's call, like vllm-router's ``/add_worker``: bind the router to a
private address).

Per completion request, top to bottom:

1. read the body (bounded by ``max_body_bytes``), parse it, check ``model``;
2. extract the routing key (``routing_key``): header, ``user``, prompt hash;
3. aggregated mode: send the client's bytes unchanged to the worker the policy picks;
   disaggregated mode: a one-token prefill on the key's prefill worker, then the decode
   on the key's decode worker with the prefill's ``kv_transfer_params`` (``pd``);
4. a worker that fails before any byte reached the client (connection error, timeout,
   5xx, a body that is not JSON) is recorded against it and the request goes to the
   key's next worker, up to ``max_attempts`` workers; nothing else (a header no worker
   can be sent, the client leaving, a fault of the router) is charged to a worker;
5. streamed answers are passed through chunk by chunk; the first chunk is read before
   the response starts, so a worker that fails before producing anything is retried too.

Routing decisions, in-flight counts and health live in ``RoutingState`` objects, which
are synchronous: the asyncio code here only moves bytes and feeds them outcomes.
Errors are OpenAI-style JSON bodies; no path waits without a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from inference_sidecar import pd
from inference_sidecar.config import RouterConfig, normalise_url, redact_url
from inference_sidecar.exceptions import (
    ConfigError,
    NoWorkerAvailable,
    RequestError,
    UpstreamError,
)
from inference_sidecar.health import HealthEvent
from inference_sidecar.kv_blocks import BlockHashing, hashing_from_metrics
from inference_sidecar.kv_events import EventSource, KVEventSubscriber
from inference_sidecar.kv_index import EventBatch, KVIndex
from inference_sidecar.metrics import RouterMetrics
from inference_sidecar.policies import KVPrefixPolicy, make_policy
from inference_sidecar.prompt_tokens import PromptTokenizer
from inference_sidecar.routing_key import (
    RoutingKey,
    estimate_prompt_tokens,
    extract_routing_key,
)
from inference_sidecar.routing_state import RoutingState, Ticket

logger = logging.getLogger(__name__)

JSON = "application/json"
WORKER_HEADER = "x-sidecar-worker"
PREFILL_WORKER_HEADER = "x-sidecar-prefill-worker"
#: Client headers worth passing to a worker; hop-by-hop and length headers are not.
FORWARDED_HEADERS = ("authorization", "x-request-id", "accept")
#: A header value as HTTP/1.1 can carry it: visible ASCII, spaces and tabs.
_SENDABLE_HEADER_VALUE = re.compile(r"[\t\x20-\x7e]*")
#: Seconds a client refused by the admission limit is asked to wait (``Retry-After``).
RETRY_AFTER_S = 1
#: Bytes of an upstream error body kept when a 5xx is retried (for the error message).
_ERROR_SNIPPET = 300
#: Seconds between attempts to read the workers' block size and hash algorithm.
KV_CONFIG_RETRY_S = 1.0


def error_body(
    message: str, error_type: str, *, param: str | None = None, code: str | int | None = None
) -> bytes:
    """An OpenAI-style error document."""
    return orjson.dumps(
        {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    )


def error_response(
    status: int,
    message: str,
    error_type: str,
    *,
    param: str | None = None,
    code: str | int | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    return Response(
        error_body(message, error_type, param=param, code=code),
        status_code=status,
        media_type=JSON,
        headers=headers,
    )


@dataclass(frozen=True, slots=True)
class Reply:
    """A complete, non-streamed upstream answer and who produced it."""

    status: int
    body: bytes
    content_type: str
    worker: str


@dataclass(frozen=True, slots=True)
class RoutedRequest:
    """One client completion request, parsed once, as every routing step needs it."""

    endpoint: str
    """``chat/completions`` or ``completions``: the path under ``/v1`` and a metrics label."""
    raw: bytes
    """The client's bytes, sent unchanged in aggregated mode."""
    body: dict[str, Any]
    key: RoutingKey
    headers: Mapping[str, str]
    """What is forwarded to the worker (``Router._headers``)."""
    received: float
    """Router clock when the request arrived (time to first token and latency)."""

    @property
    def path(self) -> str:
        return f"/v1/{self.endpoint}"

    @property
    def streaming(self) -> bool:
        return self.body.get("stream") is True


@dataclass(slots=True, eq=False)
class _Attempt:
    """One worker trying one request: what its end reports to the routing state."""

    pool: RoutingState
    worker: str
    started: float
    deadline: float
    """Event-loop time by which the attempt must be over, its stream included."""
    ticket: Ticket
    blocks: int = 0
    """Full KV blocks of the prompt (kv_prefix): a success must make the worker publish."""
    ok: bool | None = False
    """The outcome to record: ``None`` when the worker is not to blame (``finish``)."""
    handed_over: bool = False
    """A stream's relay ends the attempt, when the stream ends."""


_T = TypeVar("_T")


class _RelayedStream(StreamingResponse):
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


class _AttemptFailed(Exception):
    """One worker failed in a way that allows trying another one."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


_WORKER_FAILURES = (_AttemptFailed, httpx.HTTPError, TimeoutError)


def _describe_failure(exc: BaseException) -> tuple[str, str]:
    """(kind for the health tracker, text for the error message) of a failed attempt."""
    if isinstance(exc, _AttemptFailed):
        return exc.kind, str(exc)
    if isinstance(exc, httpx.TimeoutException | TimeoutError):
        return "timeout", f"timeout: {type(exc).__name__}"
    return "transport", f"transport: {type(exc).__name__}: {exc}"


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be a JSON object; raises ``RequestError`` with the reason."""
    if not raw.strip():
        raise RequestError("the request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def parse_body(raw: bytes) -> dict[str, Any]:
    """Parse and check a completion request body; raises ``RequestError`` with the reason."""
    body = json_object(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise RequestError("you must provide a model parameter (a non-empty string)", param="model")
    return body


class Router:
    """State and behaviour of one router; ``build_app`` wraps it in an ASGI app.

    ``transport`` replaces the network in tests (``httpx.MockTransport`` or an
    ``httpx.ASGITransport`` around a fake worker); ``clock`` replaces ``time.monotonic``.
    With the kv_prefix policy, ``tokenizer`` and ``kv_hashing`` replace the model folder's
    tokenizer and the block size and algorithm read from the workers' ``/metrics``.
    """

    def __init__(
        self,
        config: RouterConfig,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
        tokenizer: PromptTokenizer | None = None,
        kv_hashing: BlockHashing | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.metrics = RouterMetrics()
        self.policy_name = config.policy
        self.kv_index: KVIndex | None = None
        self.tokenizer: PromptTokenizer | None = None
        self._kv_subscriber: KVEventSubscriber | None = None
        if config.policy == KVPrefixPolicy.name:
            workers = [redact_url(u) for u in (*config.workers, *config.prefill, *config.decode)]
            self.kv_index = KVIndex(
                workers, hashing=kv_hashing, stale_after_s=config.kv_stale_after_s, clock=clock
            )
            assert config.tokenizer_dir is not None  # RouterConfig checks it
            self.tokenizer = tokenizer or PromptTokenizer.from_model_dir(config.tokenizer_dir)
            self._kv_subscriber = KVEventSubscriber(
                {redact_url(u): s for u, s in config.kv_events.items()},
                self._kv_delivered,
                self._kv_error,
            )
        roles = (
            {"worker": config.workers}
            if config.mode == "aggregated"
            else {"prefill": config.prefill, "decode": config.decode}
        )
        # Workers are known by their URLs without credentials, which are what logs, errors,
        # /health and metric labels show; _urls gives the URL to send to.
        self._urls = {redact_url(u): u for urls in roles.values() for u in urls}
        self.pools: dict[str, RoutingState] = {
            role: RoutingState(
                role,
                [redact_url(u) for u in urls],
                make_policy(
                    config.policy,
                    load_factor=config.load_factor,
                    min_bound=config.min_load_bound,
                    residency_factor=config.residency_factor,
                    recompute_weight=config.recompute_weight,
                    request_cost=config.request_cost,
                    new_key_placement=config.new_key_placement,
                    kv_index=self.kv_index,
                ),
                config.health,
                on_event=self._on_health_event,
            )
            for role, urls in roles.items()
        }
        for pool in self.pools.values():
            for worker in pool.workers:
                self._show_member(pool, worker)
        self._probed_ok: set[str] = set()
        self._admitted = 0
        self._client = httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(
                max_connections=config.max_connections,
                max_keepalive_connections=config.max_connections,
            ),
        )
        self._health_task: asyncio.Task[None] | None = None
        self._kv_config_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        if self.kv_index is not None:
            self.metrics.watch_kv_index(self.kv_index, self._kv_fallbacks)

    # ----- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Start active health checks (if enabled) and, for kv_prefix, the KV event
        subscriber and the reading of the workers' cache configuration."""
        if self.config.health_interval_s > 0 and self._health_task is None:
            self._health_task = asyncio.create_task(self._health_loop(), name="health-checks")
        if self.kv_index is not None and self._kv_subscriber is not None:
            self._loop = asyncio.get_running_loop()
            self._kv_subscriber.start()
            if self.kv_index.hashing is None and self._kv_config_task is None:
                self._kv_config_task = asyncio.create_task(
                    self._learn_kv_hashing(), name="kv-cache-config"
                )

    async def aclose(self) -> None:
        for task in (self._health_task, self._kv_config_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._health_task = self._kv_config_task = None
        if self._kv_subscriber is not None:
            await asyncio.to_thread(self._kv_subscriber.stop)
        await self._client.aclose()

    # ----- KV events (kv_prefix) -------------------------------------------------------

    async def _learn_kv_hashing(self) -> None:
        """Read the block size and hash algorithm from the first worker whose
        ``/metrics`` says them; until then requests are routed by hashing."""
        assert self.kv_index is not None
        reported: set[tuple[str, str]] = set()
        while self.kv_index.hashing is None:
            for pool in self.pools.values():
                for worker in pool.workers:
                    try:
                        reply = await self._client.get(
                            f"{self._urls[worker]}/metrics", timeout=self.config.health_timeout_s
                        )
                        hashing = hashing_from_metrics(reply.text)
                    except httpx.HTTPError:
                        continue
                    except ValueError as exc:
                        if (worker, str(exc)) not in reported:
                            reported.add((worker, str(exc)))
                            logger.warning("%s: no KV-aware routing yet: %s", worker, exc)
                        continue
                    self.kv_index.hashing = hashing
                    logger.info("KV blocks of %s: %s", worker, hashing)
                    return
            await asyncio.sleep(KV_CONFIG_RETRY_S)

    def _kv_delivered(self, worker: str, items: list[tuple[EventBatch, bool]]) -> None:
        """Called in the subscriber's thread: apply on the event loop's."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.apply_kv_events, worker, items)

    def apply_kv_events(self, worker: str, items: list[tuple[EventBatch, bool]]) -> None:
        """Apply a worker's batches, in order, to the index (on the event loop)."""
        assert self.kv_index is not None
        for batch, replayed in items:
            outcome = self.kv_index.apply(worker, batch, replayed=replayed)
            if outcome in ("gap", "restart"):
                logger.info("KV index of %s cleared: %s at batch %d", worker, outcome, batch.seq)

    def _kv_error(self, worker: str, kind: str) -> None:
        self.metrics.worker_errors.labels("kv_events", worker, kind).inc()

    def _kv_fallbacks(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for pool in self.pools.values():
            if isinstance(pool.policy, KVPrefixPolicy):
                for worker, n in pool.policy.fallbacks.items():
                    total[worker] = total.get(worker, 0) + n
        return total

    def _with_blocks(self, request: RoutingKey, endpoint: str, body: dict[str, Any]) -> RoutingKey:
        """``request``'s key with the prompt's exact size and block hashes (kv_prefix)."""
        if self.kv_index is None or self.tokenizer is None:
            return request
        hashing = self.kv_index.hashing
        if hashing is None:
            self.metrics.kv_unhashed.labels("no_hashing").inc()
            return request
        tokens = self.tokenizer.token_ids(endpoint, body)
        if tokens is None:
            self.metrics.kv_unhashed.labels("unreproducible").inc()
            return request
        return dataclasses.replace(request, size=len(tokens), blocks=hashing.block_hashes(tokens))

    # ----- membership ------------------------------------------------------------------

    def add_worker(
        self, url: str, role: str = "worker", kv_events: EventSource | None = None
    ) -> bool:
        """Admit a worker that joined at runtime to the ``role`` pool; False if it is
        already one. With kv_prefix its KV event stream is required: the index learns its
        (empty) cache from the first batch, and until then its cached prefixes count as
        none, so it draws the keys no worker has cached. Raises ``ConfigError``."""
        url = normalise_url(url, "url")
        pool = self.pools.get(role)
        if pool is None:
            raise ConfigError("role", f"this router's pools are {sorted(self.pools)}, not {role!r}")
        if kv_events is None and self.kv_index is not None:
            raise ConfigError("kv_events", "kv_prefix needs the new worker's KV event stream")
        worker = redact_url(url)
        if worker in self._urls and self._urls[worker] != url:
            raise ConfigError("url", f"{worker} is already a worker with other credentials")
        if not pool.add_worker(worker):
            return False
        self._urls[worker] = url
        self._show_member(pool, worker)
        if self.kv_index is not None and self._kv_subscriber is not None:
            assert kv_events is not None
            self.kv_index.add_worker(worker)
            self._kv_subscriber.add(worker, kv_events)
        logger.info("worker %s joined the %s pool", worker, pool.name)
        return True

    def _show_member(self, pool: RoutingState, worker: str) -> None:
        """A new member's metric series: in service, nothing in flight."""
        self.metrics.in_service.labels(pool.name, worker).set(1)
        self.metrics.in_flight.labels(pool.name, worker).set(0)

    async def join(self, request: Request) -> Response:
        """``POST /workers`` with ``{"url": ..., "role": "worker", "kv_events": {"endpoint":
        ..., "replay": ...}}``: 201 when added, 200 when it already was a worker."""
        try:
            doc = json_object(await self._read_body(request))
            if not isinstance(doc.get("url"), str):
                raise ConfigError("url", "give the worker's URL as a string")
            events = doc.get("kv_events")
            source = EventSource(**events) if isinstance(events, dict) else None
            added = self.add_worker(doc["url"], str(doc.get("role", "worker")), source)
        except RequestError as exc:
            return error_response(exc.status, exc.message, exc.error_type, code=exc.code)
        except TypeError as exc:  # kv_events with fields EventSource does not have
            return error_response(400, f"kv_events: {exc}", "invalid_request_error")
        except ConfigError as exc:
            return error_response(400, str(exc), "invalid_request_error", param=exc.key)
        _, health = self.readiness()
        return Response(orjson.dumps(health), status_code=201 if added else 200, media_type=JSON)

    @property
    def serving_pool(self) -> RoutingState:
        """The pool that produces answers (decode in disaggregated mode)."""
        return self.pools.get("worker") or self.pools["decode"]

    # ----- health ----------------------------------------------------------------------

    async def probe_all(self) -> None:
        """Probe every worker's ``/health`` once, concurrently, and feed the results."""
        targets = [(pool, w) for pool in self.pools.values() for w in pool.workers]
        results = await asyncio.gather(*(self._probe(w) for _, w in targets))
        now = self.clock()
        for (pool, worker), ok in zip(targets, results, strict=True):
            if ok:
                self._probed_ok.add(worker)
            pool.probed(worker, ok, now)

    async def _probe(self, worker: str) -> bool:
        try:
            reply = await self._client.get(
                f"{self._urls[worker]}/health", timeout=self.config.health_timeout_s
            )
        except httpx.HTTPError:
            return False
        return reply.status_code == 200

    async def _health_loop(self) -> None:
        while True:
            try:
                await self.probe_all()
            except Exception:  # never let a bug stop health checking for good
                logger.exception("health check round failed")
            await asyncio.sleep(self.config.health_interval_s)

    def _on_health_event(self, pool: str, event: HealthEvent) -> None:
        level = logging.WARNING if event.kind in ("ejected", "down") else logging.INFO
        logger.log(
            level,
            "worker %s (%s pool) %s: %s%s",
            event.worker,
            pool,
            event.kind,
            event.reason,
            f" ({event.detail})" if event.detail else "",
        )
        self.metrics.health_events.labels(pool, event.worker, event.kind, event.reason).inc()
        if event.kind == "down" and self.kv_index is not None:
            self.kv_index.reset(event.worker, "down")  # it may come back with an empty cache
        if event.kind == "ejected":
            self.metrics.ejections.labels(pool, event.worker, event.reason).inc()
        self.metrics.in_service.labels(pool, event.worker).set(
            int(self.pools[pool].is_in_service(event.worker))
        )

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready when every pool has a worker in service that answered a probe
        (or, with active checks off, simply a worker in service)."""
        checks_on = self.config.health_interval_s > 0
        ready = all(
            any(
                pool.is_in_service(w) and (not checks_on or w in self._probed_ok)
                for w in pool.workers
            )
            for pool in self.pools.values()
        )
        doc = {
            "status": "ok" if ready else "unavailable",
            "mode": self.config.mode,
            "policy": self.policy_name,
            "pools": {name: pool.status() for name, pool in self.pools.items()},
        }
        if self.kv_index is not None:
            hashing = self.kv_index.hashing
            doc["kv_blocks"] = (
                {"block_size": hashing.block_size, "hash_algo": hashing.algo}
                if hashing is not None
                else None  # not read from the workers yet: requests are routed by hashing
            )
        return ready, doc

    # ----- upstream calls ----------------------------------------------------------------

    def _headers(self, request_headers: Mapping[str, str]) -> dict[str, str]:
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

    def _begin(self, pool: RoutingState, worker: str, key: RoutingKey) -> _Attempt:
        """Account for a request sent to ``worker``."""
        ticket = pool.start(worker, key.value, key.size, key.blocks)
        self.metrics.worker_requests.labels(pool.name, worker).inc()
        self.metrics.in_flight.labels(pool.name, worker).set(pool.in_flight[worker])
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout_s
        return _Attempt(pool, worker, self.clock(), deadline, ticket, len(key.blocks))

    def _end(self, attempt: _Attempt) -> None:
        pool, worker = attempt.pool, attempt.worker
        if self.config.health_interval_s <= 0:
            pool.expire(self.clock())
        pool.finish(
            worker, attempt.ok, self.clock() - attempt.started, self.clock(), attempt.ticket
        )
        if attempt.ok is True and attempt.blocks and self.kv_index is not None:
            self.kv_index.expect_events(worker, since=attempt.started)
        self.metrics.in_flight.labels(pool.name, worker).set(pool.in_flight[worker])

    def _fail(self, pool: RoutingState, worker: str, kind: str) -> None:
        self.metrics.worker_errors.labels(pool.name, worker, kind).inc()

    def _choose(self, pool: RoutingState, key: RoutingKey, tried: list[str]) -> str | None:
        choice = pool.choose(key.value, exclude=tried, size=key.size, blocks=key.blocks)
        if choice is None:
            return None
        decision = "failed_over" if tried else choice.decision
        self.metrics.decisions.labels(self.policy_name, pool.name, decision).inc()
        logger.debug(
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
        attempt_once: Callable[[_Attempt], Awaitable[_T]],
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
            except _WORKER_FAILURES as exc:
                attempt.ok = False
                kind, text = _describe_failure(exc)
                failures.append((worker, text))
                self._fail(pool, worker, kind)
            except BaseException:
                # The client went away (cancellation) or the router failed: the worker
                # is not to blame, so outlier detection hears nothing of it.
                attempt.ok = None
                raise
            finally:
                if not attempt.handed_over:
                    self._end(attempt)
            logger.info("worker %s failed (%s); trying another", worker, failures[-1][1])
        raise self._exhausted(pool, failures)

    async def exchange(self, pool: RoutingState, request: RoutedRequest, content: bytes) -> Reply:
        """POST ``content`` and read the whole answer, retrying other workers on failure.

        A 2xx answer must be JSON (else the worker is faulty); a 4xx is the client's
        problem and is returned as is, without retry and without blaming the worker.
        """

        async def post(attempt: _Attempt) -> Reply:
            # A total deadline: httpx's read timeout is per read, so a worker that
            # trickles bytes could otherwise hold the request forever.
            async with asyncio.timeout_at(attempt.deadline):
                reply = await self._client.post(
                    f"{self._urls[attempt.worker]}{request.path}",
                    content=content,
                    headers=request.headers,
                )
            if reply.status_code >= 500:
                raise _AttemptFailed(
                    "status_5xx", f"HTTP {reply.status_code}: {reply.text[:_ERROR_SNIPPET]}"
                )
            if reply.status_code < 300:
                try:
                    orjson.loads(reply.content)
                except orjson.JSONDecodeError as exc:
                    raise _AttemptFailed(
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
        pass the rest through. A failure after that ends the stream with an SSE error
        event (the client has bytes already; a retry would duplicate them)."""

        async def open_stream(attempt: _Attempt) -> Response:
            req = self._client.build_request(
                "POST",
                f"{self._urls[attempt.worker]}{request.path}",
                content=content,
                headers=request.headers,
            )
            upstream: httpx.Response | None = None
            try:
                async with asyncio.timeout_at(attempt.deadline):
                    upstream = await self._client.send(req, stream=True)
                    if upstream.status_code >= 500:
                        body = await upstream.aread()
                        raise _AttemptFailed(
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
                    raise _AttemptFailed("invalid_response", "the stream ended before any data")
                pool.prefilled(attempt.worker, attempt.ticket)
                self.metrics.ttft.labels(request.endpoint).observe(self.clock() - request.received)
                attempt.handed_over = True
                attempt.ok = None  # until the relay starts: a client gone first is no fault
                return _RelayedStream(
                    self._relay(attempt, first, chunks),
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

    async def _relay(
        self, attempt: _Attempt, first: bytes, chunks: AsyncIterator[bytes]
    ) -> AsyncGenerator[bytes, None]:
        """The worker's chunks, until its stream ends, breaks or passes the attempt's
        deadline; the last two end the client's stream with an SSE error event."""
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
                message = f"the worker did not finish within {self.config.request_timeout_s} s"
            else:
                kind, status = "stream_broken", 502
                message = f"the worker failed mid-stream: {type(exc).__name__}"
            self._fail(attempt.pool, attempt.worker, kind)
            logger.warning("stream from %s failed after the first chunk: %s", attempt.worker, kind)
            yield b"data: " + error_body(message, "upstream_error", code=status) + b"\n\n"
        except BaseException:
            attempt.ok = None  # client disconnected (cancellation) or generator closed early
            raise

    def _stream_ended(self, attempt: _Attempt, request: RoutedRequest) -> None:
        self._end(attempt)
        self.metrics.latency.labels(request.endpoint).observe(self.clock() - request.received)

    def _exhausted(self, pool: RoutingState, attempts: list[tuple[str, str]]) -> UpstreamError:
        if not attempts:
            return NoWorkerAvailable(f"no worker available in the {pool.name} pool")
        detail = "; ".join(f"{w}: {reason}" for w, reason in attempts)
        return UpstreamError(
            f"all {len(attempts)} worker(s) tried in the {pool.name} pool failed: {detail}",
            tuple(attempts),
        )

    # ----- request handling --------------------------------------------------------------

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RequestError(
                f"the request body ({declared} bytes) exceeds the limit of {limit} bytes",
                status=413,
                code="request_too_large",
            )
        parts: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(
                    f"the request body exceeds the limit of {limit} bytes",
                    status=413,
                    code="request_too_large",
                )
            parts.append(chunk)
        return b"".join(parts)

    async def completion(self, request: Request, endpoint: str) -> Response:
        """Handle ``POST /v1/{endpoint}`` if under the admission limit, else refuse it
        before reading its body; never raises (errors become JSON bodies)."""
        limit = self.config.max_concurrent_requests
        if self._admitted >= limit:
            self.metrics.requests.labels(endpoint, "429").inc()
            return error_response(
                429,
                f"the router is serving its limit of {limit} requests; retry later",
                "rate_limit_exceeded",
                code=429,
                headers={"retry-after": str(RETRY_AFTER_S)},
            )
        self._admitted += 1
        self.metrics.admitted.set(self._admitted)
        response: Response | None = None
        try:
            response = await self._complete(request, endpoint)
            return response
        finally:
            if isinstance(response, _RelayedStream):  # its slot is held until it ends
                response.on_close.append(self._release)
            else:
                self._release()

    def _release(self) -> None:
        self._admitted -= 1
        self.metrics.admitted.set(self._admitted)

    async def _complete(self, request: Request, endpoint: str) -> Response:
        received = self.clock()
        try:
            raw = await self._read_body(request)
            body = parse_body(raw)
            key = extract_routing_key(request.headers, body, self.config.key_headers)
            key = dataclasses.replace(key, size=estimate_prompt_tokens(body))
            routed = RoutedRequest(
                endpoint=endpoint,
                raw=raw,
                body=body,
                key=self._with_blocks(key, endpoint, body),
                headers=self._headers(request.headers),
                received=received,
            )
            if self.config.mode == "aggregated":
                answer = self._aggregated(routed)
            else:
                answer = self._disaggregated(routed)
            response = await _unless_disconnected(request, answer)
        except RequestError as exc:
            response = error_response(
                exc.status, exc.message, exc.error_type, param=exc.param, code=exc.code
            )
        except NoWorkerAvailable as exc:
            response = error_response(503, exc.message, "service_unavailable", code=503)
        except UpstreamError as exc:
            response = error_response(502, exc.message, "upstream_error", code=502)
        except ClientDisconnect:
            response = error_response(400, "the client disconnected", "invalid_request_error")
        self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        if not isinstance(response, StreamingResponse):  # streams observe it when they end
            self.metrics.latency.labels(endpoint).observe(self.clock() - received)
        return response

    async def _aggregated(self, request: RoutedRequest) -> Response:
        """The client's bytes, unchanged, to the key's worker."""
        return await self._serve(self.pools["worker"], request, request.raw, {})

    async def _disaggregated(self, request: RoutedRequest) -> Response:
        """Prefill on the key's prefill worker, decode on its decode worker.

        Degrades instead of failing: with no prefill worker answering, the decode
        worker computes the prompt itself; with no decode worker answering, a prefill
        worker runs the whole request. Each fallback is counted as ``pd_fallback``.
        """
        prefill_pool, decode_pool = self.pools["prefill"], self.pools["decode"]
        body = request.body
        extra: dict[str, str] = {}
        try:
            prefill = await self.exchange(
                prefill_pool, request, orjson.dumps(pd.prefill_body(body))
            )
        except UpstreamError as exc:
            logger.warning("prefill failed (%s); the decode worker computes the prompt", exc)
            self.metrics.decisions.labels(self.policy_name, "prefill", "pd_fallback").inc()
            decode_content = orjson.dumps(pd.decode_body(body, None))
        else:
            if prefill.status >= 300:
                return Response(
                    prefill.body, status_code=prefill.status, media_type=prefill.content_type
                )
            decode_content = orjson.dumps(pd.decode_body(body, orjson.loads(prefill.body)))
            extra[PREFILL_WORKER_HEADER] = prefill.worker
        try:
            return await self._serve(decode_pool, request, decode_content, extra)
        except UpstreamError as exc:
            if not extra:  # the prefill pool failed already: nothing left to try
                raise
            logger.warning("decode failed (%s); a prefill worker runs the whole request", exc)
            self.metrics.decisions.labels(self.policy_name, "decode", "pd_fallback").inc()
            whole = orjson.dumps(pd.decode_body(body, None))
            return await self._serve(prefill_pool, request, whole, {})

    async def _serve(
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

    async def models(self, request: Request) -> Response:
        """Proxy ``GET /v1/models`` to the first serving worker that answers."""
        pool = self.serving_pool
        attempts: list[tuple[str, str]] = []
        timeout_s = self.config.request_timeout_s
        for worker in pool.candidates()[: self.config.max_attempts]:
            try:
                async with asyncio.timeout(timeout_s):
                    reply = await self._client.get(f"{self._urls[worker]}/v1/models")
                if reply.status_code < 500:
                    orjson.loads(reply.content)
                    return Response(reply.content, reply.status_code, media_type=JSON)
                attempts.append((worker, f"HTTP {reply.status_code}"))
            except TimeoutError:
                attempts.append((worker, f"no answer within {timeout_s} s"))
            except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
                attempts.append((worker, f"{type(exc).__name__}: {exc}"))
        error = self._exhausted(pool, attempts)
        status = 503 if isinstance(error, NoWorkerAvailable) else 502
        return error_response(status, error.message, "upstream_error", code=status)

    async def health(self, request: Request) -> Response:
        ready, doc = self.readiness()
        return Response(orjson.dumps(doc), status_code=200 if ready else 503, media_type=JSON)

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")


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


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(
        exc.status_code, str(exc.detail), "invalid_request_error", code=exc.status_code
    )


async def _unexpected(request: Request, exc: Exception) -> Response:
    logger.exception("unexpected error while handling %s %s", request.method, request.url.path)
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
        return await router.completion(request, "chat/completions")

    async def completions(request: Request) -> Response:
        return await router.completion(request, "completions")

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", router.models, methods=["GET"]),
            Route("/health", router.health, methods=["GET"]),
            Route("/metrics", router.metrics_endpoint, methods=["GET"]),
            Route("/workers", router.join, methods=["POST"]),
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
