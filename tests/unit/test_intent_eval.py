"""Scoring intent writes against what the shopper did next: tiny hand-made shoppers whose
figures are worked out by hand in each test."""

from __future__ import annotations

import dataclasses
import math
import random

import orjson
import pytest

from flink_jobs.config import SessionConfig
from flink_jobs.core.events import ShopperEvent
from flink_jobs.tools.intent_eval import (
    EvalResult,
    GroupReport,
    IntentWrite,
    draw_candidates,
    evaluate,
    format_table,
    ndcg_at,
    roc_auc,
)
from intent_reader.client import IntentLabel
from tests.support.builders import T0

GAP_S = SessionConfig().gap_s

A1 = {"product_id": "sku-737145", "category": "Electronics > Audio > Headphones", "price": 108.99}
A2 = {"product_id": "sku-149048", "category": "Electronics > Audio > Headphones", "price": 299.99}
B1 = {"product_id": "sku-880412", "category": "Sports & Outdoors > Camping", "price": 249.0}
C1 = {"product_id": "sku-552310", "category": "Grocery > Coffee & Tea", "price": 12.49}


def ev(shopper: str, event_type: str, at_s: float, product: dict | None = None, **fields):
    return ShopperEvent(
        event_id=f"ev-{shopper}-{event_type}-{at_s}",
        shopper_id=shopper,
        event_type=event_type,
        event_time_ms=T0 + int(at_s * 1000),
        **(product or {}),
        **fields,
    )


def write(shopper: str, at_s: float, *labels: tuple, source="model", template="v2", model="m"):
    return IntentWrite(
        shopper_id=shopper,
        version_ts=T0 + int(at_s * 1000),
        labels=tuple(IntentLabel(*label) for label in labels),
        source=source,
        template=template,
        model=model,
    )


def only_group(events, writes, **options) -> GroupReport:
    result = evaluate(events, writes, **options)
    [group] = result.groups
    return group


class TestRocAuc:
    def test_counts_the_pairs_a_positive_outscores(self) -> None:
        # positives 0.9 and 0.3 against negatives 0.8 and 0.1: 3 of 4 pairs ordered right
        assert roc_auc([0.9, 0.8, 0.3, 0.1], [True, False, True, False]) == 0.75

    def test_a_tie_counts_half(self) -> None:
        # 0.9 beats 0.5 (1), the positive 0.5 ties the negative 0.5 (0.5): 1.5 / 2
        assert roc_auc([0.9, 0.5, 0.5], [True, True, False]) == 0.75

    def test_perfect_and_inverted_rankings(self) -> None:
        assert roc_auc([0.9, 0.1], [True, False]) == 1.0
        assert roc_auc([0.1, 0.9], [True, False]) == 0.0

    def test_one_class_only_has_no_auc(self) -> None:
        assert roc_auc([0.9, 0.1], [True, True]) is None
        assert roc_auc([], []) is None


class TestNdcg:
    @pytest.mark.parametrize(
        ("rank", "expected"),
        [(1, 1.0), (3, 0.5), (10, 1 / math.log2(11)), (11, 0.0)],
    )
    def test_one_relevant_item_at_rank(self, rank: int, expected: float) -> None:
        assert ndcg_at(rank) == pytest.approx(expected)


