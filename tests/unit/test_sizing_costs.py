"""The plan's unit costs, read from results documents made by hand."""

from __future__ import annotations

import pytest

from flink_jobs.tools.sizing import costs as sizing_costs
from flink_jobs.tools.sizing.costs import (
    CONFIG,
    DERIVED,
    MEASURED,
    ConfigDefaults,
    MissingFigure,
    read_unit_costs,
)

CONFIG_DEFAULTS = ConfigDefaults(
    template="t.j2",
    max_tokens=192,
    rules_first=True,
    trigger_max_wait_s=2.0,
    out_of_orderness_s=0.5,
    max_parallelism=128,
    router_policy="bounded_hash",
    trigger_quiet_s=0.5,
    trigger_min_interval_s=1.0,
)


def capacity(**drain_extra):
    return {
        "machine": {"cores": 2, "cpu_model": "Test CPU"},
        "phases": {
            "drain": {
                "cpu_ms_per_event": {"flink_jvm": 0.4, "llm_call_process": 0.1, "redis": 0.02},
                "stats": {
                    "events_accepted": 1000,
                    "llm_calls": 250,
                    "prompts_sent": 260,
                    **drain_extra,
                },
            },
            "paced": {
                "event_to_prompt_s": {"p99": 0.6},
                "settings": {"job": {"out_of_orderness_s": "0.2"}},
            },
        },
    }


def quality():
    def arm(template, calls, tokens):
        return {
            "template": template,
            "cost": {"llm_calls": calls, "prompt_tokens_per_call": tokens},
        }

    return {
        "datasets": {
            "small": {"arms": [arm("t.j2", 10, 900.0)]},
            "large": {"arms": [arm("other.j2", 500, 100.0), arm("t.j2", 200, 1500.0)]},
        }
    }


def read(**documents):
    return read_unit_costs(documents, CONFIG_DEFAULTS)


def test_a_missing_results_file_gives_an_error_naming_it_and_its_writer():
    expected = (
        "bench/results/pipeline_capacity.json: the file is missing"
        " (written by `python -m bench.pipeline_capacity`)"
    )
    with pytest.raises(MissingFigure) as error:
        read().get("jvm_cpu_ms_per_event")
    assert str(error.value) == expected


def test_a_missing_key_gives_an_error_naming_the_file_and_the_key():
    with pytest.raises(
        MissingFigure, match=r"redis_upsert\.json: no shapes\.job\.upsert_ops_per_s"
    ):
        read(redis_upsert={"shapes": {}}).get("redis_writes_per_node_per_s")


def test_a_key_that_is_not_a_number_is_reported_as_such():
    with pytest.raises(MissingFigure, match="is not a number"):
        read(redis_upsert={"shapes": {"job": {"upsert_ops_per_s": "fast"}}}).get(
            "redis_writes_per_node_per_s"
        )


def test_the_taskmanagers_cpu_per_event_is_the_drains_jvm_share_with_its_key():
    figure = read(pipeline_capacity=capacity()).get("jvm_cpu_ms_per_event")
    assert (figure.value, figure.kind) == (0.4, MEASURED)
    assert figure.cite() == (
        "bench/results/pipeline_capacity.json: phases.drain.cpu_ms_per_event.flink_jvm"
    )


def test_the_call_process_cpu_is_counted_per_llm_call():
    figure = read(pipeline_capacity=capacity()).get("call_process_cpu_ms_per_call")
    assert (figure.value, figure.kind) == (pytest.approx(0.4), DERIVED)


def test_the_trigger_rate_is_the_drains_llm_calls_per_accepted_event():
    assert read(pipeline_capacity=capacity()).get("llm_calls_per_event").value == 0.25


def test_the_prompt_tokens_are_the_shipped_templates_arm_with_the_most_calls():
    figure = read(intent_quality=quality()).get("prompt_tokens_per_call")
    assert figure.value == 1500.0
    assert "datasets.large.arms[1].cost.prompt_tokens_per_call" in figure.key


def test_the_hit_ratio_is_the_routers_default_policys_in_the_steady_phase():
    routing = {"phases": {"steady": {"sidecar_bounded_hash": {"prefix_cache_hit_ratio": 0.8}}}}
    assert read(routing=routing).get("prefix_cache_hit_ratio").value == 0.8


def test_the_output_tokens_default_to_the_configured_cap():
    figure = read().get("output_tokens_per_call")
    assert (figure.value, figure.kind, figure.key) == (192, CONFIG, "llm.max_tokens")


def test_the_jobs_own_p99_moves_with_the_default_out_of_orderness():
    figure = read(pipeline_capacity=capacity()).get("job_to_prompt_p99_s")
    assert figure.value == pytest.approx(0.6 + 0.5 - 0.2)


def test_a_drain_without_rules_only_writes_is_flagged_when_the_default_makes_them():
    assert any("intents_written_rules" in c for c in read(pipeline_capacity=capacity()).caveats)
    flagged = read(pipeline_capacity=capacity(intents_written_rules=260)).caveats
    assert flagged == ()


def test_the_default_freshness_is_the_freshness_benchmarks_staleness_target():
    freshness = {"targets": [{"name": "staleness of active shoppers' intents", "limit": 5.0}]}
    assert read(freshness=freshness).get("freshness_target_s").value == 5.0


def test_every_unit_cost_but_the_gpus_throughputs_has_a_reader():
    gpu_figures = {"prefill_tokens_per_s", "decode_tokens_per_s"}
    assert set(sizing_costs._READERS) == set(sizing_costs.FIGURE_NAMES) - gpu_figures


def test_an_input_replaces_a_missing_figure_and_its_reason():
    missing = read()
    given = missing.with_figure(
        "router_cpu_ms_per_request", sizing_costs.Figure(0.3, "command line", "--x", "input")
    )
    assert given.get("router_cpu_ms_per_request").value == 0.3
    assert "router_cpu_ms_per_request" not in given.absent


def policy_row(quiet_s: float, *rates: float, long_rate: float) -> dict:
    trigger = {"quiet_s": quiet_s, "max_wait_s": 2.0, "min_interval_s": 1.0}
    return {
        "trigger": trigger,
        "samples": [{"prompts_per_event": r} for r in rates],
        "long_sample": {"prompts_per_event": long_rate},
    }


def test_the_trigger_rates_spread_is_the_policy_replays_at_the_default_trigger_settings():
    policy = {
        "timings": [policy_row(3.0, 0.1, long_rate=0.9), policy_row(0.5, 0.3, 0.2, long_rate=0.4)]
    }
    spread = read(trigger_policy=policy).prompts_per_event_spread
    assert spread is not None
    assert (spread.low, spread.high) == (0.2, 0.4)
    assert spread.cite().startswith("bench/results/trigger_policy.json: timings[1]")


def test_no_replay_at_the_default_trigger_settings_gives_no_spread():
    policy = {"timings": [policy_row(3.0, 0.1, long_rate=0.9)]}
    assert read(trigger_policy=policy).prompts_per_event_spread is None
    assert read().prompts_per_event_spread is None
