"""Update notifications, the pure parts: the fields writer and reader agree on, the
settings and their configuration, and how an entry is parsed. The writer and the
follower against a real Redis are in ``tests/service/test_intent_updates_redis.py``.
"""

from __future__ import annotations

import pytest

from flink_jobs.config import AppConfig, ConfigError, load_config
from flink_jobs.runtime.counters import flushes_key, samples_key, stats_key
from flink_jobs.runtime.intent_store import (
    Notify,
)
from intent_reader.layout import NOTIFY_FIELDS, intent_key
from intent_reader.updates import (
    UPDATE_FIELDS,
    IntentUpdate,
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

        assert str(caught.value).startswith(f"redis.notify_stream {key!r} would be {what}")

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
