"""Pipeline capacity: events/s the real PyFlink job sustains when the LLM costs nothing.

The job is ``flink_jobs.job.create_job`` as deployed, on a local PyFlink mini-cluster,
against the embedded Tansu broker and a redis-server, with the LLM replaced by
``bench/standin_llm.py`` (a STAND-IN that answers at once, in its own process): what is
measured is the pipeline's own cost per event: Kafka, the JVM-Python boundary, decoding,
sessions, the trigger policy, prompt rendering, the async HTTP call and the Redis upsert.

Four phases, each on a fresh job (own topic, group, key prefix):

1. **drain** (the capacity): ``--events`` realistic events (``flink_jobs.tools.sample_data``,
   many shoppers at once, event times ending now) are put on the topic *before* the job
   starts; the job then reads them as fast as it can with the default trigger policy.
   The stats hash is polled every 0.5 s; the capacity is the rate at which events get
   their outcome in the keyed session stage (``run_summary.events_accounted``: accepted,
   late, duplicate, dead-lettered), between the moments 10% and 90% of the events had
   one (start-up and tail excluded). Not ``events_in``: decoding runs ahead of the
   session stage by whatever Flink's network buffers hold (thousands of events).
2. **paced** (the latency): events are produced at a fixed rate for ``--paced-s``
   seconds, event time = send time, with a trigger policy that waits at most 0.5 s
   (quiet 0.2 s, max wait 0.5 s, no minimum interval; high-signal events fire at once)
   and 0.2 s out-of-orderness. Event-to-Redis is the job's own ``event_to_intent_ms``
   samples: from the event time the trigger fired at to the intent written, so the
   pipeline's latency (the watermark's hold included). The first ``--paced-warmup-s``
   of the stream are sent at the same rate but not measured: the stream opens with
   every shopper new (each one's first event prompts), a burst that a sustained stream,
   where shoppers arrive at a steady rate, does not have. Rates of 1.0, 0.8, 0.6, 0.5, 0.4,
   0.3 and 0.25 times the drain rate are tried in turn (or ``--paced-rate`` alone) until one
   keeps up: p99 <= 1 s and every event done within ``MAX_LAG_S`` of the last one sent.
   That rate is the sustained capacity. Between the warm-up's end and the producer's last
   event (``steady``), the CPU cores each part of the stack used, the Redis commands per
   second (``INFO commandstats``) and the LLM calls per event are read too
   (``bench/plan_check.py`` compares them with ``shopper-intents plan``).
3. **floor**: the drain's events through jobs of the real job's shape that do none of its
   work (``bench/pyflink_floor.py``, four shapes): the rate no PyFlink job of that shape
   beats on the host, beside the job's own (``job_over_floor``).
4. **modes**: the same smaller drain (``--modes-events``) in PyFlink's thread and process
   execution modes, and in thread mode with the LLM calls made in the job's own
   interpreter (``llm.call_process=false``), back to back: the effect of each, as ratios.

``--profile-s N`` runs py-spy on the Python worker(s) for N s of the drain and writes the
collapsed stacks beside the results (``pipeline_capacity.pyspy.txt``) and the top
functions into the JSON. Peak memory of every process (``VmHWM``) is recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis

from bench._common import (
    RESULTS_DIR,
    CpuClock,
    PeakMemory,
    our_processes,
    percentile,
    ratio,
    result_doc,
    rounded,
    target,
    write_result,
)
from flink_jobs.tools.local_services import (
    LOCAL_BROKER_SOURCE_PROPERTIES,
    LocalProcess,
    create_topics,
    free_port,
    http_ok,
    start_redis,
    start_tansu,
    stop_on_sigterm,
)
from flink_jobs.tools.run_summary import events_accounted

BENCHMARK = "pipeline_capacity"
TARGET_EVENTS_PER_S = 5000
TARGET_P99_S = 1.0
NAIVE_EVENTS_PER_S = 500
POLL_S = 0.5
#: Seconds from the producer's last event until every event has its outcome, for a job that
#: kept up: once traffic stops the last events wait for the watermark to pass them
#: (job.watermark_idle_advance_s + the 0.2 s bound + job.watermark_interval_ms), and the
#: stats hash is flushed every second. Measured 1.9 s at a rate with p99 0.97 s.
MAX_LAG_S = 3.0
#: Paced rates tried, as fractions of the drain rate, until one keeps up within the target.
PACED_FRACTIONS = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.25)
#: The job's timing samples the paced phase reads, cleared after the warm-up.
PACED_TIMINGS = ("event_to_intent_ms", "event_to_prompt_ms", "llm_latency_ms")
#: The floor jobs' shapes (bench.pyflink_floor.SHAPES) and the drain figures kept of each.
FLOOR_SHAPES = ("bare", "state_timer", "job_decode", "job_state")
FLOOR_KEYS = (
    *("events", "events_per_s", "peak_2s_events_per_s", "wall_s_from_submit"),
    *("throughput_series", "cpu_ms_per_event"),
)
LATENCY_TRIGGER = {"quiet_s": "0.2", "max_wait_s": "0.5", "min_interval_s": "0"}


# --- pure pieces -----------------------------------------------------------------------------


def crossing_time(series: Sequence[tuple[float, int]], level: float) -> float | None:
    """When the count first reached ``level`` (linear between polls); None if it never did."""
    previous: tuple[float, int] | None = None
    for t, count in series:
        if count >= level:
            if previous is None or count == previous[1]:
                return t
            t0, c0 = previous
            return t0 + (t - t0) * (level - c0) / (count - c0)
        previous = (t, count)
    return None


def drain_rate(
    series: Sequence[tuple[float, int]], total: int, low: float = 0.1, high: float = 0.9
) -> float | None:
    """Events/s between the moments ``low`` and ``high`` of ``total`` events were counted."""
    t_low = crossing_time(series, low * total)
    t_high = crossing_time(series, high * total)
    if t_low is None or t_high is None or t_high <= t_low:
        return None
    return (high - low) * total / (t_high - t_low)


def windowed_rates(
    series: Sequence[tuple[float, int]], window_s: float = 2.0
) -> list[tuple[float, float]]:
    """(time, events/s over the preceding ``window_s``) at each poll, for the plot."""
    out = []
    j = 0
    for t, count in series:
        while series[j][0] < t - window_s:
            j += 1
        t0, c0 = series[j]
        if t > t0:
            out.append((round(t, 2), round((count - c0) / (t - t0), 1)))
    return out


def top_functions(collapsed: str, limit: int = 25) -> list[dict[str, Any]]:
    """Self and inclusive share of samples per function from py-spy's raw (collapsed) output.

    Each line is ``frame;frame;...;leaf count``; a frame is ``function (file:line)``.
    """
    total = 0
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = [_frame_name(f) for f in stack.split(";")]
        own[frames[-1]] += count
        for name in set(frames):
            inclusive[name] += count
    if not total:
        return []
    return [
        {
            "function": name,
            "self_pct": round(100 * own[name] / total, 1),
            "inclusive_pct": round(100 * inclusive[name] / total, 1),
        }
        for name, _ in own.most_common(limit)
    ]


def _frame_name(frame: str) -> str:
    """``f (flink_jobs/core/events.py:110)`` -> ``f (flink_jobs/core/events.py)``."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    for marker in ("site-packages/", "/work/main/", "lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{name} ({path})" if path else name


