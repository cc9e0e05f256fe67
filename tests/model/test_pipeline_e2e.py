"""The whole pipeline on real components: a Kafka-protocol broker, Redis, PyFlink and
vLLM behind the router.

One run is shared by the tests of this module: 80 shoppers' sessions (10 minutes of
event time, with malformed, schema-violating, oversized and duplicate records mixed in)
are replayed at 2.5x, which two vLLM workers on AVX2-only cores keep up with, with event
times rebased to the send time. The job runs until every record and every prompt has an
outcome; each test then checks one promise against what landed in Redis and on the
dead-letter topic. The run's figures are written to ``<cache>/reports/pipeline_e2e.json``.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import dataclass

import fastjsonschema
import orjson
import pytest
import redis

from flink_jobs.config import AppConfig, load_config
from flink_jobs.core.events import load_schema
from flink_jobs.tools.local_services import cache_dir, create_topics
from flink_jobs.tools.replay import replay_records
from flink_jobs.tools.run_summary import (
    EVENT_OUTCOMES,
    IntentRow,
    PrefixCacheStats,
    is_settled,
    latency_summary,
    read_dead_letters,
    read_intents,
    read_prefix_cache,
    read_samples,
    read_stats,
)
from flink_jobs.tools.sample_data import SampleConfig, generate_sample
from tests.support.job_process import job_groups
from tests.support.waiting import held_for, until

# Ten minutes of 40 shoppers' events at 5x: two minutes of replay, the same events per
# second the CPU workers faced with 80 shoppers at 2.5x (every other assertion here is
# about the stream, which the service tier covers at length on stand-ins).
SHOPPERS = 40
SPEED = 5.0
RUN_TIMEOUT_S = 20 * 60


@dataclass
class PipelineRun:
    config: AppConfig
    records: list[bytes]
    expected: dict
    stats: dict[str, int]
    intents: dict[str, IntentRow]
    dead_letters: list[dict]
    prefix_cache: PrefixCacheStats
    llm_latency_ms: list[int]
    event_to_intent_ms: list[int]
    event_to_prompt_ms: list[int]
    outbox_wait_ms: list[int]
    replay_s: float
    elapsed_s: float


@pytest.fixture(scope="module")
def pipeline_run(kafka_bootstrap: str, redis_url: str, llm_tier) -> PipelineRun:
    from flink_jobs.job import create_job

    sample = generate_sample(SampleConfig(shoppers=SHOPPERS, seed=11, duration_s=600.0))
    expected = orjson.loads(sample.expected.to_json())
    name = f"e2e-{time.monotonic_ns()}"
    groups = job_groups(name, kafka_bootstrap, redis_url, llm_tier.job_settings())
    groups["job"] = {"checkpoint_interval_s": 5}
    config = load_config(overrides=groups, environ={})
    create_topics(kafka_bootstrap, [config.kafka.events_topic, config.kafka.dead_letter_topic], 2)
    client = redis.Redis.from_url(redis_url)
    job = create_job(config).execute_async(name)
    try:
        started = time.monotonic()
        summary = replay_records(
            kafka_bootstrap,
            config.kafka.events_topic,
            sample.records,
            speed=SPEED,
            rebase_time="send",
        )
        assert summary.ok, summary.describe(config.kafka.events_topic)
        replay_s = time.monotonic() - started
        stats = _settled_stats(client, config, len(sample.records))
        elapsed_s = time.monotonic() - started
    finally:
        job.cancel().result()
    dead_letters = read_dead_letters(
        kafka_bootstrap,
        config.kafka.dead_letter_topic,
        expected=stats.get("dead_letter_decode", 0) + stats.get("dead_letter_inference", 0),
    )
    run = PipelineRun(
        config=config,
        records=sample.records,
        expected=expected,
        stats=stats,
        intents={row.shopper_id: row for row in read_intents(client, config.redis.key_prefix)},
        dead_letters=dead_letters,
        prefix_cache=read_prefix_cache(llm_tier.worker_urls),
        llm_latency_ms=read_samples(client, config.redis.key_prefix, "llm_latency_ms"),
        event_to_intent_ms=read_samples(client, config.redis.key_prefix, "event_to_intent_ms"),
        event_to_prompt_ms=read_samples(client, config.redis.key_prefix, "event_to_prompt_ms"),
        outbox_wait_ms=read_samples(client, config.redis.key_prefix, "outbox_wait_ms"),
        replay_s=replay_s,
        elapsed_s=elapsed_s,
    )
    _write_report(run)
    return run


def _settled_stats(client: redis.Redis, config: AppConfig, produced: int) -> dict[str, int]:
    """The stats once settled: every record and prompt has an outcome, and it stays so for
    longer than the trigger's max wait (the last prompts fire from timers after the replay)."""
    seen: dict[str, dict[str, int]] = {}

    def settled() -> dict[str, int] | None:
        seen["stats"] = stats = read_stats(client, config.redis.key_prefix)
        return stats if is_settled(stats, produced) else None

    return until(
        held_for(settled, config.trigger.max_wait_s + 5),
        "the pipeline to settle",
        timeout_s=RUN_TIMEOUT_S,
        interval_s=1.0,
        explain=lambda: f"last stats {seen.get('stats')}",
    )


