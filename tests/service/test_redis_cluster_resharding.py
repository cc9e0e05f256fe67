"""A Redis Cluster moves a slot that holds written intents while the job writes to it: the
writes follow the slot (``ASK`` while it moves, ``MOVED`` after, ``TRYAGAIN`` while a write's
two keys are on either side) and each lands once, with its notification, in one script.

A real cluster of three primaries with a replica each, many shoppers written with growing
versions through the job's own write path (``tests/support/cluster_writes``), a reader
polling them, and the slot of one shard of the layout (its shoppers' intents and its
notification stream) migrated key by key from its primary to another, as
``redis-cli --cluster reshard`` does: ``CLUSTER SETSLOT ... IMPORTING`` / ``MIGRATING``,
``MIGRATE`` of the keys the source still holds until it holds none, ``SETSLOT ... NODE``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from flink_jobs.tools.local_services import (
    RedisClusterService,
    RedisService,
    start_redis_cluster,
)
from intent_reader import IntentReader, IntentUpdates
from intent_reader.layout import key_slot
from tests.support.cluster_writes import (
    STEP_TIMEOUT_S,
    IntentWriters,
    VersionPoller,
    cluster_config,
)
from tests.support.waiting import until

SHOPPERS = [f"shopper-{i:04d}" for i in range(240)]
WRITERS = 12
KEYS_PER_MIGRATE = 2


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisClusterService]:
    with start_redis_cluster(tmp_path / "cluster", node_timeout_ms=2000) as service:
        yield service


def migrate_slot(
    cluster: RedisClusterService, slot: int, target: RedisService, between: Callable[[], None]
) -> None:
    """Move ``slot`` from its primary to ``target``, a few keys at a time, calling
    ``between()`` after each step (the test waits there for writes to the slot)."""
    source = cluster.owner_of(slot)
    src, dst = cluster.client(source), cluster.client(target)
    try:
        source_id, target_id = cluster.node_id(source), cluster.node_id(target)
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, KEYS_PER_MIGRATE):
            src.execute_command("MIGRATE", target.host, target.port, "", 0, 5000, "KEYS", *keys)
            between()
        for node in cluster.primaries():
            client = cluster.client(node)
            try:
                client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
            finally:
                client.close()
    finally:
        src.close()
        dst.close()


def test_a_slot_moved_under_the_writes_keeps_every_write_and_its_notification(
    cluster: RedisClusterService, unique_name: str
) -> None:
    stream = f"{unique_name}:intent-updates"
    config = cluster_config(cluster.url, unique_name, notify_stream=stream)
    layout = config.redis.layout()
    moved_shard = layout.shard_of(SHOPPERS[0])
    moving = [s for s in SHOPPERS if layout.shard_of(s) == moved_shard]
    slot = key_slot(layout.intent_key(SHOPPERS[0]))
    source = cluster.owner_of(slot)
    target = next(n for n in cluster.primaries() if n is not source)

    writers = IntentWriters(config, SHOPPERS, WRITERS).start()
    poller = VersionPoller(cluster.url, unique_name, SHOPPERS).start()
    try:
        writers.wait_acked(2)
        keys_before = count_keys(cluster, source, slot)

        def some_writes_to_the_slot() -> None:
            since = time.monotonic()
            until(
                lambda: writers.log.acked_between(moving, since, time.monotonic()) > 0,
                "a write to the moving slot",
                timeout_s=STEP_TIMEOUT_S,
            )

        started = time.monotonic()
        migrate_slot(cluster, slot, target, some_writes_to_the_slot)
        ended = time.monotonic()
        writers.wait_acked(1, since=ended)
        writers.pause()
        until(lambda: poller.rounds > 2, "the reader's rounds", timeout_s=STEP_TIMEOUT_S)
    finally:
        writers.stop()
        poller.stop()

    outcomes = writers.log.outcomes
    # The slot held the moving shoppers' intents and their shard of the stream, moved in
    # several steps, and now lives on the target.
    assert keys_before == len(moving) + 1 > KEYS_PER_MIGRATE
    assert cluster.owner_of(slot) is target
    assert (count_keys(cluster, source, slot), count_keys(cluster, target, slot)) == (
        0,
        keys_before,
    )
    assert writers.log.acked_between(moving, started, ended) > 0  # written while it moved
    # Accounting: every write sent ended as one outcome, and each one landed or was stale.
    assert writers.log.sent == sum(outcomes.values()) == outcomes["written"] + outcomes["stale"]
    # Every shopper's newest version is kept, and no reader ever saw one go back.
    with IntentReader.from_url(cluster.url, timeout_s=2.0, cluster=True, prefix=unique_name) as r:
        stored = {s: i.version_seq for s, i in r.get_many(SHOPPERS).items() if i is not None}
    assert stored == {s: writers.log.newest_acked(s) for s in SHOPPERS}
    assert poller.regressions == []
    # Every landed write was announced once, in its shopper's shard of the stream.
    with IntentUpdates.from_url(cluster.url, stream, cluster=True, start="earliest") as updates:
        announced = read_all(updates)
    assert outcomes["written"] <= len(announced) <= outcomes["written"] + outcomes["stale"]
    assert {u.shopper_id for u in announced} == set(SHOPPERS)


def count_keys(cluster: RedisClusterService, node: RedisService, slot: int) -> int:
    client = cluster.client(node)
    try:
        return int(client.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot))
    finally:
        client.close()


def read_all(updates: IntentUpdates) -> list:
    found = []
    while batch := updates.read(block_s=None):
        found += batch
    return found
