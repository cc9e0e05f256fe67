"""intent_reader.client: parsing HMGET replies, missing/stale/malformed behaviour, batching.

Redis is replaced by a small in-memory fake with the two calls the reader makes
(``pipeline(transaction=False)`` and ``hmget``); the hashes are written with the job's
own ``flink_jobs.runtime.intent_store.upsert_args``, so reader and writer agree on the layout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import redis
import redis.asyncio

from flink_jobs.core.events import load_schema
from flink_jobs.runtime.intent_store import RECORD_FIELDS, IntentRecord, upsert_args
from intent_reader import (
    AsyncIntentReader,
    IntentReader,
    MalformedIntentError,
    ReaderUnavailableError,
    ShopperIntent,
    intent_key,
    parse_intent,
)
from intent_reader.client import FIELDS
from intent_reader.layout import INTENT_LABELS, MAX_FIELD_BYTES
from tests.support.builders import intent_record

NOW_MS = 1_800_000_000_000
WRONGTYPE = "WRONGTYPE Operation against a key holding the wrong kind of value"
INTENT = {
    "intents": [
        {"label": "ready_to_buy", "confidence": 0.8, "category": "Running Shoes"},
        {"label": "comparing_options", "confidence": 0.4, "category": "Running Shoes"},
        {"label": "deal_seeking", "confidence": 0.2},
    ],
    "summary": "Added trail shoes to the cart",
}


class FakePipeline:
    def __init__(self, store: FakeRedis) -> None:
        self.store = store
        self.calls: list[tuple[str, Sequence[str]]] = []

    def __enter__(self) -> FakePipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def hmget(self, key: str, fields: Sequence[str]) -> None:
        self.calls.append((key, fields))

    def execute(self, raise_on_error: bool = True) -> list[list[bytes | None] | Exception]:
        """As redis-py's: an error reply raises, or with ``raise_on_error=False`` takes its
        command's place in the replies."""
        self.store.round_trips += 1
        if self.store.fail:
            raise redis.ConnectionError("connection refused")
        out: list[list[bytes | None] | Exception] = []
        for key, fields in self.calls:
            if key in self.store.strings:
                error = redis.ResponseError(WRONGTYPE)
                if raise_on_error:
                    raise error
                out.append(error)
                continue
            h = self.store.hashes.get(key, {})
            out.append([h.get(f) for f in fields])
        return out


class FakeRedis:
    def __init__(self) -> None:
        self.hashes: dict[str, dict[str, bytes]] = {}
        self.strings: dict[str, bytes] = {}  # keys of another type than a hash
        self.round_trips = 0
        self.fail = False

    def pipeline(self, transaction: bool = True) -> FakePipeline:
        assert transaction is False
        return FakePipeline(self)

    def write(self, record: IntentRecord, prefix: str = "si", written_at_ms: int = NOW_MS) -> None:
        """What UPSERT_SCRIPT stores for ``record``, built from the writer's own arguments."""
        args = upsert_args(record, ttl_ms=60_000)
        fields = {"version_ts": args[0], "version_seq": args[1], "written_at_ms": written_at_ms}
        pairs = args[3:]
        fields.update(dict(zip(pairs[::2], pairs[1::2], strict=True)))
        self.hashes[intent_key(record.shopper_id, prefix)] = {
            k: str(v).encode() for k, v in fields.items()
        }


def record(shopper_id: str = "s-1", event_ms: int = NOW_MS - 5_000, seq: int = 3) -> IntentRecord:
    return intent_record(
        shopper_id, event_ms, seq, intent=INTENT, top_label="ready_to_buy", template_hash="abc123"
    )


@pytest.fixture
def fake() -> FakeRedis:
    return FakeRedis()


def reader_of(fake: FakeRedis, **kwargs) -> IntentReader:
    return IntentReader(fake, clock=lambda: NOW_MS / 1000, **kwargs)  # type: ignore[arg-type]


