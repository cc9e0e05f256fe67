"""Turning what the model answered into a schema-valid intent, or a reason it is not one.

Guided decoding should make every answer valid, but the job also talks to endpoints that
ignore ``response_format``, so the answer is checked against the same bounded schema the
server was asked to follow. Only a valid intent ever reaches Redis.
"""

from __future__ import annotations

import bisect
import copy
import math
import re
from collections.abc import Callable, Sequence
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
    #: "model" for a parsed answer, "rules" for one derived from the session's facts alone
    #: (flink_jobs.core.grounding): readers and the eval tell the two apart.
    source: str = "model"

    def to_json(self) -> bytes:
        return orjson.dumps(self.body)


@dataclass(frozen=True, slots=True)
class IntentError:
    reason: str  #: empty_answer | not_json | schema_violation | too_long
    detail: str


@cache
def _validator() -> Callable[[Any], Any]:
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


# --- the model's own ranking score: its label probabilities -----------------------------------

#: The label that says a purchase is coming (the eval's purchase foresight reads it).
PURCHASE_OUTLOOK = "ready_to_buy"
_LABEL_KEY = re.compile(r'"label"\s*:\s*"')


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token with its log-probability and the top alternatives' (as the
    OpenAI-compatible ``logprobs.content`` lists them)."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True, slots=True)
class LabelChoice:
    """Where the answer chose a label: the label written, and the probability the model gave
    every label there (its alternatives' tokens, renormalised over the labels)."""

    chosen: str
    probabilities: dict[str, float]


def label_choices(tokens: Sequence[TokenLogprob], labels: Sequence[str]) -> list[LabelChoice]:
    """The answer's label choices in the order written. A label's probability at a choice is
    the summed probability of the alternative tokens that start it and no other label (a
    token shared by several labels' starts says nothing about which, and is left out)."""
    text = "".join(t.token for t in tokens)
    starts = []
    offset = 0
    for t in tokens:
        starts.append(offset)
        offset += len(t.token)
    choices = []
    for match in _LABEL_KEY.finditer(text):
        at = match.end()
        i = bisect.bisect_right(starts, at) - 1
        if i < 0 or i >= len(tokens):
            continue
        if starts[i] + len(tokens[i].token) <= at:  # the label starts with the next token
            i += 1
            if i >= len(tokens):
                continue
        prefix = text[starts[i] : at]
        written = text[at:].split('"', 1)[0]
        alternatives = dict(tokens[i].top)
        alternatives.setdefault(tokens[i].token, tokens[i].logprob)
        mass: dict[str, float] = {}
        for token, logprob in alternatives.items():
            if not token.startswith(prefix) or len(token) == len(prefix):
                continue
            rest = token[len(prefix) :]
            owners = [x for x in labels if x.startswith(rest) or rest.startswith(x + '"')]
            if len(owners) == 1:
                mass[owners[0]] = mass.get(owners[0], 0.0) + math.exp(logprob)
        total = sum(mass.values())
        if written in labels and total > 0:
            choices.append(LabelChoice(written, {k: v / total for k, v in mass.items()}))
    return choices


def with_label_scores(
    intent: Intent, choices: Sequence[LabelChoice], max_intents: int = 3
) -> Intent:
    """``intent`` with each label's confidence the model's probability of that label where
    it chose it (``label_choices``), so that intents rank by the model's own belief rather
    than the digits it wrote. When the answer does not name ``ready_to_buy`` and has room,
    it is added, without a category, at the probability the model gave it at the first
    choice: every answer then carries the model's purchase outlook. No choice read: the
    intent as it is."""
    if not choices:
        return intent
    chosen = {c.chosen: c.probabilities.get(c.chosen, 0.0) for c in reversed(choices)}
    items = [
        {**item, "confidence": round(chosen[item["label"]], 4)} if item["label"] in chosen else item
        for item in intent.body["intents"]
    ]
    outlook = choices[0].probabilities.get(PURCHASE_OUTLOOK, 0.0)
    if len(items) < max_intents and all(i["label"] != PURCHASE_OUTLOOK for i in items):
        items.append({"label": PURCHASE_OUTLOOK, "confidence": round(outlook, 4)})
    items.sort(key=lambda i: -i["confidence"])
    body = {**intent.body, "intents": items}
    top = items[0]
    return Intent(body, top["label"], float(top["confidence"]), intent.summary, intent.source)
