"""What the pipeline knows exactly about a shopper's session, and an intent derived from it
by rules alone.

The model is asked to infer an intent; the facts below are never asked of it. They are
counted from the session's events (``SessionState.events``: the current session only,
its newest ``session.max_events`` events), so they are exact, cheap, and fresh the moment
an event lands. They go into the intent record beside the model's answer, into the v2
prompt as a summary, and into :func:`rules_intent`, the label written before the model
answers (and the baseline the model must beat). :func:`reconcile` makes the model's
record: the rules' labels first, then the model's other labels.

Facts (:class:`GroundedFacts`):

- categories and brands engaged, with counts, most engaged first (ties: the most recently
  engaged first). An engagement is a product event other than ``remove_from_cart``. A
  category is kept as the event's path (``"Electronics > Audio > Headphones"``) with its
  leaf (``"Headphones"``), sanitised to the intent schema's category alphabet (letters,
  marks and digits of every script, spaces and ``&',.()/+-``);
- the price band: lowest, median and highest price of the distinct products seen (the
  median of an even count is the lower middle one: always a price the shopper saw);
- the cart: ``add_to_cart`` adds its quantity, ``remove_from_cart`` takes its quantity
  away, ``purchase`` removes the product bought; lines in the order first added;
- the last purchase of the session (product, category, event time);
- the latest search queries, newest first, each once, at most ``MAX_RECENT_SEARCHES``;
- the number of events of each type.

Rules of :func:`rules_intent`, the first that applies wins:

1. the newest cart or purchase event is a ``purchase`` -> ``post_purchase`` (0.8), in the
   category of the product bought;
2. the cart is not empty and the newest event is an ``add_to_cart`` -> ``ready_to_buy``
   (0.7), in the category of the product just added;
3. the cart is not empty and the shopper moved on (any other newest event) ->
   ``abandoning_cart`` (0.6) with ``ready_to_buy`` (0.25) second, in the category of the
   newest cart line;
4. two or more distinct products of one category viewed or clicked ->
   ``comparing_options`` (0.6), in the most engaged such category;
5. at least one search, and no more distinct products viewed or clicked than searches ->
   ``researching_product`` (0.5), in the most engaged category if there is one;
6. otherwise -> ``browsing`` (0.5), in the most engaged category if there is one.

Confidences are fixed per rule: they rank the rules' certainty, not a probability. The
intent is marked ``source="rules"``; its body is valid against the intent schema.

Categories offered to the model (:func:`session_category_enum`) are the leaves engaged this
session, most engaged first, then the other levels of their catalogue paths; a session
with no product yet falls back to the leaves of the shopper's usual categories, and those
failing, to ``FALLBACK_CATEGORIES``.
"""

from __future__ import annotations

import re
import statistics
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from flink_jobs.core.events import EVENT_TYPES, ShopperEvent
from flink_jobs.core.intents import Intent
from flink_jobs.core.session import SessionState

#: How many categories and brands the facts list (most engaged first).
MAX_LISTED = 8
MAX_RECENT_SEARCHES = 3
#: At most this many categories are offered to the model per request.
MAX_CATEGORY_ENUM = 12
#: The categories offered when the shopper has engaged with no product at all.
FALLBACK_CATEGORIES: tuple[str, ...] = ("General",)

#: The intent schema's category: at most 40 characters, none that a JSON string or the prompt
#: would have to escape (control characters, quotes, backslashes, angle brackets).
CATEGORY_MAX_CHARS = 40
#: Punctuation a category keeps; other punctuation and symbols become spaces.
CATEGORY_PUNCTUATION = frozenset(" &',.()/+-")
SUMMARY_MAX_CHARS = 120

PRODUCT_EVENTS = ("view", "click", "add_to_cart", "remove_from_cart", "purchase")
_ENGAGEMENTS = ("view", "click", "add_to_cart", "purchase")
_LOOKS = ("view", "click")
_CART_EVENTS = ("add_to_cart", "remove_from_cart", "purchase")


# --- values ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CategoryCount:
    path: str  #: as the events carry it
    leaf: str  #: its last level, sanitised ("" when nothing printable is left)
    count: int  #: engagements
    products: int  #: distinct products viewed or clicked


@dataclass(frozen=True, slots=True)
class BrandCount:
    name: str
    count: int


@dataclass(frozen=True, slots=True)
class PriceBand:
    low: float
    median: float  #: the lower middle price for an even count
    high: float
    products: int  #: distinct products with a price


