"""Update notifications, the pure parts: the fields writer and reader agree on, the
settings and their configuration, and how an entry is parsed. The writer and the
follower against a real Redis are in ``tests/service/test_intent_updates_redis.py``.
"""

from __future__ import annotations

import itertools

import pytest
import redis

from flink_jobs.config import AppConfig, ConfigError, load_config
from flink_jobs.runtime.counters import flushes_key, samples_key, stats_key
from flink_jobs.runtime.intent_store import (
    Notify,
)
from intent_reader.layout import MAX_FIELD_BYTES, NOTIFY_FIELDS, intent_key
from intent_reader.updates import (
    UPDATE_FIELDS,
    IntentUpdate,
    IntentUpdates,
    MalformedUpdateError,
    parse_update,
)

# --- the writer --------------------------------------------------------------------------


class TestWriterNotifies:
    def test_reader_and_writer_agree_on_the_fields(self) -> None:
        assert UPDATE_FIELDS == NOTIFY_FIELDS

    @pytest.mark.parametrize(("stream", "maxlen"), [("", 10), ("x", 0)])
    def test_notify_rejects_bad_settings(self, stream: str, maxlen: int) -> None:
        with pytest.raises(ValueError):
            Notify(stream, maxlen)


class TestConfig:
    def test_off_unless_configured(self) -> None:
        assert AppConfig().redis.notify_stream == ""

    def test_set_from_the_environment(self) -> None:
        config = load_config(
            environ={
                "SI_REDIS_NOTIFY_STREAM": "si:intent-updates",
                "SI_REDIS_NOTIFY_STREAM_MAXLEN": "5000",
            }
        )
        assert (config.redis.notify_stream, config.redis.notify_stream_maxlen) == (
            "si:intent-updates",
            5000,
        )

    def test_a_stream_key_that_is_a_shopper_key_is_refused(self) -> None:
        with pytest.raises(ConfigError, match="notify_stream"):
            load_config(environ={"SI_REDIS_NOTIFY_STREAM": "si:intent:updates"})

    @pytest.mark.parametrize(
        ("key", "what"),
        [
            (stats_key("si"), "the stats hash"),
            (flushes_key("si"), "the stats ledger"),
            (samples_key("si", "llm_latency_ms"), "a timing samples list"),
            (intent_key("updates", "si"), "a shopper's intent key"),
        ],
    )
    def test_a_stream_key_that_is_another_key_of_the_layout_is_refused(
        self, key: str, what: str
    ) -> None:
        with pytest.raises(ConfigError) as caught:
            load_config(environ={"SI_REDIS_NOTIFY_STREAM": key})

        assert str(caught.value).startswith(f"redis.notify_stream: {key!r} would be {what}")

    def test_the_layouts_keys_under_another_prefix_are_free(self) -> None:
        config = load_config(environ={"SI_REDIS_NOTIFY_STREAM": stats_key("other")})

        assert config.redis.notify_stream == "other:stats"

    def test_maxlen_must_be_positive(self) -> None:
        with pytest.raises(ConfigError, match="notify_stream_maxlen"):
            load_config(environ={"SI_REDIS_NOTIFY_STREAM_MAXLEN": "0"})

    def test_the_job_passes_it_to_the_store(self) -> None:
        from flink_jobs.runtime.inference import PromptRunner

        config = load_config(
            environ={"SI_REDIS_NOTIFY_STREAM": "x:updates", "SI_REDIS_NOTIFY_STREAM_MAXLEN": "7"}
        )
        _llm, intent_store = PromptRunner(config).clients()
        assert intent_store.notify == Notify("x:updates", 7)


# --- the follower ------------------------------------------------------------------------


def test_parse_update_types_the_fields() -> None:
    update = parse_update(
        b"1-2",
        {
            b"shopper_id": b"s",
            b"version_ts": b"5",
            b"version_seq": b"1",
            b"top_label": b"browsing",
            b"written_at_ms": b"9",
        },
    )
    assert update == IntentUpdate("1-2", "s", 5, 1, "browsing", 9)


def test_parse_update_refuses_non_numbers() -> None:
    fields = {name: "x" for name in UPDATE_FIELDS}
    with pytest.raises(MalformedUpdateError, match="1-0"):
        parse_update("1-0", fields)


GOOD = {
    b"shopper_id": b"s",
    b"version_ts": b"5",
    b"version_seq": b"1",
    b"top_label": b"browsing",
    b"written_at_ms": b"9",
}


def test_parse_update_refuses_bytes_that_are_not_utf8() -> None:
    with pytest.raises(MalformedUpdateError, match="not UTF-8"):
        parse_update(b"1-0", {**GOOD, b"shopper_id": b"caf\xe9"})


def test_parse_update_refuses_a_field_over_the_size_bound() -> None:
    with pytest.raises(MalformedUpdateError, match=f"at most {MAX_FIELD_BYTES}"):
        parse_update(b"1-0", {**GOOD, b"intent": b"x" * (MAX_FIELD_BYTES + 1)})


class StreamClient:
    """The two calls a follower makes, over batches of entries given up front."""

    def __init__(self, batches: list[list[tuple[bytes, dict[bytes, bytes]]]]) -> None:
        self.batches = batches
        self.closed = 0

    def xinfo_stream(self, stream: str) -> dict[str, object]:
        return {"last-generated-id": b"0-0", "entries-added": 0, "length": 0}

    def xread(self, streams: dict[str, str], count: int, block: int | None):
        return [[b"s", self.batches.pop(0)]] if self.batches else []

    def close(self) -> None:
        self.closed += 1


class TestFollower:
    def test_follow_passes_an_entry_that_is_not_utf8_and_yields_the_rest(self) -> None:
        client = StreamClient(
            [
                [(b"1-0", GOOD), (b"2-0", {**GOOD, b"top_label": b"\xff\xfe"}), (b"3-0", GOOD)],
                [(b"4-0", GOOD)],
            ]
        )
        updates = IntentUpdates(client, "s")  # type: ignore[arg-type]

        got = list(itertools.islice(updates.follow(poll_s=0.01), 3))

        assert [u.entry_id for u in got] == ["1-0", "3-0", "4-0"]
        assert (updates.malformed, updates.last_id) == (1, "4-0")

    def test_read_raises_the_bad_entry_with_the_good_ones_of_its_batch(self) -> None:
        client = StreamClient([[(b"1-0", {b"hello": b"world"}), (b"2-0", GOOD)]])
        updates = IntentUpdates(client, "s")  # type: ignore[arg-type]

        with pytest.raises(MalformedUpdateError, match="missing shopper_id") as caught:
            updates.read()

        assert [u.entry_id for u in caught.value.updates] == ["2-0"]

    def test_from_url_closes_its_client_and_a_given_one_is_left_open(self, monkeypatch) -> None:
        made = StreamClient([])
        monkeypatch.setattr(redis.Redis, "from_url", lambda url, **kw: made)
        given = StreamClient([])

        with IntentUpdates.from_url("redis://127.0.0.1:1/0", "s"):
            pass
        with IntentUpdates(given, "s"):  # type: ignore[arg-type]
            pass

        assert (made.closed, given.closed) == (1, 0)
