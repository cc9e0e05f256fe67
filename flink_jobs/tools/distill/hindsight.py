"""The target intent of one trigger point, taken from what the shopper did next.

Given the session as the prompt saw it (its facts, the rules' intent, the categories the
model may name) and the shopper's events after the point within the same session (no
quiet gap longer than the session gap), :func:`hindsight_intent` writes the intent the
model should have answered. Entries, most confident first, each label once:

1. the session has just bought (the rules' ``post_purchase``: the newest cart or purchase
   event is a purchase) -> ``post_purchase`` in the category bought: a fact;
2. a purchase follows within the session -> ``ready_to_buy`` in the category bought next
   (or the next engagement's, or the cart's); else, a cart that holds something is left
   behind -> ``abandoning_cart`` in the newest cart line's category;
3. the next product engagement's category, when the model may name it and no entry names
   it yet -> ``comparing_options`` when the session already engaged with that category,
   else ``browsing``;
4. nothing of the above -> the rules' own activity label and category (``browsing``,
   ``comparing_options`` or ``researching_product``).

Confidences are fixed by place (``CONFIDENCES``): the served model's confidences are its
label probabilities (``core.intents.with_label_scores``), not the digits it writes. The
summary is the rules' sentence, written from the facts.

Why this shape: the eval scores an intent against the same future (``intent_eval``): the
next engagement's category, a purchase within the session, and consistency with the
facts. Entry 1 keeps the facts a model must not contradict; entry 2 is the purchase
outlook whose probability ranks shoppers by how likely they buy; entry 3 points the
re-ranker at what the shopper looks at next.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flink_jobs.core.events import ShopperEvent
from flink_jobs.core.grounding import GroundedFacts, category_levels, leaf_category
from flink_jobs.core.intents import Intent

#: The confidence written for the first, second and third entry.
CONFIDENCES = (0.7, 0.2, 0.1)
ENGAGEMENTS = ("view", "click", "add_to_cart", "purchase")
CART_STAGE = ("post_purchase", "ready_to_buy", "abandoning_cart")


def offered_category(path: str | None, offered: Sequence[str]) -> str | None:
    """The name in ``offered`` (the request's category enum) that ``path`` falls under: its
    leaf, else its nearest level up; None when the model may name none of them."""
    if not path:
        return None
    by_normal = {" ".join(c.split()).casefold(): c for c in offered}
    for level in reversed(category_levels(path)):
        found = by_normal.get(" ".join(level.split()).casefold())
        if found is not None:
            return found
    return None


def hindsight_intent(
    facts: GroundedFacts,
    rules: Intent,
    offered: Sequence[str],
    after: Sequence[ShopperEvent],
) -> Intent:
    """The target intent (see the module docstring); ``after``: the session's later events,
    oldest first."""
    entries: list[tuple[str, str | None]] = []
    rules_top = rules.body["intents"][0]
    if rules_top["label"] == "post_purchase":
        entries.append(("post_purchase", rules_top.get("category")))
    engaged = next((e for e in after if e.event_type in ENGAGEMENTS and e.product_id), None)
    engaged_category = offered_category(engaged.category, offered) if engaged else None
    bought = next((e for e in after if e.event_type == "purchase"), None)
    cart_category = (
        offered_category(facts.cart[-1].category, offered) or leaf_category(facts.cart[-1].category)
        if facts.cart
        else None
    )
    if bought is not None:
        category = offered_category(bought.category, offered) or engaged_category or cart_category
        entries.append(("ready_to_buy", category or rules_top.get("category")))
    elif facts.cart:
        entries.append(("abandoning_cart", cart_category))
    named = {c.casefold() for _, c in entries if c}
    if engaged_category and engaged_category.casefold() not in named:
        seen = any(offered_category(c.path, (engaged_category,)) for c in facts.categories)
        entries.append(("comparing_options" if seen else "browsing", engaged_category))
    if not entries:
        entries.append((rules_top["label"], rules_top.get("category")))
    intents: list[dict[str, Any]] = []
    for (label, category), confidence in zip(entries, CONFIDENCES, strict=False):
        item: dict[str, Any] = {"label": label, "confidence": confidence}
        # Held to the request's enum, as the served model's decoding is.
        category = offered_category(category, offered)
        if category:
            item["category"] = category
        intents.append(item)
    body = {"intents": intents, "summary": rules.summary}
    return Intent(body, intents[0]["label"], intents[0]["confidence"], rules.summary)
