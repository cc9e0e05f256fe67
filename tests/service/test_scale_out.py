"""The job on a standalone Flink cluster (a JobManager and two TaskManager processes, two
slots each, spread evenly, Python in thread mode), submitted with ``flink run`` as Managed
Flink and docker-compose submit it, on the real broker and Redis, with LLM stand-ins
(``bench/standin_llm.py``) behind the real router: the subject is the stream.

Runs P2 and P4: the bundled sample (300 shoppers, 3,098 records with its bad ones) on a
topic of four partitions, read to its end at parallelism 2 and at 4, so each TaskManager
runs one subtask of every operator (two at P4, sharing its interpreter), each with its own
outbox, call process and counters.

Run R, rescales while events keep arriving (generated samples replayed at their pace, one
after another until the job has restarted from the kill, so no phase outlasts the events
however slowly the cluster settles): the job starts at parallelism 1, is stopped with a
savepoint and restored at 2, stopped with a savepoint again and restored at 1 (what
Managed Flink's autoscaling does); then the TaskManager running it is SIGKILLed
mid-stream, and the job restarts from its last checkpoint in the other TaskManager's
slots, and runs until every prompt is answered.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
import redis

from flink_jobs.checkpoints import latest_checkpoint
from flink_jobs.tools.flink_cluster import ClusterSpec, FlinkCluster, job_script, settings_env
from flink_jobs.tools.local_services import (
    cache_dir,
    create_topics,
    free_port,
)
from flink_jobs.tools.replay import read_records, replay_records
from flink_jobs.tools.run_summary import (
    EVENT_OUTCOMES,
    group_lag,
    group_progress,
    prompts_settled,
    read_json_topic,
    read_stats,
)
from flink_jobs.tools.sample_data import BadRecords, SampleConfig, generate_sample
from intent_reader.layout import SOURCE_RANKS, intent_key
from intent_reader.updates import IntentUpdate, IntentUpdates
from tests.support.answers import Unanswered, unanswered_in
from tests.support.dashboards import FLINK_PREFIX, flink_builtin_names_used, grouping_labels_used
from tests.support.job_process import call_processes, job_groups
from tests.support.stream import move_event_time
from tests.support.waiting import until

pytestmark = pytest.mark.timeout(20 * 60)

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "data" / "sample_sessions.jsonl"
EXPECTED = REPO / "data" / "sample_sessions.expected.json"
PARTITIONS = 4
TIMEOUT_S = 480  # a standalone cluster of three JVMs on two shared cores is slow to settle
# One record per batch: Tansu reports a partition's end as its last batch's first offset
# + 1, and a bounded job stops there (docs/event_time.md).
ONE_PER_BATCH = {"batch.num.messages": 1, "linger.ms": 0}
# Run R: how long each phase runs with events flowing before the next step.
RESCALE_SHOPPERS = 30
RESCALE_SPEED = 2.0
PHASE_EVENTS = 20
ROUND_S = 80.0  # event time per replayed sample: 40 s of sending at RESCALE_SPEED
MAX_ROUNDS = 20  # bounds the replay if the job never restarts
# Run R's waits, as multiples of its first phase (submitted, running, PHASE_EVENTS read),
# timed on this host under its load: a slower host waits longer, a wedged run fails sooner.
PACE_FACTOR = 8
MIN_WAIT_S = 60.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> FlinkCluster:
    first = free_port()
    spec = ClusterSpec(
        taskmanagers=2,
        slots_per_taskmanager=2,
        taskmanager_memory="1600m",  # two subtasks' Python share each TaskManager's process
        reporter_ports=range(first, first + 8),
        # Without it, parallelism 2 could fill one TaskManager's two slots.
        extra={"taskmanager.load-balance.mode": "SLOTS"},
    )
    with FlinkCluster(tmp_path_factory.mktemp("flink"), spec) as started:
        yield started


def _groups(name: str, bootstrap: str, redis_url: str, llm: dict, **job) -> dict:
    groups = job_groups(name, bootstrap, redis_url, llm)
    groups["kafka"]["prompts_topic"] = f"{name}-prompts"
    groups["redis"]["notify_stream"] = f"{name}:updates"
    # The cluster's -p decides, as Managed Flink's parallelism setting would.
    groups["job"] = {"parallelism": 0, "checkpoint_interval_s": 2, **job}
    return groups


def _now_ms() -> int:
    return int(time.time() * 1000)


def _topics(bootstrap: str, name: str) -> None:
    create_topics(bootstrap, [f"{name}-events"], PARTITIONS)
    create_topics(bootstrap, [f"{name}-dlq", f"{name}-prompts"], 1)


def _watching(
    cluster: FlinkCluster, job_id: str, timeout_s: float = TIMEOUT_S, state=lambda: ""
) -> dict:
    """The settings of a wait on the job (``until(check, what, **_watching(...))``): it
    stops when the job FAILED or was CANCELED, and says ``state()`` (what was still
    missing), the job's status and the TaskManagers' log tails, so a failed run explains
    itself from the CI output alone."""

    def ended() -> str | None:
        status = cluster.status(job_id)
        if status in ("FAILED", "CANCELED"):
            return f"job {status}: {cluster.exceptions(job_id)}"
        return None

    def explain() -> str:
        tails = "\n".join(f"--- {tm.name}:\n{tm.log_tail()}" for tm in cluster.live_taskmanagers())
        return f"job {cluster.status(job_id)}; {state()}\n{tails}"

    return {"timeout_s": timeout_s, "interval_s": 0.5, "give_up": ended, "explain": explain}


def _writes(client: redis.Redis, name: str) -> list[IntentUpdate]:
    return IntentUpdates(client, f"{name}:updates", start="earliest", batch=100_000).read(
        block_s=None
    )


def _regressions(writes: list[IntentUpdate]) -> list[str]:
    """Shoppers whose landed writes were not in strictly increasing version order."""
    by_shopper: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for w in writes:
        by_shopper[w.shopper_id].append((w.version_ts, w.version_seq, SOURCE_RANKS[w.source]))
    return [s for s, t in by_shopper.items() if t != sorted(set(t))]


def _newest_prompts(prompts: list[dict]) -> dict[str, tuple[int, int]]:
    newest: dict[str, tuple[int, int]] = {}
    for p in prompts:
        version = (p["version_ts"], p["seq"])
        newest[p["shopper_id"]] = max(newest.get(p["shopper_id"], version), version)
    return newest


# --- runs P2 and P4: the bundled sample at parallelism 2 and 4 ---------------------------


@dataclass
class ParallelRun:
    parallelism: int
    expected: dict
    produced: int
    stats: dict[str, int]
    intents: set[str]
    writes: list[IntentUpdate]
    prompts: list[dict]
    dead_letters: list[dict]
    hosts: dict[str, list[str]]
    unanswered: list[Unanswered]
    status: str


@pytest.fixture(scope="module", params=[2, 4], ids=["p2", "p4"])
def parallel_run(request, cluster, kafka_bootstrap, redis_url, standin_tier) -> ParallelRun:
    parallelism = request.param
    name = f"p{parallelism}-{time.monotonic_ns()}"
    _topics(kafka_bootstrap, name)
    records = read_records(SAMPLE)
    sent = replay_records(
        kafka_bootstrap, f"{name}-events", records, rebase_time="last", extra_config=ONE_PER_BATCH
    )
    assert sent.ok, sent.describe(f"{name}-events")
    groups = _groups(name, kafka_bootstrap, redis_url, standin_tier.job_settings())
    groups["kafka"]["bounded"] = True
    job_id = cluster.submit(
        job_script(), settings_env(groups), parallelism=parallelism, log_name=name
    )
    cluster.wait_running(job_id)
    hosts = cluster.placement(job_id)
    until(
        lambda: cluster.status(job_id) == "FINISHED",
        "the bounded job to finish",
        **_watching(cluster, job_id),
    )
    client = redis.Redis.from_url(redis_url)
    stats = read_stats(client, name)
    prompts = read_json_topic(kafka_bootstrap, f"{name}-prompts", timeout_s=10)
    dead_letters = read_json_topic(kafka_bootstrap, f"{name}-dlq", timeout_s=10)
    run = ParallelRun(
        parallelism=parallelism,
        expected=orjson.loads(EXPECTED.read_bytes()),
        produced=len(records),
        stats=stats,
        intents={
            k.decode().rsplit(":", 1)[1] for k in client.scan_iter(match=intent_key("*", name))
        },
        writes=_writes(client, name),
        prompts=prompts,
        dead_letters=dead_letters,
        hosts=hosts,
        unanswered=unanswered_in(client, name, prompts, dead_letters),
        status=cluster.status(job_id),
    )
    client.close()
    return run


def test_every_operator_ran_its_subtasks_spread_evenly_on_two_taskmanagers(
    parallel_run: ParallelRun,
):
    assert parallel_run.status == "FINISHED"
    per_taskmanager = parallel_run.parallelism // 2
    spread = {name: sorted(Counter(h).values()) for name, h in parallel_run.hosts.items()}
    assert spread and all(c == [per_taskmanager] * 2 for c in spread.values()), spread


def test_in_parallel_the_counts_balance_exactly(parallel_run: ParallelRun):
    s = parallel_run.stats
    assert s["events_in"] == parallel_run.produced
    assert sum(s.get(name, 0) for name in EVENT_OUTCOMES) == s["events_in"]
    assert prompts_settled(s) == s["prompts_sent"] > 0
    assert s["prompts_sent"] == len(parallel_run.prompts)


def test_in_parallel_every_qualifying_shopper_gets_an_intent(parallel_run: ParallelRun):
    missing = set(parallel_run.expected["qualifying_shoppers"]) - parallel_run.intents
    assert not missing, sorted(missing)
    assert parallel_run.unanswered == []


def test_in_parallel_no_write_lands_over_a_newer_one(parallel_run: ParallelRun):
    assert len(parallel_run.writes) >= len(parallel_run.intents) > 0
    assert _regressions(parallel_run.writes) == []


def test_in_parallel_the_dead_letters_are_exactly_the_bad_records(parallel_run: ParallelRun):
    decode = [d for d in parallel_run.dead_letters if d["stage"] == "decode"]
    assert Counter(d["reason"] for d in decode) == Counter(
        parallel_run.expected["dead_letter_by_reason"]
    )
    assert parallel_run.stats["dead_letter_decode"] == len(decode)
    assert parallel_run.stats.get("events_duplicate", 0) == parallel_run.expected["duplicates"]


# --- run R: 1 -> 2 -> 1 through savepoints, then a TaskManager killed, while events arrive --


def _checkpoints(cluster: FlinkCluster, job_id: str) -> int:
    """Checkpoints the job completed."""
    found = cluster._rest(f"/jobs/{job_id}/checkpoints") or {}
    return found.get("counts", {}).get("completed", 0)


def _scrape_once_counted(cluster: FlinkCluster, job_id: str, timeout_s: float) -> dict:
    """The reporters' series once a checkpoint completed and every decoder subtask has
    published a count of its records (``metrics.GaugeBoard`` copies them every few s)."""
    scraped: dict = {}

    def counted() -> bool:
        scraped.update(cluster.scrape_metrics())
        events_in = scraped.get(FLINK_PREFIX + "events_in", [])
        return len(events_in) == 2 and all(value > 0 for _labels, value in events_in)

    until(
        lambda: _checkpoints(cluster, job_id) > 0 and counted(), "counts",
        **_watching(cluster, job_id, timeout_s),
    )  # fmt: skip
    return scraped


def _restarted(cluster: FlinkCluster, job_id: str) -> bool:
    """The job went through RESTARTING since it was submitted (its status timestamps)."""
    return bool(cluster.job(job_id).get("timestamps", {}).get("RESTARTING"))


@dataclass
class Phase:
    parallelism: int
    savepoint: str | None = None
    # What the cluster's Prometheus reporters served mid-phase, once a checkpoint completed.
    reported: dict[str, list[tuple[dict[str, str], float]]] | None = None
    stats: dict[str, int] | None = None  # at its stop-with-savepoint
    committed: int | None = None  # records the consumer group had committed by then


@dataclass
class RescaleRun:
    produced: int
    phases: list[Phase]
    killed: str
    call_processes_at_kill: int  # across the TaskManagers, with the job at parallelism 1
    restarted: bool
    stats: dict[str, int]
    writes: list[IntentUpdate]
    prompts: list[dict]
    unanswered: list[Unanswered]
    replay_ended_before_the_kill: bool
    lag_at_end: int


@pytest.fixture(scope="module")
def rescaled_run(cluster, kafka_bootstrap, redis_url, standin_tier, tmp_path_factory) -> RescaleRun:
    workdir = tmp_path_factory.mktemp("rescale")
    name = f"rescale-{time.monotonic_ns()}"
    _topics(kafka_bootstrap, name)
    groups = _groups(
        name, kafka_bootstrap, redis_url, standin_tier.job_settings(),
        checkpoint_dir=str(workdir / "checkpoints"), watermark_idle_advance_s=5,
    )  # fmt: skip
    env = settings_env(groups)
    client = redis.Redis.from_url(redis_url)
    replayed, enough = threading.Event(), threading.Event()
    produced = []

    def replay() -> None:
        """Samples of the same shoppers with fresh event ids, each stamped with its send
        times, until ``enough`` (or ``MAX_ROUNDS``)."""
        for seed in range(29, 29 + MAX_ROUNDS):
            config = SampleConfig(
                shoppers=RESCALE_SHOPPERS, seed=seed, duration_s=ROUND_S, bad=BadRecords.none()
            )
            records = generate_sample(config).records
            sent = replay_records(
                kafka_bootstrap, f"{name}-events", records, speed=RESCALE_SPEED,
                rebase_time="send",
            )  # fmt: skip
            assert sent.ok, sent.describe(f"{name}-events")
            produced.append(len(records))
            if enough.is_set():
                break
        replayed.set()

    def events_in() -> int:
        return read_stats(client, name).get("events_in", 0)

    timeout = {"s": TIMEOUT_S}  # until the first phase has been timed

    def watching(job_id: str, state=lambda: "") -> dict:
        return _watching(cluster, job_id, timeout["s"], state)

    def run_for(job_id: str, events: int) -> None:
        start = events_in()
        until(lambda: events_in() >= start + events, f"{events} more events", **watching(job_id))

    phases = [Phase(1), Phase(2), Phase(1)]
    savepoint = None
    threading.Thread(target=replay, daemon=True).start()
    try:
        for i, phase in enumerate(phases):
            started = time.monotonic()
            job_id = cluster.submit(
                job_script(), env, phase.parallelism, savepoint, log_name=f"{name}-{i}"
            )
            cluster.wait_running(job_id)
            run_for(job_id, PHASE_EVENTS)
            if i == 0:
                timeout["s"] = max(MIN_WAIT_S, PACE_FACTOR * (time.monotonic() - started))
            if i == len(phases) - 1:
                break
            # The source commits a savepoint's offsets as the job stops and may not get to
            # it (seen: none committed after the first savepoint, on a loaded host); a
            # checkpoint's commit before it gives the phase a count to check.
            until(
                lambda: group_progress(kafka_bootstrap, name, f"{name}-events")[0] > 0,
                "the group's first committed offsets", **watching(job_id),
            )  # fmt: skip
            if phase.parallelism > 1:
                phase.reported = _scrape_once_counted(cluster, job_id, timeout["s"])
            savepoint = phase.savepoint = cluster.stop_with_savepoint(
                job_id, workdir / "savepoints"
            )
            phase.stats = read_stats(client, name)
            phase.committed = group_progress(kafka_bootstrap, name, f"{name}-events")[0]
        # The last phase's TaskManager dies mid-stream once this phase has sent a prompt (its
        # call process runs) and a checkpoint has completed after it; the job restarts from
        # that checkpoint in the other TaskManager's free slot.
        sent_before = phases[1].stats.get("prompts_sent", 0)
        until(
            lambda: read_stats(client, name).get("prompts_sent", 0) > sent_before,
            "a prompt at parallelism 1", **watching(job_id),
        )  # fmt: skip
        checkpoint = latest_checkpoint(workdir / "checkpoints")
        until(
            lambda: latest_checkpoint(workdir / "checkpoints") != checkpoint,
            "a checkpoint at parallelism 1", **watching(job_id),
        )  # fmt: skip
        replay_ended_before_the_kill = replayed.is_set()
        call_processes_at_kill = sum(
            len(call_processes(tm.pid)) for tm in cluster.live_taskmanagers()
        )
        # Chosen by where Flink placed the keyed operator, not by its call process.
        victim = cluster.taskmanager_running(job_id, "shopper-sessions")
        victim.kill()
        until(lambda: _restarted(cluster, job_id), "the job to restart", **watching(job_id))
        cluster.wait_running(job_id)
        enough.set()
        until(replayed.is_set, "the replay to end", **watching(job_id))
        # Past the quiet period and max wait of the replay's last events, on every partition
        # (tests.support.stream): the last prompts fire as the job reads it.
        move_event_time(kafka_bootstrap, f"{name}-events", PARTITIONS, _now_ms() + 30_000)
        covered: dict[str, int] = {}
        seen: dict = {}

        def answered() -> bool:
            """A checkpoint covers every record, the marker included (the group's commits,
            not events_in: the killed TaskManager took the counts it had not flushed, some
            for records before the checkpoint the job restarted from); a later checkpoint
            has flushed the prompts the marker fired; every shopper's newest prompt is
            answered or dead-lettered."""
            lag = group_lag(kafka_bootstrap, name, f"{name}-events")
            seen.update(lag=lag)
            if lag:
                return False
            covered.setdefault("at", _checkpoints(cluster, job_id))
            prompts = read_json_topic(kafka_bootstrap, f"{name}-prompts", timeout_s=5)
            dead = read_json_topic(kafka_bootstrap, f"{name}-dlq", timeout_s=5)
            open_ = unanswered_in(client, name, prompts, dead)
            seen.update(prompts=len(prompts), unanswered=open_)
            return not open_ and _checkpoints(cluster, job_id) > covered["at"]

        def state() -> str:
            unanswered = "\n  ".join(str(u) for u in seen.get("unanswered", ()))
            return (
                f"group lag {seen.get('lag')}, {seen.get('prompts')} prompts on the topic, "
                f"stats {read_stats(client, name)}\nunanswered:\n  {unanswered}"
            )

        until(answered, "every shopper's newest prompt to be answered", **watching(job_id, state))
        restarted = _restarted(cluster, job_id)
    finally:
        enough.set()
        cluster.cancel(job_id)
    prompts = read_json_topic(kafka_bootstrap, f"{name}-prompts", timeout_s=10)
    dead = read_json_topic(kafka_bootstrap, f"{name}-dlq", timeout_s=10)
    run = RescaleRun(
        produced=sum(produced),
        phases=phases,
        killed=victim.name,
        call_processes_at_kill=call_processes_at_kill,
        restarted=restarted,
        stats=read_stats(client, name),
        writes=_writes(client, name),
        prompts=prompts,
        unanswered=unanswered_in(client, name, prompts, dead),
        lag_at_end=group_lag(kafka_bootstrap, name, f"{name}-events"),
        replay_ended_before_the_kill=replay_ended_before_the_kill,
    )
    # What a failed run is diagnosed from: every prompt each attempt wrote, and the counts.
    report = cache_dir() / "reports" / "scale_out_rescale.json"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_bytes(
        orjson.dumps(
            {"stats": run.stats, "prompts": prompts, "dead_letters": dead,
             "unanswered": [str(u) for u in run.unanswered]},
            option=orjson.OPT_INDENT_2,
        )
    )  # fmt: skip
    client.close()
    return run


def test_the_job_was_rescaled_1_2_1_through_savepoints_while_events_arrived(
    rescaled_run: RescaleRun,
):
    assert [p.parallelism for p in rescaled_run.phases] == [1, 2, 1]
    for phase in rescaled_run.phases[:2]:
        assert Path(phase.savepoint.removeprefix("file:")).joinpath("_metadata").exists()
    assert not rescaled_run.replay_ended_before_the_kill


def test_up_to_each_savepoint_every_record_the_group_committed_was_counted(
    rescaled_run: RescaleRun,
):
    """The source commits a savepoint's offsets asynchronously as the job stops, so the
    group's commit may lag the savepoint (seen: 19 committed, 21 read and counted)."""
    for phase in rescaled_run.phases[:2]:
        assert 0 < phase.committed <= phase.stats["events_in"]


