"""The LLM client over httpx's transport seam: what it sends, and how it retries. Timeouts,
connection errors, 429, 5xx and unreadable bodies are retried with backoff (or after the
server's Retry-After); any other status fails at once. Failure for good is an ``LlmError``
carrying the reason, the status and how many attempts were made. The job's own transport
(aiohttp's, under httpx's API) is checked against a loopback server for the same reasons
in ``tests/service/test_llm_client_network.py``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest

from flink_jobs.config import LlmConfig
from flink_jobs.core.intents import intent_response_format
from flink_jobs.runtime.llm_client import (
    Completion,
    LlmAnswer,
    LlmClient,
    LlmError,
    backoff_delay,
    is_retryable_status,
    parse_retry_after,
    proxy_for,
    read_answer,
)
from tests.support.llm_call import (
    CLIENT_CONFIG,
    INTENT_TEXT,
    PROMPT,
    SHOPPER,
    llm_completion,
    recorded_backoff_sleeps,
)


@dataclass
class Server:
    """A scripted endpoint: each request gets the next reply (a response, an exception to
    raise, or a callable that builds one); the requests are kept."""

    replies: list[Any]
    requests: list[httpx.Request] = field(default_factory=list)

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        reply = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        if isinstance(reply, BaseException):
            raise reply
        if callable(reply):
            reply = await reply(request)
        return reply


def call(server: Server, config: LlmConfig = CLIENT_CONFIG) -> LlmAnswer:
    async def run() -> LlmAnswer:
        client = LlmClient(config, transport=httpx.MockTransport(server))
        try:
            return await client.complete(PROMPT, SHOPPER)
        finally:
            await client.aclose()

    return asyncio.run(run())


def failure(server: Server, config: LlmConfig = CLIENT_CONFIG) -> LlmError:
    with pytest.raises(LlmError) as caught:
        call(server, config)
    return caught.value


@pytest.fixture(autouse=True)
def backoff_sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Backoff sleeps are recorded instead of slept, so retry tests take no time."""
    return recorded_backoff_sleeps(monkeypatch)


class TestRequest:
    def test_posts_to_chat_completions_under_the_base_url(self) -> None:
        server = Server([llm_completion()])

        call(server)

        [request] = server.requests
        assert request.method == "POST"
        assert str(request.url) == "http://llm.test/v1/chat/completions"

    def test_body_carries_model_messages_and_sampling(self) -> None:
        server = Server([llm_completion()])

        call(server)

        body = orjson.loads(server.requests[0].content)
        assert body["model"] == "SmolLM2-135M-Instruct"
        assert body["messages"] == list(PROMPT.messages)
        assert body["max_tokens"] == CLIENT_CONFIG.max_tokens
        assert body["temperature"] == CLIENT_CONFIG.temperature

    def test_body_asks_for_guided_json(self) -> None:
        server = Server([llm_completion()])

        call(server)

        assert orjson.loads(server.requests[0].content)["response_format"] == (
            intent_response_format()
        )

    def test_guided_json_can_be_turned_off(self) -> None:
        server = Server([llm_completion()])

        call(server, LlmConfig(base_url=CLIENT_CONFIG.base_url, guided_json=False))

        assert "response_format" not in orjson.loads(server.requests[0].content)

    def test_shopper_id_travels_as_session_header_and_user(self) -> None:
        server = Server([llm_completion()])

        call(server)

        request = server.requests[0]
        assert request.headers["X-Session-ID"] == SHOPPER
        assert orjson.loads(request.content)["user"] == SHOPPER
        assert request.headers["Content-Type"] == "application/json"

    def test_api_key_is_sent_as_bearer_token_only_when_set(self) -> None:
        with_key, without_key = Server([llm_completion()]), Server([llm_completion()])

        call(with_key, LlmConfig(base_url=CLIENT_CONFIG.base_url, api_key="sk-test"))
        call(without_key)

        assert with_key.requests[0].headers["Authorization"] == "Bearer sk-test"
        assert "Authorization" not in without_key.requests[0].headers


