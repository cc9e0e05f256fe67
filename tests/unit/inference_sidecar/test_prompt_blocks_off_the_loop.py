"""kv_prefix tokenizes each prompt to hash its blocks. That work runs off the router's
event loop, so ``/health`` and other requests are answered meanwhile, and a prompt that
cannot fit the model's context is never tokenized at all."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import orjson
import pytest
from fake_workers import FakeWorkers
from kv_harness import EVENTS, HASHING
from router_harness import BODY, CHAT, A, B, metric, session

from inference_sidecar.config import RouterConfig
from inference_sidecar.kv import PromptTokenizer
from inference_sidecar.kv.models import models_from_list
from inference_sidecar.kv.prompt_blocks import prompt_blocks
from inference_sidecar.router import Router, build_app
from tests.support.waiting import until_async

pytestmark = pytest.mark.anyio

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
UNHASHED = "inference_sidecar_kv_unhashed_requests_total"


class CharEncoder:
    """One token per character; counts its calls, and can be held inside a call."""

    def __init__(self) -> None:
        self.calls = 0
        self.entered = threading.Event()
        self.release = threading.Event()
        self.hold = False

    def __call__(self, text: str, special: bool) -> list[int]:
        self.calls += 1
        self.entered.set()
        if self.hold:
            self.release.wait(10)
        return [ord(c) for c in text]


def router_with(fake: FakeWorkers, encoder: CharEncoder, **kw: Any) -> Router:
    config = RouterConfig(
        workers=(A, B),
        policy="kv_prefix",
        kv_events=EVENTS,
        tokenizer_dir="unused",
        health_interval_s=0,
        **kw,
    )
    tokenizer = PromptTokenizer(encoder, TEMPLATE, max_token_bytes=4)
    return Router(config, transport=fake.transport(), tokenizer=tokenizer, kv_hashing=HASHING)


def client_of(router: Router) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=build_app(router)), base_url="http://r"
    )


def chat(text: str) -> dict[str, Any]:
    return {**BODY, "messages": [{"role": "user", "content": text}]}


async def test_a_prompt_that_cannot_fit_the_context_is_never_tokenized(
    fake: FakeWorkers,
) -> None:
    encoder = CharEncoder()
    router = router_with(fake, encoder, max_model_len=64)
    async with client_of(router) as client:
        reply = await client.post(CHAT, json=chat("x" * 64 * 4 + "y"), headers=session("s"))
        assert reply.status_code == 200  # routed by hashing; the worker judges the length
        assert encoder.calls == 0
        assert metric(router, UNHASHED, reason="over_context") == 1
        fits = await client.post(CHAT, json=chat("x" * 64), headers=session("s"))
        assert fits.status_code == 200 and encoder.calls == 1
    await router.aclose()


async def test_health_is_answered_while_a_prompt_is_being_tokenized(
    fake: FakeWorkers,
) -> None:
    encoder = CharEncoder()
    encoder.hold = True
    router = router_with(fake, encoder)
    async with client_of(router) as client:
        slow = asyncio.create_task(client.post(CHAT, json=chat("x" * 100), headers=session("s")))
        await until_async(encoder.entered.is_set, "the prompt to be in the tokenizer")
        async with asyncio.timeout(5):  # answered, not queued behind the held tokenizer
            health = await client.get("/health")
            other = await client.get("/metrics")
        assert health.status_code == 200 and other.status_code == 200
        assert not slow.done()
        encoder.release.set()
        assert (await slow).status_code == 200
    await router.aclose()


def test_the_count_of_tokens_is_checked_after_tokenizing_too() -> None:
    tokenizer = PromptTokenizer(lambda text, special: [1] * 10 * len(text), TEMPLATE)
    result = prompt_blocks(tokenizer, "chat/completions", chat("abc"), HASHING, max_tokens=20)
    assert result.unhashed == "over_context"
    fits = prompt_blocks(tokenizer, "chat/completions", chat("ab"), HASHING, max_tokens=20)
    assert (fits.tokens, len(fits.blocks)) == (20, 5)


def test_a_token_id_prompt_longer_than_the_context_is_over_it() -> None:
    tokenizer = PromptTokenizer(lambda text, special: [], TEMPLATE)
    body = {"model": "m", "prompt": list(range(30))}
    assert prompt_blocks(tokenizer, "completions", body, HASHING, 29).unhashed == "over_context"
    assert prompt_blocks(tokenizer, "completions", body, HASHING, 30).tokens == 30


def test_the_context_is_read_from_vllms_model_list() -> None:
    models = {
        "object": "list",
        "data": [
            {"id": "SmolLM2-135M-Instruct", "object": "model", "max_model_len": 4096},
            {"id": "adapter", "object": "model", "root": "/a", "parent": "SmolLM2-135M-Instruct"},
        ],
    }
    assert models_from_list(orjson.dumps(models).decode()).max_model_len == 4096
    assert models_from_list('{"data": [{"id": "m"}]}').max_model_len is None
    assert models_from_list("not json") is None
