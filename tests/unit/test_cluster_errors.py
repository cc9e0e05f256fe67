"""What a Redis Cluster in motion means for a write and for a read: each refusal of a
failover or a slot migration is one the write waits out within its retry budget, never a
dead letter nor a failure of the batch's other shoppers; a reader names the shoppers it
could not read and reads the others.

Against a real cluster (a killed primary, a migrated slot) in
``tests/service/test_redis_cluster_failover.py`` and ``..._resharding.py``.
"""

from __future__ import annotations

import pytest
import redis.exceptions

from flink_jobs.runtime.intent_store import (
    IntentStoreError,
    KeyRejectedError,
    StoreBusyError,
    StoreUnavailableError,
    _results_to_bools,
    server_error,
)
from intent_reader import IntentReader, ReaderUnavailableError
from intent_reader.client import FIELDS
from tests.support.builders import intent_record

RECORDS = [intent_record("shopper-1"), intent_record("shopper-2")]


class TestWrite:
    @pytest.mark.parametrize(
        ("error", "code"),
        [
            (redis.exceptions.ClusterDownError("The cluster is down"), "CLUSTERDOWN"),
            (redis.exceptions.MovedError("3999 127.0.0.1:6381"), "MOVED"),
            (redis.exceptions.AskError("3999 127.0.0.1:6381"), "ASK"),
            (redis.exceptions.TryAgainError("Multiple keys request during rehashing"), "TRYAGAIN"),
            (redis.exceptions.MasterDownError("Link with MASTER is down"), "MASTERDOWN"),
        ],
    )
    def test_a_cluster_in_motion_is_waited_out(self, error: Exception, code: str) -> None:
        mapped = server_error(error, "shopper-1")

        assert isinstance(mapped, StoreBusyError)
        assert mapped.code == code

    @pytest.mark.parametrize(
        "reply",
        [
            redis.exceptions.ConnectionError("Connection reset by peer"),
            redis.exceptions.TimeoutError("Timeout reading from socket"),
            redis.exceptions.ClusterError("TTL exhausted."),
        ],
    )
    def test_a_node_lost_mid_batch_retries_the_batch(self, reply: Exception) -> None:
        with pytest.raises(StoreUnavailableError):
            _results_to_bools(RECORDS, [1, reply])

    def test_a_refusal_of_one_key_stays_that_shoppers(self) -> None:
        wrongtype = redis.exceptions.ResponseError("WRONGTYPE the intent key holds a string")

        with pytest.raises(KeyRejectedError) as raised:
            _results_to_bools(RECORDS, [wrongtype, 1])

        assert raised.value.shopper_id == "shopper-1"

    def test_any_other_error_reply_fails_loudly(self) -> None:
        with pytest.raises(IntentStoreError) as raised:
            _results_to_bools(RECORDS, [redis.exceptions.ResponseError("ERR bug"), 1])

        assert not isinstance(raised.value, StoreUnavailableError)


class OneNodeDown:
    """A pipeline whose replies for ``down`` keys are the errors a cluster client leaves in
    place of a node it could not reach (or a slot no node serves yet)."""

    def __init__(self, down: set[str], error: Exception) -> None:
        self.down, self.error, self.keys = down, error, []

    def pipeline(self, transaction: bool = True) -> OneNodeDown:
        return self

    def __enter__(self) -> OneNodeDown:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def hmget(self, key: str, fields: object) -> None:
        self.keys.append(key)

    def execute(self, raise_on_error: bool = True) -> list[object]:
        keys, self.keys = self.keys, []
        return [self.error if k in self.down else [None] * len(FIELDS) for k in keys]


class TestRead:
    @pytest.mark.parametrize(
        "error",
        [
            redis.exceptions.ConnectionError("Error 111 connecting"),
            redis.exceptions.ClusterDownError("The cluster is down"),
            redis.exceptions.MovedError("3999 127.0.0.1:6381"),
        ],
    )
    def test_a_shopper_on_a_node_that_cannot_answer_is_named_and_the_rest_read(
        self, error: Exception
    ) -> None:
        client = OneNodeDown({"si:intent:shopper-2"}, error)
        reader = IntentReader(client, shards=0)  # type: ignore[arg-type]

        batch = reader.get_many(["shopper-1", "shopper-2", "shopper-3"])

        assert batch == {"shopper-1": None, "shopper-2": None, "shopper-3": None}
        assert set(batch.errors) == {"shopper-2"}
        assert isinstance(batch.errors["shopper-2"], ReaderUnavailableError)
        assert reader.malformed == 0

    def test_a_batch_no_node_could_answer_raises(self) -> None:
        keys = {"si:intent:shopper-1", "si:intent:shopper-2"}
        reader = IntentReader(OneNodeDown(keys, redis.exceptions.ConnectionError("down")))  # type: ignore[arg-type]

        with pytest.raises(ReaderUnavailableError):
            reader.get_many(["shopper-1", "shopper-2"])
