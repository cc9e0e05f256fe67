"""Scale-out: the real job's drain throughput on a standalone Flink cluster, by shape.

Three shapes in one run, each a fresh cluster (``flink_jobs.tools.flink_cluster``: a
JobManager and TaskManager JVMs, the job submitted with ``flink run`` as Managed Flink
and docker-compose submit it) over the same events, preloaded on a topic of four
partitions:

- one TaskManager with one slot, parallelism 1;
- two TaskManagers with one slot each, parallelism 2 (how ``deploy/README.md`` sizes an
  application: one slot, one interpreter per TaskManager);
- one TaskManager with two slots, parallelism 2: thread mode runs every Python operator of
  a TaskManager in its one embedded interpreter, so this shows what sharing it costs.

The LLM is ``bench/standin_llm.py``, a STAND-IN that answers at once: what is measured is
the pipeline's own cost. A shape's rate is ``pipeline_capacity.drain_rate`` (events with
an outcome in the session stage, between 10 % and 90 % of them); its CPU per event comes
from every process of the stack over the same span (``CpuClock``), by kind, with the
TaskManagers and the JobManager apart; "core-bound" is the rate the host's cores allow at
that CPU per event (cores / CPU seconds per event), which is what a host with more cores
than this one would approach.

Before its events go on the topic, each shape's job runs ``--idle-s`` with none: the cores
each part of the stack uses then (``idle_cores``: heartbeats, timers, the source's fetches,
checkpoints, and whatever of each JVM's start-up, JIT compilation above all, still runs)
do not grow with events, so a shape with more TaskManagers pays more of them per event on
a host that gives each fewer events. ``cpu_ms_per_event_net_of_idle`` takes that share out
of the drain's figure: an estimate of what each further event costs, low by whatever of
the idle share was start-up. ``--rounds N`` drains every shape N times, the shapes
interleaved round by round, and judges the targets on each shape's mean: one drain per
shape moved by a quarter between two runs on one host. Results:
``bench/results/scale_out.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from bench._common import (
    RESULTS_DIR,
    CpuClock,
    PeakMemory,
    ratio,
    result_doc,
    rounded,
    target,
    targets_table,
    write_result,
)
from bench.pipeline_capacity import (
    Stack,
    drain_rate,
    job_overrides,
    make_events,
    poll_drain,
    preload,
)
from flink_jobs.tools.local_services import create_topics, stop_on_sigterm

BENCHMARK = "scale_out"
PARTITIONS = 4
#: After the job's sources are up and before its idle CPU is read: class loading, the
#: first watermarks and the operators' threads starting are start-up, not idling.
IDLE_WARMUP_S = 5.0


@dataclass(frozen=True)
class Shape:
    label: str
    taskmanagers: int
    slots: int
    parallelism: int


SHAPES = (
    Shape("1 TM x 1 slot, p=1", 1, 1, 1),
    Shape("2 TM x 1 slot, p=2", 2, 1, 2),
    Shape("1 TM x 2 slots, p=2", 1, 2, 2),
)


def _settings(stack: Stack, name: str) -> dict[str, dict[str, Any]]:
    """The job's settings as ``flink run`` passes them (``SI_*``); parallelism from ``-p``."""
    settings = job_overrides(stack, name)
    settings["job"]["parallelism"] = 0
    return settings


def core_bound(cpu_ms_total: float | None, cores: int) -> float | None:
    """Events/s ``cores`` allow when each event costs ``cpu_ms_total`` of CPU."""
    if not cpu_ms_total:
        return None
    return cores * 1000 / cpu_ms_total


def idle_cores(seconds: float) -> dict[str, float]:
    """Cores each part of the stack uses over ``seconds`` (the job running, no events)."""
    cpu = CpuClock(os.getpid())
    mark = cpu.mark()
    time.sleep(seconds)
    return {kind: rounded(s / seconds, 3) for kind, s in cpu.since(mark).items()}


def drain_window_s(counts: Sequence[tuple[float, int]], total: int) -> float:
    """Seconds from the poll where 10 % of ``total`` were done to the last poll: the span
    ``poll_drain`` reads the CPU over."""
    start = next((t for t, done in counts if done >= 0.1 * total), counts[-1][0])
    return counts[-1][0] - start


