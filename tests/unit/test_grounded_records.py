"""Grounded records, the pure parts: a prompt that fires carries the session's facts, its
rules-only intent and its categories; the record, the reader and the update notification
carry ``facts`` and ``source``; records and entries written before those fields existed
still read (as the model's, with no facts). The script against a real Redis is in
``tests/service/test_two_speed_store_redis.py``."""

from __future__ import annotations

import orjson
import pytest

from flink_jobs.config import AppConfig, PromptConfig
from flink_jobs.core.grounding import grounded_facts, rules_intent, session_category_enum
from flink_jobs.core.intents import parse_intent as parse_answer
from flink_jobs.core.prompting import PromptRenderer
from flink_jobs.core.tasks import PromptTask
from flink_jobs.core.timeline import on_event
from flink_jobs.runtime.inference import intent_record as record_of
from flink_jobs.runtime.inference import model_record
from flink_jobs.runtime.intent_store import RECORD_FIELDS, parse_stored, upsert_args
from intent_reader import parse_intent
from intent_reader.client import FIELDS
from intent_reader.layout import OPTIONAL_FIELDS
from intent_reader.updates import parse_update
from tests.support.builders import (
    EARBUDS,
    HEADPHONES,
    SHOPPER,
    at,
    intent_record,
    session_of,
    shopper_event,
)

CONFIG = AppConfig()
ANSWER = parse_answer(
    '{"intents":[{"label":"comparing_options","confidence":0.9,"category":"Headphones"},'
    '{"label":"ready_to_buy","confidence":0.4,"category":"Headphones"}],'
    '"summary":"Compared earbuds"}'
)
RENDER = PromptRenderer(PromptConfig()).render
NOW_MS = at(600)


def _events():
    return [
        shopper_event("search", 0, query="wireless headphones"),
        shopper_event("view", 10, HEADPHONES),
        shopper_event("view", 20, EARBUDS),
        shopper_event("add_to_cart", 30, HEADPHONES, quantity=1),
    ]


def fired_prompt() -> tuple[PromptTask, object]:
    """The prompt the add-to-cart fires (a high-signal event behind the watermark: at once)."""
    events = _events()
    state = session_of(*events[:-1])
    step = on_event(state, (), events[-1], at(60), CONFIG, RENDER)
    [task] = step.prompts
    return task, session_of(*events)


class TestThePromptCarriesTheFacts:
    def test_its_facts_are_the_sessions_grounded_facts(self) -> None:
        task, session = fired_prompt()

        assert orjson.loads(task.facts_json) == grounded_facts(session).as_dict()
        assert orjson.loads(task.facts_json)["cart"] == [
            {
                "product_id": HEADPHONES["product_id"],
                "quantity": 1,
                "category": HEADPHONES["category"],
            }
        ]

    def test_its_rules_intent_is_the_rules_for_that_session(self) -> None:
        task, session = fired_prompt()

        assert task.rules == rules_intent(grounded_facts(session), session)
        assert (task.rules.source, task.rules.top_label) == ("rules", "ready_to_buy")

    def test_its_categories_are_the_sessions_enum(self) -> None:
        task, session = fired_prompt()

        assert task.categories == session_category_enum(session)
        assert task.categories[0] == "Headphones"

    def test_a_task_pickled_before_these_fields_existed_still_loads(self) -> None:
        import pickle

        task, _ = fired_prompt()
        legacy = PromptTask(
            task.shopper_id, task.seq, task.version_ts, task.event_time_ms, task.prompt
        )

        again = pickle.loads(pickle.dumps(legacy))
        assert (again.facts_json, again.rules, again.categories) == ("", None, ())