@dataclass(frozen=True, slots=True)
class CartLine:
    product_id: str
    quantity: int
    category: str  #: the path

    @property
    def leaf(self) -> str:
        return leaf_category(self.category)


@dataclass(frozen=True, slots=True)
class Purchase:
    product_id: str
    category: str  #: the path
    event_time_ms: int

    @property
    def leaf(self) -> str:
        return leaf_category(self.category)


@dataclass(frozen=True, slots=True)
class GroundedFacts:
    """The exact facts of one session; see the module docstring for how each is counted."""

    shopper_id: str
    session_started_ms: int = 0
    newest_event_ms: int = 0
    event_counts: tuple[tuple[str, int], ...] = ()  #: (event type, count), EVENT_TYPES order
    categories: tuple[CategoryCount, ...] = ()
    brands: tuple[BrandCount, ...] = ()
    price_band: PriceBand | None = None
    cart: tuple[CartLine, ...] = ()
    last_purchase: Purchase | None = None
    recent_searches: tuple[str, ...] = ()
    last_event_type: str = ""
    products_viewed: int = 0  #: distinct products viewed or clicked
    #: Leaves of the shopper's usual categories from earlier sessions (the category fallback).
    usual_leaves: tuple[str, ...] = field(default=(), repr=False)

    @property
    def events(self) -> int:
        return sum(n for _, n in self.event_counts)

    def count(self, event_type: str) -> int:
        return dict(self.event_counts).get(event_type, 0)

    @property
    def cart_product_ids(self) -> tuple[str, ...]:
        return tuple(line.product_id for line in self.cart)

    @property
    def cart_items(self) -> int:
        return sum(line.quantity for line in self.cart)

    @property
    def top_leaf(self) -> str | None:
        """The most engaged category's leaf (None when no product was engaged)."""
        return next((c.leaf for c in self.categories if c.leaf), None)

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON types, in the shape the intent record stores them."""
        band = self.price_band
        bought = self.last_purchase
        return {
            "session_started_ms": self.session_started_ms,
            "newest_event_ms": self.newest_event_ms,
            "event_counts": dict(self.event_counts),
            "categories": [
                {"path": c.path, "leaf": c.leaf, "count": c.count, "products": c.products}
                for c in self.categories
            ],
            "brands": [{"name": b.name, "count": b.count} for b in self.brands],
            "price_band": (
                None
                if band is None
                else {
                    "min": band.low,
                    "median": band.median,
                    "max": band.high,
                    "products": band.products,
                }
            ),
            "cart": [
                {"product_id": x.product_id, "quantity": x.quantity, "category": x.category}
                for x in self.cart
            ],
            "last_purchase": (
                None
                if bought is None
                else {
                    "product_id": bought.product_id,
                    "category": bought.category,
                    "event_time_ms": bought.event_time_ms,
                }
            ),
            "recent_searches": list(self.recent_searches),
            "products_viewed": self.products_viewed,
        }

    def to_json(self) -> bytes:
        return orjson.dumps(self.as_dict())


# --- categories --------------------------------------------------------------------------------


def sanitise_category(text: str) -> str:
    """``text`` in the intent schema's category alphabet: NFKC-normalised (full-width and
    compatibility forms become plain ones), letters, combining marks and digits of every
    script kept (a Cyrillic or Japanese catalogue names its categories in its own script),
    format characters (category Cf: invisible) dropped, any other character (symbols,
    emoji, other punctuation, controls) a space, spaces collapsed, cut to 40 characters
    ("" if nothing is left)."""
    kept = "".join(_category_char(c) for c in unicodedata.normalize("NFKC", text))
    return " ".join(kept.split())[:CATEGORY_MAX_CHARS].strip()


def _category_char(char: str) -> str:
    kind = unicodedata.category(char)
    if kind[0] in "LMN" or char in CATEGORY_PUNCTUATION:
        return char
    return "" if kind == "Cf" else " "


def category_levels(path: str) -> tuple[str, ...]:
    """The sanitised levels of a catalogue path, top first; empty levels left out."""
    levels = (sanitise_category(part) for part in re.split(r"\s*[>|]\s*", path))
    return tuple(level for level in levels if level)


def leaf_category(path: str) -> str:
    """The last level of a catalogue path, sanitised: ``"A > B > Headphones"`` ->
    ``"Headphones"`` ("" when the path has nothing printable)."""
    levels = category_levels(path)
    return levels[-1] if levels else ""


def _normal(category: str) -> str:
    return " ".join(category.split()).casefold()


def session_category_enum(
    source: SessionState | GroundedFacts, *, with_parents: bool = True
) -> tuple[str, ...]:
    """The categories the model may name for this session (never empty; see the module
    docstring), at most ``MAX_CATEGORY_ENUM``, each once (compared case-insensitively)."""
    facts = source if isinstance(source, GroundedFacts) else grounded_facts(source)
    leaves = [c.leaf for c in facts.categories]
    parents = (
        [p for c in facts.categories for p in reversed(category_levels(c.path)[:-1])]
        if with_parents
        else []
    )
    offered = _unique([*leaves, *parents]) or _unique(facts.usual_leaves)
    return offered[:MAX_CATEGORY_ENUM] or FALLBACK_CATEGORIES


def category_is_grounded(intent: Intent, categories: Iterable[str]) -> bool:
    """Whether every category ``intent`` names is one of ``categories`` (compared as the
    reranker does: case and spacing ignored). An intent entry without a category invents
    nothing, so it passes."""
    allowed = {_normal(c) for c in categories}
    named = (item.get("category") for item in intent.body.get("intents", ()))
    return all(_normal(c) in allowed for c in named if c)


def _unique(names: Iterable[str]) -> tuple[str, ...]:
    seen: dict[str, str] = {}
    for name in names:
        if name:
            seen.setdefault(_normal(name), name)
    return tuple(seen.values())


# --- facts -----------------------------------------------------------------------------------


def grounded_facts(state: SessionState) -> GroundedFacts:
    """Count the facts of ``state``'s current session (pure; events in event-time order)."""
    events = state.events
    type_counts = {t: 0 for t in EVENT_TYPES}
    for e in events:
        type_counts[e.event_type] = type_counts.get(e.event_type, 0) + 1
    return GroundedFacts(
        shopper_id=state.shopper_id,
        session_started_ms=state.session_started_ms if events else 0,
        newest_event_ms=events[-1].event_time_ms if events else 0,
        event_counts=tuple((t, n) for t, n in type_counts.items() if n),
        categories=_category_counts(events),
        brands=_brand_counts(events),
        price_band=_price_band(events),
        cart=_cart(events),
        last_purchase=next(
            (
                Purchase(e.product_id, e.category, e.event_time_ms)
                for e in reversed(events)
                if e.event_type == "purchase"
            ),
            None,
        ),
        recent_searches=_unique_exact(
            e.query for e in reversed(events) if e.event_type == "search" and e.query
        )[:MAX_RECENT_SEARCHES],
        last_event_type=events[-1].event_type if events else "",
        products_viewed=len({e.product_id for e in events if e.event_type in _LOOKS}),
        usual_leaves=tuple(leaf_category(c) for c in state.history.top_categories),
    )


