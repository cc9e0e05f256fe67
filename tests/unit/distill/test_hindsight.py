"""The target intent hindsight gives a trigger point: what the shopper did next, within
the session, in the categories the model may name."""

from __future__ import annotations

from flink_jobs.core.grounding import grounded_facts, rules_intent, session_category_enum
from flink_jobs.tools.distill.hindsight import hindsight_intent, offered_category
from tests.support.builders import session_of, shopper_event

HEADPHONES = {"product_id": "sku-1", "category": "Electronics > Audio > Headphones", "price": 99.0}
HEADPHONES_2 = {
    "product_id": "sku-2",
    "category": "Electronics > Audio > Headphones",
    "price": 149.0,
}
SPEAKERS = {"product_id": "sku-3", "category": "Electronics > Audio > Speakers", "price": 59.0}
TENT = {"product_id": "sku-4", "category": "Sports > Camping > Tents", "price": 199.0}


def target(before, after):
    state = session_of(*before)
    facts = grounded_facts(state)
    intent = hindsight_intent(
        facts, rules_intent(facts, state), session_category_enum(facts), after
    )
    return [(i["label"], i.get("category")) for i in intent.body["intents"]], intent


def test_a_purchase_later_in_the_session_makes_ready_to_buy_first_in_the_category_bought():
    before = [shopper_event("view", 0, HEADPHONES), shopper_event("view", 30, HEADPHONES_2)]
    after = [
        shopper_event("add_to_cart", 60, HEADPHONES_2),
        shopper_event("purchase", 90, HEADPHONES_2),
    ]

    entries, _ = target(before, after)

    assert entries == [("ready_to_buy", "Headphones")]


def test_a_cart_left_without_a_purchase_is_abandoning_cart():
    before = [shopper_event("view", 0, HEADPHONES), shopper_event("add_to_cart", 20, HEADPHONES)]

    entries, _ = target(before, [])

    assert entries == [("abandoning_cart", "Headphones")]


def test_just_bought_stays_post_purchase_first_whatever_comes_next():
    before = [
        shopper_event("add_to_cart", 0, HEADPHONES),
        shopper_event("purchase", 30, HEADPHONES),
    ]
    after = [
        shopper_event("add_to_cart", 60, HEADPHONES_2),
        shopper_event("purchase", 80, HEADPHONES_2),
    ]

    entries, _ = target(before, after)

    assert entries[0] == ("post_purchase", "Headphones")
    assert entries[1] == ("ready_to_buy", "Headphones")


def test_the_next_engagement_in_another_offered_category_is_named_after_the_outlook():
    before = [shopper_event("view", 0, HEADPHONES), shopper_event("view", 10, SPEAKERS)]
    after = [shopper_event("view", 40, SPEAKERS)]

    entries, _ = target(before, after)

    assert entries == [("comparing_options", "Speakers")]


def test_a_next_category_the_model_may_not_name_is_left_out():
    before = [shopper_event("view", 0, HEADPHONES), shopper_event("view", 10, HEADPHONES_2)]
    after = [shopper_event("view", 40, TENT)]

    entries, intent = target(before, after)

    assert entries == [("comparing_options", "Headphones")]  # the rules' reading
    assert intent.summary.startswith("Comparing 2 Headphones products")


def test_every_category_named_is_one_the_request_offers():
    before = [shopper_event("search", 0, query="tent"), shopper_event("view", 5, TENT)]
    after = [shopper_event("add_to_cart", 9, TENT), shopper_event("purchase", 30, TENT)]
    state = session_of(*before)
    offered = session_category_enum(grounded_facts(state))

    entries, _ = target(before, after)

    assert all(category in offered for _, category in entries if category)


def test_offered_category_falls_back_to_the_nearest_level_up():
    assert offered_category("Electronics > Audio > Earbuds", ("Headphones", "Audio")) == "Audio"
    assert offered_category("Garden > Hoses", ("Headphones", "Audio")) is None
