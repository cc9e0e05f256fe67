"""The per-shopper session state machine: one event in, a new immutable state and an
outcome out. Duplicates change nothing, late events are folded or dropped by a bound, a
quiet gap closes the session into history, and everything kept is bounded."""

from __future__ import annotations

import pytest

from flink_jobs.config import SessionConfig, TriggerConfig
from flink_jobs.core.events import ShopperEvent
from flink_jobs.core.session import (
    DEDUPE_WINDOW_FACTOR,
    History,
    Outcome,
    SessionState,
    apply_event,
    clear_pending,
    mark_prompted,
    new_session_state,
)
from tests.support.builders import EARBUDS, HEADPHONES, T0, shopper_event

SHOPPER = "shopper-00146"
CONFIG = SessionConfig(max_events=40, gap_s=30 * 60, max_lateness_s=10 * 60)
HIGH_SIGNAL = TriggerConfig().high_signal_types


SHOES = {
    "product_id": "sku-970664",
    "title": "Stridewell Cloudrun Women's Trail Running Shoes, Size 7.5",
    "category": "Sports & Outdoors > Running > Shoes",
    "brand": "Stridewell",
    "price": 118.99,
}


def event(
    event_type: str = "view",
    at_s: float = 0,
    product: dict | None = None,
    event_id: str | None = None,
    query: str = "",
) -> ShopperEvent:
    product = {} if event_type == "search" else (product or HEADPHONES)
    return shopper_event(
        event_type, at_s, product, shopper_id=SHOPPER, event_id=event_id, query=query
    )


def apply(state: SessionState, *events: ShopperEvent, config: SessionConfig = CONFIG):
    """Apply events in order; returns the final state and every outcome."""
    outcomes = []
    for e in events:
        state, outcome = apply_event(state, e, config, HIGH_SIGNAL)
        outcomes.append(outcome)
    return state, outcomes


def times(state: SessionState) -> list[float]:
    return [(e.event_time_ms - T0) / 1000 for e in state.events]


class TestAccepting:
    def test_first_event_starts_the_session(self) -> None:
        first = event("search", at_s=3, query="over ear headphones")

        state, [outcome] = apply(new_session_state(SHOPPER), first)

        assert outcome is Outcome.ACCEPTED
        assert state.events == (first,)
        assert state.session_started_ms == first.event_time_ms
        assert state.newest_event_ms == first.event_time_ms

    def test_events_in_order_are_appended(self) -> None:
        state, outcomes = apply(
            new_session_state(SHOPPER),
            event("search", 0, query="over ear headphones"),
            event("click", 25),
            event("view", 27),
        )

        assert outcomes == [Outcome.ACCEPTED] * 3
        assert times(state) == [0, 25, 27]

    def test_state_is_immutable(self) -> None:
        before = new_session_state(SHOPPER)

        apply(before, event())

        assert before == new_session_state(SHOPPER)
        with pytest.raises(AttributeError):
            before.events = ()  # type: ignore[misc]


class TestDuplicates:
    def test_duplicate_event_id_changes_nothing(self) -> None:
        state, _ = apply(new_session_state(SHOPPER), event(event_id="ev-91732b90b04260dd"))

        again, [outcome] = apply(state, event("view", 5, event_id="ev-91732b90b04260dd"))

        assert outcome is Outcome.DUPLICATE
        assert again is state

    def test_duplicate_is_recognised_after_its_event_left_the_session(self) -> None:
        config = SessionConfig(max_events=2, gap_s=1800, max_lateness_s=600)
        state, _ = apply(
            new_session_state(SHOPPER),
            event(at_s=0, event_id="ev-old"),
            event(at_s=1),
            event(at_s=2),
            config=config,
        )
        assert "ev-old" not in {e.event_id for e in state.events}

        _, [outcome] = apply(state, event(at_s=0, event_id="ev-old"), config=config)

        assert outcome is Outcome.DUPLICATE

    def test_dedupe_window_is_bounded(self) -> None:
        config = SessionConfig(max_events=2, gap_s=1800, max_lateness_s=600)
        window = config.max_events * DEDUPE_WINDOW_FACTOR
        state, _ = apply(
            new_session_state(SHOPPER),
            *(event(at_s=i, event_id=f"ev-{i}") for i in range(window + 5)),
            config=config,
        )

        assert len(state.recent_ids) == window
        # The oldest ids were forgotten: a replay of one is accepted again.
        _, [outcome] = apply(state, event(at_s=window + 5, event_id="ev-0"), config=config)
        assert outcome is Outcome.ACCEPTED


