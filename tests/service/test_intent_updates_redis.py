"""Update notifications: the upsert script announces landed writes on a stream, and
``intent_reader.IntentUpdates`` follows it. Against the session's real Redis (the pure
parts are in ``tests/unit/test_intent_updates.py``).

The promises: one entry per write that lands, none for a refused one, written in the same
script as the hash; off unless configured; a follower started "latest" misses nothing
appended after it started and reads entries in order, typed.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis
import redis.asyncio

from flink_jobs.config import ConfigError, load_config
from flink_jobs.runtime.intent_store import (
    AsyncIntentStore,
    IntentStore,
    KeyRejectedError,
    Notify,
    NotifyStreamError,
    check_notify_stream,
)
from intent_reader.updates import (
    IntentUpdate,
    IntentUpdates,
    MalformedUpdateError,
)
from tests.support.builders import intent_record
from tests.support.waiting import until


def record(shopper: str = "s-1", ts: int = 1_000, seq: int = 0, label: str = "browsing"):
    return intent_record(
        shopper, ts, seq, top_label=label, template="t", template_hash="h", model="m"
    )


#: How long a test waits for a read that should return long before (its liveness bound).
WAIT_S = 10.0


def blocked_in_xread(client: redis.Redis) -> bool:
    """Whether a client of the server is blocked in ``XREAD``."""
    return any(c.get("cmd") == "xread" and "b" in c.get("flags", "") for c in client.client_list())


@pytest.fixture
def stream(unique_name: str) -> str:
    return f"{unique_name}:intent-updates"


@pytest.fixture
def store(redis_client: redis.Redis, unique_name: str, stream: str) -> IntentStore:
    return IntentStore(redis_client, prefix=unique_name, notify=Notify(stream))


def entries(client: redis.Redis, stream: str) -> list[dict[str, str]]:
    return [
        {k.decode(): v.decode() for k, v in fields.items()} for _id, fields in client.xrange(stream)
    ]


# --- the writer --------------------------------------------------------------------------


class TestWriterNotifies:
    def test_a_landed_write_appends_one_entry_matching_the_hash(
        self, store: IntentStore, redis_client: redis.Redis, stream: str
    ) -> None:
        assert store.upsert(record(ts=2_000, seq=3, label="ready_to_buy"))
        stored = store.read("s-1")
        assert stored is not None
        assert entries(redis_client, stream) == [
            {
                "shopper_id": "s-1",
                "version_ts": "2000",
                "version_seq": "3",
                "top_label": "ready_to_buy",
                "written_at_ms": str(stored.written_at_ms),
                "source": "model",
                "template": "t",
                "model": "m",
                "intent": stored.intent_json,
                "answer": stored.answer_json,
            }
        ]

    def test_refused_writes_append_nothing(
        self, store: IntentStore, redis_client: redis.Redis, stream: str
    ) -> None:
        assert store.upsert(record(ts=2_000, seq=1))
        assert not store.upsert(record(ts=1_000))  # older
        assert not store.upsert(record(ts=2_000, seq=1))  # equal
        assert [e["version_ts"] for e in entries(redis_client, stream)] == ["2000"]

    def test_a_batch_announces_only_what_landed_in_order(
        self, store: IntentStore, redis_client: redis.Redis, stream: str
    ) -> None:
        written = store.upsert_many(
            [record("a", 10), record("b", 10), record("a", 5), record("a", 20)]
        )
        assert written == [True, True, False, True]
        got = [(e["shopper_id"], e["version_ts"]) for e in entries(redis_client, stream)]
        assert got == [("a", "10"), ("b", "10"), ("a", "20")]

    def test_off_by_default_no_stream_is_made(
        self, redis_client: redis.Redis, unique_name: str, stream: str
    ) -> None:
        assert IntentStore(redis_client, prefix=unique_name).upsert(record())
        assert redis_client.exists(stream) == 0

    def test_the_stream_is_trimmed_to_about_maxlen(
        self, redis_client: redis.Redis, unique_name: str, stream: str
    ) -> None:
        store = IntentStore(redis_client, prefix=unique_name, notify=Notify(stream, maxlen=10))
        store.upsert_many([record(ts=t) for t in range(1, 501)])
        # "~" trims whole stream nodes (100 entries by default): about maxlen, never fewer.
        assert 10 <= redis_client.xlen(stream) <= 200

    def test_async_store_notifies_too(self, redis_url: str, unique_name: str, stream: str) -> None:
        async def scenario() -> list[bool]:
            client = redis.asyncio.Redis.from_url(redis_url)
            try:
                store = AsyncIntentStore(client, prefix=unique_name, notify=Notify(stream))
                return await store.upsert_many([record(ts=2), record(ts=1), record(ts=3)])
            finally:
                await client.aclose()

        assert asyncio.run(scenario()) == [True, False, True]
        sync = redis.Redis.from_url(redis_url)
        try:
            assert [e["version_ts"] for e in entries(sync, stream)] == ["2", "3"]
        finally:
            sync.close()


class TestAStreamKeyOfAnotherType:
    """``redis.notify_stream`` naming a key that holds something else (the stats hash):
    nothing is written, and the job refuses it at start."""

    def test_the_write_is_refused_before_the_intent_or_its_expiry_lands(
        self, redis_client: redis.Redis, unique_name: str
    ) -> None:
        stats = f"{unique_name}:stats"
        redis_client.hset(stats, "events_in", 7)
        store = IntentStore(redis_client, prefix=unique_name, notify=Notify(stats))

        with pytest.raises(NotifyStreamError, match=r"holds a hash, not a stream"):
            store.upsert(record("s-1"))

        assert redis_client.exists(f"{unique_name}:intent:s-1") == 0
        assert redis_client.hgetall(stats) == {b"events_in": b"7"}
        assert redis_client.ttl(stats) == -1

    def test_it_is_not_taken_for_one_shoppers_bad_key(
        self, redis_client: redis.Redis, unique_name: str
    ) -> None:
        """Every shopper's write would fail alike: not a dead letter per shopper, a stop."""
        redis_client.set(f"{unique_name}:updates", "a string")
        store = IntentStore(
            redis_client, prefix=unique_name, notify=Notify(f"{unique_name}:updates")
        )

        with pytest.raises(NotifyStreamError) as caught:
            store.upsert_many([record("s-1"), record("s-2")])

        assert not isinstance(caught.value, KeyRejectedError)
        assert redis_client.keys(f"{unique_name}:intent:*") == []

    def test_the_job_refuses_it_at_start(
        self, redis_url: str, redis_client: redis.Redis, unique_name: str
    ) -> None:
        from flink_jobs.job import check_redis_layout

        redis_client.hset(f"{unique_name}:seen", "x", 1)
        config = load_config(
            overrides={"redis": {"url": redis_url, "notify_stream": f"{unique_name}:seen"}},
            environ={},
        )

        with pytest.raises(ConfigError, match=r"^redis\.notify_stream: '.*' holds a hash"):
            check_redis_layout(config)

    def test_a_stream_or_a_key_not_made_yet_is_accepted_at_start(
        self, redis_client: redis.Redis, unique_name: str, store: IntentStore, stream: str
    ) -> None:
        check_notify_stream(redis_client, stream)  # not made yet
        store.upsert(record("s-1"))

        check_notify_stream(redis_client, stream)  # a stream now

        assert redis_client.type(stream) == b"stream"


