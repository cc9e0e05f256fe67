"""The two-speed write rule against a real Redis: a record's version is the triple
(version_ts, version_seq, rank of its source: rules 0 < model 1), so the rules-only record
written when a prompt fires gives way to the model's answer for that prompt, never the
reverse, and nothing older replaces anything newer. Also: the readers (sync and asyncio)
and the notification stream see ``facts`` and ``source``. The pure parts are in
``tests/unit/test_grounded_records.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import orjson
import pytest
import redis
import redis.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flink_jobs.runtime.intent_store import IntentRecord, IntentStore, Notify, is_newer
from intent_reader import AsyncIntentReader, IntentReader
from intent_reader.layout import intent_key
from intent_reader.updates import IntentUpdates
from tests.support.builders import intent_record

FACTS = {"event_counts": {"view": 2, "add_to_cart": 1}, "cart": [{"product_id": "sku-1"}]}
RULES_BODY = {
    "intents": [{"label": "ready_to_buy", "confidence": 0.7, "category": "Headphones"}],
    "summary": "Just added Headphones to the cart",
}
MODEL_BODY = {
    "intents": [{"label": "comparing_options", "confidence": 0.9, "category": "Headphones"}],
    "summary": "Comparing two pairs of headphones",
}


#: What the model said before the record put the rules' label first (``grounding.reconcile``).
ANSWER_BODY = {
    "intents": [{"label": "browsing", "confidence": 0.9, "category": "Headphones"}],
    "summary": MODEL_BODY["summary"],
}


def write(ts: int, seq: int, source: str, *, template_hash: str = "h1") -> IntentRecord:
    body = RULES_BODY if source == "rules" else MODEL_BODY
    record = intent_record(
        "shopper-1",
        ts,
        seq,
        intent=body,
        template="shopper_intent_v2.j2",
        template_hash=template_hash,
        model="" if source == "rules" else "SmolLM2-135M-Instruct",
    )
    return dataclasses.replace(
        record,
        facts_json=orjson.dumps(FACTS).decode(),
        source=source,
        answer_json="" if source == "rules" else orjson.dumps(ANSWER_BODY).decode(),
    )


@pytest.fixture
def store(redis_client: redis.Redis, unique_name: str) -> IntentStore:
    return IntentStore(redis_client, prefix=unique_name)


def stored_source(store: IntentStore) -> tuple[int, int, str]:
    stored = store.read("shopper-1")
    assert stored is not None
    return (stored.version_ts, stored.version_seq, stored.source)


class TestTwoSpeeds:
    def test_the_models_answer_replaces_the_rules_record_of_its_prompt(
        self, store: IntentStore
    ) -> None:
        assert store.upsert(write(1_000, 4, "rules"))
        assert store.upsert(write(1_000, 4, "model"))
        assert stored_source(store) == (1_000, 4, "model")

    def test_a_rules_record_never_replaces_the_models_answer_of_its_prompt(
        self, store: IntentStore
    ) -> None:
        assert store.upsert(write(1_000, 4, "model"))
        assert not store.upsert(write(1_000, 4, "rules"))
        assert stored_source(store) == (1_000, 4, "model")

    def test_a_model_answer_to_an_older_prompt_never_replaces_a_newer_rules_record(
        self, store: IntentStore
    ) -> None:
        assert store.upsert(write(1_000, 4, "rules"))
        assert store.upsert(write(2_000, 5, "rules"))
        assert not store.upsert(write(1_000, 4, "model"))
        assert stored_source(store) == (2_000, 5, "rules")

    def test_a_newer_prompts_rules_record_replaces_an_older_models_answer(
        self, store: IntentStore
    ) -> None:
        assert store.upsert(write(1_000, 4, "model"))
        assert store.upsert(write(2_000, 5, "rules"))
        assert stored_source(store) == (2_000, 5, "rules")

    def test_a_record_written_without_source_ranks_as_the_model(
        self, store: IntentStore, redis_client: redis.Redis
    ) -> None:
        assert store.upsert(write(1_000, 4, "model"))
        key = intent_key("shopper-1", store.prefix)
        redis_client.hdel(key, "source", "facts")  # as a job before this change wrote it

        assert not store.upsert(write(1_000, 4, "rules"))
        assert redis_client.hget(key, "source") is None

    def test_a_reevaluation_replaces_an_equal_model_answer_but_never_with_rules(
        self, store: IntentStore, redis_client: redis.Redis
    ) -> None:
        backfill = IntentStore(redis_client, prefix=store.prefix, reevaluate=True)
        assert store.upsert(write(1_000, 4, "model", template_hash="h1"))

        assert not backfill.upsert(write(1_000, 4, "rules", template_hash="h2"))
        assert backfill.upsert(write(1_000, 4, "model", template_hash="h2"))
        assert store.read("shopper-1").template_hash == "h2"


triple_st = st.tuples(st.integers(0, 4), st.integers(0, 3), st.sampled_from(["rules", "model"]))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(writes=st.lists(triple_st, min_size=1, max_size=10))
def test_any_write_order_keeps_the_greatest_triple(
    redis_service, writes: list[tuple[int, int, str]]
) -> None:
    client = redis.Redis.from_url(redis_service.url)
    try:
        store = IntentStore(client, prefix=f"h{uuid.uuid4().hex[:10]}")
        records = [write(ts, seq, source) for ts, seq, source in writes]
        landed = store.upsert_many(records)

        best = None
        for record, did_write in zip(records, landed, strict=True):
            assert did_write is is_newer(record.ordered_version, best)
            if did_write:
                best = record.ordered_version
        assert store.read("shopper-1").ordered_version == max(r.ordered_version for r in records)
    finally:
        client.close()


class TestReaders:
    def test_sync_and_asyncio_readers_see_facts_and_source(
        self, store: IntentStore, redis_url: str
    ) -> None:
        store.upsert(write(1_000, 4, "rules"))
        sync = IntentReader.from_url(redis_url, prefix=store.prefix, max_age_s=1e9)

        async def read_async():
            reader = AsyncIntentReader.from_url(redis_url, prefix=store.prefix, max_age_s=1e9)
            try:
                return await reader.get_many(["shopper-1", "nobody"])
            finally:
                await reader.aclose()

        via_async = asyncio.run(read_async())
        via_sync = sync.get_many(["shopper-1", "nobody"])

        assert via_async["nobody"] is None
        got = via_async["shopper-1"]
        assert (got.source, got.facts, got.top_label) == ("rules", FACTS, "ready_to_buy")
        assert got.answer is None
        store.upsert(write(1_000, 4, "model"))
        assert sync.get("shopper-1").answer == ANSWER_BODY
        assert dataclasses.replace(got, age_ms=0, written_age_ms=0) == dataclasses.replace(
            via_sync["shopper-1"], age_ms=0, written_age_ms=0
        )

    def test_the_notification_carries_source_template_model_intent_and_answer(
        self, redis_client: redis.Redis, unique_name: str
    ) -> None:
        stream = f"{unique_name}:updates"
        store = IntentStore(redis_client, prefix=unique_name, notify=Notify(stream))
        store.upsert(write(1_000, 4, "rules"))
        store.upsert(write(1_000, 4, "model"))

        updates = IntentUpdates(redis_client, stream, start="earliest").read(block_s=None)

        assert [(u.source, u.model) for u in updates] == [
            ("rules", ""),
            ("model", "SmolLM2-135M-Instruct"),
        ]
        assert [u.intent for u in updates] == [RULES_BODY, MODEL_BODY]
        assert [u.answer_json for u in updates] == ["", orjson.dumps(ANSWER_BODY).decode()]
        assert {u.template for u in updates} == {"shopper_intent_v2.j2"}
