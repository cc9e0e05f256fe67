"""A late event on a job with no late-events topic, on the real broker, Redis and PyFlink.

PyFlink fails a task that emits to a side output nothing consumes ("Unknown OutputTag"),
and the job then restarts and reads its input again: found when a late event reached a job
run without ``kafka.late_events_topic``. The late event is sent once the watermark has passed
the others. Every record carries its event time as its Kafka timestamp, as a producer
stamping events at their source does: the watermark follows the Kafka timestamps, and with
send times as timestamps an on-time record read after the first watermark was already
behind it (CI once counted four of the five so). The LLM endpoint here is a closed port,
so every prompt is dead-lettered at once; what is checked is the event accounting.

A failed task restarts after 5 s and reads the input again, counting every record twice.
So an on-time event follows the late one on the same key: once it has an outcome, the
attempt that read the late event got past it, and the counts say whether any record was
read twice.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

import orjson
import redis
from confluent_kafka import Producer

from flink_jobs.tools.local_services import create_topics, free_port
from flink_jobs.tools.run_summary import is_settled, read_stats
from tests.support.job_process import JobProcess, job_groups
from tests.support.waiting import until

SETTLE_TIMEOUT_S = 300
#: How far ahead of the wall clock the event after the late one is stamped: the job applies
#: it when the watermark gets there.
AFTER_THE_LATE_ONE_AHEAD_MS = 15_000


def _view(event_id: str, shopper_id: str, time_ms: int) -> bytes:
    return orjson.dumps(
        {
            "event_id": event_id,
            "shopper_id": shopper_id,
            "event_type": "view",
            "event_time": datetime.fromtimestamp(time_ms / 1000, UTC).isoformat(),
            "product": {"product_id": "sku-737145", "title": "Trail running shoes"},
        }
    )


def test_a_late_event_without_a_late_topic_is_folded_and_counted_once(
    kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path
) -> None:
    name = unique_name
    create_topics(kafka_bootstrap, [f"{name}-events", f"{name}-dlq"], 1)
    # The newest on-time event is a second old, so the watermark passes it about a second
    # and a quarter after it is read (job.watermark_idle_advance_s plus its lag).
    t0 = int(time.time() * 1000) - 4 * 60_000 - 1_000
    times = [t0 + i * 60_000 for i in range(5)]
    records = [(_view(f"ev-on-time-{i}", "shopper-00001", t), t) for i, t in enumerate(times)]
    # Three minutes behind the watermark, within session.max_lateness_s (ten minutes).
    records.append((_view("ev-late", "shopper-00001", t0 + 60_000), t0 + 60_000))
    producer = Producer({"bootstrap.servers": kafka_bootstrap})

    def produce(batch: list[tuple[bytes, int]]) -> None:
        for record, time_ms in batch:
            producer.produce(f"{name}-events", record, key=b"k", timestamp=time_ms)
        assert producer.flush(30) == 0

    llm = {"base_url": f"http://127.0.0.1:{free_port()}/v1", "max_attempts": 1}
    groups = job_groups(name, kafka_bootstrap, redis_url, llm)
    client = redis.Redis.from_url(redis_url)
    job = JobProcess(groups, tmp_path / "job.log")

    def stats_once(check, what: str) -> dict[str, int]:
        seen: dict[str, dict[str, int]] = {}

        def checked() -> dict[str, int] | None:
            seen["stats"] = stats = read_stats(client, name)
            return stats if check(stats) else None

        return until(checked, what, **job.waits(SETTLE_TIMEOUT_S, state=lambda: seen.get("stats")))

    try:
        on_time = len(records) - 1
        produce(records[:on_time])
        stats_once(lambda stats: stats.get("events_accepted", 0) == on_time, "on-time events")
        # On time again, the newest event yet: stamped ahead of the wall clock (which a quiet
        # partition's watermark follows) by more than the job takes to read it.
        after = int(time.time() * 1000) + AFTER_THE_LATE_ONE_AHEAD_MS
        records.append((_view("ev-after-the-late-one", "shopper-00001", after), after))
        produce(records[on_time:])
        stats = stats_once(
            lambda stats: (
                is_settled(stats, len(records)) and stats.get("events_accepted", 0) >= on_time + 1
            ),
            "an outcome for the event after the late one",
        )
    finally:
        job.kill()

    assert stats["events_in"] == len(records), stats
    assert stats.get("events_behind_watermark") == 1, stats
    assert stats.get("events_late_folded") == 1, stats
