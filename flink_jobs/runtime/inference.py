"""One prompt's trip: ask the model, check the answer, upsert the intent; and the prompt's
rules-only record (:func:`write_rules`), upserted before the model answers.

The answer's categories must be among the prompt's (``PromptTask.categories``, also the
request's decoding enum): an answer that names another is dead-lettered (stage ``intent``,
reason ``ungrounded_category``) without asking again, since greedy decoding would answer
the same; the prompt's rules-only record stays. It can only happen with a server that
ignores ``response_format`` (or ``llm.guided_json`` off).

Plain asyncio, no Flink: ``outbox.Outbox`` runs prompts through :class:`PromptRunner`
(:func:`run_task` with the job's clients), its ``Runner``, on its event loop. A failed call
or an invalid answer becomes a dead letter saying why; so does an intent whose Redis key
cannot take it (another type at the key: retrying would fail the same way, and a job restart
would meet it again). A Redis that is unreachable or cannot take writes for now (READONLY,
BUSY, OOM, LOADING...; on a cluster also CLUSTERDOWN during a failover, TRYAGAIN while a
slot migrates) is retried with backoff for ``redis.write_retry_budget_s`` and then raised,
so the job fails and restarts from its last checkpoint rather than drop an intent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from flink_jobs.config import AppConfig
from flink_jobs.core.events import DeadLetter
from flink_jobs.core.grounding import category_is_grounded, reconcile
from flink_jobs.core.intents import (
    Intent,
    IntentError,
    label_choices,
    parse_intent,
    with_label_scores,
)
from flink_jobs.core.prompting import intent_labels
from flink_jobs.core.tasks import PromptTask, TaskResult
from flink_jobs.runtime.intent_store import (
    AsyncIntentStore,
    IntentRecord,
    KeyRejectedError,
    StoreUnavailableError,
)
from flink_jobs.runtime.llm_client import LlmClient, LlmError
from intent_reader.clients import UNAVAILABLE_ERRORS

log = logging.getLogger(__name__)

#: What a write is retried on: the store's own "Redis unavailable" and a client's errors of
#: a server that passes (a cluster in motion included).
_RETRIED_WRITE_ERRORS: tuple[type[BaseException], ...] = (
    StoreUnavailableError,
    *UNAVAILABLE_ERRORS,
)


class RedisUnavailable(RuntimeError):
    """Redis stayed unreachable, or unable to take writes, for the whole retry budget; the
    job must restart."""


def _dead_letter(
    task: PromptTask, stage: str, reason: str, detail: str, **context: Any
) -> DeadLetter:
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


@dataclass(frozen=True, slots=True)
class Answered:
    """The LLM's valid answer to a prompt, and what asking cost over every call it took."""

    intent: Intent
    model: str
    attempts: int
    llm_latency_s: float
    prompt_tokens: int


@dataclass(slots=True)
class AttemptTally:
    """The LLM calls a prompt has started so far, kept outside :func:`ask` so a superseded
    prompt's retries are still counted (``llm_retries``) when its task is cancelled."""

    made: int = 0

    def add(self) -> None:
        self.made += 1


async def ask(
    task: PromptTask,
    llm: LlmClient,
    invalid_answer_retries: int = 1,
    tally: AttemptTally | None = None,
) -> Answered | TaskResult:
    """The LLM step of :func:`run_task`: a valid intent, or the dead letter saying why not.
    It writes nothing, so it can be abandoned at any point (``PromptRunner.supersede``)."""
    # A re-asked prompt cost every call it took: freshness is judged against the LLM time
    # and tokens summed over them, not against the last call's alone.
    attempts = 0
    latency_s = 0.0
    prompt_tokens = 0
    for _ in range(1 + invalid_answer_retries):
        try:
            answer = await llm.complete(
                task.prompt,
                task.shopper_id,
                task.categories,
                on_attempt=tally.add if tally is not None else None,
            )
        except LlmError as exc:
            return TaskResult(
                "dead_letter",
                _dead_letter(
                    task, "llm", exc.reason, exc.detail, status=exc.status, attempts=exc.attempts
                ),
                attempts=attempts + exc.attempts,
                llm_latency_s=latency_s,
                prompt_tokens=prompt_tokens,
            )
        attempts += answer.attempts
        latency_s += answer.latency_s
        prompt_tokens += answer.completion.prompt_tokens
        parsed = parse_intent(answer.text)
        if not isinstance(parsed, IntentError) and answer.completion.logprobs:
            parsed = with_label_scores(
                parsed, label_choices(answer.completion.logprobs, intent_labels())
            )
        if not isinstance(parsed, IntentError):
            if task.categories and not category_is_grounded(parsed, task.categories):
                return TaskResult(
                    "dead_letter",
                    _dead_letter(
                        task,
                        "intent",
                        "ungrounded_category",
                        f"the answer names a category outside the session's "
                        f"({', '.join(task.categories)}): {answer.text[:200]!r}",
                        answer=answer.text[:2000],
                        categories=list(task.categories),
                    ),
                    attempts=attempts,
                    llm_latency_s=latency_s,
                    prompt_tokens=prompt_tokens,
                )
            return Answered(parsed, answer.completion.model, attempts, latency_s, prompt_tokens)
        failure = parsed
        if answer.completion.finish_reason == "length":
            failure = IntentError(
                "truncated",
                f"the answer was cut at llm.max_tokens ({answer.completion.completion_tokens} "
                f"tokens) before it was complete: raise llm.max_tokens ({parsed.detail})",
            )
    # Guided decoding should make this rare; a second draw usually fixes what a preempted
    # or badly batched generation broke, a third would not be cheaper.
    return TaskResult(
        "dead_letter",
        _dead_letter(task, "intent", failure.reason, failure.detail, answer=answer.text[:2000]),
        attempts=attempts,
        llm_latency_s=latency_s,
        prompt_tokens=prompt_tokens,
    )