class TestLateEvents:
    def test_out_of_order_event_is_folded_in_event_time_order(self) -> None:
        state, outcomes = apply(
            new_session_state(SHOPPER), event(at_s=0), event(at_s=60), event(at_s=30)
        )

        assert outcomes == [Outcome.ACCEPTED, Outcome.ACCEPTED, Outcome.LATE_FOLDED]
        assert times(state) == [0, 30, 60]
        assert state.newest_event_ms == T0 + 60_000

    def test_late_event_within_the_bound_is_folded(self) -> None:
        newest = 20 * 60
        state, _ = apply(new_session_state(SHOPPER), event(at_s=newest))

        late, [outcome] = apply(state, event(at_s=newest - CONFIG.max_lateness_s))

        assert outcome is Outcome.LATE_FOLDED
        assert outcome.changed_session
        assert len(late.events) == 2

    def test_event_beyond_the_lateness_bound_is_dropped(self) -> None:
        newest = 20 * 60
        state, _ = apply(new_session_state(SHOPPER), event(at_s=newest))

        after, [outcome] = apply(state, event(at_s=newest - CONFIG.max_lateness_s - 1))

        assert outcome is Outcome.LATE_DROPPED
        assert not outcome.changed_session
        assert after is state

    def test_event_with_the_same_time_as_the_newest_is_not_late(self) -> None:
        state, _ = apply(new_session_state(SHOPPER), event(at_s=10))

        _, [outcome] = apply(state, event(at_s=10))

        assert outcome is Outcome.ACCEPTED


class TestSessionGap:
    def test_event_after_the_gap_starts_a_new_session(self) -> None:
        state, _ = apply(new_session_state(SHOPPER), event(at_s=0), event(at_s=60))
        returning = event(at_s=60 + CONFIG.gap_s + 1, product=SHOES)

        state, [outcome] = apply(state, returning)

        assert outcome is Outcome.ACCEPTED
        assert state.events == (returning,)
        assert state.session_started_ms == returning.event_time_ms

    def test_event_exactly_at_the_gap_stays_in_the_session(self) -> None:
        state, _ = apply(new_session_state(SHOPPER), event(at_s=0))

        state, _ = apply(state, event(at_s=CONFIG.gap_s))

        assert len(state.events) == 2
        assert state.history == History()

    def test_closed_session_is_folded_into_history(self) -> None:
        state, _ = apply(
            new_session_state(SHOPPER),
            event("view", 0, HEADPHONES),
            event("view", 10, EARBUDS),
            event("view", 20, SHOES),
            event("add_to_cart", 30, SHOES),
            event("purchase", 40, SHOES),
        )

        state, _ = apply(state, event("search", 40 + CONFIG.gap_s + 1, query="trail socks"))

        assert state.history == History(
            sessions=1,
            purchases=1,
            # add_to_cart and purchase weigh double: shoes 1 + 2 + 2 beat headphones 2.
            top_categories=(
                "Sports & Outdoors > Running > Shoes",
                "Electronics > Audio > Headphones",
            ),
            top_brands=("Stridewell", "Auralis", "Sonique"),
        )

    def test_history_accumulates_over_sessions(self) -> None:
        state = new_session_state(SHOPPER)
        for session in range(3):
            start = session * (CONFIG.gap_s + 600)
            state, _ = apply(state, event("view", start), event("purchase", start + 30))

        assert state.history.sessions == 2
        assert state.history.purchases == 2
        assert state.history.top_brands == ("Sonique",)