def command_calls(commandstats: Mapping[str, Any]) -> dict[str, int]:
    """Calls per command from ``INFO commandstats``: redis-py's parsed form
    (``{"cmdstat_evalsha": {"calls": 3, ...}}``) or the raw values (``"calls=3,usec=..."``)."""
    out: dict[str, int] = {}
    for key, value in commandstats.items():
        if not key.startswith("cmdstat_"):
            continue
        if isinstance(value, Mapping):
            calls = value.get("calls")
        else:
            fields = dict(part.partition("=")[::2] for part in str(value).split(","))
            calls = fields.get("calls")
        if calls is not None:
            out[key.removeprefix("cmdstat_")] = int(calls)
    return out


@dataclass(frozen=True)
class Snapshot:
    """The stats hash and Redis's command counts at one poll, ``t`` s into it."""

    t: float
    stats: Mapping[str, int]
    commands: Mapping[str, int]


def window_figures(start: Snapshot, end: Snapshot, cpu_s: Mapping[str, float]) -> dict[str, Any]:
    """What the stack did between two polls: events done and LLM calls per second and per
    event, cores used per part of the stack (``cpu_s``: its CPU seconds in the window) and
    Redis commands per second."""
    seconds = end.t - start.t
    if seconds <= 0:
        return {}

    def delta(name: str) -> int:
        return end.stats.get(name, 0) - start.stats.get(name, 0)

    events = events_accounted(dict(end.stats)) - events_accounted(dict(start.stats))
    commands = {name: calls - start.commands.get(name, 0) for name, calls in end.commands.items()}
    return {
        "window_s": rounded(seconds),
        "events": events,
        "events_per_s": rounded(events / seconds, 1),
        "llm_calls_per_s": rounded(delta("llm_calls") / seconds, 1),
        "llm_calls_per_event": rounded(ratio(delta("llm_calls"), events), 4),
        "prompts_per_event": rounded(ratio(delta("prompts_sent"), events), 4),
        "cpu_cores": {kind: rounded(s / seconds, 4) for kind, s in sorted(cpu_s.items())},
        "redis_commands_per_s": {
            name: rounded(n / seconds, 1) for name, n in sorted(commands.items()) if n > 0
        },
    }


# --- events ------------------------------------------------------------------------------------