async def write(
    task: PromptTask,
    answered: Answered,
    store: AsyncIntentStore,
    model: str,
    redis_retry_budget_s: float,
) -> TaskResult:
    """The Redis step of :func:`run_task`: the versioned upsert of the answered intent."""
    record = model_record(task, answered.intent, answered.model or task.model or model)
    return await _upsert(
        task,
        record,
        store,
        redis_retry_budget_s,
        attempts=answered.attempts,
        llm_latency_s=answered.llm_latency_s,
        prompt_tokens=answered.prompt_tokens,
    )


async def write_rules(
    task: PromptTask, store: AsyncIntentStore, redis_retry_budget_s: float
) -> TaskResult:
    """The rules-only record of ``task`` (``task.rules``), upserted the moment the prompt
    fires: no LLM call. The same Redis policy as :func:`write` (retried within the budget,
    then :class:`RedisUnavailable`; a key that cannot take it dead-letters); its outcome's
    ``source`` is ``rules``."""
    if task.rules is None:
        raise ValueError(f"prompt {task.seq} of {task.shopper_id} carries no rules intent")
    record = intent_record(task, task.rules, "")
    return await _upsert(task, record, store, redis_retry_budget_s)


def model_record(task: PromptTask, answer: Intent, model: str) -> IntentRecord:
    """The record of the model's ``answer`` to ``task``: the answer beside the session's
    rules-only intent (``grounding.reconcile``), with the answer itself kept in ``answer``."""
    facts = orjson.loads(task.facts_json) if task.facts_json else None
    return intent_record(
        task, reconcile(answer, task.rules, facts), model, answer_json=answer.to_json().decode()
    )


def intent_record(
    task: PromptTask, intent: Intent, model: str, answer_json: str = ""
) -> IntentRecord:
    """The record of ``intent`` for ``task``'s version, with the task's grounded facts (and
    ``answer_json``, the model's answer as it returned, on a model's record)."""
    return IntentRecord(
        shopper_id=task.shopper_id,
        version_ts=task.version_ts,
        version_seq=task.seq,
        intent_json=intent.to_json().decode(),
        top_label=intent.top_label,
        top_confidence=intent.top_confidence,
        summary=intent.summary,
        event_time_ms=task.event_time_ms,
        template=task.prompt.template,
        template_hash=task.prompt.template_hash,
        model=model,
        facts_json=task.facts_json,
        source=intent.source,
        answer_json=answer_json,
    )


async def _upsert(
    task: PromptTask,
    record: IntentRecord,
    store: AsyncIntentStore,
    redis_retry_budget_s: float,
    *,
    attempts: int = 0,
    llm_latency_s: float = 0.0,
    prompt_tokens: int = 0,
) -> TaskResult:
    try:
        written = await upsert_with_retry(store, record, redis_retry_budget_s)
    except KeyRejectedError as exc:
        return TaskResult(
            "dead_letter",
            _dead_letter(
                task,
                "store",
                exc.reason,
                f"Redis refused the intent for this shopper's key {store.key(task.shopper_id)!r}: "
                f"{exc.detail}",
                intent=record.intent_json,
                model=record.model,
                source=record.source,
            ),
            source=record.source,
            attempts=attempts,
            llm_latency_s=llm_latency_s,
            prompt_tokens=prompt_tokens,
        )
    return TaskResult(
        "written" if written else "stale",
        source=record.source,
        attempts=attempts,
        llm_latency_s=llm_latency_s,
        prompt_tokens=prompt_tokens,
    )


async def run_task(
    task: PromptTask,
    llm: LlmClient,
    store: AsyncIntentStore,
    model: str,
    redis_retry_budget_s: float,
    invalid_answer_retries: int = 1,
) -> TaskResult:
    answered = await ask(task, llm, invalid_answer_retries)
    if isinstance(answered, TaskResult):
        return answered
    return await write(task, answered, store, model, redis_retry_budget_s)


