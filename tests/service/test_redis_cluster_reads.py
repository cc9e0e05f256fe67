"""Reading what the job writes to a Redis Cluster: intents of shoppers on every node in one
``get_many`` (sync and asyncio), every shard of the notification stream followed, every
intent found by the run summary's scan, and the job's start check of the stream's shards.

The session's cluster (three primaries with a replica each); each test under its own
prefix. The layout itself (tags, slots, shards) is specified in
``tests/unit/test_cluster_layout.py``.
"""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio.cluster
import redis.cluster

from flink_jobs.runtime.intent_store import (
    AsyncIntentStore,
    IntentStore,
    Notify,
    NotifyStreamError,
    check_notify_stream,
)
from flink_jobs.tools.local_services import RedisClusterService
from flink_jobs.tools.run_summary import read_intents
from intent_reader import AsyncIntentReader, IntentReader, IntentUpdates, KeyLayout
from intent_reader.layout import DEFAULT_CLUSTER_SHARDS, key_slot
from tests.support.builders import intent_record

SHOPPERS = [f"shopper-{i:03d}" for i in range(60)]


def write_all(client: redis.cluster.RedisCluster, prefix: str, notify: Notify | None = None):
    store = IntentStore(client, prefix, notify=notify)
    assert store.upsert_many([intent_record(s, 1_000 + i, 1) for i, s in enumerate(SHOPPERS)])
    return store


def test_one_batch_reads_shoppers_whose_keys_are_on_every_primary(
    redis_cluster: RedisClusterService, cluster_client, unique_name: str
) -> None:
    store = write_all(cluster_client, unique_name)
    owners = {redis_cluster.owner_of(key_slot(store.key(s))).port for s in SHOPPERS}

    with IntentReader.from_url(
        redis_cluster.url, timeout_s=2.0, cluster=True, prefix=unique_name
    ) as reader:
        batch = reader.get_many(SHOPPERS)

    assert len(owners) == 3
    assert not batch.errors
    assert {s: i.version_ts for s, i in batch.items()} == {
        s: 1_000 + n for n, s in enumerate(SHOPPERS)
    }


def test_the_asyncio_reader_reads_the_same_batches_side_by_side(
    redis_cluster: RedisClusterService, cluster_client, unique_name: str
) -> None:
    write_all(cluster_client, unique_name)

    async def read() -> dict[str, int]:
        async with AsyncIntentReader.from_url(
            redis_cluster.url, timeout_s=2.0, cluster=True, prefix=unique_name
        ) as reader:
            batches = await asyncio.gather(*(reader.get_many(SHOPPERS) for _ in range(4)))
        assert all(not b.errors for b in batches)
        return [{s: i.version_ts for s, i in b.items()} for b in batches]

    expected = {s: 1_000 + n for n, s in enumerate(SHOPPERS)}
    assert asyncio.run(read()) == [expected] * 4


def test_a_follower_reads_every_landed_write_from_every_shard(
    redis_cluster: RedisClusterService, cluster_client, unique_name: str
) -> None:
    stream = f"{unique_name}:intent-updates"
    updates = IntentUpdates(cluster_client, stream)  # from now on, every shard

    async def write() -> None:
        client = redis.asyncio.cluster.RedisCluster.from_url(redis_cluster.url)
        try:
            store = AsyncIntentStore(client, unique_name, notify=Notify(stream))
            assert all(await store.upsert_many([intent_record(s, 5_000, 2) for s in SHOPPERS]))
            assert not any(await store.upsert_many([intent_record(s, 4_000, 9) for s in SHOPPERS]))
        finally:
            await client.aclose()

    asyncio.run(write())
    seen = []
    while len(seen) < len(SHOPPERS):
        batch = updates.read(block_s=5.0)
        assert batch, "the follower found no more updates"
        seen += batch

    layout = KeyLayout(unique_name, DEFAULT_CLUSTER_SHARDS)
    shards = {layout.shard_of(u.shopper_id) for u in seen}
    assert sorted(u.shopper_id for u in seen) == SHOPPERS
    assert {(u.version_ts, u.version_seq) for u in seen} == {(5_000, 2)}
    assert len(shards) > 1
    assert updates.read(block_s=None) == []
    assert updates.missed() == 0


def test_a_follower_resumes_from_its_saved_cursors(
    redis_cluster: RedisClusterService, cluster_client, unique_name: str
) -> None:
    stream = f"{unique_name}:intent-updates"
    first = IntentUpdates(cluster_client, stream, start="earliest")
    write_all(cluster_client, unique_name, Notify(stream))
    read_first = first.read(block_s=5.0)
    saved = first.last_ids

    store = IntentStore(cluster_client, unique_name, notify=Notify(stream))
    store.upsert_many([intent_record(s, 9_000, 1) for s in SHOPPERS[:5]])
    resumed = IntentUpdates(cluster_client, stream, start=saved)
    again = []
    while batch := resumed.read(block_s=None):
        again += batch

    assert sorted(u.shopper_id for u in read_first) == SHOPPERS
    assert sorted(u.shopper_id for u in again) == SHOPPERS[:5]
    assert {u.version_ts for u in again} == {9_000}


def test_the_run_summary_finds_every_intent_on_every_primary(
    redis_cluster: RedisClusterService, cluster_client, unique_name: str
) -> None:
    write_all(cluster_client, unique_name)

    rows = read_intents(cluster_client, unique_name, shards=DEFAULT_CLUSTER_SHARDS)

    assert sorted(r.shopper_id for r in rows) == SHOPPERS


def test_the_start_check_refuses_a_shard_of_the_stream_that_is_not_a_stream(
    cluster_client, unique_name: str
) -> None:
    stream = f"{unique_name}:intent-updates"
    layout = KeyLayout(unique_name, DEFAULT_CLUSTER_SHARDS)
    cluster_client.set(layout.notify_keys(stream)[7], "not a stream")

    with pytest.raises(NotifyStreamError, match=r"\{s7\}.*holds a string"):
        check_notify_stream(cluster_client, stream, layout)
