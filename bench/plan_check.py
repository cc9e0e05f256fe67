"""``shopper-intents plan`` against this machine: the job's CPU and Redis writes, predicted
and measured at one rate.

The job runs as deployed (its default trigger policy and out-of-orderness) on a local
PyFlink mini-cluster against the embedded broker and a redis-server, with the LLM
replaced by the stand-in that answers at once, fed at a fixed rate by
``bench.pipeline_capacity``'s paced runner (``run_paced``: a warm-up that is not
measured, then ``--seconds`` measured). The rate defaults to 0.8 times the paced rate the
capacity benchmark found sustained on this machine (``phases.paced.rate_offered`` in
``pipeline_capacity.json``), so the job keeps up and its CPU is what the rate costs, not
what the machine has.

Between the warm-up's end and the producer's last event it reads the CPU cores the job's
processes used (the Flink JVM with its embedded interpreter, the LLM call process) and
Redis's ``EVALSHA`` calls per second (the intent upserts, plus the job's stats flushes,
about one a second per operator), and the plan's prediction for the events per second
measured in that window, from the unit costs in the results folder and the defaults of
``shopper-intents plan`` (``flink_jobs/tools/sizing/``), at the trigger rate of the run's
own events: computed offline before the run, from the records the run sends, by the job's
session and trigger code (:func:`workload_trigger_rate`), as ``plan --events-file`` does.
Targets: each within 25 % of that prediction, and the job kept up. The predictions at the
capacity drain's trigger rate (the plan's default) and at the window's measured one are
recorded beside it: the first shows what a rate from other traffic costs the plan, the
second (an outcome, not an input) separates a trigger rate off from a cost per event or
call. The GPU count is not checked (no GPU here, and the stand-in computes nothing), nor
the router (the job calls the stand-in directly).

``python -m bench.plan_check [--rate N] [--seconds S]``; writes
``bench/results/plan_check.json``. CPU-bound for two to three minutes: run it under the
heavy lock (``bench.run_all`` does).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import pipeline_capacity
from bench._common import (
    REPO,
    RESULTS_DIR,
    PeakMemory,
    result_doc,
    rounded,
    target,
    write_result,
)
from bench.report import load_results
from flink_jobs.config import AppConfig, load_config
from flink_jobs.tools.local_services import stop_on_sigterm
from flink_jobs.tools.sizing.costs import (
    CALL_PROCESS_KIND,
    JVM_KINDS,
    MEASURED,
    TRIGGER_RATE,
    ConfigDefaults,
    Figure,
    UnitCosts,
    read_unit_costs,
)
from flink_jobs.tools.sizing.model import FLINK, PlanInputs, plan
from flink_jobs.tools.sizing.trigger_rate import (
    TriggerReplay,
    decode_records,
    rate_figures,
    replay_trigger,
)

BENCHMARK = "plan_check"
TOLERANCE = 0.25
#: The share of the capacity benchmark's sustained paced rate the check runs at.
RATE_FRACTION = 0.8
#: What is compared, and how the targets name it.
CHECKED = {
    "job_cores": "job CPU cores (Flink JVM + LLM call process)",
    "redis_upserts_per_s": "Redis upserts/s (EVALSHA calls)",
}


# --- pure pieces -------------------------------------------------------------------------------


def default_rate(capacity: Mapping[str, Any] | None) -> float | None:
    """``RATE_FRACTION`` of the capacity benchmark's sustained paced rate, when its paced
    run kept up; None when there is none."""
    paced = ((capacity or {}).get("phases") or {}).get("paced")
    if not isinstance(paced, Mapping) or not paced.get("rate_offered"):
        return None
    if not isinstance(paced.get("event_to_redis_s"), Mapping):
        return None
    if not pipeline_capacity.kept_up(dict(paced)):
        return None
    return round(RATE_FRACTION * float(paced["rate_offered"]))


def predicted(
    costs: UnitCosts, events_per_s: float, trigger_rate: Mapping[str, Figure] | None = None
) -> dict[str, float | None]:
    """The plan's job cores (the Managed Flink tier's work, before the utilisation),
    Redis upserts/s and LLM calls/s at ``events_per_s``; with ``trigger_rate`` (figures
    ``llm_calls_per_event`` and ``prompts_per_event``) in place of the unit costs'."""
    for name, figure in (trigger_rate or {}).items():
        if name in TRIGGER_RATE:
            costs = costs.with_figure(name, figure)
    p = plan(PlanInputs(events_per_s), costs)
    return {
        "job_cores": rounded(p.resource(FLINK).work),
        "redis_upserts_per_s": rounded(p.rates.get("redis_upserts"), 1),
        "llm_calls_per_s": rounded(p.rates.get("llm_calls"), 1),
    }