async def upsert_with_retry(
    store: AsyncIntentStore,
    record: IntentRecord,
    budget_s: float,
    *,
    clock: Callable[[], float] | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> bool:
    """Upsert ``record``, retrying with backoff (0.1 s doubling to 5 s) while Redis is
    unavailable, until ``budget_s`` has passed: the last wait is cut short so that the last
    attempt is made at the deadline, then :class:`RedisUnavailable` is raised. ``clock``
    (monotonic seconds; the event loop's by default) and ``sleep`` are for tests."""
    now = clock or asyncio.get_running_loop().time
    deadline = now() + budget_s
    delay = 0.1
    while True:
        try:
            return await store.upsert(record)
        except _RETRIED_WRITE_ERRORS as exc:
            left = deadline - now()
            if left <= 0:
                raise RedisUnavailable(
                    f"could not write the intent of shopper {record.shopper_id} to Redis "
                    f"for {budget_s:.0f} s: {exc}"
                ) from exc
            wait = min(delay, left)
            log.warning("Redis write failed (%s); retrying in %.1f s", exc, wait)
            await sleep(wait)
            delay = min(delay * 2, 5.0)


Clients = Callable[[], tuple[LlmClient, AsyncIntentStore]]


class PromptRunner:
    """The outbox's ``Runner`` in this interpreter: :func:`run_task` with the job's LLM
    client and intent store, made on first use, on the event loop that runs the calls
    (their connection pools belong to it): from the configuration, or by ``make_clients``
    (tests)."""

    def __init__(self, config: AppConfig, make_clients: Clients | None = None) -> None:
        self._config = config
        self._make_clients = make_clients
        self._llm: LlmClient | None = None
        self._store: AsyncIntentStore | None = None
        # shopper -> (seq, LLM step)
        self._asking: dict[str, tuple[int, asyncio.Future[Answered | TaskResult]]] = {}

    def clients(self) -> tuple[LlmClient, AsyncIntentStore]:
        if (self._llm is None or self._store is None) and self._make_clients is not None:
            self._llm, self._store = self._make_clients()
        if self._llm is None or self._store is None:
            from flink_jobs.runtime.intent_store import Notify
            from intent_reader.clients import async_client

            rc = self._config.redis
            client = async_client(rc.url, cluster=rc.cluster, socket_timeout=rc.write_timeout_s)
            notify = Notify(rc.notify_stream, rc.notify_stream_maxlen) if rc.notify_stream else None
            self._store = AsyncIntentStore(
                client,
                rc.key_prefix,
                rc.intent_ttl_s * 1000,
                notify=notify,
                reevaluate=rc.reevaluate,
                shards=rc.layout().shards,
            )
            self._llm = LlmClient(self._config.llm)
        return self._llm, self._store

    async def run(self, task: PromptTask) -> TaskResult:
        """:func:`run_task` for ``task``, stoppable while it waits for the LLM
        (:meth:`supersede`)."""
        llm, store = self.clients()
        tally = AttemptTally()
        asking = asyncio.ensure_future(
            ask(task, llm, self._config.llm.invalid_answer_retries, tally)
        )
        self._asking[task.shopper_id] = (task.seq, asking)
        try:
            answered = await asking
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():  # the runner itself is stopping
                raise
            return TaskResult("superseded", attempts=max(1, tally.made))  # its request was out
        finally:
            if self._asking.get(task.shopper_id, (None, None))[1] is asking:
                del self._asking[task.shopper_id]
        if isinstance(answered, TaskResult):
            return answered
        return await write(
            task,
            answered,
            store,
            self._config.llm.model,
            self._config.redis.write_retry_budget_s,
        )

    async def write_rules(self, task: PromptTask) -> TaskResult:
        """The rules-only record of ``task`` (:func:`write_rules`), the outbox's rules lane."""
        _llm, store = self.clients()
        return await write_rules(task, store, self._config.redis.write_retry_budget_s)

    def supersede(self, shopper_id: str, seq: int) -> None:
        """Abandon prompt ``seq`` of the shopper if it is still waiting for the LLM: a newer
        prompt of the shopper is queued, whose intent would replace this one's anyway. The
        call then settles as ``superseded`` and its HTTP request is closed, which makes the
        router and vLLM stop computing it. Once the answer is in, its write goes ahead (an
        intent is either written or not, never half)."""
        entry = self._asking.get(shopper_id)
        if entry is not None and entry[0] == seq:
            entry[1].cancel()

    async def aclose(self) -> None:
        if self._llm is not None:
            await self._llm.aclose()
        if self._store is not None:
            await self._store.client.aclose()
        self._llm = self._store = None
