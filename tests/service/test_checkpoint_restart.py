"""Checkpoints, a killed job and a replay, on the real broker, Redis and PyFlink, with LLM
stand-ins (``bench/standin_llm.py``) behind the real router: the subject is the stream.

Run B consumes a topic while it is being produced (event time rebased to send time, at
twice the sample's pace), checkpointing every 2 s. Once a checkpoint has completed and
intents are landing, the job's LLM call process (``flink_jobs.runtime.call_process``) is
killed, which fails the job into Flink's own restart from that checkpoint, with a new call
process; once intents land again, one request on each stand-in is made to hang, and once a
checkpoint has been taken with such a prompt waiting for its answer, the job process group
is SIGKILLed mid-stream; while it is down the replay goes on, then the job restarts from
the latest checkpoint and finishes. A watcher reads every shopper's intent version from
Redis throughout. Run A then replays the finished topic from the start, never
interrupted, as a bounded replay (it reads to the end of the topic and finishes). Both
runs copy every prompt they render to a prompts topic.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import psutil
import pytest
import redis

from flink_jobs.checkpoints import latest_checkpoint
from flink_jobs.tools.local_services import LOCAL_BROKER_SOURCE_PROPERTIES, cache_dir, create_topics
from flink_jobs.tools.replay import replay_records
from flink_jobs.tools.run_summary import (
    group_lag,
    group_progress,
    is_settled,
    read_json_topic,
    read_stats,
)
from flink_jobs.tools.sample_data import SampleConfig, generate_sample
from intent_reader.layout import intent_key
from tests.support.answers import Unanswered, unanswered_in
from tests.support.job_process import JobProcess, call_processes
from tests.support.stream import move_event_time
from tests.support.waiting import until

SHOPPERS = 30
SPEED = 2.0
WARM_UP = 20
PHASE_TIMEOUT_S = 600


Version = tuple[int, int]


@dataclass
class VersionWatcher:
    """Polls every intent's (version_ts, version_seq) and notes any that went backwards."""

    client: redis.Redis
    prefix: str
    seen: dict[str, Version] = field(default_factory=dict)
    regressions: list[str] = field(default_factory=list)
    polls: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(0.3):
            try:
                self.poll()
            except redis.RedisError:
                continue

    def poll(self) -> None:
        """Reads and compares under one lock, so two pollers cannot compare out of order."""
        with self._lock:
            for shopper, version in intent_versions(self.client, self.prefix).items():
                before = self.seen.get(shopper)
                if before is not None and version < before:
                    self.regressions.append(f"{shopper}: {before} -> {version}")
                self.seen[shopper] = max(version, before or version)
            self.polls += 1


def intent_versions(client: redis.Redis, prefix: str) -> dict[str, Version]:
    keys = list(client.scan_iter(match=intent_key("*", prefix), count=1000))
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.hmget(key, "version_ts", "version_seq")
    return {
        key.decode()[len(intent_key("", prefix)) :]: (int(ts), int(seq))
        for key, (ts, seq) in zip(keys, pipe.execute(), strict=True)
        if ts is not None
    }


@dataclass
class Runs:
    prompts_a: list[dict]
    prompts_b: list[dict]
    unanswered_b: list[Unanswered]
    watcher: VersionWatcher
    versions_at_kill: dict[str, Version]
    restored_from: Path
    restart_log: str
    killed_call_process: int
    call_process_after: int
    hung_requests: int
    intents_before_call_process_kill: int
    intents_after_call_process_kill: int
    stats_a: dict[str, int]
    stats_b: dict[str, int]


def _hung(tier) -> int:
    """Requests the stand-ins have made hang so far."""
    return sum(tier.stats(url)["faults"]["hang"] for url in tier.worker_urls)


