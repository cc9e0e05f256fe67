"""The capacity benchmark's floor job (``bench/pyflink_floor.py``) does what it stands for.

``bench.pipeline_capacity`` quotes the floor's drain rate beside the job's as what PyFlink
alone allows a job of the same shape. That holds only if each of its events really goes
from the job's Kafka source through a keyed Python operator, keyed state and an
event-time timer (behind the job's own decoder in ``job_decode``, and with the job's own
state in ``job_state``). Run bounded, on the real broker, Redis and PyFlink.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

import orjson
import pytest
import redis
from confluent_kafka import Producer

from flink_jobs.tools.local_services import create_topics
from flink_jobs.tools.run_summary import read_stats
from tests.support.job_process import JobProcess, job_groups

EVENTS = 300
SHOPPERS = 30


@pytest.mark.parametrize("shape", ["state_timer", "job_decode", "job_state"])
def test_every_event_passes_keyed_state_and_fires_its_own_timer(
    shape: str, kafka_bootstrap: str, redis_url: str, unique_name: str, tmp_path
) -> None:
    name = unique_name
    create_topics(kafka_bootstrap, [f"{name}-events", f"{name}-dlq"], 1)
    t0 = int(time.time() * 1000) - 10 * 60_000
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(EVENTS):
        shopper = f"shopper-{i % SHOPPERS:05d}"
        event = {
            "event_id": f"ev-{i}",
            "shopper_id": shopper,
            "event_type": "view",
            "event_time": datetime.fromtimestamp((t0 + i) / 1000, UTC).isoformat(),
            "product": {"product_id": f"sku-{i:06d}", "title": "Trail running shoes"},
        }
        producer.produce(f"{name}-events", orjson.dumps(event), key=shopper, timestamp=t0 + i)
        # One record per batch: Tansu 0.6 reports a partition's end offset as its last
        # batch's first offset + 1, and a bounded job stops there (docs/event_time.md).
        assert producer.flush(30) == 0

    groups = job_groups(name, kafka_bootstrap, redis_url, {})
    groups["kafka"]["bounded"] = True
    job = JobProcess(groups, tmp_path / "floor.log", ("-m", "bench.pyflink_floor", shape))
    try:
        assert job.wait(timeout_s=240) == 0, job.log_text()[-3000:]
    finally:
        job.kill()
    stats = read_stats(redis.Redis.from_url(redis_url), name)
    assert (
        stats.get("events_in"),
        stats.get("events_accepted"),
        stats.get("floor_timers_fired"),
    ) == (EVENTS, EVENTS, EVENTS)
