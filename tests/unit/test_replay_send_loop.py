"""Replay's send loop and its counts, over a stand-in for the Kafka producer (no broker):
what was produced, acknowledged and failed, by which error, reported as progress, in the
summary and in the Prometheus metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import confluent_kafka
import orjson
import pytest

from flink_jobs.tools.replay import ReplayMetrics, ReplayProgress, replay_records

T0 = 1_780_304_400_000  # 2026-06-01T09:00:00.000Z


def event(shopper: str, seconds: int) -> bytes:
    return orjson.dumps(
        {
            "event_id": f"e-{shopper}-{seconds}",
            "shopper_id": shopper,
            "event_type": "product_view",
            "event_time": f"2026-06-01T09:00:{seconds:02d}.000Z",
            "product": {"product_id": "sku-737145", "title": "Sonique Studio Pro Headphones"},
        }
    )


EVENTS = [event("shopper-00146", 0), event("shopper-00146", 4), event("shopper-00271", 9)]


class KafkaError:
    """What the producer hands a delivery callback on failure."""

    def __init__(self, name: str) -> None:
        self._name = name

    def name(self) -> str:
        return self._name

    def __str__(self) -> str:
        return f'KafkaError{{code={self._name},val=10,str="Broker: {self._name}"}}'


class Message:
    def __init__(self, value: bytes) -> None:
        self._value = value

    def value(self) -> bytes:
        return self._value


class FakeProducer:
    """``confluent_kafka.Producer`` as replay uses it: ``produce`` queues a record and
    ``poll``/``flush`` deliver what is queued through each record's callback. Records whose
    value is in ``rejected`` fail with that error; with ``stuck`` nothing is ever delivered;
    with ``full`` every ``produce`` finds the local queue full."""

    rejected: ClassVar[dict[bytes, str]] = {}
    stuck: ClassVar[bool] = False
    full: ClassVar[bool] = False
    made: ClassVar[list[FakeProducer]] = []

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.queued: list[tuple[bytes, Callable[[Any, Any], None]]] = []
        self.produced: list[tuple[str, bytes | None, bytes, int]] = []
        FakeProducer.made.append(self)

    def list_topics(self, topic: str, timeout: float) -> None:
        return None

    def produce(self, topic, value, key, timestamp, on_delivery) -> None:
        if self.full:
            raise BufferError("Local: Queue full")
        self.produced.append((topic, key, value, timestamp))
        self.queued.append((value, on_delivery))

    def poll(self, timeout: float) -> int:
        if self.stuck:
            return 0
        delivered, self.queued = self.queued, []
        for value, on_delivery in delivered:
            error = self.rejected.get(value)
            on_delivery(KafkaError(error) if error else None, Message(value))
        return len(delivered)

    def flush(self, timeout: float) -> int:
        self.poll(timeout)
        return len(self.queued)


@pytest.fixture
def producer(monkeypatch: pytest.MonkeyPatch) -> type[FakeProducer]:
    monkeypatch.setattr(FakeProducer, "rejected", {})
    monkeypatch.setattr(FakeProducer, "stuck", False)
    monkeypatch.setattr(FakeProducer, "full", False)
    monkeypatch.setattr(FakeProducer, "made", [])
    monkeypatch.setattr(confluent_kafka, "Producer", FakeProducer)
    return FakeProducer


def test_every_acknowledged_record_is_sent_with_its_bytes(producer) -> None:
    summary = replay_records("127.0.0.1:9092", "shopper-events", EVENTS)

    assert (summary.records, summary.sent, summary.failed) == (3, 3, 0)
    assert summary.bytes == sum(len(e) for e in EVENTS)
    assert summary.ok
    assert (summary.errors, summary.first_error) == ({}, None)


def test_records_go_to_the_topic_in_file_order_keyed_by_shopper(producer) -> None:
    replay_records("127.0.0.1:9092", "shopper-events", EVENTS)

    [made] = producer.made
    assert [(t, k, v) for t, k, v, _ in made.produced] == [
        ("shopper-events", b"shopper-00146", EVENTS[0]),
        ("shopper-events", b"shopper-00146", EVENTS[1]),
        ("shopper-events", b"shopper-00271", EVENTS[2]),
    ]
    assert [ts for *_, ts in made.produced] == [T0, T0 + 4_000, T0 + 9_000]


def test_a_rejected_record_is_counted_by_its_error_and_the_first_error_kept(producer) -> None:
    producer.rejected = {EVENTS[1]: "MSG_SIZE_TOO_LARGE", EVENTS[2]: "TOPIC_AUTHORIZATION_FAILED"}

    summary = replay_records("127.0.0.1:9092", "shopper-events", EVENTS)

    assert (summary.sent, summary.failed) == (1, 2)
    assert summary.bytes == len(EVENTS[0])
    assert summary.errors == {"MSG_SIZE_TOO_LARGE": 1, "TOPIC_AUTHORIZATION_FAILED": 1}
    assert "MSG_SIZE_TOO_LARGE" in summary.first_error
    assert not summary.ok


def test_a_local_queue_that_stays_full_fails_each_record_without_raising(producer) -> None:
    producer.full = True

    summary = replay_records("127.0.0.1:9092", "shopper-events", EVENTS, flush_timeout_s=0.0)

    assert (summary.sent, summary.failed) == (0, 3)
    assert summary.errors == {"LOCAL_QUEUE_FULL": 3}
    assert summary.first_error == "local producer queue stayed full"


def test_records_still_queued_at_the_flush_timeout_are_counted_as_not_delivered(
    producer,
) -> None:
    producer.stuck = True

    summary = replay_records("127.0.0.1:9092", "shopper-events", EVENTS, flush_timeout_s=0.0)

    assert (summary.sent, summary.failed) == (0, 3)
    assert summary.errors == {"NOT_DELIVERED_BEFORE_FLUSH_TIMEOUT": 3}
    assert summary.first_error == "3 records not delivered within 0.0 s"


def test_the_last_progress_report_matches_the_summary(producer) -> None:
    producer.rejected = {EVENTS[0]: "MSG_SIZE_TOO_LARGE"}
    reports: list[ReplayProgress] = []

    summary = replay_records("127.0.0.1:9092", "shopper-events", EVENTS, progress=reports.append)

    last = reports[-1]
    assert (last.total, last.produced, last.sent, last.failed) == (3, 3, 2, 1)
    assert last.bytes == summary.bytes


def test_progress_is_reported_at_most_once_per_interval_then_once_at_the_end(producer) -> None:
    reports: list[ReplayProgress] = []

    replay_records(
        "127.0.0.1:9092", "shopper-events", EVENTS, progress=reports.append,
        progress_interval_s=3600.0,
    )  # fmt: skip

    assert len(reports) == 1


def test_the_metrics_mirror_the_counts(producer) -> None:
    producer.rejected = {EVENTS[2]: "MSG_SIZE_TOO_LARGE"}
    metrics = ReplayMetrics()

    replay_records("127.0.0.1:9092", "shopper-events", EVENTS, metrics=metrics)

    value = metrics.registry.get_sample_value
    assert value("shopper_intents_replay_records_planned") == 3
    assert value("shopper_intents_replay_records_produced_total") == 3
    assert value("shopper_intents_replay_records_sent_total") == 2
    assert value("shopper_intents_replay_bytes_sent_total") == len(EVENTS[0]) + len(EVENTS[1])
    failed = value("shopper_intents_replay_records_failed_total", {"error": "MSG_SIZE_TOO_LARGE"})
    assert failed == 1


def test_with_send_stamps_the_planning_counts_as_time_already_passed(monkeypatch) -> None:
    """Records stamped at ``T0`` and planned until 2.5 s later: the replay clock starts at
    ``T0``, so the first 2.5 s of records are due at once, not 2.5 s late for their stamps."""
    from types import SimpleNamespace

    from flink_jobs.tools import replay

    monkeypatch.setattr(
        replay, "time", SimpleNamespace(monotonic=lambda: 100.0, time=lambda: T0 / 1000 + 2.5)
    )

    assert replay._replay_clock_start(T0) == 97.5
    assert replay._replay_clock_start(None) == 100.0  # no stamps: the clock starts now
