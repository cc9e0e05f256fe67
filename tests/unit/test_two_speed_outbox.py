"""Two speeds in the outbox: a prompt's rules-only write is dispatched when it is
submitted, takes no call slot, waits for no call and is never superseded; its outcome
settles apart from the call's (``source="rules"``) and is counted apart; a rules write that
fails for good fails the outbox as a call does. And ``latest_wins=False``: every prompt is
answered, in order. Calls and writes are fakes here; the job's own runner over a real
Redis and the call process are in ``tests/service/test_two_speed_outbox.py``."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from flink_jobs.core.events import DeadLetter
from flink_jobs.core.intents import Intent
from flink_jobs.core.tasks import PromptTask, TaskResult
from flink_jobs.metrics import OutcomeRecorder
from flink_jobs.runtime.outbox import Outbox, OutboxFailed, Settled
from tests.support.builders import prompt_task
from tests.support.fake_metrics import FakeGroup, FakeStats
from tests.support.waiting import until

WAIT_S = 10.0
RULES = Intent(
    {"intents": [{"label": "browsing", "confidence": 0.5}], "summary": "Browsing Headphones."},
    "browsing",
    0.5,
    "Browsing Headphones.",
    source="rules",
)


def task(shopper_id: str, seq: int) -> PromptTask:
    return dataclasses.replace(prompt_task(shopper_id, seq), rules=RULES, facts_json="{}")


class Fakes:
    """A runner whose calls wait until released and whose rules writes land at once (or
    raise)."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.calls: list[tuple[str, int]] = []
        self.rules: list[tuple[str, int]] = []
        self.rules_error: Exception | None = None
        self.stopped: list[tuple[str, int]] = []

    async def run(self, t: PromptTask) -> TaskResult:
        self.calls.append((t.shopper_id, t.seq))
        while not self.released.is_set():
            await asyncio.sleep(0.002)
        return TaskResult("written", attempts=1, llm_latency_s=0.01)

    async def write_rules(self, t: PromptTask) -> TaskResult:
        if self.rules_error is not None:
            raise self.rules_error
        self.rules.append((t.shopper_id, t.seq))
        return TaskResult("written", source="rules")

    def supersede(self, shopper_id: str, seq: int) -> None:
        self.stopped.append((shopper_id, seq))

    async def aclose(self) -> None:
        pass


@pytest.fixture
def fakes() -> Fakes:
    return Fakes()


@pytest.fixture
def outbox_for(fakes: Fakes):
    made: list[Outbox] = []

    def make(latest_wins: bool = True, capacity: int = 8, max_concurrency: int = 1) -> Outbox:
        outbox = Outbox(fakes, capacity, max_concurrency, latest_wins=latest_wins)
        made.append(outbox.start())
        return outbox

    yield make
    fakes.released.set()
    for outbox in made:
        outbox.close()


def settled(outbox: Outbox, shopper_id: str) -> list[tuple[int, str, str]]:
    return [(s.task.seq, s.result.source, s.result.outcome) for s in outbox.collect(shopper_id)]


class TestTheRulesLane:
    def test_a_rules_write_lands_while_every_call_slot_is_busy(self, outbox_for, fakes) -> None:
        outbox = outbox_for()
        outbox.submit(task("shopper-00043", 1))
        until(
            lambda: fakes.calls, "the other shopper's call to hold the only slot", timeout_s=WAIT_S
        )

        outbox.submit(task("shopper-00146", 3))

        until(lambda: ("shopper-00146", 3) in fakes.rules, "the rules write", timeout_s=WAIT_S)
        until(lambda: not outbox.writing_rules("shopper-00146"), "its outcome", timeout_s=WAIT_S)
        assert settled(outbox, "shopper-00146") == [(3, "rules", "written")]
        assert ("shopper-00146", 3) not in fakes.calls  # the call still waits for the slot
        assert outbox.tracks("shopper-00146", 3)  # its rules outcome does not settle the call

    def test_every_prompts_rules_write_runs_though_a_newer_prompt_supersedes_its_call(
        self, outbox_for, fakes
    ) -> None:
        outbox = outbox_for()
        outbox.submit(task("shopper-00043", 1))
        until(
            lambda: fakes.calls, "the other shopper's call to hold the only slot", timeout_s=WAIT_S
        )

        for seq in (3, 4, 5):
            outbox.submit(task("shopper-00146", seq))
        fakes.released.set()

        got = outbox.wait("shopper-00146", 5, WAIT_S)
        assert [t for t in fakes.rules if t[0] == "shopper-00146"] == [
            ("shopper-00146", 3),
            ("shopper-00146", 4),
            ("shopper-00146", 5),
        ]
        assert sorted((s.task.seq, s.result.source, s.result.outcome) for s in got) == [
            (3, "model", "superseded"),
            (3, "rules", "written"),
            (4, "model", "superseded"),
            (4, "rules", "written"),
            (5, "model", "written"),
            (5, "rules", "written"),
        ]

    def test_a_prompt_without_a_rules_intent_has_no_rules_write(self, outbox_for, fakes) -> None:
        outbox = outbox_for()
        fakes.released.set()

        outbox.submit(prompt_task("shopper-00146", 3))

        assert [s.result.source for s in outbox.wait("shopper-00146", 3, WAIT_S)] == ["model"]
        assert fakes.rules == []

    def test_a_rules_write_that_fails_for_good_fails_the_outbox(self, outbox_for, fakes) -> None:
        fakes.rules_error = RuntimeError("Redis unreachable for the whole budget")
        outbox = outbox_for()

        # The failure is raised by the operator's next call into the outbox: the rest of
        # this very submit when the loop's thread fails the write first, else the collect.
        with pytest.raises(OutboxFailed, match="Redis unreachable"):
            outbox.submit(task("shopper-00146", 3))
            until(
                lambda: not outbox.writing_rules("shopper-00146"),
                "the rules write to end",
                timeout_s=WAIT_S,
            )
            outbox.collect("shopper-00146")