def make_events(shoppers: int, duration_s: float, seed: int, limit: int) -> list[bytes]:
    """Realistic valid events of ``shoppers`` shoppers over ``duration_s`` of event time."""
    from flink_jobs.tools.sample_data import BadRecords, SampleConfig, generate_sample

    sample = generate_sample(
        SampleConfig(shoppers=shoppers, seed=seed, duration_s=duration_s, bad=BadRecords.none())
    )
    return sample.records[:limit]


#: The paced run's start-up events (shoppers, event-time span s, seed, events) and the rate
#: they are sent at: enough for the job to write its first intents before the stream.
STARTUP_EVENTS = (20, 30, 13, 60)
STARTUP_RATE = 60.0
#: How long before the stream :meth:`PacedWorkload.as_sent` stamps the start-up events: the
#: run waits for the job's first intents in between, for as long as that takes. Any gap
#: longer than the trigger's waits and shorter than ``session.gap_s`` gives the same prompts.
STARTUP_LEAD_S = 60.0


@dataclass(frozen=True)
class PacedWorkload:
    """What a paced run sends: ``startup`` at ``STARTUP_RATE`` while the job starts, then
    ``records`` at ``rate`` per second, of which the first ``warmup`` are not measured."""

    records: list[bytes]
    warmup: int
    shoppers: int
    rate: float
    startup: list[bytes]

    def as_sent(self, start_ms: int) -> list[bytes]:
        """The start-up's records and the stream's, in the order sent and stamped as the
        replay stamps them (``replay_records(..., rate=..., rebase_time="send")``: each
        record's event time is its send time, the i-th of the stream ``start_ms`` + i /
        ``rate`` s), the stream starting at ``start_ms`` and the start-up
        ``STARTUP_LEAD_S`` before it."""
        from flink_jobs.tools.replay import plan_replay

        lead_ms = int(STARTUP_LEAD_S * 1000)
        startup = plan_replay(
            self.startup, rate=STARTUP_RATE, rebase_to_ms=start_ms - lead_ms, rebase_anchor="send"
        )
        stream = plan_replay(
            self.records, rate=self.rate, rebase_to_ms=start_ms, rebase_anchor="send"
        )
        return [p.value for p in (*startup, *stream)]

    @property
    def measured_from(self) -> int:
        """The index in :meth:`as_sent` of the first record the steady window measures."""
        return len(self.startup) + self.warmup


def paced_workload(args: argparse.Namespace) -> PacedWorkload:
    """The records a paced run at ``args.paced_rate`` sends: ``--paced-warmup-s`` of them
    not measured, then ``--paced-s``, from shoppers in the drain's proportion to events."""
    warm = int(args.paced_rate * args.paced_warmup_s)
    total = warm + int(args.paced_rate * args.paced_s)
    shoppers = max(50, int(args.shoppers * total / max(1, args.events)))
    return PacedWorkload(
        records=make_events(shoppers, args.duration_s, 11, total),
        warmup=warm,
        shoppers=shoppers,
        rate=float(args.paced_rate),
        startup=make_events(*STARTUP_EVENTS),
    )


def preload(bootstrap: str, topic: str, records: Sequence[bytes]) -> float:
    """Put ``records`` on ``topic`` with event times moved so the last one is now; seconds."""
    from confluent_kafka import Producer

    from flink_jobs.tools.replay import plan_replay, producer_config

    started = time.monotonic()
    plan = plan_replay(list(records), rebase_to_ms=int(time.time() * 1000), rebase_anchor="last")
    producer = Producer(producer_config(bootstrap, {"linger.ms": 20, "batch.num.messages": 10000}))
    for item in plan:
        while True:
            try:
                producer.produce(topic, value=item.value, key=item.key, timestamp=item.timestamp_ms)
                break
            except BufferError:
                producer.poll(0.1)
        producer.poll(0)
    left = producer.flush(120)
    if left:
        raise RuntimeError(f"{left} records not delivered to {topic}")
    return time.monotonic() - started


# --- the stack ---------------------------------------------------------------------------------


class Stack:
    """Redis, Tansu and the stand-in LLM as child processes; ``close()`` stops them."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.redis = start_redis(workdir=workdir / "redis")
        self.kafka = start_tansu(workdir=workdir / "broker")
        port = free_port()
        self.llm = LocalProcess(
            "standin_llm",
            [sys.executable, "-m", "bench.standin_llm", "--port", str(port)],
            workdir / "standin_llm.log",
            cwd=Path(__file__).resolve().parent.parent,
        ).start()
        self.llm_url = f"http://127.0.0.1:{port}"
        self.llm.wait_ready(lambda: http_ok(f"{self.llm_url}/health", 1.0), timeout_s=30)

    def close(self) -> None:
        for part in (self.llm, self.kafka, self.redis):
            with contextlib.suppress(Exception):
                part.stop()


def settings(items: Sequence[str]) -> dict[str, dict[str, str]]:
    """``["job.python_bundle_size=5000"]`` -> ``{"job": {"python_bundle_size": "5000"}}``."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        group, dot, name = key.partition(".")
        if not (sep and dot and group and name):
            raise ValueError(f"expected GROUP.KEY=VALUE, got {item!r}")
        out.setdefault(group, {})[name] = value
    return out


