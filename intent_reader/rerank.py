"""An example re-ranker: reorder a ranking service's candidate products by the shopper's intent.

A pure function over plain values, so it is easy to read, test and port. Each candidate's
score is multiplied by a factor that starts at 1 and, for every intent the model gave
(label ``L`` with confidence ``c`` and optional category), moves by:

- ``c x category_boost[L]`` when the candidate's category matches the intent's category
  (e.g. ``ready_to_buy`` +1.0: push what the shopper is about to buy; ``post_purchase``
  -0.5: stop pushing the category just bought);
- ``c x on_sale_boost[L]`` when the candidate is on sale (e.g. ``deal_seeking`` +0.5).

The factor is floored at ``min_factor`` so a demoted product stays rankable. A missing or
stale intent leaves the order unchanged. Ties keep the input order (the sort is stable),
so the same inputs always give the same ranking. Each result says why it moved.

Categories match after case-folding and collapsing spaces, either whole or against one
segment of a path-like candidate category (``"Sports > Running Shoes"`` matches
``"running shoes"``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from intent_reader.client import ShopperIntent

DEFAULT_CATEGORY_BOOST: Mapping[str, float] = MappingProxyType(
    {
        "ready_to_buy": 1.0,
        "abandoning_cart": 0.8,
        "comparing_options": 0.6,
        "researching_product": 0.5,
        "replenishing": 0.5,
        "gift_shopping": 0.4,
        "deal_seeking": 0.3,
        "browsing": 0.2,
        "post_purchase": -0.5,
    }
)
DEFAULT_ON_SALE_BOOST: Mapping[str, float] = MappingProxyType({"deal_seeking": 0.5})


@dataclass(frozen=True, slots=True)
class Candidate:
    product_id: str
    score: float
    category: str | None = None
    on_sale: bool = False


@dataclass(frozen=True, slots=True)
class RerankWeights:
    category_boost: Mapping[str, float] = field(default_factory=lambda: DEFAULT_CATEGORY_BOOST)
    on_sale_boost: Mapping[str, float] = field(default_factory=lambda: DEFAULT_ON_SALE_BOOST)
    min_factor: float = 0.1


@dataclass(frozen=True, slots=True)
class Ranked:
    candidate: Candidate
    score: float
    factor: float
    reasons: tuple[str, ...]


def normalise_category(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().casefold()


def category_matches(candidate_category: str | None, intent_category: str | None) -> bool:
    """Whether a candidate's category is the one an intent names (see the module docstring)."""
    if not candidate_category or not intent_category:
        return False
    wanted = normalise_category(intent_category)
    if normalise_category(candidate_category) == wanted:
        return True
    segments = re.split(r"\s*[>/|]\s*", candidate_category)
    return any(normalise_category(s) == wanted for s in segments)


def intent_factor(
    candidate: Candidate, intent: ShopperIntent, weights: RerankWeights
) -> tuple[float, tuple[str, ...]]:
    """The score factor for ``candidate`` under ``intent``, with the reasons it moved."""
    factor = 1.0
    reasons = []
    for label in intent.labels:
        if category_matches(candidate.category, label.category):
            boost = weights.category_boost.get(label.label, 0.0) * label.confidence
            if boost:
                factor += boost
                reasons.append(f"{label.label}:{label.category}:{boost:+.2f}")
        if candidate.on_sale:
            boost = weights.on_sale_boost.get(label.label, 0.0) * label.confidence
            if boost:
                factor += boost
                reasons.append(f"{label.label}:on_sale:{boost:+.2f}")
    return max(factor, weights.min_factor), tuple(reasons)


def rerank(
    candidates: Sequence[Candidate],
    intent: ShopperIntent | None,
    weights: RerankWeights | None = None,
) -> list[Ranked]:
    """``candidates`` ordered by intent-adjusted score, highest first (stable on ties)."""
    weights = weights or RerankWeights()
    if intent is None or intent.stale:
        ranked = [Ranked(c, c.score, 1.0, ()) for c in candidates]
    else:
        ranked = []
        for c in candidates:
            factor, reasons = intent_factor(c, intent, weights)
            ranked.append(Ranked(c, c.score * factor, factor, reasons))
    return sorted(ranked, key=lambda r: -r.score)
