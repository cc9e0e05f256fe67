"""``shopper-intents plan``'s arithmetic, on unit costs made by hand."""

from __future__ import annotations

import dataclasses

import pytest

from flink_jobs.tools.sizing import gpus
from flink_jobs.tools.sizing.costs import ASSUMED, INPUT, Spread, UnitCosts
from flink_jobs.tools.sizing.model import (
    FLINK,
    LLM,
    MIN_ROUTER_REPLICAS,
    REDIS,
    ROUTER,
    PlanInputs,
    plan,
)
from tests.support.builders import unit_costs as costs

#: With the builder's unit costs (500 uncached prompt tokens and 200 output tokens a call,
#: 0.25 calls and 0.75 ms of job CPU per event) a call takes 500 / 12,500 + 200 / 5,000 =
#: 0.08 GPU-seconds.
GPU = {"prefill_tokens_per_s": 12_500.0, "decode_tokens_per_s": 5_000.0}


def planned(events_per_s: float = 1000.0, unit_costs: UnitCosts | None = None, **inputs):
    inputs = {"utilisation": 1.0, **GPU, **inputs}
    return plan(PlanInputs(events_per_s, **inputs), unit_costs or costs())


def count(p, tier: str) -> int | None:
    return p.resource(tier).count


def test_doubling_the_event_rate_doubles_the_gpus():
    assert count(planned(1000), LLM) == 20
    assert count(planned(2000), LLM) == 40


def test_prefill_tokens_are_the_prompt_tokens_the_prefix_cache_did_not_serve():
    p = planned(1000)
    assert p.rates["prefill_tokens"] == pytest.approx(250 * 2000 * 0.25)


def test_a_higher_prefix_cache_hit_ratio_lowers_the_prefill_and_the_gpus():
    low, high = planned(prefix_cache_hit_ratio=0.5), planned(prefix_cache_hit_ratio=0.9)
    assert high.rates["prefill_tokens"] < low.rates["prefill_tokens"]
    assert count(high, LLM) < count(low, LLM)


def test_longer_answers_raise_the_decode_tokens_and_the_gpus():
    assert count(planned(output_tokens_per_call=400), LLM) == 30


def test_the_gpu_count_is_the_busy_gpus_over_the_utilisation_rounded_up():
    assert count(planned(utilisation=0.7), LLM) == 29  # 20 / 0.7 = 28.6


def test_kpus_are_the_jobs_cpu_over_the_utilisation_rounded_up():
    p = planned(1000, utilisation=0.5)  # 1,000 x 0.75 ms = 0.75 vCPU
    assert p.resource(FLINK).work == pytest.approx(0.75)
    assert count(p, FLINK) == 2


def test_the_call_process_cpu_counts_per_llm_call():
    assert planned(4000, llm_calls_per_event=0.5).resource(FLINK).work == pytest.approx(4.0)


def test_a_faster_vcpu_needs_fewer_kpus():
    assert planned(4000, cpu_speed=2.0).resource(FLINK).work == pytest.approx(1.5)


def test_subtasks_per_kpu_raise_the_parallelism_not_the_kpus():
    p = planned(4000, parallelism_per_kpu=2)
    assert count(p, FLINK) == 3
    assert "parallelism 6 (2 per KPU)" in p.resource(FLINK).rule


def test_a_parallelism_above_the_max_parallelism_is_warned_of():
    p = planned(1000, unit_costs=costs(max_parallelism=1.0), parallelism_per_kpu=2)
    assert any("above job.max_parallelism (1)" in w for w in p.warnings)


def test_redis_takes_an_upsert_per_llm_call_and_one_per_prompt_for_its_rules_record():
    p = planned(1000)
    assert p.rates["redis_upserts"] == pytest.approx(1000 * (0.25 + 0.05))


def test_without_rules_only_records_redis_takes_an_upsert_per_llm_call():
    p = planned(1000, unit_costs=costs(rules_writes_per_prompt=0.0))
    assert p.rates["redis_upserts"] == pytest.approx(250)


def test_redis_shards_are_the_upserts_over_a_nodes_rounded_up():
    assert count(planned(100_000), REDIS) == 3  # 30,000 / 10,000


def test_more_than_one_redis_shard_warns_that_the_notification_stream_needs_one():
    assert any("notify_stream" in w for w in planned(100_000).warnings)