class TestTheRecord:
    def test_the_upsert_writes_facts_and_source_after_the_other_fields(self) -> None:
        task, _ = fired_prompt()
        args = upsert_args(record_of(task, task.rules, ""), ttl_ms=60_000)

        fields = dict(zip(args[3::2], args[4::2], strict=True))
        assert RECORD_FIELDS[-3:] == ("facts", "source", "answer")
        assert (fields["source"], fields["model"], fields["answer"]) == ("rules", "", "")
        assert orjson.loads(fields["facts"]) == orjson.loads(task.facts_json)

    def test_the_models_record_carries_the_same_facts(self) -> None:
        task, _ = fired_prompt()

        record = model_record(task, ANSWER, "SmolLM2-135M-Instruct")

        assert (record.source, record.facts_json) == ("model", task.facts_json)

    def test_the_models_record_leads_with_the_rules_and_keeps_the_answer_beside(self) -> None:
        task, _ = fired_prompt()  # just added headphones to the cart: ready_to_buy by rule 2

        record = model_record(task, ANSWER, "SmolLM2-135M-Instruct")

        assert orjson.loads(record.intent_json)["intents"] == [
            {"label": "ready_to_buy", "confidence": 0.7, "category": "Headphones"},
            {"label": "comparing_options", "confidence": 0.7, "category": "Headphones"},
        ]
        assert (record.top_label, record.top_confidence) == ("ready_to_buy", 0.7)
        assert orjson.loads(record.answer_json) == ANSWER.body
        assert record.summary == "Compared earbuds"

    def test_a_claimed_purchase_of_an_unbought_cart_is_stored_with_the_rules_summary(
        self,
    ) -> None:
        task, _ = fired_prompt()  # one pair of headphones in the cart, nothing bought
        answer = parse_answer(
            '{"intents":[{"label":"post_purchase","confidence":0.9,"category":"Headphones"}],'
            '"summary":"Just bought the headphones, may want a case next"}'
        )

        record = model_record(task, answer, "SmolLM2-135M-Instruct")

        assert record.summary == task.rules.summary
        assert orjson.loads(record.intent_json)["summary"] == task.rules.summary
        assert record.summary.startswith("Just added Headphones to the cart (1 item in it)")
        assert orjson.loads(record.answer_json)["summary"].startswith("Just bought")

    def test_an_unknown_source_is_refused(self) -> None:
        with pytest.raises(ValueError, match="source"):
            intent_record().__class__(**{**_fields(intent_record()), "source": "guess"})

    def test_the_order_ranks_rules_below_the_model_at_one_version(self) -> None:
        rules = intent_record(version_ts=5, seq=2).__class__(
            **{**_fields(intent_record(version_ts=5, seq=2)), "source": "rules"}
        )
        model = intent_record(version_ts=5, seq=2)
        newer_rules = rules.__class__(**{**_fields(rules), "version_seq": 3})

        assert rules.ordered_version < model.ordered_version < newer_rules.ordered_version

    def test_a_stored_hash_without_facts_or_source_reads_as_the_models(self) -> None:
        args = upsert_args(intent_record(), ttl_ms=60_000)
        fields = dict(zip(args[3::2], args[4::2], strict=True))
        for name in OPTIONAL_FIELDS:
            del fields[name]
        fields |= {"version_ts": args[0], "version_seq": args[1], "written_at_ms": "7"}

        stored = parse_stored("shopper-1", fields)
        assert (stored.source, stored.facts) == ("model", None)


def _fields(record) -> dict:
    return {name: getattr(record, name) for name in record.__dataclass_fields__}


class TestTheReader:
    def _values(self, record) -> list[bytes | None]:
        args = upsert_args(record, ttl_ms=60_000)
        fields = dict(zip(args[3::2], args[4::2], strict=True))
        fields |= {"version_ts": args[0], "version_seq": args[1], "written_at_ms": str(NOW_MS)}
        return [fields[f].encode() if f in fields else None for f in FIELDS]

    def test_reads_the_facts_and_the_source(self) -> None:
        task, _ = fired_prompt()
        intent = parse_intent(SHOPPER, self._values(record_of(task, task.rules, "")), NOW_MS, 10**9)

        assert intent.source == "rules" and intent.is_rules_only
        assert intent.facts == orjson.loads(task.facts_json)
        assert intent.facts["event_counts"] == {"search": 1, "view": 2, "add_to_cart": 1}

    def test_a_record_written_before_the_fields_existed_reads_as_the_models(self) -> None:
        values = self._values(intent_record())
        for name in OPTIONAL_FIELDS:
            values[FIELDS.index(name)] = None

        intent = parse_intent("shopper-1", values, NOW_MS, 10**9)
        assert (intent.source, intent.facts, intent.is_rules_only) == ("model", None, False)
        assert intent.answer == intent.intent  # the answer was stored as is then

    def test_a_models_record_reads_with_the_answer_beside_the_intent(self) -> None:
        task, _ = fired_prompt()
        values = self._values(model_record(task, ANSWER, "SmolLM2-135M-Instruct"))

        intent = parse_intent(SHOPPER, values, NOW_MS, 10**9)

        assert intent.top_label == "ready_to_buy"
        assert intent.answer == ANSWER.body

    def test_a_rules_only_record_has_no_answer(self) -> None:
        task, _ = fired_prompt()
        values = self._values(record_of(task, task.rules, ""))

        assert parse_intent(SHOPPER, values, NOW_MS, 10**9).answer is None


NOTIFIED = {
    b"shopper_id": b"s",
    b"version_ts": b"5",
    b"version_seq": b"1",
    b"top_label": b"ready_to_buy",
    b"written_at_ms": b"9",
}


class TestTheNotification:
    def test_an_entry_carries_what_was_written(self) -> None:
        body = b'{"intents":[{"label":"ready_to_buy","confidence":0.7}],"summary":"x"}'
        extra = {
            b"source": b"rules",
            b"template": b"shopper_intent_v2.j2",
            b"model": b"",
            b"intent": body,
            b"answer": b"",
        }

        update = parse_update(b"1-0", {**NOTIFIED, **extra})

        assert (update.source, update.template, update.model) == (
            "rules",
            "shopper_intent_v2.j2",
            "",
        )
        assert update.intent == orjson.loads(body)
        assert update.answer_json == ""

    def test_an_entry_appended_before_those_fields_existed_still_parses(self) -> None:
        update = parse_update(b"1-0", NOTIFIED)

        assert (update.source, update.template, update.intent) == ("model", "", None)
