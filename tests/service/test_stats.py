"""Outcome counters published to one Redis hash: counted in memory, added with HINCRBY on
flush (by a background thread and on close), never lost while Redis is away, and never
added twice when Redis applied a flush whose reply was lost."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from flink_jobs.runtime.counters import MAX_SAMPLES, StatsReporter, stats_key
from flink_jobs.tools import local_services
from flink_jobs.tools.run_summary import read_samples
from tests.support.waiting import until

SLOW_FLUSH_S = 60.0  # long enough that only explicit flushes and close() publish


@pytest.fixture
def reporter(redis_url: str, unique_name: str) -> Iterator[StatsReporter]:
    reporter = StatsReporter(redis_url, unique_name, flush_interval_s=SLOW_FLUSH_S)
    try:
        yield reporter
    finally:
        reporter.close()


def published(client: redis.Redis, prefix: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in client.hgetall(stats_key(prefix)).items()}


class TestFlush:
    def test_counts_are_added_to_the_hash(
        self, reporter: StatsReporter, redis_client: redis.Redis, unique_name: str
    ) -> None:
        reporter.add("events_in", 5)
        reporter.add("events_accepted", 4)
        reporter.add("dead_letter_decode")

        reporter.flush()

        assert published(redis_client, unique_name) == {
            "events_in": 5,
            "events_accepted": 4,
            "dead_letter_decode": 1,
        }

    def test_nothing_is_published_before_a_flush(
        self, reporter: StatsReporter, redis_client: redis.Redis, unique_name: str
    ) -> None:
        reporter.add("events_in", 3)

        assert published(redis_client, unique_name) == {}

    def test_successive_flushes_add_deltas(
        self, reporter: StatsReporter, redis_client: redis.Redis, unique_name: str
    ) -> None:
        reporter.add("events_in", 2)
        reporter.flush()
        reporter.add("events_in", 3)
        reporter.flush()
        reporter.flush()  # nothing pending: adds nothing

        assert published(redis_client, unique_name) == {"events_in": 5}

    def test_reporters_of_several_operators_sum_in_one_hash(
        self, redis_url: str, redis_client: redis.Redis, unique_name: str
    ) -> None:
        reporters = [StatsReporter(redis_url, unique_name, SLOW_FLUSH_S) for _ in range(3)]
        for i, r in enumerate(reporters, start=1):
            r.add("llm_calls", i)
            r.close()

        assert published(redis_client, unique_name) == {"llm_calls": 6}

    def test_background_thread_flushes_on_its_interval(
        self, redis_url: str, redis_client: redis.Redis, unique_name: str
    ) -> None:
        reporter = StatsReporter(redis_url, unique_name, flush_interval_s=0.02)
        try:
            reporter.add("intents_written", 2)
            until(
                lambda: published(redis_client, unique_name),
                "the reporter's thread to flush",
                timeout_s=2.0,
            )

            assert published(redis_client, unique_name) == {"intents_written": 2}
        finally:
            reporter.close()


class TestSamples:
    def test_samples_are_appended_to_a_list_per_name(
        self, reporter: StatsReporter, redis_client: redis.Redis, unique_name: str
    ) -> None:
        for value in (120, 80, 3000):
            reporter.sample("llm_latency_ms", value)

        reporter.flush()

        assert read_samples(redis_client, unique_name, "llm_latency_ms") == [120, 80, 3000]

    def test_only_the_newest_samples_are_kept(
        self, reporter: StatsReporter, redis_client: redis.Redis, unique_name: str
    ) -> None:
        for batch in range(3):
            for i in range(MAX_SAMPLES // 2):
                reporter.sample("event_to_intent_ms", batch * MAX_SAMPLES + i)
            reporter.flush()

        kept = read_samples(redis_client, unique_name, "event_to_intent_ms")
        assert len(kept) == MAX_SAMPLES
        assert kept[-1] == 2 * MAX_SAMPLES + MAX_SAMPLES // 2 - 1


class TestClose:
    def test_close_flushes_what_is_pending(
        self, redis_url: str, redis_client: redis.Redis, unique_name: str
    ) -> None:
        reporter = StatsReporter(redis_url, unique_name, flush_interval_s=SLOW_FLUSH_S)
        reporter.add("events_late_dropped", 7)

        closing = threading.Thread(target=reporter.close, daemon=True)
        closing.start()
        closing.join(timeout=SLOW_FLUSH_S / 6)

        assert not closing.is_alive(), "close waits out the flush interval"
        assert published(redis_client, unique_name) == {"events_late_dropped": 7}


class TestRedisAway:
    @pytest.mark.parametrize("publish", ["flush", "close"])
    def test_counts_survive_an_outage_and_are_published_after_it(
        self, tmp_path: Path, unique_name: str, publish: str
    ) -> None:
        """By the next flush, or by close(), which flushes once and must publish both the
        batch the outage held back and what was counted after it."""
        private = local_services.start_redis(workdir=tmp_path / "redis")
        reporter = StatsReporter(private.url, unique_name, flush_interval_s=SLOW_FLUSH_S)
        try:
            reporter.add("events_in", 4)
            private.stop()

            reporter.flush()  # fails quietly and keeps the deltas
            reporter.add("events_in", 1)

            private.start()
            getattr(reporter, publish)()
            client = redis.Redis.from_url(private.url)
            try:
                assert published(client, unique_name) == {"events_in": 5}
            finally:
                client.close()
        finally:
            reporter.close()
            private.stop()

    def test_a_flush_redis_applied_but_never_answered_is_not_added_again(
        self, reporter: StatsReporter, redis_client: redis.Redis, unique_name: str, monkeypatch
    ) -> None:
        """Redis restarted (or the connection dropped) after it ran the batch and before
        the reply came back: the reporter cannot tell, sends the batch again, and Redis
        must not count it twice."""
        client = reporter._client  # the reporter's own connection, to lose one reply on
        real_pipeline = client.pipeline

        def pipeline_losing_its_reply(*args, **kwargs):
            pipe = real_pipeline(*args, **kwargs)
            execute = pipe.execute

            def execute_then_lose_the_reply(*a, **kw):
                execute(*a, **kw)
                raise redis.ConnectionError("connection closed before the reply")

            pipe.execute = execute_then_lose_the_reply
            return pipe

        reporter.add("events_in", 3)
        reporter.add("events_accepted", 3)
        monkeypatch.setattr(client, "pipeline", pipeline_losing_its_reply)
        reporter.flush()  # applied by Redis, failed for the reporter
        monkeypatch.undo()
        reporter.add("events_in", 2)
        reporter.flush()

        assert published(redis_client, unique_name) == {"events_in": 5, "events_accepted": 3}
