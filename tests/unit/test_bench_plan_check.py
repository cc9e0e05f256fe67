"""bench/plan_check.py's comparison, and the pieces it reads a run's steady window with."""

from __future__ import annotations

import pytest

from bench import pipeline_capacity, plan_check, router_load
from bench.pipeline_capacity import (
    STARTUP_LEAD_S,
    PacedWorkload,
    Snapshot,
    SteadyWindow,
    command_calls,
    window_figures,
)
from flink_jobs.config import AppConfig
from flink_jobs.tools.sizing.trigger_rate import decode_records
from tests.support.builders import HEADPHONES, T0, raw_event, unit_costs


def test_a_measurement_within_a_quarter_of_the_prediction_meets_its_target():
    targets = plan_check.compare({"job_cores": 1.0}, {"job_cores": 1.2})
    assert targets[0]["met"] is True
    assert targets[0]["value"] == pytest.approx(0.2)


def test_a_measurement_more_than_a_quarter_off_misses_its_target():
    assert plan_check.compare({"job_cores": 1.0}, {"job_cores": 0.7})[0]["met"] is False


def test_a_figure_not_measured_misses_its_target():
    targets = plan_check.compare({"job_cores": 1.0, "redis_upserts_per_s": 100.0}, {})
    assert [t["met"] for t in targets] == [False, False]


def test_both_the_jobs_cpu_and_redis_writes_are_judged():
    names = [t["name"] for t in plan_check.compare({}, {})]
    assert len(names) == 2
    assert names[0].startswith("job CPU cores") and names[1].startswith("Redis upserts/s")


def test_the_jobs_cores_are_its_jvm_and_call_process_not_the_rest_of_the_stack():
    steady = {
        "cpu_cores": {"flink_jvm": 0.5, "llm_call_process": 0.2, "redis": 0.1, "tansu": 0.3},
        "redis_commands_per_s": {"evalsha": 300.0, "hincrby": 9.0},
    }
    measured = plan_check.measured(steady)
    assert measured["job_cores"] == pytest.approx(0.7)
    assert measured["redis_upserts_per_s"] == 300.0


def test_the_default_rate_is_a_share_of_the_paced_rate_that_kept_up():
    kept_up = {"rate_offered": 1000, "event_to_redis_s": {"p99": 0.5}, "lag_at_end_s": 1.0}
    assert plan_check.default_rate({"phases": {"paced": kept_up}}) == 800


def test_no_default_rate_comes_from_a_paced_run_that_fell_behind():
    behind = {"rate_offered": 1000, "event_to_redis_s": {"p99": 9.0}, "lag_at_end_s": 30.0}
    assert plan_check.default_rate({"phases": {"paced": behind}}) is None
    assert plan_check.default_rate(None) is None


def test_redis_command_counts_are_read_from_either_form_of_commandstats():
    parsed = {"cmdstat_evalsha": {"calls": 7, "usec": 70}, "errorstat_ERR": {"count": 1}}
    raw = {"cmdstat_hset": "calls=3,usec=9,usec_per_call=3.00"}
    assert command_calls(parsed) == {"evalsha": 7}
    assert command_calls(raw) == {"hset": 3}


def test_a_window_gives_rates_per_second_and_cores_per_part_of_the_stack():
    start = Snapshot(10.0, {"events_accepted": 100, "llm_calls": 20}, {"evalsha": 50})
    end = Snapshot(30.0, {"events_accepted": 2100, "llm_calls": 520}, {"evalsha": 1050})
    figures = window_figures(start, end, {"flink_jvm": 10.0})
    assert figures["events_per_s"] == 100.0
    assert figures["llm_calls_per_event"] == 0.25
    assert figures["cpu_cores"] == {"flink_jvm": 0.5}
    assert figures["redis_commands_per_s"] == {"evalsha": 50.0}


def test_the_routers_cost_per_request_is_its_cpu_over_the_requests_answered():
    figures = router_load.throughput_figures(requests=2000, wall_s=10.0, router_cpu_s=1.0)
    assert figures["cpu_ms_per_request"] == 0.5
    assert figures["requests_per_s_per_core"] == 2000


class _Clock:
    """A CpuClock whose processes used ``per_call`` CPU seconds between each reading."""

    def __init__(self, per_call: float) -> None:
        self.used = 0.0
        self.per_call = per_call

    def mark(self):
        self.used += self.per_call
        return {1: ("flink_jvm", self.used)}

    def since(self, mark):
        self.used += self.per_call
        return {"flink_jvm": self.used - mark[1][1]}