def _ranked(counts: dict[str, int], last_seen: dict[str, int]) -> list[str]:
    return sorted(counts, key=lambda k: (-counts[k], -last_seen[k], k))


def _category_counts(events: Sequence[ShopperEvent]) -> tuple[CategoryCount, ...]:
    counts: dict[str, int] = {}
    last_seen: dict[str, int] = {}
    looked_at: dict[str, set[str]] = {}
    for i, e in enumerate(events):
        if e.event_type not in _ENGAGEMENTS or not e.category:
            continue
        counts[e.category] = counts.get(e.category, 0) + 1
        last_seen[e.category] = i
        if e.event_type in _LOOKS and e.product_id:
            looked_at.setdefault(e.category, set()).add(e.product_id)
    return tuple(
        CategoryCount(path, leaf_category(path), counts[path], len(looked_at.get(path, ())))
        for path in _ranked(counts, last_seen)[:MAX_LISTED]
    )


def _brand_counts(events: Sequence[ShopperEvent]) -> tuple[BrandCount, ...]:
    counts: dict[str, int] = {}
    last_seen: dict[str, int] = {}
    for i, e in enumerate(events):
        if e.event_type in _ENGAGEMENTS and e.brand:
            counts[e.brand] = counts.get(e.brand, 0) + 1
            last_seen[e.brand] = i
    return tuple(BrandCount(b, counts[b]) for b in _ranked(counts, last_seen)[:MAX_LISTED])


