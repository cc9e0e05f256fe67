"""Two speeds in the real job (Kafka-protocol broker, Redis, PyFlink, two vLLM workers with
SmolLM2-135M on the CPU behind the router), across a job restart: every landed write is
read back from the notification stream (one entry per write that landed, in the order they
landed).

The model takes seconds per answer, and the job answers every prompt in order
(``llm.latest_wins=false``), so a shopper's older prompt is often answered after its newer
prompt's rules-only record landed: the case the version order must refuse. Shoppers are
split between the two templates (``prompt.arms``). The job is killed mid-stream once a
checkpoint completed and intents landed, and restarted from that checkpoint; the prompts
it had out are sent again, rules-only record included.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from flink_jobs.checkpoints import latest_checkpoint
from flink_jobs.metrics import arm_stat
from flink_jobs.tools.local_services import create_topics
from flink_jobs.tools.replay import replay_records
from flink_jobs.tools.run_summary import read_stats
from flink_jobs.tools.sample_data import BadRecords, SampleConfig, generate_sample
from intent_reader.layout import SOURCE_RANKS, intent_key
from intent_reader.updates import IntentUpdate, IntentUpdates
from tests.support.job_process import JobProcess, job_groups
from tests.support.waiting import until

SHOPPERS = 12
SPEED = 2.0
ARMS = "shopper_intent_v1.j2:50,shopper_intent_v2.j2:50"
WARM_UP = 10
TIMEOUT_S = 300
QUIET_S = 30  # several answers' time: the model's queue has drained


@dataclass
class Run:
    writes: list[IntentUpdate]
    hashes: dict[str, dict[bytes, bytes]]
    killed_at_ms: int
    restarted_log: str
    stats: dict[str, int]


@pytest.fixture(scope="module")
def run(kafka_bootstrap, redis_url, llm_tier, tmp_path_factory) -> Run:
    workdir: Path = tmp_path_factory.mktemp("two-speed")
    name = f"twospeed-{time.monotonic_ns()}"
    stream = f"{name}:updates"
    sample = generate_sample(
        SampleConfig(shoppers=SHOPPERS, seed=31, duration_s=90.0, bad=BadRecords.none())
    )
    create_topics(kafka_bootstrap, [f"{name}-events", f"{name}-dlq"], 1)
    groups = job_groups(
        name, kafka_bootstrap, redis_url, {**llm_tier.job_settings(), "latest_wins": False}
    )
    groups["redis"]["notify_stream"] = stream
    groups["prompt"] = {"arms": ARMS}
    groups["job"] = {
        "checkpoint_interval_s": 2,
        "checkpoint_dir": str(workdir / "checkpoints"),
        "watermark_idle_advance_s": 5,
    }
    client = redis.Redis.from_url(redis_url)
    replayed = threading.Event()

    def replay(records: list[bytes]) -> None:
        summary = replay_records(
            kafka_bootstrap, f"{name}-events", records, speed=SPEED, rebase_time="send"
        )
        assert summary.ok, summary.describe(f"{name}-events")

    # The kill waits for model answers, whose time depends on the host (a CPU model 4-5x
    # slower on AVX2-only hosts): the second half of the stream waits for the kill, so the
    # job dies with the stream under way on any host.
    killed = threading.Event()
    half = (len(sample.records) + WARM_UP) // 2

    def replay_rest() -> None:
        replay(sample.records[WARM_UP:half])
        killed.wait(TIMEOUT_S)
        replay(sample.records[half:])
        replayed.set()

    def entries() -> int:
        return client.xlen(stream)

    first = JobProcess(groups, workdir / "first.log")
    restarted = None
    try:
        # The stream proper starts once the job reads: its start-up takes a while.
        replay(sample.records[:WARM_UP])
        until(
            lambda: read_stats(client, name).get("events_in", 0) >= WARM_UP,
            "the job to read the first records",
            **first.waits(TIMEOUT_S),
        )
        threading.Thread(target=replay_rest, daemon=True).start()
        until(
            lambda: (
                latest_checkpoint(workdir / "checkpoints") is not None
                and read_stats(client, name).get("intents_written", 0) >= 3
            ),
            "a completed checkpoint and three model intents",
            **first.waits(TIMEOUT_S),
        )
        assert not replayed.is_set(), "the replay ended before the kill: not mid-stream"
        first.kill()
        killed_at_ms = int(time.time() * 1000)
        killed.set()
        groups["job"]["restore_from"] = "latest"
        restarted = JobProcess(groups, workdir / "restarted.log")
        until(replayed.is_set, "the replay to end", **restarted.waits(TIMEOUT_S))
        last, since = -1, time.monotonic()

        def quiet() -> bool:
            nonlocal last, since
            now = entries()
            if now != last:
                last, since = now, time.monotonic()
            return time.monotonic() - since > QUIET_S

        until(quiet, f"no write to land for {QUIET_S} s", **restarted.waits(TIMEOUT_S))
    finally:
        killed.set()
        first.kill()
        if restarted is not None:
            restarted.kill()
    writes = IntentUpdates(client, stream, start="earliest", batch=100_000).read(block_s=None)
    hashes = {
        key.decode().rsplit(":", 1)[1]: client.hgetall(key)
        for key in client.scan_iter(match=intent_key("*", name))
    }
    stats = read_stats(client, name)
    client.close()
    return Run(writes, hashes, killed_at_ms, restarted.log_text(), stats)


def _triple(w: IntentUpdate) -> tuple[int, int, int]:
    return (w.version_ts, w.version_seq, SOURCE_RANKS[w.source])


def _by_shopper(writes: list[IntentUpdate]) -> dict[str, list[IntentUpdate]]:
    out: dict[str, list[IntentUpdate]] = defaultdict(list)
    for w in writes:
        out[w.shopper_id].append(w)
    return out


def test_the_job_restarted_from_its_checkpoint_and_writes_landed_on_both_sides(run: Run) -> None:
    assert "restoring from" in run.restarted_log
    assert any(w.written_at_ms < run.killed_at_ms for w in run.writes)
    assert any(w.written_at_ms > run.killed_at_ms for w in run.writes)


def test_each_prompts_rules_record_lands_before_the_models_answer_replaces_it(run: Run) -> None:
    for shopper, writes in _by_shopper(run.writes).items():
        landed_rules = set()
        for w in writes:
            if w.source == "rules":
                landed_rules.add(w.version)
            else:
                assert w.version in landed_rules, f"{shopper}: model {w.version} without rules"
    assert sum(w.source == "model" for w in run.writes) >= SHOPPERS


def test_no_write_ever_lands_over_a_newer_record_across_the_restart(run: Run) -> None:
    for shopper, writes in _by_shopper(run.writes).items():
        triples = [_triple(w) for w in writes]
        assert triples == sorted(set(triples)), f"{shopper}: {triples}"
    # The refusals happened: older answers arrived after newer rules-only records.
    assert run.stats.get("intents_stale", 0) >= 1


def test_the_final_record_is_the_last_write_that_landed(run: Run) -> None:
    last = {w.shopper_id: w for w in run.writes}
    for shopper, fields in run.hashes.items():
        assert (int(fields[b"version_ts"]), fields[b"source"].decode()) == (
            last[shopper].version_ts,
            last[shopper].source,
        )
        assert fields[b"facts"]


def test_shoppers_are_split_between_the_arms_and_counted_per_arm(run: Run) -> None:
    templates = {w.shopper_id: w.template for w in run.writes}
    assert set(templates.values()) == {"shopper_intent_v1.j2", "shopper_intent_v2.j2"}
    for template in ("shopper_intent_v1.j2", "shopper_intent_v2.j2"):
        assert run.stats.get(arm_stat(template, "prompts_sent"), 0) > 0
        assert run.stats.get(arm_stat(template, "intents_written_rules"), 0) > 0