def net_of_idle(
    per_event: dict[str, float], idle: dict[str, float], window_s: float, events: int
) -> dict[str, float]:
    """``per_event`` (CPU ms per event by kind) less what ``idle`` (cores by kind) would
    have used over the ``window_s`` those ``events`` took."""
    if events <= 0:
        return {}
    net = {
        kind: rounded(ms - 1000 * idle.get(kind, 0.0) * window_s / events)
        for kind, ms in per_event.items()
        if kind != "total"
    }
    return {**net, "total": rounded(sum(net.values()))}


def run_shape(stack: Stack, shape: Shape, records: Sequence[bytes], workdir: Path, args):
    from flink_jobs.tools.flink_cluster import ClusterSpec, FlinkCluster, job_script, settings_env
    from flink_jobs.tools.run_summary import wait_for_task_starts

    name = f"scale-{shape.taskmanagers}tm{shape.slots}s-p{shape.parallelism}-{int(time.time())}"
    create_topics(stack.kafka.bootstrap, [f"{name}-events"], PARTITIONS)
    create_topics(stack.kafka.bootstrap, [f"{name}-dlq"], 1)
    client = redis.Redis.from_url(stack.redis.url)
    memory = PeakMemory(os.getpid())
    spec = ClusterSpec(taskmanagers=shape.taskmanagers, slots_per_taskmanager=shape.slots)
    with FlinkCluster(workdir / name, spec) as cluster:
        job_id = cluster.submit(
            job_script(), settings_env(_settings(stack, name)), shape.parallelism
        )
        try:
            if not wait_for_task_starts(client, name, shape.parallelism, args.timeout_s):
                raise TimeoutError(f"{name}: its sources not up after {args.timeout_s} s")
            time.sleep(IDLE_WARMUP_S)
            idle = idle_cores(args.idle_s)
            print(f"{shape.label}: idle, cores by part: {idle}")
            started = time.monotonic()
            produce_s = preload(stack.kafka.bootstrap, f"{name}-events", records)
            print(f"{shape.label}: {len(records):,} events on the topic in {produce_s:.1f} s")
            _, counts, per_event = poll_drain(client, name, len(records), args.timeout_s, memory)
        finally:
            cluster.cancel(job_id)
        wall = time.monotonic() - started
    rate = drain_rate(counts, len(records))
    window_s = drain_window_s(counts, len(records))
    counted = counts[-1][1] - next((n for _, n in counts if n >= 0.1 * len(records)), 0)
    result = {
        "shape": shape.label,
        "taskmanagers": shape.taskmanagers,
        "slots_per_taskmanager": shape.slots,
        "parallelism": shape.parallelism,
        "events": len(records),
        "done": counts[-1][1],
        "wall_s_from_first_event": round(wall, 1),
        "events_per_s": rounded(rate, 0),
        "cpu_ms_per_event": per_event,
        "idle_s": args.idle_s,
        "idle_cores": idle,
        "cpu_ms_per_event_net_of_idle": net_of_idle(per_event, idle, window_s, counted),
        "core_bound_events_per_s": rounded(core_bound(per_event.get("total"), args.cores), 0),
        "peak_memory_mib": memory.summary(),
    }
    print(
        f"{shape.label}: {result['events_per_s']} events/s, "
        f"{per_event.get('total')} ms CPU per event, in {wall:.0f} s"
    )
    return result


