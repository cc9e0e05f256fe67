"""The version edge cases of the intent write, against a real Redis.

Policy (docs/redis_layout.md, "Guarantees"): a refused write extends the stored intent's
expiry as a landed one would, so an older version cannot land once the newer one would
have expired in the meantime; and a re-evaluation (``redis.reevaluate``: a backfill with a
new template or model) replaces, at an equal version, an intent made by another template
or model, which a live job's write at an equal version never does.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import orjson
import pytest
import redis

from flink_jobs.runtime.intent_store import IntentRecord, IntentStore

T0 = 1_780_304_400_000  # 2026-06-01T09:00:00Z
SHOPPER = "shopper-00146"


def record(
    version_ts: int = T0,
    seq: int = 3,
    template_hash: str = "56171ff6b9a3",
    model: str = "SmolLM2-135M-Instruct",
) -> IntentRecord:
    summary = f"Intent of {version_ts}.{seq} by {template_hash}"
    return IntentRecord(
        shopper_id=SHOPPER,
        version_ts=version_ts,
        version_seq=seq,
        intent_json=orjson.dumps(
            {"intents": [{"label": "browsing", "confidence": 0.6}], "summary": summary}
        ).decode(),
        top_label="browsing",
        top_confidence=0.6,
        summary=summary,
        event_time_ms=version_ts,
        template="shopper_intent_v1.j2",
        template_hash=template_hash,
        model=model,
    )


class TestExpiry:
    def test_a_refused_write_keeps_the_newer_intent_past_its_first_expiry(
        self, redis_client: redis.Redis, unique_name: str
    ) -> None:
        store = IntentStore(redis_client, prefix=unique_name, ttl_ms=1_000)
        newer, older = record(T0 + 60_000), record(T0)
        assert store.upsert(newer)
        time.sleep(0.6)
        assert not store.upsert(older)  # refused: it extends the newer intent's life
        time.sleep(0.6)  # the newer intent's first expiry has passed

        landed_again = store.upsert(older)

        assert landed_again is False
        assert store.read(SHOPPER).version == newer.version  # type: ignore[union-attr]

    def test_a_refused_write_never_shortens_the_expiry(
        self, redis_client: redis.Redis, unique_name: str
    ) -> None:
        long_lived = IntentStore(redis_client, prefix=unique_name, ttl_ms=600_000)
        short_lived = IntentStore(redis_client, prefix=unique_name, ttl_ms=60_000)
        long_lived.upsert(record(T0 + 60_000))

        short_lived.upsert(record(T0))

        assert redis_client.pttl(long_lived.key(SHOPPER)) > 60_000

    def test_a_refused_write_leaves_the_stored_intent_as_it_was(
        self, redis_client: redis.Redis, unique_name: str
    ) -> None:
        store = IntentStore(redis_client, prefix=unique_name, ttl_ms=60_000)
        store.upsert(record(T0 + 60_000))
        before = redis_client.hgetall(store.key(SHOPPER))

        store.upsert(record(T0))

        assert redis_client.hgetall(store.key(SHOPPER)) == before


class TestReevaluation:
    def test_a_live_write_at_an_equal_version_keeps_the_other_templates_intent(
        self, redis_client: redis.Redis, unique_name: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        live = IntentStore(redis_client, prefix=unique_name)
        live.upsert(record(template_hash="56171ff6b9a3"))

        with caplog.at_level(logging.WARNING, "flink_jobs.runtime.intent_store"):
            written = live.upsert(record(template_hash="9d0c22e1f7b4"))

        assert written is False
        assert live.read(SHOPPER).template_hash == "56171ff6b9a3"  # type: ignore[union-attr]
        assert "redis.reevaluate" in caplog.text  # said, not silent

    def test_a_reevaluation_replaces_an_equal_version_made_by_another_template(
        self, redis_client: redis.Redis, unique_name: str
    ) -> None:
        IntentStore(redis_client, prefix=unique_name).upsert(record(template_hash="56171ff6b9a3"))
        backfill = IntentStore(redis_client, prefix=unique_name, reevaluate=True)

        written = backfill.upsert(record(template_hash="9d0c22e1f7b4"))

        assert written is True
        stored = backfill.read(SHOPPER)
        assert (stored.version, stored.template_hash) == ((T0, 3), "9d0c22e1f7b4")  # type: ignore[union-attr]

    def test_a_reevaluation_replaces_an_equal_version_made_by_another_model(
        self, redis_client: redis.Redis, unique_name: str
    ) -> None:
        IntentStore(redis_client, prefix=unique_name).upsert(record(model="SmolLM2-135M-Instruct"))
        backfill = IntentStore(redis_client, prefix=unique_name, reevaluate=True)

        assert backfill.upsert(record(model="SmolLM2-360M-Instruct")) is True
        assert backfill.read(SHOPPER).model == "SmolLM2-360M-Instruct"  # type: ignore[union-attr]

    def test_a_reevaluation_replayed_with_the_same_template_is_a_no_op(
        self, redis_client: redis.Redis, unique_name: str
    ) -> None:
        backfill = IntentStore(redis_client, prefix=unique_name, reevaluate=True)
        backfill.upsert(record(template_hash="9d0c22e1f7b4"))

        assert backfill.upsert(record(template_hash="9d0c22e1f7b4")) is False

    def test_a_reevaluation_never_replaces_a_newer_intent(
        self, redis_client: redis.Redis, unique_name: str
    ) -> None:
        IntentStore(redis_client, prefix=unique_name).upsert(record(T0 + 60_000))
        backfill = IntentStore(redis_client, prefix=unique_name, reevaluate=True)

        assert backfill.upsert(record(T0, template_hash="9d0c22e1f7b4")) is False
        assert backfill.upsert(record(T0 + 60_000, seq=2, template_hash="9d0c22e1f7b4")) is False
        assert backfill.read(SHOPPER).version == (T0 + 60_000, 3)  # type: ignore[union-attr]

    def test_a_live_replay_does_not_undo_a_reevaluation(
        self, redis_client: redis.Redis, unique_name: str
    ) -> None:
        """After a backfill re-evaluated a shopper, the live job replaying the same version
        from a checkpoint keeps the re-evaluated intent."""
        live = IntentStore(redis_client, prefix=unique_name)
        old = record(template_hash="56171ff6b9a3")
        live.upsert(old)
        IntentStore(redis_client, prefix=unique_name, reevaluate=True).upsert(
            dataclasses.replace(old, template_hash="9d0c22e1f7b4")
        )

        assert live.upsert(old) is False
        assert live.read(SHOPPER).template_hash == "9d0c22e1f7b4"  # type: ignore[union-attr]