def _price_band(events: Sequence[ShopperEvent]) -> PriceBand | None:
    prices: dict[str, float] = {}  # the newest price of each product
    for e in events:
        if e.event_type in PRODUCT_EVENTS and e.price is not None:
            prices[e.product_id] = float(e.price)
    if not prices:
        return None
    values = sorted(prices.values())
    return PriceBand(values[0], statistics.median_low(values), values[-1], len(values))


def _cart(events: Sequence[ShopperEvent]) -> tuple[CartLine, ...]:
    quantities: dict[str, int] = {}
    categories: dict[str, str] = {}
    for e in events:
        if e.event_type not in _CART_EVENTS or not e.product_id:
            continue
        if e.event_type == "add_to_cart":
            quantities[e.product_id] = quantities.get(e.product_id, 0) + e.quantity
            categories[e.product_id] = e.category
        elif e.event_type == "remove_from_cart":
            left = quantities.get(e.product_id, 0) - e.quantity
            if left > 0:
                quantities[e.product_id] = left
            else:
                quantities.pop(e.product_id, None)
        else:  # purchase
            quantities.pop(e.product_id, None)
    return tuple(CartLine(p, q, categories[p]) for p, q in quantities.items())


def _unique_exact(texts: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(texts))


# --- the rules -------------------------------------------------------------------------------

RULES_SOURCE = "rules"


def rules_intent(facts: GroundedFacts, state: SessionState) -> Intent:
    """The intent the numbered rules of the module docstring give for this session."""
    events = state.events
    newest_cart_event = next((e for e in reversed(events) if e.event_type in _CART_EVENTS), None)
    newest = events[-1] if events else None
    band = _band_text(facts.price_band)

    if newest_cart_event is not None and newest_cart_event.event_type == "purchase":
        category = leaf_category(newest_cart_event.category) or facts.top_leaf
        summary = f"Bought {_items(facts.count('purchase'))} this session" + (
            f", the last in {category}." if category else "."
        )
        return _intent([("post_purchase", 0.8, category)], summary)

    if facts.cart and newest is not None and newest.event_type == "add_to_cart":
        category = leaf_category(newest.category) or facts.top_leaf
        summary = (
            f"Just added {category or 'a product'} to the cart ({_items(facts.cart_items)} in it)"
            f" after viewing {_products(facts)}{band}."
        )
        return _intent([("ready_to_buy", 0.7, category)], summary)

    if facts.cart:
        category = leaf_category(facts.cart[-1].category) or facts.top_leaf
        since = _MOVED_ON.get(newest.event_type, "moved on") if newest is not None else "left"
        summary = (
            f"{_items(facts.cart_items).capitalize()} in the cart"
            + (f" ({category})" if category else "")
            + f", not bought; since then {since}."
        )
        return _intent(
            [("abandoning_cart", 0.6, category), ("ready_to_buy", 0.25, category)], summary
        )

    compared = next((c for c in facts.categories if c.products >= 2 and c.leaf), None)
    if compared is not None:
        summary = f"Comparing {compared.products} {compared.leaf} products{band}."
        return _intent([("comparing_options", 0.6, compared.leaf)], summary)

    searches = facts.count("search")
    category = facts.top_leaf
    if searches and facts.products_viewed <= searches:
        summary = f"Searched {_times(searches)}, then {_looks(facts)}" + (
            f" in {category}." if category and facts.products_viewed else "."
        )
        return _intent([("researching_product", 0.5, category)], summary)

    summary = f"Browsing {category or 'the catalogue'}: {_looks(facts)}{band}."
    return _intent([("browsing", 0.5, category)], summary)


# --- the record: the model's answer beside the rules' -----------------------------------------

#: The intent schema's limit on ``intents``.
MAX_INTENTS = 3
#: Labels that say where the shopper's cart stands. The session's facts decide them
#: exactly (rules 1-3), so a record takes them from the rules and never from the model.
CART_STAGE_LABELS = frozenset({"ready_to_buy", "abandoning_cart", "post_purchase"})