class TestBounds:
    def test_keeps_only_the_newest_max_events(self) -> None:
        config = SessionConfig(max_events=5, gap_s=1800, max_lateness_s=600)

        state, _ = apply(
            new_session_state(SHOPPER), *(event(at_s=i) for i in range(12)), config=config
        )

        assert times(state) == [7, 8, 9, 10, 11]

    def test_session_start_survives_eviction(self) -> None:
        config = SessionConfig(max_events=2, gap_s=1800, max_lateness_s=600)

        state, _ = apply(
            new_session_state(SHOPPER), *(event(at_s=i) for i in range(4)), config=config
        )

        assert state.session_started_ms == T0


class TestPendingBookkeeping:
    def test_first_event_opens_a_pending_window(self) -> None:
        state, _ = apply(new_session_state(SHOPPER), event(at_s=5), event(at_s=9))

        assert state.pending_since_ms == T0 + 5_000
        assert state.pending_high_signal is False

    def test_late_event_moves_pending_since_back(self) -> None:
        state, _ = apply(new_session_state(SHOPPER), event(at_s=50), event(at_s=20))

        assert state.pending_since_ms == T0 + 20_000

    @pytest.mark.parametrize("event_type", HIGH_SIGNAL)
    def test_high_signal_event_marks_pending_high_signal(self, event_type: str) -> None:
        state, _ = apply(new_session_state(SHOPPER), event("view", 0), event(event_type, 5))

        assert state.pending_high_signal is True

    def test_high_signal_flag_stays_until_prompted(self) -> None:
        state, _ = apply(new_session_state(SHOPPER), event("add_to_cart", 0), event("view", 5))

        assert state.pending_high_signal is True

    def test_duplicate_and_dropped_events_leave_pending_untouched(self) -> None:
        state, _ = apply(new_session_state(SHOPPER), event(at_s=700, event_id="ev-a"))
        state = mark_prompted(state, now_ms=T0 + 700_000, fingerprint=1)

        after, _ = apply(state, event(at_s=700, event_id="ev-a"), event("purchase", at_s=0))

        assert after.pending_since_ms is None
        assert after.pending_high_signal is False

    def test_mark_prompted_records_the_prompt_and_clears_pending(self) -> None:
        state, _ = apply(new_session_state(SHOPPER), event("add_to_cart", 0))

        prompted = mark_prompted(state, now_ms=T0 + 1_000, fingerprint=0xABC)

        assert prompted.pending_since_ms is None
        assert prompted.pending_high_signal is False
        assert prompted.last_prompt_ms == T0 + 1_000
        assert prompted.last_prompt_fingerprint == 0xABC
        assert prompted.prompt_seq == state.prompt_seq + 1
        assert prompted.events == state.events

    def test_prompt_sequence_grows_with_every_prompt(self) -> None:
        state = new_session_state(SHOPPER)
        for i in range(3):
            state, _ = apply(state, event(at_s=i * 20))
            state = mark_prompted(state, now_ms=T0 + i * 20_000, fingerprint=i)

        assert state.prompt_seq == 3

    def test_clear_pending_forgets_pending_without_counting_a_prompt(self) -> None:
        state, _ = apply(new_session_state(SHOPPER), event("purchase", 0))
        state = mark_prompted(state, now_ms=T0, fingerprint=7)
        state, _ = apply(state, event("view", 5))

        cleared = clear_pending(state)

        assert cleared.pending_since_ms is None
        assert cleared.pending_high_signal is False
        assert (cleared.prompt_seq, cleared.last_prompt_ms) == (1, T0)
        assert cleared.last_prompt_fingerprint == 7
