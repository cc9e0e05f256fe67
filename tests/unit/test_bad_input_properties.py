"""Bad input, property by property: whatever bytes, sessions or model
answers arrive, the event decoder, the session state machine, the prompt renderer and the
intent parser never raise, and every input ends in one counted, explained outcome.

Expected values are computed here from the schemas and the documented rules, not from the
modules' private helpers, so a property fails when a module drifts from its contract.
"""

from __future__ import annotations

import base64
import json
import re
import unicodedata
from collections import Counter
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from functools import cache
from typing import Any

import fastjsonschema
import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import event as count_case
from hypothesis import strategies as st

from flink_jobs.config import PromptConfig, SessionConfig, TriggerConfig
from flink_jobs.core.events import (
    EVENT_TYPES,
    MAX_CLOCK_SKEW_MS,
    MAX_DEAD_LETTER_RAW_BYTES,
    DeadLetter,
    ShopperEvent,
    SourcePosition,
    decode_event,
    load_schema,
)
from flink_jobs.core.intents import Intent, IntentError, parse_intent
from flink_jobs.core.prompting import (
    ANGLE_LOOKALIKES,
    PromptError,
    PromptRenderer,
    RenderedPrompt,
)
from flink_jobs.core.session import (
    DEDUPE_WINDOW_FACTOR,
    History,
    Outcome,
    SessionState,
    apply_event,
    new_session_state,
)
from flink_jobs.core.token_budget import token_counter
from flink_jobs.tools.sample_data import PROMPT_INJECTIONS
from tests.support.builders import EARBUDS, HEADPHONES, T0

NOW_MS = T0 + 3_600_000
MAX_BYTES = 16 * 1024  # job.max_event_bytes default
SOURCE = SourcePosition("shopper-events", partition=0, offset=7, timestamp_ms=NOW_MS)
HIGH_SIGNAL = TriggerConfig().high_signal_types

DECODE_REASONS = {
    "oversized",
    "invalid_utf8",
    "malformed_json",
    "schema_violation",
    "invalid_event_time",
    "event_time_in_future",
}
INTENT_REASONS = {"empty_answer", "not_json", "schema_violation", "too_long"}

# No deadline: the first example of a test compiles a JSON schema or parses the template.
# No example database: failures are reproduced from the printed case, not from a folder.
PROPERTY = settings(
    max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
SLOW_PROPERTY = settings(PROPERTY, max_examples=60)


@cache
def schema_validator(name: str):
    return fastjsonschema.compile(load_schema(name))


# --- strategies: hostile text ---------------------------------------------------------------

SURROGATES = ("\ud800", "\udbff", "\udc00", "\udfff")
HOSTILE_FRAGMENTS = (
    "<events>",
    "</events>",
    "<",
    ">",
    "\n",
    "\r\n",
    "\t",
    '"',
    "'",
    "\\",
    "\\u003c",
    "\x00",
    "\x1b[31m",
    "\x7f",
    "\x85",
    "\u2028",
    "\u2029",
    "\u202e",  # right-to-left override
    "\u2066",
    "\ufeff",
    "\u0301",
    "😀",
    "{",
    "}",
    "SYSTEM: ",
    "### Assistant:",
    *PROMPT_INJECTIONS,
)
# Text a shopper or seller could type: arbitrary Unicode scalars (no surrogates: they
# can't survive the UTF-8 decoder) mixed with delimiters, escapes and injections.
hostile_text = st.one_of(
    st.text(max_size=30),
    st.lists(st.one_of(st.text(max_size=8), st.sampled_from(HOSTILE_FRAGMENTS)), max_size=10).map(
        "".join
    ),
    st.builds(
        lambda piece, times: piece * times,
        st.sampled_from(HOSTILE_FRAGMENTS),
        st.integers(min_value=50, max_value=400),
    ),
)
# Text that only an encoder could produce: lone surrogates, which Python's json escapes.
raw_text = st.one_of(
    hostile_text,
    st.lists(st.one_of(st.text(max_size=4), st.sampled_from(SURROGATES)), max_size=6).map("".join),
)

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),  # NaN and infinities become non-standard JSON literals
    raw_text,
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)