def reconcile(
    answer: Intent, rules: Intent | None, facts: Mapping[str, Any] | None = None
) -> Intent:
    """The intent the record stores for the model's ``answer`` to a prompt whose session gave
    ``rules`` (``rules_intent``) and ``facts`` (``GroundedFacts.as_dict``, as the task
    carries them): the rules' labels first, then the model's other labels, except those of
    the cart's stage (``CART_STAGE_LABELS``), which only the rules give.

    A label appears once (its first occurrence wins), at most ``MAX_INTENTS`` remain, and a
    follower's confidence is capped at the one before it, so the list stays most confident
    first. The source stays ``model``.

    The summary is held to the facts as the labels are: it is the model's, unless the model
    named a cart stage the rules did not give (its summary tells that stage's story) or the
    summary says the shopper bought something while the session has no purchase
    (:func:`claims_purchase`); then it is the rules' summary, which the facts state.

    Why the rules lead: scored on the same writes (``make eval``), records led by the
    model's labels rank products worse than the rules alone (the 135M model adds
    categories and confidences that move the wrong products up) and call sessions that
    have just bought anything but ``post_purchase``; led by the rules, the model's extra
    labels and categories rank about as well as the rules. A model that beats the rules on
    its own answers should lead instead (``docs/decisions.md#rules-lead-the-record``).

    Why the cart's stage is the rules' alone: the session's cart and purchases decide it
    exactly, and the model calls sessions with an empty cart ``abandoning_cart`` and rates
    ``ready_to_buy`` after a purchase, which the facts beside it refute; with those labels
    from the model, the records foresee purchases worse than the rules
    (``docs/decisions.md#cart-stage-from-rules``).
    """
    if rules is None:
        return answer
    ruled = {i["label"] for i in rules.body["intents"]}
    replaced_stage = any(
        i["label"] in CART_STAGE_LABELS and i["label"] not in ruled for i in answer.body["intents"]
    )
    purchases = (facts or {}).get("event_counts", {}).get("purchase", 0)
    unbought = facts is not None and not purchases and claims_purchase(answer.summary)
    summary = rules.summary if replaced_stage or unbought else answer.summary
    answered = [i for i in answer.body["intents"] if i["label"] not in CART_STAGE_LABELS]
    merged: list[dict[str, Any]] = []
    for item in [*rules.body["intents"], *answered]:
        if len(merged) == MAX_INTENTS:
            break
        if any(m["label"] == item["label"] for m in merged):
            continue
        if merged and item["confidence"] > merged[-1]["confidence"]:
            item = {**item, "confidence": merged[-1]["confidence"]}
        merged.append(item)
    body = {**answer.body, "intents": merged, "summary": summary}
    return Intent(body, merged[0]["label"], merged[0]["confidence"], summary, answer.source)


_PURCHASE_CLAIM = re.compile(
    r"\b(bought|purchased|made (a|the|their|his|her) purchase|placed (an|the|their) order|"
    r"ordered|checked out|paid for)\b",
    re.IGNORECASE,
)


def claims_purchase(summary: str) -> bool:
    """Whether ``summary`` says the shopper bought something ("Just bought the headphones",
    "purchased", "checked out", "ordered"). A false alarm only swaps in the rules' summary."""
    return _PURCHASE_CLAIM.search(summary) is not None


_MOVED_ON = {
    "view": "viewed other products",
    "click": "clicked other products",
    "search": "searched again",
    "remove_from_cart": "removed an item",
}


def _intent(labels: list[tuple[str, float, str | None]], summary: str) -> Intent:
    intents = []
    for label, confidence, category in labels:
        item: dict[str, Any] = {"label": label, "confidence": confidence}
        if category:
            item["category"] = category
        intents.append(item)
    summary = _fit_summary(summary)
    body = {"intents": intents, "summary": summary}
    return Intent(body, labels[0][0], labels[0][1], summary, source=RULES_SOURCE)


def _fit_summary(text: str) -> str:
    """Within the schema's summary: 1-120 characters, no control characters, quotes,
    backslashes or angle brackets (category leaves are sanitised already)."""
    text = " ".join(re.sub(r'[\x00-\x1f\\"<>]', " ", text).split())
    if len(text) > SUMMARY_MAX_CHARS:
        text = text[: SUMMARY_MAX_CHARS - 3].rstrip() + "..."
    return text or "No activity yet."


def _items(n: int) -> str:
    return f"{n} item" if n == 1 else f"{n} items"


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


def _products(facts: GroundedFacts) -> str:
    n = facts.products_viewed
    return "no product" if n == 0 else f"{n} product" + ("s" if n > 1 else "")


def _looks(facts: GroundedFacts) -> str:
    n = facts.products_viewed
    return "viewed no product" if n == 0 else f"viewed {n} product" + ("s" if n > 1 else "")


def _band_text(band: PriceBand | None) -> str:
    if band is None or band.products < 2:
        return ""
    return f", {band.low:.2f}-{band.high:.2f}"
