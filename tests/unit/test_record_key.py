"""How decoded records are keyed: an event by its shopper, and a decode dead letter too, so
that it reaches the keyed operator, which writes every dead letter of the job."""

from __future__ import annotations

import time

import orjson

from flink_jobs.core.events import (
    UNKEYED_DEAD_LETTERS,
    DeadLetter,
    ShopperEvent,
    SourcePosition,
    decode_event,
    record_key,
)

NOW_MS = int(time.time() * 1000)


def _decoded(raw: bytes, offset: int = 7) -> ShopperEvent | DeadLetter:
    return decode_event(raw, SourcePosition("shopper-events", 2, offset, NOW_MS), NOW_MS, 16_384)


def _view(**fields) -> bytes:
    event = {
        "event_id": "ev-1",
        "shopper_id": "shopper-00001",
        "event_type": "view",
        "event_time": "2026-11-26T09:00:00Z",
        "product": {"product_id": "sku-737145", "title": "Trail running shoes"},
    }
    return orjson.dumps({**event, **fields})


def test_an_event_is_keyed_by_its_shopper() -> None:
    assert record_key(_decoded(_view())) == "shopper-00001"


def test_a_dead_letter_that_names_its_shopper_is_keyed_by_its_kafka_position() -> None:
    """Its fields failed validation, so none of them becomes a key."""
    refused = _decoded(_view(event_type="teleport"))
    assert isinstance(refused, DeadLetter)
    assert record_key(refused) == f"{UNKEYED_DEAD_LETTERS}:shopper-events:2:7"


def test_dead_letters_without_a_shopper_are_keyed_apart_by_their_kafka_position() -> None:
    """So a flood of unreadable records spreads over the keyed operator's subtasks."""
    keys = {record_key(_decoded(b"{not json", offset)) for offset in range(100)}
    assert len(keys) == 100
    assert all(key.startswith(UNKEYED_DEAD_LETTERS) for key in keys)


def test_no_event_can_carry_a_dead_letter_key_as_its_shopper() -> None:
    refused = _decoded(_view(shopper_id=f"{UNKEYED_DEAD_LETTERS}:shopper-events:2:7"))
    assert isinstance(refused, DeadLetter)
    assert refused.reason == "schema_violation"
