"""How far a consumer group has got through a topic, on the real broker: the judge of
"every record was read" in the restart and rescale tests, which a wrong end offset turns
into a wait that never ends."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from flink_jobs.tools.local_services import create_topics
from flink_jobs.tools.run_summary import group_lag, group_progress


@pytest.fixture
def topic(kafka_bootstrap: str) -> str:
    name = f"progress-{time.monotonic_ns()}"
    create_topics(kafka_bootstrap, [name], 1)
    return name


def _write_in_one_request(bootstrap: str, topic: str, count: int) -> None:
    """``count`` records that the producer sends as one batch (it lingers for them)."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 500})
    for i in range(count):
        producer.produce(topic, b'{"n": %d}' % i, partition=0)
    assert producer.flush(30) == 0


def _commit(bootstrap: str, group: str, topic: str, offset: int) -> None:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        consumer.commit(offsets=[TopicPartition(topic, 0, offset)], asynchronous=False)
    finally:
        consumer.close()


def test_records_written_in_one_request_all_count_in_the_topic(kafka_bootstrap, topic):
    _write_in_one_request(kafka_bootstrap, topic, 7)

    assert group_progress(kafka_bootstrap, "nobody", topic) == (0, 7)


def test_the_lag_is_zero_once_the_group_committed_every_record(kafka_bootstrap, topic):
    _write_in_one_request(kafka_bootstrap, topic, 7)
    _commit(kafka_bootstrap, f"{topic}-group", topic, 7)

    assert group_lag(kafka_bootstrap, f"{topic}-group", topic) == 0


def test_the_lag_counts_the_records_past_the_groups_commit(kafka_bootstrap, topic):
    _write_in_one_request(kafka_bootstrap, topic, 7)
    _commit(kafka_bootstrap, f"{topic}-group", topic, 3)

    assert group_lag(kafka_bootstrap, f"{topic}-group", topic) == 4
