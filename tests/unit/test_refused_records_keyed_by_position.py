"""A record that fails validation is keyed by its Kafka position only, and the shopper id
its dead letter names is one the event schema admits or none: text
that failed validation never becomes a Flink key or a dead letter's ``shopper_id``."""

from __future__ import annotations

import re
import time

import orjson
from hypothesis import given
from hypothesis import strategies as st

from flink_jobs.core.events import (
    UNKEYED_DEAD_LETTERS,
    DeadLetter,
    SourcePosition,
    decode_event,
    record_key,
)

NOW_MS = int(time.time() * 1000)
SHOPPER_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")  # schemas/shopper_event.schema.json
SOURCE = SourcePosition("shopper-events", 2, 41_077, NOW_MS)


def refused(**fields: object) -> DeadLetter:
    event = {
        "event_id": "ev-1",
        "shopper_id": "shopper-00001",
        "event_type": "view",
        "event_time": "2026-11-26T09:00:00Z",
        "product": {"product_id": "sku-737145", "title": "Trail running shoes"},
    }
    result = decode_event(orjson.dumps({**event, **fields}), SOURCE, NOW_MS, 16_384)
    assert isinstance(result, DeadLetter)
    return result


def test_an_8000_character_shopper_id_with_newlines_is_neither_key_nor_shopper() -> None:
    text = ("ignore previous instructions\n" * 300)[:8_000]

    dead_letter = refused(shopper_id=text)

    assert record_key(dead_letter) == f"{UNKEYED_DEAD_LETTERS}:shopper-events:2:41077"
    assert dead_letter.shopper_id == ""
    body = orjson.loads(dead_letter.to_json(NOW_MS))
    assert body["shopper_id"] is None
    assert orjson.loads(dead_letter.raw)["shopper_id"] == text  # the bytes are all kept


def test_a_dead_letter_with_a_well_formed_shopper_id_is_still_keyed_by_its_position() -> None:
    dead_letter = refused(event_type="teleport")

    assert dead_letter.shopper_id == "shopper-00001"
    assert record_key(dead_letter) == f"{UNKEYED_DEAD_LETTERS}:shopper-events:2:41077"


@given(shopper_id=st.text(max_size=200))
def test_no_text_that_fails_validation_becomes_a_key(shopper_id: str) -> None:
    dead_letter = refused(shopper_id=shopper_id, event_type="teleport")

    assert record_key(dead_letter) == f"{UNKEYED_DEAD_LETTERS}:shopper-events:2:41077"
    assert dead_letter.shopper_id == "" or SHOPPER_ID.fullmatch(dead_letter.shopper_id)
