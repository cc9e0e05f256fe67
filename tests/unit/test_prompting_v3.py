"""The v3 prompt: the v2 prompt whose facts end with the rules' reading of them, and whose
worked examples answer with that reading first."""

from __future__ import annotations

import pytest

from flink_jobs.core.grounding import grounded_facts, rules_intent
from flink_jobs.core.intents import parse_intent
from tests.support.builders import session_of
from tests.support.prompts import (
    V2,
    V3,
    block,
    first_visit_comparing_headphones,
    renderer_for,
    returning_buyer_with_a_cart,
    user_message,
    worked_examples,
)


@pytest.mark.parametrize("build", [first_visit_comparing_headphones, returning_buyer_with_a_cart])
def test_the_facts_end_with_the_rules_reading_of_them(build) -> None:
    state = build()
    rules = rules_intent(grounded_facts(state), state).body["intents"][0]

    facts = block(user_message(renderer_for(V3).render(state)), "facts")

    assert facts[-1] == f'rules: {rules["label"]} in "{rules["category"]}"'


def test_the_rest_of_the_prompt_is_the_v2_prompt() -> None:
    state = returning_buyer_with_a_cart()
    v2 = user_message(renderer_for(V2).render(state))
    v3 = user_message(renderer_for(V3).render(state))

    assert [line for line in v3.splitlines() if not line.startswith("rules: ")] == v2.splitlines()


def test_each_example_shows_the_facts_and_rules_a_real_prompt_would() -> None:
    for events, facts, _ in worked_examples(V3):
        state = session_of(*events)

        assert block(user_message(renderer_for(V3).render(state)), "facts") == facts


def test_each_example_answers_with_the_rules_reading_first() -> None:
    for events, _, answer in worked_examples(V3):
        state = session_of(*events)
        rules = rules_intent(grounded_facts(state), state).body["intents"][0]

        first = parse_intent(answer).body["intents"][0]

        assert (first["label"], first["category"]) == (rules["label"], rules["category"])
