"""Decoding shopper events: every record becomes exactly one event or one dead letter whose
reason says what was wrong, and nothing raises on bad input."""

from __future__ import annotations

import base64
from typing import Any

import orjson
import pytest

from flink_jobs.core.events import (
    MAX_CLOCK_SKEW_MS,
    MAX_DEAD_LETTER_RAW_BYTES,
    DeadLetter,
    ShopperEvent,
    SourcePosition,
    decode_event,
    parse_event_time,
)
from flink_jobs.tools.sample_data import SampleConfig, generate_sample

MAX_BYTES = 16 * 1024
# 2026-06-01T09:00:00Z, the start of the bundled sample.
SAMPLE_START_MS = 1_780_304_400_000
NOW_MS = SAMPLE_START_MS + 3_600_000
SOURCE = SourcePosition("shopper-events", partition=3, offset=1234, timestamp_ms=NOW_MS)

PRODUCT_EVENT: dict[str, Any] = {
    "event_id": "ev-6ed90a919e15673f",
    "shopper_id": "shopper-00146",
    "event_type": "click",
    "event_time": "2026-06-01T09:00:28.644Z",
    "product": {
        "product_id": "sku-737145",
        "title": "Sonique Studio Pro Wireless Noise-Cancelling Over-Ear Headphones, Midnight Black",
        "category": "Electronics > Audio > Headphones",
        "brand": "Sonique",
        "price": 108.99,
    },
}
SEARCH_EVENT: dict[str, Any] = {
    "event_id": "ev-50b0404b30cc99e0",
    "shopper_id": "shopper-00146",
    "event_type": "search",
    "event_time": "2026-06-01T09:00:03.829Z",
    "query": "over ear headhones",
}


def decode(doc: Any, now_ms: int = NOW_MS, max_bytes: int = MAX_BYTES) -> Any:
    raw = doc if isinstance(doc, bytes) else orjson.dumps(doc)
    return decode_event(raw, SOURCE, now_ms, max_bytes)


def refused(doc: Any, **kwargs: Any) -> DeadLetter:
    outcome = decode(doc, **kwargs)
    assert isinstance(outcome, DeadLetter), f"expected a dead letter, got {outcome!r}"
    assert outcome.stage == "decode"
    return outcome


def with_time(event_time: Any) -> dict[str, Any]:
    return {**PRODUCT_EVENT, "event_time": event_time}


class TestValidEvents:
    def test_product_event_carries_every_product_field(self) -> None:
        event = decode(PRODUCT_EVENT)

        assert event == ShopperEvent(
            event_id="ev-6ed90a919e15673f",
            shopper_id="shopper-00146",
            event_type="click",
            event_time_ms=SAMPLE_START_MS + 28_644,
            product_id="sku-737145",
            title=PRODUCT_EVENT["product"]["title"],
            category="Electronics > Audio > Headphones",
            brand="Sonique",
            price=108.99,
        )

    def test_search_event_carries_the_query_and_no_product(self) -> None:
        event = decode(SEARCH_EVENT)

        assert isinstance(event, ShopperEvent)
        assert event.query == "over ear headhones"
        assert (event.product_id, event.title, event.price) == ("", "", None)

    def test_quantity_defaults_to_one_and_is_kept_when_given(self) -> None:
        cart = {**PRODUCT_EVENT, "event_type": "add_to_cart", "quantity": 2}

        assert decode(PRODUCT_EVENT).quantity == 1
        assert decode(cart).quantity == 2

    def test_event_time_may_be_epoch_milliseconds(self) -> None:
        event = decode(with_time(SAMPLE_START_MS + 28_644))

        assert event.event_time_ms == SAMPLE_START_MS + 28_644

    def test_event_time_as_a_whole_float_is_epoch_milliseconds(self) -> None:
        # JSON Schema counts 1.7e12 as an integer, so it must decode, not crash.
        event = decode(with_time(float(SAMPLE_START_MS)))

        assert event.event_time_ms == SAMPLE_START_MS

    def test_event_time_offset_is_applied(self) -> None:
        event = decode(with_time("2026-06-01T11:00:00+02:00"))

        assert event.event_time_ms == SAMPLE_START_MS

    def test_event_time_slightly_ahead_of_the_clock_is_accepted(self) -> None:
        event = decode(with_time(NOW_MS + MAX_CLOCK_SKEW_MS - 1000))

        assert isinstance(event, ShopperEvent)

    def test_every_generated_record_decodes_or_is_refused_as_expected(self) -> None:
        sample = generate_sample(SampleConfig(shoppers=40, seed=3))
        last_ms = parse_event_time(sample.expected.last_event_time)

        reasons = {}
        for index, raw in enumerate(sample.records):
            outcome = decode_event(raw, SOURCE, last_ms, MAX_BYTES)
            if isinstance(outcome, DeadLetter):
                reasons[index] = outcome.reason

        assert reasons == {b["index"]: b["reason"] for b in sample.expected.bad_records}


