"""Parsing what the model answered: a schema-valid intent (sorted, most confident first) or
an error whose reason says what was wrong. Only a valid intent ever reaches Redis."""

from __future__ import annotations

from typing import Any

import fastjsonschema
import orjson
import pytest

from flink_jobs.core.events import load_schema
from flink_jobs.core.intents import (
    MAX_ANSWER_CHARS,
    Intent,
    IntentError,
    intent_response_format,
    parse_intent,
)

ANSWER: dict[str, Any] = {
    "intents": [
        {"label": "comparing_options", "confidence": 0.72, "category": "headphones"},
        {"label": "researching_product", "confidence": 0.2},
    ],
    "summary": "Comparing over-ear headphones from Sonique and Auralis.",
}


def answer(**changes: Any) -> str:
    return orjson.dumps({**ANSWER, **changes}).decode()


def error_of(text: str | None) -> IntentError:
    parsed = parse_intent(text)
    assert isinstance(parsed, IntentError), f"expected an error, got {parsed!r}"
    return parsed


class TestValidAnswers:
    def test_valid_answer_becomes_an_intent(self) -> None:
        intent = parse_intent(answer())

        assert intent == Intent(
            body=ANSWER,
            top_label="comparing_options",
            top_confidence=0.72,
            summary="Comparing over-ear headphones from Sonique and Auralis.",
        )

    def test_intents_are_sorted_most_confident_first(self) -> None:
        shuffled = [
            {"label": "browsing", "confidence": 0.1},
            {"label": "ready_to_buy", "confidence": 0.8},
            {"label": "deal_seeking", "confidence": 0.35},
        ]

        intent = parse_intent(answer(intents=shuffled))

        assert [i["label"] for i in intent.body["intents"]] == [
            "ready_to_buy",
            "deal_seeking",
            "browsing",
        ]
        assert (intent.top_label, intent.top_confidence) == ("ready_to_buy", 0.8)

    def test_equal_confidences_keep_the_model_order(self) -> None:
        tied = [
            {"label": "gift_shopping", "confidence": 0.5},
            {"label": "browsing", "confidence": 0.5},
        ]

        assert parse_intent(answer(intents=tied)).top_label == "gift_shopping"

    def test_a_repeated_label_keeps_its_most_confident_entry(self) -> None:
        repeated = [
            {"label": "browsing", "confidence": 0.2},
            {"label": "deal_seeking", "confidence": 0.3},
            {"label": "browsing", "confidence": 0.6, "category": "kettles"},
        ]

        intent = parse_intent(answer(intents=repeated))

        assert intent.body["intents"] == [
            {"label": "browsing", "confidence": 0.6, "category": "kettles"},
            {"label": "deal_seeking", "confidence": 0.3},
        ]

    def test_integer_confidence_is_a_float_top_confidence(self) -> None:
        intent = parse_intent(answer(intents=[{"label": "post_purchase", "confidence": 1}]))

        assert intent.top_confidence == 1.0
        assert isinstance(intent.top_confidence, float)

    def test_json_in_a_markdown_fence_is_accepted(self) -> None:
        fenced = f"```json\n{answer()}\n```"

        assert parse_intent(fenced).top_label == "comparing_options"

    def test_bare_fence_and_surrounding_whitespace_are_accepted(self) -> None:
        assert isinstance(parse_intent(f"\n  ```\n{answer()}```  \n"), Intent)

    def test_to_json_is_the_sorted_body(self) -> None:
        intent = parse_intent(answer())

        assert orjson.loads(intent.to_json()) == ANSWER


class TestRefusedAnswers:
    @pytest.mark.parametrize("text", [None, "", "   \n"])
    def test_empty_answer(self, text: str | None) -> None:
        assert error_of(text).reason == "empty_answer"

    def test_prose_is_not_json(self) -> None:
        error = error_of("The shopper wants headphones.")

        assert error.reason == "not_json"
        assert "The shopper wants headphones." in error.detail

    def test_truncated_json_is_not_json(self) -> None:
        assert error_of(answer()[:40]).reason == "not_json"

    def test_answer_too_long_is_refused_before_parsing(self) -> None:
        error = error_of(" " * MAX_ANSWER_CHARS + answer())

        assert error.reason == "too_long"
        assert str(MAX_ANSWER_CHARS) in error.detail

    @pytest.mark.parametrize(
        ("changes", "why"),
        [
            ({"intents": [{"label": "refund_fraud", "confidence": 0.9}]}, "must be one of"),
            ({"intents": [{"label": "browsing", "confidence": 1.5}]}, "smaller than or equal"),
            ({"intents": [{"label": "browsing", "confidence": -0.1}]}, "bigger than or equal"),
            ({"intents": [{"label": "browsing", "confidence": "high"}]}, "must be number"),
            ({"intents": [{"label": "browsing", "confidence": 0.2}] * 4}, "must contain less"),
            ({"intents": []}, "must contain at least"),
            ({"summary": ""}, "summary"),
            ({"summary": "x" * 161}, "summary"),
            ({"summary": "Wants <b>headphones</b>"}, "summary"),
            ({"summary": "Line one\nline two"}, "summary"),
            ({"reasoning": "because"}, "must not contain"),
            ({"intents": [{"label": "browsing", "confidence": 0.5, "why": "x"}]}, "not contain"),
            ({"intents": [{"label": "browsing", "confidence": 0.5, "category": "x" * 61}]}, ""),
        ],
        ids=[
            "unknown_label",
            "confidence_above_one",
            "confidence_below_zero",
            "confidence_not_a_number",
            "too_many_intents",
            "no_intents",
            "empty_summary",
            "summary_too_long",
            "summary_with_markup",
            "summary_with_newline",
            "extra_top_level_key",
            "extra_intent_key",
            "category_too_long",
        ],
    )
    def test_schema_violation(self, changes: dict[str, Any], why: str) -> None:
        error = error_of(answer(**changes))

        assert error.reason == "schema_violation"
        assert why in error.detail

    def test_missing_summary_is_a_schema_violation(self) -> None:
        assert error_of(orjson.dumps({"intents": ANSWER["intents"]}).decode()).reason == (
            "schema_violation"
        )

    def test_json_that_is_not_an_object_is_a_schema_violation(self) -> None:
        assert error_of('["ready_to_buy"]').reason == "schema_violation"

    def test_detail_quotes_the_start_of_the_answer(self) -> None:
        error = error_of(answer(intents=[{"label": "refund_fraud", "confidence": 0.9}]))

        assert "refund_fraud" in error.detail


class TestResponseFormat:
    def test_asks_for_strict_json_schema_decoding(self) -> None:
        fmt = intent_response_format()

        assert fmt["type"] == "json_schema"
        assert fmt["json_schema"]["name"] == "shopper_intent"
        assert fmt["json_schema"]["strict"] is True

    def test_is_the_intent_schema_without_meta_keys(self) -> None:
        schema = intent_response_format()["json_schema"]["schema"]

        assert not any(key.startswith("$") for key in schema)
        assert schema["properties"] == load_schema("shopper_intent.schema.json")["properties"]

    def test_every_parsed_intent_validates_against_it(self) -> None:
        validate = fastjsonschema.compile(intent_response_format()["json_schema"]["schema"])

        validate(orjson.loads(parse_intent(answer()).to_json()))