def job_config(stack: Stack, name: str, extra: dict[str, dict[str, str]] | None = None):
    from flink_jobs.config import load_config

    overrides = job_overrides(stack, name)
    for group, values in (extra or {}).items():
        overrides.setdefault(group, {}).update(values)
    return load_config(overrides=overrides)


def job_overrides(stack: Stack, name: str) -> dict[str, dict[str, Any]]:
    """The job's settings for a run called ``name`` on ``stack`` (its own topics, group and
    key prefix; the stand-in as its LLM)."""
    return {
        "kafka": {
            "bootstrap_servers": stack.kafka.bootstrap,
            "source_properties": LOCAL_BROKER_SOURCE_PROPERTIES,
            "events_topic": f"{name}-events",
            "dead_letter_topic": f"{name}-dlq",
            "group_id": name,
            "starting_offsets": "earliest",
        },
        "redis": {"url": stack.redis.url, "key_prefix": name},
        "llm": {"base_url": f"{stack.llm_url}/v1", "model": "stand-in-model"},
        "job": {"name": name, "stats_flush_s": "0.5"},
    }


def submit(config, shape: str = ""):
    """Start the real job, or with ``shape`` the floor job of that shape (bench.pyflink_floor)."""
    if shape:
        from bench.pyflink_floor import create_floor_job

        return create_floor_job(config, shape).execute_async(config.job.name)
    from flink_jobs.job import create_job

    return create_job(config).execute_async(config.job.name)


def cancel(job) -> None:
    with contextlib.suppress(Exception):
        job.cancel().result()


def poll_until(client, prefix, done, timeout_s, memory: PeakMemory, on_poll=None):
    """Poll the stats hash every POLL_S until ``done(stats)``; the series of polls."""
    from flink_jobs.tools.run_summary import read_stats

    series: list[tuple[float, dict[str, int]]] = []
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        stats = read_stats(client, prefix)
        series.append((time.monotonic() - started, stats))
        memory.sample()
        if on_poll is not None:
            on_poll(series)
        if done(stats):
            break
        time.sleep(POLL_S)
    return series


def poll_drain(
    client, prefix: str, total: int, timeout_s: float, memory: PeakMemory, on_count=None
):
    """Poll until ``total`` events have their outcome: the series of polls, the (time,
    events done) counts, and the CPU milliseconds per event by part of the stack from 10 %
    of them done to the end (start-up excluded). ``on_count(done)`` runs at every poll."""
    cpu = CpuClock(memory.root)
    cpu_from: dict[str, Any] = {}

    def on_poll(series) -> None:
        counted = events_accounted(series[-1][1])
        cpu.sample()
        if not cpu_from and counted >= 0.1 * total:
            cpu_from.update(mark=cpu.mark(), events=counted)
        if on_count is not None:
            on_count(counted)

    series = poll_until(
        client, prefix, lambda s: events_accounted(s) >= total, timeout_s, memory, on_poll
    )
    cpu_s = cpu.since(cpu_from["mark"]) if cpu_from else {}
    counts = [(t, events_accounted(s)) for t, s in series]
    return series, counts, cpu_per_event(cpu_s, counts[-1][1] - cpu_from.get("events", 0))


class SteadyWindow:
    """The stack's work from the first poll after the warm-up while the producer runs to
    the first poll after it stopped: ``observe`` at every poll, then ``figures()``."""

    def __init__(self, clock: CpuClock, client) -> None:
        self.clock = clock
        self.client = client
        self.start: Snapshot | None = None
        self.end: Snapshot | None = None
        self.mark: dict[int, tuple[str, float]] = {}
        self.cpu_s: dict[str, float] = {}

    def observe(self, t: float, stats: Mapping[str, int], warm: bool, producing: bool) -> None:
        if self.start is None and warm and producing:
            self.mark = self.clock.mark()
            self.start = Snapshot(t, dict(stats), self._commands())
        elif self.start is not None and self.end is None and not producing:
            self.cpu_s = self.clock.since(self.mark)
            self.end = Snapshot(t, dict(stats), self._commands())

    def _commands(self) -> dict[str, int]:
        return command_calls(self.client.info("commandstats"))

    def figures(self) -> dict[str, Any]:
        if self.start is None or self.end is None:
            return {}
        return window_figures(self.start, self.end, self.cpu_s)


# --- profiling ---------------------------------------------------------------------------------


PYTHON_KINDS = {"bench_driver", "flink_jvm", "python_udf_worker", "llm_call_process"}


