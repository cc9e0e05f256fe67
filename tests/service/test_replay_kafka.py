"""Replay the bundled sample into the session's broker and record it back: same bytes, same
keys, same timestamps, same order within a partition; a recording replays to the same."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Consumer, TopicPartition

from flink_jobs.tools.local_services import create_topics
from flink_jobs.tools.replay import (
    ReplayProgress,
    event_time_ms,
    main,
    plan_replay,
    read_records,
    record_topic,
    replay_records,
    write_recording,
)
from tests.support.waiting import until

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "data" / "sample_sessions.jsonl"

pytestmark = pytest.mark.timeout(180)


def test_replay_then_record_gives_back_identical_bytes(
    kafka_bootstrap: str, unique_name: str, tmp_path: Path
):
    topic = f"{unique_name}-events"
    create_topics(kafka_bootstrap, [topic], partitions=1)
    records = read_records(SAMPLE)
    plan = plan_replay(records)
    seen: list[ReplayProgress] = []

    summary = replay_records(kafka_bootstrap, topic, records, progress=seen.append)

    assert summary.ok, summary.describe(topic)
    assert summary.sent == len(records)
    assert summary.bytes == sum(len(r.value) for r in records)
    assert seen and seen[-1].sent == len(records)

    recorded = record_topic(kafka_bootstrap, topic, idle_s=3.0, timeout_s=120.0)
    assert recorded.stopped_by == "idle"
    assert [r.value for r in recorded.records] == [p.value for p in plan]
    assert [r.key for r in recorded.records] == [p.key for p in plan]
    assert [r.timestamp_ms for r in recorded.records] == [p.timestamp_ms for p in plan]

    # The recording replays to the same bytes, keys and timestamps.
    path = tmp_path / "recording.jsonl"
    write_recording(path, topic, recorded.records)
    copy_topic = f"{unique_name}-copy"
    create_topics(kafka_bootstrap, [copy_topic], partitions=1)
    assert replay_records(kafka_bootstrap, copy_topic, read_records(path)).ok
    again = record_topic(kafka_bootstrap, copy_topic, idle_s=3.0, timeout_s=120.0).records
    assert [(r.key, r.value, r.timestamp_ms) for r in again] == [
        (r.key, r.value, r.timestamp_ms) for r in recorded.records
    ]


def test_partitioned_topic_keeps_each_shoppers_order(kafka_bootstrap: str, unique_name: str):
    topic = f"{unique_name}-parts"
    create_topics(kafka_bootstrap, [topic], partitions=3)
    records = read_records(SAMPLE)[:600]
    assert replay_records(kafka_bootstrap, topic, records).ok

    recorded = record_topic(kafka_bootstrap, topic, idle_s=3.0, timeout_s=120.0)
    assert recorded.partitions == 3
    assert sorted(r.value for r in recorded.records) == sorted(r.value for r in records)

    def by_key(items):
        out = defaultdict(list)
        for key, value in items:
            if key is not None:
                out[key].append(value)
        return out

    plan = plan_replay(records)
    assert by_key((r.key, r.value) for r in recorded.records) == by_key(
        (p.key, p.value) for p in plan
    )
    partitions_of_key = defaultdict(set)
    for r in recorded.records:
        partitions_of_key[r.key].add(r.partition)
    assert all(len(parts) == 1 for key, parts in partitions_of_key.items() if key is not None)
    assert len({r.partition for r in recorded.records}) > 1


def test_cli_rate_paces_the_replay(kafka_bootstrap: str, unique_name: str, tmp_path: Path, capsys):
    topic = f"{unique_name}-cli"
    create_topics(kafka_bootstrap, [topic], partitions=1)
    path = tmp_path / "small.jsonl"
    path.write_bytes(b"".join(r.value + b"\n" for r in read_records(SAMPLE)[:40]))

    started = time.monotonic()
    code = main(
        ["replay", str(path), "--bootstrap", kafka_bootstrap, "--topic", topic, "--rate", "50"]
    )
    elapsed = time.monotonic() - started
    assert code == 0
    assert elapsed >= 39 / 50
    assert "sent 40, failed 0" in capsys.readouterr().err

    out = tmp_path / "recorded.jsonl"
    code = main(
        [
            "record",
            "--bootstrap",
            kafka_bootstrap,
            "--topic",
            topic,
            "--out",
            str(out),
            "--idle-timeout",
            "2",
        ]
    )
    assert code == 0
    assert [r.value for r in read_records(out)] == [r.value for r in read_records(path)]


def test_events_stamped_with_their_send_time_arrive_in_send_order_none_before_its_stamp(
    kafka_bootstrap: str, unique_name: str
):
    """Paced benchmarks measure latency from these stamps, so each record's Kafka timestamp
    is the time it is sent, and so is the event time of every event the replay rebases
    (the schema's refusals go out unchanged): they grow in send order whatever order the
    file's events were in, and no record arrives before its stamp. How late records arrive
    after their stamps is part of the pipeline_capacity bench's event-to-Redis figure."""
    topic = f"{unique_name}-stamped"
    create_topics(kafka_bootstrap, [topic], partitions=1)
    records = read_records(SAMPLE)
    unchanged = {r.value for r in records}
    consumer = Consumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": topic, "fetch.wait.max.ms": 20}
    )
    consumer.assign([TopicPartition(topic, 0, 0)])
    arrived: list[tuple[bytes, int, float]] = []  # (value, Kafka timestamp, arrival)
    stop = threading.Event()

    def consume() -> None:
        while not stop.is_set():
            message = consumer.poll(0.05)
            if message is not None and not message.error():
                arrived.append((message.value(), message.timestamp()[1], time.time()))

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    try:
        summary = replay_records(kafka_bootstrap, topic, records, rate=500, rebase_time="send")
        until(lambda: len(arrived) >= len(records), "every record to arrive", timeout_s=30,
              interval_s=0.05)  # fmt: skip
    finally:
        stop.set()
        reader.join(5)
        consumer.close()

    assert summary.ok, summary.describe(topic)
    assert len(arrived) == len(records)
    stamps = [stamp for _, stamp, _ in arrived]
    assert stamps == sorted(stamps)
    assert all(at >= stamp / 1000 for _, stamp, at in arrived), "a record came before its stamp"
    rebased = [(value, stamp) for value, stamp, _ in arrived if value not in unchanged]
    assert len(rebased) > len(records) // 2
    assert all(
        event_time_ms(orjson.loads(value)["event_time"]) == stamp for value, stamp in rebased
    )
