"""The versioned intent write against a real Redis (its pure protocol is in
``tests/unit/test_intent_store.py``).

The invariant under test: an older intent never overwrites a newer one, whatever the
order or concurrency of the writers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import shutil
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import redis
import redis.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flink_jobs.runtime.intent_store import (
    DEFAULT_TTL_MS,
    AsyncIntentStore,
    IntentStore,
    IntentStoreError,
    StoreUnavailableError,
    is_newer,
)
from flink_jobs.tools.local_services import free_port, start_redis
from tests.support.builders import versioned_record
from tests.support.waiting import until

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def prefix(unique_name: str) -> str:
    return unique_name


@pytest.fixture
def store(redis_client: redis.Redis, prefix: str) -> IntentStore:
    return IntentStore(redis_client, prefix=prefix)


# --- against Redis -----------------------------------------------------------------------


class TestUpsert:
    def test_first_write_stores_every_field(self, store: IntentStore) -> None:
        record = versioned_record(ts=1_700_000_000_000, seq=3)
        assert store.upsert(record) is True
        stored = store.read(record.shopper_id)
        assert stored is not None
        assert stored.version == (1_700_000_000_000, 3)
        assert stored.intent == orjson.loads(record.intent_json)
        assert (stored.top_label, stored.top_confidence, stored.summary) == (
            "compare",
            0.8,
            "1700000000000.3",
        )
        assert (stored.template, stored.template_hash, stored.model) == (
            "intent_v1",
            "abc123",
            "smollm2-135m",
        )
        assert stored.event_time_ms == record.event_time_ms
        assert stored.written_at_ms > 1_600_000_000_000

    def test_key_is_a_hash_under_the_prefix(
        self, store: IntentStore, redis_client: redis.Redis, prefix: str
    ) -> None:
        store.upsert(versioned_record("s-9"))
        assert redis_client.type(f"{prefix}:intent:s-9") == b"hash"
        assert redis_client.hmget(f"{prefix}:intent:s-9", "top_label", "version_seq") == [
            b"compare",
            b"0",
        ]

    @pytest.mark.parametrize(
        ("first", "second"),
        [((1_000, 0), (2_000, 0)), ((1_000, 0), (1_000, 1)), ((1_000, 9), (1_001, 0))],
    )
    def test_newer_overwrites_older(
        self, store: IntentStore, first: tuple[int, int], second: tuple[int, int]
    ) -> None:
        assert store.upsert(versioned_record(ts=first[0], seq=first[1]))
        assert store.upsert(versioned_record(ts=second[0], seq=second[1])) is True
        stored = store.read("shopper-1")
        assert stored is not None
        assert stored.version == second
        assert stored.summary == f"{second[0]}.{second[1]}"

    @pytest.mark.parametrize(
        ("newer", "older"),
        [
            ((2_000, 0), (1_000, 0)),  # older event time
            ((2_000, 0), (1_999, 99)),  # older event time, higher sequence
            ((2_000, 5), (2_000, 4)),  # same event time, lower sequence
        ],
    )
    def test_older_never_overwrites_newer(
        self, store: IntentStore, newer: tuple[int, int], older: tuple[int, int]
    ) -> None:
        assert store.upsert(versioned_record(ts=newer[0], seq=newer[1]))
        assert store.upsert(versioned_record(ts=older[0], seq=older[1])) is False
        stored = store.read("shopper-1")
        assert stored is not None
        assert stored.version == newer
        assert stored.summary == f"{newer[0]}.{newer[1]}"

    def test_equal_version_is_a_no_op(self, store: IntentStore, redis_client: redis.Redis) -> None:
        assert store.upsert(versioned_record(ts=5_000, seq=2))
        before = redis_client.hgetall(store.key("shopper-1"))
        changed = dataclasses.replace(versioned_record(ts=5_000, seq=2), summary="changed")
        assert store.upsert(changed) is False
        assert redis_client.hgetall(store.key("shopper-1")) == before

    def test_ttl_is_set(self, store: IntentStore, redis_client: redis.Redis) -> None:
        store.upsert(versioned_record())
        pttl = redis_client.pttl(store.key("shopper-1"))
        assert DEFAULT_TTL_MS - 60_000 < pttl <= DEFAULT_TTL_MS

    def test_custom_ttl_is_extended_by_landed_and_refused_writes(
        self, redis_client: redis.Redis, prefix: str
    ) -> None:
        short = IntentStore(redis_client, prefix=prefix, ttl_ms=60_000)
        long = IntentStore(redis_client, prefix=prefix, ttl_ms=10 * 60_000)
        short.upsert(versioned_record(ts=2_000))
        assert 50_000 < redis_client.pttl(short.key("shopper-1")) <= 60_000
        long.upsert(versioned_record(ts=1_000))  # refused: extends the expiry all the same
        assert redis_client.pttl(short.key("shopper-1")) > 60_000
        long.upsert(versioned_record(ts=3_000))  # accepted: the expiry is reset
        assert redis_client.pttl(short.key("shopper-1")) > 60_000

    def test_expired_intent_is_gone(self, redis_client: redis.Redis, prefix: str) -> None:
        store = IntentStore(redis_client, prefix=prefix, ttl_ms=50)
        store.upsert(versioned_record())
        until(
            lambda: store.read("shopper-1") is None,
            "the intent to expire",
            timeout_s=2.0,
            interval_s=0.02,
        )

    def test_read_missing_shopper(self, store: IntentStore) -> None:
        assert store.read("nobody") is None


class TestUpsertMany:
    def test_batch_reports_per_record(self, store: IntentStore) -> None:
        records = [
            versioned_record("a", ts=10),
            versioned_record("b", ts=10),
            versioned_record("a", ts=5),  # older than the first, same batch
            versioned_record("a", ts=20),
            versioned_record("b", ts=10),  # equal
        ]
        assert store.upsert_many(records) == [True, True, False, True, False]
        assert store.read("a").version == (20, 0)  # type: ignore[union-attr]
        assert store.read("b").version == (10, 0)  # type: ignore[union-attr]

    def test_empty_batch(self, store: IntentStore) -> None:
        assert store.upsert_many([]) == []

    def test_recovers_when_the_server_forgot_the_script(
        self, store: IntentStore, redis_client: redis.Redis
    ) -> None:
        store.upsert(versioned_record(ts=1))
        redis_client.script_flush()  # as after a Redis restart
        assert store.upsert_many([versioned_record(ts=2), versioned_record("other", ts=1)]) == [
            True,
            True,
        ]
        assert store.read("shopper-1").version == (2, 0)  # type: ignore[union-attr]

    def test_wrong_type_key_raises_store_error(
        self, store: IntentStore, redis_client: redis.Redis
    ) -> None:
        redis_client.set(store.key("broken"), "not a hash")
        with pytest.raises(IntentStoreError, match="broken"):
            store.upsert_many([versioned_record("fine"), versioned_record("broken")])

    def test_unreachable_redis_raises_unavailable(self) -> None:
        client = redis.Redis(port=free_port(), socket_connect_timeout=0.5)
        with pytest.raises(StoreUnavailableError):
            IntentStore(client).upsert(versioned_record())


class TestRedisRestart:
    def test_store_recovers_after_a_restart(self, tmp_path: Path) -> None:
        """A restart drops connections and the script cache; the store reports, then recovers."""
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed")
        with start_redis(workdir=tmp_path) as service:
            client = redis.Redis.from_url(service.url, socket_timeout=2)
            store = IntentStore(client)
            assert store.upsert(versioned_record(ts=1))

            service.restart()

            outcomes = []
            for _ in range(3):  # the first call may meet the dead pooled connection
                try:
                    outcomes.append(store.upsert(versioned_record(ts=2)))
                    break
                except StoreUnavailableError:
                    outcomes.append("unavailable")
            assert outcomes[-1] is True
            assert store.read("shopper-1").version == (2, 0)  # type: ignore[union-attr]
            client.close()


class TestAsyncStore:
    def test_same_protocol_over_asyncio(self, redis_url: str, prefix: str) -> None:
        async def scenario() -> None:
            client = redis.asyncio.Redis.from_url(redis_url)
            try:
                store = AsyncIntentStore(client, prefix=prefix, ttl_ms=30_000)
                written = await store.upsert_many(
                    [versioned_record(ts=2), versioned_record(ts=1), versioned_record(ts=2, seq=1)]
                )
                assert written == [True, False, True]
                assert await store.upsert(versioned_record(ts=2)) is False
                await client.script_flush()
                assert await store.upsert(versioned_record(ts=3)) is True
                stored = await store.read("shopper-1")
                assert stored is not None
                assert stored.version == (3, 0)
                assert 0 < await client.pttl(store.key("shopper-1")) <= 30_000
                assert await store.read("nobody") is None
            finally:
                await client.aclose()

        asyncio.run(scenario())


# --- concurrent writers ------------------------------------------------------------------

SHOPPERS = [f"shopper-{i}" for i in range(5)]
VERSIONS = [(ts, seq) for ts in range(1_000, 1_010) for seq in range(4)]

WRITER_SCRIPT = textwrap.dedent(
    """
    import json, random, sys
    import redis
    from flink_jobs.runtime.intent_store import IntentRecord, IntentStore

    url, prefix, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    shoppers, versions = json.loads(sys.stdin.read())
    rng = random.Random(seed)
    work = [(s, ts, seq) for s in shoppers for ts, seq in versions]
    rng.shuffle(work)
    store = IntentStore(redis.Redis.from_url(url), prefix=prefix)
    for start in range(0, len(work), 7):
        store.upsert_many([
            IntentRecord(s, ts, seq, "{}", "x", 0.5, f"{ts}.{seq}", ts, "t", "h", "m")
            for s, ts, seq in work[start:start + 7]
        ])
    """
)


def _shuffled_writes(redis_url: str, prefix: str, seed: int) -> None:
    rng = random.Random(seed)
    work = [(s, ts, seq) for s in SHOPPERS for ts, seq in VERSIONS]
    rng.shuffle(work)
    client = redis.Redis.from_url(redis_url)
    try:
        store = IntentStore(client, prefix=prefix)
        for shopper, ts, seq in work:
            store.upsert(versioned_record(shopper, ts, seq))
    finally:
        client.close()


def _assert_max_version_stored(store: IntentStore) -> None:
    top = max(VERSIONS)
    for shopper in SHOPPERS:
        stored = store.read(shopper)
        assert stored is not None
        assert stored.version == top
        assert stored.summary == f"{top[0]}.{top[1]}"


class TestConcurrentWriters:
    def test_threads_with_shuffled_versions_end_at_the_max(
        self, redis_url: str, store: IntentStore, prefix: str
    ) -> None:
        seen: dict[str, list[tuple[int, int]]] = {s: [] for s in SHOPPERS}
        stop = threading.Event()

        def watch() -> None:  # the stored version of a shopper never goes back
            while not stop.is_set():
                for shopper in SHOPPERS:
                    stored = store.read(shopper)
                    if stored is not None:
                        seen[shopper].append(stored.version)

        watcher = threading.Thread(target=watch)
        watcher.start()
        writers = [
            threading.Thread(target=_shuffled_writes, args=(redis_url, prefix, seed))
            for seed in range(6)
        ]
        for w in writers:
            w.start()
        for w in writers:
            w.join(timeout=60)
        stop.set()
        watcher.join(timeout=10)
        assert not any(w.is_alive() for w in writers)

        _assert_max_version_stored(store)
        for versions in seen.values():
            assert versions == sorted(versions)

    def test_processes_with_shuffled_versions_end_at_the_max(
        self, redis_url: str, store: IntentStore, prefix: str
    ) -> None:
        payload = json.dumps([SHOPPERS, VERSIONS])
        workers = [
            subprocess.Popen(
                [sys.executable, "-c", WRITER_SCRIPT, redis_url, prefix, str(seed)],
                stdin=subprocess.PIPE,
                cwd=REPO_ROOT,
                text=True,
            )
            for seed in range(4)
        ]
        for worker in workers:
            assert worker.stdin is not None
            worker.stdin.write(payload)
            worker.stdin.close()
        codes = [worker.wait(timeout=120) for worker in workers]
        assert codes == [0] * len(workers)
        _assert_max_version_stored(store)


# --- the ordering rule, generated --------------------------------------------------------


@pytest.fixture(scope="module")
def module_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


version_st = st.tuples(st.integers(0, 5), st.integers(0, 3))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(versions=st.lists(version_st, min_size=1, max_size=12))
def test_any_write_order_keeps_the_lexicographic_max(
    module_client: redis.Redis, versions: list[tuple[int, int]]
) -> None:
    store = IntentStore(module_client, prefix=f"h{uuid.uuid4().hex[:10]}")
    written = store.upsert_many([versioned_record(ts=ts, seq=seq) for ts, seq in versions])

    best: tuple[int, int] | None = None
    for version, did_write in zip(versions, written, strict=True):
        assert did_write is is_newer(version, best)
        if did_write:
            best = version
    stored = store.read("shopper-1")
    assert stored is not None
    assert stored.version == max(versions)
    assert stored.summary == "{}.{}".format(*max(versions))
