"""What the session operator reads and writes in keyed state per record and timer: each
round trip crosses the JVM boundary and pickles, so one that changes nothing is not made.
Flink's state and timer service are fakes that count; no JVM runs."""

from __future__ import annotations

from types import SimpleNamespace

from pyflink.datastream import TimeDomain

from flink_jobs.config import load_config
from flink_jobs.metrics import GaugeBoard
from flink_jobs.operators import ShopperSessions, _RecentSessions
from tests.support.builders import HEADPHONES, SHOPPER, at, session_of, shopper_event

CONFIG = load_config(environ={})


class Value:
    """A ValueState that counts its round trips."""

    def __init__(self, value=None) -> None:
        self._value, self.reads, self.writes = value, 0, 0

    def value(self):
        self.reads += 1
        return self._value

    def update(self, value) -> None:
        self.writes += 1
        self._value = value

    def clear(self) -> None:
        self.update(None)


class Items:
    """A ListState that counts its writes."""

    def __init__(self, items=()) -> None:
        self.items, self.writes = list(items), 0

    def get(self):
        return list(self.items)

    def add_all(self, items) -> None:
        self.writes += 1
        self.items.extend(items)

    def update(self, items) -> None:
        self.writes += 1
        self.items = list(items)

    def clear(self) -> None:
        self.update([])


def _operator(session=None, held=(), legacy=None) -> ShopperSessions:
    sessions = ShopperSessions(CONFIG)
    sessions._session, sessions._legacy_held, sessions._pending = (
        Value(session),
        Value(legacy),
        Value(),
    )
    sessions._held, sessions._held_count = Items(held), Value(len(held))
    sessions._recent = _RecentSessions(16)
    sessions._renderer = SimpleNamespace(render=None)  # no prompt fires in these tests
    sessions._gauges = GaugeBoard()
    sessions._flink_counters = SimpleNamespace(inc=lambda name, amount=1: None)
    sessions._stats = SimpleNamespace(add=lambda name, amount=1: None)
    sessions._outbox = SimpleNamespace()
    return sessions


def _watermark_timer(sessions: ShopperSessions, at_ms: int) -> list:
    timers = SimpleNamespace(register_event_time_timer=lambda when: None)
    ctx = SimpleNamespace(
        time_domain=lambda: TimeDomain.EVENT_TIME,
        get_current_key=lambda: SHOPPER,
        timer_service=lambda: timers,
    )
    return list(sessions.on_timer(at_ms, ctx))


def test_a_timer_that_changes_nothing_writes_no_state() -> None:
    view = shopper_event("view", 10, HEADPHONES)
    later = shopper_event("view", 60, HEADPHONES)
    sessions = _operator(session=session_of(view), held=[later])

    _watermark_timer(sessions, at(30))  # before the held event is due: nothing to do

    writes = [sessions._session.writes, sessions._held.writes, sessions._held_count.writes]
    assert writes == [0, 0, 0]


def test_a_timer_that_applies_a_held_event_writes_the_session_and_empties_the_held() -> None:
    view = shopper_event("view", 10, HEADPHONES)
    sessions = _operator(held=[view])

    _watermark_timer(sessions, at(10))

    assert sessions._session.writes == 1
    assert sessions._session._value.events == (view,)
    assert sessions._held.items == []


def test_held_events_of_an_earlier_snapshot_move_to_the_list_once() -> None:
    """``held-events`` (one value per shopper) is what an earlier version kept; it is read
    until the shopper's session is in memory, and moved to the list the first time."""
    older, newer = shopper_event("view", 50, HEADPHONES), shopper_event("view", 60, HEADPHONES)
    sessions = _operator(session=session_of(shopper_event("view", 5)), held=[newer], legacy=[older])

    _watermark_timer(sessions, at(20))
    _watermark_timer(sessions, at(25))

    assert sessions._held.items == [older, newer]
    assert sessions._held_count._value == 2
    assert sessions._legacy_held._value is None
    assert sessions._legacy_held.reads == 1
