"""The model's own ranking score: each label's confidence is the probability the model
gave it where it chose it (``core.intents.label_choices`` / ``with_label_scores``)."""

from __future__ import annotations

import math

import orjson
import pytest

from flink_jobs.config import LlmConfig
from flink_jobs.core.intents import (
    TokenLogprob,
    label_choices,
    parse_intent,
    with_label_scores,
)
from flink_jobs.core.prompting import intent_labels
from flink_jobs.runtime.llm_client import build_request, read_answer
from tests.support.builders import prompt_task

LABELS = intent_labels()


def tokens(*parts: tuple[str, float, dict[str, float]] | str) -> list[TokenLogprob]:
    """Generated tokens: plain text (probability 1), or (token, logprob, alternatives)."""
    out = []
    for part in parts:
        if isinstance(part, str):
            out.append(TokenLogprob(part, 0.0, ((part, 0.0),)))
        else:
            token, logprob, alternatives = part
            out.append(TokenLogprob(token, logprob, tuple(alternatives.items())))
    return out


ANSWER = tokens(
    '{"intents":[{"label":"',
    (
        "compar",
        math.log(0.6),
        {"compar": math.log(0.6), "ready": math.log(0.3), "b": math.log(0.1)},
    ),
    'ing_options","confidence":0.7,"category":"Headphones"},{"label":"',
    ("research", math.log(0.5), {"research": math.log(0.5), "deal": math.log(0.5)}),
    'ing_product","confidence":0.2,"category":"Headphones"}],"summary":"Comparing."}',
)


def test_each_choice_carries_the_labels_probabilities_where_it_was_made():
    first, second = label_choices(ANSWER, LABELS)

    assert first.chosen == "comparing_options"
    assert first.probabilities == pytest.approx(
        {"comparing_options": 0.6, "ready_to_buy": 0.3, "browsing": 0.1}
    )
    assert second.chosen == "researching_product"
    assert second.probabilities == pytest.approx({"researching_product": 0.5, "deal_seeking": 0.5})


def test_a_token_that_starts_several_labels_says_nothing_and_is_left_out():
    answer = tokens(
        '{"intents":[{"label":"',
        (
            "ready",
            math.log(0.5),
            {"ready": math.log(0.5), "re": math.log(0.3), "ab": math.log(0.2)},
        ),
        '_to_buy","confidence":0.7}],"summary":"x"}',
    )

    [choice] = label_choices(answer, LABELS)

    # "re" starts ready_to_buy, researching_product and replenishing.
    assert choice.probabilities == pytest.approx(
        {"ready_to_buy": 0.5 / 0.7, "abandoning_cart": 0.2 / 0.7}
    )


def test_a_label_token_that_holds_the_opening_quote_is_read_too():
    answer = tokens(
        '{"intents":[{"label":',
        ('"post', math.log(0.9), {'"post': math.log(0.9), '"ready': math.log(0.1)}),
        '_purchase","confidence":0.8}],"summary":"x"}',
    )

    [choice] = label_choices(answer, LABELS)

    assert choice.chosen == "post_purchase"
    assert choice.probabilities == pytest.approx({"post_purchase": 0.9, "ready_to_buy": 0.1})


def test_confidences_become_the_models_probabilities_and_the_purchase_outlook_is_added():
    text = "".join(t.token for t in ANSWER)
    intent = parse_intent(text)

    scored = with_label_scores(intent, label_choices(ANSWER, LABELS))

    assert scored.body["intents"] == [
        {"label": "comparing_options", "confidence": 0.6, "category": "Headphones"},
        {"label": "researching_product", "confidence": 0.5, "category": "Headphones"},
        {"label": "ready_to_buy", "confidence": 0.3},
    ]
    assert (scored.top_label, scored.top_confidence) == ("comparing_options", 0.6)
    assert scored.summary == intent.summary


def test_without_log_probabilities_the_answer_keeps_its_own_confidences():
    intent = parse_intent('{"intents":[{"label":"browsing","confidence":0.7}],"summary":"x"}')

    assert with_label_scores(intent, []) == intent


def test_the_request_asks_for_log_probabilities_and_the_answer_reads_them():
    _, body = build_request(prompt_task().prompt, "s1", LlmConfig(top_logprobs=5))
    request = orjson.loads(body)
    payload = {
        "model": "m",
        "choices": [
            {
                "message": {"content": "{}"},
                "finish_reason": "stop",
                "logprobs": {
                    "content": [
                        {
                            "token": "{",
                            "logprob": -0.1,
                            "top_logprobs": [{"token": "{", "logprob": -0.1}],
                        }
                    ]
                },
            }
        ],
    }

    completion = read_answer(orjson.dumps(payload))

    assert (request["logprobs"], request["top_logprobs"]) == (True, 5)
    assert completion.logprobs == (TokenLogprob("{", -0.1, (("{", -0.1),)),)
    assert "logprobs" not in orjson.loads(
        build_request(prompt_task().prompt, "s1", LlmConfig(label_scores=False))[1]
    )