def _groups(name: str, bootstrap: str, redis_url: str, llm: dict, run: str) -> dict:
    return {
        "kafka": {
            "bootstrap_servers": bootstrap,
            "source_properties": LOCAL_BROKER_SOURCE_PROPERTIES,
            "events_topic": f"{name}-events",
            "dead_letter_topic": f"{name}-{run}-dlq",
            "prompts_topic": f"{name}-{run}-prompts",
            "group_id": f"{name}-{run}",
            "starting_offsets": "earliest",
        },
        "redis": {"url": redis_url, "key_prefix": f"{name}-{run}"},
        "llm": llm,
        # A quiet partition's watermark only follows the wall clock after 5 s, well above
        # the gaps of this replay, so the live run sees the topic as the replay does.
        "job": {"checkpoint_interval_s": 2, "watermark_idle_advance_s": 5},
    }


def _checkpoint_number(checkpoints: Path) -> int:
    """The newest completed checkpoint's number (``chk-N``), 0 before the first."""
    newest = latest_checkpoint(checkpoints)
    return int(newest.name.removeprefix("chk-")) if newest is not None else 0


class RunBAnswered:
    """The check that run B is done: a checkpoint covers every record, the event-time
    marker included (``tests.support.stream``), a later checkpoint has completed, and every
    shopper's newest prompt is answered (or dead-lettered). Reading the marker moves the
    watermark past every trigger, and the prompts those triggers fire reach the prompts
    topic before the barrier of a checkpoint taken after it. The stats cannot tell: the
    killed job lost the counts it had not flushed, some of records before its last
    checkpoint, and the restarted job counts records after that checkpoint again. The
    group's committed offsets, the checkpoints, the prompts topic and Redis can."""

    def __init__(
        self, client: redis.Redis, prefix: str, bootstrap: str, name: str, checkpoints: Path
    ) -> None:
        self.client, self.prefix, self.bootstrap = client, prefix, bootstrap
        self.name, self.checkpoints = name, checkpoints
        self.covered: dict[str, int] = {}
        self.seen: dict = {}

    def __call__(self) -> bool:
        lag = group_lag(self.bootstrap, f"{self.name}-b", f"{self.name}-events")
        self.seen.update(lag=lag, stats=read_stats(self.client, self.prefix))
        if lag:
            return False
        self.covered.setdefault("at", _checkpoint_number(self.checkpoints))
        prompts = read_json_topic(self.bootstrap, f"{self.name}-b-prompts", timeout_s=10)
        dead_letters = read_json_topic(self.bootstrap, f"{self.name}-b-dlq", timeout_s=10)
        open_ = unanswered_in(self.client, self.prefix, prompts, dead_letters)
        self.seen.update(prompts=len(prompts), unanswered=[str(u) for u in open_])
        return not open_ and _checkpoint_number(self.checkpoints) > self.covered["at"]


