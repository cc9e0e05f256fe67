"""Categories from the catalogue: each LLM request carries a response_format whose
``category`` is an enum of the prompt's categories (the messages, and so the cached
prefix, unchanged), and an answer that names another category is dead-lettered as
``ungrounded_category`` without asking again, and counted. The LLM is a fake
(httpx.MockTransport); the real vLLM obeying the enum is in ``tests/model``."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import orjson

from flink_jobs.config import LlmConfig
from flink_jobs.metrics import OutcomeRecorder
from flink_jobs.runtime.inference import Answered, ask
from flink_jobs.runtime.llm_client import LlmClient, build_request
from flink_jobs.runtime.outbox import Settled
from tests.support.builders import completion, prompt_task
from tests.support.fake_metrics import FakeGroup, FakeStats

LLM = LlmConfig(base_url="http://llm.test/v1", max_attempts=1)
CATEGORIES = ("Headphones", "Audio", "Electronics")


def task():
    return dataclasses.replace(prompt_task(), categories=CATEGORIES)


def answer(category: str) -> str:
    return orjson.dumps(
        {
            "intents": [{"label": "comparing_options", "confidence": 0.7, "category": category}],
            "summary": "Comparing headphones",
        }
    ).decode()


class TestTheRequest:
    def test_the_response_format_names_the_prompts_categories_as_an_enum(self) -> None:
        _, body = build_request(task().prompt, "shopper-00146", LLM, CATEGORIES)

        item = orjson.loads(body)["response_format"]["json_schema"]["schema"]["properties"]
        item = item["intents"]["items"]
        assert item["properties"]["category"] == {"type": "string", "enum": list(CATEGORIES)}
        assert "category" in item["required"]

    def test_the_messages_are_the_same_whatever_the_categories(self) -> None:
        _, with_enum = build_request(task().prompt, "shopper-00146", LLM, CATEGORIES)
        _, without = build_request(task().prompt, "shopper-00146", LLM)

        assert orjson.loads(with_enum)["messages"] == orjson.loads(without)["messages"]
        schema = orjson.loads(without)["response_format"]["json_schema"]["schema"]
        assert "enum" not in schema["properties"]["intents"]["items"]["properties"]["category"]

    def test_the_client_sends_the_enum_of_each_call(self) -> None:
        sent: list[dict] = []

        async def server(request: httpx.Request) -> httpx.Response:
            sent.append(orjson.loads(request.content))
            return completion(answer("Headphones"))

        async def go():
            client = LlmClient(LLM, transport=httpx.MockTransport(server))
            try:
                return await ask(task(), client)
            finally:
                await client.aclose()

        assert isinstance(asyncio.run(go()), Answered)
        schema = sent[0]["response_format"]["json_schema"]["schema"]
        enum = schema["properties"]["intents"]["items"]["properties"]["category"]["enum"]
        assert enum == list(CATEGORIES)


def ask_once_answering(text: str) -> tuple[object, int]:
    calls = 0

    async def server(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return completion(text)

    async def go():
        client = LlmClient(LLM, transport=httpx.MockTransport(server))
        try:
            return await ask(task(), client, invalid_answer_retries=1)
        finally:
            await client.aclose()

    return asyncio.run(go()), calls


class TestTheAnswer:
    def test_a_category_outside_the_enum_is_dead_lettered_without_asking_again(self) -> None:
        result, calls = ask_once_answering(answer("Running Shoes"))

        assert (result.outcome, calls) == ("dead_letter", 1)
        dead = result.dead_letter
        assert (dead.stage, dead.reason) == ("intent", "ungrounded_category")
        assert "Running Shoes" in dead.detail and "Headphones" in dead.detail
        assert dead.context["categories"] == list(CATEGORIES)

    def test_a_category_of_the_enum_in_other_case_and_spacing_is_grounded(self) -> None:
        result, _ = ask_once_answering(answer("headphones"))

        assert isinstance(result, Answered)

    def test_an_ungrounded_answer_is_counted(self) -> None:
        result, _ = ask_once_answering(answer("Running Shoes"))
        stats, group = FakeStats(), FakeGroup()
        recorder = OutcomeRecorder(stats)
        recorder.register(group)

        recorder.settled(Settled(task(), result, settled_at_ms=0))

        assert group.read()["answers_ungrounded"] == 1
        assert stats.counts["dead_letter_intent_ungrounded_category"] == 1
        assert stats.counts["dead_letter_inference"] == 1
