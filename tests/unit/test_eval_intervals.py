"""Differences between arms with a 95 % bootstrap interval over shoppers, and the distilled
adapter's targets judged from a run's figures."""

from __future__ import annotations

import pytest

from flink_jobs.tools.eval_runner import judge_targets
from flink_jobs.tools.intent_eval import PointScores, aggregate, bootstrap_difference


def points(values: list[float], shoppers: int = 40) -> list[PointScores]:
    return [
        PointScores(f"s{i % shoppers}", i, purchase_after=i % 2 == 0, ndcg_at_10=v)
        for i, v in enumerate(values)
    ]


def test_an_arm_against_itself_differs_by_zero_with_a_zero_interval():
    a = points([0.1 * (i % 7) for i in range(120)])

    d = bootstrap_difference(a, a, "ndcg_at_10", resamples=200)

    assert (d.difference, d.low, d.high) == (0.0, 0.0, 0.0)
    assert d.writes == 120


def test_a_clearly_better_arm_has_an_interval_above_zero():
    base = [0.1 * (i % 7) for i in range(120)]
    a, b = points([v + 0.2 for v in base]), points(base)

    d = bootstrap_difference(a, b, "ndcg_at_10", resamples=200)

    assert d.difference == pytest.approx(0.2)
    assert 0 < d.low <= d.difference <= d.high


def test_a_noisy_small_gain_has_an_interval_that_spans_zero():
    a = points([1.0 if i % 10 == 0 else 0.0 for i in range(60)], shoppers=6)
    b = points([1.0 if i % 11 == 0 else 0.0 for i in range(60)], shoppers=6)

    d = bootstrap_difference(a, b, "ndcg_at_10", resamples=300)

    assert d.low < 0 < d.high


def test_only_writes_both_arms_scored_are_compared():
    a = points([1.0] * 10)
    b = points([0.0] * 5)

    d = bootstrap_difference(a, b, "ndcg_at_10", resamples=50)

    assert d.writes == 5 and d.difference == 1.0


def test_purchase_auc_aggregates_the_purchase_scores():
    scored = [PointScores("s", i, purchase_after=i >= 2, purchase_score=float(i)) for i in range(4)]

    assert aggregate(scored).purchase_auc == 1.0


def run_document(adapter_auc: float, adapter_low: float) -> dict:
    adapter = "shopper_intent_compact.j2@si-compact-lora"

    def diff(a, b, metric, value, low=0.01):
        return {"a": a, "b": b, "metric": metric, "difference": value, "low": low, "high": 1.0}

    return {
        "arms": [
            {
                "template": "shopper_intent_v3.j2",
                "cost": {"prompt_tokens_per_call": 2000.0, "llm_latency_s": {"p50": 4.0}},
            },
            {
                "template": adapter,
                "cost": {"prompt_tokens_per_call": 300.0, "llm_latency_s": {"p50": 1.5}},
            },
        ],
        "scores": {
            "common_points": 240,
            "differences": [
                diff(f"{adapter} answer", f"{adapter} rules", "ndcg_at_10", 0.04),
                diff(
                    f"{adapter} answer",
                    f"{adapter} rules",
                    "purchase_auc",
                    adapter_auc,
                    adapter_low,
                ),
                diff(f"{adapter} answer", f"{adapter} rules", "browsing_with_signal", 0.1),
                diff(f"{adapter} record", "shopper_intent_v3.j2 record", "ndcg_at_10", 0.02),
            ],
        },
    }


def test_the_targets_say_which_are_met():
    targets = {
        t["name"]: t for t in judge_targets(run_document(adapter_auc=0.08, adapter_low=0.01))
    }

    assert targets["adapter answer - rules, purchase_auc gain"]["met"] is True
    assert targets["prompt tokens per call, adapter arm / v3 arm"]["value"] == 0.15
    assert targets["LLM latency p50, adapter arm / v3 arm"]["met"] is True
    # browsing_with_signal: lower is better, so a rise of 0.1 is a loss.
    assert (
        targets["adapter answer - rules, browsing_with_signal (better is positive)"]["met"] is False
    )
    assert targets["trigger points answered by every arm"]["met"] is True


def test_a_purchase_auc_gain_under_the_limit_is_missed():
    targets = {
        t["name"]: t for t in judge_targets(run_document(adapter_auc=0.03, adapter_low=-0.01))
    }

    assert targets["adapter answer - rules, purchase_auc gain"]["met"] is False
    assert targets["adapter answer - rules, purchase_auc: 95 % interval's low end"]["met"] is False


def test_a_trigger_point_answered_twice_is_scored_once_with_its_newest_answer():
    from flink_jobs.tools.eval_runner import one_write_per_point
    from flink_jobs.tools.intent_eval import IntentWrite
    from intent_reader.client import IntentLabel

    first = IntentWrite("s1", 10, (IntentLabel("browsing", 0.5),))
    again = IntentWrite("s1", 10, (IntentLabel("comparing_options", 0.6),))
    other = IntentWrite("s1", 20, (IntentLabel("browsing", 0.5),))

    assert one_write_per_point([first, other, again]) == [again, other]