@pytest.fixture(scope="module")
def runs(kafka_bootstrap, redis_url, standin_tier, tmp_path_factory) -> Runs:
    workdir = tmp_path_factory.mktemp("restart")
    name = f"restart-{time.monotonic_ns()}"
    sample = generate_sample(SampleConfig(shoppers=SHOPPERS, seed=23, duration_s=120.0))
    create_topics(
        kafka_bootstrap,
        [f"{name}-events"] + [f"{name}-{r}-{t}" for r in "ab" for t in ("dlq", "prompts")],
        1,
    )
    client = redis.Redis.from_url(redis_url)
    groups_b = _groups(name, kafka_bootstrap, redis_url, standin_tier.job_settings(), "b")
    groups_b["job"]["checkpoint_dir"] = str(workdir / "checkpoints")
    prefix_b = groups_b["redis"]["key_prefix"]

    replayed = threading.Event()

    def replay(records: list[bytes]) -> None:
        summary = replay_records(
            kafka_bootstrap, f"{name}-events", records, speed=SPEED, rebase_time="send"
        )
        assert summary.ok, summary.describe(f"{name}-events")

    timeline: dict[str, float] = {}

    def replay_rest() -> None:
        timeline["replay_rest_started"] = time.monotonic()
        replay(sample.records[WARM_UP:])
        timeline["replay_rest_ended"] = time.monotonic()
        replayed.set()

    watcher = VersionWatcher(client, prefix_b)
    first = JobProcess(groups_b, workdir / "b-first.log")
    restarted = None
    try:
        # The stream proper starts once the job is reading: its start-up takes a while.
        replay(sample.records[:WARM_UP])
        until(
            lambda: read_stats(client, prefix_b).get("events_in", 0) >= WARM_UP,
            "the job to read the first records",
            **first.waits(PHASE_TIMEOUT_S),
        )
        threading.Thread(target=replay_rest, daemon=True).start()
        watcher.start()
        until(
            lambda: (
                latest_checkpoint(workdir / "checkpoints") is not None
                and read_stats(client, prefix_b).get("intents_written", 0) >= 3
            ),
            "a completed checkpoint and three intents",
            **first.waits(PHASE_TIMEOUT_S),
        )
        assert not replayed.is_set(), "the replay ended before the kill: not mid-stream"
        [killed_call_process] = call_processes(first.pid)
        intents_before_helper_kill = read_stats(client, prefix_b)["intents_written"]
        psutil.Process(killed_call_process).kill()
        until(
            lambda: (
                call_processes(first.pid) not in ([], [killed_call_process])
                and read_stats(client, prefix_b)["intents_written"] > intents_before_helper_kill
            ),
            "a new call process and a new intent after the call process was killed",
            **first.waits(PHASE_TIMEOUT_S),
        )
        [call_process_after] = call_processes(first.pid)
        intents_after_helper_kill = read_stats(client, prefix_b)["intents_written"]
        # A prompt waits for its answer in the checkpoint the restart restores: the restored
        # job must send it again (``prompts_resent``).
        hung_before = _hung(standin_tier)
        standin_tier.inject("hang", 1)
        until(
            lambda: _hung(standin_tier) > hung_before,
            "a request to hang",
            **first.waits(PHASE_TIMEOUT_S),
        )
        checkpoint_before = latest_checkpoint(workdir / "checkpoints")
        until(
            lambda: latest_checkpoint(workdir / "checkpoints") != checkpoint_before,
            "a checkpoint taken while a prompt waits for its answer",
            **first.waits(PHASE_TIMEOUT_S),
        )
        assert not replayed.is_set(), "the replay ended before the kill: not mid-stream"
        first.kill()
        timeline["job_killed"] = time.monotonic()
        standin_tier.inject("hang", 0)
        hung_requests = _hung(standin_tier) - hung_before
        watcher.poll()
        versions_at_kill = dict(watcher.seen)
        restored_from = latest_checkpoint(workdir / "checkpoints")

        # While the job is down the replay goes on: the restarted job finds a backlog.
        def on_topic() -> int:
            return group_progress(kafka_bootstrap, f"{name}-b", f"{name}-events")[1]

        at_kill = on_topic()
        until(
            lambda: replayed.is_set() or on_topic() >= at_kill + 5,
            "records written while the job is down",
            timeout_s=PHASE_TIMEOUT_S,
            interval_s=0.5,
        )

        groups_b["job"]["restore_from"] = "latest"
        restarted = JobProcess(groups_b, workdir / "b-restarted.log")
        until(replayed.is_set, "the replay to finish", timeout_s=PHASE_TIMEOUT_S, interval_s=0.5)
        # Past the quiet period and max wait of the replay's last events.
        move_event_time(kafka_bootstrap, f"{name}-events", 1, int(time.time() * 1000) + 30_000)
        answered = RunBAnswered(client, prefix_b, kafka_bootstrap, name, workdir / "checkpoints")
        until(
            answered,
            "run B to answer every shopper's newest prompt",
            **restarted.waits(PHASE_TIMEOUT_S, state=lambda: f"last seen: {answered.seen}"),
        )
        watcher.poll()
    finally:
        watcher.stop()
        first.kill()
        if restarted is not None:
            restarted.kill()

    groups_a = _groups(name, kafka_bootstrap, redis_url, standin_tier.job_settings(), "a")
    groups_a["kafka"]["bounded"] = True
    uninterrupted = JobProcess(groups_a, workdir / "a.log")
    try:
        until(
            lambda: is_settled(
                read_stats(client, groups_a["redis"]["key_prefix"]), len(sample.records)
            ),
            "run A to settle",
            **uninterrupted.waits(PHASE_TIMEOUT_S),
        )
    finally:
        uninterrupted.kill()

    prompts_b = read_json_topic(kafka_bootstrap, f"{name}-b-prompts")
    dead_letters_b = read_json_topic(kafka_bootstrap, f"{name}-b-dlq")
    runs = Runs(
        prompts_a=read_json_topic(kafka_bootstrap, f"{name}-a-prompts"),
        prompts_b=prompts_b,
        unanswered_b=unanswered_in(client, prefix_b, prompts_b, dead_letters_b),
        watcher=watcher,
        versions_at_kill=versions_at_kill,
        restored_from=restored_from,
        restart_log=restarted.log_text(),
        killed_call_process=killed_call_process,
        call_process_after=call_process_after,
        hung_requests=hung_requests,
        intents_before_call_process_kill=intents_before_helper_kill,
        intents_after_call_process_kill=intents_after_helper_kill,
        stats_a=read_stats(client, groups_a["redis"]["key_prefix"]),
        stats_b=read_stats(client, prefix_b),
    )
    report = cache_dir() / "reports" / "checkpoint_restart.json"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_bytes(
        orjson.dumps(
            {
                "stats_a": runs.stats_a,
                "stats_b": runs.stats_b,
                "prompts_a": runs.prompts_a,
                "prompts_b": runs.prompts_b,
                "restored_from": str(runs.restored_from),
                "intents_at_kill": len(runs.versions_at_kill),
                # seconds after the rest of the replay started
                "job_killed_at_s": timeline["job_killed"] - timeline["replay_rest_started"],
                "replay_ended_at_s": timeline["replay_rest_ended"]
                - timeline["replay_rest_started"],
            },
            option=orjson.OPT_INDENT_2,
        )
    )
    return runs


