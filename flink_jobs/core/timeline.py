"""One shopper's timeline: what each arriving event and each watermark timer does.

Events are held until the watermark passes them and then applied in event-time order; the
trigger is evaluated at event times only. So a trigger firing at event time ``t`` sees
exactly the shopper's events up to ``t`` (all of them, for events within the watermark's
out-of-orderness bound), whatever order the partitions were read in and whenever the
watermark happened to be emitted: replaying a topic renders the same prompts.

Flink timers only say "the watermark has passed this time". When the watermark jumps (a
job catching up a backlog), PyFlink fires every timer it passed before the Python side has
registered the wake-up timers those firings ask for, so timers arrive out of order. Hence
:func:`on_timer` replays the shopper's timeline itself: every held event due and every
trigger wake-up (kept in ``SessionState.wake_at_ms``) up to the timer's time, in
event-time order. A timer whose time was already replayed does nothing. The same
replay lets a held event wait past its own time for a timer at the first time it could
make the trigger fire (``trigger.earliest_fire_ms``): the prompts are those of a timer at
every event's own time.

An event that arrives behind the watermark is applied at once, after the held events the
watermark has passed. ``session.apply_event`` then judges it against the shopper's newest
event: folded into the context if within ``session.max_lateness_s`` (a late click is
still signal), else dropped and dead-lettered.

Held events are bounded per shopper (``session.max_held_events``): events may be stamped
up to five minutes ahead, and a producer that floods one shopper with them must not grow
that shopper's state without end. The event beyond the bound is dead-lettered (stage
``hold``, reason ``too_many_held``, the event inside) and counted in
``events_held_overflow``. Holding an event costs the same however many are held: the
operator appends it to a list state (:func:`hold_event` says what to append, and needs
only the count), and the held events are read, in arrival order, only when a timer or an
event behind the watermark needs them (:func:`on_timer` orders them).

A prompt that fires carries, beside the rendered messages, what the session says exactly:
its grounded facts, the rules-only intent and the categories the model may name
(``grounding``), so the calls' runtime computes nothing from the session.

:func:`on_event`, :func:`hold_event` and :func:`on_timer` are pure:
``operators.ShopperSessions`` stores the :class:`Step` they return, registers its timers and
emits its prompt and dead letters.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from itertools import groupby
from operator import attrgetter

from flink_jobs.config import AppConfig
from flink_jobs.core.events import DeadLetter, ShopperEvent
from flink_jobs.core.grounding import (
    GroundedFacts,
    grounded_facts,
    rules_intent,
    session_category_enum,
)
from flink_jobs.core.prompting import PromptError, RenderedPrompt
from flink_jobs.core.session import (
    Outcome,
    SessionState,
    apply_event,
    clear_pending,
    mark_prompted,
    new_session_state,
)
from flink_jobs.core.tasks import PromptTask
from flink_jobs.core.trigger import Verdict, decide, earliest_fire_ms

Renderer = Callable[[SessionState, GroundedFacts], RenderedPrompt]


@dataclass(slots=True)
class Step:
    """What one event or timer changed. ``held``: the shopper's held events after it, in
    event-time order; None when they are the ones before plus ``held_added`` (appended, the
    others untouched: all the operator writes for an event it holds)."""

    state: SessionState | None
    held: tuple[ShopperEvent, ...] | None
    held_added: tuple[ShopperEvent, ...] = ()
    counts: dict[str, int] = field(default_factory=dict)
    timers: list[int] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    late_events: list[tuple[ShopperEvent, Outcome]] = field(default_factory=list)
    prompts: list[PromptTask] = field(default_factory=list)

    def count(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1

    def held_after(self, before: Iterable[ShopperEvent]) -> tuple[ShopperEvent, ...]:
        """The shopper's held events after this step, given those before it (any order)."""
        return (*before, *self.held_added) if self.held is None else self.held


def hold(held: tuple[ShopperEvent, ...], event: ShopperEvent) -> tuple[ShopperEvent, ...]:
    """``held`` with ``event`` added in event-time order (ties keep arrival order)."""
    at = bisect.bisect_right([e.event_time_ms for e in held], event.event_time_ms)
    return (*held[:at], event, *held[at:])


def release(
    held: tuple[ShopperEvent, ...], until_ms: int
) -> tuple[tuple[ShopperEvent, ...], tuple[ShopperEvent, ...]]:
    """Split ``held`` into the events due by ``until_ms``, oldest first, and the rest."""
    at = bisect.bisect_right([e.event_time_ms for e in held], until_ms)
    return held[:at], held[at:]


def in_time_order(held: Iterable[ShopperEvent]) -> tuple[ShopperEvent, ...]:
    """Held events as appended (arrival order) sorted by event time, ties in arrival order."""
    return tuple(sorted(held, key=_event_time))


_event_time = attrgetter("event_time_ms")


def is_held(event: ShopperEvent, watermark_ms: int) -> bool:
    """Whether :func:`on_event` will hold ``event`` (and so needs no session state)."""
    return event.event_time_ms > watermark_ms