class _Redis:
    def __init__(self) -> None:
        self.evalsha = 0

    def info(self, section):
        assert section == "commandstats"
        self.evalsha += 100
        return {"cmdstat_evalsha": {"calls": self.evalsha}}


def test_the_steady_window_runs_from_the_warm_up_end_to_the_producers_end():
    window = SteadyWindow(_Clock(per_call=2.0), _Redis())
    polls = [
        (0.0, 0, False, True),  # warming up
        (5.0, 500, True, True),  # warm: the window opens
        (10.0, 1000, True, True),
        (15.0, 1500, True, False),  # the producer is done: the window closes
        (20.0, 1600, True, False),
    ]
    for t, events, warm, producing in polls:
        window.observe(t, {"events_accepted": events}, warm, producing)
    figures = window.figures()
    assert figures["window_s"] == 10.0
    assert figures["events"] == 1000
    assert figures["cpu_cores"] == {"flink_jvm": 0.2}
    assert figures["redis_commands_per_s"] == {"evalsha": 10.0}


def test_a_window_that_never_closed_gives_no_figures():
    window = SteadyWindow(_Clock(per_call=1.0), _Redis())
    window.observe(1.0, {}, True, True)
    assert window.figures() == {}


def test_a_prediction_at_the_measured_trigger_rate_takes_the_windows_calls_and_prompts():
    steady = {"llm_calls_per_event": 0.5, "prompts_per_event": 0.5, "events": 9}
    drain = plan_check.predicted(unit_costs(), 1000)
    window = plan_check.predicted(unit_costs(), 1000, plan_check.measured_trigger_rate(steady))
    assert (drain["llm_calls_per_s"], window["llm_calls_per_s"]) == (250, 500)
    assert window["redis_upserts_per_s"] == 1000


def workload(records: list[bytes], warmup: int, rate: float = 10.0, startup=()):
    return PacedWorkload(list(records), warmup, shoppers=3, rate=rate, startup=list(startup))


def test_the_paced_records_are_stamped_with_their_send_times_the_start_up_before():
    stream = [raw_event("a", 0.0, "view", product=HEADPHONES) for _ in range(3)]
    paced = workload(stream, warmup=1, startup=[raw_event("s", 0.0, "search", query="tea")])
    times = [e.event_time_ms for e in decode_records(paced.as_sent(T0))]
    assert times == [T0 - int(STARTUP_LEAD_S * 1000), T0, T0 + 100, T0 + 200]
    assert paced.measured_from == 2


def test_the_paced_workload_is_the_runs_records_warm_up_first():
    args = pipeline_capacity.parse_args(
        ["--paced-rate", "10", "--paced-warmup-s", "1", "--paced-s", "2"]
    )
    paced = pipeline_capacity.paced_workload(args)
    assert (len(paced.records), paced.warmup, paced.rate) == (30, 10, 10.0)
    assert paced.records == pipeline_capacity.make_events(paced.shoppers, 3600.0, 11, 30)


def test_the_workloads_trigger_rate_counts_what_the_job_does_while_the_window_is_open():
    stream = [raw_event(s, 0.0, "view", product=HEADPHONES) for s in "abcde"]
    replay = plan_check.workload_trigger_rate(workload(stream, warmup=3, rate=1.0), AppConfig(), T0)
    # The job counts an event, and fires its prompt, once its watermark passes the end of
    # the event's quiet period: with one record a second, two records after it came. So
    # the window from the fourth record to the last counts the second and third shoppers'
    # events and prompts, and leaves the last two shoppers' for after it closed.
    quiet_ms = int(AppConfig().trigger.quiet_s * 1000)
    assert (replay.counted_records, replay.accepted_events, replay.prompts) == (2, 2, 2)
    assert replay.fires == {"b": (T0 + 1000 + quiet_ms,), "c": (T0 + 2000 + quiet_ms,)}


def test_the_workloads_trigger_rate_is_recorded_with_its_counts_and_trigger_settings():
    stream = [raw_event(s, 0.0, "view", product=HEADPHONES) for s in "abc"]
    replay = plan_check.workload_trigger_rate(workload(stream, warmup=0, rate=1.0), AppConfig(), T0)
    figures = plan_check.workload_figures(replay)
    assert (figures["records"], figures["accepted_events"], figures["prompts"]) == (3, 1, 1)
    assert figures["prompts_per_event"] == figures["llm_calls_per_event"] == 1.0
    assert figures["trigger"]["quiet_s"] == AppConfig().trigger.quiet_s
