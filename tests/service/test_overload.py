"""A burst at three times the sustainable rate or more, on the real broker, Redis and
PyFlink, with LLM stand-ins (``bench/standin_llm.py``) behind the real router answering in
``STANDIN_LATENCY_S``: the subject is the job's back-pressure, not the model.

The sustainable rate is measured first: eight of the job's own prompts sent at once
through the job's LLM client (as many as the job's calls in flight, ``llm.max_concurrency``),
a second time on warm connections, give the tier's calls per second at the stand-ins'
latency, and the trigger policy sends about 0.27 prompts per event. The sample's records
are then replayed in event-time order at rates relative to it, event time rebased to send
time: a minute at a fifth of the sustainable rate (the job's start-up included), a 20 s
burst at three times it, then two minutes at a fifth again, in which the backlog must
drain. Throughout, the test polls the stats hash, every intent in Redis, the events the
job has read and the resident memory of the job's processes (driver, Flink JVM, Python
workers). The figures, with the rate the LLM tier actually sustained while it drained the
backlog, go to ``<cache>/reports/overload.json``.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from dataclasses import dataclass, field, replace

import orjson
import psutil
import pytest
import redis

from flink_jobs.config import LlmConfig, load_config
from flink_jobs.core.events import DeadLetter, decode_event
from flink_jobs.core.prompting import PromptRenderer
from flink_jobs.core.session import SessionState, apply_event, new_session_state
from flink_jobs.runtime.llm_client import LlmClient
from flink_jobs.tools.local_services import cache_dir, create_topics
from flink_jobs.tools.replay import replay_records
from flink_jobs.tools.run_summary import (
    is_settled,
    percentile,
    prompts_settled,
    read_intents,
    read_samples,
    read_stats,
)
from flink_jobs.tools.sample_data import Sample, SampleConfig, generate_sample
from tests.support.job_process import JobProcess, job_groups
from tests.support.waiting import until

# (name, seconds, events per second as a multiple of the sustainable rate)
PHASES = (("steady", 60.0, 0.2), ("burst", 20.0, 3.0), ("recovery", 120.0, 0.2))
AFTER_BURST_S = 30.0
"""The burst's intents are those written in the burst and this long after it."""
TAIL_S = 30.0
"""Freshness must be back to its steady level in the recovery phase's last TAIL_S."""
STANDIN_LATENCY_S = 2.0
"""Each answer's latency: the job's 8 calls in flight then sustain 4 calls/s, about 15
events/s, well below what the job reads and renders on two cores."""
PROMPTS_PER_EVENT = 0.27  # the trigger policy on this sample (measured: 0.23-0.32)
CALIBRATION_CALLS = LlmConfig().max_concurrency  # the job's calls in flight
SHOPPERS = 80
"""Shoppers of the calibration sample; the replayed one has as many as the rate needs."""
LLM_CAPACITY = 16
SETTLE_TIMEOUT_S = 180


@dataclass
class Probe:
    """What the test saw, sampled every half second from outside the job."""

    client: redis.Redis
    prefix: str
    root_pid: int
    started: float = field(default_factory=time.monotonic)
    rss_mb: list[tuple[float, float]] = field(default_factory=list)
    in_flight: list[tuple[float, int]] = field(default_factory=list)
    events_in: list[tuple[float, int]] = field(default_factory=list)
    llm_calls: list[tuple[float, int]] = field(default_factory=list)
    # (seconds since start when seen, event-to-intent latency ms) per new intent version
    writes: list[tuple[float, int]] = field(default_factory=list)
    _versions: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            now = time.monotonic() - self.started
            self.rss_mb.append((now, _tree_rss_mb(self.root_pid)))
            stats = read_stats(self.client, self.prefix)
            self.in_flight.append((now, stats.get("prompts_sent", 0) - prompts_settled(stats)))
            self.events_in.append((now, stats.get("events_in", 0)))
            self.llm_calls.append((now, stats.get("llm_calls", 0)))
            for row in read_intents(self.client, self.prefix):
                if self._versions.get(row.shopper_id) != row.written_at_ms:
                    self._versions[row.shopper_id] = row.written_at_ms
                    self.writes.append((now, row.latency_ms))


def _tree_rss_mb(pid: int) -> float:
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total / 2**20


@dataclass
class OverloadRun:
    stats: dict[str, int]
    probe: Probe
    phase_ends: dict[str, float]
    produced: dict[str, int]
    settled_at: float
    # The outbox's queued + running prompts, sampled at each prompt sent.
    queued_or_running: list[int]
    sustainable_events_per_s: float


