"""The key layout on Redis Cluster: every key one write touches shares a hash slot, so the
versioned upsert stays one script; the single-node layout is unchanged; the configuration
that selects it, and refuses what would break it.

Slots are computed as Redis computes them (``redis.crc.key_slot`` is redis-py's own), so
"same slot" here is what the server checks with ``CROSSSLOT``. The layout against a real
cluster is in ``tests/service/test_redis_cluster_*.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.crc import key_slot as redis_key_slot

from flink_jobs.config import ConfigError, load_config
from flink_jobs.runtime.counters import flushes_key, samples_key, stats_key
from flink_jobs.runtime.intent_store import Notify, evalsha_args
from intent_reader.layout import (
    DEFAULT_CLUSTER_SHARDS,
    HASH_SLOTS,
    KeyLayout,
    intent_key,
    key_slot,
    shard_tag,
)
from tests.support.builders import intent_record

#: Shopper ids as the event schema allows them.
shopper_ids = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:-",
    min_size=1,
    max_size=64,
)
CLUSTER = KeyLayout("si", DEFAULT_CLUSTER_SHARDS)


class TestSlots:
    @pytest.mark.parametrize(
        "key",
        ["", "a", "si:intent:shopper-42", "{s7}", "x{s7}y", "{}x", "a{}{b}", "{a", "}{a}", "é"],
    )
    def test_the_slot_is_the_one_redis_computes(self, key: str) -> None:
        assert key_slot(key) == redis_key_slot(key.encode())

    @given(shopper_ids)
    def test_a_shopper_ids_slot_is_the_one_redis_computes(self, shopper_id: str) -> None:
        assert key_slot(shopper_id) == redis_key_slot(shopper_id.encode())

    def test_every_shard_of_the_default_layout_has_a_slot_of_its_own(self) -> None:
        slots = {key_slot(shard_tag(n)) for n in range(DEFAULT_CLUSTER_SHARDS)}

        assert len(slots) == DEFAULT_CLUSTER_SHARDS


class TestSingleNodeLayout:
    def test_its_keys_are_unchanged(self) -> None:
        layout = KeyLayout("si")

        assert layout.intent_key("shopper-42") == intent_key("shopper-42") == "si:intent:shopper-42"
        assert layout.notify_keys("si:intent-updates") == ("si:intent-updates",)
        assert layout.notify_key("si:intent-updates", "shopper-42") == "si:intent-updates"
        assert layout.stats_keys() == (stats_key("si"),) == ("si:stats",)
        assert layout.flushes_key() == flushes_key("si") == "si:stats:flushes"
        assert layout.samples_keys("llm_latency_ms") == (samples_key("si", "llm_latency_ms"),)
        assert layout.notify_maxlen(100_000) == 100_000

    def test_the_upsert_names_the_plain_keys(self) -> None:
        args = evalsha_args(intent_record("shopper-42"), KeyLayout("si"), 1_000, "sha", Notify("n"))

        assert args[:4] == ["sha", 2, "si:intent:shopper-42", "n"]

    def test_a_brace_in_the_prefix_is_its_own_business(self) -> None:
        assert KeyLayout("{si}").intent_key("s") == "{si}:intent:s"


class TestClusterLayout:
    def test_a_shoppers_key_carries_its_shards_tag(self) -> None:
        shard = key_slot("shopper-42") % DEFAULT_CLUSTER_SHARDS

        assert CLUSTER.shard_of("shopper-42") == shard
        assert CLUSTER.intent_key("shopper-42") == f"si:intent:{{s{shard}}}:shopper-42"

    @given(shopper_ids)
    def test_the_upserts_keys_share_one_slot(self, shopper_id: str) -> None:
        args = evalsha_args(
            intent_record(shopper_id), CLUSTER, 1_000, "sha", Notify("si:intent-updates")
        )
        intent, stream = args[2], args[3]

        assert args[1] == 2
        assert redis_key_slot(intent.encode()) == redis_key_slot(stream.encode())
        assert stream in CLUSTER.notify_keys("si:intent-updates")

    def test_a_stats_hash_and_its_ledger_share_one_slot(self) -> None:
        for shard in range(DEFAULT_CLUSTER_SHARDS):
            stats, ledger = CLUSTER.stats_key(shard), CLUSTER.flushes_key(shard)
            assert redis_key_slot(stats.encode()) == redis_key_slot(ledger.encode())

    def test_there_is_a_stats_hash_and_a_samples_list_per_shard(self) -> None:
        stats = CLUSTER.stats_keys()
        samples = CLUSTER.samples_keys("llm_latency_ms")

        assert len(set(stats)) == len(set(samples)) == DEFAULT_CLUSTER_SHARDS
        assert stats[7] == "si:stats:{s7}"
        assert samples[7] == "si:samples:llm_latency_ms:{s7}"

    def test_the_stream_is_one_key_per_shard_trimmed_to_a_share_of_the_length(self) -> None:
        keys = CLUSTER.notify_keys("si:intent-updates")

        assert keys[7] == "si:intent-updates:{s7}"
        assert len(keys) == DEFAULT_CLUSTER_SHARDS
        assert CLUSTER.notify_maxlen(100_000) == 1_563  # 64 shards hold about 100,000
        assert CLUSTER.notify_maxlen(10) == 1

    @given(shopper_ids)
    def test_a_key_names_its_shopper(self, shopper_id: str) -> None:
        assert CLUSTER.shopper_id(CLUSTER.intent_key(shopper_id)) == shopper_id
        assert KeyLayout("si").shopper_id(intent_key(shopper_id)) == shopper_id

    @pytest.mark.parametrize(
        "key",
        ["si:stats:{s1}", "si:intent:shopper-42", "si:intent:{s1}:shopper-42", "si:intent:{s1}:"],
    )
    def test_a_key_that_is_no_shoppers_names_none(self, key: str) -> None:
        # shopper-42's shard is not 1, so its key in shard 1 is not one the job writes
        assert CLUSTER.shard_of("shopper-42") != 1
        assert CLUSTER.shopper_id(key) is None

    def test_a_brace_in_the_prefix_is_refused(self) -> None:
        with pytest.raises(ValueError, match="brace"):
            KeyLayout("{si}", 16)

    @pytest.mark.parametrize("shards", [-1, HASH_SLOTS + 1])
    def test_a_number_of_shards_outside_the_slots_is_refused(self, shards: int) -> None:
        with pytest.raises(ValueError, match="shards"):
            KeyLayout("si", shards)


class TestConfig:
    def test_off_by_default(self) -> None:
        config = load_config(environ={})

        assert config.redis.cluster is False
        assert config.redis.layout() == KeyLayout("si", 0)

    def test_on_the_job_writes_the_cluster_layout(self) -> None:
        config = load_config(environ={"SI_REDIS_CLUSTER": "true", "SI_REDIS_CLUSTER_SHARDS": "16"})

        assert config.redis.layout() == KeyLayout("si", 16)

    def test_the_job_makes_a_cluster_client_for_its_store(self) -> None:
        import redis.asyncio.cluster

        from flink_jobs.runtime.inference import PromptRunner

        config = load_config(
            environ={"SI_REDIS_CLUSTER": "true", "SI_REDIS_NOTIFY_STREAM": "si:updates"}
        )
        _llm, store = PromptRunner(config).clients()

        assert isinstance(store.client, redis.asyncio.cluster.RedisCluster)
        assert store.layout == KeyLayout("si", DEFAULT_CLUSTER_SHARDS)

    @pytest.mark.parametrize(
        ("environ", "message"),
        [
            ({"SI_REDIS_URL": "unix:///run/redis.sock"}, "redis:// or rediss://"),
            ({"SI_REDIS_URL": "redis://cache:6379/2"}, "database 0 only"),
            ({"SI_REDIS_KEY_PREFIX": "{si}"}, r"redis\.key_prefix: '\{si\}' holds a brace"),
            ({"SI_REDIS_NOTIFY_STREAM": "{si}:updates"}, r"redis\.notify_stream: .* brace"),
            ({"SI_REDIS_CLUSTER_SHARDS": "0"}, r"redis\.cluster_shards: must be >= 1"),
        ],
    )
    def test_what_would_break_the_cluster_layout_is_refused(
        self, environ: dict[str, str], message: str
    ) -> None:
        with pytest.raises(ConfigError, match=message):
            load_config(environ={"SI_REDIS_CLUSTER": "true", **environ})

    def test_a_cluster_url_may_name_database_zero_or_none(self) -> None:
        for url in ("redis://cache:6379", "rediss://:token@cache:6379/0"):
            config = load_config(environ={"SI_REDIS_CLUSTER": "true", "SI_REDIS_URL": url})
            assert config.redis.cluster
