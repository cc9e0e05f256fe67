"""A late event on a job with no late-events topic, on the real broker, Redis and PyFlink.

PyFlink fails a task that emits to a side output nothing consumes ("Unknown OutputTag"),
and the job then restarts and reads its input again: found when a late event reached a job
run without ``kafka.late_events_topic``. The late event is sent once the watermark has passed
the others. Every record carries its event time as its Kafka timestamp, as a producer
stamping events at their source does: the watermark follows the Kafka timestamps, and with
send times as timestamps an on-time record read after the first watermark was already
behind it (CI once counted four of the five so). The LLM endpoint here is a closed port,
so every prompt is dead-lettered at once; what is checked is the event accounting.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

import orjson
import redis
from confluent_kafka import Producer

from flink_jobs.tools.local_services import create_topics, free_port
from flink_jobs.tools.run_summary import is_settled, read_stats
from tests.service.job_process import JobProcess, job_groups

SETTLE_TIMEOUT_S = 300


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

    def wait_for(check, what: str) -> dict[str, int]:
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while not check(stats := read_stats(client, name)):
            assert job.running(), f"the job ended: {stats}\n{job.log_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no {what}: {stats}"
            time.sleep(0.5)
        return stats

    try:
        produce(records[:-1])
        on_time = len(records) - 1
        wait_for(lambda stats: stats.get("events_accepted", 0) == on_time, "on-time events")
        produce(records[-1:])
        stats = wait_for(lambda stats: is_settled(stats, len(records)), "settled run")
        time.sleep(12)  # a failed task restarts after 5 s and reads the input again
        stats = read_stats(client, name)
    finally:
        job.kill()

    assert stats["events_in"] == len(records), stats
    assert stats.get("events_behind_watermark") == 1, stats
    assert stats.get("events_late_folded") == 1, stats
