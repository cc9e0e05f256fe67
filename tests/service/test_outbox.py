"""The outbox: prompts run on a background event loop, bounded, one call per shopper at a
time, a queued prompt replaced by the shopper's newer one (latest context wins), outcomes
kept until collected, and a failure that must restart the job raised, not swallowed.

The calls are the job's own (``PromptRunner``: the LLM client over httpx's MockTransport,
the intent store over the test Redis); a call that raises is in
``tests/unit/test_outbox.py``."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import httpx
import orjson
import pytest
import redis
import redis.asyncio

from flink_jobs.config import AppConfig
from flink_jobs.runtime.inference import PromptRunner
from flink_jobs.runtime.intent_store import AsyncIntentStore
from flink_jobs.runtime.llm_client import LlmClient
from flink_jobs.runtime.outbox import Outbox
from tests.support.builders import completion
from tests.support.builders import prompt_task as task
from tests.support.clock import FakeClock
from tests.support.llm_call import COMPARING_INTENT, ONE_ATTEMPT_LLM
from tests.support.waiting import until

WAIT_S = 10.0


class HeldLlm:
    """An LLM whose answers wait until the test releases them; records what it computed
    and whether a call was cancelled while it waited."""

    def __init__(self) -> None:
        self.computed: list[tuple[str, int]] = []
        self.started = threading.Semaphore(0)
        self.cancelled = threading.Event()
        self._gate = threading.Event()

    def release(self) -> None:
        self._gate.set()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content)
        seq = int(body["messages"][1]["content"].split("seq=")[1].split("\n")[0])
        self.computed.append((request.headers["X-Session-ID"], seq))
        self.started.release()
        try:
            while not self._gate.is_set():  # held until released
                await asyncio.sleep(0.005)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return completion(orjson.dumps(COMPARING_INTENT).decode())


def job_runner(redis_url: str, prefix: str, llm: HeldLlm) -> PromptRunner:
    """The job's runner, its LLM client over ``llm`` and its store over the test Redis."""

    def clients() -> tuple[LlmClient, AsyncIntentStore]:
        store = AsyncIntentStore(redis.asyncio.Redis.from_url(redis_url), prefix)
        return LlmClient(ONE_ATTEMPT_LLM, transport=httpx.MockTransport(llm)), store

    return PromptRunner(replace(AppConfig(), llm=ONE_ATTEMPT_LLM), clients)


@pytest.fixture
def llm() -> HeldLlm:
    return HeldLlm()


