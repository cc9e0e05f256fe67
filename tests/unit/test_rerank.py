"""intent_reader.rerank: ordering candidate products by a shopper's intent."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from intent_reader import Candidate, IntentLabel, RerankWeights, ShopperIntent, rerank
from intent_reader.rerank import category_matches, intent_factor


def intent(*labels: IntentLabel, stale: bool = False) -> ShopperIntent:
    doc = {
        "intents": [
            {"label": x.label, "confidence": x.confidence, "category": x.category} for x in labels
        ],
        "summary": "s",
    }
    return ShopperIntent(
        shopper_id="s-1",
        labels=tuple(labels),
        summary="s",
        top_label=labels[0].label,
        top_confidence=labels[0].confidence,
        version_ts=1,
        version_seq=1,
        event_time_ms=1,
        written_at_ms=1,
        template="t",
        template_hash="h",
        model="m",
        age_ms=1000,
        written_age_ms=900,
        stale=stale,
        intent_json=json.dumps(doc),
    )


SHOES = Candidate("shoes", 0.5, "Sports > Running Shoes")
TV = Candidate("tv", 0.9, "Televisions")
SOCKS_SALE = Candidate("socks", 0.6, "Socks", on_sale=True)
CANDIDATES = [TV, SOCKS_SALE, SHOES]


def order(ranked) -> list[str]:
    return [r.candidate.product_id for r in ranked]


class TestCategoryMatches:
    @pytest.mark.parametrize(
        ("candidate", "wanted", "expected"),
        [
            ("Running Shoes", "running shoes", True),
            ("  Running   Shoes ", "Running Shoes", True),
            ("Sports > Running Shoes", "Running Shoes", True),
            ("Home/Kitchen/Knives", "knives", True),
            ("Running Shoes", "Shoes", False),
            (None, "Shoes", False),
            ("Shoes", None, False),
            ("", "", False),
        ],
    )
    def test_cases(self, candidate, wanted, expected):
        assert category_matches(candidate, wanted) is expected


class TestRerank:
    def test_no_intent_keeps_score_order(self):
        assert order(rerank(CANDIDATES, None)) == ["tv", "socks", "shoes"]

    def test_stale_intent_is_ignored(self):
        stale = intent(IntentLabel("ready_to_buy", 1.0, "Running Shoes"), stale=True)
        assert order(rerank(CANDIDATES, stale)) == ["tv", "socks", "shoes"]

    def test_ready_to_buy_lifts_the_matching_category_to_the_top(self):
        ranked = rerank(CANDIDATES, intent(IntentLabel("ready_to_buy", 0.9, "Running Shoes")))
        assert order(ranked) == ["shoes", "tv", "socks"]
        top = ranked[0]
        assert top.factor == pytest.approx(1.9) and top.score == pytest.approx(0.95)
        assert top.reasons == ("ready_to_buy:Running Shoes:+0.90",)
        assert ranked[1].factor == 1.0 and ranked[1].reasons == ()

    def test_post_purchase_demotes_the_bought_category(self):
        ranked = rerank(
            [SHOES, Candidate("laces", 0.3, "Laces")],
            intent(IntentLabel("post_purchase", 1.0, "Running Shoes")),
        )
        assert order(ranked) == ["laces", "shoes"]
        assert ranked[1].factor == pytest.approx(0.5)

    def test_deal_seeking_lifts_products_on_sale(self):
        ranked = rerank(CANDIDATES, intent(IntentLabel("deal_seeking", 1.0)))
        assert order(ranked)[0] == "tv"  # 0.6 x 1.5 does not beat 0.9
        ranked = rerank(CANDIDATES, intent(IntentLabel("deal_seeking", 1.0, "Socks")))
        assert order(ranked)[0] == "socks"  # + category and on-sale boosts

    def test_factor_is_floored(self):
        weights = RerankWeights(category_boost={"post_purchase": -5.0}, min_factor=0.1)
        factor, _ = intent_factor(
            SHOES, intent(IntentLabel("post_purchase", 1.0, "Running Shoes")), weights
        )
        assert factor == 0.1

    def test_unknown_label_has_no_effect(self):
        ranked = rerank(CANDIDATES, intent(IntentLabel("not_a_label", 1.0, "Televisions")))
        assert [r.factor for r in ranked] == [1.0, 1.0, 1.0]

    def test_input_is_not_modified(self):
        candidates = list(CANDIDATES)
        rerank(candidates, intent(IntentLabel("ready_to_buy", 1.0, "Running Shoes")))
        assert candidates == CANDIDATES


scores = st.floats(min_value=0, max_value=1e6, allow_nan=False)
categories = st.sampled_from(["Running Shoes", "Socks", "Televisions", None])
candidates_st = st.lists(
    st.builds(Candidate, st.uuids().map(str), scores, categories, st.booleans()), max_size=30
)
labels_st = st.lists(
    st.builds(
        IntentLabel,
        st.sampled_from(["ready_to_buy", "post_purchase", "deal_seeking", "browsing"]),
        st.floats(min_value=0, max_value=1),
        categories,
    ),
    min_size=1,
    max_size=3,
)


@given(candidates_st, labels_st)
def test_rerank_is_a_sorted_permutation(candidates, labels):
    ranked = rerank(candidates, intent(*labels))
    assert sorted(order(ranked)) == sorted(c.product_id for c in candidates)
    assert all(a.score >= b.score for a, b in itertools.pairwise(ranked))
    assert rerank(candidates, intent(*labels)) == ranked  # deterministic
