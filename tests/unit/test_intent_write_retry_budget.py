"""The intent write's retry uses its whole budget: attempts go on until
the deadline, the last wait cut short to land on it, and only then is the failure raised.

On a fake clock: the store never answers and every wait moves the clock, so the attempt
times are exact and the test takes no time."""

from __future__ import annotations

import asyncio

import pytest

from flink_jobs.runtime.inference import RedisUnavailable, upsert_with_retry
from flink_jobs.runtime.intent_store import IntentRecord, StoreUnavailableError
from tests.support.clock import FakeClock

T0 = 1_780_304_400_000  # 2026-06-01T09:00:00Z

RECORD = IntentRecord(
    shopper_id="shopper-00146",
    version_ts=T0,
    version_seq=3,
    intent_json='{"intents":[{"label":"browsing","confidence":0.6}],"summary":"Browsing."}',
    top_label="browsing",
    top_confidence=0.6,
    summary="Browsing.",
    event_time_ms=T0,
    template="shopper_intent_v1.j2",
    template_hash="56171ff6b9a3",
    model="SmolLM2-135M-Instruct",
)


class DownStore:
    """An intent store whose Redis never answers; it notes when each attempt was made."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.attempts_at: list[float] = []

    async def upsert(self, record: IntentRecord) -> bool:
        self.attempts_at.append(self.clock.now)
        raise StoreUnavailableError("Redis unavailable: connection refused")


def retry_until_given_up(budget_s: float) -> tuple[FakeClock, DownStore]:
    clock = FakeClock()
    store = DownStore(clock)

    async def main() -> None:
        await upsert_with_retry(store, RECORD, budget_s, clock=clock.time, sleep=clock.sleep)

    with pytest.raises(RedisUnavailable, match="shopper-00146"):
        asyncio.run(main())
    return clock, store


def test_a_one_second_budget_is_used_to_its_end() -> None:
    clock, store = retry_until_given_up(budget_s=1.0)

    assert clock.now == pytest.approx(1.0)
    assert store.attempts_at == pytest.approx([0.0, 0.1, 0.3, 0.7, 1.0])


def test_the_last_wait_is_cut_to_the_deadline() -> None:
    clock, _ = retry_until_given_up(budget_s=1.0)

    assert clock.waits == pytest.approx([0.1, 0.2, 0.4, 0.3])


def test_a_thirty_second_budget_ends_with_an_attempt_at_its_deadline() -> None:
    """The default ``redis.write_retry_budget_s``: waits double up to 5 s, then stay there."""
    clock, store = retry_until_given_up(budget_s=30.0)

    assert store.attempts_at[-1] == pytest.approx(30.0)
    assert max(clock.waits) == pytest.approx(5.0)
    assert clock.now == pytest.approx(30.0)