def python_workers(root: int) -> list[int]:
    """PIDs where the job's Python code runs: in thread mode the Flink JVM (an interpreter
    embedded in it), in process mode ``root`` itself (a local mini-cluster runs the Python
    workers in loopback mode, as threads of the submitting process) and any separate worker
    process under it; and the LLM call processes (``flink_jobs.runtime.call_process``)."""
    return [pid for pid, kind in our_processes(root) if kind in PYTHON_KINDS]


def py_spy() -> str | None:
    """The py-spy executable (the ``bench`` extra, ``make bench``), or None."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.exists() else None)


def start_profiler(pids: Sequence[int], seconds: float, out: Path) -> list[subprocess.Popen]:
    spy = py_spy()
    if spy is None:
        return []
    procs = []
    for pid in pids:
        procs.append(
            subprocess.Popen(
                [
                    *(spy, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "97"),
                    *("-f", "raw", "--gil", "--nonblocking", "-o", f"{out}.{pid}"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    return procs


# --- phases ------------------------------------------------------------------------------------


def run_drain(
    stack: Stack,
    args,
    memory: PeakMemory,
    out_dir: Path,
    events: int | None = None,
    extra: dict[str, dict[str, str]] | None = None,
    floor_shape: str = "",
) -> dict[str, Any]:
    events = events or args.events
    shoppers = max(1, args.shoppers * events // args.events)
    name = f"cap-drain-{int(time.time())}"
    job_settings = settings(args.set)
    for group, values in (extra or {}).items():
        job_settings.setdefault(group, {}).update(values)
    config = job_config(stack, name, job_settings)
    create_topics(
        stack.kafka.bootstrap, [config.kafka.events_topic, config.kafka.dead_letter_topic], 1
    )
    records = make_events(shoppers, args.duration_s, 7, events)
    produce_s = preload(stack.kafka.bootstrap, config.kafka.events_topic, records)
    print(f"drain: {len(records):,} events on the topic in {produce_s:.1f} s; starting the job")
    client = redis.Redis.from_url(stack.redis.url)
    profile: dict[str, Any] = {"requested_s": args.profile_s}
    profilers: list[subprocess.Popen] = []
    profile_path = out_dir / f"{BENCHMARK}.pyspy.txt"

    profiled = args.profile_s and not floor_shape

    def on_count(counted: int) -> None:
        if profiled and "pids" not in profile and counted >= 0.1 * len(records):
            pids = python_workers(memory.root)
            profile["pids"] = pids
            profilers.extend(start_profiler(pids, args.profile_s, profile_path))
            if not profilers:
                profile["error"] = "py-spy not found: install the bench extra (make bench)"
                print(f"drain: no profile, {profile['error']}")

    started = time.monotonic()
    job = submit(config, floor_shape)
    try:
        series, counts, cpu_ms = poll_drain(
            client, name, len(records), args.timeout_s, memory, on_count
        )
        for proc in profilers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=args.profile_s + 30)
        settle = poll_until(client, name, lambda s: False, 3.0, memory)
    finally:
        cancel(job)
    wall = time.monotonic() - started
    decoded = [(t, s.get("events_in", 0)) for t, s in series]
    final = settle[-1][1] if settle else series[-1][1]
    if profilers:
        collapsed = ""
        for pid in profile.get("pids", []):
            part = Path(f"{profile_path}.{pid}")
            if part.exists():
                collapsed += part.read_text()
                part.unlink()
        profile_path.write_text(collapsed)
        profile["file"] = profile_path.name
        profile["top"] = top_functions(collapsed)
    rate = drain_rate(counts, len(records))
    return {
        "settings": job_settings,
        "events": len(records),
        "shoppers": shoppers,
        "event_time_span_s": args.duration_s,
        "preload_s": round(produce_s, 1),
        "wall_s_from_submit": round(wall, 1),
        "first_event_in_s": rounded(crossing_time(counts, 1)),
        "all_in_s": rounded(crossing_time(counts, len(records))),
        "events_per_s": rounded(rate, 0),
        "peak_2s_events_per_s": max((r for _, r in windowed_rates(counts)), default=None),
        "throughput_series": windowed_rates(counts),
        "decoded_events_per_s": rounded(drain_rate(decoded, len(records)), 0),
        "decode_throughput_series": windowed_rates(decoded),
        "stats": final,
        "cpu_ms_per_event": cpu_ms,
        "prompts_per_event": rounded(
            final.get("prompts_sent", 0) / max(1, final.get("events_accepted", 0))
        ),
        "profile": profile,
    }


def run_floor(
    stack: Stack, args, memory: PeakMemory, drain: dict[str, Any] | None
) -> dict[str, Any]:
    """The drain's events through the floor jobs (``bench.pyflink_floor``), one per shape,
    right after the real job's drain: PyFlink's own cost per event, beside the job's."""
    floor: dict[str, Any] = {}
    for shape in FLOOR_SHAPES:
        run = run_drain(stack, args, memory, args.out, floor_shape=shape)
        floor[shape] = {k: run[k] for k in FLOOR_KEYS}
        print(f"floor {shape}: {run['events_per_s']} events/s")
    job_rate = (drain or {}).get("events_per_s")
    floor["job_over_floor"] = rounded(ratio(job_rate, floor["state_timer"]["events_per_s"]))
    floor["target_over_floor"] = rounded(
        ratio(TARGET_EVENTS_PER_S, floor["state_timer"]["events_per_s"])
    )
    return floor


