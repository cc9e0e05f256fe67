"""Events held for the watermark are bounded per shopper, and holding one costs the same
however many are held.

Events stamped up to five minutes ahead are held until the watermark passes them. The
operator keeps them in a list state it appends to (``hold_event``: the new event and the
count, nothing else written), and a shopper with ``session.max_held_events`` held has the
next one dead-lettered (stage ``hold``, reason ``too_many_held``, the whole event inside)
and counted in ``events_held_overflow``."""

from __future__ import annotations

import itertools
import pickle

import orjson
import pytest

from flink_jobs.config import AppConfig, ConfigError, SessionConfig
from flink_jobs.core.events import ShopperEvent
from flink_jobs.core.prompting import PromptRenderer
from flink_jobs.core.timeline import Step, hold_event, on_event, on_timer
from tests.support.builders import HEADPHONES, T0

SHOPPER = "shopper-00321"
CONFIG = AppConfig(session=SessionConfig(max_held_events=50))
RENDER = PromptRenderer(CONFIG.prompt).render

_ids = itertools.count()


def future_view(ahead_s: float) -> ShopperEvent:
    """A view stamped ``ahead_s`` after T0, where the watermark stands."""
    return ShopperEvent(
        event_id=f"ev-{next(_ids):06d}",
        shopper_id=SHOPPER,
        event_type="view",
        event_time_ms=T0 + int(ahead_s * 1000),
        **HEADPHONES,
    )


class HeldState:
    """The operator's keyed state for held events, as ``operators.ShopperSessions`` writes
    it: a list appended to (``Step.held_added``) or replaced (``Step.held``), and a count;
    every write is pickled, as Flink's state pickles it."""

    def __init__(self) -> None:
        self.events: list[ShopperEvent] = []
        self.pickled_bytes: list[int] = []  # per step

    def commit(self, step: Step) -> None:
        if step.held is None:
            written = [*step.held_added]
            self.events.extend(step.held_added)
        else:
            written = [*step.held]
            self.events = list(step.held)
        self.pickled_bytes.append(
            sum(len(pickle.dumps(e)) for e in written) + len(pickle.dumps(len(self.events)))
        )


def arrive(held: HeldState, event: ShopperEvent, config: AppConfig = CONFIG) -> Step:
    step = hold_event(event, len(held.events), config)
    held.commit(step)
    return step


def test_a_held_event_is_appended_without_the_others() -> None:
    held = HeldState()
    for ahead in range(10):
        arrive(held, future_view(60 + ahead))

    step = arrive(held, future_view(120))

    assert step.held is None
    assert len(step.held_added) == 1
    assert step.counts == {"events_held": 1}


def test_holding_an_event_writes_no_more_with_900_held_than_with_none() -> None:
    config = AppConfig(session=SessionConfig(max_held_events=1_000))
    held = HeldState()
    for ahead in range(900):
        arrive(held, future_view(1 + ahead * 0.25), config)

    one_event = held.pickled_bytes[0]

    # Each write is the one event and the count (a few bytes more for longer numbers),
    # where rewriting the held list would write 900 events for the last arrival.
    assert max(held.pickled_bytes) < 1.2 * one_event


def test_the_event_beyond_the_bound_is_dead_lettered_and_counted() -> None:
    held = HeldState()
    for ahead in range(50):
        arrive(held, future_view(60 + ahead))
    extra = future_view(200)

    step = arrive(held, extra)

    assert len(held.events) == 50
    assert step.held_added == () and step.timers == []
    assert step.counts == {"events_held_overflow": 1}
    [dead_letter] = step.dead_letters
    assert (dead_letter.stage, dead_letter.reason) == ("hold", "too_many_held")
    assert dead_letter.shopper_id == SHOPPER
    assert "session.max_held_events" in dead_letter.detail
    body = orjson.loads(dead_letter.to_json(T0))
    assert body["context"]["event"]["event_id"] == extra.event_id  # nothing lost
    assert body["context"]["event"]["event_time_ms"] == extra.event_time_ms


def test_on_event_applies_the_same_bound() -> None:
    held = tuple(future_view(60 + ahead) for ahead in range(50))

    step = on_event(None, held, future_view(200), T0, CONFIG, RENDER)

    assert step.held == held
    assert step.counts == {"events_held_overflow": 1}


def test_once_the_watermark_releases_them_holding_resumes() -> None:
    held = HeldState()
    for ahead in range(50):
        arrive(held, future_view(60 + ahead))
    released = on_timer(None, tuple(held.events), T0 + 200_000, CONFIG, RENDER)
    held.commit(released)

    step = arrive(held, future_view(300))

    assert step.counts == {"events_held": 1}


def test_held_events_appended_out_of_order_are_released_in_event_time_order() -> None:
    later, earlier = future_view(20), future_view(10)
    held = HeldState()
    arrive(held, later)
    arrive(held, earlier)

    step = on_timer(None, tuple(held.events), T0 + 30_000, CONFIG, RENDER)

    assert step.state.events == (earlier, later)
    assert step.held == ()


def test_the_bound_must_be_positive() -> None:
    with pytest.raises(ConfigError, match=r"session\.max_held_events"):
        SessionConfig(max_held_events=0).validate()
