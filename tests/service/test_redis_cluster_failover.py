"""A Redis Cluster primary dies while the job writes: its replica is promoted and the writes
go on landing, within the retry budget, through the job's own write path.

A real cluster of three primaries with a replica each (``cluster-node-timeout`` 1 s), many
shoppers written with growing versions by the job's runner (``tests/support/cluster_writes``)
and a reader polling them. The test kills one primary's process (SIGKILL: no goodbye to its
replica), stops new writes and lets those in flight end: they meet a refused connection
(or ``CLUSTERDOWN``, once the others count the dead primary's slots as uncovered) until
the replica takes over, wait it out within their retry budget, and land there. Then it
measures what
asynchronous replication may lose (writes the dead primary acknowledged before its replica
had them), and writes every shopper once more.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flink_jobs.tools.local_services import RedisClusterService, start_redis_cluster
from intent_reader import IntentReader
from intent_reader.layout import key_slot
from tests.support.cluster_writes import (
    STEP_TIMEOUT_S,
    IntentWriters,
    VersionPoller,
    cluster_config,
    version_ts,
)
from tests.support.waiting import until

log = logging.getLogger(__name__)

SHOPPERS = [f"shopper-{i:04d}" for i in range(240)]
WRITERS = 12


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisClusterService]:
    with start_redis_cluster(tmp_path / "cluster", node_timeout_ms=1000) as service:
        yield service


def stored_seqs(url: str, prefix: str) -> dict[str, int]:
    with IntentReader.from_url(url, timeout_s=2.0, cluster=True, prefix=prefix) as reader:
        batch = reader.get_many(SHOPPERS)
    assert not batch.errors
    for intent in batch.values():
        assert intent is None or intent.version_ts == version_ts(intent.version_seq)
    return {s: (i.version_seq if i is not None else 0) for s, i in batch.items()}


def test_a_killed_primary_is_replaced_and_every_write_lands_or_is_counted(
    cluster: RedisClusterService, unique_name: str, record_property, caplog
) -> None:
    caplog.set_level(logging.WARNING, logger="flink_jobs.runtime.inference")
    config = cluster_config(cluster.url, unique_name, notify_stream=f"{unique_name}:intent-updates")
    layout = config.redis.layout()
    writers = IntentWriters(config, SHOPPERS, WRITERS).start()
    poller = VersionPoller(cluster.url, unique_name, SHOPPERS).start()
    try:
        writers.wait_acked(2)
        until(lambda: poller.rounds > 0, "the reader's first round", timeout_s=STEP_TIMEOUT_S)
        victim = cluster.owner_of(key_slot(layout.intent_key(SHOPPERS[0])))
        (heir,) = cluster.replicas_of(victim)
        killed_at = time.monotonic()
        victim.process.kill()  # SIGKILL, while writes are in flight
        until(
            lambda: cluster.role_of(heir) == "master",
            "the replica's promotion",
            timeout_s=STEP_TIMEOUT_S,
        )
        promoted_after_s = time.monotonic() - killed_at
        writers.pause()  # the writes in flight end: landed, or failed past the budget

        stored = stored_seqs(cluster.url, unique_name)
        lost = {s: [seq for seq, _ in writers.log.acked[s] if seq > stored[s]] for s in SHOPPERS}
        lost = {s: seqs for s, seqs in lost.items() if seqs}

        resumed_at, rounds = time.monotonic(), poller.rounds
        writers.resume()
        writers.wait_acked(1, since=resumed_at)
        writers.pause()
        until(
            lambda: poller.rounds > rounds + 1,
            "the reader's rounds after the failover",
            timeout_s=STEP_TIMEOUT_S,
        )
    finally:
        writers.stop()
        poller.stop()

    outcomes = writers.log.outcomes
    lost_writes = sum(len(seqs) for seqs in lost.values())
    retries = [r for r in caplog.records if r.getMessage().startswith("Redis write failed")]
    figures = {
        "writes_sent": writers.log.sent,
        "written": outcomes["written"],
        "stale": outcomes["stale"],
        "failed": outcomes["failed"],
        "dead_letter": outcomes["dead_letter"],
        "attempts_retried": len(retries),
        "lost_acknowledged_writes": lost_writes,
        "shoppers_with_a_lost_write": len(lost),
        "promoted_within_s": round(promoted_after_s, 2),
        "reader_rounds": poller.rounds,
        "reader_saw_older_after_newer": len(poller.regressions),
    }
    for name, value in figures.items():
        record_property(name, value)
    log.warning("cluster failover figures: %s", figures)

    # The writes in flight met the failover, and waited it out within their budget.
    assert retries
    # Accounting: every write sent ended as one outcome; none failed, none dead-lettered.
    assert writers.log.sent == sum(outcomes.values())
    assert (outcomes["failed"], outcomes["dead_letter"]) == (0, 0), writers.log.failures[:3]
    # What the failover lost (counted above), it lost from the dead primary's slots alone.
    assert all(cluster.owner_of(key_slot(layout.intent_key(s))) is heir for s in lost)
    # Then every shopper's newest version is kept.
    final = stored_seqs(cluster.url, unique_name)
    assert final == {s: writers.log.newest_acked(s) for s in SHOPPERS}
    # A reader saw an older version after a newer one only where the newer one was lost.
    assert {shopper for shopper, _, _ in poller.regressions} <= set(lost)
