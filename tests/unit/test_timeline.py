"""One shopper's timeline: events wait for the watermark, are applied in event-time order,
and the trigger fires at event times, so the prompts depend on the topic alone."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from flink_jobs.config import AppConfig, PromptConfig
from flink_jobs.core.events import ShopperEvent
from flink_jobs.core.prompting import PromptRenderer
from flink_jobs.core.session import Outcome
from flink_jobs.core.timeline import Step, hold, on_event, on_timer, release
from flink_jobs.core.trigger import END_OF_TIME_MS
from tests.support.builders import EARBUDS, ESPRESSO, HEADPHONES, T0, at, shopper_event

SHOPPER = "shopper-00321"
CONFIG = AppConfig()
RENDER = PromptRenderer(PromptConfig()).render
NO_WATERMARK = -(2**63)


def event(event_type: str = "view", at_s: float = 0, product: dict | None = None) -> ShopperEvent:
    return shopper_event(event_type, at_s, product or HEADPHONES, shopper_id=SHOPPER)


class FlinkKey:
    """One key's state and event-time timers, advanced the way Flink advances them.

    ``fire_order`` shuffles the timers that one watermark advance passes, as PyFlink does
    when the watermark jumps: the Python side registers the timers a firing asks for only
    after the JVM has fired the others it passed."""

    def __init__(
        self, fire_order: random.Random | None = None, timer_per_event: bool = False
    ) -> None:
        self.fire_order = fire_order
        self.timer_per_event = timer_per_event
        self.state = None
        self.held: tuple[ShopperEvent, ...] = ()
        self.timers: set[int] = set()
        self.watermark = NO_WATERMARK
        self.prompts: list = []
        self.emitted_at: list[int] = []  # the watermark each prompt was emitted at
        self.steps: list[Step] = []

    def arrive(self, e: ShopperEvent) -> Step:
        if self.timer_per_event and e.event_time_ms > self.watermark:
            self.timers.add(e.event_time_ms)
        return self._take(on_event(self.state, self.held, e, self.watermark, CONFIG, RENDER))

    def advance(self, watermark: int) -> None:
        self.watermark = max(self.watermark, watermark)
        while self.timers and min(self.timers) <= self.watermark:
            passed = sorted(t for t in self.timers if t <= self.watermark)
            if self.fire_order is None:
                passed = passed[:1]
            else:
                self.fire_order.shuffle(passed)
            self.timers.difference_update(passed)
            for due in passed:
                self._take(on_timer(self.state, self.held, due, CONFIG, RENDER))

    def _take(self, step: Step) -> Step:
        self.state, self.held = step.state, step.held_after(self.held)
        self.timers.update(step.timers)
        self.prompts.extend(step.prompts)
        self.emitted_at.extend(self.watermark for _ in step.prompts)
        self.steps.append(step)
        return step


def test_a_browsing_event_ahead_of_the_watermark_waits_for_the_end_of_its_quiet_period() -> None:
    e = event("view", at_s=1)

    step = on_event(None, (), e, at(0), CONFIG, RENDER)

    assert step.held == (e,)
    assert step.timers == [at(1 + CONFIG.trigger.quiet_s)]
    assert step.state is None
    assert step.counts == {"events_held": 1}


def test_a_high_signal_event_ahead_of_the_watermark_waits_for_its_own_time() -> None:
    cart = event("add_to_cart", at_s=1)

    step = on_event(None, (), cart, at(0), CONFIG, RENDER)

    assert step.timers == [cart.event_time_ms]


def test_an_event_behind_the_watermark_comes_after_the_held_events_the_watermark_passed() -> None:
    key = FlinkKey()
    browsed = event("view", at_s=10)
    key.arrive(browsed)
    key.advance(at(11))  # passes the view, but its timer is at the end of its quiet period
    straggler = event("view", at_s=9, product=EARBUDS)

    step = key.arrive(straggler)

    assert step.state.events == (straggler, browsed)
    assert step.late_events == [(straggler, Outcome.LATE_FOLDED)]
    assert key.held == ()


def test_held_events_are_kept_in_event_time_order() -> None:
    late, early = event(at_s=5), event(at_s=2)

    assert hold(hold((), late), early) == (early, late)


def test_a_timer_releases_the_events_due_and_keeps_the_later_ones() -> None:
    first, second, third = event(at_s=1), event(at_s=2), event(at_s=3)

    due, rest = release((first, second, third), at(2))

    assert (due, rest) == ((first, second), (third,))


def test_a_timer_applies_the_released_events_and_counts_their_outcomes() -> None:
    view = event("view", at_s=1)

    step = on_timer(None, (view,), view.event_time_ms, CONFIG, RENDER)

    assert step.state.events == (view,)
    assert step.held == ()
    assert step.counts["events_accepted"] == 1


def test_an_event_behind_the_watermark_is_applied_at_once_and_reported_late() -> None:
    key = FlinkKey()
    key.arrive(event("view", at_s=10))
    key.advance(at(20))
    straggler = event("view", at_s=8, product=EARBUDS)

    step = key.arrive(straggler)

    assert straggler in step.state.events
    assert step.late_events == [(straggler, Outcome.LATE_FOLDED)]
    assert step.counts["events_behind_watermark"] == 1
    assert step.counts["events_late_folded"] == 1


def test_an_event_beyond_the_lateness_bound_is_dead_lettered() -> None:
    key = FlinkKey()
    key.arrive(event("view", at_s=3600))
    key.advance(at(3601))

    step = key.arrive(event("view", at_s=0))

    [dead_letter] = step.dead_letters
    assert (dead_letter.stage, dead_letter.reason) == ("late", "too_late")
    assert step.counts["events_late_dropped"] == 1


def test_a_high_signal_event_fires_when_the_watermark_reaches_it_without_later_events() -> None:
    key = FlinkKey()
    cart = event("add_to_cart", at_s=4)
    later_view = event("view", at_s=5, product=EARBUDS)
    key.arrive(event("view", at_s=4 - CONFIG.trigger.quiet_s / 2))  # still in its quiet period
    key.arrive(cart)
    key.arrive(later_view)

    key.advance(at(4))

    [prompt] = key.prompts
    assert prompt.version_ts == cart.event_time_ms
    assert prompt.prompt.events_included == 2
    assert later_view in key.held


def test_browsing_fires_after_the_quiet_period_in_event_time() -> None:
    key = FlinkKey()
    key.arrive(event("view", at_s=1))
    key.advance(at(1))
    assert key.prompts == []

    key.advance(at(1 + CONFIG.trigger.quiet_s))

    [prompt] = key.prompts
    assert prompt.prompt.events_included == 1


def _prompts_of(
    arrivals: list[ShopperEvent],
    watermark_points: list[int],
    bound_ms: int,
    fire_order: random.Random | None = None,
):
    """Feed ``arrivals`` in order, emitting a bounded-out-of-orderness watermark after the
    arrivals listed in ``watermark_points``, then let the watermark run past everything."""
    return _rendered(_fed(arrivals, watermark_points, bound_ms, FlinkKey(fire_order)))


def _rendered(key: FlinkKey):
    return [(p.seq, p.version_ts, p.prompt.messages) for p in key.prompts]


def _fed(
    arrivals: list[ShopperEvent], watermark_points: list[int], bound_ms: int, key: FlinkKey
) -> FlinkKey:
    newest = NO_WATERMARK
    for i, e in enumerate(arrivals):
        key.arrive(e)
        newest = max(newest, e.event_time_ms)
        if i in watermark_points:
            key.advance(newest - bound_ms - 1)
    key.advance(newest + 3_600_000)
    return key


SESSION = [
    ("search", 0.0, HEADPHONES),
    ("view", 2.0, HEADPHONES),
    ("view", 2.3, EARBUDS),
    ("view", 9.0, HEADPHONES),
    ("add_to_cart", 11.0, EARBUDS),
    ("view", 11.2, HEADPHONES),
    ("view", 30.0, EARBUDS),
    ("purchase", 31.0, EARBUDS),
    ("view", 60.0, HEADPHONES),
]


@settings(max_examples=60, deadline=None)
@given(
    jitter=st.lists(st.integers(0, 400), min_size=len(SESSION), max_size=len(SESSION)),
    watermark_points=st.lists(st.integers(0, len(SESSION) - 1), max_size=len(SESSION)),
)
def test_replays_render_the_same_prompts_whatever_the_read_order_and_watermark_timing(
    jitter: list[int], watermark_points: list[int]
) -> None:
    bound_ms = int(CONFIG.job.out_of_orderness_s * 1000)
    events = [
        ShopperEvent(f"ev-{i}", SHOPPER, kind, T0 + int(s * 1000), **product)
        for i, (kind, s, product) in enumerate(SESSION)
    ]
    # Arrival order is event time plus up to 400 ms of jitter: out of order within the bound.
    shuffled = [
        e
        for _, e in sorted(
            zip(jitter, events, strict=True), key=lambda p: p[1].event_time_ms + p[0]
        )
    ]

    in_order = _prompts_of(events, list(range(len(events))), bound_ms)
    replayed = _prompts_of(shuffled, watermark_points, bound_ms)

    assert len(in_order) >= 3
    assert replayed == in_order


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), watermark_points=st.lists(st.integers(0, len(SESSION) - 1)))
def test_a_catching_up_job_renders_the_same_prompts_when_timers_fire_out_of_order(
    seed: int, watermark_points: list[int]
) -> None:
    bound_ms = int(CONFIG.job.out_of_orderness_s * 1000)
    events = [
        ShopperEvent(f"ev-{i}", SHOPPER, kind, T0 + int(s * 1000), **product)
        for i, (kind, s, product) in enumerate(SESSION)
    ]

    in_order = _prompts_of(events, list(range(len(events))), bound_ms)
    jumping = _prompts_of(events, watermark_points, bound_ms, random.Random(seed))

    assert jumping == in_order


@settings(max_examples=60, deadline=None)
@given(watermark_points=st.lists(st.integers(0, len(SESSION) - 1), max_size=len(SESSION)))
def test_held_events_render_the_prompts_of_a_timer_at_every_event_time(
    watermark_points: list[int],
) -> None:
    bound_ms = int(CONFIG.job.out_of_orderness_s * 1000)
    events = [
        ShopperEvent(f"ev-{i}", SHOPPER, kind, T0 + int(s * 1000), **product)
        for i, (kind, s, product) in enumerate(SESSION)
    ]

    deferred = _fed(events, watermark_points, bound_ms, FlinkKey())
    every_event = _fed(events, watermark_points, bound_ms, FlinkKey(timer_per_event=True))

    assert len(deferred.prompts) >= 3
    assert _rendered(deferred) == _rendered(every_event)
    assert deferred.emitted_at == every_event.emitted_at  # and as soon


def test_a_timer_whose_time_was_already_replayed_does_nothing() -> None:
    key = FlinkKey()
    key.arrive(event("view", at_s=1))
    key.arrive(event("view", at_s=20, product=EARBUDS))
    key.advance(at(30))
    state, held = key.state, key.held

    step = on_timer(state, held, at(1), CONFIG, RENDER)

    assert (step.state, step.held, step.prompts, step.timers) == (state, None, [], [])
    assert step.held_after(held) == held


def test_events_behind_the_last_watermark_prompt_at_once_and_set_no_timer_past_it() -> None:
    """Flink's last watermark can pass records still to come: each one is applied, and what
    it changes fires, since no later time exists for a timer (a timer past it does not
    even fit in a Java long)."""
    first = on_event(None, (), event("view", 1), END_OF_TIME_MS, CONFIG, RENDER)
    second = on_event(first.state, (), event("view", 2, ESPRESSO), END_OF_TIME_MS, CONFIG, RENDER)

    assert [len(first.prompts), len(second.prompts)] == [1, 1]
    assert all(t <= END_OF_TIME_MS for t in first.timers + second.timers)