def _sustainable_events_per_s(standin_tier, records: list[bytes]) -> float:
    """An upper bound of the event rate the job keeps up with, from the LLM tier's measured
    throughput, so the phases' rates follow the tier as configured (and the host's speed)
    instead of fixed numbers.

    Measured with the job's own requests: the sample's first shoppers' sessions rendered
    by the job's renderer, sent at once through the job's LLM client (as many as the job
    has in flight), twice; the second round, on warm connections and without the job
    sharing the cores, is timed: the burst is then at least three times what the job
    sustains."""
    config = load_config(overrides={"llm": standin_tier.job_settings()}, environ={})
    states: dict[str, SessionState] = {}
    for raw in records:
        event = decode_event(raw, None, 2**62, config.job.max_event_bytes)
        if isinstance(event, DeadLetter):
            continue
        state = states.get(event.shopper_id) or new_session_state(event.shopper_id)
        states[event.shopper_id] = apply_event(
            state, event, config.session, config.trigger.high_signal_types
        )[0]
    renderer = PromptRenderer(config.prompt)
    prompts = [(s, renderer.render(state)) for s, state in list(states.items())]
    prompts = prompts[:CALIBRATION_CALLS]

    async def call_all() -> float:
        client = LlmClient(replace(config.llm, max_concurrency=CALIBRATION_CALLS))
        try:
            for _ in range(2):
                started = time.monotonic()
                await asyncio.gather(*(client.complete(p, f"calibration-{s}") for s, p in prompts))
            return time.monotonic() - started
        finally:
            await client.aclose()

    calls_per_s = len(prompts) / asyncio.run(call_all())
    return calls_per_s / PROMPTS_PER_EVENT


def _sample_for(sustainable: float, calibration: Sample) -> Sample:
    """A sample with enough records for every phase at this host's rate: the same seed
    and span, more shoppers as the tier is faster (a fixed sample ran out on a host
    with twice the speed)."""
    needed = sum(round(span_s * share * sustainable) for _, span_s, share in PHASES)
    sample, shoppers = calibration, SHOPPERS
    while len(sample.records) < needed:
        shoppers = math.ceil(shoppers * 1.1 * needed / len(sample.records))
        sample = generate_sample(SampleConfig(shoppers=shoppers, seed=31, duration_s=600))
    return sample


def _split_into_phases(records: list[bytes], sustainable: float) -> list[list[bytes]]:
    """Consecutive slices of ``records``, one per phase, each as long as its rate and span
    ask for."""
    parts, at = [], 0
    for _, span_s, share in PHASES:
        count = round(span_s * share * sustainable)
        parts.append(records[at : at + count])
        at += count
    assert len(parts[-1]) == round(PHASES[-1][1] * PHASES[-1][2] * sustainable), (
        "the sample is too small"
    )
    return parts


@pytest.fixture(scope="module")
def overload(kafka_bootstrap, redis_url, standin_tier, tmp_path_factory) -> OverloadRun:
    with standin_tier.configured(latency=STANDIN_LATENCY_S):
        return _run(kafka_bootstrap, redis_url, standin_tier, tmp_path_factory.mktemp("overload"))


def _run(kafka_bootstrap, redis_url, standin_tier, workdir) -> OverloadRun:
    name = f"overload-{time.monotonic_ns()}"
    calibration = generate_sample(SampleConfig(shoppers=SHOPPERS, seed=31, duration_s=600))
    sustainable = _sustainable_events_per_s(standin_tier, calibration.records)
    sample = _sample_for(sustainable, calibration)
    phases = _split_into_phases(sample.records, sustainable)
    total = sum(len(records) for records in phases)
    create_topics(kafka_bootstrap, [f"{name}-events", f"{name}-dlq"], 2)
    llm = {**standin_tier.job_settings(), "capacity": LLM_CAPACITY}
    groups = job_groups(name, kafka_bootstrap, redis_url, llm)
    client = redis.Redis.from_url(redis_url)
    job = JobProcess(groups, workdir / "job.log")
    probe = Probe(client, name, job.pid)
    phase_ends: dict[str, float] = {}
    produced: dict[str, int] = {}
    try:
        probe.start()
        for (phase, _, share), records in zip(PHASES, phases, strict=True):
            summary = replay_records(
                kafka_bootstrap,
                f"{name}-events",
                records,
                rate=share * sustainable,
                rebase_time="send",
            )
            assert summary.ok, summary.describe(f"{name}-events")
            phase_ends[phase] = time.monotonic() - probe.started
            produced[phase] = max(produced.values(), default=0) + len(records)
        until(
            lambda: is_settled(read_stats(client, name), total),
            "the run to settle",
            **job.waits(SETTLE_TIMEOUT_S, interval_s=1, state=lambda: read_stats(client, name)),
        )
        settled_at = time.monotonic() - probe.started
    finally:
        probe.stop()
        job.kill()
    run = OverloadRun(
        read_stats(client, name),
        probe,
        phase_ends,
        produced,
        settled_at,
        read_samples(client, name, "outbox_in_system"),
        sustainable,
    )
    _write_report(run)
    return run


def _latencies(run: OverloadRun, start_s: float, end_s: float) -> list[int]:
    return [ms for at, ms in run.probe.writes if start_s <= at < end_s]


def _recovery_s(run: OverloadRun) -> float:
    """Seconds from the end of the burst until the prompts in flight are back to the
    steady phase's highest level."""
    steady_max = max(n for at, n in run.probe.in_flight if at < run.phase_ends["steady"])
    burst_end = run.phase_ends["burst"]
    after = [(at, n) for at, n in run.probe.in_flight if at >= burst_end]
    backlog_left = [at for at, n in after if n > steady_max]
    return (max(backlog_left) - burst_end) if backlog_left else 0.0