def table(shapes: Sequence[dict[str, Any]]) -> str:
    kinds = sorted({k for s in shapes for k in s["cpu_ms_per_event"] if k != "total"})
    head = ["round", "shape", "events/s", "CPU ms/event", *kinds, "core-bound events/s"]
    head += ["idle cores", "CPU ms/event net of idle"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for s in shapes:
        cpu = s["cpu_ms_per_event"]
        row = [s.get("round", 1), s["shape"], s["events_per_s"], cpu.get("total")]
        row += [*(cpu.get(k, "") for k in kinds), s["core_bound_events_per_s"]]
        row.append(rounded(sum(s["idle_cores"].values())))
        row.append(s["cpu_ms_per_event_net_of_idle"].get("total"))
        lines.append("| " + " | ".join(str(v) for v in row) + " |")
    return "\n".join(lines)


def means_table(means: Sequence[dict[str, Any]]) -> str:
    head = ["shape", "rounds", "events/s", "CPU ms/event", "core-bound events/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for m in means:
        row = [m["shape"], m["rounds"], m["events_per_s"], m["cpu_ms_per_event"].get("total")]
        row.append(m["core_bound_events_per_s"])
        lines.append("| " + " | ".join(str(v) for v in row) + " |")
    return "\n".join(lines)


def shape_targets(one: dict[str, Any], two: dict[str, Any], shared: dict[str, Any]) -> list[dict]:
    """The targets of scaling out: the second TaskManager costs at most 10 % more
    CPU per event, and drains at 85 % or more of what the cores allow at its CPU per event
    (the machine, not the job, is then the limit); the two slots' rate beside them."""
    cpu_one, cpu_two = (s["cpu_ms_per_event"].get("total") for s in (one, two))
    return [
        target(
            "2 TaskManagers over 1, drain events/s",
            ratio(two["events_per_s"], one["events_per_s"]),
            ">=",
            1.0,
            "on two cores shared with the broker, Redis, the stand-in and the JobManager",
        ),
        target(
            "2 TaskManagers over 1, CPU ms per event of the whole stack",
            ratio(cpu_two, cpu_one),
            "<=",
            1.1,
        ),
        target(
            "2 TaskManagers, drain events/s over the core-bound rate",
            ratio(two["events_per_s"], two["core_bound_events_per_s"]),
            ">=",
            0.85,
        ),
        target(
            "2 slots in 1 TaskManager over 1 slot, drain events/s",
            ratio(shared["events_per_s"], one["events_per_s"]),
            ">=",
            1.0,
        ),
    ]


def run(args) -> dict[str, Any]:
    import tempfile

    started = time.monotonic()
    records = make_events(args.shoppers, args.duration_s, 7, args.events)
    results = []
    with tempfile.TemporaryDirectory(prefix="si-scale-") as tmp:
        stack = Stack(Path(tmp))
        try:
            for round_ in range(1, args.rounds + 1):
                for shape in SHAPES:
                    result = run_shape(stack, shape, records, Path(tmp), args)
                    results.append({"round": round_, **result})
        finally:
            stack.close()
    one, two, shared = (shape_mean(results, shape.label) for shape in SHAPES)
    return result_doc(
        BENCHMARK,
        started,
        shape_targets(one, two, shared),
        notes=[
            "LLM: bench/standin_llm.py, a STAND-IN that answers at once (the pipeline's own cost)",
            f"events topic of {PARTITIONS} partitions; one fresh cluster per shape and round",
            "targets and ratios: over each shape's mean of the rounds (the shapes interleaved)",
        ],
        cores=args.cores,
        rounds=args.rounds,
        shapes=results,
        means=[one, two, shared],
        ratios={
            "two_taskmanagers_over_one": rounded(ratio(two["events_per_s"], one["events_per_s"])),
            "two_slots_one_taskmanager_over_one": rounded(
                ratio(shared["events_per_s"], one["events_per_s"])
            ),
        },
    )


def shape_mean(results: Sequence[dict[str, Any]], label: str) -> dict[str, Any]:
    """A shape's rate, CPU per event (by kind) and core-bound rate, averaged over its rounds:
    one drain per shape on a shared 2-core host moved by a quarter from run to run
    (docs/lab_notebook.md), more than the gaps between shapes."""
    runs = [r for r in results if r["shape"] == label]

    def mean(values: Sequence[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return rounded(statistics.fmean(known)) if known else None

    kinds = sorted({k for r in runs for k in r["cpu_ms_per_event"]})
    return {
        "shape": label,
        "rounds": len(runs),
        "events_per_s": mean([r["events_per_s"] for r in runs]),
        "cpu_ms_per_event": {k: mean([r["cpu_ms_per_event"].get(k) for r in runs]) for k in kinds},
        "core_bound_events_per_s": mean([r["core_bound_events_per_s"] for r in runs]),
    }


def parse_args(argv: Sequence[str] | None):
    p = argparse.ArgumentParser(
        prog="python -m bench.scale_out", description=__doc__.split("\n")[0]
    )
    p.add_argument("--events", type=int, default=40_000, help="events drained per shape")
    p.add_argument("--shoppers", type=int, default=4_000, help="shoppers generated")
    p.add_argument("--duration-s", type=float, default=3600.0, help="event-time span generated")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per shape")
    p.add_argument(
        "--idle-s", type=float, default=20.0, help="each shape's job idles this long first"
    )
    p.add_argument(
        "--cores", type=int, default=len(os.sched_getaffinity(0)), help="for the core-bound rate"
    )
    p.add_argument(
        "--rounds", type=int, default=1, help="drains of every shape, the shapes interleaved"
    )
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()
    doc = run(args)
    path = write_result(doc, args.out)
    print(table(doc["shapes"]))
    if doc["rounds"] > 1:
        print("means over the rounds:")
        print(means_table(doc["means"]))
    print(targets_table(doc["targets"]))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
