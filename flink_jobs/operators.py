"""The Flink operators: each wires one pure module to Flink's state, timers and I/O.

* :class:`DecodeEvents` - ``events.decode_event`` on each Kafka record; refusals go to the
  dead-letter side output.
* :class:`ShopperSessions` - keyed by shopper: ``session.apply_event`` on keyed state,
  ``trigger.decide`` on each event and timer, ``prompting`` to render what fires.
* :class:`InferIntents` - the async operator: ``inference.run_task`` per prompt.

Outcomes are counted twice: as Flink metrics (for Managed Flink / CloudWatch) and in the
Redis stats hash (``stats.py``) that the local console and the tests read.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pyflink.common import Row, Time
from pyflink.common.typeinfo import Types
from pyflink.datastream import OutputTag, RuntimeContext
from pyflink.datastream.functions import AsyncFunction, KeyedProcessFunction, ProcessFunction
from pyflink.datastream.state import StateTtlConfig, ValueStateDescriptor

from flink_jobs.config import AppConfig
from flink_jobs.events import DeadLetter, ShopperEvent, SourcePosition, decode_event
from flink_jobs.inference import Coalescer, PromptTask, TaskResult, run_coalesced, run_task
from flink_jobs.prompting import PromptError, PromptRenderer
from flink_jobs.session import (
    Outcome,
    SessionState,
    apply_event,
    clear_pending,
    mark_prompted,
    new_session_state,
)
from flink_jobs.stats import StatsReporter
from flink_jobs.trigger import Verdict, decide

log = logging.getLogger(__name__)

DEAD_LETTERS = OutputTag("dead-letters", Types.STRING())


def _now_ms() -> int:
    return int(time.time() * 1000)


def _dead_letter_json(dead_letter: DeadLetter) -> str:
    return dead_letter.to_json(_now_ms()).decode("utf-8")


class _Counted:
    """Counters that go both to Flink's metric group and to the Redis stats hash."""

    def _open_counters(self, ctx: RuntimeContext, config: AppConfig) -> None:
        self._metrics = ctx.get_metrics_group().add_group("shopper_intents")
        self._flink_counters: dict[str, Any] = {}
        self._stats = StatsReporter(
            config.redis.url, config.redis.key_prefix, config.job.stats_flush_s
        )

    def _count(self, name: str, amount: int = 1) -> None:
        counter = self._flink_counters.get(name)
        if counter is None:
            counter = self._flink_counters[name] = self._metrics.counter(name)
        counter.inc(amount)
        self._stats.add(name, amount)

    def _close_counters(self) -> None:
        if getattr(self, "_stats", None) is not None:
            self._stats.close()
            self._stats = None


class DecodeEvents(ProcessFunction, _Counted):
    def __init__(self, config: AppConfig) -> None:
        self._config = config

    def open(self, runtime_context: RuntimeContext) -> None:
        self._open_counters(runtime_context, self._config)

    def close(self) -> None:
        self._close_counters()

    def process_element(self, value: Row, ctx: ProcessFunction.Context):
        self._count("events_in")
        source = SourcePosition(value[0], value[1], value[2], value[3])
        result = decode_event(bytes(value[4]), source, _now_ms(), self._config.job.max_event_bytes)
        if isinstance(result, DeadLetter):
            self._count("dead_letter_decode")
            self._count(f"dead_letter_decode_{result.reason}")
            yield DEAD_LETTERS, _dead_letter_json(result)
        else:
            yield result