# --- strategies: shopper events -------------------------------------------------------------

ids = st.from_regex(r"[A-Za-z0-9._:-]{1,64}", fullmatch=True)
OFFSETS = [timezone(timedelta(hours=h, minutes=m)) for h, m in ((0, 0), (14, 0), (-23, -59))]
rfc3339_times = st.builds(
    lambda moment, zulu, fraction: moment.isoformat(
        timespec="milliseconds" if fraction else "seconds"
    ).replace("+00:00", "Z" if zulu else "+00:00"),
    st.datetimes(
        min_value=datetime(1, 1, 2),
        max_value=datetime(9999, 12, 30),
        timezones=st.sampled_from(OFFSETS),
    ),
    st.booleans(),
    st.booleans(),
)
# Times the schema accepts: near the clock, or anywhere from 1970 (year 1 as text) to 9999.
schema_valid_times = st.one_of(
    st.integers(min_value=NOW_MS - 86_400_000, max_value=NOW_MS + 2 * MAX_CLOCK_SKEW_MS),
    st.integers(min_value=0, max_value=32_503_680_000_000),
    rfc3339_times,
)
event_times = st.one_of(
    schema_valid_times,
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    st.booleans(),
    st.datetimes().map(datetime.isoformat),  # naive: no offset
    st.sampled_from(
        [
            "2026-06-30T23:59:60Z",
            "1969-12-31T23:59:59.999Z",
            "1970-01-01T00:00:00Z",
            "0001-01-01T00:00:00+14:00",
            "9999-12-31T23:59:59.999999-23:59",
            "2026-02-30T09:00:00Z",
            "2026-06-01T09:00:00+24:00",
            "",
        ]
    ),
    hostile_text,
)
products = st.fixed_dictionaries(
    {"product_id": st.text(min_size=1, max_size=64)},
    optional={
        "title": st.text(max_size=300),
        "category": st.text(max_size=120),
        "brand": st.text(max_size=80),
        "price": st.one_of(st.floats(min_value=0, max_value=1_000_000), st.integers(0, 1_000_000)),
    },
)


@st.composite
def event_docs(draw) -> dict[str, Any]:
    """An event that passes the schema (its time may still be refused by the decoder)."""
    event_type = draw(st.sampled_from(EVENT_TYPES))
    doc: dict[str, Any] = {
        "event_id": draw(ids),
        "shopper_id": draw(ids),
        "event_type": event_type,
        "event_time": draw(schema_valid_times),
    }
    if event_type == "search":
        doc["query"] = draw(st.text(min_size=1, max_size=300))
    else:
        doc["product"] = draw(products)
    if draw(st.booleans()):
        doc["quantity"] = draw(st.integers(min_value=1, max_value=1000))
    return doc


@st.composite
def broken_event_docs(draw) -> dict[str, Any]:
    """An event with a few fields removed, retyped, blown up, renamed or unknown."""
    doc = draw(event_docs())
    doc["event_time"] = draw(event_times)
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        key = draw(st.sampled_from([*doc, "product", "query", "quantity", "coupon", ""]))
        action = draw(st.sampled_from(["drop", "retype", "huge", "hostile", "unknown_type"]))
        if action == "drop":
            doc.pop(key, None)
        elif action == "retype":
            doc[key] = draw(json_values)
        elif action == "huge":
            doc[key] = "x" * draw(st.sampled_from([65, 301, 5_000, 20_000]))
        elif action == "hostile":
            doc[key] = draw(raw_text)
        else:
            doc["event_type"] = draw(st.sampled_from(["wishlist", "VIEW", " view", "", "null"]))
    return doc


