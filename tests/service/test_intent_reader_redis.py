"""The readers against a real Redis holding keys something else wrote: one unreadable hash
(another type at the key, bytes that are not UTF-8, JSON nested without end, a 64 MiB
field, a NaN confidence) costs that shopper only, and a follower passes a stream entry that
is not UTF-8. The parsing rules themselves are in ``tests/unit/test_intent_reader.py``.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
import redis
import redis.asyncio

from flink_jobs.runtime.intent_store import IntentStore, Notify
from intent_reader import AsyncIntentReader, IntentReader, MalformedIntentError
from intent_reader.layout import intent_key
from intent_reader.updates import IntentUpdates
from tests.support.builders import intent_record

GOOD = ("good-1", "good-2", "good-3")
#: Each foreign shopper's key, as something other than the job left it, and the reason given.
SPOILED = {
    "wrong-type": "WRONGTYPE",
    "not-utf8": "not UTF-8",
    "deep-json": "nested too deep",
    "huge-field": "holds 67108864 bytes",
    "nan": "not a finite number within",
}


@pytest.fixture
def prefix(redis_client: redis.Redis, unique_name: str) -> str:
    """Three good intents and one foreign key of each kind under a fresh prefix."""
    store = IntentStore(redis_client, prefix=unique_name)
    store.upsert_many([intent_record(s, 1_000, 1) for s in (*GOOD, *SPOILED)])
    key = lambda shopper: intent_key(shopper, unique_name)  # noqa: E731
    redis_client.delete(key("wrong-type"))
    redis_client.set(key("wrong-type"), "a string")
    redis_client.hset(key("not-utf8"), "summary", b"caf\xe9 \xff")
    redis_client.hset(key("deep-json"), "facts", b"[" * 50_000 + b"]" * 50_000)
    redis_client.hset(key("huge-field"), "answer", b"x" * (64 << 20))
    redis_client.hset(key("nan"), "top_confidence", b"nan")
    return unique_name


ASKED = ["good-1", *SPOILED, "good-2", "missing", "good-3"]


def test_a_batch_returns_every_good_intent_and_names_each_bad_hash(
    redis_client: redis.Redis, prefix: str
) -> None:
    reader = IntentReader(redis_client, prefix=prefix, max_age_s=1e12)

    got = reader.get_many(ASKED)

    assert list(got) == ASKED
    assert all(got[s] is not None and got[s].shopper_id == s for s in GOOD)
    assert all(got[s] is None for s in (*SPOILED, "missing"))
    assert {s: e.reason for s, e in got.errors.items()}.keys() == SPOILED.keys()
    for shopper, reason in SPOILED.items():
        assert reason in got.errors[shopper].reason, shopper
    assert reader.malformed == len(SPOILED)


def test_the_async_reader_does_the_same(redis_url: str, prefix: str) -> None:
    async def scenario():
        async with AsyncIntentReader.from_url(
            redis_url, timeout_s=10.0, prefix=prefix, max_age_s=1e12
        ) as reader:
            return await reader.get_many(ASKED)

    got = asyncio.run(scenario())

    assert [s for s in ASKED if got[s] is not None] == list(GOOD)
    assert set(got.errors) == set(SPOILED)


def test_a_strict_reader_raises_for_the_first_bad_hash(
    redis_client: redis.Redis, prefix: str
) -> None:
    reader = IntentReader(redis_client, prefix=prefix, max_age_s=1e12, strict=True)

    with pytest.raises(MalformedIntentError, match="wrong-type"):
        reader.get_many(ASKED)


def test_a_reader_from_a_url_closes_its_connections(redis_url: str, prefix: str) -> None:
    with IntentReader.from_url(redis_url, prefix=prefix, timeout_s=2.0) as reader:
        assert reader.get("good-1") is not None
        [connection] = reader.client.connection_pool._available_connections
        assert connection._sock is not None

    assert connection._sock is None


def test_a_follower_passes_an_entry_that_is_not_utf8(
    redis_client: redis.Redis, unique_name: str
) -> None:
    stream = f"{unique_name}:intent-updates"
    store = IntentStore(redis_client, prefix=unique_name, notify=Notify(stream))
    updates = IntentUpdates(redis_client, stream, start="latest")
    store.upsert(intent_record("before", 1_000, 1))
    redis_client.xadd(stream, {"shopper_id": b"\xff\xfe", "version_ts": "1"})
    store.upsert(intent_record("after", 1_000, 1))

    got = list(itertools.islice(updates.follow(idle_timeout_s=30), 2))

    assert [u.shopper_id for u in got] == ["before", "after"]
    assert updates.malformed == 1
