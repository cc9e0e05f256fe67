"""The figures a run's summary reports from the job's samples."""

from __future__ import annotations

import math

from flink_jobs.tools.run_summary import latency_summary


def test_a_latency_summary_gives_the_count_the_percentiles_and_the_worst() -> None:
    samples_ms = [100 * i for i in range(1, 101)]  # 0.1 s .. 10.0 s

    assert latency_summary(samples_ms) == {
        "n": 100,
        "p50": 5.0,
        "p90": 9.0,
        "p99": 9.9,
        "max": 10.0,
    }


def test_a_latency_summary_of_no_samples_says_so() -> None:
    summary = latency_summary([])

    assert summary["n"] == 0
    assert all(math.isnan(summary[k]) for k in ("p50", "p90", "p99", "max"))


class _StatsHash:
    """A stats hash that shows ``task_starts`` after ``reads_before`` reads."""

    def __init__(self, reads_before: int) -> None:
        self.reads = 0
        self.reads_before = reads_before

    def hgetall(self, _key):
        self.reads += 1
        return {b"task_starts": b"1"} if self.reads > self.reads_before else {}


def test_waiting_for_task_starts_returns_once_the_job_counted_them():
    from flink_jobs.tools.run_summary import wait_for_task_starts

    assert wait_for_task_starts(_StatsHash(2), "p", 1, timeout_s=5, poll_s=0)


def test_waiting_for_task_starts_gives_up_when_the_job_is_gone():
    from flink_jobs.tools.run_summary import wait_for_task_starts

    assert not wait_for_task_starts(_StatsHash(10**6), "p", 1, timeout_s=60, alive=lambda: False)


def test_waiting_for_task_starts_gives_up_after_the_timeout():
    from flink_jobs.tools.run_summary import wait_for_task_starts

    assert not wait_for_task_starts(_StatsHash(10**6), "p", 1, timeout_s=0.05, poll_s=0.01)