class TestNextEngagementCategory:
    EVENTS = (
        ev("s1", "view", 0, A1),
        ev("s1", "view", 10, B1),
        ev("s1", "search", 20, query="headphones"),
        ev("s1", "view", 30, A2),
    )

    def test_top1_and_any_against_the_next_product_engaged(self) -> None:
        # After t=10 the search is skipped: the next engagement is A2, a headphone.
        group = only_group(
            self.EVENTS,
            [write("s1", 10, ("comparing_options", 0.6, "Camping"), ("browsing", 0.3, "Audio"))],
        )

        assert (group.answer.next_category_top1, group.answer.next_category_any) == (0.0, 1.0)
        assert group.counts.followed_by_engagement == 1

    def test_rules_baseline_is_the_rules_intent_at_the_same_point(self) -> None:
        # At t=10: one view each of Headphones and Camping, Camping the more recent, no
        # search: rule 6, browsing in Camping; the next engagement is a headphone.
        group = only_group(self.EVENTS, [write("s1", 10, ("browsing", 0.5, "Headphones"))])

        assert (group.answer.next_category_top1, group.rules.next_category_top1) == (1.0, 0.0)

    def test_a_write_with_nothing_after_it_is_not_scored(self) -> None:
        group = only_group(self.EVENTS, [write("s1", 30, ("browsing", 0.5, "Headphones"))])

        assert group.counts.followed_by_engagement == 0
        assert group.answer.next_category_top1 is None
        assert group.answer.ndcg_at_10 is None

    def test_the_next_session_does_not_count(self) -> None:
        events = [ev("s2", "view", 0, A1), ev("s2", "view", GAP_S + 1, A2)]

        group = only_group(events, [write("s2", 0, ("browsing", 0.5, "Headphones"))])

        assert group.counts.followed_by_engagement == 0

    def test_a_removal_is_not_an_engagement(self) -> None:
        events = [
            ev("s3", "add_to_cart", 0, B1),
            ev("s3", "remove_from_cart", 10, B1),
            ev("s3", "view", 20, C1),
        ]

        group = only_group(events, [write("s3", 0, ("ready_to_buy", 0.7, "Camping"))])

        assert group.answer.next_category_top1 == 0.0

    def test_an_intent_without_a_category_misses(self) -> None:
        group = only_group(self.EVENTS, [write("s1", 10, ("browsing", 0.5, None))])

        assert (group.answer.next_category_top1, group.answer.next_category_any) == (0.0, 0.0)

    def test_the_ceiling_counts_next_engagements_in_a_category_the_model_was_offered(self) -> None:
        # At t=0 only Headphones (and its parents) is offered and the next engagement is
        # Camping: out of reach. At t=10 both are offered and the next one is a headphone.
        writes = [
            write("s1", 0, ("browsing", 0.5, "Headphones")),
            write("s1", 10, ("browsing", 0.5, "Headphones")),
        ]

        group = only_group(self.EVENTS, writes)

        assert (group.counts.followed_by_engagement, group.counts.next_category_offered) == (2, 1)


class TestPurchaseForesight:
    EVENTS = (
        ev("p1", "view", 0, A1),
        ev("p1", "add_to_cart", 10, A1),
        ev("p1", "purchase", 50, A1),
        ev("p2", "view", 0, B1),
        ev("p2", "add_to_cart", 10, B1),
        ev("p2", "view", 20, C1),
        ev("p3", "view", 0, C1),
        ev("p3", "purchase", 30, C1),
    )
    WRITES = (
        write("p1", 10, ("ready_to_buy", 0.8, "Headphones")),  # buys after: score 0.8
        write("p2", 10, ("ready_to_buy", 0.6, "Camping")),  # does not: 0.6
        write("p2", 20, ("abandoning_cart", 0.5, "Camping"), ("ready_to_buy", 0.3, "Camping")),
        write("p3", 0, ("browsing", 0.5, "Coffee & Tea")),  # buys after: 0.0
    )

    def test_auc_of_the_ready_to_buy_confidence(self) -> None:
        # positives 0.8, 0.0; negatives 0.6, 0.3: 0.8 beats both, 0.0 neither: 2 / 4
        group = only_group(self.EVENTS, self.WRITES)

        assert group.answer.purchase_auc == 0.5
        assert group.counts.purchase_after == 2

    def test_rules_baseline_auc(self) -> None:
        # rules: p1@10 ready_to_buy 0.7 (+), p2@10 ready_to_buy 0.7 (-),
        # p2@20 abandoning_cart with ready_to_buy 0.25 (-), p3@0 browsing 0 (+):
        # 0.7 ties 0.7 (0.5) and beats 0.25 (1); 0 beats neither: 1.5 / 4
        group = only_group(self.EVENTS, self.WRITES)

        assert group.rules.purchase_auc == 0.375

    def test_the_purchase_labels_can_be_chosen(self) -> None:
        # abandoning_cart counts too, so p2@20 scores 0.5 + 0.3 = 0.8 (-): p1's 0.8 beats
        # 0.6 (1) and ties 0.8 (0.5), p3's 0 beats neither: 1.5 / 4
        group = only_group(
            self.EVENTS, self.WRITES, purchase_labels=("ready_to_buy", "abandoning_cart")
        )

        assert group.answer.purchase_auc == 0.375