class TestRefusals:
    def test_oversized_record_is_refused_before_parsing(self) -> None:
        raw = orjson.dumps({**SEARCH_EVENT, "query": "x" * 300})

        dead = refused(raw, max_bytes=len(raw) - 1)

        assert dead.reason == "oversized"
        assert "job.max_event_bytes" in dead.detail

    def test_invalid_utf8_is_refused(self) -> None:
        raw = orjson.dumps(SEARCH_EVENT).replace(b"headhones", b"head\xff\xfehones")

        dead = refused(raw)

        assert dead.reason == "invalid_utf8"
        assert "byte" in dead.detail

    def test_malformed_json_is_refused(self) -> None:
        dead = refused(b'{"event_id": "ev-1", "shopper_id": ')

        assert dead.reason == "malformed_json"

    @pytest.mark.parametrize("raw", [b"[1, 2]", b'"view"', b"42", b"null"])
    def test_json_that_is_not_an_object_is_a_schema_violation(self, raw: bytes) -> None:
        dead = refused(raw)

        assert dead.reason == "schema_violation"
        assert "must be a JSON object" in dead.detail

    @pytest.mark.parametrize(
        ("change", "detail"),
        [
            ({"event_type": "wishlist"}, "event.event_type must be one of"),
            ({"shopper_id": "shopper 146; DROP"}, "event.shopper_id must match pattern"),
            ({"coupon": "SUMMER"}, "must not contain {'coupon'}"),
            ({"quantity": "2"}, "event.quantity"),
            ({"product": {"product_id": "sku-1", "price": -1}}, "event.product.price"),
        ],
    )
    def test_schema_violation_names_the_field(self, change: dict[str, Any], detail: str) -> None:
        dead = refused({**PRODUCT_EVENT, **change})

        assert dead.reason == "schema_violation"
        assert detail in dead.detail

    def test_product_event_without_product_is_a_schema_violation(self) -> None:
        doc = {k: v for k, v in PRODUCT_EVENT.items() if k != "product"}

        dead = refused(doc)

        assert dead.reason == "schema_violation"
        assert "product" in dead.detail

    def test_search_without_query_is_a_schema_violation(self) -> None:
        doc = {k: v for k, v in SEARCH_EVENT.items() if k != "query"}

        assert "query" in refused(doc).detail

    def test_schema_violation_keeps_the_shopper_id_when_readable(self) -> None:
        dead = refused({**PRODUCT_EVENT, "event_type": "wishlist"})

        assert dead.shopper_id == "shopper-00146"

    def test_missing_shopper_id_leaves_it_empty(self) -> None:
        doc = {k: v for k, v in PRODUCT_EVENT.items() if k != "shopper_id"}

        assert refused(doc).shopper_id == ""

    @pytest.mark.parametrize(
        "event_time",
        ["2026-06-01T09:00:00", "2026-06-01 09:00:00+02:00", "yesterday", True, 1.5],
    )
    def test_naive_or_unreadable_event_time_is_refused(self, event_time: Any) -> None:
        dead = refused(with_time(event_time))

        assert dead.reason in ("schema_violation", "invalid_event_time")
        assert "event_time" in dead.detail

    def test_date_time_shaped_but_impossible_event_time_is_invalid(self) -> None:
        dead = refused(with_time("2026-06-30T23:59:60Z"))

        assert dead.reason == "invalid_event_time"
        assert "2026-06-30T23:59:60Z" in dead.detail

    def test_far_future_event_time_is_refused(self) -> None:
        dead = refused(with_time(NOW_MS + MAX_CLOCK_SKEW_MS + 60_000))

        assert dead.reason == "event_time_in_future"
        assert "ahead of the clock" in dead.detail
        assert dead.shopper_id == "shopper-00146"

    def test_dead_letter_keeps_the_exact_bytes_and_source(self) -> None:
        raw = b'{"event_id": \xff'

        dead = refused(raw)

        assert dead.raw == raw
        assert dead.source == SOURCE


class TestParseEventTime:
    @pytest.mark.parametrize(
        "text",
        ["2026-06-01T09:00:00Z", "2026-06-01T09:00:00z", "2026-06-01T09:00:00.000+00:00"],
    )
    def test_rfc3339_with_offset(self, text: str) -> None:
        assert parse_event_time(text) == SAMPLE_START_MS

    @pytest.mark.parametrize("value", ["2026-06-01T09:00:00", "not a time", True, 1.5])
    def test_without_offset_or_unreadable_is_none(self, value: Any) -> None:
        assert parse_event_time(value) is None


class TestDeadLetterJson:
    def test_carries_reason_raw_base64_and_source_position(self) -> None:
        raw = b'{"event_id": "ev-1", "shopper_id": '
        dead = refused(raw)

        body = orjson.loads(dead.to_json(dead_lettered_at_ms=NOW_MS))

        assert body["stage"] == "decode"
        assert body["reason"] == "malformed_json"
        assert body["dead_lettered_at_ms"] == NOW_MS
        assert base64.b64decode(body["raw_base64"]) == raw
        assert body["raw_size"] == len(raw)
        assert body["raw_truncated"] is False
        assert body["source"] == {
            "topic": "shopper-events",
            "partition": 3,
            "offset": 1234,
            "timestamp_ms": NOW_MS,
        }

    def test_huge_raw_record_is_truncated_and_says_so(self) -> None:
        raw = b"x" * (MAX_DEAD_LETTER_RAW_BYTES + 100)
        dead = DeadLetter("decode", "oversized", "too big", raw=raw)

        body = orjson.loads(dead.to_json(NOW_MS))

        assert len(base64.b64decode(body["raw_base64"])) == MAX_DEAD_LETTER_RAW_BYTES
        assert body["raw_truncated"] is True
        assert body["raw_size"] == len(raw)

    def test_without_raw_source_or_shopper_they_are_null(self) -> None:
        dead = DeadLetter("llm", "timeout", "no answer")

        body = orjson.loads(dead.to_json(NOW_MS))

        assert body["raw_base64"] is None
        assert body["source"] is None
        assert body["shopper_id"] is None
        assert "context" not in body

    def test_context_is_included_when_given(self) -> None:
        dead = DeadLetter("intent", "not_json", "nope", "shopper-00146", context={"prompt_seq": 3})

        body = orjson.loads(dead.to_json(NOW_MS))

        assert body["shopper_id"] == "shopper-00146"
        assert body["context"] == {"prompt_seq": 3}