class TestLayout:
    def test_reader_reads_every_field_the_writer_writes(self):
        written = {"version_ts", "version_seq", "written_at_ms", *RECORD_FIELDS}
        assert set(FIELDS) == written

    def test_key_matches_the_writer(self):
        from flink_jobs.runtime.intent_store import intent_key as writer_key

        assert intent_key("s-1", "p") == writer_key("s-1", "p") == "p:intent:s-1"


class TestParseIntent:
    def test_absent_hash_is_none(self):
        assert parse_intent("s", [None] * len(FIELDS), NOW_MS, 1000) is None

    def test_partial_hash_is_malformed_and_names_the_fields(self):
        values: list[bytes | None] = [b"1"] * len(FIELDS)
        values[FIELDS.index("model")] = None
        with pytest.raises(MalformedIntentError, match="model") as info:
            parse_intent("s-9", values, NOW_MS, 1000)
        assert info.value.shopper_id == "s-9"

    def test_unparsable_value_is_malformed(self, fake: FakeRedis):
        fake.write(record())
        values = [fake.hashes[intent_key("s-1")][f] for f in FIELDS]
        values[FIELDS.index("version_ts")] = b"yesterday"
        with pytest.raises(MalformedIntentError):
            parse_intent("s-1", values, NOW_MS, 1000)

    def test_wrong_reply_length_is_a_programming_error(self):
        with pytest.raises(ValueError):
            parse_intent("s", [None], NOW_MS, 1000)


class TestGet:
    def test_typed_result_with_age(self, fake: FakeRedis):
        fake.write(record(event_ms=NOW_MS - 5_000), written_at_ms=NOW_MS - 2_000)
        got = reader_of(fake).get("s-1")
        assert isinstance(got, ShopperIntent)
        assert got.age_ms == 5_000 and got.age_s == 5.0
        assert got.written_age_ms == 2_000
        assert not got.stale
        assert got.top_label == "ready_to_buy" and got.top_confidence == 0.8
        assert [x.label for x in got.labels] == [
            "ready_to_buy",
            "comparing_options",
            "deal_seeking",
        ]
        assert got.labels[2].category is None
        assert got.categories == ("Running Shoes",)
        assert got.confidence_of("comparing_options") == 0.4
        assert got.confidence_of("gift_shopping") == 0.0
        assert got.intent == INTENT
        assert (got.version_ts, got.version_seq) == (NOW_MS - 5_000, 3)

    def test_result_is_frozen(self, fake: FakeRedis):
        fake.write(record())
        got = reader_of(fake).get("s-1")
        with pytest.raises(AttributeError):
            got.stale = True  # type: ignore[misc, union-attr]

    def test_missing_is_none(self, fake: FakeRedis):
        assert reader_of(fake).get("nobody") is None

    def test_event_time_in_the_future_has_age_zero(self, fake: FakeRedis):
        fake.write(record(event_ms=NOW_MS + 3_000))
        assert reader_of(fake).get("s-1").age_ms == 0  # type: ignore[union-attr]

    def test_prefix_is_used(self, fake: FakeRedis):
        fake.write(record(), prefix="other")
        assert reader_of(fake).get("s-1") is None
        assert reader_of(fake, prefix="other").get("s-1") is not None


class TestStaleness:
    def test_stale_is_flagged_by_default(self, fake: FakeRedis):
        fake.write(record(event_ms=NOW_MS - 120_000))
        got = reader_of(fake, max_age_s=60).get("s-1")
        assert got is not None and got.stale

    def test_stale_is_dropped_on_request(self, fake: FakeRedis):
        fake.write(record(event_ms=NOW_MS - 120_000))
        assert reader_of(fake, max_age_s=60, stale="drop").get("s-1") is None

    def test_per_call_overrides(self, fake: FakeRedis):
        fake.write(record(event_ms=NOW_MS - 120_000))
        reader = reader_of(fake, max_age_s=60)
        assert reader.get("s-1", stale="drop") is None
        assert reader.get("s-1", max_age_s=300, stale="drop") is not None

    def test_boundary_is_not_stale(self, fake: FakeRedis):
        fake.write(record(event_ms=NOW_MS - 60_000))
        assert not reader_of(fake, max_age_s=60).get("s-1").stale  # type: ignore[union-attr]

    @pytest.mark.parametrize("bad", [{"max_age_s": 0}, {"stale": "ignore"}])
    def test_bad_settings_are_refused(self, fake: FakeRedis, bad):
        with pytest.raises(ValueError):
            reader_of(fake, **bad)