class TestConsistencyWithHardFacts:
    def test_just_purchased_should_be_post_purchase(self) -> None:
        events = [
            ev("c1", "add_to_cart", 0, A1),
            ev("c1", "purchase", 10, A1),
            ev("c2", "purchase", 0, B1),
        ]
        writes = [
            write("c1", 10, ("post_purchase", 0.8, "Headphones")),
            write("c2", 0, ("browsing", 0.5, "Camping")),
        ]

        group = only_group(events, writes)

        assert group.counts.just_purchased == 2
        assert (group.answer.post_purchase_consistency, group.rules.post_purchase_consistency) == (
            0.5,
            1.0,
        )

    def test_the_record_is_scored_as_the_job_stores_it_the_rules_label_first(self) -> None:
        events = [ev("c2", "purchase", 0, B1)]
        writes = [write("c2", 0, ("browsing", 0.5, "Camping"))]

        group = only_group(events, writes)

        assert (group.answer.post_purchase_consistency, group.record.post_purchase_consistency) == (
            0.0,
            1.0,
        )

    def test_a_cart_left_at_the_session_end_should_be_abandoning_cart(self) -> None:
        events = [
            ev("c3", "add_to_cart", 0, A1),
            ev("c3", "view", 10, B1),  # the session ends here, the cart full
            ev("c4", "add_to_cart", 0, C1),  # and here
        ]
        writes = [
            write("c3", 0, ("ready_to_buy", 0.7, "Headphones")),  # more came: not judged
            write("c3", 10, ("abandoning_cart", 0.6, "Headphones")),
            write("c4", 0, ("ready_to_buy", 0.7, "Coffee & Tea")),
        ]

        group = only_group(events, writes)

        assert group.counts.cart_left == 2
        # rules: c3@10 abandoning_cart (rule 3), c4@0 ready_to_buy (rule 2)
        assert (
            group.answer.abandoning_cart_consistency,
            group.rules.abandoning_cart_consistency,
        ) == (0.5, 0.5)


class TestBrowsingWithSignal:
    def test_share_of_browsing_where_the_session_says_more(self) -> None:
        events = [
            ev("b1", "view", 0, A1),
            ev("b1", "view", 5, A1),  # a category engaged twice
            ev("b2", "view", 0, B1),  # no signal
            ev("b3", "add_to_cart", 0, C1),
            ev("b3", "view", 10, A1),  # a cart
        ]
        writes = [
            write("b1", 5, ("browsing", 0.5, "Headphones")),
            write("b2", 0, ("browsing", 0.5, "Camping")),
            write("b3", 10, ("comparing_options", 0.5, "Headphones")),
        ]

        group = only_group(events, writes)

        assert group.counts.with_signal == 2
        # rules: b1 browsing (one product twice, no search), b3 abandoning_cart
        assert (group.answer.browsing_with_signal, group.rules.browsing_with_signal) == (0.5, 0.5)


