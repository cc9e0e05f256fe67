"""One prompt's trip: ask the model (over httpx's MockTransport), check the answer, upsert
the intent into a real Redis. Outcomes are written, stale, superseded or a dead letter;
an unreachable Redis is retried for the budget and then raised, never swallowed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import httpx
import orjson
import pytest
import redis
import redis.asyncio

from flink_jobs.config import AppConfig
from flink_jobs.runtime.inference import (
    PromptRunner,
    PromptTask,
    RedisUnavailable,
    TaskResult,
    run_task,
    upsert_with_retry,
)
from flink_jobs.runtime.intent_store import (
    AsyncIntentStore,
    IntentRecord,
    StoredIntent,
    StoreUnavailableError,
)
from flink_jobs.runtime.llm_client import LlmClient
from flink_jobs.tools.local_services import free_port
from tests.support import builders
from tests.support.builders import T0
from tests.support.builders import prompt_task as task
from tests.support.llm_call import COMPARING_INTENT, MODEL, ONE_ATTEMPT_LLM

BUDGET_S = 5.0

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


def completion(
    content: str, model: str = "smollm2-served", finish_reason: str = "stop"
) -> httpx.Response:
    return builders.completion(content, model=model, finish_reason=finish_reason)


def answering(content: str = orjson.dumps(COMPARING_INTENT).decode(), **kwargs: Any) -> Handler:
    async def handler(request: httpx.Request) -> httpx.Response:
        return completion(content, **kwargs)

    return handler


def stored_record(shopper_id: str, version_ts: int, seq: int) -> IntentRecord:
    return builders.intent_record(
        shopper_id,
        version_ts,
        seq,
        intent=COMPARING_INTENT,
        top_label="ready_to_buy",
        top_confidence=0.9,
        summary="newer",
        model=MODEL,
    )


class Pipeline:
    """An LLM client over a MockTransport and an intent store over the test Redis, both
    bound to the running event loop."""

    def __init__(self, redis_url: str, prefix: str, handler: Handler) -> None:
        self.redis = redis.asyncio.Redis.from_url(redis_url)
        self.store = AsyncIntentStore(self.redis, prefix=prefix)
        self.llm = LlmClient(ONE_ATTEMPT_LLM, transport=httpx.MockTransport(handler))

    async def run(self, t: PromptTask, budget_s: float = BUDGET_S) -> TaskResult:
        return await run_task(t, self.llm, self.store, MODEL, budget_s)

    async def stored(self, shopper_id: str) -> StoredIntent | None:
        return await self.store.read(shopper_id)

    async def close(self) -> None:
        await self.llm.aclose()
        await self.redis.aclose()


def run_in_pipeline(
    redis_url: str, prefix: str, handler: Handler, body: Callable[[Pipeline], Awaitable[Any]]
) -> Any:
    async def main() -> Any:
        pipeline = Pipeline(redis_url, prefix, handler)
        try:
            return await body(pipeline)
        finally:
            await pipeline.close()

    return asyncio.run(main())


@pytest.fixture
def prefix(unique_name: str) -> str:
    return unique_name


class TestWritten:
    def test_valid_answer_is_written_with_its_provenance(self, redis_url: str, prefix: str):
        async def body(p: Pipeline) -> tuple[TaskResult, StoredIntent | None]:
            return await p.run(task(seq=3)), await p.stored("shopper-00146")

        result, stored = run_in_pipeline(redis_url, prefix, answering(), body)

        assert result.outcome == "written"
        assert result.dead_letter is None
        assert (result.attempts, result.prompt_tokens) == (1, 412)
        assert stored is not None
        assert stored.version == (task().version_ts, 3)
        assert (stored.top_label, stored.top_confidence) == ("comparing_options", 0.65)
        assert stored.intent["intents"][0]["label"] == "comparing_options"
        assert stored.summary == COMPARING_INTENT["summary"]
        assert (stored.template, stored.template_hash) == ("shopper_intent_v1.j2", "56171ff6b9a3")
        assert stored.model == "smollm2-served"

    def test_configured_model_is_recorded_when_the_answer_names_none(
        self, redis_url: str, prefix: str
    ) -> None:
        async def body(p: Pipeline) -> StoredIntent | None:
            await p.run(task())
            return await p.stored("shopper-00146")

        stored = run_in_pipeline(
            redis_url, prefix, answering(orjson.dumps(COMPARING_INTENT).decode(), model=""), body
        )

        assert stored.model == MODEL

    def test_older_result_is_stale_and_leaves_the_newer_intent(
        self, redis_url: str, prefix: str
    ) -> None:
        newer = stored_record("shopper-00146", version_ts=T0 + 200_000, seq=5)

        async def body(p: Pipeline) -> tuple[TaskResult, StoredIntent | None]:
            await p.store.upsert(newer)
            return await p.run(task(seq=4, at_s=150)), await p.stored("shopper-00146")

        result, stored = run_in_pipeline(redis_url, prefix, answering(), body)

        assert result.outcome == "stale"
        assert stored.version == newer.version
        assert stored.summary == "newer"


class TestDeadLetters:
    def test_llm_failure_is_a_dead_letter_with_the_call_context(
        self, redis_url: str, prefix: str, redis_client: redis.Redis
    ) -> None:
        async def bad_request(request: httpx.Request) -> httpx.Response:
            return httpx.Response(400, text="maximum context length exceeded")

        result = run_in_pipeline(redis_url, prefix, bad_request, lambda p: p.run(task(seq=7)))

        assert result.outcome == "dead_letter"
        dead = result.dead_letter
        assert (dead.stage, dead.reason, dead.shopper_id) == ("llm", "http_error", "shopper-00146")
        assert "maximum context length" in dead.detail
        assert dead.context == {
            "prompt_seq": 7,
            "version_ts": task().version_ts,
            "template": "shopper_intent_v1.j2",
            "template_hash": "56171ff6b9a3",
            "status": 400,
            "attempts": 1,
        }
        assert redis_client.exists(f"{prefix}:intent:shopper-00146") == 0

    def test_unreachable_llm_is_a_dead_letter_after_its_attempts(
        self, redis_url: str, prefix: str
    ) -> None:
        async def refused(request: httpx.Request) -> httpx.Response:
            raise httpx.ConnectError("connection refused")

        result = run_in_pipeline(redis_url, prefix, refused, lambda p: p.run(task()))

        assert result.dead_letter.reason == "connection_error"
        assert result.dead_letter.context["attempts"] == ONE_ATTEMPT_LLM.max_attempts

    @pytest.mark.parametrize(
        ("answer", "reason"),
        [
            ("The shopper is comparing headphones.", "not_json"),
            (
                '{"intents": [{"label": "refund_fraud", "confidence": 1}], "summary": "x"}',
                "schema_violation",
            ),
            ("", "empty_answer"),
        ],
    )
    def test_invalid_answer_is_asked_again_once_then_dead_lettered_with_the_answer(
        self, redis_url: str, prefix: str, redis_client: redis.Redis, answer: str, reason: str
    ) -> None:
        result = run_in_pipeline(redis_url, prefix, answering(answer), lambda p: p.run(task()))

        assert result.outcome == "dead_letter"
        assert (result.dead_letter.stage, result.dead_letter.reason) == ("intent", reason)
        assert result.dead_letter.context["answer"] == answer
        assert result.attempts == 2
        assert redis_client.exists(f"{prefix}:intent:shopper-00146") == 0

    def test_a_second_valid_answer_is_written(self, redis_url: str, prefix: str) -> None:
        answers = iter(
            ["The shopper is comparing headphones.", orjson.dumps(COMPARING_INTENT).decode()]
        )

        async def handler(request: httpx.Request) -> httpx.Response:
            return completion(next(answers))

        result = run_in_pipeline(redis_url, prefix, handler, lambda p: p.run(task()))

        assert (result.outcome, result.attempts) == ("written", 2)

    def test_a_re_asked_prompt_counts_the_time_and_tokens_of_both_calls(
        self, redis_url: str, prefix: str
    ) -> None:
        answers = iter(
            ["The shopper is comparing headphones.", orjson.dumps(COMPARING_INTENT).decode()]
        )

        async def handler(request: httpx.Request) -> httpx.Response:
            await asyncio.sleep(0.2)
            return completion(next(answers))

        result = run_in_pipeline(redis_url, prefix, handler, lambda p: p.run(task()))

        assert result.prompt_tokens == 2 * 412
        assert result.llm_latency_s >= 0.4

    def test_answer_cut_at_max_tokens_is_reported_as_truncated(
        self, redis_url: str, prefix: str
    ) -> None:
        handler = answering('{"intents":[{"label":"brow', finish_reason="length")

        result = run_in_pipeline(redis_url, prefix, handler, lambda p: p.run(task()))

        assert result.dead_letter.reason == "truncated"
        assert "llm.max_tokens" in result.dead_letter.detail

    def test_dead_letter_serialises_with_its_context(self, redis_url: str, prefix: str) -> None:
        result = run_in_pipeline(redis_url, prefix, answering("nope"), lambda p: p.run(task()))

        body = orjson.loads(result.dead_letter.to_json(dead_lettered_at_ms=T0))

        assert body["stage"] == "intent"
        assert body["context"]["template_hash"] == "56171ff6b9a3"


class FlakyStore:
    """The real store behind a Redis outage of ``failures`` calls."""

    def __init__(self, store: AsyncIntentStore, failures: int) -> None:
        self.store, self.failures, self.calls = store, failures, 0

    async def upsert(self, record: IntentRecord) -> bool:
        self.calls += 1
        if self.calls <= self.failures:
            raise StoreUnavailableError("Redis unavailable: connection refused")
        return await self.store.upsert(record)


class TestRedisUnavailable:
    def test_short_outage_is_retried_within_the_budget(self, redis_url: str, prefix: str):
        record = stored_record("shopper-00146", T0, 1)

        async def body(p: Pipeline) -> tuple[bool, int]:
            flaky = FlakyStore(p.store, failures=2)
            written = await upsert_with_retry(flaky, record, budget_s=BUDGET_S)
            return written, flaky.calls

        written, calls = run_in_pipeline(redis_url, prefix, answering(), body)

        assert (written, calls) == (True, 3)

    def test_unreachable_redis_beyond_the_budget_raises(self) -> None:
        async def main() -> None:
            client = redis.asyncio.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0")
            llm = LlmClient(ONE_ATTEMPT_LLM, transport=httpx.MockTransport(answering()))
            try:
                store = AsyncIntentStore(client, prefix="unreachable")
                await run_task(task(), llm, store, MODEL, redis_retry_budget_s=0.25)
            finally:
                await llm.aclose()
                await client.aclose()

        with pytest.raises(RedisUnavailable, match="shopper-00146") as caught:
            asyncio.run(main())

        assert isinstance(caught.value.__cause__, StoreUnavailableError)


class HeldStore:
    """An intent store whose writes wait until the test lets them through."""

    def __init__(self, store: AsyncIntentStore) -> None:
        self.store = store
        self.writing = asyncio.Event()
        self.go_on = asyncio.Event()

    async def upsert(self, record: IntentRecord) -> bool:
        self.writing.set()
        await self.go_on.wait()
        return await self.store.upsert(record)


class TestSupersede:
    """``PromptRunner.supersede``: a newer prompt of the shopper stops this one's LLM call,
    never its write."""

    @staticmethod
    def runner(p: Pipeline, store: Any = None) -> PromptRunner:
        return PromptRunner(
            replace(AppConfig(), llm=ONE_ATTEMPT_LLM), lambda: (p.llm, store or p.store)
        )

    def test_a_call_still_waiting_for_the_llm_stops_and_writes_nothing(
        self, redis_url: str, prefix: str
    ) -> None:
        asked, cancelled = asyncio.Event(), asyncio.Event()

        async def never_answers(request: httpx.Request) -> httpx.Response:
            asked.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise
            raise AssertionError("unreachable")

        async def body(p: Pipeline) -> tuple[TaskResult, bool, StoredIntent | None]:
            runner = self.runner(p)
            call = asyncio.create_task(runner.run(task(seq=3)))
            await asyncio.wait_for(asked.wait(), 5)
            runner.supersede("shopper-00146", 2)  # not the running prompt: no effect
            runner.supersede("shopper-00145", 3)
            await asyncio.sleep(0.05)
            assert not call.done()

            runner.supersede("shopper-00146", 3)

            result = await asyncio.wait_for(call, 5)
            return result, cancelled.is_set(), await p.stored("shopper-00146")

        result, request_cancelled, stored = run_in_pipeline(redis_url, prefix, never_answers, body)

        assert (result.outcome, result.attempts) == ("superseded", 1)  # a call made
        assert request_cancelled
        assert stored is None

    def test_a_call_superseded_while_retrying_reports_the_attempts_it_made(
        self, redis_url: str, prefix: str
    ) -> None:
        asks = 0
        second_asked = asyncio.Event()

        async def fails_then_hangs(request: httpx.Request) -> httpx.Response:
            nonlocal asks
            asks += 1
            if asks == 1:
                return httpx.Response(503, json={"error": "busy"})
            second_asked.set()
            await asyncio.sleep(60)
            raise AssertionError("unreachable")

        retrying = replace(
            ONE_ATTEMPT_LLM, max_attempts=3, backoff_initial_s=0.01, backoff_max_s=0.01
        )

        async def body(p: Pipeline) -> TaskResult:
            llm = LlmClient(retrying, transport=httpx.MockTransport(fails_then_hangs))
            runner = PromptRunner(replace(AppConfig(), llm=retrying), lambda: (llm, p.store))
            try:
                call = asyncio.create_task(runner.run(task(seq=3)))
                await asyncio.wait_for(second_asked.wait(), 10)
                runner.supersede("shopper-00146", 3)
                return await asyncio.wait_for(call, 5)
            finally:
                await llm.aclose()

        result = run_in_pipeline(redis_url, prefix, fails_then_hangs, body)

        assert (result.outcome, result.attempts) == ("superseded", 2)  # one retry counted

    def test_a_call_whose_answer_is_in_is_written(self, redis_url: str, prefix: str) -> None:
        async def body(p: Pipeline) -> tuple[TaskResult, StoredIntent | None]:
            held = HeldStore(p.store)
            runner = self.runner(p, held)
            call = asyncio.create_task(runner.run(task(seq=3)))
            await asyncio.wait_for(held.writing.wait(), 5)

            runner.supersede("shopper-00146", 3)
            held.go_on.set()

            return await asyncio.wait_for(call, 5), await p.stored("shopper-00146")

        result, stored = run_in_pipeline(redis_url, prefix, answering(), body)

        assert result.outcome == "written"
        assert stored is not None and stored.version_seq == 3

    def test_stopping_the_runner_cancels_the_call_rather_than_settling_it(
        self, redis_url: str, prefix: str
    ) -> None:
        asked = asyncio.Event()

        async def never_answers(request: httpx.Request) -> httpx.Response:
            asked.set()
            await asyncio.sleep(60)
            raise AssertionError("unreachable")

        async def body(p: Pipeline) -> bool:
            call = asyncio.create_task(self.runner(p).run(task(seq=3)))
            await asyncio.wait_for(asked.wait(), 5)
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await call
            return call.cancelled()

        assert run_in_pipeline(redis_url, prefix, never_answers, body)