def to_bytes(doc: Any, ascii_only: bool) -> bytes:
    """Serialise like a careless producer would: big ints, NaN, escaped lone surrogates,
    or (without ASCII escaping) raw surrogate bytes that are not UTF-8."""
    return json.dumps(doc, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


records = st.one_of(
    st.binary(max_size=200),
    st.builds(to_bytes, json_values, st.booleans()),
    st.builds(to_bytes, event_docs(), st.booleans()),
    st.builds(to_bytes, broken_event_docs(), st.booleans()),
    st.builds(lambda doc: orjson.dumps(doc)[: len(orjson.dumps(doc)) // 2], event_docs()),
)


def as_event_doc(event: ShopperEvent) -> dict[str, Any]:
    """The event as a producer would have sent it, to validate against the event schema."""
    doc: dict[str, Any] = {
        "event_id": event.event_id,
        "shopper_id": event.shopper_id,
        "event_type": event.event_type,
        "event_time": event.event_time_ms,
        "quantity": event.quantity,
    }
    if event.product_id:
        product = {
            "product_id": event.product_id,
            "title": event.title,
            "category": event.category,
            "brand": event.brand,
        }
        doc["product"] = product if event.price is None else {**product, "price": event.price}
    if event.query:
        doc["query"] = event.query
    return doc


def assert_dead_letter_json(dead: DeadLetter) -> None:
    body = orjson.loads(dead.to_json(dead_lettered_at_ms=NOW_MS))

    assert (body["stage"], body["reason"], body["detail"]) == (
        dead.stage,
        dead.reason,
        dead.detail,
    )
    kept = dead.raw[:MAX_DEAD_LETTER_RAW_BYTES]
    assert (base64.b64decode(body["raw_base64"]) if body["raw_base64"] else b"") == kept
    assert body["raw_size"] == len(dead.raw)
    assert body["raw_truncated"] is (len(dead.raw) > MAX_DEAD_LETTER_RAW_BYTES)


class TestDecodeEvent:
    @PROPERTY
    @given(raw=records)
    def test_any_record_becomes_a_valid_event_or_an_explained_dead_letter(self, raw: bytes) -> None:
        outcome = decode_event(raw, SOURCE, NOW_MS, MAX_BYTES)

        count_case(getattr(outcome, "reason", "event"))
        if isinstance(outcome, DeadLetter):
            assert (outcome.stage, outcome.source, outcome.raw) == ("decode", SOURCE, raw)
            assert outcome.reason in DECODE_REASONS
            assert outcome.detail.strip()
            assert_dead_letter_json(outcome)
        else:
            assert isinstance(outcome, ShopperEvent)
            schema_validator("shopper_event.schema.json")(as_event_doc(outcome))
            assert 0 <= outcome.event_time_ms <= NOW_MS + MAX_CLOCK_SKEW_MS

    @PROPERTY
    @given(doc=event_docs())
    def test_a_schema_valid_event_is_refused_only_for_its_time(self, doc: dict) -> None:
        outcome = decode_event(orjson.dumps(doc), SOURCE, NOW_MS, MAX_BYTES)

        if isinstance(outcome, DeadLetter):
            assert outcome.reason in ("invalid_event_time", "event_time_in_future"), outcome
            assert outcome.shopper_id == doc["shopper_id"]
        else:
            assert (outcome.event_id, outcome.shopper_id, outcome.event_type) == (
                doc["event_id"],
                doc["shopper_id"],
                doc["event_type"],
            )
            assert outcome.query == doc.get("query", "")
            assert outcome.title == doc.get("product", {}).get("title", "")

    @SLOW_PROPERTY
    @given(
        head=st.binary(max_size=50),
        size=st.sampled_from(
            [MAX_BYTES + 1, MAX_DEAD_LETTER_RAW_BYTES, MAX_DEAD_LETTER_RAW_BYTES + 1, 200_000]
        ),
    )
    def test_an_oversized_record_is_dead_lettered_with_its_bytes_up_to_the_limit(
        self, head: bytes, size: int
    ) -> None:
        raw = (head + b"x" * size)[:size]

        outcome = decode_event(raw, SOURCE, NOW_MS, MAX_BYTES)

        assert isinstance(outcome, DeadLetter) and outcome.reason == "oversized"
        assert_dead_letter_json(outcome)


# --- session state ------------------------------------------------------------------------

PRODUCTS = (HEADPHONES, EARBUDS)


@st.composite
def session_events(draw, pool: list[str]) -> ShopperEvent:
    """A decoded, catalogue-shaped event of one shopper: ids from a small pool (so they
    repeat), times scattered around T0 with occasional jumps of hours or weeks."""
    event_type = draw(st.sampled_from(EVENT_TYPES))
    jump = draw(st.sampled_from([0, 0, 0, 3_600_000, 86_400_000, 30 * 86_400_000]))
    at_ms = T0 + jump + draw(st.integers(min_value=-1_800_000, max_value=1_800_000))
    fields = (
        {"query": draw(st.sampled_from(["over ear headphones", "earbuds", "anc"]))}
        if event_type == "search"
        else draw(st.sampled_from(PRODUCTS))
    )
    return ShopperEvent(
        event_id=draw(st.sampled_from(pool) | ids),
        shopper_id="shopper-00146",
        event_type=event_type,
        event_time_ms=at_ms,
        quantity=draw(st.integers(min_value=1, max_value=3)),
        **fields,
    )


@st.composite
def event_streams(draw) -> list[ShopperEvent]:
    pool = [f"ev-{i}" for i in range(draw(st.integers(min_value=1, max_value=15)))]
    events = draw(st.lists(session_events(pool), min_size=1, max_size=40))
    # Redeliveries of the very same event, anywhere later in the stream.
    for _ in range(draw(st.integers(min_value=0, max_value=5))):
        original = draw(st.sampled_from(events))
        events.insert(draw(st.integers(min_value=0, max_value=len(events))), original)
    return events


session_configs = st.builds(
    SessionConfig,
    max_events=st.integers(min_value=1, max_value=8),
    gap_s=st.sampled_from([60.0, 30 * 60.0, 6 * 3600.0]),
    max_lateness_s=st.sampled_from([1.0, 10 * 60.0, 3600.0]),
)


# The session's newest event redelivered after more late events than the dedupe window
# remembers: its id is gone from the window, but the event itself is still in the session.
_NEWEST = ShopperEvent("ev-newest", "shopper-00146", "view", T0, **HEADPHONES)
REDELIVERED_AFTER_LATE_BURST = [
    _NEWEST,
    *(replace(_NEWEST, event_id=f"ev-late-{i}", event_time_ms=T0 - 1000 - i) for i in range(9)),
    _NEWEST,
]


def replay(events: list[ShopperEvent], config: SessionConfig):
    state = new_session_state("shopper-00146")
    steps = []
    for event in events:
        after, outcome = apply_event(state, event, config, HIGH_SIGNAL)
        steps.append((state, event, after, outcome))
        state = after
    return state, steps


class TestSessionState:
    @PROPERTY
    @given(events=event_streams(), config=session_configs)
    def test_state_stays_sorted_and_bounded(self, events: list, config: SessionConfig) -> None:
        _, steps = replay(events, config)

        for _, _, after, _ in steps:
            times = [e.event_time_ms for e in after.events]
            assert times == sorted(times)
            assert len(after.events) <= config.max_events
            assert len(after.recent_ids) <= config.max_events * DEDUPE_WINDOW_FACTOR

    @PROPERTY
    @given(events=event_streams(), config=session_configs)
    @example(
        events=REDELIVERED_AFTER_LATE_BURST,
        config=SessionConfig(max_events=2, gap_s=1800, max_lateness_s=600),
    )
    def test_an_event_seen_recently_or_still_in_the_session_changes_nothing(
        self, events: list, config: SessionConfig
    ) -> None:
        _, steps = replay(events, config)

        for before, event, after, outcome in steps:
            seen = {*before.recent_ids, *(e.event_id for e in before.events)}
            if event.event_id in seen:
                assert outcome is Outcome.DUPLICATE, (event, before)
            if not outcome.changed_session:
                assert after == before

    @PROPERTY
    @given(events=event_streams(), config=session_configs)
    def test_delivering_every_event_twice_ends_in_the_same_state(
        self, events: list, config: SessionConfig
    ) -> None:
        once, _ = replay(events, config)
        twice, _ = replay([e for event in events for e in (event, event)], config)

        assert twice == once

    @PROPERTY
    @given(events=event_streams(), config=session_configs)
    def test_every_event_gets_one_outcome_that_matches_its_time(
        self, events: list, config: SessionConfig
    ) -> None:
        final, steps = replay(events, config)

        counts = Counter(outcome for *_, outcome in steps)
        for outcome in counts:
            count_case(outcome.value)
        assert sum(counts.values()) == len(events)
        folded = [event.event_time_ms for _, event, _, o in steps if o.changed_session]
        assert final.newest_event_ms == max(folded)
        for before, event, _, outcome in steps:
            if outcome is Outcome.ACCEPTED:
                assert event.event_time_ms >= before.newest_event_ms
            elif outcome is Outcome.LATE_FOLDED:
                assert event.event_time_ms < before.newest_event_ms
            elif outcome is Outcome.LATE_DROPPED:
                late_ms = before.newest_event_ms - event.event_time_ms
                assert late_ms > config.max_lateness_s * 1000


# --- prompt rendering ---------------------------------------------------------------------

# What the renderer promises to blank out of untrusted text: C0/C1 controls, the Unicode
# line and paragraph separators, and the bidirectional embedding/override/isolate marks.
_MUST_BLANK = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_JSON_STRING = r'"(?:[^"\\\x00-\x1f]|\\.)*"'
_EVENT_LINE = re.compile(
    r"\+\d{2,}:\d{2} (?P<type>[a-z_]+)"
    rf"(?: query=(?P<query>{_JSON_STRING}))?"
    rf"(?: title=(?P<title>{_JSON_STRING}))?"
    rf"(?: category=(?P<category>{_JSON_STRING}))?"
    rf"(?: brand=(?P<brand>{_JSON_STRING}))?"
    r"(?: price=\d+\.\d{2})?(?: qty=\d+)?"
)
_HISTORY_LINE = re.compile(
    r"Shopper history: \d+ earlier sessions, \d+ purchases"
    rf"(?:; usual categories: (?P<categories>{_JSON_STRING}(?:, {_JSON_STRING})*))?"
    rf"(?:; usual brands: (?P<brands>{_JSON_STRING}(?:, {_JSON_STRING})*))?\."
)
QUESTION = "What does this shopper intend right now?"


def cleaned(text: str, max_chars: int) -> str:
    """What ``untrusted`` shows of ``text``: controls blanked, format characters dropped,
    NFKC, lookalike brackets made plain, cut."""
    visible = "".join(c for c in _MUST_BLANK.sub(" ", text) if unicodedata.category(c) != "Cf")
    return unicodedata.normalize("NFKC", visible).translate(ANGLE_LOOKALIKES)[:max_chars]


def quoted_values(segment: str | None) -> list[str]:
    """Each JSON string literal of a ``"a", "b"`` list, decoded."""
    return [json.loads(token) for token in re.findall(_JSON_STRING, segment or "")]


@cache
def renderer(max_prompt_tokens: int = 3500, max_text_chars: int = 120) -> PromptRenderer:
    return PromptRenderer(
        PromptConfig(
            template="shopper_intent_v1.j2",  # the events block ends the v1 prompt
            max_prompt_tokens=max_prompt_tokens,
            max_text_chars=max_text_chars,
        )
    )


@st.composite
def hostile_sessions(draw) -> SessionState:
    """A session whose every shopper- or seller-typed value is hostile text."""
    count = draw(st.integers(min_value=1, max_value=16))
    events = []
    for n, at_s in enumerate(
        sorted(draw(st.lists(st.integers(0, 3600), min_size=count, max_size=count)))
    ):
        event_type = draw(st.sampled_from(EVENT_TYPES))
        events.append(
            ShopperEvent(
                event_id=f"ev-{n}",
                shopper_id="shopper-00043",
                event_type=event_type,
                event_time_ms=T0 + at_s * 1000,
                product_id="" if event_type == "search" else "sku-900001",
                title=draw(hostile_text),
                category=draw(hostile_text),
                brand=draw(hostile_text),
                price=draw(st.none() | st.floats(min_value=0, max_value=1_000_000)),
                query=draw(hostile_text),
                quantity=draw(st.integers(min_value=1, max_value=1000)),
            )
        )
    history = History(
        sessions=draw(st.integers(min_value=0, max_value=500)),
        purchases=draw(st.integers(min_value=0, max_value=500)),
        top_categories=tuple(filter(None, draw(st.lists(hostile_text, max_size=5)))),
        top_brands=tuple(filter(None, draw(st.lists(hostile_text, max_size=5)))),
    )
    return SessionState(
        shopper_id="shopper-00043",
        events=tuple(events),
        history=history,
        session_started_ms=events[0].event_time_ms,
        newest_event_ms=events[-1].event_time_ms,
    )


def benign_system_message(render: PromptRenderer) -> str:
    state = new_session_state("shopper-00146")
    state = replace(state, events=(ShopperEvent("ev-1", "shopper-00146", "view", T0),))
    return render.render(state).messages[0]["content"]


budgets = st.sampled_from(
    [(3500, 120), (3500, 300), (1500, 120), (1000, 120), (700, 40), (400, 120)]
)


class TestPromptRendering:
    @SLOW_PROPERTY
    @given(state=hostile_sessions(), budget=budgets)
    def test_hostile_text_stays_quoted_inside_one_events_block(
        self, state: SessionState, budget: tuple[int, int]
    ) -> None:
        render = renderer(*budget)
        try:
            prompt = render.render(state)
        except PromptError:
            return  # covered by the budget property below

        system, user = (m["content"] for m in prompt.messages)
        assert system == benign_system_message(render)
        lines = user.splitlines()
        assert lines[1] == "<events>" and lines[-2] == "</events>" and lines[-1] == QUESTION
        assert user.count("<") == 2, "a raw '<' outside the two delimiters"
        assert len(lines) == 4 + prompt.events_included

        max_chars = budget[1]
        history = _HISTORY_LINE.fullmatch(lines[0])
        assert history, lines[0]
        assert quoted_values(history["categories"]) == [
            cleaned(c, max_chars) for c in state.history.top_categories
        ]
        assert quoted_values(history["brands"]) == [
            cleaned(b, max_chars) for b in state.history.top_brands
        ]
        for line, event in zip(lines[2:-2], state.events[prompt.events_dropped :], strict=True):
            match = _EVENT_LINE.fullmatch(line)
            assert match, line
            assert match["type"] == event.event_type
            for field in ("query", "title", "category", "brand"):
                value = getattr(event, field)
                token = match[field]
                assert (json.loads(token) if token else "") == (
                    cleaned(value, max_chars) if value else ""
                )

    @SLOW_PROPERTY
    @given(state=hostile_sessions(), budget=budgets)
    def test_the_budget_holds_or_not_even_the_newest_event_fits(
        self, state: SessionState, budget: tuple[int, int]
    ) -> None:
        max_prompt_tokens, max_chars = budget
        try:
            prompt = renderer(*budget).render(state)
        except PromptError as exc:
            count_case("prompt_error")
            assert "prompt.max_prompt_tokens" in str(exc)
            alone = replace(state, events=state.events[-1:])
            unbounded = renderer(10**9, max_chars).render(alone)
            assert unbounded.estimated_tokens > max_prompt_tokens
            return

        assert isinstance(prompt, RenderedPrompt)
        count_case("events dropped" if prompt.events_dropped else "all events kept")
        assert prompt.estimated_tokens <= max_prompt_tokens
        assert prompt.estimated_tokens == token_counter("auto").count(prompt.messages)
        assert prompt.events_included + prompt.events_dropped == len(state.events)
        assert prompt.events_included >= 1


# --- model answers ------------------------------------------------------------------------

LABELS = tuple(
    load_schema("shopper_intent.schema.json")["properties"]["intents"]["items"]["properties"][
        "label"
    ]["enum"]
)
valid_intent_items = st.fixed_dictionaries(
    {"label": st.sampled_from(LABELS), "confidence": st.floats(min_value=0, max_value=1)},
    optional={"category": st.from_regex(r"[A-Za-z0-9 &',.()/+-]{0,40}", fullmatch=True)},
)
valid_answers = st.fixed_dictionaries(
    {
        "intents": st.lists(valid_intent_items, min_size=1, max_size=3),
        "summary": st.from_regex(r"[A-Za-z0-9 ,.'-]{1,120}", fullmatch=True),
    }
)
wrong_values = {
    "label": st.one_of(hostile_text, st.sampled_from(["refund_fraud", "BROWSING", ""])),
    "confidence": st.one_of(st.sampled_from([1.0000001, -1e-9, 2, 10**30, "0.9"]), st.floats()),
    "category": st.one_of(hostile_text, st.text(min_size=41, max_size=60)),
    "summary": st.one_of(hostile_text, st.text(min_size=121, max_size=5_000)),
}


@st.composite
def near_valid_answers(draw) -> dict[str, Any]:
    """A valid answer with one or two things wrong: a label, a confidence, a category or
    the summary, an extra key, or intents of the wrong shape."""
    doc = draw(valid_answers)
    for _ in range(draw(st.integers(min_value=1, max_value=2))):
        intents = doc["intents"] if isinstance(doc["intents"], list) else []
        items = [i for i in intents if isinstance(i, dict)]
        item = draw(st.sampled_from(items)) if items else {}
        key = draw(st.sampled_from([*wrong_values, "extra_key", "intents"]))
        if key == "summary":
            doc["summary"] = draw(wrong_values["summary"])
        elif key in wrong_values:
            item[key] = draw(wrong_values[key])
        elif key == "extra_key":
            target = draw(st.sampled_from([doc, item]))
            target[draw(st.sampled_from(["reasoning", "why", "intent"]))] = draw(json_values)
        else:
            doc["intents"] = draw(st.one_of(json_values, st.lists(valid_intent_items, min_size=4)))
    return doc


def as_answer(doc: Any, ascii_only: bool, wrapper: str) -> str:
    text = json.dumps(doc, ensure_ascii=ascii_only)
    return wrapper.replace("{}", text)


answers = st.one_of(
    st.none(),
    raw_text,
    st.builds(as_answer, json_values, st.booleans(), st.just("{}")),
    st.builds(as_answer, near_valid_answers(), st.booleans(), st.just("{}")),
    st.builds(
        as_answer,
        valid_answers,
        st.booleans(),
        st.sampled_from(["{}", "```json\n{}\n```", "```{}```", "  {}\n"]),
    ),
    st.builds(
        as_answer,
        valid_answers,
        st.booleans(),
        st.sampled_from(["Sure! {}", "{}{}", "{} trailing", "```json\n{}", "{}".join("[]")]),
    ),
)


class TestParseIntent:
    @settings(PROPERTY, max_examples=400)
    @given(answer=answers)
    def test_any_answer_becomes_a_schema_valid_intent_or_an_explained_error(
        self, answer: str | None
    ) -> None:
        parsed = parse_intent(answer)

        count_case(getattr(parsed, "reason", "intent"))
        if isinstance(parsed, IntentError):
            assert parsed.reason in INTENT_REASONS
            assert parsed.detail.strip()
            return
        assert isinstance(parsed, Intent)
        schema_validator("shopper_intent.schema.json")(parsed.body)
        schema_validator("shopper_intent.schema.json")(orjson.loads(parsed.to_json()))
        intents = parsed.body["intents"]
        labels = [i["label"] for i in intents]
        assert len(set(labels)) == len(labels)
        assert [i["confidence"] for i in intents] == sorted(
            (i["confidence"] for i in intents), reverse=True
        )
        assert (parsed.top_label, parsed.top_confidence) == (
            intents[0]["label"],
            float(intents[0]["confidence"]),
        )
        assert parsed.summary == parsed.body["summary"]


@pytest.mark.parametrize("injection", PROMPT_INJECTIONS)
def test_an_injection_echoed_as_the_answer_is_not_an_intent(injection: str) -> None:
    assert isinstance(parse_intent(injection), IntentError)