def test_router_replicas_follow_the_requests_cpu():
    assert count(planned(40_000), ROUTER) == 5  # 10,000 calls/s x 0.5 ms


def test_a_quiet_router_still_gets_its_minimum_replicas():
    assert count(planned(10), ROUTER) == MIN_ROUTER_REPLICAS


def test_a_tier_whose_figure_is_absent_is_not_sized_and_says_which_file_and_key():
    p = planned(1000, unit_costs=costs(router_cpu_ms_per_request=None))
    assert count(p, ROUTER) is None
    assert p.resource(ROUTER).missing == "test.json: no router_cpu_ms_per_request"
    assert count(p, FLINK) is not None


def test_the_freshness_budget_is_what_the_trigger_and_the_job_leave_the_llm_call():
    assert planned(freshness_s=6.0).freshness.llm_budget_s == pytest.approx(3.0)


def test_a_freshness_target_the_trigger_and_the_job_use_up_is_warned_of():
    p = planned(freshness_s=2.5)
    assert any("cannot be met" in w for w in p.warnings)


def test_an_input_replaces_the_unit_cost_and_is_cited_as_the_command_line():
    figure = planned(prompt_tokens_per_call=1000).figures["prompt_tokens_per_call"]
    assert (figure.value, figure.kind, figure.key) == (1000, INPUT, "--prompt-tokens-per-call")


def test_without_gpu_throughputs_the_gpu_tables_are_used_and_cited_as_assumed():
    p = plan(PlanInputs(1000, gpu="L4"), costs())
    figure = p.figures["decode_tokens_per_s"]
    assert (figure.value, figure.kind) == (gpus.GPUS["L4"].decode_tokens_per_s, ASSUMED)


def test_an_unknown_gpu_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="A10G"):
        plan(PlanInputs(1000, gpu="Z9"), costs())


@pytest.mark.parametrize(
    "bad",
    [
        {"events_per_s": 0},
        {"utilisation": 1.5},
        {"prefix_cache_hit_ratio": 1.0},
        {"parallelism_per_kpu": 0},
    ],
)
def test_an_input_out_of_its_range_is_refused_naming_it(bad):
    inputs = {"events_per_s": 1000, **GPU, **bad}
    flag = "--" + next(iter(bad)).replace("_", "-")
    with pytest.raises(ValueError, match=flag):
        plan(PlanInputs(**inputs), costs())


def test_the_drivers_start_with_the_tier_of_the_most_units_and_split_its_work():
    drivers = planned(1000).drivers
    assert drivers[0].startswith("vLLM workers, 20 x GPU")
    assert "decode 50% of GPU time" in drivers[0]
    assert "prefill 50%" in drivers[0]


def test_every_figure_the_plan_used_is_listed_with_its_source():
    p = planned(1000)
    assert {"jvm_cpu_ms_per_event", "prefix_cache_hit_ratio"} <= set(p.figures)
    assert p.figures["jvm_cpu_ms_per_event"].cite() == "test.json: jvm_cpu_ms_per_event"


def test_a_trigger_rate_given_alone_sets_both_its_figures():
    p = planned(1000, prompts_per_event=0.1)
    calls = p.trigger_rate["llm_calls_per_event"]
    assert (calls.value, calls.kind) == (0.1, INPUT)
    assert p.rates["llm_calls"] == pytest.approx(100)
    assert p.rates["redis_upserts"] == pytest.approx(1000 * (0.1 + 0.1))


def test_more_llm_calls_than_prompts_per_event_are_refused():
    with pytest.raises(ValueError, match="cannot exceed --prompts-per-event"):
        planned(llm_calls_per_event=0.3, prompts_per_event=0.2)


@pytest.mark.parametrize("rate", [0.0, 1.5])
def test_a_trigger_rate_outside_0_to_1_is_refused(rate):
    with pytest.raises(ValueError, match=r"--prompts-per-event must be in \(0, 1\]"):
        planned(prompts_per_event=rate)


def test_the_plan_keeps_the_trigger_rate_it_ran_at_and_its_spread():
    spread = Spread(0.2, 0.4, "test.json", "rates")
    p = planned(unit_costs=dataclasses.replace(costs(), prompts_per_event_spread=spread))
    assert set(p.trigger_rate) == {"llm_calls_per_event", "prompts_per_event"}
    assert p.trigger_rate_spread == spread
