"""Two speeds with the job's own runner over a real Redis: when a prompt is submitted its
rules-only record lands while the model is still computing, and the model's answer then
replaces it; the rules write goes through the call process like a call; its Redis failures
follow the model write's policy (a key that cannot take it dead-letters, a Redis down for
the whole budget fails loudly). The LLM is a MockTransport that answers when released."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import httpx
import orjson
import pytest
import redis
import redis.asyncio

from flink_jobs.config import AppConfig, load_config
from flink_jobs.core.grounding import (
    reconcile,
)
from flink_jobs.core.intents import parse_intent
from flink_jobs.runtime.call_process import CallProcess
from flink_jobs.runtime.inference import PromptRunner, RedisUnavailable
from flink_jobs.runtime.intent_store import AsyncIntentStore, IntentStore
from flink_jobs.runtime.llm_client import LlmClient
from flink_jobs.runtime.outbox import Outbox
from flink_jobs.tools.local_services import free_port
from tests.support.builders import completion, grounded_task
from tests.support.waiting import until

WAIT_S = 10.0
ANSWER = {
    "intents": [{"label": "comparing_options", "confidence": 0.8, "category": "Headphones"}],
    "summary": "Comparing two pairs of headphones",
}


class HeldLlm:
    def __init__(self) -> None:
        self.started = threading.Event()
        self.released = threading.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.started.set()
        while not self.released.is_set():
            await asyncio.sleep(0.005)
        return completion(orjson.dumps(ANSWER).decode())


def runner_over(redis_url: str, prefix: str, llm: HeldLlm, config: AppConfig) -> PromptRunner:
    def clients():
        store = AsyncIntentStore(redis.asyncio.Redis.from_url(redis_url), prefix)
        return LlmClient(config.llm, transport=httpx.MockTransport(llm)), store

    return PromptRunner(config, clients)


def stored(client: redis.Redis, prefix: str, shopper_id: str = "shopper-00146"):
    return IntentStore(client, prefix).read(shopper_id)


def test_the_rules_record_lands_first_and_the_models_answer_replaces_it(
    redis_url: str, redis_client: redis.Redis, unique_name: str
) -> None:
    llm = HeldLlm()
    config = load_config({"llm": {"max_attempts": 1}}, environ={})
    runner = runner_over(redis_url, unique_name, llm, config)
    outbox = Outbox(runner, 8, 1)
    outbox.start()
    try:
        t = grounded_task()
        outbox.submit(t)
        assert llm.started.wait(WAIT_S)
        until(lambda: stored(redis_client, unique_name), "the rules record", timeout_s=WAIT_S)

        first = stored(redis_client, unique_name)
        assert (first.source, first.version, first.model) == ("rules", (t.version_ts, 2), "")
        assert first.intent == t.rules.body
        assert first.facts == orjson.loads(t.facts_json)

        llm.released.set()
        outcomes = outbox.wait("shopper-00146", 2, WAIT_S)

        then = stored(redis_client, unique_name)
        assert (then.source, then.version) == ("model", (t.version_ts, 2))
        assert orjson.loads(then.answer_json) == ANSWER
        assert then.intent == reconcile(parse_intent(orjson.dumps(ANSWER).decode()), t.rules).body
        assert then.facts == first.facts
        assert sorted((s.result.source, s.result.outcome) for s in outcomes) == [
            ("model", "written"),
            ("rules", "written"),
        ]
    finally:
        llm.released.set()
        outbox.close()


def test_a_rules_write_runs_in_the_call_process(
    redis_url: str, redis_client: redis.Redis, unique_name: str
) -> None:
    config = load_config({"redis": {"url": redis_url, "key_prefix": unique_name}}, environ={})
    calls = CallProcess(config)

    async def go():
        try:
            return await asyncio.wait_for(calls.write_rules(grounded_task()), 60)
        finally:
            await calls.aclose()

    result = asyncio.run(go())

    assert (result.source, result.outcome) == ("rules", "written")
    assert stored(redis_client, unique_name).source == "rules"


def test_a_rules_write_to_a_key_of_another_type_is_dead_lettered(
    redis_url: str, redis_client: redis.Redis, unique_name: str
) -> None:
    redis_client.set(f"{unique_name}:intent:shopper-00146", "not a hash")
    runner = runner_over(redis_url, unique_name, HeldLlm(), AppConfig())

    async def go():
        try:
            return await runner.write_rules(grounded_task())
        finally:
            await runner.aclose()

    result = asyncio.run(go())

    assert (result.source, result.outcome) == ("rules", "dead_letter")
    dead = result.dead_letter
    assert (dead.stage, dead.reason, dead.context["source"]) == ("store", "key_wrong_type", "rules")


def test_a_rules_write_fails_loudly_when_redis_stays_down(unique_name: str) -> None:
    down = f"redis://127.0.0.1:{free_port()}/0"
    config = dataclasses.replace(
        AppConfig(), redis=dataclasses.replace(AppConfig().redis, write_retry_budget_s=0.3)
    )
    runner = runner_over(down, unique_name, HeldLlm(), config)

    async def go():
        try:
            return await runner.write_rules(grounded_task())
        finally:
            await runner.aclose()

    with pytest.raises(RedisUnavailable, match="shopper-00146"):
        asyncio.run(go())
