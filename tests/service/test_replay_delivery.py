"""The replay tool's delivery against a Kafka address where nothing listens: failures
are counted, not raised, and exported with the plan on its metrics endpoint (planning and
file formats, without a broker, are in ``tests/unit/test_replay.py``)."""

from __future__ import annotations

import urllib.request

from flink_jobs.tools.replay import replay_records
from tests.support.builders import raw_event


def event(shopper: str = "s1", seconds: float = 0.0, event_id: str | None = None, **extra) -> bytes:
    return raw_event(shopper, seconds, event_id=event_id, **{"query": "running shoes", **extra})


MALFORMED = b'{"event_id": "x", "shopper_id": "s9"'


class TestShell:
    def test_delivery_failures_are_counted_not_raised(self):
        # Nothing listens on port 1: every record times out in the local queue.
        summary = replay_records(
            "127.0.0.1:1",
            "nowhere",
            [event("a"), MALFORMED],
            extra_config={"message.timeout.ms": 500, "enable.idempotence": False, "log_level": 0},
            flush_timeout_s=10.0,
        )
        assert summary.records == 2
        assert summary.sent == 0
        assert summary.failed == 2
        assert not summary.ok
        assert summary.errors
        assert "failed 2" in summary.describe("nowhere")


class TestMetrics:
    def test_failures_and_the_plan_are_exported(self):
        from prometheus_client.parser import text_string_to_metric_families

        from flink_jobs.tools.local_services import free_port
        from flink_jobs.tools.replay import ReplayMetrics

        metrics = ReplayMetrics()
        port = free_port()
        server = metrics.serve(port)
        try:
            replay_records(
                "127.0.0.1:1",  # nothing listens: both records time out
                "nowhere",
                [event("a"), MALFORMED],
                extra_config={
                    "message.timeout.ms": 500,
                    "enable.idempotence": False,
                    "log_level": 0,
                },
                flush_timeout_s=10.0,
                metrics=metrics,
            )
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        finally:
            server.shutdown()
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples
        }
        assert samples[("shopper_intents_replay_records_planned", ())] == 2
        assert samples[("shopper_intents_replay_records_produced_total", ())] == 2
        assert samples[("shopper_intents_replay_records_sent_total", ())] == 0
        failed = {
            labels: v
            for (name, labels), v in samples.items()
            if name == "shopper_intents_replay_records_failed_total"
        }
        assert sum(failed.values()) == 2
        assert all(dict(labels)["error"] for labels in failed)
