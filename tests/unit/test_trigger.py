"""The trigger policy: when a shopper's session is worth a prompt. High-signal events fire
at once, browsing waits for a quiet period but never longer than the max wait, prompts of
one shopper are spaced by the min interval, and nothing fires when nothing changed."""

from __future__ import annotations

from flink_jobs.config import SessionConfig, TriggerConfig
from flink_jobs.core.events import ShopperEvent
from flink_jobs.core.session import (
    SessionState,
    clear_pending,
    mark_prompted,
    new_session_state,
)
from flink_jobs.core.trigger import END_OF_TIME_MS, Verdict, decide, material_fingerprint
from tests.support.builders import at as ms
from tests.support.builders import session_of, shopper_event

SESSION = SessionConfig()
TRIGGER = TriggerConfig(quiet_s=5.0, max_wait_s=20.0, min_interval_s=10.0)

KETTLE = {
    "product_id": "sku-204311",
    "title": "Brewster Gooseneck Electric Kettle, 1L, Matte Black",
    "category": "Home & Kitchen > Kettles",
    "brand": "Brewster",
    "price": 59.0,
}
GOOSENECK_RIVAL = {
    "product_id": "sku-204988",
    "title": "Fellow-style Pour-Over Kettle, 0.9L, Stainless",
    "category": "Home & Kitchen > Kettles",
    "brand": "Pourline",
    "price": 74.0,
}
GRINDER = {
    "product_id": "sku-881902",
    "title": "Brewster Conical Burr Coffee Grinder, 18 Settings",
    "category": "Home & Kitchen > Coffee Grinders",
    "brand": "Brewster",
    "price": 89.5,
}


SHOPPER = "shopper-00299"


def event(event_type: str, at_s: float, product: dict | None = None) -> ShopperEvent:
    return shopper_event(event_type, at_s, product or KETTLE, shopper_id=SHOPPER)


def session(*events: ShopperEvent, state: SessionState | None = None) -> SessionState:
    state = state or new_session_state(SHOPPER)
    return session_of(*events, config=SESSION, high_signal=TRIGGER.high_signal_types, state=state)


def prompted_at(state: SessionState, at_s: float) -> SessionState:
    return mark_prompted(state, ms(at_s), material_fingerprint(state))


class TestIdle:
    def test_new_shopper_is_idle(self) -> None:
        decision = decide(new_session_state("shopper-00299"), ms(0), TRIGGER)

        assert decision.verdict is Verdict.IDLE
        assert decision.wake_at_ms is None

    def test_after_a_prompt_nothing_is_pending(self) -> None:
        state = prompted_at(session(event("add_to_cart", 0)), 0)

        assert decide(state, ms(30), TRIGGER).verdict is Verdict.IDLE


class TestHighSignal:
    def test_add_to_cart_fires_at_once(self) -> None:
        state = session(event("view", 0), event("add_to_cart", 2))

        decision = decide(state, ms(2), TRIGGER)

        assert decision.verdict is Verdict.FIRE
        assert decision.reason == "high-signal event"
        assert decision.fingerprint == material_fingerprint(state)

    def test_purchase_fires_at_once_even_mid_burst(self) -> None:
        state = session(*(event("view", s, GRINDER) for s in range(0, 4)), event("purchase", 4))

        assert decide(state, ms(4), TRIGGER).verdict is Verdict.FIRE


class TestEndOfTime:
    """Flink's last watermark, with records still arriving behind it (seen in a bounded run
    at parallelism 2)."""

    def test_a_change_pending_at_the_end_of_time_fires_within_the_minimum_interval(self) -> None:
        state = session(event("view", 0))
        # A prompt already made at the end of time: the minimum interval runs past it.
        state = mark_prompted(state, END_OF_TIME_MS, material_fingerprint(state))
        state = session(event("view", 1, GRINDER), state=state)

        decision = decide(state, END_OF_TIME_MS, TRIGGER)

        assert decision.verdict is Verdict.FIRE
        assert decision.reason == "end of input"
        assert decision.wake_at_ms is None

    def test_nothing_material_still_fires_nothing(self) -> None:
        state = prompted_at(session(event("view", 0)), 0)
        state = session(event("view", 1), state=state)  # the same kind, the same category

        assert decide(state, END_OF_TIME_MS, TRIGGER).verdict is Verdict.UNCHANGED


class TestBrowsing:
    def test_waits_for_the_quiet_period(self) -> None:
        state = session(event("view", 0))

        decision = decide(state, ms(0), TRIGGER)

        assert decision.verdict is Verdict.WAIT
        assert decision.reason == "quiet period"
        assert decision.wake_at_ms == ms(TRIGGER.quiet_s)

    def test_fires_once_the_shopper_has_been_quiet(self) -> None:
        state = session(event("view", 0), event("click", 1, GRINDER))

        decision = decide(state, ms(1 + TRIGGER.quiet_s), TRIGGER)

        assert decision.verdict is Verdict.FIRE
        assert decision.reason == "quiet period"

    def test_each_new_event_pushes_the_quiet_period_back(self) -> None:
        state = session(event("view", 0), event("view", 3, GRINDER))

        decision = decide(state, ms(3), TRIGGER)

        assert decision.wake_at_ms == ms(3 + TRIGGER.quiet_s)

    def test_max_wait_caps_a_shopper_who_never_pauses(self) -> None:
        # A view every 3 s: the quiet period never elapses.
        state = session(*(event("view", s, KETTLE if s % 2 else GRINDER) for s in range(0, 19, 3)))

        waiting = decide(state, ms(18), TRIGGER)
        due = decide(state, ms(TRIGGER.max_wait_s), TRIGGER)

        assert waiting.verdict is Verdict.WAIT
        assert waiting.reason == "max wait"
        assert waiting.wake_at_ms == ms(TRIGGER.max_wait_s)
        assert due.verdict is Verdict.FIRE
        assert due.reason == "max wait"

    def test_max_wait_counts_from_the_first_uncovered_event(self) -> None:
        state = prompted_at(session(event("view", 0)), 5)
        state = session(*(event("view", s, GRINDER) for s in range(30, 49, 3)), state=state)

        decision = decide(state, ms(48), TRIGGER)

        assert decision.wake_at_ms == ms(30 + TRIGGER.max_wait_s)


