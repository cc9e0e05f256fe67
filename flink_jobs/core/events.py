"""Decoding and validating shopper events: raw Kafka bytes in, an event or a dead letter out.

Every record gets exactly one outcome. Nothing here raises on bad input: the reason a
record was refused is data (a :class:`DeadLetter`), so it can be counted and written to
the dead-letter topic with the exact bytes that caused it.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cache
from operator import attrgetter
from typing import TYPE_CHECKING, Any, TypeVar

import fastjsonschema
import orjson

from flink_jobs.paths import resource_dir

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
SCHEMAS_DIR = resource_dir("schemas")

EVENT_TYPES = ("view", "click", "add_to_cart", "remove_from_cart", "purchase", "search")

#: Events stamped further ahead of the clock than this are refused: a far-future time would
#: push the shopper's session and the watermark forward and make every later event late.
MAX_CLOCK_SKEW_MS = 5 * 60 * 1000
#: Raw bytes kept in a dead letter; the rest is cut so one huge record can't bloat the topic.
MAX_DEAD_LETTER_RAW_BYTES = 64 * 1024
#: A shopper id as the event schema admits it: a refused record's dead letter names its
#: shopper only when the id has this shape (the record's bytes keep whatever it held).
_SHOPPER_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


#: A dataclass's class, for the decorator below.
_Dataclass = TypeVar("_Dataclass", bound="DataclassInstance")


def pickled_by_fields(cls: type[_Dataclass]) -> type[_Dataclass]:
    """Pickle a frozen, slotted dataclass as its constructor and its field values.

    The job stores sessions, held events and prompts in Flink state, which pickles them on
    every write; the default pickling of a slotted dataclass goes through Python-level
    ``__getstate__`` for each object, this through one C ``attrgetter`` call, several times
    faster to dump (``docs/decisions.md#pickled-by-fields``).
    """
    fields = attrgetter(*(f.name for f in dataclasses.fields(cls)))

    def __reduce__(self: object) -> tuple[Any, ...]:
        return cls, fields(self)

    # Installing a method on the decorated class is this decorator's whole job.
    cls.__reduce__ = __reduce__  # type: ignore[method-assign]
    return cls


@dataclass(frozen=True, slots=True)
class SourcePosition:
    topic: str
    partition: int
    offset: int
    timestamp_ms: int


@pickled_by_fields
@dataclass(frozen=True, slots=True)
class ShopperEvent:
    event_id: str
    shopper_id: str
    event_type: str
    event_time_ms: int
    product_id: str = ""
    title: str = ""
    category: str = ""
    brand: str = ""
    price: float | None = None
    query: str = ""
    quantity: int = 1


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """Why a record was refused, with everything needed to find and replay it."""

    stage: str  #: decode | late | hold | prompt | llm | intent | store
    reason: str  #: a stable code, e.g. malformed_json
    detail: str  #: a human sentence: what is wrong and what to fix
    shopper_id: str = ""
    source: SourcePosition | None = None
    raw: bytes = b""
    context: dict[str, Any] | None = None

    def to_json(self, dead_lettered_at_ms: int) -> bytes:
        raw = self.raw[:MAX_DEAD_LETTER_RAW_BYTES]
        body: dict[str, Any] = {
            "stage": self.stage,
            "reason": self.reason,
            "detail": self.detail,
            "shopper_id": self.shopper_id or None,
            "dead_lettered_at_ms": dead_lettered_at_ms,
            "source": None,
            "raw_base64": base64.b64encode(raw).decode("ascii") if raw else None,
            "raw_truncated": len(self.raw) > len(raw),
            "raw_size": len(self.raw),
        }
        if self.source is not None:
            body["source"] = {
                "topic": self.source.topic,
                "partition": self.source.partition,
                "offset": self.source.offset,
                "timestamp_ms": self.source.timestamp_ms,
            }
        if self.context:
            body["context"] = self.context
        return orjson.dumps(body)


@cache
def load_schema(name: str) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((SCHEMAS_DIR / name).read_text())
    return schema


@cache
def _event_validator() -> Callable[[Any], Any]:
    return fastjsonschema.compile(load_schema("shopper_event.schema.json"))


def decode_event(
    raw: bytes, source: SourcePosition | None, now_ms: int, max_bytes: int
) -> ShopperEvent | DeadLetter:
    """Turn one record's bytes into a :class:`ShopperEvent`, or say why not."""

    def refuse(reason: str, detail: str, shopper_id: str = "") -> DeadLetter:
        return DeadLetter("decode", reason, detail, shopper_id, source, raw)

    if len(raw) > max_bytes:
        return refuse(
            "oversized",
            f"record is {len(raw)} bytes; the limit is {max_bytes} (job.max_event_bytes)",
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return refuse("invalid_utf8", f"record is not UTF-8: {exc.reason} at byte {exc.start}")
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        return refuse("malformed_json", f"record is not JSON: {exc}")
    if not isinstance(doc, dict):
        return refuse("schema_violation", f"record must be a JSON object, got {type(doc).__name__}")
    shopper_id = well_formed_shopper_id(doc.get("shopper_id"))
    try:
        _event_validator()(doc)
    except fastjsonschema.JsonSchemaValueException as exc:
        return refuse("schema_violation", _schema_message(exc), shopper_id)
    event_time_ms = parse_event_time(doc["event_time"])
    if event_time_ms is None:
        return refuse(
            "invalid_event_time", f"event_time {doc['event_time']!r} is not RFC 3339", shopper_id
        )
    if event_time_ms < 0:
        # The schema bounds epoch ms at 0; RFC 3339 text must not sneak below it (a session's
        # newest_event_ms starts at 0, so a negative time would corrupt lateness and gaps).
        return refuse(
            "invalid_event_time",
            f"event_time {doc['event_time']!r} is before 1970-01-01T00:00:00Z",
            shopper_id,
        )
    if event_time_ms > now_ms + MAX_CLOCK_SKEW_MS:
        return refuse(
            "event_time_in_future",
            f"event_time is {(event_time_ms - now_ms) // 1000} s ahead of the clock "
            f"(at most {MAX_CLOCK_SKEW_MS // 1000} s allowed)",
            shopper_id,
        )
    product = doc.get("product") or {}
    return ShopperEvent(
        event_id=doc["event_id"],
        shopper_id=doc["shopper_id"],
        event_type=doc["event_type"],
        event_time_ms=event_time_ms,
        product_id=product.get("product_id", ""),
        title=product.get("title", ""),
        category=product.get("category", ""),
        brand=product.get("brand", ""),
        price=product.get("price"),
        query=doc.get("query", ""),
        quantity=int(doc.get("quantity", 1)),
    )


def well_formed_shopper_id(value: object) -> str:
    """``value`` if it is a shopper id the event schema admits, else "": a record that fails
    validation may hold any text there (kilobytes, line breaks), which must not reach a
    dead letter's ``shopper_id``, logs or keys."""
    return value if isinstance(value, str) and _SHOPPER_ID.fullmatch(value) else ""


def parse_event_time(value: object) -> int | None:
    """Epoch milliseconds from RFC 3339 text (an offset is required) or epoch ms."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        # JSON Schema counts 1.7e12 as an integer, so a whole float passes validation.
        return int(value) if float(value).is_integer() else None
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        return None
    if parsed.tzinfo is None:
        return None
    # Exact integer arithmetic: timestamp() * 1000 can land a millisecond low.
    return (parsed - _EPOCH) // timedelta(milliseconds=1)


def _schema_message(exc: fastjsonschema.JsonSchemaValueException) -> str:
    where = exc.name.replace("data", "event", 1) if exc.name else "event"
    return f"{where}: {exc.message.replace(exc.name or 'data', where, 1)}"[:300]


#: The key prefix of decode dead letters that name no shopper: they pass through the keyed
#: operator like events (NUL is not in any shopper id the event schema admits).
UNKEYED_DEAD_LETTERS = "\x00dead-letters"


def record_key(record: ShopperEvent | DeadLetter) -> str:
    """The shopper a decoded event belongs to, for ``key_by``; a decode dead letter's key is
    its Kafka position.

    A refused record's fields are unvalidated text, so none becomes a key; keyed apart,
    a flood of unreadable records spreads over the keyed operator's subtasks instead of
    landing on one (they write no state, so a key each costs nothing)."""
    if isinstance(record, ShopperEvent):
        return record.shopper_id
    source = record.source
    if source is None:
        return UNKEYED_DEAD_LETTERS
    return f"{UNKEYED_DEAD_LETTERS}:{source.topic}:{source.partition}:{source.offset}"