class TestGetMany:
    def test_one_round_trip_every_shopper_in_request_order(self, fake: FakeRedis):
        for sid in ("a", "c"):
            fake.write(record(sid))
        got = reader_of(fake).get_many(["c", "b", "a", "c"])
        assert list(got) == ["c", "b", "a"]
        assert got["b"] is None and got["a"] is not None and got["c"] is not None
        assert fake.round_trips == 1

    def test_empty_request_makes_no_call(self, fake: FakeRedis):
        assert reader_of(fake).get_many([]) == {}
        assert fake.round_trips == 0

    def test_malformed_hash_is_missing_unless_strict(self, fake: FakeRedis):
        fake.write(record("ok"))
        fake.hashes[intent_key("bad")] = {"version_ts": b"1"}
        got = reader_of(fake).get_many(["ok", "bad"])
        assert got["bad"] is None and got["ok"] is not None
        with pytest.raises(MalformedIntentError):
            reader_of(fake, strict=True).get_many(["ok", "bad"])

    def test_mixed_fresh_stale_missing(self, fake: FakeRedis):
        fake.write(record("fresh", event_ms=NOW_MS - 1_000))
        fake.write(record("old", event_ms=NOW_MS - 3_600_000))
        got = reader_of(fake, max_age_s=900, stale="drop").get_many(["fresh", "old", "none"])
        assert got["fresh"] is not None and got["old"] is None and got["none"] is None