class TestReranking:
    EVENTS = (ev("r1", "view", 0, B1), ev("r1", "view", 10, A1))  # catalogue: A1 and B1

    def test_a_demoted_category_puts_the_engaged_product_second(self) -> None:
        # post_purchase at confidence 1 halves A1's score (from [0.5, 1) to [0.25, 0.5)),
        # below B1's: rank 2 of 2
        group = only_group(self.EVENTS, [write("r1", 0, ("post_purchase", 1.0, "Headphones"))])

        assert group.answer.ndcg_at_10 == pytest.approx(1 / math.log2(3))
        assert group.answer.recall_at_10 == 1.0

    def test_a_boosted_category_puts_the_engaged_product_first(self) -> None:
        # ready_to_buy at confidence 1 doubles A1's score, above any base score
        group = only_group(self.EVENTS, [write("r1", 0, ("ready_to_buy", 1.0, "Headphones"))])

        assert group.answer.ndcg_at_10 == 1.0

    def test_an_intent_matching_no_candidate_ranks_as_no_intent(self) -> None:
        catalogue = [ev("x", "view", i, {**C1, "product_id": f"sku-{i:03d}"}) for i in range(40)]
        events = [*catalogue, ev("r2", "view", 0, B1), ev("r2", "view", 10, A1)]

        group = only_group(events, [write("r2", 0, ("browsing", 0.9, "Toys"))], candidates=30)

        assert group.answer.ndcg_at_10 == group.no_intent.ndcg_at_10
        assert group.answer.recall_at_10 == group.no_intent.recall_at_10

    def test_every_group_ranks_the_same_candidates_without_intent(self) -> None:
        catalogue = [ev("x", "view", i, {**C1, "product_id": f"sku-{i:03d}"}) for i in range(40)]
        events = [*catalogue, ev("r3", "view", 0, B1), ev("r3", "view", 10, A1)]
        writes = [
            write("r3", 0, ("browsing", 0.5, "Camping"), template="v1"),
            write("r3", 0, ("ready_to_buy", 0.9, "Headphones"), template="v2"),
        ]

        v1, v2 = evaluate(events, writes, candidates=30).groups

        assert v1.no_intent == v2.no_intent
        assert v2.answer.ndcg_at_10 == 1.0

    def test_the_same_inputs_score_the_same(self) -> None:
        catalogue = [ev("x", "view", i, {**C1, "product_id": f"sku-{i:03d}"}) for i in range(40)]
        events = [*catalogue, ev("r4", "view", 0, B1), ev("r4", "view", 10, A1)]
        writes = [write("r4", 0, ("browsing", 0.5, "Camping"))]

        first = evaluate(events, writes, seed=5).as_dict()

        assert evaluate(list(reversed(events)), writes, seed=5).as_dict() == first

    def test_a_rerun_with_every_time_moved_draws_the_same_candidates(self) -> None:
        # The eval moves event times to the wall clock, so each run sees other times.
        catalogue = [ev("x", "view", i, {**C1, "product_id": f"sku-{i:03d}"}) for i in range(200)]
        shoppers = [f"r{i}" for i in range(8)]
        events = catalogue + [
            e for s in shoppers for e in (ev(s, "view", 0, B1), ev(s, "view", 10, A1))
        ]
        writes = [write(s, 0, ("browsing", 0.5, "Camping")) for s in shoppers]
        hour = 3_600_000

        def moved(e: ShopperEvent) -> ShopperEvent:
            return dataclasses.replace(e, event_time_ms=e.event_time_ms + hour)

        later = evaluate(
            [moved(e) for e in events],
            [dataclasses.replace(w, version_ts=w.version_ts + hour) for w in writes],
            seed=5,
        )

        assert later.as_dict() == evaluate(events, writes, seed=5).as_dict()


COFFEE_CATALOGUE = {f"sku-{i:03d}": "Grocery > Coffee & Tea" for i in range(20)}


class TestCandidates:
    def test_the_engaged_product_and_n_minus_one_distinct_others(self) -> None:
        drawn = draw_candidates("sku-007", COFFEE_CATALOGUE, 8, random.Random(1))

        ids = [c.product_id for c in drawn]
        assert len(ids) == len(set(ids)) == 8
        assert "sku-007" in ids
        assert set(ids) <= set(COFFEE_CATALOGUE)

    def test_a_small_catalogue_gives_all_it_has(self) -> None:
        drawn = draw_candidates(
            "sku-001", dict(list(COFFEE_CATALOGUE.items())[:3]), 50, random.Random(1)
        )

        assert sorted(c.product_id for c in drawn) == ["sku-000", "sku-001", "sku-002"]

    def test_base_scores_are_in_the_documented_range_and_seeded(self) -> None:
        first = draw_candidates("sku-007", COFFEE_CATALOGUE, 8, random.Random(3))

        assert all(0.5 <= c.score < 1.0 for c in first)
        assert draw_candidates("sku-007", COFFEE_CATALOGUE, 8, random.Random(3)) == first
        assert draw_candidates("sku-007", COFFEE_CATALOGUE, 8, random.Random(4)) != first


