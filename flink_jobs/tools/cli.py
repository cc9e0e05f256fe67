"""``shopper-intents``: run the job, or watch it work on an embedded stack.

``shopper-intents demo``
    Starts the embedded stack (broker, Redis, vLLM on the CPU, router), submits the job
    to a PyFlink mini-cluster (or, with ``--taskmanagers N``, to a standalone cluster of a
    JobManager and N TaskManager processes with ``flink run``), replays the bundled
    sample of shopper sessions, shows progress and the intents as they land, prints a
    summary and stops everything when the run has settled (or on Ctrl-C). With
    ``--external`` it starts nothing and uses the Kafka, Redis and LLM endpoints of the
    configuration.

``shopper-intents run``
    Runs the job against the endpoints in the configuration (env / properties file).

``shopper-intents eval``
    Runs the job bounded with the real model once per template arm over the same events
    and scores every intent against what the shopper did next (``eval_runner``).

``shopper-intents distill data|train``
    Builds training examples from recorded events (trigger points, compact prompts,
    hindsight targets) and trains a LoRA adapter on them (``distill``).

``shopper-intents plan --events-per-s N``
    Sizes Managed Flink KPUs, vLLM GPUs, router replicas and Redis shards for a rate of
    events from the unit costs measured in ``bench/results`` (``sizing``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import redis

from flink_jobs.config import AppConfig, ConfigError, load_config
from flink_jobs.paths import cache_dir, resource_dir
from flink_jobs.tools import eval_runner
from flink_jobs.tools.distill import commands as distill_commands
from flink_jobs.tools.embedded_stack import LLM_NICENESS
from flink_jobs.tools.local_services import stop_on_sigterm
from flink_jobs.tools.run_summary import (
    events_accounted,
    latency_summary,
    prompts_settled,
    read_intents,
    read_prefix_cache,
    read_samples,
    read_stats,
    wait_for_task_starts,
)
from flink_jobs.tools.sizing import command as sizing_command

if TYPE_CHECKING:
    from flink_jobs.tools.embedded_stack import ServedModel
    from flink_jobs.tools.replay import ReplaySummary, SourceRecord

log = logging.getLogger("shopper-intents")

DEFAULT_SAMPLE = resource_dir("sample") / "sample_sessions.jsonl"
#: The template the distilled adapter was trained on (flink_jobs/tools/distill/).
ADAPTER_TEMPLATE = "shopper_intent_compact.j2"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shopper-intents", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the job end to end on an embedded stack")
    demo.add_argument(
        "--sample", type=Path, default=DEFAULT_SAMPLE, help="events to replay (JSONL/CSV)"
    )
    demo.add_argument(
        "--speed", type=float, default=30.0, help="replay speed-up (default %(default)s)"
    )
    demo.add_argument(
        "--external",
        action="store_true",
        help="use the Kafka, Redis and LLM endpoints of the configuration, start nothing",
    )
    demo.add_argument(
        "--shoppers", type=int, default=100, help="replay the first N shoppers (0: all)"
    )
    demo.add_argument("--llm-workers", type=int, default=2, help="vLLM workers (one core each)")
    demo.add_argument(
        "--llm-niceness",
        type=int,
        default=LLM_NICENESS,
        help=f"scheduling niceness of the vLLM workers, 0-19 (default {LLM_NICENESS})",
    )
    demo.add_argument(
        "--llm-cores",
        type=_core_list,
        default=(),
        help="cores to pin the vLLM workers to, round-robin, e.g. 1 or 2,3 (default: all)",
    )
    demo.add_argument(
        "--taskmanagers",
        type=int,
        default=0,
        help="run the job on a standalone cluster of N TaskManagers (one slot each) instead"
        " of the in-process mini-cluster, which starts faster (default: the mini-cluster)",
    )
    demo.add_argument(
        "--parallelism",
        type=int,
        default=None,
        help="the job's parallelism (default: 1, or the TaskManagers' slots on a cluster)",
    )
    demo.add_argument(
        "--workdir", type=Path, default=None, help="logs and state (default: <cache>/demo)"
    )
    demo.add_argument(
        "--timeout", type=float, default=1200.0, help="give up after this many seconds"
    )
    demo.add_argument(
        "--adapter",
        type=Path,
        default=None,
        help="serve this adapter (a distill train folder, merged into a model folder) and"
        " prompt every shopper with"
        f" {ADAPTER_TEMPLATE} through it (default: v3 with the base model)",
    )
    sub.add_parser("run", help="run the job against the configured endpoints")
    eval_runner.add_parser(sub)
    distill_commands.add_parser(sub)
    sizing_command.add_parser(sub)
    args = parser.parse_args(argv)
    stop_on_sigterm()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("py4j", "httpx", "apache_beam"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        if args.command == "run":
            from flink_jobs.job import main as run_job

            run_job()
            return 0
        if args.command == "eval":
            return eval_runner.run_eval(args)
        if args.command == "distill":
            return distill_commands.run(args)
        if args.command == "plan":
            return sizing_command.run(args)
        return run_demo(args)
    except ConfigError as exc:
        log.error("configuration error: %s", exc)
        return 2
    except KeyboardInterrupt:
        log.info("interrupted")
        return 130


def _core_list(text: str) -> tuple[int, ...]:
    """``--llm-cores``: comma-separated core numbers, or ``all`` (an empty tuple)."""
    if text.strip() == "all":
        return ()
    try:
        cores = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected core numbers like 1 or 2,3, or 'all'; got {text!r}"
        ) from None
    from inference_sidecar.workers import available_cores

    allowed = available_cores()
    outside = [core for core in cores if core not in allowed]
    if outside:
        raise argparse.ArgumentTypeError(
            f"{outside} not among the cores this process may use: {list(allowed)}"
        )
    return cores


def run_demo(args: argparse.Namespace) -> int:
    from flink_jobs.tools.embedded_stack import EVENTS_PARTITIONS, start_embedded_stack
    from flink_jobs.tools.replay import read_records

    records = first_shoppers(read_records(args.sample), args.shoppers)
    workdir = args.workdir or cache_dir() / "demo"
    workdir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as resources:
        config = load_config()
        worker_urls: list[str] = []
        if not args.external:
            topics = [config.kafka.events_topic, config.kafka.dead_letter_topic]
            stack = resources.enter_context(
                start_embedded_stack(
                    workdir,
                    topics,
                    llm_workers=args.llm_workers,
                    llm_niceness=args.llm_niceness,
                    llm_cores=args.llm_cores,
                    partitions=max(EVENTS_PARTITIONS, args.parallelism or 0, args.taskmanagers),
                    llm_model=_served_adapter(args.adapter),
                )
            )
            overrides = stack.config_overrides()
            overrides["kafka"]["starting_offsets"] = "earliest"
            if args.adapter is not None:
                # The adapter's arm for every shopper: its compact template, its model.
                overrides["prompt"] = {"template": ADAPTER_TEMPLATE}
                overrides["llm"]["model"] = args.adapter.name
            config = load_config(overrides=overrides)
            worker_urls = stack.llm.worker_urls
        if args.taskmanagers > 0:
            _submit_to_cluster(args, config, workdir, resources)
        else:
            from flink_jobs.job import create_job

            if args.parallelism:
                config = load_config(
                    overrides={**_overrides_of(config), "job": {"parallelism": args.parallelism}}
                )
            log.info("submitting the Flink job to a local mini-cluster")
            job = create_job(config).execute_async(config.job.name)
            resources.callback(_cancel, job)
        return _watch(args, config, worker_urls, records, workdir)


def _served_adapter(adapter: Path | None) -> ServedModel | None:
    """The workers' model: the base (None), or ``adapter`` merged into a model folder and
    served under the adapter folder's name (on a CPU twice as fast as a LoRA module:
    docs/distillation.md)."""
    from flink_jobs.tools.distill.serving import merged_model
    from flink_jobs.tools.embedded_stack import ServedModel

    if adapter is None:
        return None
    if not (adapter / "adapter_config.json").exists():
        raise SystemExit(f"--adapter {adapter}: no adapter_config.json (distill train writes one)")
    return ServedModel(name=adapter.name, model_dir=merged_model(adapter))


def _overrides_of(config: AppConfig) -> dict[str, dict[str, Any]]:
    """The endpoints a demo's embedded stack put into ``config``, as overrides again."""
    return {
        "kafka": {
            "bootstrap_servers": config.kafka.bootstrap_servers,
            "starting_offsets": config.kafka.starting_offsets,
            "source_properties": dict(config.kafka.source_properties),
        },
        "redis": {"url": config.redis.url},
        "llm": {"base_url": config.llm.base_url, "request_timeout_s": config.llm.request_timeout_s},
    }


