"""The outbox raises a failure that must restart the job, not swallows it: shown with a
call that raises. Its other promises (bounded, one call per shopper at a time, latest
context wins, outcomes kept until collected) are shown with the job's own calls over a real
Redis in ``tests/service/test_outbox.py``."""

from __future__ import annotations

import time

import pytest

from flink_jobs.core.tasks import PromptTask, TaskResult
from flink_jobs.runtime.outbox import Outbox, OutboxFailed
from tests.builders import prompt_task as task

WAIT_S = 10.0


class TestFailures:
    def test_a_call_that_raises_fails_the_next_submit_and_collect(self) -> None:
        async def broken(t: PromptTask) -> TaskResult:
            raise RuntimeError("Redis unreachable for the whole budget")

        outbox = Outbox(broken, capacity=4, max_concurrency=1).start()
        try:
            outbox.submit(task("shopper-00146", seq=1))
            deadline = time.monotonic() + WAIT_S
            while outbox.in_system and time.monotonic() < deadline:
                time.sleep(0.01)

            with pytest.raises(OutboxFailed, match="Redis unreachable"):
                outbox.collect("shopper-00146")
            with pytest.raises(OutboxFailed):
                outbox.submit(task("shopper-00299", seq=1))
        finally:
            outbox.close()