def test_a_job_stopped_with_a_savepoint_leaves_no_call_process_behind(rescaled_run: RescaleRun):
    assert rescaled_run.call_processes_at_kill == 1


def test_a_killed_taskmanager_makes_the_job_restart_from_its_checkpoint(rescaled_run: RescaleRun):
    assert rescaled_run.restarted, rescaled_run.killed


def test_across_the_rescales_and_the_kill_every_record_was_read(rescaled_run: RescaleRun):
    """A checkpoint after the kill covers every record: the group committed them all. The
    stats hash cannot show it across a crash (``docs/event_time.md``): the restarted job
    counts the records after its checkpoint again, and the killed TaskManager's unflushed
    counts are lost, its sends and its outcomes alike, so no relation between the two
    holds there. That every prompt had an outcome is judged on the prompts themselves:
    each shopper's newest is answered (the next test), and an older one is superseded by
    it."""
    assert rescaled_run.lag_at_end == 0


def test_every_shoppers_newest_prompt_is_answered_across_the_rescales(rescaled_run: RescaleRun):
    assert len(_newest_prompts(rescaled_run.prompts)) >= RESCALE_SHOPPERS // 2
    assert rescaled_run.unanswered == []


def test_no_write_lands_over_a_newer_one_across_the_rescales(rescaled_run: RescaleRun):
    assert rescaled_run.writes
    assert _regressions(rescaled_run.writes) == []