def _submit_to_cluster(
    args: argparse.Namespace, config: AppConfig, workdir: Path, resources: ExitStack
) -> None:
    """A JobManager and ``--taskmanagers`` TaskManagers, the job submitted with ``flink
    run`` at ``--parallelism`` (default: every slot), its settings in the environment as
    Managed Flink or docker-compose would give them."""
    from flink_jobs.tools.flink_cluster import ClusterSpec, FlinkCluster, job_script, settings_env

    cluster = resources.enter_context(
        FlinkCluster(workdir / "flink", ClusterSpec(taskmanagers=args.taskmanagers))
    )
    parallelism = args.parallelism or args.taskmanagers
    env = settings_env({**_overrides_of(config), "job": {"parallelism": 0}})
    log.info(
        "submitting the Flink job to a cluster of %d TaskManager(s) at parallelism %d",
        args.taskmanagers,
        parallelism,
    )
    job_id = cluster.submit(job_script(), env, parallelism)
    resources.callback(cluster.cancel, job_id)


def _cancel(job: Any) -> None:  # PyFlink's JobClient
    log.info("cancelling the job and stopping the stack")
    try:
        job.cancel().result()
    except Exception as exc:  # the job may already have failed; say so, don't mask it
        log.warning("job cancel: %s", exc)