def _llm_calls_per_s_while_draining(run: OverloadRun) -> float | None:
    """The LLM tier's measured capacity: calls answered per second from the end of the
    burst until the backlog was gone (the tier was busy all that time)."""
    start = run.phase_ends["burst"]
    end = start + _recovery_s(run)
    at_start = [n for at, n in run.probe.llm_calls if at <= start]
    at_end = [n for at, n in run.probe.llm_calls if at <= end]
    if end - start < 10 or not at_start or not at_end:
        return None
    return (at_end[-1] - at_start[-1]) / (end - start)


def _phase_latencies(run: OverloadRun) -> tuple[list[int], list[int], list[int]]:
    """Event-to-intent ms of the intents written in the steady phase, in the burst and the
    AFTER_BURST_S after it (the burst's prompts wait in the outbox and in Kafka, so they
    land late), and in the last TAIL_S of the recovery phase."""
    ends = run.phase_ends
    return (
        _latencies(run, 0, ends["steady"]),
        _latencies(run, ends["steady"], ends["burst"] + AFTER_BURST_S),
        _latencies(run, ends["recovery"] - TAIL_S, ends["recovery"]),
    )


def _write_report(run: OverloadRun) -> None:
    steady, burst, tail = _phase_latencies(run)
    report = {
        "standin_latency_s": STANDIN_LATENCY_S,
        "sustainable_events_per_s": run.sustainable_events_per_s,
        "phases": [
            {"name": n, "seconds": s, "events_per_s": share * run.sustainable_events_per_s}
            for n, s, share in PHASES
        ],
        "phase_ends_s": run.phase_ends,
        "settled_at_s": run.settled_at,
        "peak_rss_mb": max(mb for _, mb in run.probe.rss_mb),
        "steady_peak_rss_mb": max(
            mb for at, mb in run.probe.rss_mb if at < run.phase_ends["steady"]
        ),
        "max_prompts_without_outcome": max(n for _, n in run.probe.in_flight),
        "max_prompts_queued_or_running": max(run.queued_or_running, default=0),
        "outbox_capacity": LLM_CAPACITY,
        "events_read_at_phase_ends": {
            name: max((n for at, n in run.probe.events_in if at <= end), default=0)
            for name, end in run.phase_ends.items()
        },
        "events_produced_at_phase_ends": run.produced,
        "recovery_s": _recovery_s(run),
        "llm_calls_per_s_while_draining": _llm_calls_per_s_while_draining(run),
        "prompts_per_event": run.stats.get("prompts_sent", 0) / max(1, run.stats["events_in"]),
        "event_to_intent_s": {
            name: {"p50": percentile(v, 50) / 1000, "p99": percentile(v, 99) / 1000, "n": len(v)}
            for name, v in (("steady", steady), ("burst", burst), ("recovery_tail", tail))
        },
        "stats": run.stats,
    }
    path = cache_dir() / "reports" / "overload.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))


def test_the_sustainable_rate_was_measured_at_the_standins_latency(overload) -> None:
    """The calibration saw the latency this module set, not the session's default (0.05 s,
    which would measure 40 times the rate). The lower bound is loose: beside the model
    tier's vLLM workers on the other xdist worker, a CI run's round took 2.85 s, not 2."""
    at_most = CALIBRATION_CALLS / STANDIN_LATENCY_S / PROMPTS_PER_EVENT

    assert at_most * 0.4 <= overload.sustainable_events_per_s <= at_most


def test_superseded_prompts_of_a_shopper_are_coalesced_during_the_burst(overload) -> None:
    assert overload.stats.get("prompts_superseded", 0) > 0


def test_prompts_queued_or_running_never_exceed_the_outbox_capacity(overload) -> None:
    """Beyond ``llm.capacity`` the job blocks (back-pressure): the rest waits in Kafka."""
    assert overload.queued_or_running, "no prompt was sent"
    assert max(overload.queued_or_running) <= LLM_CAPACITY


def test_the_burst_filled_the_outbox(overload) -> None:
    assert max(overload.queued_or_running) > LLM_CAPACITY // 2


def test_memory_stays_bounded_through_the_burst(overload) -> None:
    steady_peak = max(mb for at, mb in overload.probe.rss_mb if at < overload.phase_ends["steady"])
    overall_peak = max(mb for _, mb in overload.probe.rss_mb)

    assert overall_peak < steady_peak * 1.25


def test_freshness_recovers_after_the_burst(overload) -> None:
    steady, burst, tail = _phase_latencies(overload)

    assert percentile(burst, 50) > percentile(steady, 50), "the burst did not overload the job"
    assert percentile(tail, 50) <= percentile(steady, 99) + 1000
    assert _recovery_s(overload) < PHASES[-1][1] - TAIL_S


def test_every_event_and_prompt_has_an_outcome_after_the_burst(overload) -> None:
    assert is_settled(overload.stats, overload.stats["events_in"])