class TestAnswer:
    def test_returns_text_usage_and_model(self) -> None:
        answer = call(Server([llm_completion()]))

        assert answer.text == INTENT_TEXT
        assert (answer.completion.prompt_tokens, answer.completion.completion_tokens) == (40, 21)
        assert answer.completion.model == "SmolLM2-135M-Instruct"
        assert answer.attempts == 1
        assert answer.latency_s >= 0

    def test_read_answer_accepts_completion_style_text(self) -> None:
        payload = orjson.dumps({"choices": [{"text": INTENT_TEXT}]})

        assert read_answer(payload) == Completion(INTENT_TEXT)

    def test_read_answer_treats_null_content_as_empty(self) -> None:
        payload = orjson.dumps({"choices": [{"message": {"content": None}}], "usage": None})

        assert read_answer(payload) == Completion("")


class TestProxy:
    """The calls honour the proxy a user names, in ``llm.proxy_url`` or the environment."""

    def test_without_proxy_variables_the_endpoint_is_reached_directly(
        self, proxy_env: pytest.MonkeyPatch
    ) -> None:
        assert proxy_for(httpx.URL("http://router.internal:8000/v1")) is None

    def test_the_proxy_named_for_the_scheme_is_used(self, proxy_env: pytest.MonkeyPatch) -> None:
        proxy_env.setenv("HTTP_PROXY", "http://proxy.corp:3128")
        proxy_env.setenv("HTTPS_PROXY", "http://tls-proxy.corp:3128")

        proxy = proxy_for(httpx.URL("https://llm.example.com/v1"))

        assert proxy is not None and proxy.url == httpx.URL("http://tls-proxy.corp:3128")

    def test_no_proxy_exempts_its_hosts(self, proxy_env: pytest.MonkeyPatch) -> None:
        proxy_env.setenv("HTTP_PROXY", "http://proxy.corp:3128")
        proxy_env.setenv("NO_PROXY", ".internal,10.0.0.0")

        assert proxy_for(httpx.URL("http://router.internal:8000/v1")) is None

    def test_loopback_endpoints_never_go_through_an_environment_proxy(
        self, proxy_env: pytest.MonkeyPatch
    ) -> None:
        proxy_env.setenv("ALL_PROXY", "http://proxy.corp:3128")

        assert [
            proxy_for(httpx.URL(url))
            for url in ("http://127.0.0.1:8000/v1", "http://[::1]:8000/v1", "http://localhost/v1")
        ] == [None, None, None]

    def test_the_configured_proxy_wins_and_keeps_its_credentials_apart(
        self, proxy_env: pytest.MonkeyPatch
    ) -> None:
        proxy_env.setenv("HTTP_PROXY", "http://other.corp:3128")

        proxy = proxy_for(httpx.URL("http://router:8000/v1"), "http://svc:hunter2@proxy.corp:3128")

        assert proxy is not None
        assert (proxy.url, proxy.auth) == (httpx.URL("http://proxy.corp:3128"), ("svc", "hunter2"))


