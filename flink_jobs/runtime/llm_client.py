"""Calling an OpenAI-compatible chat endpoint for one shopper's prompt, with retries.

Retry policy: a timeout, a connection failure, HTTP 429 or a 5xx is worth another try
(after an exponential, jittered backoff, or the server's ``Retry-After``); any other
status means the request itself is wrong and retrying would only repeat the error.
Each attempt runs under its own timeout and is cancelled when it expires, so an abandoned
call never keeps a slot on the server.

The shopper id travels as ``X-Session-ID`` (and the body's ``user``): the router keys its
sticky routing on it, so the shopper's growing prompt prefix stays in one worker's cache.

Each request carries its own ``response_format``: the intent schema with ``category`` an
enum of the session's categories (``PromptTask.categories``), so the model cannot name a
category the shopper never engaged with. It is a request parameter, not prompt text: the
messages, and the prefix the worker caches, are the same whatever the enum.

The requests go through httpx's API over aiohttp's HTTP/1.1 engine (``httpx-aiohttp``),
which costs a fraction of httpcore's CPU per call; httpx's API stays, so tests still
script the server with ``httpx.MockTransport`` (``docs/decisions.md#httpx-over-aiohttp``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
import orjson
from httpx_aiohttp import AiohttpTransport

from flink_jobs.config import LlmConfig
from flink_jobs.core.intents import TokenLogprob, intent_response_format
from flink_jobs.core.prompting import RenderedPrompt
from intent_reader.config_errors import redact_url

log = logging.getLogger(__name__)


def quiet_http_logs() -> None:
    """Keep the HTTP clients' loggers to warnings: httpx and httpcore log every request
    (INFO, DEBUG), and in thread mode PEMJA hands every record to Java, whatever level
    Java then filters at (the call process forwards each to the job the same way)."""
    for name in ("httpx", "httpcore", "aiohttp"):
        logging.getLogger(name).setLevel(logging.WARNING)


RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


class LlmError(Exception):
    """The call failed for good; carries what the dead-letter record needs."""

    def __init__(self, reason: str, detail: str, attempts: int, status: int | None = None) -> None:
        super().__init__(f"{reason}: {detail} (after {attempts} attempts)")
        self.reason = reason
        self.detail = detail
        self.attempts = attempts
        self.status = status


class _RetryableError(Exception):
    def __init__(
        self, reason: str, detail: str, status: int | None, retry_after_s: float | None = None
    ):
        super().__init__(detail)
        self.reason, self.detail, self.status, self.retry_after_s = (
            reason,
            detail,
            status,
            retry_after_s,
        )


@dataclass(frozen=True, slots=True)
class Completion:
    """What one chat completion body says."""

    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    model: str = ""
    finish_reason: str = ""
    #: The generated tokens with their log-probabilities, when asked for (llm.label_scores).
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class LlmAnswer:
    completion: Completion
    attempts: int
    latency_s: float

    @property
    def text(self) -> str:
        return self.completion.text


def build_request(
    prompt: RenderedPrompt,
    shopper_id: str,
    config: LlmConfig,
    categories: Sequence[str] = (),
) -> tuple[dict[str, str], bytes]:
    """Headers and body of the chat call; ``categories``: the enum the answer's categories
    must come from (none: any category the schema allows)."""
    headers = {"Content-Type": "application/json", "X-Session-ID": shopper_id}
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    body: dict[str, Any] = {
        "model": prompt.model or config.model,  # the prompt's A/B arm may name its own
        "messages": list(prompt.messages),
        "max_tokens": config.max_tokens,
        "temperature": config.temperature,
        "user": shopper_id,
    }
    if config.guided_json:
        body["response_format"] = intent_response_format(categories or None)
    if config.label_scores:
        body["logprobs"] = True
        body["top_logprobs"] = config.top_logprobs
    return headers, orjson.dumps(body)


def is_retryable_status(status: int) -> bool:
    return status in RETRYABLE_STATUS or status >= 500


def backoff_delay(
    attempt: int, config: LlmConfig, rand: Callable[[], float] = random.random
) -> float:
    """Full-jitter exponential backoff before attempt ``attempt + 1`` (attempt counts from 1)."""
    ceiling = min(config.backoff_max_s, config.backoff_initial_s * 2.0 ** (attempt - 1))
    return ceiling * (0.5 + rand() / 2)


def parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def read_answer(payload: bytes) -> Completion:
    doc = orjson.loads(payload)
    choice = doc["choices"][0]
    message = choice.get("message") or {}
    text = message.get("content") if isinstance(message, dict) else None
    if text is None:
        text = choice.get("text", "")
    usage = doc.get("usage") or {}
    return Completion(
        text or "",
        int(usage.get("prompt_tokens") or 0),
        int(usage.get("completion_tokens") or 0),
        doc.get("model", ""),
        choice.get("finish_reason") or "",
        _token_logprobs(choice.get("logprobs")),
    )


def _token_logprobs(logprobs: Any) -> tuple[TokenLogprob, ...]:
    """The ``logprobs.content`` of a chat choice (none when absent or not as expected: the
    answer then keeps the confidences it wrote)."""
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list):
        return ()
    return tuple(
        TokenLogprob(
            str(t["token"]),
            float(t["logprob"]),
            tuple((str(a["token"]), float(a["logprob"])) for a in t.get("top_logprobs") or ()),
        )
        for t in content
    )


def transport_failure(exc: Exception) -> _RetryableError:
    """Name a failed request by what happened underneath: httpx-aiohttp re-raises every
    aiohttp connection error as ``httpx.ConnectTimeout`` (a refused connection included),
    which would dead-letter an unreachable server as a timeout. Its cause says which."""
    cause = exc.__cause__ if isinstance(exc, httpx.TransportError) else None
    failure = cause if isinstance(cause, aiohttp.ClientError | TimeoutError) else exc
    if isinstance(failure, httpx.TimeoutException | TimeoutError):
        return _RetryableError("timeout", f"request timed out ({type(failure).__name__})", None)
    return _RetryableError("connection_error", f"{type(failure).__name__}: {failure}", None)


def proxy_for(url: httpx.URL, proxy_url: str = "") -> httpx.Proxy | None:
    """The proxy to reach ``url`` through: ``proxy_url`` when set, else the one the
    environment names for its scheme (or ``ALL_PROXY``) unless ``NO_PROXY`` exempts its
    host or the host is this machine's (a proxy elsewhere cannot reach its loopback).
    httpx's own transport looks this up itself; the aiohttp one must be told."""
    if proxy_url:
        return httpx.Proxy(proxy_url)
    proxies = urllib.request.getproxies_environment()
    chosen = proxies.get(url.scheme) or proxies.get("all")
    host = f"{url.host}:{url.port}" if url.port else url.host
    if (
        not chosen
        or _is_loopback(url.host)
        # urllib's NO_PROXY matcher, which typeshed does not list.
        or urllib.request.proxy_bypass_environment(host, proxies)  # type: ignore[attr-defined]
    ):
        return None
    return httpx.Proxy(chosen)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class LlmClient:
    """One per operator instance; created on the outbox's event loop (the aiohttp session
    binds to it on the first request).

    The pool holds as many connections as calls may run at once, not one per queued
    prompt: a pool sized for the queue (hundreds) costs more CPU per call than the call
    itself."""

    def __init__(
        self, config: LlmConfig, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self._config = config
        limits = httpx.Limits(
            max_connections=config.max_concurrency,
            max_keepalive_connections=config.max_concurrency,
        )
        # An absolute URL, parsed once: httpx re-parses and merges a relative one per request.
        self._endpoint = httpx.URL(config.base_url.rstrip("/") + "/chat/completions")
        if transport is None:
            proxy = proxy_for(self._endpoint, config.proxy_url)
            if proxy is not None:
                log.info(
                    "LLM calls to %s go through the proxy %s",
                    self._endpoint.host,
                    redact_url(str(proxy.url)),
                )
            transport = AiohttpTransport(limits=limits, proxy=proxy)
        self._client = httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(config.request_timeout_s, connect=5.0),
        )

    async def complete(
        self,
        prompt: RenderedPrompt,
        shopper_id: str,
        categories: Sequence[str] = (),
        on_attempt: Callable[[], None] | None = None,
    ) -> LlmAnswer:
        """The answer to ``prompt``, retried on transient failures. ``on_attempt`` is called
        as each attempt starts: a caller that cancels the call still knows how many it made."""
        headers, body = build_request(prompt, shopper_id, self._config, categories)
        started = time.monotonic()
        last: _RetryableError | None = None
        for attempt in range(1, self._config.max_attempts + 1):
            if on_attempt is not None:
                on_attempt()
            try:
                completion = await asyncio.wait_for(
                    self._attempt(headers, body), timeout=self._config.request_timeout_s
                )
                return LlmAnswer(completion, attempt, time.monotonic() - started)
            except TimeoutError:
                last = _RetryableError(
                    "timeout", f"no answer within {self._config.request_timeout_s} s", None
                )
            except _RetryableError as exc:
                last = exc
            except LlmError as exc:  # not retryable: report the attempts made so far
                if exc.attempts == attempt:
                    raise
                raise LlmError(exc.reason, exc.detail, attempt, exc.status) from exc
            if attempt < self._config.max_attempts:
                delay = (
                    last.retry_after_s
                    if last.retry_after_s is not None
                    else backoff_delay(attempt, self._config)
                )
                await asyncio.sleep(min(delay, self._config.backoff_max_s))
        assert last is not None
        raise LlmError(last.reason, last.detail, self._config.max_attempts, last.status)

    async def _attempt(self, headers: dict[str, str], body: bytes) -> Completion:
        try:
            response = await self._client.post(self._endpoint, content=body, headers=headers)
        except (httpx.TransportError, aiohttp.ClientError) as exc:
            raise transport_failure(exc) from exc
        if response.status_code != 200:
            detail = self._scrub(f"HTTP {response.status_code}: {response.text[:300]}")
            if is_retryable_status(response.status_code):
                raise _RetryableError(
                    "http_error",
                    detail,
                    response.status_code,
                    parse_retry_after(response.headers.get("retry-after")),
                )
            raise LlmError("http_error", detail, 1, response.status_code)
        try:
            return read_answer(response.content)
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as exc:
            raise _RetryableError(
                "bad_response",
                self._scrub(f"unreadable completion body: {response.text[:200]!r}"),
                200,
            ) from exc

    def _scrub(self, text: str) -> str:
        """Error details quote the server's body, and a gateway may echo the credentials
        it refused: the API key never reaches a dead letter or a log."""
        key = self._config.api_key
        return text.replace(key, "***") if key else text

    async def aclose(self) -> None:
        await self._client.aclose()