class ShopperSessions(KeyedProcessFunction, _Counted):
    """Keyed by shopper id; holds a :class:`SessionState` and one pending trigger timer.

    Trigger times are event times. A timer is a processing-time timer set for the same
    distance ahead as the trigger is in event time, and when it fires the shopper's event
    clock is taken to have advanced by the wall time since their newest event arrived:
    event-time timers would wait for the watermark, which stops when traffic does.
    """

    def __init__(self, config: AppConfig) -> None:
        self._config = config

    def open(self, runtime_context: RuntimeContext) -> None:
        ttl = (
            StateTtlConfig.new_builder(Time.seconds(self._config.session.state_ttl_s))
            .set_update_type(StateTtlConfig.UpdateType.OnCreateAndWrite)
            .set_state_visibility(StateTtlConfig.StateVisibility.NeverReturnExpired)
            .build()
        )
        session = ValueStateDescriptor("session", Types.PICKLED_BYTE_ARRAY())
        session.enable_time_to_live(ttl)
        clock = ValueStateDescriptor(
            "clock", Types.TUPLE([Types.LONG(), Types.LONG(), Types.LONG()])
        )
        clock.enable_time_to_live(ttl)
        self._session = runtime_context.get_state(session)
        # (newest event time, wall time it arrived, wall time of the pending timer or 0)
        self._clock = runtime_context.get_state(clock)
        self._renderer = PromptRenderer(self._config.prompt)
        self._open_counters(runtime_context, self._config)

    def close(self) -> None:
        self._close_counters()

    def process_element(self, event: ShopperEvent, ctx: KeyedProcessFunction.Context):
        state: SessionState = self._session.value() or new_session_state(event.shopper_id)
        state, outcome = apply_event(
            state, event, self._config.session, self._config.trigger.high_signal_types
        )
        self._count(f"events_{outcome.value}")
        if outcome is Outcome.LATE_DROPPED:
            yield (
                DEAD_LETTERS,
                _dead_letter_json(
                    DeadLetter(
                        "late",
                        "too_late",
                        f"event is more than {self._config.session.max_lateness_s:.0f} s "
                        "(session.max_lateness_s) behind the shopper's newest event",
                        shopper_id=event.shopper_id,
                        context={"event_id": event.event_id, "event_time_ms": event.event_time_ms},
                    )
                ),
            )
            return
        if not outcome.changed_session:
            return
        wall = ctx.timer_service().current_processing_time()
        pending_timer = self._pending_timer()
        self._clock.update((state.newest_event_ms, wall, pending_timer))
        yield from self._evaluate(state, state.newest_event_ms, wall, ctx, event.event_time_ms)

    def on_timer(self, timestamp: int, ctx: KeyedProcessFunction.OnTimerContext):
        clock = self._clock.value()
        if clock is None or clock[2] != timestamp:
            return  # superseded by a later timer
        newest_ms, arrived_wall, _ = clock
        self._clock.update((newest_ms, arrived_wall, 0))
        state: SessionState | None = self._session.value()
        if state is None:
            return
        now_ms = newest_ms + max(0, timestamp - arrived_wall)
        yield from self._evaluate(state, now_ms, timestamp, ctx, state.newest_event_ms)

    def _pending_timer(self) -> int:
        clock = self._clock.value()
        return clock[2] if clock else 0

    def _evaluate(self, state: SessionState, now_ms: int, wall: int, ctx, trigger_event_ms: int):
        decision = decide(state, now_ms, self._config.trigger)
        if decision.verdict is Verdict.FIRE:
            try:
                prompt = self._renderer.render(state)
            except PromptError as exc:
                self._count("dead_letter_prompt")
                yield (
                    DEAD_LETTERS,
                    _dead_letter_json(
                        DeadLetter("prompt", "prompt_error", str(exc), shopper_id=state.shopper_id)
                    ),
                )
                state = clear_pending(state)
            else:
                state = mark_prompted(state, now_ms, decision.fingerprint)
                self._count("prompts_sent")
                self._count(f"prompts_reason_{decision.reason.replace(' ', '_').replace('-', '_')}")
                yield PromptTask(
                    state.shopper_id,
                    state.prompt_seq,
                    state.newest_event_ms,
                    trigger_event_ms,
                    prompt,
                )
        elif decision.verdict is Verdict.UNCHANGED:
            self._count("prompts_skipped_unchanged")
            state = clear_pending(state)
        elif decision.verdict is Verdict.WAIT:
            assert decision.wake_at_ms is not None
            target = wall + max(1, decision.wake_at_ms - now_ms)
            clock = self._clock.value()
            if clock is not None and not (0 < clock[2] <= target):
                ctx.timer_service().register_processing_time_timer(target)
                self._clock.update((clock[0], clock[1], target))
        self._session.update(state)


_OUTCOME_COUNTERS = {
    "written": "intents_written",
    "stale": "intents_stale",
    "superseded": "prompts_superseded",
    "dead_letter": "dead_letter_inference",
}


class InferIntents(AsyncFunction):
    """The async LLM call. Clients are created on the operator's event loop, lazily:
    PyFlink calls ``open`` before that loop runs."""

    def __init__(self, config: AppConfig) -> None:
        self._config = config

    def open(self, runtime_context: RuntimeContext) -> None:
        self._llm = None
        self._store = None
        self._coalescer = None
        self._stats = StatsReporter(
            self._config.redis.url, self._config.redis.key_prefix, self._config.job.stats_flush_s
        )
        metrics = runtime_context.get_metrics_group().add_group("shopper_intents")
        self._flink_counters = {name: metrics.counter(name) for name in _OUTCOME_COUNTERS.values()}

    def close(self) -> None:
        if getattr(self, "_stats", None) is not None:
            self._stats.close()

    def _clients(self):
        if self._llm is None:
            import redis.asyncio

            from flink_jobs.intent_store import AsyncIntentStore
            from flink_jobs.llm_client import LlmClient

            client = redis.asyncio.Redis.from_url(
                self._config.redis.url, socket_timeout=self._config.redis.write_timeout_s
            )
            self._store = AsyncIntentStore(
                client, self._config.redis.key_prefix, self._config.redis.intent_ttl_s * 1000
            )
            self._llm = LlmClient(self._config.llm)
            self._coalescer = Coalescer(self._config.llm.max_concurrency)
        return self._llm, self._store, self._coalescer

    async def async_invoke(self, task: PromptTask) -> list[str]:
        llm, store, coalescer = self._clients()

        def run(t: PromptTask):
            return run_task(
                t,
                llm,
                store,
                self._config.llm.model,
                self._config.redis.write_retry_budget_s,
                self._config.llm.invalid_answer_retries,
            )

        result: TaskResult = await run_coalesced(task, coalescer, run)
        self._record(result)
        if result.outcome == "written":
            self._stats.sample("event_to_intent_ms", _now_ms() - task.event_time_ms)
        if result.dead_letter is not None:
            return [_dead_letter_json(result.dead_letter)]
        return []

    def timeout(self, task: PromptTask) -> list[str]:
        result = TaskResult(
            "dead_letter",
            DeadLetter(
                "llm",
                "operator_timeout",
                "the async operator's timeout expired",
                shopper_id=task.shopper_id,
            ),
        )
        self._record(result)
        return [_dead_letter_json(result.dead_letter)]

    def _record(self, result: TaskResult) -> None:
        name = _OUTCOME_COUNTERS[result.outcome]
        self._flink_counters[name].inc()
        self._stats.add(name)
        if result.dead_letter is not None:
            self._stats.add(f"dead_letter_{result.dead_letter.stage}_{result.dead_letter.reason}")
        if result.attempts > 1:
            self._stats.add("llm_retries", result.attempts - 1)
        if result.prompt_tokens:
            self._stats.add("llm_prompt_tokens", result.prompt_tokens)
        if result.llm_latency_s:
            self._stats.add("llm_calls")
            self._stats.sample("llm_latency_ms", int(result.llm_latency_s * 1000))