class TestGroupsAndInputs:
    def test_writes_are_grouped_by_template_model_and_source(self) -> None:
        events = [ev("g1", "view", 0, A1), ev("g1", "view", 10, A2)]
        writes = [
            write("g1", 0, ("browsing", 0.5, "Headphones"), template="v1", source="model"),
            write("g1", 0, ("browsing", 0.5, "Headphones"), template="v2", source="model"),
            write("g1", 0, ("browsing", 0.5, "Headphones"), template="v2", source="rules"),
            write("g1", 10, ("comparing_options", 0.6, "Headphones"), template="v2"),
        ]

        result = evaluate(events, writes)

        assert [(g.template, g.model, g.source, g.counts.writes) for g in result.groups] == [
            ("v1", "m", "model", 1),
            ("v2", "m", "model", 2),
            ("v2", "m", "rules", 1),
        ]

    def test_a_write_for_a_shopper_without_events_is_unmatched(self) -> None:
        events = [ev("g2", "view", 10, A1)]
        writes = [
            write("nobody", 0, ("browsing", 0.5, None)),
            write("g2", 5, ("browsing", 0.5, None)),
        ]

        result = evaluate(events, writes)

        assert (result.unmatched_writes, result.groups) == (2, ())

    def test_a_write_reads_from_the_intent_hash_fields(self) -> None:
        record = {
            "intent": orjson.dumps(
                {
                    "intents": [
                        {"label": "browsing", "confidence": 0.2},
                        {"label": "ready_to_buy", "confidence": 0.7, "category": "Headphones"},
                    ],
                    "summary": "Added headphones to the cart.",
                }
            ),
            "version_ts": str(T0),
            "template": "shopper_intent_v2.j2",
            "model": "SmolLM2-135M-Instruct",
            "source": "rules",
        }

        w = IntentWrite.from_record("shopper-00146", record)

        assert w == IntentWrite(
            "shopper-00146",
            T0,
            (IntentLabel("ready_to_buy", 0.7, "Headphones"), IntentLabel("browsing", 0.2, None)),
            "rules",
            "shopper_intent_v2.j2",
            "SmolLM2-135M-Instruct",
        )
        assert (w.top_label, w.categories) == ("ready_to_buy", ("Headphones",))

    def test_a_record_without_a_source_is_the_models(self) -> None:
        record = {"intent": '{"intents":[{"label":"browsing","confidence":0.5}],"summary":"x"}'}

        w = IntentWrite.from_record("s", {**record, "version_ts": 1, "template": "t", "model": "m"})

        assert w.source == "model"

    def test_the_table_has_a_row_per_arm(self) -> None:
        events = [ev("t1", "view", 0, A1), ev("t1", "view", 10, A2)]
        result = evaluate(events, [write("t1", 0, ("comparing_options", 0.6, "Headphones"))])

        lines = format_table(result).splitlines()

        assert len(lines) == 2 + 4
        assert lines[2].startswith("| v2 | m | model | answer | 1 | 1.000 | 1.000 |")
        assert lines[3].startswith("| v2 | m | model | record | 1 | 1.000 | 1.000 |")
        assert lines[5].startswith("| v2 | m | model | none | 1 |  |  |  |")

    def test_the_result_is_json(self) -> None:
        events = [ev("t2", "view", 0, A1), ev("t2", "view", 10, A2)]
        result: EvalResult = evaluate(events, [write("t2", 0, ("browsing", 0.5, "Headphones"))])

        doc = orjson.loads(orjson.dumps(result.as_dict()))

        assert doc["groups"][0]["counts"]["writes"] == 1
        assert set(doc["groups"][0]["answer"]) == set(doc["groups"][0]["rules"])
