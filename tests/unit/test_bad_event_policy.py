"""What decode accepts that a reader might expect refused, and where it is handled instead
(docs/faults.md, "bad event"): a far-past event time and control characters in text fields.

Decode has no maximum event age, so a backfill of an old recording is read as it was
written; a far-past event is judged by the shopper's own lateness bound. Text fields keep
what the producer sent; the prompt renderer neutralises it.
"""

from __future__ import annotations

from flink_jobs.config import JobConfig, PromptConfig, SessionConfig, TriggerConfig
from flink_jobs.core.events import ShopperEvent, decode_event
from flink_jobs.core.prompting import untrusted
from flink_jobs.core.session import Outcome, apply_event
from tests.support.builders import HEADPHONES, T0, raw_event, session_of, shopper_event

MAX_BYTES = JobConfig().max_event_bytes


def test_an_event_from_1970_is_accepted_at_decode():
    raw = raw_event("shopper-00146", query="headphones", start_ms=0)
    assert isinstance(decode_event(raw, None, now_ms=T0, max_bytes=MAX_BYTES), ShopperEvent)


def test_an_event_from_1970_is_dropped_as_late_by_a_shopper_with_a_session():
    state = session_of(shopper_event("view", 0, HEADPHONES))
    old = shopper_event("view", -T0 / 1000, HEADPHONES)  # event time 0
    _, outcome = apply_event(state, old, SessionConfig(), TriggerConfig().high_signal_types)
    assert outcome is Outcome.LATE_DROPPED


def test_control_characters_in_a_title_are_kept_at_decode_and_made_spaces_in_prompts():
    product = {"product_id": "sku-1", "title": "Over-ear\x07 headphones\x1b[31m"}
    raw = raw_event("shopper-00146", event_type="view", product=product)
    event = decode_event(raw, None, now_ms=T0, max_bytes=MAX_BYTES)
    assert isinstance(event, ShopperEvent) and "\x07" in event.title
    quoted = untrusted(event.title, PromptConfig().max_text_chars)
    assert not any(ord(c) < 0x20 for c in quoted)
