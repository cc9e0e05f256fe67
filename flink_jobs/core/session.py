"""A shopper's recent session as an immutable value, and how one event changes it.

Pure functions over frozen dataclasses: the Flink operator only loads the state, calls
:func:`apply_event`, stores what comes back and acts on the outcome. Keeping the rules here
makes replays deterministic and lets them be tested without a JVM.

Rules, in order:

* an event id seen recently (in the dedupe window, or of an event still in the session)
  is a duplicate and changes nothing;
* an event further behind the shopper's newest event than ``session.max_lateness_s`` is
  dropped as late (it is counted and dead-lettered by the caller); a late event within that
  bound is still folded into the context, since a late click is still signal;
* an event after a quiet gap longer than ``session.gap_s`` closes the session: its gist is
  folded into the shopper's history and a new session starts;
* the session keeps the newest ``session.max_events`` events in event-time order.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, replace
from enum import Enum

from flink_jobs.config import SessionConfig
from flink_jobs.core.events import ShopperEvent, pickled_by_fields

#: How many recent event ids are remembered for de-duplication, as a multiple of the
#: session length: duplicates arrive close together (producer retries, replays).
DEDUPE_WINDOW_FACTOR = 4
HISTORY_TOP_N = 5


class Outcome(Enum):
    ACCEPTED = "accepted"
    LATE_FOLDED = "late_folded"
    DUPLICATE = "duplicate"
    LATE_DROPPED = "late_dropped"

    @property
    def changed_session(self) -> bool:
        return self in (Outcome.ACCEPTED, Outcome.LATE_FOLDED)


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class History:
    """The gist of a shopper's earlier sessions: small, stable, and safe to put in a prompt."""

    sessions: int = 0
    purchases: int = 0
    top_categories: tuple[str, ...] = ()
    top_brands: tuple[str, ...] = ()


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class SessionState:
    shopper_id: str
    events: tuple[ShopperEvent, ...] = ()
    recent_ids: tuple[str, ...] = ()
    history: History = History()
    session_started_ms: int = 0
    newest_event_ms: int = 0
    #: Trigger bookkeeping (see trigger.py); times are event times.
    pending_since_ms: int | None = None
    pending_high_signal: bool = False
    last_prompt_ms: int | None = None
    last_prompt_fingerprint: int = 0
    prompt_seq: int = 0
    #: The event time the trigger asked to be woken at (timeline.py), None when it need not be.
    wake_at_ms: int | None = None


def new_session_state(shopper_id: str) -> SessionState:
    return SessionState(shopper_id=shopper_id)


def apply_event(
    state: SessionState,
    event: ShopperEvent,
    config: SessionConfig,
    high_signal_types: tuple[str, ...],
) -> tuple[SessionState, Outcome]:
    # The window alone is not enough: late events can push an id out of it while its event
    # is still in the session, and a redelivery would then be listed twice.
    in_session = any(e.event_id == event.event_id for e in state.events)
    if in_session or event.event_id in state.recent_ids:
        return state, Outcome.DUPLICATE
    max_lateness_ms = int(config.max_lateness_s * 1000)
    if state.events and event.event_time_ms < state.newest_event_ms - max_lateness_ms:
        return state, Outcome.LATE_DROPPED

    outcome = (
        Outcome.LATE_FOLDED if event.event_time_ms < state.newest_event_ms else Outcome.ACCEPTED
    )
    if state.events and event.event_time_ms - state.newest_event_ms > config.gap_s * 1000:
        state = _close_session(state)

    events = list(state.events)
    times = [e.event_time_ms for e in events]
    events.insert(bisect.bisect_right(times, event.event_time_ms), event)
    events = events[-config.max_events :]
    recent_ids = (*state.recent_ids, event.event_id)[-config.max_events * DEDUPE_WINDOW_FACTOR :]

    return (
        replace(
            state,
            events=tuple(events),
            recent_ids=recent_ids,
            session_started_ms=state.session_started_ms if state.events else event.event_time_ms,
            newest_event_ms=max(state.newest_event_ms, event.event_time_ms),
            pending_since_ms=(
                event.event_time_ms
                if state.pending_since_ms is None
                else min(state.pending_since_ms, event.event_time_ms)
            ),
            pending_high_signal=state.pending_high_signal or event.event_type in high_signal_types,
        ),
        outcome,
    )


def mark_prompted(state: SessionState, now_ms: int, fingerprint: int) -> SessionState:
    """Record that a prompt covering every event so far was sent (so no wake-up is owed)."""
    return replace(
        state,
        pending_since_ms=None,
        pending_high_signal=False,
        wake_at_ms=None,
        last_prompt_ms=now_ms,
        last_prompt_fingerprint=fingerprint,
        prompt_seq=state.prompt_seq + 1,
    )


def clear_pending(state: SessionState) -> SessionState:
    """Forget pending events that changed nothing material (no prompt or wake-up is owed
    for them)."""
    return replace(state, pending_since_ms=None, pending_high_signal=False, wake_at_ms=None)


def _close_session(state: SessionState) -> SessionState:
    categories = Counter(c for c in state.history.top_categories)
    brands = Counter(b for b in state.history.top_brands)
    for e in state.events:
        if e.category:
            categories[e.category] += 2 if e.event_type in ("add_to_cart", "purchase") else 1
        if e.brand:
            brands[e.brand] += 1
    history = History(
        sessions=state.history.sessions + 1,
        purchases=state.history.purchases + sum(e.event_type == "purchase" for e in state.events),
        top_categories=tuple(sorted(categories, key=lambda c: (-categories[c], c))[:HISTORY_TOP_N]),
        top_brands=tuple(sorted(brands, key=lambda b: (-brands[b], b))[:HISTORY_TOP_N]),
    )
    return replace(state, events=(), history=history, session_started_ms=0)
