"""The benchmark suite's pure pieces: result keys, ratios, rates, targets, the baseline."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest

from bench import _common, freshness, pipeline_capacity, redis_upsert, report, run_all
from flink_jobs.config import AppConfig
from flink_jobs.core.events import ShopperEvent


def _doc(**figures):
    return _common.result_doc("x", time.monotonic(), [], **figures)


def test_a_result_document_starts_with_the_shared_keys_in_order():
    doc = _doc(extra=1)
    assert tuple(doc)[: len(_common.RESULT_KEYS)] == _common.RESULT_KEYS
    assert doc["extra"] == 1


def test_a_benchmark_cannot_overwrite_a_shared_key():
    with pytest.raises(ValueError, match="shared keys"):
        _doc(machine="mine")


def test_no_targets_is_not_all_targets_met():
    assert _doc()["all_targets_met"] is False


def test_the_machine_is_described_by_cores_cpu_and_memory():
    assert {"cores", "cpu_model", "memory_gib"} <= set(_common.machine())


def test_the_machine_names_the_cpu_features_that_decide_the_workers_dtype():
    text = _common.machine_text(
        {"cores": 2, "cpu_model": "AMD EPYC", "cpu_features": ["avx2", "avx512f", "avx512_bf16"],
         "memory_gib": 23.5, "python": "3.11.7"}
    )  # fmt: skip
    assert text == "2 cores, AMD EPYC (avx2, avx512f, avx512_bf16), 23.5 GiB RAM, Python 3.11.7"


def test_a_report_over_results_from_two_machines_says_so_and_names_each():
    docs = {
        name: {
            "benchmark": name,
            "targets": [],
            "machine": {"cores": 2, "cpu_model": "AMD EPYC", "cpu_features": features},
        }
        for name, features in (("first", ["avx2"]), ("second", ["avx2", "avx512f"]))
    }
    text = report.report(docs, {})
    assert "more than one machine" in text
    assert text.count("Machine: 2 cores, AMD EPYC (avx2") == 2


def test_ratio_of_a_missing_or_zero_denominator_is_nan():
    assert _common.ratio(3, 2) == 1.5
    assert math.isnan(_common.ratio(3, 0))
    assert math.isnan(_common.ratio(None, 2))


def test_a_nan_value_never_meets_a_target():
    assert _common.target("t", math.nan, "<=", 1.0)["met"] is False
    assert _common.target("t", None, ">=", 1.0)["met"] is False


def test_a_target_compares_with_its_operator():
    assert _common.target("t", 0.6, ">=", 0.5)["met"] is True
    assert _common.target("t", 1.2, "<=", 1.0)["met"] is False
    assert _common.target("t", 1.0, "<", 1.0)["met"] is False
    assert _common.target("t", 1.1, ">", 1.0)["met"] is True


def test_a_missing_limit_never_meets_a_target():
    assert _common.target("t", 0.6, "<", None)["met"] is False


_SHAPES = {"job": {"upsert_over_hset": 1.2}, "batch": {"upsert_over_hset": 1.0}}


def test_the_redis_benchmark_reference_is_judged_against_the_same_ratio_as_the_shapes():
    reference = {"upsert_evalsha": 200_000.0, "hset": 440_000.0, "upsert_over_hset": 0.455}
    verdicts = {t["name"]: t["met"] for t in redis_upsert.judge(_SHAPES, reference)}
    assert verdicts == {
        "job shape: upsert / HSET throughput": True,
        "batch shape: upsert / HSET throughput": True,
        "redis-benchmark: EVALSHA upsert / HSET throughput": False,
    }


def test_without_redis_benchmark_only_the_shapes_are_judged():
    assert len(redis_upsert.judge(_SHAPES, None)) == 2


def test_a_redis_benchmark_that_gave_no_figure_misses_its_target():
    reference = {"upsert_evalsha": None, "hset": 440_000.0, "upsert_over_hset": None}
    assert redis_upsert.judge(_SHAPES, reference)[-1]["met"] is False


def test_nan_is_written_as_null():
    assert _common.rounded(math.nan) is None
    assert _common.rounded(1.23456) == 1.235


def test_peaks_are_summarised_per_kind_as_largest_and_sum():
    summary = _common.summarise_peaks(
        [("redis", 2048), ("vllm_worker", 1024), ("vllm_worker", 3072)]
    )
    assert summary["vllm_worker"] == {"processes": 2, "max_mib": 3.0, "sum_mib": 4.0}
    assert summary["redis"]["processes"] == 1


@pytest.mark.parametrize(
    ("cmdline", "kind"),
    [
        ("java -cp x org.apache.flink.client.python.PythonGatewayServer", "flink_jvm"),
        (
            "java -cp x org.apache.flink.runtime.taskexecutor.TaskManagerRunner --configDir c",
            "flink_taskmanager",
        ),
        (
            "java -cp x org.apache.flink.runtime.entrypoint.StandaloneSessionClusterEntrypoint",
            "flink_jobmanager",
        ),
        ("/usr/bin/redis-server 127.0.0.1:1234", "redis"),
        ("/x/.cache/bin/tansu broker --listener-url tcp://127.0.0.1:1", "tansu"),
        ("python -m vllm.entrypoints.openai.api_server --model m", "vllm_worker"),
        ("python -m inference_sidecar router --port 1", "router"),
        ("python -m bench.standin_llm --port 1", "standin_llm"),
        ("/x/.cache/venv/bin/python3.11 -m flink_jobs.runtime.call_process 72", "llm_call_process"),
        ("bash -c sleep", None),
    ],
)
def test_processes_are_classified_by_their_command_line(cmdline, kind):
    assert _common.classify_process(cmdline) == kind


# --- pipeline capacity ------------------------------------------------------------------------


def test_the_cpu_clock_counts_only_what_was_used_after_the_mark():
    clock = _common.CpuClock()
    busy_until = time.process_time() + 0.2
    while time.process_time() < busy_until:
        pass
    mark = clock.mark()
    busy_until = time.process_time() + 0.3
    while time.process_time() < busy_until:
        pass
    used = clock.since(mark)["bench_driver"]
    assert 0.25 <= used < 1.0


def test_cpu_per_event_is_milliseconds_by_kind_and_in_total():
    per_event = pipeline_capacity.cpu_per_event({"flink_jvm": 1.5, "redis": 0.5}, 1000)
    assert per_event == {"flink_jvm": 1.5, "redis": 0.5, "total": 2.0}


def test_no_cpu_figures_without_events_counted():
    assert pipeline_capacity.cpu_per_event({"flink_jvm": 1.5}, 0) == {}


def test_the_drain_rate_is_taken_between_10_and_90_percent():
    series = [(0.0, 0), (10.0, 0), (11.0, 100), (12.0, 900), (13.0, 1000)]
    # 10% (100 events) at 11.0 s, 90% (900) at 12.0 s: 800 events in 1 s.
    assert pipeline_capacity.drain_rate(series, 1000) == pytest.approx(800.0)


def test_crossings_are_interpolated_between_polls():
    assert pipeline_capacity.crossing_time([(0.0, 0), (2.0, 100)], 50) == pytest.approx(1.0)
    assert pipeline_capacity.crossing_time([(0.0, 0), (2.0, 10)], 50) is None


def test_a_drain_that_never_finished_has_no_rate():
    assert pipeline_capacity.drain_rate([(0.0, 0), (1.0, 500)], 1000) is None


def test_windowed_rates_are_events_per_second_over_the_window():
    series = [(0.0, 0), (1.0, 100), (2.0, 300), (3.0, 600)]
    assert pipeline_capacity.windowed_rates(series, 2.0)[-1] == (3.0, 250.0)


def _paced(p99: float | None, lag: float | None) -> dict:
    return {"event_to_redis_s": {"p50": 0.4, "p99": p99}, "lag_at_end_s": lag}


def test_a_paced_run_keeps_up_with_p99_within_a_second_and_no_growing_lag():
    assert pipeline_capacity.kept_up(_paced(0.9, 0.2))
    assert not pipeline_capacity.kept_up(_paced(1.4, 0.2))
    assert not pipeline_capacity.kept_up(_paced(0.9, 4.3))
    assert not pipeline_capacity.kept_up(_paced(None, None))


def test_profile_lines_become_self_and_inclusive_shares():
    collapsed = "main (a.py:1);decode (e.py:5) 3\nmain (a.py:1);pickle (p.py:9) 1\n"
    top = {row["function"]: row for row in pipeline_capacity.top_functions(collapsed)}
    assert top["decode (e.py)"]["self_pct"] == 75.0
    assert "main (a.py)" not in top  # never a leaf
    assert pipeline_capacity.top_functions(collapsed, 5)[0]["inclusive_pct"] == 75.0


def test_without_py_spy_the_drain_runs_unprofiled(monkeypatch, tmp_path):
    monkeypatch.setattr(pipeline_capacity.shutil, "which", lambda _name: None)
    monkeypatch.setattr(pipeline_capacity.sys, "executable", str(tmp_path / "python"))
    assert pipeline_capacity.py_spy() is None
    assert pipeline_capacity.start_profiler([1], 5, tmp_path / "out.txt") == []


def test_the_floor_drains_the_drains_events_in_each_shape_and_sets_the_job_beside_it(
    monkeypatch, tmp_path
):
    rates = {"bare": 20_000.0, "state_timer": 16_000.0, "job_decode": 9_000.0, "job_state": 6_000.0}
    drains = []

    def drain(stack, args, memory, out_dir, events=None, extra=None, floor_shape=""):
        drains.append((floor_shape, events, extra))
        return {
            "events": 60_000,
            "events_per_s": rates[floor_shape],
            "peak_2s_events_per_s": None,
            "wall_s_from_submit": 9.0,
            "throughput_series": [],
            "cpu_ms_per_event": {},
        }

    monkeypatch.setattr(pipeline_capacity, "run_drain", drain)
    args = SimpleNamespace(out=tmp_path)
    floor = pipeline_capacity.run_floor(None, args, None, {"events_per_s": 2_400.0})
    assert drains == [
        (shape, None, None) for shape in ("bare", "state_timer", "job_decode", "job_state")
    ]
    assert floor["state_timer"]["events_per_s"] == 16_000.0
    assert floor["job_over_floor"] == 0.15
    assert floor["target_over_floor"] == 0.312


def test_without_a_drain_the_floor_has_no_ratio_to_the_job(monkeypatch, tmp_path):
    monkeypatch.setattr(
        pipeline_capacity,
        "run_drain",
        lambda *a, floor_shape="", **k: {key: 1.0 for key in pipeline_capacity.FLOOR_KEYS},
    )
    floor = pipeline_capacity.run_floor(None, SimpleNamespace(out=tmp_path), None, None)
    assert floor["job_over_floor"] is None


# --- redis upsert -------------------------------------------------------------------------------


def test_the_plain_hset_writes_the_same_fields_as_the_upsert():
    record = redis_upsert.make_records(1, 1)[0]
    mapping = redis_upsert.hset_mapping(record, 1000)
    assert set(mapping) == {
        "version_ts",
        "version_seq",
        "written_at_ms",
        *redis_upsert.RECORD_FIELDS,
    }


def test_benchmark_records_are_newer_per_shopper_so_every_upsert_writes():
    records = redis_upsert.make_records(10, 3)
    for shopper in {r.shopper_id for r in records}:
        versions = [r.version for r in records if r.shopper_id == shopper]
        assert versions == sorted(set(versions))


def test_redis_benchmark_csv_gives_the_last_rows_requests_per_second():
    text = '"test","rps","avg_latency_ms"\n"HSET k a 1","363636.38","2.076"\n'
    assert redis_upsert.parse_redis_benchmark_csv(text) == pytest.approx(363636.38)
    assert redis_upsert.parse_redis_benchmark_csv("") is None


# --- freshness: the baseline and staleness ------------------------------------------------------


def _event(
    i: int, shopper: str, kind: str = "view", product: str = "p1", category: str = "Kettles"
) -> ShopperEvent:
    return ShopperEvent(
        f"e{i}", shopper, kind, 1_000_000 + i * 1000, product_id=product, category=category
    )


def test_browsing_a_category_already_browsed_is_not_qualifying():
    config = AppConfig()
    events = [
        _event(0, "s"),
        _event(1, "s", product="p2"),
        _event(2, "s", product="p3", category="Grinders"),
    ]
    rows = freshness.shopper_timelines(events, config.session, config.trigger)["s"]
    assert [q for _e, _a, q, _s in rows] == [True, False, True]


def test_the_policy_delay_is_to_the_first_prompt_at_or_after_the_event():
    delays = freshness.policy_delays_s({"s": [1_000, 5_000], "t": [2_000]}, {"s": [4_000]})
    assert delays == [3.0, float("inf"), float("inf")]


def test_the_policy_replay_counts_one_prompt_for_a_burst_within_the_quiet_period():
    from flink_jobs.core.prompting import PromptRenderer

    config = AppConfig().with_overrides({"trigger": {"quiet_s": 3, "max_wait_s": 5}})
    events = [_event(0, "s"), _event(1, "s", category="Grinders"), _event(2, "s", product="p2")]
    replay = freshness.policy_replay(events, config, PromptRenderer(config.prompt).render)
    assert replay == {
        "accepted_events": 3,
        "qualifying_events": 2,
        "prompts": 1,
        "prompts_per_event": 0.333,
        "delay_to_prompt_max_s": 5.0,
    }


def test_the_policy_is_replayed_over_each_further_sample_seed():
    from flink_jobs.core.prompting import PromptRenderer

    config = AppConfig()
    render = PromptRenderer(config.prompt).render
    rows = freshness.policy_across_samples([3, 4], 5, 120.0, config, render)
    assert [r["seed"] for r in rows] == [3, 4]
    for row in rows:
        assert 0 < row["prompts"] <= row["qualifying_events"] <= row["accepted_events"]
        assert row["delay_to_prompt_max_s"] <= config.trigger.max_wait_s


def test_policy_only_replays_each_timing_over_the_seeds_and_a_long_sample(monkeypatch):
    monkeypatch.setattr(freshness, "LONG_SAMPLE", (6, 300.0))
    workload = ["--shoppers", "4", "--duration-s", "90", "--policy-seeds", "3"]
    timings = ["--policy-timing", "3,5,2", "--policy-timing", "0.5,2,1"]
    args = freshness.build_parser().parse_args(["--policy-only", *workload, *timings])

    doc = freshness.policy_timings(args)

    assert doc["workload"]["seeds"] == [7, 3]
    assert [row["trigger"]["quiet_s"] for row in doc["timings"]] == [3.0, 0.5]
    for row in doc["timings"]:
        assert [r["seed"] for r in row["samples"]] == [7, 3]
        assert row["long_sample"]["shoppers"] == 6
        assert (
            row["delay_to_prompt_max_s"]
            <= row["trigger"]["max_wait_s"] + (row["trigger"]["min_interval_s"])
        )
    assert "0.5 /  2.0 /  1.0" in freshness.policy_table(doc)


def test_the_baseline_has_one_prompt_per_accepted_event():
    config = AppConfig()
    events = [_event(0, "a"), _event(1, "b"), _event(1, "b")]  # the last one a duplicate
    timelines = freshness.shopper_timelines(events, config.session, config.trigger)
    from flink_jobs.core.prompting import PromptRenderer

    prompts = freshness.baseline_prompts(timelines, PromptRenderer(config.prompt))
    assert [shopper for shopper, _ in prompts] == ["a", "b"]


def test_the_baseline_prompt_is_the_session_as_of_that_event():
    config = AppConfig()
    events = [_event(0, "a"), _event(1, "a", product="p2")]
    timelines = freshness.shopper_timelines(events, config.session, config.trigger)
    from flink_jobs.core.prompting import PromptRenderer

    prompts = freshness.baseline_prompts(timelines, PromptRenderer(config.prompt))
    assert [p.events_included for _, p in prompts] == [1, 2]


def test_staleness_is_zero_when_the_intent_covers_the_latest_qualifying_event():
    assert freshness.staleness_s(5_000, 5_000, 9_000) == 0.0


def test_staleness_counts_from_the_uncovered_event():
    assert freshness.staleness_s(5_000, 4_000, 9_000) == 4.0
    assert freshness.staleness_s(5_000, None, 6_500) == 1.5


def test_no_qualifying_event_yet_has_no_staleness():
    assert freshness.staleness_s(None, None, 9_000) is None


def test_latest_before_is_the_last_time_not_after_now():
    assert freshness.latest_before([1, 5, 9], 6) == 5
    assert freshness.latest_before([7], 6) is None


def test_time_outside_the_call_ranks_prompts_by_it_and_shows_their_queueing():
    outside = freshness.outside_call([6_000, 9_000, 4_500], [5_000, 4_800, 4_000], [0, 3_100, 0])
    assert outside["aligned"] and outside["median_s"] == 1.0
    assert outside["slowest"][0] == {"outside_s": 4.2, "queued_s": 3.1}
    assert [r["outside_s"] for r in outside["slowest"]] == [4.2, 1.0, 0.5]


def test_time_outside_the_call_is_not_paired_when_the_samples_differ_in_number():
    assert freshness.outside_call([6_000, 9_000], [5_000], [0, 0]) == {"aligned": False}


# --- the runner --------------------------------------------------------------------------------


def test_the_runner_selects_benchmarks_by_name_in_suite_order():
    assert run_all.selected("pipeline_capacity,redis_upsert") == [
        "redis_upsert",
        "pipeline_capacity",
    ]


def test_the_runner_refuses_an_unknown_benchmark():
    with pytest.raises(SystemExit):
        run_all.selected("nope")


def test_ab_settings_become_config_override_groups():
    assert pipeline_capacity.settings(["job.python_bundle_size=5000", "trigger.quiet_s=1"]) == {
        "job": {"python_bundle_size": "5000"},
        "trigger": {"quiet_s": "1"},
    }


def test_a_setting_without_a_group_is_refused():
    with pytest.raises(ValueError, match=r"GROUP\.KEY=VALUE"):
        pipeline_capacity.settings(["quiet_s=1"])


def test_the_scale_out_benchmarks_core_bound_rate_is_cores_over_cpu_per_event():
    from bench.scale_out import core_bound

    assert core_bound(0.5, 2) == 4000.0
    assert core_bound(None, 2) is None


def test_the_scale_out_drain_window_runs_from_a_tenth_of_the_events_done_to_the_last_poll():
    from bench.scale_out import drain_window_s

    counts = [(0.0, 0), (1.0, 50), (2.0, 120), (5.0, 1000)]
    assert drain_window_s(counts, 1000) == 3.0


def test_idle_cores_over_the_drain_window_come_off_each_parts_cpu_per_event():
    from bench.scale_out import net_of_idle

    per_event = {"taskmanager": 1.0, "tansu": 0.1, "total": 1.1}
    # 0.5 of a core idling for 10 s is 5 CPU seconds: 0.5 ms over 10,000 events.
    net = net_of_idle(per_event, {"taskmanager": 0.5}, 10.0, 10_000)
    assert net == {"taskmanager": 0.5, "tansu": 0.1, "total": 0.6}


def test_no_events_counted_gives_no_net_figure():
    from bench.scale_out import net_of_idle

    assert net_of_idle({"total": 1.0}, {"taskmanager": 0.5}, 10.0, 0) == {}


def test_the_scale_out_targets_judge_the_second_taskmanagers_cpu_and_its_share_of_the_cores():
    from bench.scale_out import shape_targets

    def shape(rate: float, cpu_ms: float, core_bound: float) -> dict:
        return {
            "events_per_s": rate,
            "cpu_ms_per_event": {"total": cpu_ms},
            "core_bound_events_per_s": core_bound,
        }

    one = shape(2728.0, 0.670, 2985.0)
    met = {t["name"]: t["met"] for t in shape_targets(one, shape(3059.0, 0.713, 2805.0), one)}
    assert met["2 TaskManagers over 1, CPU ms per event of the whole stack"]
    assert met["2 TaskManagers, drain events/s over the core-bound rate"]
    costly = shape_targets(one, shape(2000.0, 0.80, 2500.0), one)
    assert [t["met"] for t in costly[:3]] == [False, False, False]


def test_the_scale_out_targets_are_judged_on_each_shapes_mean_over_its_rounds():
    from bench.scale_out import shape_mean

    def drained(shape: str, rate: float, cpu_ms: float) -> dict:
        return {
            "shape": shape,
            "events_per_s": rate,
            "cpu_ms_per_event": {"total": cpu_ms},
            "core_bound_events_per_s": 2000 / cpu_ms,
        }

    results = [drained("one", 2728.0, 0.670), drained("two", 3059.0, 0.713)]
    results += [drained("one", 3366.0, 0.555), drained("two", 2864.0, 0.736)]
    one = shape_mean(results, "one")
    assert one["rounds"] == 2
    assert one["events_per_s"] == 3047.0
    assert one["cpu_ms_per_event"] == {"total": 0.613}