def _by_version(prompts: list[dict]) -> dict[tuple[str, int], str]:
    digests: dict[tuple[str, int], str] = {}
    for p in prompts:
        key = (p["shopper_id"], p["seq"])
        assert digests.setdefault(key, p["sha256"]) == p["sha256"], f"two prompts for {key}"
    return digests


def test_the_restarted_job_restores_the_latest_checkpoint(runs: Runs) -> None:
    assert (runs.restored_from / "_metadata").exists()
    assert "restoring from" in runs.restart_log
    assert runs.versions_at_kill, "no intent had landed before the kill"


def test_a_prompt_pending_at_the_checkpoint_is_sent_again_after_the_restart(runs: Runs) -> None:
    assert runs.hung_requests >= 1
    assert runs.stats_b.get("prompts_resent", 0) >= 1


def test_a_killed_call_process_is_replaced_and_intents_land_again(runs: Runs) -> None:
    assert runs.call_process_after != runs.killed_call_process
    assert runs.intents_after_call_process_kill > runs.intents_before_call_process_kill


def test_replaying_the_topic_renders_the_same_prompts(runs: Runs) -> None:
    live_with_a_crash, replayed = _by_version(runs.prompts_b), _by_version(runs.prompts_a)

    assert len(replayed) >= SHOPPERS
    assert live_with_a_crash == replayed


def test_no_intent_is_lost_across_the_restart(runs: Runs) -> None:
    assert runs.unanswered_b == []


def test_an_older_intent_never_overwrites_a_newer_one(runs: Runs) -> None:
    assert runs.watcher.polls > 20
    assert runs.watcher.regressions == []
