"""The outbox raises a failure that must restart the job, not swallows it: shown with a
call that raises. It releases what it holds when closed (its runner, its event loop). Its
other promises (bounded, one call per shopper at a time, latest context wins, outcomes kept
until collected) are shown with the job's own calls over a real Redis in
``tests/service/test_outbox.py``."""

from __future__ import annotations

import gc
import os

import pytest

from flink_jobs.config import AppConfig
from flink_jobs.core.tasks import PromptTask, TaskResult
from flink_jobs.runtime.call_process import CallProcess
from flink_jobs.runtime.inference import PromptRunner
from flink_jobs.runtime.outbox import Outbox, OutboxFailed, Runner
from tests.support.builders import prompt_task as task
from tests.support.waiting import until

WAIT_S = 10.0


class Answering:
    """A runner whose calls answer at once (or raise ``error``), and that counts its closes."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.closed = 0

    async def run(self, t: PromptTask) -> TaskResult:
        if self.error is not None:
            raise self.error
        return TaskResult("written", attempts=1)

    async def write_rules(self, t: PromptTask) -> TaskResult:
        return TaskResult("written", source="rules")

    def supersede(self, shopper_id: str, seq: int) -> None:
        pass

    async def aclose(self) -> None:
        self.closed += 1


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class TestFailures:
    def test_a_call_that_raises_fails_the_next_submit_and_collect(self) -> None:
        broken = Answering(RuntimeError("Redis unreachable for the whole budget"))

        outbox = Outbox(broken, capacity=4, max_concurrency=1).start()
        try:
            outbox.submit(task("shopper-00146", seq=1))
            until(lambda: not outbox.in_system, "the call to fail", timeout_s=WAIT_S)

            with pytest.raises(OutboxFailed, match="Redis unreachable"):
                outbox.collect("shopper-00146")
            with pytest.raises(OutboxFailed):
                outbox.submit(task("shopper-00299", seq=1))
        finally:
            outbox.close()


class TestClose:
    def test_a_closed_outbox_holds_no_file_descriptor(self) -> None:
        """Its event loop's selector and self-pipe are closed with it, not by the collector."""
        outboxes = [Outbox(Answering(), capacity=4, max_concurrency=1) for _ in range(20)]
        gc.disable()
        try:
            before = open_fds()
            for outbox in outboxes:
                outbox.start()
                outbox.submit(task("shopper-00146", seq=1))
                outbox.wait("shopper-00146", 1, WAIT_S)
                outbox.close()

            assert open_fds() == before - 3 * len(outboxes)
        finally:
            gc.enable()

    def test_close_closes_the_runner_once_even_when_called_twice(self) -> None:
        runner = Answering()
        outbox = Outbox(runner, capacity=4, max_concurrency=1).start()

        outbox.close()
        outbox.close()

        assert runner.closed == 1

    def test_an_outbox_never_started_closes_its_loop(self) -> None:
        outbox = Outbox(Answering(), capacity=4, max_concurrency=1)
        before = open_fds()

        outbox.close()

        assert open_fds() == before - 3


class TestTheRunnerProtocol:
    def test_the_jobs_runners_implement_it(self) -> None:
        assert isinstance(PromptRunner(AppConfig()), Runner)
        assert isinstance(CallProcess(AppConfig()), Runner)
