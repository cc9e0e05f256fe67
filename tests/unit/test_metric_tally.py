"""metrics.GaugeCounters: the async operator's Flink metrics, kept in Python, read as gauges."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from flink_jobs.metrics import GaugeCounters, Tally, gauge_names


class FakeGroup:
    """What PyFlink's metric group does with a gauge: keeps the callable, reads it later."""

    def __init__(self) -> None:
        self.gauges: dict[str, Callable[[], int]] = {}

    def gauge(self, name: str, obj: Callable[[], int]) -> None:
        self.gauges[name] = obj

    def read(self) -> dict[str, int]:
        return {name: fn() for name, fn in self.gauges.items()}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_register_adds_a_gauge_per_count_and_timing_statistic() -> None:
    group = FakeGroup()
    names = Tally(["written", "stale"], ["latency_ms"]).register(group)
    assert names == gauge_names(["written", "stale"], ["latency_ms"])
    assert list(group.gauges) == [
        "written",
        "stale",
        "latency_ms_count",
        "latency_ms_sum",
        "latency_ms_p50",
        "latency_ms_p95",
        "latency_ms_max",
    ]
    assert set(group.read().values()) == {0}


def test_counts_accumulate_and_gauges_read_them() -> None:
    group = FakeGroup()
    tally = Tally(["written"])
    tally.register(group)
    tally.add("written")
    tally.add("written", 4)
    assert group.read() == {"written": 5}


def test_timings_give_count_sum_and_recent_quantiles() -> None:
    group = FakeGroup()
    tally = Tally([], ["latency_ms"])
    tally.register(group)
    for value in range(1, 101):  # 1..100 ms
        tally.observe("latency_ms", value)
    assert group.read() == {
        "latency_ms_count": 100,
        "latency_ms_sum": 5050,
        "latency_ms_p50": 50,
        "latency_ms_p95": 95,
        "latency_ms_max": 100,
    }


def test_quantiles_cover_only_the_window_while_totals_keep_growing() -> None:
    clock = Clock()
    tally = Tally([], ["latency_ms"], window_s=60, clock=clock)
    tally.observe("latency_ms", 5_000)
    clock.now += 61
    tally.observe("latency_ms", 20)
    assert tally.timing("latency_ms", "max") == 20
    assert tally.timing("latency_ms", "count") == 2
    assert tally.timing("latency_ms", "sum") == 5_020
    clock.now += 61
    assert tally.timing("latency_ms", "p95") == 0  # nothing recent


def test_negative_samples_count_as_zero() -> None:
    tally = Tally([], ["freshness_ms"])
    tally.observe("freshness_ms", -30)  # a producer clock ahead of ours
    assert tally.timing("freshness_ms", "max") == 0
    assert tally.timing("freshness_ms", "sum") == 0


def test_unknown_names_raise() -> None:
    tally = Tally(["written"], ["latency_ms"])
    with pytest.raises(KeyError):
        tally.add("writen")
    with pytest.raises(KeyError):
        tally.observe("latncy_ms", 1)


def test_updates_from_many_threads_are_not_lost() -> None:
    tally = Tally(["written"], ["latency_ms"])

    def work() -> None:
        for _ in range(5_000):
            tally.add("written")
            tally.observe("latency_ms", 1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tally.count("written") == 20_000
    assert tally.timing("latency_ms", "count") == 20_000


def test_gauge_counters_register_a_gauge_on_first_use() -> None:
    group = FakeGroup()
    counters = GaugeCounters(group)
    assert group.read() == {}
    counters.inc("prompts_sent")
    counters.inc("prompts_sent", 2)
    counters.inc("events_in")
    assert group.read() == {"prompts_sent": 3, "events_in": 1}
