"""metrics: the operators' Flink metrics, kept in Python and read as gauges (``GaugeCounters``,
``Tally``), which reach Flink in thread mode as published numbers (``GaugeBoard``)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from flink_jobs.metrics import GaugeBoard, GaugeCounters, PublishedGroup, Tally, gauge_names
from tests.support.clock import FakeClock
from tests.support.fake_metrics import FakeGroup


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
    clock = FakeClock(1000.0)
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


# --- GaugeBoard: gauges Flink reads without calling Python ---------------------------------


class JavaGauge:
    """What ``shopperintents.PublishedGauge`` is to the JVM: a number, set from Python."""

    def __init__(self) -> None:
        self.value: int | None = None

    def set(self, value: int) -> None:
        self.value = value


class JavaGroup:
    """The Java metric group behind a thread-mode PyFlink group: it takes gauge objects."""

    def __init__(self) -> None:
        self.gauges: dict[str, object] = {}

    def gauge(self, name: str, gauge: object) -> object:
        self.gauges[name] = gauge
        return gauge

    def read(self) -> dict[str, int | None]:
        """What a reporter sees: the published numbers, nothing called."""
        return {name: g.value for name, g in self.gauges.items()}


class ThreadModeGroup(FakeGroup):
    """A PyFlink thread-mode group, with its Java group; a Python gauge on it is an error
    unless the test expects the fallback."""

    def __init__(self, python_gauges_expected: bool = False) -> None:
        super().__init__()
        self.java = JavaGroup()
        self.python_gauges_expected = python_gauges_expected

    def gauge(self, name: str, obj: Callable[[], int]) -> None:
        assert self.python_gauges_expected, "a Python callable handed to the JVM as a gauge"
        super().gauge(name, obj)

    def add_group(self, name: str, extra: str | None = None) -> ThreadModeGroup:
        sub = ThreadModeGroup()
        sub.java = self.java  # one flat view for the test
        return sub


def _board(clock: FakeClock, interval_s: float = 1.0) -> GaugeBoard:
    return GaugeBoard(
        interval_s,
        clock,
        new_gauge=JavaGauge,
        java_group=lambda g: g.java if isinstance(g, ThreadModeGroup) else None,
    )


def test_in_thread_mode_flink_reads_numbers_the_operator_published() -> None:
    clock, group = FakeClock(1000.0), ThreadModeGroup()
    board = _board(clock)
    counters = GaugeCounters(PublishedGroup(group, board))
    counters.inc("events_in", 3)
    assert group.java.read() == {"events_in": 0}  # registered at its first count
    board.publish()
    assert group.java.read() == {"events_in": 3}


def test_publishing_copies_the_values_at_most_once_per_interval() -> None:
    clock, group = FakeClock(1000.0), ThreadModeGroup()
    board = _board(clock, interval_s=1.0)
    tally = Tally(["written"])
    tally.register(PublishedGroup(group, board))
    board.publish()
    tally.add("written", 2)
    clock.now += 0.5
    board.publish()
    assert group.java.read()["written"] == 0
    clock.now += 0.5
    board.publish()
    assert group.java.read()["written"] == 2
    tally.add("written")
    board.publish_now()
    assert group.java.read()["written"] == 3


def test_subgroups_publish_through_the_same_board() -> None:
    clock, group = FakeClock(1000.0), ThreadModeGroup()
    board = _board(clock)
    tally = Tally(["prompts_sent"])
    tally.register(PublishedGroup(group, board).add_group("arm", "v3"))
    tally.add("prompts_sent")
    board.publish_now()
    assert group.java.read() == {"prompts_sent": 1}


def test_outside_thread_mode_gauges_stay_python_callables() -> None:
    """Process mode: Beam reads them in the Python worker, no JVM thread calls Python."""
    group = FakeGroup()
    tally = Tally(["written"])
    tally.register(PublishedGroup(group, _board(FakeClock(1000.0))))
    tally.add("written")
    assert group.read() == {"written": 1}


def test_without_the_java_class_gauges_fall_back_to_python_callables_with_a_warning(caplog):
    def missing() -> JavaGauge:
        raise RuntimeError("java.lang.ClassNotFoundException: shopperintents.PublishedGauge")

    group = ThreadModeGroup(python_gauges_expected=True)
    board = GaugeBoard(1.0, FakeClock(1000.0), new_gauge=missing, java_group=lambda g: g.java)
    tally = Tally(["written"])
    tally.register(PublishedGroup(group, board))
    tally.add("written")
    assert group.read() == {"written": 1}
    assert "shopper-intents-connectors.jar" in caplog.text