def measured_trigger_rate(steady: Mapping[str, Any]) -> dict[str, Figure]:
    """The trigger rate a paced run's steady window measured, as the plan's figures."""
    return {
        name: Figure(float(steady[name]), "plan_check", f"steady.{name}", MEASURED)
        for name in TRIGGER_RATE
        if isinstance(steady.get(name), int | float)
    }


def workload_trigger_rate(
    workload: pipeline_capacity.PacedWorkload, config: AppConfig, start_ms: int
) -> TriggerReplay:
    """The trigger rate of the records a paced run sends, replayed offline through the
    job's session and trigger code under ``config`` (its trigger, session and watermark
    settings), counted over the window the run measures.

    The records are exactly those the run sends (``workload.as_sent``: the start-up's,
    then the stream's, stamped with their send times at the paced rate as the replay tool
    stamps them, the stream from ``start_ms``: only the spacing matters, not the start).
    The steady window opens at the first poll after the producer has sent the warm-up's
    records and closes at the first poll after it sent its last; the job counts events and
    prompts when its watermark passes them, which trails the send time by about the same
    at both ends. So every record is replayed (the sessions and pending timers the warm-up
    leaves carry into the window), and what happens from the first measured record's
    arrival to the last record's is counted: not the warm-up's opening burst of new
    shoppers, each of whose first event prompts, and not the prompts that fire once the
    stream stops, after the window has closed (``settle=False``).
    """
    records = decode_records(workload.as_sent(start_ms), config.job.max_event_bytes)
    return replay_trigger(records, config, measured_from=workload.measured_from, settle=False)


def workload_figures(replay: TriggerReplay) -> dict[str, Any]:
    """What the offline replay of the run's events counted, for the result document."""
    return {
        "records": replay.records,
        "counted_records": replay.counted_records,
        "accepted_events": replay.accepted_events,
        "prompts": replay.prompts,
        "prompts_per_event": rounded(replay.prompts_per_event, 4),
        "llm_calls_per_event": rounded(replay.llm_calls_per_event, 4),
        "trigger": dict(replay.trigger),
        "out_of_orderness_s": replay.out_of_orderness_s,
    }


def measured(steady: Mapping[str, Any]) -> dict[str, float | None]:
    """The same figures from a paced run's steady window (``window_figures``)."""
    cores = steady.get("cpu_cores") or {}
    commands = steady.get("redis_commands_per_s") or {}
    job = [cores[kind] for kind in (*JVM_KINDS, CALL_PROCESS_KIND) if kind in cores]
    return {
        "job_cores": rounded(sum(job)) if job else None,
        "redis_upserts_per_s": rounded(commands.get("evalsha", 0.0) + commands.get("eval", 0.0), 1)
        if commands
        else None,
        "llm_calls_per_s": steady.get("llm_calls_per_s"),
    }


def relative_error(predicted_value: float | None, measured_value: float | None) -> float | None:
    """``|measured - predicted| / predicted``; None when either is missing or the
    prediction is not positive."""
    if predicted_value is None or measured_value is None or predicted_value <= 0:
        return None
    return abs(measured_value - predicted_value) / predicted_value


def compare(
    prediction: Mapping[str, float | None],
    measurement: Mapping[str, float | None],
    tolerance: float = TOLERANCE,
) -> list[dict[str, Any]]:
    """One target per checked figure: the measured within ``tolerance`` of the predicted."""
    return [
        target(
            f"{label}: |measured - predicted| / predicted",
            relative_error(prediction.get(name), measurement.get(name)),
            "<=",
            tolerance,
            f"predicted {prediction.get(name)}, measured {measurement.get(name)}",
        )
        for name, label in CHECKED.items()
    ]


# --- the run -----------------------------------------------------------------------------------


CITED = (
    "jvm_cpu_ms_per_event",
    "call_process_cpu_ms_per_call",
    "llm_calls_per_event",
    "prompts_per_event",
    "rules_writes_per_prompt",
)


