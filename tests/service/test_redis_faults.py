"""Redis answers with an error instead of writing (issue 28, finding 2).

A server that cannot take writes for a while (a replica after a failover: READONLY; a long
script: BUSY; out of memory under ``noeviction``: OOM) is waited out like an unreachable
one: the write is retried with backoff within ``redis.write_retry_budget_s`` and lands
once the server recovers, and past the budget it fails loudly. A key that cannot take the
write at all (another type at one shopper's key: WRONGTYPE) dead-letters that shopper's
intent with the reason, and other shoppers' intents go on landing.

Each test puts its own ``redis-server`` into the state, never the session's shared one.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import redis
import redis.asyncio

from flink_jobs.config import LlmConfig
from flink_jobs.core.prompting import RenderedPrompt
from flink_jobs.core.tasks import PromptTask, TaskResult
from flink_jobs.runtime.inference import RedisUnavailable, run_task, upsert_with_retry
from flink_jobs.runtime.intent_store import AsyncIntentStore, IntentRecord
from flink_jobs.runtime.llm_client import LlmClient
from flink_jobs.tools.local_services import RedisService, free_port, start_redis

T0 = 1_780_304_400_000  # 2026-06-01T09:00:00Z
MODEL = "SmolLM2-135M-Instruct"
LLM = LlmConfig(base_url="http://llm.test/v1", model=MODEL, max_attempts=1)
# Long enough that a state lifted after LIFT_AFTER_S is always waited out.
BUDGET_S = 10.0
LIFT_AFTER_S = 0.6

INTENT = {
    "intents": [{"label": "comparing_options", "confidence": 0.65, "category": "headphones"}],
    "summary": "Comparing over-ear headphones from Sonique and Auralis.",
}


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisService]:
    with start_redis(workdir=tmp_path / "redis") as service:
        yield service


@pytest.fixture
def admin(private_redis: RedisService) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(private_redis.url, socket_timeout=5)
    try:
        yield client
    finally:
        client.close()


def record(shopper_id: str = "shopper-00146", seq: int = 3) -> IntentRecord:
    return IntentRecord(
        shopper_id=shopper_id,
        version_ts=T0 + 95_000,
        version_seq=seq,
        intent_json=orjson.dumps(INTENT).decode(),
        top_label="comparing_options",
        top_confidence=0.65,
        summary=INTENT["summary"],
        event_time_ms=T0 + 95_000,
        template="shopper_intent_v1.j2",
        template_hash="56171ff6b9a3",
        model=MODEL,
    )


class CountingStore:
    """The real store, counting the attempts the retry makes."""

    def __init__(self, store: AsyncIntentStore) -> None:
        self.store, self.attempts = store, 0

    async def upsert(self, r: IntentRecord) -> bool:
        self.attempts += 1
        return await self.store.upsert(r)


def upsert_while_lifting(
    url: str, lift: Callable[[], object] | None, budget_s: float = BUDGET_S
) -> tuple[bool, int]:
    """``upsert_with_retry`` of one intent while ``lift`` ends the server's state after
    ``LIFT_AFTER_S`` (never, if None); returns whether it wrote and how many attempts it took."""
    timer = threading.Timer(LIFT_AFTER_S, lift) if lift else None

    async def main() -> tuple[bool, int]:
        client = redis.asyncio.Redis.from_url(url, socket_timeout=2)
        store = CountingStore(AsyncIntentStore(client))
        try:
            if timer:
                timer.start()
            return await upsert_with_retry(store, record(), budget_s), store.attempts
        finally:
            await client.aclose()

    try:
        return asyncio.run(main())
    finally:
        if timer:
            timer.join()


def stored_version(admin: redis.Redis, shopper_id: str = "shopper-00146") -> tuple[int, int]:
    ts, seq = admin.hmget(f"si:intent:{shopper_id}", "version_ts", "version_seq")
    return int(ts), int(seq)


def read_only_replica(admin: redis.Redis) -> None:
    """The server becomes a replica of a primary that is gone: as after a failover, it
    refuses writes until it is promoted."""
    admin.replicaof("127.0.0.1", str(free_port()))
    with pytest.raises(redis.exceptions.ReadOnlyError):
        admin.set("probe", "1")


def spin_until_killed(client: redis.Redis) -> None:
    """A script that runs until SCRIPT KILL ends it."""
    with contextlib.suppress(redis.ResponseError):
        client.eval("while true do end", 0)


class TestTransientServerStates:
    def test_a_replica_refusing_writes_is_waited_out_until_it_is_promoted(
        self, private_redis: RedisService, admin: redis.Redis
    ) -> None:
        read_only_replica(admin)

        written, attempts = upsert_while_lifting(
            private_redis.url, lambda: admin.replicaof("NO", "ONE")
        )

        assert written is True
        assert attempts >= 2
        assert stored_version(admin) == (T0 + 95_000, 3)

    def test_a_server_out_of_memory_is_waited_out_until_memory_frees(
        self, private_redis: RedisService, admin: redis.Redis
    ) -> None:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", "1")

        written, attempts = upsert_while_lifting(
            private_redis.url, lambda: admin.config_set("maxmemory", "0")
        )

        assert written is True
        assert attempts >= 2
        assert stored_version(admin) == (T0 + 95_000, 3)

    def test_a_server_busy_with_a_long_script_is_waited_out_until_the_script_ends(
        self, private_redis: RedisService, admin: redis.Redis
    ) -> None:
        admin.config_set("busy-reply-threshold", "100")  # ms before other clients get BUSY
        spinner = redis.Redis.from_url(private_redis.url, socket_timeout=BUDGET_S)
        spinning = threading.Thread(target=spin_until_killed, args=(spinner,))
        spinning.start()
        try:
            deadline = time.monotonic() + 5
            while True:  # until the server answers BUSY
                try:
                    admin.ping()
                except redis.ResponseError as exc:
                    assert str(exc).startswith("BUSY")
                    break
                assert time.monotonic() < deadline, "the script never made the server busy"
                time.sleep(0.05)

            written, attempts = upsert_while_lifting(private_redis.url, admin.script_kill)
        finally:
            spinning.join()
            spinner.close()

        assert written is True
        assert attempts >= 2
        assert stored_version(admin) == (T0 + 95_000, 3)

    def test_a_state_that_outlasts_the_budget_fails_the_write_loudly(
        self, private_redis: RedisService, admin: redis.Redis
    ) -> None:
        read_only_replica(admin)

        with pytest.raises(RedisUnavailable, match="shopper-00146") as raised:
            upsert_while_lifting(private_redis.url, None, budget_s=0.5)

        assert "read only" in str(raised.value)


async def completion_handler(request: httpx.Request) -> httpx.Response:
    body = {
        "model": "smollm2-served",
        "choices": [
            {"message": {"role": "assistant", "content": orjson.dumps(INTENT).decode()},
             "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 412, "completion_tokens": 30},
    }  # fmt: skip
    return httpx.Response(200, content=orjson.dumps(body))


def prompt_task(shopper_id: str, seq: int = 3) -> PromptTask:
    prompt = RenderedPrompt(
        messages=(
            {"role": "system", "content": "You infer a shopper's current shopping intent."},
            {"role": "user", "content": "<events>\n+01:35 view\n</events>"},
        ),
        template="shopper_intent_v1.j2",
        template_hash="56171ff6b9a3",
        estimated_tokens=400,
        events_included=1,
        events_dropped=0,
    )
    at = T0 + 95_000
    return PromptTask(shopper_id, seq, version_ts=at, event_time_ms=at, prompt=prompt)


def run_tasks(url: str, *tasks: PromptTask) -> list[TaskResult]:
    """Each prompt's whole trip, in order, as the job's call runner makes it."""

    async def main() -> list[TaskResult]:
        client = redis.asyncio.Redis.from_url(url, socket_timeout=2)
        llm = LlmClient(LLM, transport=httpx.MockTransport(completion_handler))
        try:
            store = AsyncIntentStore(client)
            return [await run_task(t, llm, store, MODEL, BUDGET_S) for t in tasks]
        finally:
            await llm.aclose()
            await client.aclose()

    return asyncio.run(main())


class TestPerKeyErrors:
    def test_a_key_of_another_type_dead_letters_that_shoppers_intent_and_others_land(
        self, private_redis: RedisService, admin: redis.Redis
    ) -> None:
        admin.set("si:intent:shopper-00999", "written by someone else")

        poisoned, healthy = run_tasks(
            private_redis.url, prompt_task("shopper-00999"), prompt_task("shopper-00146")
        )

        assert poisoned.outcome == "dead_letter"
        dead_letter = poisoned.dead_letter
        assert (dead_letter.stage, dead_letter.reason) == ("store", "key_wrong_type")
        assert dead_letter.shopper_id == "shopper-00999"
        assert "WRONGTYPE" in dead_letter.detail
        assert orjson.loads(dead_letter.context["intent"]) == INTENT  # nothing lost
        assert admin.get("si:intent:shopper-00999") == b"written by someone else"
        assert healthy.outcome == "written"
        assert stored_version(admin, "shopper-00146") == (T0 + 95_000, 3)

    def test_the_dead_letter_of_a_poisoned_key_serialises_with_its_intent(
        self, private_redis: RedisService, admin: redis.Redis
    ) -> None:
        admin.rpush("si:intent:shopper-00999", "a list, not a hash")

        (poisoned,) = run_tasks(private_redis.url, prompt_task("shopper-00999", seq=4))

        body = orjson.loads(poisoned.dead_letter.to_json(T0 + 100_000))
        assert (body["stage"], body["reason"], body["shopper_id"]) == (
            "store",
            "key_wrong_type",
            "shopper-00999",
        )
        assert body["context"]["prompt_seq"] == 4
        assert orjson.loads(body["context"]["intent"]) == INTENT