# --- the follower ------------------------------------------------------------------------


class TestFollower:
    def test_latest_skips_what_came_before_and_reads_what_comes_after(
        self, store: IntentStore, redis_client: redis.Redis, stream: str
    ) -> None:
        store.upsert(record("before", 1))
        updates = IntentUpdates(redis_client, stream)
        store.upsert(record("after", 2, seq=4, label="gift_shopping"))
        store.upsert(record("after", 3))
        got = updates.read()
        assert [(u.shopper_id, u.version) for u in got] == [("after", (2, 4)), ("after", (3, 0))]
        assert got[0].top_label == "gift_shopping"
        assert updates.read() == []

    def test_latest_on_a_stream_not_yet_made_misses_nothing(
        self, store: IntentStore, redis_client: redis.Redis, stream: str
    ) -> None:
        updates = IntentUpdates(redis_client, stream)
        store.upsert(record("first", 1))
        assert [u.shopper_id for u in updates.read()] == ["first"]

    def test_earliest_replays_what_the_stream_holds(
        self, store: IntentStore, redis_client: redis.Redis, stream: str
    ) -> None:
        store.upsert_many([record("a", 1), record("b", 1)])
        assert [u.shopper_id for u in IntentUpdates(redis_client, stream, "earliest").read()] == [
            "a",
            "b",
        ]

    def test_resumes_after_a_saved_cursor(
        self, store: IntentStore, redis_client: redis.Redis, stream: str
    ) -> None:
        first = IntentUpdates(redis_client, stream, "earliest")
        store.upsert(record("a", 1))
        first.read()
        store.upsert(record("b", 1))
        resumed = IntentUpdates(redis_client, stream, start=first.last_id)
        assert [u.shopper_id for u in resumed.read()] == ["b"]

    def test_batches_are_bounded(
        self, store: IntentStore, redis_client: redis.Redis, stream: str
    ) -> None:
        updates = IntentUpdates(redis_client, stream, batch=2)
        store.upsert_many([record(f"s{i}", 1) for i in range(5)])
        sizes = [len(updates.read()) for _ in range(4)]
        assert sizes == [2, 2, 1, 0]

    def test_a_blocking_read_wakes_on_a_write(
        self, store: IntentStore, redis_client: redis.Redis, redis_url: str, stream: str
    ) -> None:
        """The read blocks far longer than the test waits for it: it returns with the write
        only if the write wakes it."""
        updates = IntentUpdates(redis.Redis.from_url(redis_url, socket_timeout=90), stream)
        got: list[IntentUpdate] = []
        reader = threading.Thread(target=lambda: got.extend(updates.read(block_s=60)), daemon=True)
        reader.start()
        try:
            until(lambda: blocked_in_xread(redis_client), "the read to block", timeout_s=10)
            store.upsert(record("late", 1))
            reader.join(timeout=WAIT_S)
            assert not reader.is_alive(), "the write did not wake the read"
        finally:
            updates.client.close()
        assert [u.shopper_id for u in got] == ["late"]

    def test_follow_stops_when_idle(
        self, store: IntentStore, redis_client: redis.Redis, stream: str
    ) -> None:
        updates = IntentUpdates(redis_client, stream)
        store.upsert_many([record("a", 1), record("b", 1)])
        got: list[IntentUpdate] = []
        follower = threading.Thread(
            target=lambda: got.extend(updates.follow(idle_timeout_s=0.5, poll_s=0.2)), daemon=True
        )
        follower.start()
        follower.join(timeout=WAIT_S)
        assert not follower.is_alive(), "the follow went on past its idle timeout"
        assert [u.shopper_id for u in got] == ["a", "b"]

    def test_a_foreign_entry_raises_and_is_passed(
        self, store: IntentStore, redis_client: redis.Redis, stream: str
    ) -> None:
        updates = IntentUpdates(redis_client, stream)
        redis_client.xadd(stream, {"hello": "world"})
        with pytest.raises(MalformedUpdateError, match="missing shopper_id"):
            updates.read()
        store.upsert(record("fine", 1))
        assert [u.shopper_id for u in updates.read()] == ["fine"]

    def test_missed_counts_what_trimming_took_before_it_was_read(
        self, redis_client: redis.Redis, unique_name: str, stream: str
    ) -> None:
        store = IntentStore(redis_client, prefix=unique_name, notify=Notify(stream, maxlen=10))
        updates = IntentUpdates(redis_client, stream)
        assert updates.missed() == 0  # no stream yet
        store.upsert(record(ts=1))
        assert updates.missed() == 0
        store.upsert_many([record(ts=t) for t in range(2, 401)])
        retained = redis_client.xlen(stream)
        assert updates.missed() == 400 - retained
        read = 0
        while batch := updates.read():
            read += len(batch)
        assert read == retained
        assert updates.missed() == 0  # counted once

    def test_a_reader_that_keeps_up_misses_nothing(
        self, redis_client: redis.Redis, unique_name: str, stream: str
    ) -> None:
        store = IntentStore(redis_client, prefix=unique_name, notify=Notify(stream, maxlen=10))
        updates = IntentUpdates(redis_client, stream)
        got = []
        for start in range(1, 400, 5):
            store.upsert_many([record(ts=t) for t in range(start, start + 5)])
            got += updates.read()
        assert [u.version_ts for u in got] == list(range(1, 401))
        assert updates.missed() == 0

    def test_a_resumed_cursor_syncs_on_the_first_check(
        self, store: IntentStore, redis_client: redis.Redis, stream: str
    ) -> None:
        store.upsert_many([record(ts=t) for t in range(1, 4)])
        first = redis_client.xrange(stream)[0][0].decode()
        resumed = IntentUpdates(redis_client, stream, start=first)
        assert resumed.missed() is None
        assert resumed.missed() == 0
        assert [u.version_ts for u in resumed.read()] == [2, 3]