class TestRetries:
    @pytest.mark.parametrize("status", [429, 500, 502, 503, 504])
    def test_retryable_status_is_retried(self, status: int, backoff_sleeps: list[float]) -> None:
        server = Server([httpx.Response(status, text="busy"), llm_completion()])

        answer = call(server)

        assert answer.attempts == 2
        assert len(server.requests) == 2
        assert len(backoff_sleeps) == 1

    @pytest.mark.parametrize(
        "error",
        [
            httpx.ConnectError("connection refused"),
            httpx.RemoteProtocolError("server disconnected"),
            httpx.ReadTimeout("read timed out"),
            httpx.ConnectTimeout("connect timed out"),
        ],
        ids=type,
    )
    def test_transport_errors_are_retried(self, error: Exception) -> None:
        assert call(Server([error, llm_completion()])).attempts == 2

    def test_timed_out_attempt_is_cancelled_and_retried(self) -> None:
        cancelled = []

        async def hang(request: httpx.Request) -> httpx.Response:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append(request)
                raise
            raise AssertionError("unreachable")

        config = LlmConfig(base_url=CLIENT_CONFIG.base_url, request_timeout_s=0.05)

        answer = call(Server([hang, llm_completion()]), config)

        assert answer.attempts == 2
        assert len(cancelled) == 1

    def test_unreadable_body_is_retried(self) -> None:
        server = Server([httpx.Response(200, text="<html>gateway</html>"), llm_completion()])

        assert call(server).attempts == 2

    def test_gives_up_after_max_attempts_with_the_count(self) -> None:
        server = Server([httpx.Response(503, text="overloaded")])

        error = failure(server)

        assert len(server.requests) == CLIENT_CONFIG.max_attempts
        assert error.attempts == CLIENT_CONFIG.max_attempts
        assert (error.reason, error.status) == ("http_error", 503)
        assert "overloaded" in error.detail
        assert f"after {CLIENT_CONFIG.max_attempts} attempts" in str(error)

    def test_connection_errors_exhaust_as_connection_error(self) -> None:
        error = failure(Server([httpx.ConnectError("connection refused")]))

        assert (error.reason, error.status) == ("connection_error", None)

    def test_httpx_timeouts_exhaust_as_timeout(self) -> None:
        assert failure(Server([httpx.ReadTimeout("slow")])).reason == "timeout"

    def test_unreadable_bodies_exhaust_as_bad_response(self) -> None:
        error = failure(Server([httpx.Response(200, text="not json")]))

        assert (error.reason, error.status) == ("bad_response", 200)

    def test_backoff_grows_between_attempts(self, backoff_sleeps: list[float]) -> None:
        config = LlmConfig(base_url=CLIENT_CONFIG.base_url, max_attempts=4, backoff_initial_s=1.0)

        failure(Server([httpx.Response(500)]), config)

        assert len(backoff_sleeps) == 3  # none after the last attempt
        assert 0.5 <= backoff_sleeps[0] <= 1.0
        assert 1.0 <= backoff_sleeps[1] <= 2.0
        assert 2.0 <= backoff_sleeps[2] <= 4.0


class TestNoRetry:
    @pytest.mark.parametrize("status", [400, 401, 404, 422])
    def test_client_error_fails_at_once(self, status: int, backoff_sleeps: list[float]) -> None:
        server = Server(
            [httpx.Response(status, text="bad request: unknown model"), llm_completion()]
        )

        error = failure(server)

        assert len(server.requests) == 1
        assert backoff_sleeps == []
        assert (error.reason, error.status, error.attempts) == ("http_error", status, 1)
        assert "unknown model" in error.detail

    def test_client_error_after_a_retry_counts_every_attempt(self) -> None:
        server = Server([httpx.Response(503), httpx.Response(400, text="context too long")])

        error = failure(server)

        assert len(server.requests) == 2
        assert error.attempts == 2
        assert error.status == 400


class TestRetryAfter:
    def test_retry_after_is_honoured(self, backoff_sleeps: list[float]) -> None:
        busy = httpx.Response(429, headers={"Retry-After": "3"}, text="slow down")

        call(Server([busy, llm_completion()]))

        assert backoff_sleeps == [3.0]

    def test_retry_after_is_capped_by_backoff_max(self, backoff_sleeps: list[float]) -> None:
        busy = httpx.Response(503, headers={"Retry-After": "120"})

        call(Server([busy, llm_completion()]))

        assert backoff_sleeps == [CLIENT_CONFIG.backoff_max_s]

    @pytest.mark.parametrize(
        ("value", "seconds"),
        [("2", 2.0), ("0.5", 0.5), ("-3", 0.0), (None, None), ("", None), ("soon", None)],
    )
    def test_parse_retry_after(self, value: str | None, seconds: float | None) -> None:
        assert parse_retry_after(value) == seconds


class TestPolicyHelpers:
    @pytest.mark.parametrize("status", [408, 425, 429, 500, 501, 503, 599])
    def test_retryable_statuses(self, status: int) -> None:
        assert is_retryable_status(status)

    @pytest.mark.parametrize("status", [400, 401, 403, 404, 413, 422])
    def test_non_retryable_statuses(self, status: int) -> None:
        assert not is_retryable_status(status)

    @pytest.mark.parametrize("attempt", [1, 2, 3, 4, 5, 6, 10])
    def test_backoff_is_jittered_within_half_to_full_ceiling(self, attempt: int) -> None:
        ceiling = min(
            CLIENT_CONFIG.backoff_max_s, CLIENT_CONFIG.backoff_initial_s * 2 ** (attempt - 1)
        )

        assert backoff_delay(attempt, CLIENT_CONFIG, rand=lambda: 0.0) == ceiling / 2
        assert backoff_delay(attempt, CLIENT_CONFIG, rand=lambda: 1.0) == ceiling