@pytest.fixture
def outbox_for(redis_url: str, unique_name: str, llm: HeldLlm) -> Iterator:
    """Outboxes wired as the job wires them; ``supersede=False`` leaves running calls be."""
    made: list[Outbox] = []

    def make(
        capacity: int = 8,
        max_concurrency: int = 1,
        supersede: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> Outbox:
        runner = job_runner(redis_url, unique_name, llm)
        if not supersede:
            runner.supersede = lambda shopper_id, seq: None  # type: ignore[method-assign]
        made.append(Outbox(runner, capacity, max_concurrency, clock=clock).start())
        return made[-1]

    yield make
    llm.release()
    for outbox in made:
        outbox.close()


def outcomes(outbox: Outbox, shopper_id: str, seq: int) -> list[tuple[int, str]]:
    return [(s.task.seq, s.result.outcome) for s in outbox.wait(shopper_id, seq, WAIT_S)]


def with_its_only_slot_busy(outbox_for, llm: HeldLlm, **options) -> Outbox:
    """An outbox of one call slot, held by another shopper's call until ``llm.release()``."""
    outbox = outbox_for(max_concurrency=1, **options)
    outbox.submit(task("shopper-00043", seq=1))
    assert llm.started.acquire(timeout=WAIT_S)
    return outbox


class TestLatestContextWins:
    def test_a_queued_prompt_replaced_by_a_newer_one_is_not_sent(
        self, outbox_for, llm: HeldLlm, redis_client: redis.Redis, unique_name: str
    ) -> None:
        outbox = with_its_only_slot_busy(outbox_for, llm)
        for seq in (1, 2, 3):
            outbox.submit(task("shopper-00146", seq=seq, at_s=10 * seq))

        llm.release()

        assert outcomes(outbox, "shopper-00146", 3) == [
            (1, "superseded"),
            (2, "superseded"),
            (3, "written"),
        ]
        assert ("shopper-00146", 3) in llm.computed
        assert ("shopper-00146", 1) not in llm.computed
        assert redis_client.hget(f"{unique_name}:intent:shopper-00146", "version_seq") == b"3"

    def test_an_older_prompt_arriving_after_a_newer_one_is_the_one_dropped(
        self, outbox_for, llm: HeldLlm
    ) -> None:
        outbox = with_its_only_slot_busy(outbox_for, llm)
        outbox.submit(task("shopper-00146", seq=5))
        outbox.submit(task("shopper-00146", seq=4))

        llm.release()

        assert outcomes(outbox, "shopper-00146", 5) == [(4, "superseded"), (5, "written")]

    def test_prompts_of_other_shoppers_are_all_sent(self, outbox_for, llm: HeldLlm) -> None:
        outbox = outbox_for(max_concurrency=1)
        shoppers = ["shopper-00043", "shopper-00146", "shopper-00299"]
        for shopper in shoppers:
            outbox.submit(task(shopper, seq=1))

        llm.release()

        for shopper in shoppers:
            assert outcomes(outbox, shopper, 1) == [(1, "written")]
        assert [shopper for shopper, _ in llm.computed] == shoppers

    def test_a_newer_prompt_stops_the_shoppers_call_still_waiting_for_the_llm(
        self, outbox_for, llm: HeldLlm, redis_client: redis.Redis, unique_name: str
    ) -> None:
        outbox = outbox_for(max_concurrency=4)
        outbox.submit(task("shopper-00146", seq=1))
        assert llm.started.acquire(timeout=WAIT_S)

        outbox.submit(task("shopper-00146", seq=2, at_s=20))

        assert llm.started.acquire(timeout=WAIT_S)  # at once, not after the first call
        llm.release()
        assert outcomes(outbox, "shopper-00146", 2) == [(1, "superseded"), (2, "written")]
        assert redis_client.hget(f"{unique_name}:intent:shopper-00146", "version_seq") == b"2"

    def test_a_call_that_followed_a_stopped_one_is_not_stopped(
        self, outbox_for, llm: HeldLlm
    ) -> None:
        outbox = outbox_for(max_concurrency=4)
        outbox.submit(task("shopper-00146", seq=1))
        assert llm.started.acquire(timeout=WAIT_S)
        outbox.submit(task("shopper-00146", seq=2, at_s=20))
        assert llm.started.acquire(timeout=WAIT_S)

        outbox.submit(task("shopper-00146", seq=3, at_s=30))

        assert not llm.started.acquire(timeout=0.3)  # seq 2 goes on; seq 3 waits for it
        llm.release()
        assert outcomes(outbox, "shopper-00146", 3) == [
            (1, "superseded"),
            (2, "written"),
            (3, "written"),
        ]
        assert [seq for _, seq in llm.computed] == [1, 2, 3]


class TestOneCallPerShopper:
    def test_a_shoppers_next_prompt_waits_for_the_running_one(
        self, outbox_for, llm: HeldLlm
    ) -> None:
        outbox = outbox_for(max_concurrency=4, supersede=False)
        outbox.submit(task("shopper-00146", seq=1))
        assert llm.started.acquire(timeout=WAIT_S)
        outbox.submit(task("shopper-00146", seq=2))

        assert not llm.started.acquire(timeout=0.3)  # a free slot, yet not started
        llm.release()

        assert [seq for seq, _ in outcomes(outbox, "shopper-00146", 2)] in ([1, 2], [2])
        assert llm.computed == [("shopper-00146", 1), ("shopper-00146", 2)]


class TestQueuedTime:
    """How long a prompt waited before its call started: the part of its time outside the
    LLM call that the job's own timings do not see. Measured on a clock the test moves;
    what prompts wait in a running job is the freshness bench's ``outbox_wait_ms``."""

    def test_a_prompt_that_waited_for_a_busy_slot_reports_the_wait(
        self, outbox_for, llm: HeldLlm
    ) -> None:
        clock = FakeClock()
        outbox = with_its_only_slot_busy(outbox_for, llm, clock=clock)
        outbox.submit(task("shopper-00146", seq=1))
        clock.advance(0.5)
        llm.release()

        (first,) = outbox.wait("shopper-00043", 1, WAIT_S)
        (second,) = outbox.wait("shopper-00146", 1, WAIT_S)
        assert first.queued_ms == 0  # its call started as it came
        assert second.queued_ms == 500  # the time the busy slot held it

    def test_a_replacing_prompt_waits_from_its_own_arrival(self, outbox_for, llm: HeldLlm) -> None:
        clock = FakeClock()
        outbox = with_its_only_slot_busy(outbox_for, llm, clock=clock)
        outbox.submit(task("shopper-00146", seq=1))
        clock.advance(0.5)
        outbox.submit(task("shopper-00146", seq=2))
        clock.advance(0.25)
        llm.release()

        settled = {s.task.seq: s for s in outbox.wait("shopper-00146", 2, WAIT_S)}
        assert settled[1].result.outcome == "superseded" and settled[1].queued_ms == 0
        assert settled[2].queued_ms == 250  # not the 750 since the prompt it replaced came


class TestBounded:
    def test_submit_blocks_while_the_outbox_is_full(self, outbox_for, llm: HeldLlm) -> None:
        outbox = outbox_for(capacity=2, max_concurrency=1)
        outbox.submit(task("shopper-00043", seq=1))
        outbox.submit(task("shopper-00146", seq=1))
        third = threading.Thread(target=outbox.submit, args=(task("shopper-00299", seq=1),))
        third.start()

        third.join(timeout=0.5)
        assert third.is_alive() and outbox.in_system == 2
        llm.release()
        third.join(timeout=WAIT_S)

        assert not third.is_alive()
        assert outcomes(outbox, "shopper-00299", 1) == [(1, "written")]

    def test_replacing_a_queued_prompt_never_blocks(self, outbox_for, llm: HeldLlm) -> None:
        outbox = outbox_for(capacity=2, max_concurrency=1)
        outbox.submit(task("shopper-00043", seq=1))
        outbox.submit(task("shopper-00146", seq=1))

        replacing = threading.Thread(target=outbox.submit, args=(task("shopper-00146", seq=2),))
        replacing.start()

        replacing.join(timeout=WAIT_S)
        assert not replacing.is_alive()  # it returned while the outbox was still full
        assert outbox.in_system == 2


class TestWakeUps:
    def test_prompts_queued_while_every_slot_is_busy_do_not_wake_the_loop_yet_are_all_sent(
        self, outbox_for, llm: HeldLlm, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        outbox = outbox_for(capacity=64, max_concurrency=2)
        for shopper in ("shopper-00043", "shopper-00146"):
            outbox.submit(task(shopper, seq=1))
            assert llm.started.acquire(timeout=WAIT_S)
        loop = outbox._loop
        wake_ups: list[object] = []
        wake = loop.call_soon_threadsafe
        monkeypatch.setattr(loop, "call_soon_threadsafe", lambda *a: wake_ups.append(a) or wake(*a))
        queued = [f"shopper-{n:05d}" for n in range(300, 320)]

        for shopper in queued:
            outbox.submit(task(shopper, seq=1))
        assert wake_ups == []
        llm.release()

        for shopper in queued:
            assert outcomes(outbox, shopper, 1) == [(1, "written")]


class TestBookkeeping:
    def test_outcomes_wait_until_collected_then_are_gone(self, outbox_for, llm: HeldLlm) -> None:
        outbox = outbox_for()
        llm.release()
        outbox.submit(task("shopper-00146", seq=1))
        outcomes(outbox, "shopper-00146", 1)

        assert outbox.collect("shopper-00146") == []
        assert not outbox.tracks("shopper-00146", 1)

    def test_it_tracks_a_prompt_from_submit_until_collected(self, outbox_for, llm) -> None:
        outbox = outbox_for()
        assert not outbox.tracks("shopper-00146", 1)
        outbox.submit(task("shopper-00146", seq=1))
        assert outbox.tracks("shopper-00146", 1)
        llm.release()
        until(lambda: not outbox.in_system, "the call to settle", timeout_s=WAIT_S)

        assert outbox.tracks("shopper-00146", 1)  # settled, not yet collected
        assert [s.task.seq for s in outbox.collect("shopper-00146")] == [1]

    def test_waiting_for_a_prompt_never_submitted_is_refused(self, outbox_for) -> None:
        with pytest.raises(ValueError, match="never submitted"):
            outbox_for().wait("shopper-00146", 7, WAIT_S)


class TestFailures:
    def test_close_cancels_calls_still_running(self, outbox_for, llm: HeldLlm) -> None:
        outbox = outbox_for()
        outbox.submit(task("shopper-00146", seq=1))
        assert llm.started.acquire(timeout=WAIT_S)

        outbox.close(timeout_s=5)

        assert llm.cancelled.is_set()  # not waited for: it would have held close