def cpu_per_event(cpu_s: dict[str, float], events: int) -> dict[str, float]:
    """CPU milliseconds per event by part of the stack, and ``total`` over them all."""
    if events <= 0 or not cpu_s:
        return {}
    per_event = {kind: rounded(1000 * s / events) for kind, s in cpu_s.items()}
    return {**per_event, "total": rounded(1000 * sum(cpu_s.values()) / events)}


def kept_up(paced: dict[str, Any]) -> bool:
    """The paced run met the latency target and the job was not behind at the end."""
    p99, lag = paced["event_to_redis_s"]["p99"], paced.get("lag_at_end_s")
    return p99 is not None and p99 <= TARGET_P99_S and lag is not None and lag <= MAX_LAG_S


def run_paced(
    stack: Stack,
    args,
    memory: PeakMemory,
    latency_settings: bool = True,
    workload: PacedWorkload | None = None,
) -> dict[str, Any]:
    """Events at ``args.paced_rate``; with ``latency_settings`` the job's trigger and
    out-of-orderness are the short ones of the latency measurement, else its defaults.
    ``workload``: ``paced_workload(args)`` when the caller already built it."""
    from flink_jobs.runtime.counters import samples_key
    from flink_jobs.tools.replay import ReplayProgress, replay_records
    from flink_jobs.tools.run_summary import is_settled, latency_summary, read_samples

    name = f"cap-paced-{int(time.time())}"
    extra = settings(args.set)
    if latency_settings:
        extra.setdefault("trigger", {}).update(LATENCY_TRIGGER)
        extra.setdefault("job", {})["out_of_orderness_s"] = "0.2"
    config = job_config(stack, name, extra)
    create_topics(
        stack.kafka.bootstrap, [config.kafka.events_topic, config.kafka.dead_letter_topic], 1
    )
    workload = workload or paced_workload(args)
    records, warm = workload.records, workload.warmup
    warmed_up = threading.Event()  # set by the producer's thread
    measuring = False

    def note_progress(progress: ReplayProgress) -> None:
        if progress.produced >= warm:
            warmed_up.set()

    def forget_warmup(_series) -> None:
        nonlocal measuring
        if warm and warmed_up.is_set() and not measuring:
            client.delete(*(samples_key(name, timing) for timing in PACED_TIMINGS))
            measuring = True

    def on_poll(series) -> None:
        forget_warmup(series)
        t, stats = series[-1]
        steady.observe(t, stats, not warm or warmed_up.is_set(), producer.is_alive())

    client = redis.Redis.from_url(stack.redis.url)
    steady = SteadyWindow(CpuClock(memory.root), client)
    job = submit(config)
    try:
        # Start-up: wait until the job has written intents, then forget its samples.
        replay_records(stack.kafka.bootstrap, config.kafka.events_topic, workload.startup,
                       rate=STARTUP_RATE, rebase_time="send")  # fmt: skip
        poll_until(client, name, lambda s: s.get("intents_written", 0) > 0, args.timeout_s, memory)
        time.sleep(2.0)
        base = poll_until(client, name, lambda s: True, 1, memory)[-1][1]
        client.delete(*(samples_key(name, timing) for timing in PACED_TIMINGS))
        print(
            f"paced: {len(records):,} events at {args.paced_rate:,.0f}/s,"
            f" the first {warm:,} not measured"
        )
        summary: dict[str, Any] = {}
        producer = threading.Thread(
            target=lambda: summary.setdefault(
                "replay",
                replay_records(
                    stack.kafka.bootstrap,
                    config.kafka.events_topic,
                    records,
                    rate=args.paced_rate,
                    rebase_time="send",
                    progress=note_progress,
                ),
            ),
            daemon=True,
        )
        producer.start()
        expected = base.get("events_in", 0) + len(records)
        series = poll_until(
            client,
            name,
            lambda s: not producer.is_alive() and is_settled(s, expected),
            args.paced_warmup_s + args.paced_s + args.timeout_s,
            memory,
            on_poll=on_poll,
        )
        producer.join(timeout=5)
    finally:
        cancel(job)
    samples = read_samples(client, name, "event_to_intent_ms")
    in_job = read_samples(client, name, "event_to_prompt_ms")
    final = series[-1][1]
    counts = [(t, events_accounted(s) - events_accounted(base)) for t, s in series]
    replay = summary.get("replay")
    produced_s = replay.elapsed_s if replay else None
    in_all = crossing_time(counts, len(records))
    return {
        "settings": extra,
        "events": len(records),
        "warmup_events": warm,
        "shoppers": workload.shoppers,
        "rate_offered": args.paced_rate,
        "producer_s": rounded(produced_s),
        "rate_produced": rounded(len(records) / produced_s if produced_s else None, 0),
        "all_in_s": rounded(in_all),
        "lag_at_end_s": rounded(in_all - produced_s if in_all and produced_s else None),
        "trigger": dict(extra.get("trigger", {})),
        "event_to_redis_samples": len(samples),
        "event_to_redis_s": latency_summary(samples),
        "event_to_redis_p90_s": rounded(percentile([v / 1000 for v in samples], 90)),
        "event_to_redis_max_s": rounded(max(samples) / 1000 if samples else None),
        "event_to_redis_ms": samples,
        "event_to_prompt_s": latency_summary(in_job),
        "throughput_series": windowed_rates(counts),
        "stats": final,
        "prompts_per_event": rounded(
            (final.get("prompts_sent", 0) - base.get("prompts_sent", 0)) / max(1, len(records))
        ),
        "settled": is_settled(final, base.get("events_in", 0) + len(records)),
        "steady": steady.figures(),
    }


