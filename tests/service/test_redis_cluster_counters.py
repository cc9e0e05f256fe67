"""The job's counters on a Redis Cluster: each operator instance's reporter adds to the
stats hash of its own slot group (its batch ledger beside it, in the slot the script
needs), and the run summary sums every group's hash and joins every group's samples.

The session's cluster; each test under its own prefix.
"""

from __future__ import annotations

import redis.cluster
import redis.exceptions

from flink_jobs.runtime.counters import StatsReporter
from flink_jobs.tools.local_services import RedisClusterService
from flink_jobs.tools.run_summary import read_samples, read_stats
from intent_reader import KeyLayout

SHARDS = 64
SLOW_FLUSH_S = 60.0  # only close() publishes


def reporters(url: str, prefix: str, count: int) -> list[StatsReporter]:
    return [
        StatsReporter(url, prefix, SLOW_FLUSH_S, cluster=True, shards=SHARDS) for _ in range(count)
    ]


def test_the_summary_sums_the_hashes_every_reporter_added_to(
    redis_cluster: RedisClusterService, cluster_client, unique_name: str
) -> None:
    for i, reporter in enumerate(reporters(redis_cluster.url, unique_name, 8), start=1):
        reporter.add("events_in", i)
        reporter.add("intents_written")
        reporter.close()

    layout = KeyLayout(unique_name, SHARDS)
    used = [k for k in layout.stats_keys() if cluster_client.exists(k)]

    assert read_stats(cluster_client, unique_name, shards=SHARDS) == {
        "events_in": 36,
        "intents_written": 8,
    }
    assert len(used) > 1  # spread over slot groups (all eight in one: 64**-7)


def test_a_batch_applied_but_never_answered_is_counted_once_in_its_group(
    redis_cluster: RedisClusterService, cluster_client, unique_name: str, monkeypatch
) -> None:
    """The batch's number and its ledger live in the slot of its stats hash: the script that
    refuses a batch it applied already can read both."""
    (reporter,) = reporters(redis_cluster.url, unique_name, 1)
    real_pipeline = reporter._client.pipeline

    def pipeline_losing_its_reply(*args, **kwargs):
        pipe = real_pipeline(*args, **kwargs)
        execute = pipe.execute

        def execute_then_lose_the_reply(*a, **kw):
            execute(*a, **kw)
            raise redis.exceptions.ConnectionError("connection closed before the reply")

        pipe.execute = execute_then_lose_the_reply
        return pipe

    reporter.add("events_in", 3)
    monkeypatch.setattr(reporter._client, "pipeline", pipeline_losing_its_reply)
    reporter.flush()  # applied by Redis, failed for the reporter
    monkeypatch.undo()
    reporter.add("events_in", 2)
    reporter.close()

    assert read_stats(cluster_client, unique_name, shards=SHARDS) == {"events_in": 5}


def test_the_summary_joins_the_samples_of_every_group(
    redis_cluster: RedisClusterService, cluster_client, unique_name: str
) -> None:
    for i, reporter in enumerate(reporters(redis_cluster.url, unique_name, 4)):
        reporter.sample("llm_latency_ms", 100 + i)
        reporter.sample("llm_latency_ms", 200 + i)
        reporter.close()

    samples = read_samples(cluster_client, unique_name, "llm_latency_ms", shards=SHARDS)

    assert sorted(samples) == [100, 101, 102, 103, 200, 201, 202, 203]