class TestOneBadHashInABatch:
    """A hash that cannot be read costs its own shopper only: the batch returns the others'
    intents and names the bad one in ``errors`` with the reason."""

    @staticmethod
    def spoil(fake: FakeRedis, shopper: str, field: str, value: bytes) -> None:
        fake.write(record(shopper))
        fake.hashes[intent_key(shopper)][field] = value

    @pytest.mark.parametrize(
        ("field", "value", "reason"),
        [
            ("summary", b"caf\xe9 \xff", "not UTF-8"),
            ("facts", b"{" + b" " * (64 << 20) + b"}", "holds 67108866 bytes"),
            ("facts", b"[" * 50_000 + b"]" * 50_000, "nested too deep"),
            ("answer", b"x" * (MAX_FIELD_BYTES + 1), f"at most {MAX_FIELD_BYTES}"),
            ("top_confidence", b"nan", "not a finite number within"),
            ("top_confidence", b"1e308", "not a finite number within"),
            (
                "intent",
                b'{"intents":[{"label":"browsing","confidence":NaN}],"summary":"s"}',
                "not a finite number within",
            ),
            (
                "intent",
                b'{"intents":[{"label":"browsing","confidence":1e308}],"summary":"s"}',
                "not a finite number within",
            ),
            (
                "intent",
                b'{"intents":[{"label":"browsing","confidence":"0.5"}],"summary":"s"}',
                "not a number",
            ),
            ("intent", b'{"intents":["browsing"],"summary":"s"}', "not an object"),
        ],
        ids=[
            "utf8",
            "64mib",
            "deep",
            "big",
            "nan",
            "huge",
            "nan-label",
            "huge-label",
            "text-confidence",
            "not-an-object",
        ],
    )
    def test_the_good_shoppers_intents_are_returned_and_the_bad_one_named(
        self, fake: FakeRedis, field: str, value: bytes, reason: str
    ):
        fake.write(record("good-1"))
        self.spoil(fake, "bad", field, value)
        fake.write(record("good-2"))
        reader = reader_of(fake)

        got = reader.get_many(["good-1", "bad", "good-2"])

        assert got["good-1"] is not None and got["good-2"] is not None
        assert got["bad"] is None
        assert list(got.errors) == ["bad"]
        assert isinstance(got.errors["bad"], MalformedIntentError)
        assert reason in got.errors["bad"].reason
        assert reader.malformed == 1

    def test_a_key_of_another_type_is_named_with_redis_refusal(self, fake: FakeRedis):
        fake.write(record("good"))
        fake.strings[intent_key("bad")] = b"not a hash"

        got = reader_of(fake).get_many(["bad", "good"])

        assert got["good"] is not None and got["bad"] is None
        assert "WRONGTYPE" in got.errors["bad"].reason

    def test_a_strict_reader_raises_the_bad_hashs_error(self, fake: FakeRedis):
        fake.write(record("good"))
        fake.strings[intent_key("bad")] = b"not a hash"

        with pytest.raises(MalformedIntentError, match="WRONGTYPE"):
            reader_of(fake, strict=True).get_many(["good", "bad"])

    def test_a_batch_of_good_hashes_has_no_errors(self, fake: FakeRedis):
        fake.write(record("good"))

        assert reader_of(fake).get_many(["good", "missing"]).errors == {}

    def test_labels_the_reader_does_not_know_are_left_out(self, fake: FakeRedis):
        intent = {
            "intents": [
                {"label": "window_shopping", "confidence": 0.9},
                {"label": "browsing", "confidence": 0.5},
            ],
            "summary": "s",
        }
        fake.write(intent_record("s-1", NOW_MS - 1_000, 1, intent=intent, top_label="browsing"))

        got = reader_of(fake).get("s-1")

        assert got is not None
        assert [x.label for x in got.labels] == ["browsing"]

    def test_the_known_labels_are_the_intent_schemas(self):
        schema = load_schema("shopper_intent.schema.json")
        enum = schema["properties"]["intents"]["items"]["properties"]["label"]["enum"]

        assert tuple(enum) == INTENT_LABELS


class TestLifecycle:
    """A reader made by ``from_url`` owns its client and closes it; one given a client
    leaves it open for its owner."""

    class Client:
        def __init__(self) -> None:
            self.closed = 0

        def close(self) -> None:
            self.closed += 1

        async def aclose(self) -> None:
            self.closed += 1

    def test_from_url_closes_its_client_on_close_and_with(self, monkeypatch):
        made = [self.Client(), self.Client()]
        monkeypatch.setattr(redis.Redis, "from_url", lambda url, **kw: made.pop(0))
        first = IntentReader.from_url("redis://127.0.0.1:1/0")
        client = first.client

        first.close()
        with IntentReader.from_url("redis://127.0.0.1:1/0") as second:
            assert second.client.closed == 0

        assert (client.closed, second.client.closed) == (1, 1)

    def test_a_given_client_is_left_open(self):
        client = self.Client()

        with IntentReader(client) as reader:  # type: ignore[arg-type]
            reader.close()

        assert client.closed == 0

    def test_the_async_reader_closes_what_it_made_and_leaves_a_given_client(self, monkeypatch):
        made = self.Client()
        monkeypatch.setattr(redis.asyncio.Redis, "from_url", lambda url, **kw: made)
        given = self.Client()

        async def scenario() -> None:
            async with AsyncIntentReader.from_url("redis://127.0.0.1:1/0"):
                pass
            async with AsyncIntentReader(given):  # type: ignore[arg-type]
                pass

        asyncio.run(scenario())

        assert (made.closed, given.closed) == (1, 0)


class TestErrors:
    def test_unreachable_redis_raises_reader_unavailable(self, fake: FakeRedis):
        fake.fail = True
        with pytest.raises(ReaderUnavailableError) as info:
            reader_of(fake).get("s-1")
        assert isinstance(info.value.__cause__, redis.ConnectionError)
