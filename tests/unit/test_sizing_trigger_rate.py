"""The trigger rate of a sequence of events, from the job's own session and trigger code
replayed offline: one prompt covers a burst, qualifying events far apart prompt one each,
refused, duplicate and too-late records are not accepted, and the count can leave out a
warm-up and the prompts due after the last record."""

from __future__ import annotations

import pytest

from flink_jobs.config import AppConfig
from flink_jobs.core.events import ShopperEvent
from flink_jobs.tools.sizing.costs import INPUT
from flink_jobs.tools.sizing.trigger_rate import decode_records, rate_figures, replay_trigger
from tests.support.builders import (
    EARBUDS,
    ESPRESSO,
    HEADPHONES,
    SHOPPER,
    at,
    raw_event,
    shopper_event,
)

CONFIG = AppConfig()


def view(at_s: float, product: dict, shopper_id: str = SHOPPER) -> ShopperEvent:
    return shopper_event("view", at_s, product, shopper_id=shopper_id)


def add_to_cart(at_s: float, product: dict) -> ShopperEvent:
    return shopper_event("add_to_cart", at_s, product)


def replay(*events: ShopperEvent, config: AppConfig = CONFIG, **options):
    return replay_trigger(events, config, **options)


def test_a_burst_of_browsing_within_the_quiet_period_fires_one_prompt():
    burst = replay(view(0, HEADPHONES), view(0.1, ESPRESSO), view(0.2, EARBUDS))
    assert (burst.accepted_events, burst.prompts) == (3, 1)


def test_qualifying_events_further_apart_than_the_waits_fire_one_prompt_each():
    spaced = replay(view(0, HEADPHONES), view(10, ESPRESSO), add_to_cart(20, ESPRESSO))
    assert (spaced.accepted_events, spaced.prompts) == (3, 3)
    assert spaced.prompts_per_event == 1.0


def test_an_event_that_changes_nothing_material_fires_no_prompt():
    same_category = replay(view(0, HEADPHONES), view(10, EARBUDS))
    assert (same_category.accepted_events, same_category.prompts) == (2, 1)


def test_a_browsing_event_fires_when_its_quiet_period_ends():
    fires = replay(view(0, HEADPHONES)).fires
    assert fires == {SHOPPER: (at(CONFIG.trigger.quiet_s),)}


def test_a_high_signal_event_fires_at_once():
    assert replay(add_to_cart(0, ESPRESSO)).fires == {SHOPPER: (at(0),)}


def test_the_trigger_settings_given_decide_how_many_events_one_prompt_covers():
    events = (view(0, HEADPHONES), view(2, ESPRESSO))
    patient = CONFIG.with_overrides({"trigger": {"quiet_s": 3, "max_wait_s": 5}})
    assert replay(*events).prompts == 2
    assert replay(*events, config=patient).prompts == 1


def test_a_record_the_job_refuses_is_not_accepted():
    records = decode_records([b"not json", raw_event("s1", 0, "view", product=HEADPHONES)])
    replayed = replay_trigger(records, CONFIG)
    assert (replayed.accepted_events, replayed.prompts) == (1, 1)
    assert replayed.refused == {"malformed_json": 1}


def test_a_duplicate_is_accepted_once():
    event = view(0, HEADPHONES)
    twice = replay(event, event)
    assert twice.accepted_events == 1
    assert twice.counts["events_duplicate"] == 1


def test_an_event_further_behind_than_the_session_allows_is_dropped_not_accepted():
    newest = CONFIG.session.max_lateness_s + 60
    # The second event moves the watermark past the first, which the session then holds.
    replayed = replay(view(newest, HEADPHONES), view(newest + 2, ESPRESSO), view(0, EARBUDS))
    assert replayed.accepted_events == 2
    assert replayed.counts["events_late_dropped"] == 1


def test_events_out_of_order_within_the_watermarks_bound_count_as_in_order():
    first, second, cart = view(0, HEADPHONES), view(0.3, ESPRESSO), add_to_cart(5, ESPRESSO)
    in_order, swapped = replay(first, second, cart), replay(second, first, cart)
    assert swapped.fires == in_order.fires
    assert swapped.counts.get("events_late_folded", 0) == 0


def test_llm_calls_per_event_are_one_per_prompt():
    replayed = replay(view(0, HEADPHONES), view(0.1, ESPRESSO), add_to_cart(10, ESPRESSO))
    assert replayed.llm_calls_per_event == replayed.prompts_per_event == pytest.approx(2 / 3)


def test_what_happens_before_the_measured_record_arrives_is_replayed_but_not_counted():
    warm_up = (view(0, HEADPHONES), view(5, ESPRESSO, shopper_id="shopper-2"))
    measured = replay(*warm_up, view(10, EARBUDS), measured_from=2)
    # Counted: the second shopper's view, which the watermark passes (so the job applies
    # it, and its prompt fires) only after the measured record came, and that record, of
    # the same category as the first view, which the warm-up applied and prompted for.
    assert (measured.counted_records, measured.accepted_events, measured.prompts) == (1, 2, 1)


def test_without_settling_the_prompts_due_after_the_last_record_are_not_counted():
    assert replay(view(0, HEADPHONES)).prompts == 1
    assert replay(view(0, HEADPHONES), settle=False).prompts == 0


def test_no_accepted_event_gives_no_rate():
    assert replay_trigger([], CONFIG).prompts_per_event is None


def test_the_jobs_own_renderer_is_the_default():
    assert replay_trigger([view(0, HEADPHONES)]).prompts == 1


def test_the_figures_cite_the_events_and_what_was_counted():
    figures = rate_figures(replay(view(0, HEADPHONES), view(0.1, EARBUDS)), "events.jsonl")
    prompts, calls = figures["prompts_per_event"], figures["llm_calls_per_event"]
    assert (prompts.value, prompts.kind, prompts.source) == (0.5, INPUT, "events.jsonl")
    assert prompts.key.startswith("1 prompts / 2 accepted events of 2 records")
    assert calls.value == prompts.value
    assert "one LLM call per prompt" in calls.key


def test_events_with_none_valid_are_an_error_that_says_why():
    refused = replay_trigger(decode_records([b"{", b"[]"]), CONFIG)
    with pytest.raises(ValueError, match=r"no valid events: .* refuses all 2 records"):
        rate_figures(refused, "events.jsonl")
    with pytest.raises(ValueError, match="no valid events: there are no records"):
        rate_figures(replay_trigger([], CONFIG), "events.jsonl")