def run(args) -> dict[str, Any]:
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="si-bench-capacity-"))
    memory = PeakMemory()
    stack = Stack(workdir)
    phases: dict[str, Any] = {}
    try:
        if "drain" in args.phases:
            phases["drain"] = run_drain(stack, args, memory, args.out)
            print(f"drain: {phases['drain']['events_per_s']} events/s")
        if "floor" in args.phases:
            phases["floor"] = run_floor(stack, args, memory, phases.get("drain"))
        if "modes" in args.phases:
            # The same smaller drain in each execution mode, and in thread mode with the
            # LLM calls in the job's own interpreter, back to back.
            variants = {
                "thread": {"job": {"python_execution_mode": "thread"}},
                "process": {"job": {"python_execution_mode": "process"}},
                "thread_calls_in_job": {
                    "job": {"python_execution_mode": "thread"},
                    "llm": {"call_process": False},
                },
            }
            modes = {
                name: run_drain(stack, args, memory, args.out, args.modes_events, overrides)
                for name, overrides in variants.items()
            }
            thread_rate = modes["thread"]["events_per_s"]
            phases["modes"] = {
                **modes,
                "thread_over_process": rounded(
                    ratio(thread_rate, modes["process"]["events_per_s"])
                ),
                "call_process_over_calls_in_job": rounded(
                    ratio(thread_rate, modes["thread_calls_in_job"]["events_per_s"])
                ),
            }
            print(
                f"modes: thread/process {phases['modes']['thread_over_process']}, call process/"
                f"calls in job {phases['modes']['call_process_over_calls_in_job']}"
            )
        if "paced" in args.phases:
            measured = phases.get("drain", {}).get("events_per_s") or 1000
            rates = (
                [args.paced_rate]
                if args.paced_rate
                else [max(50, int(f * measured // 50 * 50)) for f in PACED_FRACTIONS]
            )
            tries = []
            for rate in rates:
                args.paced_rate = rate
                tries.append(run_paced(stack, args, memory))
                print(
                    f"paced {rate}/s: p99 {tries[-1]['event_to_redis_s']['p99']} s,"
                    f" event to prompt p99 {tries[-1]['event_to_prompt_s']['p99']} s"
                )
                if kept_up(tries[-1]):
                    break
            phases["paced"] = tries[-1]
            phases["paced_tries"] = [
                {k: t[k] for k in ("rate_offered", "event_to_redis_s", "lag_at_end_s")}
                for t in tries
            ]
        memory.sample()
        with contextlib.suppress(Exception):
            phases["standin_llm_requests"] = httpx.get(f"{stack.llm_url}/stats").json()
    finally:
        stack.close()
    drain = phases.get("drain", {})
    paced = phases.get("paced", {})
    targets = []
    if drain:
        targets.append(
            target(
                "drain: events/s with the stand-in LLM",
                drain.get("events_per_s"),
                ">=",
                TARGET_EVENTS_PER_S,
            )
        )
    if paced:
        targets.append(
            target(
                "sustained: events/s paced with event-to-Redis p99 <= 1 s, kept up",
                paced["rate_offered"] if kept_up(paced) else None,
                ">=",
                TARGET_EVENTS_PER_S,
                f"rates tried: {[t['rate_offered'] for t in phases['paced_tries']]}",
            )
        )
        targets.append(
            target(
                f"paced at {paced['rate_offered']:,.0f}/s: event-to-Redis p99 (s)",
                paced["event_to_redis_s"]["p99"],
                "<=",
                TARGET_P99_S,
                "from the event time the trigger fired at; includes the 0.2 s watermark bound",
            )
        )
        targets.append(
            target(
                "paced: the job kept up (lag when the producer finished, s)",
                paced.get("lag_at_end_s"),
                "<=",
                MAX_LAG_S,
                "the last events wait for the watermark once traffic stops",
            )
        )
    return result_doc(
        BENCHMARK,
        started,
        targets,
        [
            "The LLM is a stand-in that answers at once (bench/standin_llm.py): this measures the "
            "pipeline's own cost, not the model's.",
            "Producer, broker, Redis, stand-in and Flink share the machine's 2 cores.",
        ],
        capacity_events_per_s=drain.get("events_per_s"),
        over_naive=rounded(
            drain["events_per_s"] / NAIVE_EVENTS_PER_S if drain.get("events_per_s") else None
        ),
        phases=phases,
        memory_peak=memory.summary(),
    )


def _cpu_lines(label: str, run: dict[str, Any]) -> list[str]:
    cpu = run.get("cpu_ms_per_event")
    if not cpu:
        return []
    return [f"{label:<8}CPU ms/event " + ", ".join(f"{k} {v}" for k, v in cpu.items())]


def table(doc: dict[str, Any]) -> str:
    lines = []
    drain = doc["phases"].get("drain")
    if drain:
        lines.append(
            f"drain   {drain['events']:>8,} events  {drain['events_per_s']} events/s"
            f" (peak 2 s: {drain['peak_2s_events_per_s']})"
            f"  prompts/event {drain['prompts_per_event']}"
        )
        lines += _cpu_lines("drain", drain)
    floor = doc["phases"].get("floor")
    if floor:
        for shape in FLOOR_SHAPES:
            lines.append(
                f"floor   {floor[shape]['events']:>8,} events  PyFlink alone, {shape}:"
                f" {floor[shape]['events_per_s']} events/s"
            )
            lines += _cpu_lines("floor", floor[shape])
        lines.append(
            f"floor   the job's drain over the state_timer floor: {floor['job_over_floor']};"
            f" the target over it: {floor['target_over_floor']}"
        )
    modes = doc["phases"].get("modes")
    if modes:
        lines.append(
            f"modes   {modes['thread']['events']:>8,} events  thread"
            f" {modes['thread']['events_per_s']} events/s, process"
            f" {modes['process']['events_per_s']} events/s:"
            f" {modes['thread_over_process']}x"
        )
        lines.append(
            f"modes   {modes['thread_calls_in_job']['events']:>8,} events  thread, calls in the"
            f" job's interpreter {modes['thread_calls_in_job']['events_per_s']} events/s:"
            f" call process {modes['call_process_over_calls_in_job']}x"
        )
    paced = doc["phases"].get("paced")
    if paced:
        lat = paced["event_to_redis_s"]
        lines.append(
            f"paced   {paced['events']:>8,} events at {paced['rate_offered']}/s"
            f"  event-to-Redis p50 {lat['p50']} s p99 {lat['p99']} s"
            f"  lag at end {paced['lag_at_end_s']} s"
        )
        in_job = paced.get("event_to_prompt_s")
        if in_job:
            lines.append(
                f"paced   of which event to prompt sent (Kafka, watermark, trigger):"
                f" p50 {in_job['p50']} s p99 {in_job['p99']} s"
            )
    for kind, m in doc["memory_peak"].items():
        lines.append(
            f"memory  {kind:<18} peak {m['max_mib']:>8} MiB"
            f" (sum {m['sum_mib']}, n={m['processes']})"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None):
    p = argparse.ArgumentParser(
        prog="python -m bench.pipeline_capacity", description=__doc__.split("\n")[0]
    )
    p.add_argument("--events", type=int, default=150_000, help="events in the drain phase")
    p.add_argument("--shoppers", type=int, default=15_000, help="shoppers generated")
    p.add_argument("--duration-s", type=float, default=3600.0, help="event-time span generated")
    p.add_argument("--paced-rate", type=float, default=None, help="default: 0.8x the drain rate")
    p.add_argument("--paced-s", type=float, default=40.0, help="measured, after the warm-up")
    p.add_argument(
        "--paced-warmup-s", type=float, default=10.0, help="sent first at the rate, not measured"
    )
    p.add_argument("--phases", default="drain,floor,paced,modes")
    p.add_argument(
        "--modes-events", type=int, default=10_000, help="events per drain of the modes phase"
    )
    p.add_argument("--profile-s", type=float, default=0.0, help="py-spy the workers this long")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="GROUP.KEY=VALUE",
        help="job configuration, e.g. job.python_bundle_size=5000 (A/B runs; the paced job"
        " keeps its own trigger and out-of-orderness)",
    )
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()
    args.out.mkdir(parents=True, exist_ok=True)
    doc = run(args)
    print(table(doc))
    print(f"written {write_result(doc, args.out)}")
    return 0 if doc["all_targets_met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