# --- what the cluster's Prometheus reporters serve (scraped at parallelism 2) -------------


def _reported(rescaled_run: RescaleRun) -> dict[str, list[tuple[dict[str, str], float]]]:
    reported = rescaled_run.phases[1].reported
    assert reported, "nothing scraped from the reporters at parallelism 2"
    return reported


def test_the_dashboards_flink_series_are_what_a_real_reporter_serves(rescaled_run: RescaleRun):
    reported = _reported(rescaled_run)
    used = flink_builtin_names_used()
    assert used, "the dashboard should show Flink's own scaling metrics"
    assert sorted(used - reported.keys()) == []


def test_the_dashboards_flink_panels_group_by_labels_the_series_carry(rescaled_run: RescaleRun):
    reported = _reported(rescaled_run)
    missing = [
        f"{name} by {label}"
        for name, labels in grouping_labels_used().items()
        if name in reported
        for label in labels
        if not any(label in series_labels for series_labels, _ in reported[name])
    ]
    assert missing == []


def test_the_jobs_own_counts_reach_the_reporter_from_each_subtask(rescaled_run: RescaleRun):
    """Published by the operators' threads (``metrics.GaugeBoard``), read by the reporter
    without calling Python: one series per decoder subtask (the scrape waited for both to
    count), and the session operator's outcomes beside them."""
    reported = _reported(rescaled_run)
    assert len(reported[FLINK_PREFIX + "events_in"]) == 2
    assert {labels["subtask_index"] for labels, _ in reported[FLINK_PREFIX + "events_held"]} == {
        "0",
        "1",
    }
