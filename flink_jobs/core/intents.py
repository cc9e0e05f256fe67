"""Turning what the model answered into a schema-valid intent, or a reason it is not one.

Guided decoding should make every answer valid, but the job also talks to endpoints that
ignore ``response_format``, so the answer is checked against the same bounded schema the
server was asked to follow. Only a valid intent ever reaches Redis.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import fastjsonschema
import orjson

from flink_jobs.core.events import load_schema

INTENT_SCHEMA_NAME = "shopper_intent.schema.json"
MAX_ANSWER_CHARS = 8192


@dataclass(frozen=True, slots=True)
class Intent:
    body: dict[str, Any]
    top_label: str
    top_confidence: float
    summary: str
    # "model" for a parsed answer, "rules" for one derived from the session's facts alone
    # (flink_jobs.core.grounding): readers and the eval tell the two apart.
    source: str = "model"

    def to_json(self) -> bytes:
        return orjson.dumps(self.body)


@dataclass(frozen=True, slots=True)
class IntentError:
    reason: str  # empty_answer | not_json | schema_violation | too_long
    detail: str


@cache
def _validator():
    return fastjsonschema.compile(load_schema(INTENT_SCHEMA_NAME))


def intent_response_format(categories: Sequence[str] | None = None) -> dict[str, Any]:
    """The OpenAI ``response_format`` that asks the server to decode into the schema.

    Given ``categories`` (the session's, ``grounding.session_category_enum``), each intent's
    ``category`` is required and must be one of them: the model cannot invent one. The
    format travels with the request, so the prompt (and its cached prefix) is unchanged.
    """
    schema = {k: v for k, v in load_schema(INTENT_SCHEMA_NAME).items() if not k.startswith("$")}
    if categories:
        schema = copy.deepcopy(schema)
        item = schema["properties"]["intents"]["items"]
        item["properties"]["category"] = {"type": "string", "enum": list(categories)}
        item["required"] = [*item["required"], "category"]
    return {
        "type": "json_schema",
        "json_schema": {"name": "shopper_intent", "schema": schema, "strict": True},
    }


def parse_intent(answer: str | None) -> Intent | IntentError:
    if not answer or not answer.strip():
        return IntentError("empty_answer", "the model returned no text")
    if len(answer) > MAX_ANSWER_CHARS:
        return IntentError(
            "too_long", f"answer is {len(answer)} characters; at most {MAX_ANSWER_CHARS}"
        )
    text = _strip_fences(answer.strip())
    try:
        body = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        return IntentError("not_json", f"answer is not JSON ({exc}): {answer[:200]!r}")
    try:
        _validator()(body)
    except fastjsonschema.JsonSchemaValueException as exc:
        return IntentError("schema_violation", f"{exc.message}: {answer[:200]!r}")
    # Small models repeat a label; keep its most confident entry.
    best: dict[str, dict[str, Any]] = {}
    for item in body["intents"]:
        if item["label"] not in best or item["confidence"] > best[item["label"]]["confidence"]:
            best[item["label"]] = item
    intents = sorted(best.values(), key=lambda i: -i["confidence"])
    body = {"intents": intents, "summary": body["summary"]}
    return Intent(body, intents[0]["label"], float(intents[0]["confidence"]), body["summary"])


def _strip_fences(text: str) -> str:
    """Models without guided decoding like to wrap JSON in a markdown fence."""
    if text.startswith("```"):
        text = text.split("\n", 1)[1] if "\n" in text else text[3:]
        if text.rstrip().endswith("```"):
            text = text.rstrip()[:-3]
    return text.strip()