def _label(path: Path) -> str:
    """``path`` as the plan cites it: relative to the checkout when inside it."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def run(args) -> dict[str, Any]:
    started = time.monotonic()
    results = load_results(args.results)
    rate = args.rate or default_rate(results.get("pipeline_capacity"))
    if not rate:
        raise SystemExit(
            f"no sustained paced rate in {args.results}/pipeline_capacity.json"
            " (run python -m bench.pipeline_capacity first) and no --rate"
        )
    costs = read_unit_costs(results, ConfigDefaults.from_code(), where=_label(args.results))
    paced_args = paced_arguments(rate, args)
    # The job's configuration as run_paced loads it, but for the stack's addresses.
    config = load_config()
    workload = pipeline_capacity.paced_workload(paced_args)
    offline = workload_trigger_rate(workload, config, int(time.time() * 1000))
    workload_rate = rate_figures(offline, "plan_check: the paced run's events, offline")
    print(
        f"the run's events, replayed offline: {offline.prompts_per_event or 0:.4f} prompts"
        f" per accepted event in the measured window"
    )
    memory = PeakMemory()
    stack = pipeline_capacity.Stack(Path(tempfile.mkdtemp(prefix="si-bench-plan-check-")))
    try:
        paced = pipeline_capacity.run_paced(
            stack, paced_args, memory, latency_settings=False, workload=workload
        )
    finally:
        stack.close()
    memory.sample()
    steady = paced.get("steady") or {}
    rate_measured = steady.get("events_per_s")
    at_drain = predicted(costs, rate_measured) if rate_measured else {}
    prediction = predicted(costs, rate_measured, workload_rate) if rate_measured else {}
    measurement = measured(steady)
    at_measured = (
        predicted(costs, rate_measured, measured_trigger_rate(steady)) if rate_measured else {}
    )
    targets = [
        *compare(prediction, measurement),
        target(
            "the job kept up at the rate (lag when the producer finished, s)",
            paced.get("lag_at_end_s"),
            "<=",
            pipeline_capacity.MAX_LAG_S,
            f"offered {rate} events/s",
        ),
    ]
    return result_doc(
        BENCHMARK,
        started,
        targets,
        [
            "The GPU count is not checked: no GPU here, and the LLM is a stand-in that answers"
            " at once (bench/standin_llm.py). Nor is the router: the job calls the stand-in"
            " directly.",
            "Predicted at the events/s measured in the window, from the unit costs in the"
            " results folder and the plan's defaults, at the trigger rate of the run's own"
            " events ('workload_trigger_rate': the records the run sends, replayed offline"
            " before it through the job's session and trigger code, counted over the"
            " measured window). 'predicted_at_drain_trigger_rate' takes the capacity drain's"
            " instead (the plan's default: the paced replay stamps events with their send"
            " time, so a shopper's events come closer together than in the drain);"
            " 'predicted_at_measured_trigger_rate' the window's measured one, an outcome, to"
            " tell a different trigger rate from a different cost per event or call.",
            "EVALSHA calls include the job's stats flushes (about one a second per operator).",
            "The job runs with its default trigger policy; producer, broker, Redis, the"
            " stand-in and Flink share the machine's cores.",
            *costs.caveats,
        ],
        rate_offered=rate,
        predicted=prediction,
        predicted_at_drain_trigger_rate=at_drain,
        predicted_at_measured_trigger_rate=at_measured,
        measured=measurement,
        workload_trigger_rate=workload_figures(offline),
        steady=steady,
        paced={
            k: paced.get(k)
            for k in ("events", "rate_offered", "rate_produced", "lag_at_end_s", "settled")
        },
        unit_costs={
            name: {"value": rounded(figure.value, 4), "source": figure.cite()}
            for name in CITED
            if (figure := workload_rate.get(name) or getattr(costs, name)) is not None
        },
        drain_trigger_rate={
            name: {"value": rounded(figure.value, 4), "source": figure.cite()}
            for name in TRIGGER_RATE
            if (figure := getattr(costs, name)) is not None
        },
        memory_peak=memory.summary(),
    )


def paced_arguments(rate: float, args: argparse.Namespace) -> argparse.Namespace:
    """``bench.pipeline_capacity``'s arguments for its paced phase alone at ``rate``."""
    parsed: argparse.Namespace = pipeline_capacity.parse_args(
        [
            *("--phases", "paced", "--paced-rate", str(rate)),
            *("--paced-s", str(args.seconds), "--paced-warmup-s", str(args.warmup_s)),
            *("--timeout-s", str(args.timeout_s)),
        ]
    )
    return parsed


def parse_args(argv: Sequence[str] | None):
    p = argparse.ArgumentParser(
        prog="python -m bench.plan_check", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help=f"events/s (default: {RATE_FRACTION} x the sustained paced rate in"
        " pipeline_capacity.json)",
    )
    p.add_argument("--seconds", type=float, default=40.0, help="measured, after the warm-up")
    p.add_argument("--warmup-s", type=float, default=10.0, help="sent first, not measured")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the results go")
    p.add_argument(
        "--results", type=Path, default=None, help="the unit costs' results (default: --out)"
    )
    args = p.parse_args(argv)
    args.results = args.results or args.out
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()
    doc = run(args)
    for t in doc["targets"]:
        print(
            f"{t['name']}: {t['value']} {t['op']} {t['limit']}: {'met' if t['met'] else 'NOT met'}"
        )
    print(f"written {write_result(doc, args.out)}")
    return 0 if doc["all_targets_met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