def on_event(
    state: SessionState | None,
    held: Iterable[ShopperEvent],
    event: ShopperEvent,
    watermark_ms: int,
    config: AppConfig,
    render: Renderer,
) -> Step:
    """Hold ``event`` or, behind the watermark, apply it; ``held`` in any order. An operator
    that holds the event needs only :func:`hold_event` (no held events read)."""
    if is_held(event, watermark_ms):
        held = in_time_order(held)
        step = hold_event(event, len(held), config, state)
        step.held = hold(held, event) if step.held_added else held
        return step
    # Held events the watermark has passed may wait for a later timer (earliest_fire_ms).
    step = on_timer(state, held, watermark_ms, config, render)
    _apply(step, (event,), config, behind_watermark=True)
    _evaluate(step, watermark_ms, event.event_time_ms, config, render)
    return step


def hold_event(
    event: ShopperEvent, held_count: int, config: AppConfig, state: SessionState | None = None
) -> Step:
    """Hold ``event``, which is ahead of the watermark, given how many the shopper holds: it
    is appended (``Step.held_added``) with a timer at the first time it could make the
    trigger fire, or, with ``session.max_held_events`` held already, dead-lettered."""
    if held_count >= config.session.max_held_events:
        step = Step(state, None)
        step.count("events_held_overflow")
        step.dead_letters.append(
            DeadLetter(
                "hold",
                "too_many_held",
                f"the shopper already has {held_count} events waiting for the watermark "
                f"(session.max_held_events); events stamped ahead of the clock arrive faster "
                "than event time passes them",
                shopper_id=event.shopper_id,
                context={"event": event},
            )
        )
        return step
    step = Step(state, None, (event,), timers=[earliest_fire_ms(event, config.trigger)])
    step.count("events_held")
    return step


def on_timer(
    state: SessionState | None,
    held: Iterable[ShopperEvent],
    timestamp_ms: int,
    config: AppConfig,
    render: Renderer,
) -> Step:
    """Replay the shopper's timeline up to ``timestamp_ms``; ``held`` in any order."""
    due, rest = release(in_time_order(held), timestamp_ms)
    step = Step(state, rest if due else None)  # None: none released, the held stay as they are
    for at_ms, same_time in groupby(due, key=lambda e: e.event_time_ms):
        _wake(step, at_ms - 1, config, render)
        _apply(step, tuple(same_time), config, behind_watermark=False)
        assert step.state is not None
        _evaluate(step, at_ms, step.state.newest_event_ms, config, render)
    _wake(step, timestamp_ms, config, render)
    # Wake-ups due by now ran above; Flink would only fire them again for nothing.
    step.timers = [t for t in step.timers if t > timestamp_ms]
    return step


def _wake(step: Step, until_ms: int, config: AppConfig, render: Renderer) -> None:
    """Run the trigger wake-ups due by ``until_ms``, each at its own time."""
    while (
        step.state is not None
        and step.state.wake_at_ms is not None
        and step.state.wake_at_ms <= until_ms
    ):
        at_ms = step.state.wake_at_ms
        _evaluate(step, at_ms, at_ms, config, render)


def _apply(
    step: Step, events: tuple[ShopperEvent, ...], config: AppConfig, behind_watermark: bool
) -> None:
    for event in events:
        state = step.state or new_session_state(event.shopper_id)
        step.state, outcome = apply_event(
            state, event, config.session, config.trigger.high_signal_types
        )
        step.count(f"events_{outcome.value}")
        if behind_watermark:
            step.count("events_behind_watermark")
            if outcome is not Outcome.DUPLICATE:
                step.late_events.append((event, outcome))
        if outcome is Outcome.LATE_DROPPED:
            step.dead_letters.append(
                DeadLetter(
                    "late",
                    "too_late",
                    f"event is more than {config.session.max_lateness_s:.0f} s "
                    "(session.max_lateness_s) behind the shopper's newest event",
                    shopper_id=event.shopper_id,
                    context={"event_id": event.event_id, "event_time_ms": event.event_time_ms},
                )
            )


def _evaluate(
    step: Step, now_ms: int, trigger_event_ms: int, config: AppConfig, render: Renderer
) -> None:
    """Run the trigger at ``now_ms``; whatever it decides replaces the wake-up the state
    asked for (prompting and clearing leave none)."""
    state = step.state
    assert state is not None
    decision = decide(state, now_ms, config.trigger)
    if decision.verdict is Verdict.FIRE:
        facts = grounded_facts(state)
        try:
            prompt = render(state, facts)
        except PromptError as exc:
            step.count("dead_letter_prompt")
            step.dead_letters.append(
                DeadLetter("prompt", "prompt_error", str(exc), shopper_id=state.shopper_id)
            )
            step.state = clear_pending(state)
            return
        rules = rules_intent(facts, state)
        state = step.state = mark_prompted(state, now_ms, decision.fingerprint)
        step.count("prompts_sent")
        step.count(f"prompts_reason_{decision.reason.replace(' ', '_').replace('-', '_')}")
        step.prompts.append(
            PromptTask(
                state.shopper_id,
                state.prompt_seq,
                state.newest_event_ms,
                trigger_event_ms,
                prompt,
                facts_json=facts.to_json().decode(),
                rules=rules,
                categories=session_category_enum(facts),
            )
        )
    elif decision.verdict is Verdict.UNCHANGED:
        step.count("prompts_skipped_unchanged")
        step.state = clear_pending(state)
    elif decision.verdict is Verdict.WAIT:
        assert decision.wake_at_ms is not None
        if state.wake_at_ms != decision.wake_at_ms:
            step.state = replace(state, wake_at_ms=decision.wake_at_ms)
        step.timers.append(decision.wake_at_ms)
    elif state.wake_at_ms is not None:
        step.state = replace(state, wake_at_ms=None)