def _write_report(run: PipelineRun) -> None:
    llm_calls = run.stats.get("llm_calls", 0)
    report = {
        "shoppers": SHOPPERS,
        "records": len(run.records),
        "replay_speed": SPEED,
        "replay_s": round(run.replay_s, 1),
        "elapsed_s": round(run.elapsed_s, 1),
        "events_per_s": round(len(run.records) / run.replay_s, 1),
        "event_to_intent_latency_s": latency_summary(run.event_to_intent_ms),
        "llm_latency_s": latency_summary(run.llm_latency_ms),
        "llm_calls": llm_calls,
        "llm_calls_per_event": round(llm_calls / max(1, run.stats.get("events_accepted", 0)), 3),
        "prefix_cache_hit_ratio": round(run.prefix_cache.hit_ratio, 3),
        "stats": run.stats,
    }
    out = cache_dir() / "reports" / "pipeline_e2e.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print("\npipeline e2e report:", orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())


class TestAccounting:
    def test_every_record_produced_enters_the_job(self, pipeline_run: PipelineRun):
        assert pipeline_run.stats["events_in"] == len(pipeline_run.records)

    def test_every_record_has_exactly_one_outcome(self, pipeline_run: PipelineRun):
        outcomes = sum(pipeline_run.stats.get(name, 0) for name in EVENT_OUTCOMES)
        assert outcomes == pipeline_run.stats["events_in"]

    def test_duplicate_event_ids_are_counted_and_ignored(self, pipeline_run: PipelineRun):
        assert pipeline_run.stats.get("events_duplicate", 0) == pipeline_run.expected["duplicates"]

    def test_every_prompt_sent_has_an_outcome(self, pipeline_run: PipelineRun):
        s = pipeline_run.stats
        finished = (
            s.get("intents_written", 0)
            + s.get("intents_stale", 0)
            + s.get("prompts_superseded", 0)
            + s.get("dead_letter_inference", 0)
        )
        assert finished == s["prompts_sent"] > 0

    def test_every_prompt_sent_records_the_jobs_share_of_its_freshness(
        self, pipeline_run: PipelineRun
    ):
        in_job, in_all = pipeline_run.event_to_prompt_ms, pipeline_run.event_to_intent_ms
        assert len(in_job) == pipeline_run.stats["prompts_sent"]
        assert 0 <= statistics.median(in_job) < statistics.median(in_all)

    def test_every_intent_written_records_how_long_its_prompt_queued_for_a_call(
        self, pipeline_run: PipelineRun
    ):
        queued, in_all = pipeline_run.outbox_wait_ms, pipeline_run.event_to_intent_ms
        assert len(queued) == len(in_all) == pipeline_run.stats["intents_written"]
        assert all(0 <= q <= total for q, total in zip(queued, in_all, strict=True))


class TestDeadLetters:
    def test_each_bad_record_is_dead_lettered_with_its_reason(self, pipeline_run: PipelineRun):
        decoded = [d for d in pipeline_run.dead_letters if d["stage"] == "decode"]
        assert Counter(d["reason"] for d in decoded) == Counter(
            pipeline_run.expected["dead_letter_by_reason"]
        )
        assert pipeline_run.stats["dead_letter_decode"] == pipeline_run.expected["dead_letter"]

    def test_dead_letters_carry_raw_bytes_and_source_position(self, pipeline_run: PipelineRun):
        topic = pipeline_run.config.kafka.events_topic
        for d in (d for d in pipeline_run.dead_letters if d["stage"] == "decode"):
            assert d["source"]["topic"] == topic
            assert d["source"]["offset"] >= 0 and d["source"]["partition"] >= 0
            assert d["raw_base64"] and d["detail"]


class TestIntents:
    def test_every_qualifying_shopper_has_a_schema_valid_intent(self, pipeline_run: PipelineRun):
        validate = fastjsonschema.compile(load_schema("shopper_intent.schema.json"))
        missing = set(pipeline_run.expected["qualifying_shoppers"]) - set(pipeline_run.intents)
        why = [d for d in pipeline_run.dead_letters if d["shopper_id"] in missing]
        assert not missing, f"{len(missing)} shoppers without an intent: {sorted(missing)}; {why}"
        for row in pipeline_run.intents.values():
            validate(row.intent)

    def test_shoppers_seen_only_in_bad_records_get_no_intent(self, pipeline_run: PipelineRun):
        assert not set(pipeline_run.expected["ghost_shoppers"]) & set(pipeline_run.intents)

    def test_intents_record_the_template_that_produced_them(self, pipeline_run: PipelineRun):
        client = redis.Redis.from_url(pipeline_run.config.redis.url, decode_responses=True)
        shopper = next(iter(pipeline_run.intents))
        stored = client.hgetall(f"{pipeline_run.config.redis.key_prefix}:intent:{shopper}")
        assert stored["template"] == pipeline_run.config.prompt.template
        assert len(stored["template_hash"]) == 12

    def test_the_llm_served_prompts_from_its_prefix_cache(self, pipeline_run: PipelineRun):
        assert pipeline_run.prefix_cache.hits > 0