def first_shoppers(records: list[SourceRecord], limit: int) -> list[SourceRecord]:
    """The records of the first ``limit`` shoppers, plus every record without a readable
    shopper id (the bad ones, which the demo should show being dead-lettered)."""
    if limit <= 0:
        return records
    from flink_jobs.tools.replay import shopper_key

    kept: set[bytes] = set()
    out = []
    for record in records:
        key = record.key or shopper_key(record.value)
        if key is not None and key not in kept:
            if len(kept) >= limit:
                continue
            kept.add(key)
        out.append(record)
    return out


def _watch(
    args: argparse.Namespace,
    config: AppConfig,
    worker_urls: list[str],
    records: list[SourceRecord],
    workdir: Path,
) -> int:
    from flink_jobs.tools.replay import replay_records

    client = redis.Redis.from_url(config.redis.url)
    prefix = config.redis.key_prefix
    replay_result: dict[str, ReplaySummary] = {}

    def send(part: list[SourceRecord]) -> ReplaySummary:
        return replay_records(
            config.kafka.bootstrap_servers,
            config.kafka.events_topic,
            part,
            speed=args.speed,
            rebase_time="send",
        )

    def replay() -> None:
        # Once the job's source task is up: the freshness figures are the running job's,
        # not its start-up's (the JVM, the Python worker and the source's first fetch took
        # 3-5 s here, and the first prompts waited for them).
        if not wait_for_task_starts(client, prefix, 1, JOB_START_TIMEOUT_S):
            log.warning("the job did not start in %.0f s; replaying anyway", JOB_START_TIMEOUT_S)
        replay_result["summary"] = send(records)

    log.info("replaying %d records from %s at %.0fx", len(records), args.sample, args.speed)
    started = time.monotonic()
    replayer = threading.Thread(target=replay, name="replay", daemon=True)
    replayer.start()

    seen: dict[str, int] = {}
    settled_since: float | None = None
    quiet_needed = config.trigger.max_wait_s + 5
    while time.monotonic() - started < args.timeout:
        time.sleep(2.0)
        stats = read_stats(client, prefix)
        for row in read_intents(client, prefix):
            if seen.get(row.shopper_id) != row.written_at_ms:
                seen[row.shopper_id] = row.written_at_ms
                latency_s = row.latency_ms / 1000
                print(
                    f"  intent  {row.shopper_id:<14} {row.top_label:<20} {latency_s:5.1f} s"
                    f"  {row.summary[:60]}"
                )
        print(
            f"[{time.monotonic() - started:6.0f}s]"
            f" events in {stats.get('events_in', 0)}/{len(records)}"
            f"  dead-lettered {stats.get('dead_letter_decode', 0)}"
            f"  prompts {stats.get('prompts_sent', 0)} (done {prompts_settled(stats)},"
            f" superseded {stats.get('prompts_superseded', 0)})"
            f"  intents in Redis {len(seen)}",
            flush=True,
        )
        done = (
            not replayer.is_alive()
            and stats.get("events_in", 0) >= len(records)
            and events_accounted(stats) == stats.get("events_in", 0)
            and prompts_settled(stats) == stats.get("prompts_sent", 0)
        )
        if not done:
            settled_since = None
        elif settled_since is None:
            settled_since = time.monotonic()
        elif time.monotonic() - settled_since >= quiet_needed:
            break
    else:
        log.error("the run did not settle within %.0f s", args.timeout)
        return 1

    elapsed = time.monotonic() - started
    summary = _summary(client, prefix, stats, worker_urls, elapsed, replay_result.get("summary"))
    (workdir / "summary.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    print(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
    log.info("summary written to %s", workdir / "summary.json")
    return 0


#: How long the demo waits for the job's source task to start before replaying.
JOB_START_TIMEOUT_S = 180.0


def _summary(
    client: redis.Redis,
    prefix: str,
    stats: dict[str, int],
    worker_urls: list[str],
    elapsed: float,
    replay_summary: ReplaySummary | None,
) -> dict[str, Any]:
    cache = read_prefix_cache(worker_urls) if worker_urls else None
    return {
        "elapsed_s": round(elapsed, 1),
        "replay": replay_summary.describe("events") if replay_summary else None,
        "stats": stats,
        "shoppers_with_intent": len(read_intents(client, prefix)),
        "event_to_intent_latency_s": latency_summary(
            read_samples(client, prefix, "event_to_intent_ms")
        ),
        # The rules-only record's freshness (llm.rules_first): the grounded part's staleness.
        "event_to_rules_latency_s": latency_summary(
            read_samples(client, prefix, "event_to_rules_ms")
        ),
        # Its share spent in the job, before the prompt reached the LLM calls' outbox.
        "event_to_prompt_latency_s": latency_summary(
            read_samples(client, prefix, "event_to_prompt_ms")
        ),
        "llm_latency_s": latency_summary(read_samples(client, prefix, "llm_latency_ms")),
        "llm_calls_per_event": round(
            stats.get("llm_calls", 0) / max(1, stats.get("events_accepted", 0)), 3
        ),
        "prefix_cache_hit_ratio": round(cache.hit_ratio, 3) if cache else None,
    }


if __name__ == "__main__":
    sys.exit(main())
