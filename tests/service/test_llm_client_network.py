"""The LLM client with the job's own transport (aiohttp's, under httpx's API) over real
sockets: a loopback server that answers, refuses, hangs up or says nothing gets the same
failure reasons as the scripted transport in ``tests/unit/test_llm_client.py``, and a
loopback proxy sees the calls the environment or ``llm.proxy_url`` sends through it."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import orjson
import pytest

from flink_jobs.runtime.llm_client import (
    LlmAnswer,
    LlmClient,
    LlmError,
)
from tests.support.llm_call import (
    CLIENT_CONFIG,
    INTENT_TEXT,
    PROMPT,
    SHOPPER,
    llm_completion,
    recorded_backoff_sleeps,
)


@pytest.fixture(autouse=True)
def backoff_sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Backoff sleeps are recorded instead of slept, so retry tests take no time."""
    return recorded_backoff_sleeps(monkeypatch)


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader, heads: list[bytes] | None = None) -> bytes:
    """The request's body; its head is added to ``heads`` when given."""
    head = await reader.readuntil(b"\r\n\r\n")
    if heads is not None:
        heads.append(head)
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return await reader.readexactly(length)


async def write_answer(writer: asyncio.StreamWriter) -> None:
    body = llm_completion().content
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    writer.close()


async def ask_loopback(port: int, **config: Any) -> LlmAnswer:
    """The client as the job builds it (its default transport), at a loopback port."""
    client = LlmClient(replace(CLIENT_CONFIG, base_url=f"http://127.0.0.1:{port}/v1", **config))
    try:
        return await client.complete(PROMPT, SHOPPER)
    finally:
        await client.aclose()


def over_the_network(handle: Handler, **config: Any) -> LlmAnswer:
    """Against a loopback server speaking raw HTTP/1.1."""

    async def run() -> LlmAnswer:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        try:
            return await ask_loopback(server.sockets[0].getsockname()[1], **config)
        finally:
            server.close()

    return asyncio.run(run())


class TestOverTheNetwork:
    """The default transport's failures get the same reasons as the scripted ones above."""

    def test_an_answer_is_read_over_http(self) -> None:
        seen: list[bytes] = []

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append(await read_request(reader))
            await write_answer(writer)

        answer_ = over_the_network(answer)

        assert answer_.text == INTENT_TEXT
        assert orjson.loads(seen[0])["user"] == SHOPPER

    def test_a_refused_connection_is_a_connection_error(self) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]

        with pytest.raises(LlmError) as caught:
            asyncio.run(ask_loopback(port, max_attempts=1))

        assert (caught.value.reason, caught.value.attempts) == ("connection_error", 1)

    def test_a_server_hanging_up_is_a_connection_error(self) -> None:
        async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.close()

        with pytest.raises(LlmError) as caught:
            over_the_network(hang_up, max_attempts=1)

        assert caught.value.reason == "connection_error"
        assert "Disconnected" in caught.value.detail

    def test_a_server_that_never_answers_is_a_timeout(self) -> None:
        async def say_nothing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            await reader.read()  # until the client gives up and closes
            writer.close()

        with pytest.raises(LlmError) as caught:
            over_the_network(say_nothing, max_attempts=1, request_timeout_s=0.2)

        assert caught.value.reason == "timeout", caught.value.detail


class TestProxy:
    """The calls honour the proxy a user names, in ``llm.proxy_url`` or the environment."""

    def test_a_call_goes_through_the_environment_proxy(self, proxy_env: pytest.MonkeyPatch) -> None:
        """A loopback server plays the proxy: it sees the request in the absolute form a
        client sends a proxy, for a host that no resolver knows, and answers it."""

        def config(proxy_port: int) -> dict[str, str]:
            proxy_env.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy_port}")
            return {}

        answer, heads = through_a_loopback_proxy(config)

        assert answer.text == INTENT_TEXT
        assert [head.split(b"\r\n", 1)[0] for head in heads] == [
            b"POST http://llm.invalid:8000/v1/chat/completions HTTP/1.1"
        ]

    def test_the_configured_proxy_gets_its_credentials(self, proxy_env: pytest.MonkeyPatch) -> None:
        _, heads = through_a_loopback_proxy(
            lambda port: {"proxy_url": f"http://svc:hunter2@127.0.0.1:{port}"}
        )

        lines = heads[0].lower().split(b"\r\n")
        assert b"proxy-authorization: basic c3zjomh1bnrlcji=" in lines  # svc:hunter2


def through_a_loopback_proxy(
    config_for: Callable[[int], dict[str, str]],
) -> tuple[LlmAnswer, list[bytes]]:
    """A call to an unresolvable host, the client configured by ``config_for(proxy
    port)``; returns the answer and the request heads the proxy saw."""
    heads: list[bytes] = []

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, heads)
        await write_answer(writer)

    async def run() -> LlmAnswer:
        server = await asyncio.start_server(proxy, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        config = replace(CLIENT_CONFIG, base_url="http://llm.invalid:8000/v1", **config_for(port))
        client = LlmClient(config)
        try:
            return await client.complete(PROMPT, SHOPPER)
        finally:
            await client.aclose()
            server.close()

    return asyncio.run(run()), heads
