"""``tests.support.waiting``, the one way a test waits: a wait returns what the condition
gave, and one that fails says what it waited for, how long, why it stopped and what it saw."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.support.clock import FakeClock
from tests.support.waiting import WaitFailed, held_for, passes_within, until, until_async


def true_on_call(n: int, value: object = "done"):
    """A check that passes from its ``n``-th call on, with ``value``."""
    calls = itertools.count(1)
    return lambda: value if next(calls) >= n else None


class TestUntil:
    def test_returns_the_first_true_value_of_the_check(self) -> None:
        assert until(true_on_call(3, {"events_in": 6}), "six events", interval_s=0) == {
            "events_in": 6
        }

    def test_a_timeout_names_what_was_waited_for_how_long_and_what_was_seen(self) -> None:
        with pytest.raises(WaitFailed) as failed:
            until(lambda: False, "the job to settle", timeout_s=0.05, explain=lambda: "lag 3")

        assert (
            str(failed.value) == "timed out after 0.05 s waiting for the job to settle; saw: lag 3"
        )

    def test_what_was_seen_over_several_lines_starts_on_its_own(self) -> None:
        with pytest.raises(WaitFailed, match="waiting for a write; saw:\njob log tail:\nboom"):
            until(lambda: False, "a write", timeout_s=0, explain=lambda: "job log tail:\nboom")

    def test_give_up_ends_the_wait_with_its_reason(self) -> None:
        with pytest.raises(
            WaitFailed, match=r"gave up waiting for a write after .* s: the job exited"
        ):
            until(lambda: False, "a write", timeout_s=600, give_up=lambda: "the job exited")

    def test_the_check_passing_wins_over_giving_up(self) -> None:
        assert until(lambda: 1, "a write", give_up=lambda: "the job exited") == 1

    def test_the_check_runs_once_more_before_giving_up(self) -> None:
        """A bounded job's last counts may land as it exits."""
        assert until(true_on_call(2), "the counts", give_up=lambda: "the job exited") == "done"

    def test_an_exception_from_the_check_ends_the_wait(self) -> None:
        def check() -> bool:
            raise ConnectionError("refused")

        with pytest.raises(ConnectionError):
            until(check, "an answer", timeout_s=600)

    def test_a_failed_wait_is_an_assertion_error(self) -> None:
        assert issubclass(WaitFailed, AssertionError)


class TestUntilAsync:
    def test_the_loop_runs_between_polls(self) -> None:
        async def go() -> str:
            done = asyncio.Event()
            asyncio.get_running_loop().call_soon(done.set)
            return await until_async(lambda: done.is_set() and "set", "the event")

        assert asyncio.run(go()) == "set"

    def test_the_check_may_be_a_coroutine_function(self) -> None:
        answers = iter([0, 0, 7])

        async def check() -> int:
            return next(answers)

        assert asyncio.run(until_async(check, "an answer", interval_s=0)) == 7

    def test_a_timeout_names_what_was_waited_for(self) -> None:
        with pytest.raises(WaitFailed, match=r"timed out after 0\.05 s waiting for the request"):
            asyncio.run(until_async(lambda: False, "the request", timeout_s=0.05))


class TestPassesWithin:
    def test_says_whether_the_check_passed(self) -> None:
        assert passes_within(true_on_call(2), 5, interval_s=0) is True
        assert passes_within(lambda: False, 0) is False

    def test_giving_up_is_not_passing(self) -> None:
        assert passes_within(lambda: False, 600, give_up=lambda: "gone") is False


class TestHeldFor:
    def test_passes_once_the_check_has_passed_for_the_whole_time(self) -> None:
        clock = FakeClock()
        held = held_for(lambda: "settled", 10, clock=clock)

        assert held() is None  # the time starts
        clock.advance(9)
        assert held() is None
        clock.advance(1)
        assert held() == "settled"

    def test_a_failed_check_starts_the_time_again(self) -> None:
        clock = FakeClock()
        answers = iter(["settled", None, "settled", "settled"])
        held = held_for(lambda: next(answers), 10, clock=clock)

        held()
        clock.advance(10)
        assert held() is None  # failed: the time starts again at the next pass
        held()
        clock.advance(10)
        assert held() == "settled"

    def test_unchanged_also_needs_the_same_value_throughout(self) -> None:
        clock = FakeClock()
        counts = iter([{"n": 1}, {"n": 2}, {"n": 2}])
        held = held_for(lambda: next(counts), 5, unchanged=True, clock=clock)

        held()
        clock.advance(5)
        assert held() is None  # changed: the time starts again
        clock.advance(5)
        assert held() == {"n": 2}
