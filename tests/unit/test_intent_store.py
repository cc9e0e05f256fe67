"""The versioned intent write, its pure protocol: key layout, script arguments, the
ordering rule and record checks. Its behaviour against a real Redis is in
``tests/service/test_intent_store_redis.py``.
"""

from __future__ import annotations

import pytest

from flink_jobs.runtime.intent_store import (
    RECORD_FIELDS,
    IntentRecord,
    IntentStoreError,
    intent_key,
    is_newer,
    parse_stored,
    upsert_args,
)
from tests.support.builders import versioned_record

# --- pure protocol -----------------------------------------------------------------------


class TestProtocol:
    def test_key_layout(self) -> None:
        assert intent_key("shopper-42") == "si:intent:shopper-42"
        assert intent_key("s1", prefix="stage") == "stage:intent:s1"

    def test_script_arguments(self) -> None:
        args = upsert_args(versioned_record(ts=1_700_000_000_123, seq=7), ttl_ms=5_000)
        assert args[:3] == ["1700000000123", "7", "5000"]
        pairs = dict(zip(args[3::2], args[4::2], strict=True))
        assert tuple(args[3::2]) == RECORD_FIELDS
        assert pairs["summary"] == "1700000000123.7"
        assert pairs["top_confidence"] == "0.8"
        assert pairs["event_time_ms"] == "1700000000123"

    def test_ttl_must_be_positive(self) -> None:
        with pytest.raises(ValueError, match="ttl_ms"):
            upsert_args(versioned_record(), ttl_ms=0)

    @pytest.mark.parametrize(
        ("field", "value"),
        [("version_ts", -1), ("version_seq", 1.5), ("event_time_ms", True), ("shopper_id", "")],
    )
    def test_record_rejects_bad_values(self, field: str, value: object) -> None:
        fields = {"shopper_id": "s", "version_ts": 1, "version_seq": 0, "event_time_ms": 1}
        fields[field] = value
        with pytest.raises(ValueError, match=field):
            IntentRecord(
                **fields,
                intent_json="{}",
                top_label="x",
                top_confidence=0.5,
                summary="",
                template="t",
                template_hash="h",
                model="m",
            )

    def test_record_rejects_confidence_out_of_range(self) -> None:
        with pytest.raises(ValueError, match="top_confidence"):
            IntentRecord("s", 1, 0, "{}", "x", 1.5, "", 1, "t", "h", "m")

    @pytest.mark.parametrize(
        ("candidate", "stored", "expected"),
        [
            ((2, 0), None, True),
            ((2, 0), (1, 9), True),
            ((2, 5), (2, 4), True),
            ((2, 4), (2, 4), False),
            ((2, 3), (2, 4), False),
            ((1, 9), (2, 0), False),
        ],
    )
    def test_ordering_rule(
        self, candidate: tuple[int, int], stored: tuple[int, int] | None, expected: bool
    ) -> None:
        assert is_newer(candidate, stored) is expected

    def test_parse_empty_hash_is_none(self) -> None:
        assert parse_stored("s", {}) is None

    def test_parse_malformed_hash_raises(self) -> None:
        with pytest.raises(IntentStoreError, match="malformed"):
            parse_stored("s", {b"version_ts": b"1"})
