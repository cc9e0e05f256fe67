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
than this one would approach. Results: ``bench/results/scale_out.json``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from bench._common import (
    RESULTS_DIR,
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


def run_shape(stack: Stack, shape: Shape, records: Sequence[bytes], workdir: Path, args):
    from flink_jobs.tools.flink_cluster import ClusterSpec, FlinkCluster, job_script, settings_env

    name = f"scale-{shape.taskmanagers}tm{shape.slots}s-p{shape.parallelism}-{int(time.time())}"
    create_topics(stack.kafka.bootstrap, [f"{name}-events"], PARTITIONS)
    create_topics(stack.kafka.bootstrap, [f"{name}-dlq"], 1)
    produce_s = preload(stack.kafka.bootstrap, f"{name}-events", records)
    print(f"{shape.label}: {len(records):,} events on the topic in {produce_s:.1f} s")
    client = redis.Redis.from_url(stack.redis.url)
    memory = PeakMemory(os.getpid())
    spec = ClusterSpec(taskmanagers=shape.taskmanagers, slots_per_taskmanager=shape.slots)
    with FlinkCluster(workdir / name, spec) as cluster:
        started = time.monotonic()
        job_id = cluster.submit(
            job_script(), settings_env(_settings(stack, name)), shape.parallelism
        )
        try:
            _, counts, per_event = poll_drain(client, name, len(records), args.timeout_s, memory)
        finally:
            cluster.cancel(job_id)
        wall = time.monotonic() - started
    rate = drain_rate(counts, len(records))
    result = {
        "shape": shape.label,
        "taskmanagers": shape.taskmanagers,
        "slots_per_taskmanager": shape.slots,
        "parallelism": shape.parallelism,
        "events": len(records),
        "done": counts[-1][1],
        "wall_s_from_submit": round(wall, 1),
        "events_per_s": rounded(rate, 0),
        "cpu_ms_per_event": per_event,
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
    head = ["shape", "events/s", "CPU ms/event", *kinds, "core-bound events/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for s in shapes:
        cpu = s["cpu_ms_per_event"]
        row = [s["shape"], s["events_per_s"], cpu.get("total"), *(cpu.get(k, "") for k in kinds)]
        lines.append("| " + " | ".join(str(v) for v in [*row, s["core_bound_events_per_s"]]) + " |")
    return "\n".join(lines)


def run(args) -> dict[str, Any]:
    import tempfile

    started = time.time()
    records = make_events(args.shoppers, args.duration_s, 7, args.events)
    results = []
    with tempfile.TemporaryDirectory(prefix="si-scale-") as tmp:
        stack = Stack(Path(tmp))
        try:
            for shape in SHAPES:
                results.append(run_shape(stack, shape, records, Path(tmp), args))
        finally:
            stack.close()
    one, two, shared = (r["events_per_s"] for r in results)
    targets = [
        target(
            "2 TaskManagers over 1, drain events/s",
            ratio(two, one),
            ">=",
            1.0,
            "on two cores shared with the broker, Redis, the stand-in and the JobManager",
        ),
        target(
            "2 slots in 1 TaskManager over 1 slot, drain events/s", ratio(shared, one), ">=", 1.0
        ),
    ]
    return result_doc(
        BENCHMARK,
        started,
        targets,
        notes=[
            "LLM: bench/standin_llm.py, a STAND-IN that answers at once (the pipeline's own cost)",
            f"events topic of {PARTITIONS} partitions; one fresh cluster per shape",
        ],
        cores=args.cores,
        shapes=results,
        ratios={
            "two_taskmanagers_over_one": rounded(ratio(two, one)),
            "two_slots_one_taskmanager_over_one": rounded(ratio(shared, one)),
        },
    )


def parse_args(argv: Sequence[str] | None):
    p = argparse.ArgumentParser(
        prog="python -m bench.scale_out", description=__doc__.split("\n")[0]
    )
    p.add_argument("--events", type=int, default=40_000, help="events drained per shape")
    p.add_argument("--shoppers", type=int, default=4_000, help="shoppers generated")
    p.add_argument("--duration-s", type=float, default=3600.0, help="event-time span generated")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per shape")
    p.add_argument(
        "--cores", type=int, default=len(os.sched_getaffinity(0)), help="for the core-bound rate"
    )
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()
    doc = run(args)
    path = write_result(doc, args.out)
    print(table(doc["shapes"]))
    print(targets_table(doc["targets"]))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