class TestInOrder:
    def test_every_prompt_of_a_shopper_is_answered_in_order_and_none_is_stopped(
        self, outbox_for, fakes
    ) -> None:
        outbox = outbox_for(latest_wins=False)
        outbox.submit(task("shopper-00146", 1))
        until(lambda: fakes.calls, "the first call", timeout_s=WAIT_S)

        for seq in (2, 3, 4):
            outbox.submit(task("shopper-00146", seq))
        fakes.released.set()

        got = outbox.wait("shopper-00146", 4, WAIT_S)
        assert fakes.calls == [("shopper-00146", seq) for seq in (1, 2, 3, 4)]
        assert fakes.stopped == []
        model = [(s.task.seq, s.result.outcome) for s in got if s.result.source == "model"]
        assert model == [(1, "written"), (2, "written"), (3, "written"), (4, "written")]

    def test_each_queued_prompt_takes_a_place(self, outbox_for, fakes) -> None:
        outbox = outbox_for(latest_wins=False, capacity=3)
        outbox.submit(task("shopper-00146", 1))
        until(lambda: fakes.calls, "the first call", timeout_s=WAIT_S)
        outbox.submit(task("shopper-00146", 2))
        outbox.submit(task("shopper-00146", 3))

        blocked = threading.Thread(target=outbox.submit, args=(task("shopper-00146", 4),))
        blocked.start()
        blocked.join(0.3)
        assert blocked.is_alive() and outbox.in_system == 3  # back-pressure, nothing dropped
        fakes.released.set()
        blocked.join(WAIT_S)
        assert not blocked.is_alive()

    def test_a_latest_wins_outbox_replaces_and_stops_instead(self, outbox_for, fakes) -> None:
        outbox = outbox_for(latest_wins=True)
        outbox.submit(task("shopper-00146", 1))
        until(lambda: fakes.calls, "the first call", timeout_s=WAIT_S)

        outbox.submit(task("shopper-00146", 2))
        outbox.submit(task("shopper-00146", 3))

        until(lambda: fakes.stopped, "the running call to be stopped", timeout_s=WAIT_S)
        assert fakes.stopped == [("shopper-00146", 1)]


class TestCounted:
    def outcome(self, result: TaskResult) -> Settled:
        t = task("shopper-00146", 3)
        return Settled(t, result, settled_at_ms=t.event_time_ms + 40)

    def test_rules_outcomes_are_counted_apart_from_the_models(self) -> None:
        stats, group = FakeStats(), FakeGroup()
        recorder = OutcomeRecorder(stats)
        recorder.register(group)

        recorder.settled(self.outcome(TaskResult("written", source="rules")))
        recorder.settled(self.outcome(TaskResult("stale", source="rules")))
        recorder.settled(self.outcome(TaskResult("written", attempts=1, llm_latency_s=0.2)))

        gauges = group.read()
        assert (gauges["intents_written_rules"], gauges["intents_stale_rules"]) == (1, 1)
        assert gauges["intents_written"] == 1 and gauges["intents_stale"] == 0
        assert stats.samples["event_to_rules_ms"] == [40]
        assert stats.samples["event_to_intent_ms"] == [40]  # the model's answer only

    def test_a_rules_write_refused_by_its_key_is_a_counted_dead_letter(self) -> None:
        stats = FakeStats()
        dead = DeadLetter("store", "key_wrong_type", "WRONGTYPE", shopper_id="shopper-00146")

        OutcomeRecorder(stats).settled(
            self.outcome(TaskResult("dead_letter", dead, source="rules"))
        )

        assert stats.counts["dead_letter_rules"] == 1
        assert stats.counts["dead_letter_store_key_wrong_type"] == 1
        assert stats.counts["dead_letter_inference"] == 0
