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
