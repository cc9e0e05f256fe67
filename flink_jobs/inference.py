"""One prompt's trip: ask the model, check the answer, upsert the intent.

Plain asyncio, no Flink: the async operator in ``operators.py`` only calls :func:`run_task`
on its event loop. A failed call or an invalid answer becomes a dead letter saying why;
an unreachable Redis is retried with backoff for ``redis.write_retry_budget_s`` and then
raised, so the job fails and restarts from its last checkpoint rather than drop an intent.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import redis

from flink_jobs.events import DeadLetter
from flink_jobs.intent_store import AsyncIntentStore, IntentRecord, StoreUnavailableError
from flink_jobs.intents import IntentError, parse_intent
from flink_jobs.llm_client import LlmClient, LlmError
from flink_jobs.prompting import RenderedPrompt

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PromptTask:
    shopper_id: str
    seq: int
    version_ts: int  # newest event time covered by the prompt
    event_time_ms: int  # event time of the event that triggered it
    prompt: RenderedPrompt


@dataclass(frozen=True, slots=True)
class TaskResult:
    outcome: str  # written | stale | superseded | dead_letter
    dead_letter: DeadLetter | None = None
    attempts: int = 0
    llm_latency_s: float = 0.0
    prompt_tokens: int = 0


class Coalescer:
    """Latest context wins: while prompts wait for a free LLM slot, a newer prompt of the
    same shopper makes the older one pointless, so the older one is dropped (counted as
    superseded) instead of computed. Bounds LLM work by throughput, not by event rate.

    Lives on one event loop; ``max_concurrency`` calls run at once, the rest wait here
    (their number is bounded by the async operator's capacity).
    """

    def __init__(self, max_concurrency: int) -> None:
        self._slots = asyncio.Semaphore(max_concurrency)
        self._newest: dict[str, int] = {}

    def offer(self, shopper_id: str, seq: int) -> None:
        if seq > self._newest.get(shopper_id, -1):
            self._newest[shopper_id] = seq

    def superseded(self, shopper_id: str, seq: int) -> bool:
        return self._newest.get(shopper_id, -1) > seq

    def done(self, shopper_id: str, seq: int) -> None:
        if self._newest.get(shopper_id) == seq:
            del self._newest[shopper_id]

    @property
    def slots(self) -> asyncio.Semaphore:
        return self._slots

    @property
    def waiting_shoppers(self) -> int:
        return len(self._newest)


async def run_coalesced(task: PromptTask, coalescer: Coalescer, run) -> TaskResult:
    """Run ``run(task)`` in an LLM slot unless a newer prompt of the shopper arrived first."""
    coalescer.offer(task.shopper_id, task.seq)
    try:
        async with coalescer.slots:
            if coalescer.superseded(task.shopper_id, task.seq):
                return TaskResult("superseded")
            return await run(task)
    finally:
        coalescer.done(task.shopper_id, task.seq)


class RedisUnavailable(RuntimeError):
    """Redis stayed unreachable for the whole retry budget; the job must restart."""


def _dead_letter(task: PromptTask, stage: str, reason: str, detail: str, **context) -> DeadLetter:
    return DeadLetter(
        stage,
        reason,
        detail,
        shopper_id=task.shopper_id,
        context={
            "prompt_seq": task.seq,
            "version_ts": task.version_ts,
            "template": task.prompt.template,
            "template_hash": task.prompt.template_hash,
            **context,
        },
    )


async def run_task(
    task: PromptTask,
    llm: LlmClient,
    store: AsyncIntentStore,
    model: str,
    redis_retry_budget_s: float,
    invalid_answer_retries: int = 1,
) -> TaskResult:
    attempts = 0
    for _ in range(1 + invalid_answer_retries):
        try:
            answer = await llm.complete(task.prompt, task.shopper_id)
        except LlmError as exc:
            return TaskResult(
                "dead_letter",
                _dead_letter(
                    task, "llm", exc.reason, exc.detail, status=exc.status, attempts=exc.attempts
                ),
                attempts=attempts + exc.attempts,
            )
        attempts += answer.attempts
        parsed = parse_intent(answer.text)
        if not isinstance(parsed, IntentError):
            break
        if answer.completion.finish_reason == "length":
            parsed = IntentError(
                "truncated",
                f"the answer was cut at llm.max_tokens ({answer.completion.completion_tokens} "
                f"tokens) before it was complete: raise llm.max_tokens ({parsed.detail})",
            )
    else:
        # Guided decoding should make this rare; a second draw usually fixes what a
        # preempted or badly batched generation broke, a third would not be cheaper.
        return TaskResult(
            "dead_letter",
            _dead_letter(task, "intent", parsed.reason, parsed.detail, answer=answer.text[:2000]),
            attempts=attempts,
            llm_latency_s=answer.latency_s,
        )
    record = IntentRecord(
        shopper_id=task.shopper_id,
        version_ts=task.version_ts,
        version_seq=task.seq,
        intent_json=parsed.to_json().decode(),
        top_label=parsed.top_label,
        top_confidence=parsed.top_confidence,
        summary=parsed.summary,
        event_time_ms=task.event_time_ms,
        template=task.prompt.template,
        template_hash=task.prompt.template_hash,
        model=answer.completion.model or model,
    )
    written = await upsert_with_retry(store, record, redis_retry_budget_s)
    return TaskResult(
        "written" if written else "stale",
        attempts=attempts,
        llm_latency_s=answer.latency_s,
        prompt_tokens=answer.completion.prompt_tokens,
    )


async def upsert_with_retry(store: AsyncIntentStore, record: IntentRecord, budget_s: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget_s
    delay = 0.1
    while True:
        try:
            return await store.upsert(record)
        except (StoreUnavailableError, redis.ConnectionError, redis.TimeoutError) as exc:
            if loop.time() + delay > deadline:
                raise RedisUnavailable(
                    f"could not write the intent of shopper {record.shopper_id} to Redis "
                    f"for {budget_s:.0f} s: {exc}"
                ) from exc
            log.warning("Redis write failed (%s); retrying in %.1f s", exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
