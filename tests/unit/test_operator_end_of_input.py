"""The end of a bounded input: the wait for a shopper's newest prompt covers the calls
ahead of it in the outbox, and a poll left over after the operator closed does nothing."""

from __future__ import annotations

from types import SimpleNamespace

from flink_jobs.config import load_config
from flink_jobs.operators import ShopperSessions


def _sessions(in_system: int, max_concurrency: int = 8) -> ShopperSessions:
    sessions = ShopperSessions(
        load_config({"llm": {"max_concurrency": max_concurrency}}, environ={})
    )
    sessions._outbox = SimpleNamespace(in_system=in_system)
    return sessions


def test_an_empty_outbox_waits_for_one_round_of_calls_beyond_the_prompts_own():
    assert _sessions(0)._drain_timeout_s() < _sessions(1)._drain_timeout_s()


def test_the_wait_grows_with_the_rounds_of_calls_ahead():
    one_round, three_rounds = _sessions(8), _sessions(24)
    budget = load_config(environ={}).redis.write_retry_budget_s
    assert (three_rounds._drain_timeout_s() - budget) == 2 * (one_round._drain_timeout_s() - budget)


def test_a_poll_that_fires_after_close_does_nothing():
    """Seen in an eval run: a processing-time poll fired after the operator had closed its
    outbox, and the AttributeError failed the job into a restart."""
    from pyflink.datastream import TimeDomain

    sessions = _sessions(0)
    sessions._outbox = None
    ctx = SimpleNamespace(time_domain=lambda: TimeDomain.PROCESSING_TIME)
    assert list(sessions.on_timer(0, ctx)) == []