class TestMinInterval:
    def test_high_signal_soon_after_a_prompt_is_deferred(self) -> None:
        state = prompted_at(session(event("view", 0)), 5)
        state = session(event("add_to_cart", 7), state=state)

        decision = decide(state, ms(7), TRIGGER)

        assert decision.verdict is Verdict.WAIT
        assert decision.reason == "high-signal event"
        assert decision.wake_at_ms == ms(5 + TRIGGER.min_interval_s)

    def test_deferred_prompt_fires_when_the_interval_is_over(self) -> None:
        state = prompted_at(session(event("view", 0)), 5)
        state = session(event("add_to_cart", 7), state=state)

        assert decide(state, ms(5 + TRIGGER.min_interval_s), TRIGGER).verdict is Verdict.FIRE

    def test_quiet_period_after_the_interval_is_not_delayed(self) -> None:
        state = prompted_at(session(event("view", 0)), 5)
        state = session(event("view", 30, GRINDER), state=state)

        assert decide(state, ms(30), TRIGGER).wake_at_ms == ms(30 + TRIGGER.quiet_s)

    def test_zero_interval_never_defers(self) -> None:
        config = TriggerConfig(quiet_s=5.0, max_wait_s=20.0, min_interval_s=0.0)
        state = prompted_at(session(event("view", 0)), 5)
        state = session(event("add_to_cart", 5), state=state)

        assert decide(state, ms(5), config).verdict is Verdict.FIRE


class TestUnchanged:
    def test_re_viewing_the_same_product_is_unchanged(self) -> None:
        state = prompted_at(session(event("view", 0), event("add_to_cart", 1)), 1)
        state = session(event("view", 40), event("view", 45), state=state)

        decision = decide(state, ms(60), TRIGGER)

        assert decision.verdict is Verdict.UNCHANGED
        assert decision.wake_at_ms is None

    def test_a_product_in_a_new_category_is_a_material_change(self) -> None:
        state = prompted_at(session(event("view", 0)), 5)
        state = session(event("view", 40, GRINDER), state=state)

        assert decide(state, ms(40), TRIGGER).verdict is Verdict.WAIT

    def test_another_product_of_a_category_already_browsed_is_unchanged(self) -> None:
        state = prompted_at(session(event("view", 0)), 5)
        state = session(event("click", 40, GOOSENECK_RIVAL), state=state)

        assert decide(state, ms(60), TRIGGER).verdict is Verdict.UNCHANGED

    def test_a_new_kind_of_event_on_the_same_product_is_a_material_change(self) -> None:
        state = prompted_at(session(event("view", 0)), 5)
        state = session(event("add_to_cart", 40), state=state)

        assert decide(state, ms(40), TRIGGER).verdict is Verdict.FIRE

    def test_first_prompt_is_never_unchanged(self) -> None:
        state = session(event("view", 0))

        assert decide(state, ms(10), TRIGGER).verdict is Verdict.FIRE

    def test_clearing_pending_after_unchanged_makes_the_shopper_idle(self) -> None:
        state = prompted_at(session(event("view", 0)), 5)
        state = session(event("view", 40), state=state)
        assert decide(state, ms(40), TRIGGER).verdict is Verdict.UNCHANGED

        assert decide(clear_pending(state), ms(41), TRIGGER).verdict is Verdict.IDLE


class TestFingerprint:
    def test_ignores_event_times_and_repetitions(self) -> None:
        once = session(event("view", 0), event("view", 5, GRINDER))
        again = session(event("view", 100), event("view", 120, GRINDER), event("view", 130))

        assert material_fingerprint(once) == material_fingerprint(again)

    def test_depends_on_kinds_of_action_and_categories(self) -> None:
        viewed = session(event("view", 0))

        assert material_fingerprint(viewed) != material_fingerprint(
            session(event("add_to_cart", 0))
        )
        assert material_fingerprint(viewed) != material_fingerprint(
            session(event("view", 0, GRINDER))
        )

    def test_views_and_clicks_are_both_browsing(self) -> None:
        viewed = session(event("view", 0))

        assert material_fingerprint(viewed) == material_fingerprint(
            session(event("click", 0, GOOSENECK_RIVAL))
        )

    def test_depends_on_history(self) -> None:
        first = session(event("view", 0))
        returning = session(
            event("purchase", 0, GRINDER), event("view", SESSION.gap_s + 10)
        )  # the gap closes the grinder session into history

        assert first.events[0].product_id == returning.events[0].product_id
        assert material_fingerprint(first) != material_fingerprint(returning)
