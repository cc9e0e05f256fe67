"""The LLM calls in a helper process (``flink_jobs.runtime.call_process``): a prompt answered there
lands in Redis as it would in-process, what the child's call raised is raised in the
parent, a call that a newer prompt supersedes stops in the child, and a child that dies
fails its calls loudly instead of leaving them hanging; a prompt that every worker fails
is dead-lettered once the client's attempts are spent.
LLM stand-ins (``bench/standin_llm.py``) behind the real router, a real Redis: the
subject is the process, not the model."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field

import psutil
import pytest
import redis

from flink_jobs.config import load_config
from flink_jobs.core.prompting import PromptRenderer
from flink_jobs.core.tasks import PromptTask
from flink_jobs.runtime.call_process import CallProcess, CallProcessExited
from flink_jobs.runtime.inference import RedisUnavailable
from flink_jobs.runtime.intent_store import IntentStore
from flink_jobs.tools.local_services import free_port
from tests.support.builders import EARBUDS, HEADPHONES, T0, session_of
from tests.support.builders import numbered_event as event
from tests.support.job_process import call_processes

# How long the helper may take to start and send its first request: it imports httpx and
# redis-py, and beside the model tier on two cores that took longer than a second.
HELPER_START_S = 60


def prompt_task(shopper_id: str) -> PromptTask:
    state = session_of(
        event(1, "search", 3.8, query="over ear headphones", shopper_id=shopper_id),
        event(2, "view", 28.6, HEADPHONES, shopper_id=shopper_id),
        event(3, "view", 60.6, EARBUDS, shopper_id=shopper_id),
    )
    prompt = PromptRenderer(load_config(environ={}).prompt).render(state)
    at = T0 + 60_600
    return PromptTask(shopper_id, seq=1, version_ts=at, event_time_ms=at, prompt=prompt)


def config(**llm_and_redis):
    llm = {k: v for k, v in llm_and_redis.items() if k != "redis"}
    return load_config({"llm": llm, "redis": llm_and_redis.get("redis", {})}, environ={})


def run(calls: CallProcess, *tasks: PromptTask, timeout_s: float = 120.0):
    async def go():
        try:
            return await asyncio.wait_for(
                asyncio.gather(*(calls.run(t) for t in tasks), return_exceptions=True), timeout_s
            )
        finally:
            await calls.aclose()

    return asyncio.run(go())


def test_prompts_answered_in_one_helper_land_in_redis(standin_tier, redis_url, unique_name):
    calls = CallProcess(
        config(**standin_tier.job_settings(), redis={"url": redis_url, "key_prefix": unique_name})
    )
    shoppers = ["shopper-00146", "shopper-00151", "shopper-00152"]
    # Helpers of jobs that earlier tests ran in this process (PyFlink's loopback mode) are
    # not this CallProcess's.
    before = set(call_processes(os.getpid()))

    async def go():
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*(calls.run(prompt_task(s)) for s in shoppers)), 120
            )
            return results, [p for p in call_processes(os.getpid()) if p not in before]
        finally:
            await calls.aclose()

    results, running = asyncio.run(go())

    assert [r.outcome for r in results] == ["written"] * 3, results
    assert all(r.prompt_tokens > 0 and r.llm_latency_s > 0 for r in results)
    store = IntentStore(redis.Redis.from_url(redis_url), unique_name)
    assert all(store.read(s).version == (T0 + 60_600, 1) for s in shoppers)
    assert running == [calls.pid], "the first calls came together: one helper"


def test_an_unreachable_redis_is_raised_in_the_parent_and_the_retries_logged_there(
    standin_tier, caplog: pytest.LogCaptureFixture
):
    calls = CallProcess(
        config(
            **standin_tier.job_settings(),
            redis={"url": f"redis://127.0.0.1:{free_port()}/0", "write_retry_budget_s": 1.0},
        )
    )
    [outcome] = run(calls, prompt_task("shopper-00147"))

    assert isinstance(outcome, RedisUnavailable), outcome
    assert "shopper-00147" in str(outcome)
    retries = [r for r in caplog.records if "Redis write failed" in r.getMessage()]
    assert retries and all(r.name == "flink_jobs.runtime.inference" for r in retries)


def test_a_prompt_every_worker_fails_is_dead_lettered_after_the_clients_attempts(
    standin_tier, redis_url, unique_name
):
    """Each worker answers 503: the router tries both for each attempt, the client retries
    (``llm.max_attempts``), then the prompt is dead-lettered with stage ``llm``."""
    settings = {**standin_tier.job_settings(), "max_attempts": 2, "backoff_initial_s": 0.1}
    calls = CallProcess(config(**settings, redis={"url": redis_url, "key_prefix": unique_name}))
    with standin_tier.configured():
        standin_tier.inject("5xx", 100)
        [result] = run(calls, prompt_task("shopper-00154"))
        failed = [standin_tier.stats(w)["faults"]["5xx"] for w in standin_tier.worker_urls]

    assert result.outcome == "dead_letter", result
    assert result.dead_letter.stage == "llm"
    assert result.dead_letter.context["attempts"] == 2
    assert all(n >= 2 for n in failed), failed
    assert IntentStore(redis.Redis.from_url(redis_url), unique_name).read("shopper-00154") is None


@dataclass
class SilentLlm:
    """An LLM endpoint that accepts connections and never answers, and the call process
    pointed at it."""

    calls: CallProcess
    server: socket.socket
    connections: list[socket.socket] = field(default_factory=list)


@contextlib.contextmanager
def calls_to_a_silent_llm() -> Iterator[SilentLlm]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        port = server.getsockname()[1]
        silent = SilentLlm(
            CallProcess(config(base_url=f"http://127.0.0.1:{port}/v1", max_attempts=1)), server
        )
        try:
            yield silent
        finally:
            for connection in silent.connections:
                connection.close()


async def call_under_way(silent: SilentLlm, shopper_id: str) -> asyncio.Future:
    """A call of the shopper whose request is out: the silent LLM has its connection. (A
    fixed pause after the helper started was too short beside the model tier on a slow
    host: the helper was still importing, and the supersede came before the call.)"""
    in_flight = asyncio.ensure_future(silent.calls.run(prompt_task(shopper_id)))
    loop = asyncio.get_running_loop()
    connection, _ = await asyncio.wait_for(loop.sock_accept(silent.server), HELPER_START_S)
    silent.connections.append(connection)
    return in_flight


def test_a_dead_helper_fails_its_calls_in_flight_and_later_ones():
    with calls_to_a_silent_llm() as silent:
        calls = silent.calls

        async def go():
            try:
                in_flight = await call_under_way(silent, "shopper-00148")
                psutil.Process(calls.pid).kill()
                # Failed by the helper's exit, not by a timeout of the call.
                with pytest.raises(CallProcessExited, match="exited"):
                    await asyncio.wait_for(in_flight, 30)
                with pytest.raises(CallProcessExited):
                    await calls.run(prompt_task("shopper-00149"))
            finally:
                await calls.aclose()

        asyncio.run(go())


def test_a_superseded_call_is_stopped_in_the_helper_and_answers_superseded():
    with calls_to_a_silent_llm() as silent:
        calls = silent.calls

        async def go():
            try:
                in_flight = await call_under_way(silent, "shopper-00153")
                calls.supersede("shopper-00153", 1)
                return await asyncio.wait_for(in_flight, 10)
            finally:
                await calls.aclose()

        result = asyncio.run(go())

    assert result.outcome == "superseded"


def test_closing_stops_the_helper():
    calls = CallProcess(config(base_url=f"http://127.0.0.1:{free_port()}/v1", max_attempts=1))

    async def go():
        result = await calls.run(prompt_task("shopper-00150"))  # nothing listens: a dead letter
        pid = calls.pid
        await calls.aclose()
        return result, pid

    result, pid = asyncio.run(go())
    assert result.outcome == "dead_letter" and result.dead_letter.stage == "llm"
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
