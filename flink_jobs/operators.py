"""The Flink operators: each wires one pure module to Flink's state, timers and I/O.

* :class:`DecodeEvents` - ``events.decode_event`` on each Kafka record; refusals go to the
  dead-letter side output.
* :class:`ShopperSessions` - keyed by shopper: ``timeline.on_event`` / ``on_timer`` on
  keyed state and event-time timers (session, trigger and prompt rendering inside), and
  the asynchronous LLM calls through ``outbox.Outbox`` (``inference.run_task`` per prompt).

Counts go twice: to Flink metrics (for Managed Flink / CloudWatch) and to the Redis stats
hash (``runtime.counters``) that the local console and the tests read; a prompt's outcome
through one :class:`~flink_jobs.metrics.OutcomeRecorder` call that feeds both.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator

import orjson
from pyflink.common import Duration, Row, Time
from pyflink.common.typeinfo import Types
from pyflink.datastream import OutputTag, RuntimeContext, TimeDomain
from pyflink.datastream.functions import KeyedProcessFunction, ProcessFunction
from pyflink.datastream.state import (
    ListState,
    ListStateDescriptor,
    StateTtlConfig,
    ValueState,
    ValueStateDescriptor,
)

from flink_jobs.config import AppConfig
from flink_jobs.core.events import DeadLetter, ShopperEvent, SourcePosition, decode_event
from flink_jobs.core.prompting import ArmRenderer
from flink_jobs.core.session import SessionState
from flink_jobs.core.tasks import PromptTask, TaskResult
from flink_jobs.core.timeline import Step, hold_event, is_held, on_event, on_timer
from flink_jobs.core.trigger import END_OF_TIME_MS
from flink_jobs.metrics import INFER_COUNTS as INFER_COUNTS  # the gauges' names, re-exported
from flink_jobs.metrics import INFER_TIMINGS as INFER_TIMINGS
from flink_jobs.metrics import (
    GaugeBoard,
    GaugeCounters,
    OutcomeRecorder,
    PublishedGroup,
    metric_group,
)
from flink_jobs.runtime.call_process import CallProcess
from flink_jobs.runtime.counters import StatsReporter
from flink_jobs.runtime.inference import PromptRunner
from flink_jobs.runtime.llm_client import quiet_http_logs
from flink_jobs.runtime.outbox import Outbox, Settled

log = logging.getLogger(__name__)

DEAD_LETTERS = OutputTag("dead-letters", Types.STRING())
#: Events that arrived behind the watermark, with what became of them (see timeline.py).
LATE_EVENTS = OutputTag("late-events", Types.STRING())
#: Every prompt rendered (PromptTask.audit_json), when kafka.prompts_topic is set.
PROMPTS = OutputTag("prompts", Types.STRING())
#: What the session operator emits: a record for a side output, as (its tag, the JSON).
Output = tuple[OutputTag, str]
#: The watermark at the end of a bounded input (Flink's MAX_WATERMARK).
END_OF_INPUT_MS = END_OF_TIME_MS


def _now_ms() -> int:
    return int(time.time() * 1000)


def _dead_letter_json(dead_letter: DeadLetter) -> str:
    return dead_letter.to_json(_now_ms()).decode("utf-8")


class _Counted:
    """Counters that go both to Flink's metric group and to the Redis stats hash.

    The Flink side is gauges over counts kept here (``metrics.GaugeCounters``):
    PyFlink drops counter updates made in ``on_timer``. Their values reach Flink through a
    ``metrics.GaugeBoard``, published from the operator's thread after records and timers,
    so that Flink never calls into Python to read them.

    What an operator starts (the stats thread, the outbox's thread and call process) stops
    in ``close`` or when the operator is released, whichever comes first (``weakref.finalize``):
    in thread mode PyFlink calls ``close`` only at the end of a bounded input, and a job
    stopped with a savepoint, cancelled or restarted just releases its operators. Each stop
    once left a call process behind on the TaskManager (tests/service/test_scale_out.py).
    """

    def _open_counters(self, ctx: RuntimeContext, config: AppConfig) -> None:
        self._gauges = GaugeBoard()
        group = ctx.get_metrics_group().add_group(metric_group(config.job.metric_group))
        self._metrics = PublishedGroup(group, self._gauges)
        self._flink_counters = GaugeCounters(self._metrics)
        self._stats = StatsReporter(
            config.redis.url,
            config.redis.key_prefix,
            config.job.stats_flush_s,
            cluster=config.redis.cluster,
            shards=config.redis.cluster_shards,
        )
        self._retire_stats = weakref.finalize(self, self._stats.close)

    def _count(self, name: str, amount: int = 1) -> None:
        self._flink_counters.inc(name, amount)
        self._stats.add(name, amount)

    def _close_counters(self) -> None:
        if getattr(self, "_gauges", None) is not None:
            self._gauges.publish_now()
        if getattr(self, "_retire_stats", None) is not None:
            self._retire_stats()


class DecodeEvents(ProcessFunction, _Counted):
    """Bytes to :class:`ShopperEvent`, or a :class:`DeadLetter` saying why not.

    Both go out on the main output, and the keyed operator emits the dead letters (it
    has that side output anyway). With a side output of its own, PyFlink does not chain
    this operator with ``key_by``'s key selector: two calls into the interpreter per
    record instead of one (``docs/decisions.md#decode-without-side-output``).
    """

    def __init__(self, config: AppConfig) -> None:
        self._config = config

    def open(self, runtime_context: RuntimeContext) -> None:
        self._open_counters(runtime_context, self._config)
        # The source's task is up (a fresh start, or a restart): a replay can start now.
        self._count("task_starts")

    def close(self) -> None:
        self._close_counters()

    def process_element(
        self, value: Row, ctx: ProcessFunction.Context
    ) -> Iterator[ShopperEvent | DeadLetter]:
        self._gauges.publish()
        self._count("events_in")
        source = SourcePosition(value[0], value[1], value[2], value[3])
        result = decode_event(bytes(value[4]), source, _now_ms(), self._config.job.max_event_bytes)
        if isinstance(result, DeadLetter):
            self._count("dead_letter_decode")
            self._count(f"dead_letter_decode_{result.reason}")
        yield result


#: Flink's default for how often RocksDB's compaction filter re-reads the time while it
#: drops expired state (entries); the heap backend's default is 5 keys checked per access.
_ROCKSDB_TTL_QUERY_TIME_AFTER = 1000
_INCREMENTAL_TTL_CLEANUP_SIZE = 5


def _state_ttl(config: AppConfig) -> StateTtlConfig:
    """Expired state is cleaned in the background by Flink's default strategies, spelled out
    rather than left to PyFlink: building its defaults makes a ``Duration`` through the Py4J
    gateway, which an operator on a TaskManager in thread mode does not have (a standalone
    cluster, Managed Flink), so ``open`` failed there ("FileNotFoundError" launching one);
    only the in-process mini-cluster has it. The compaction filter's periodic compaction
    time is Flink's default too: PyFlink passes only the entry count to Java, so the
    ``Duration`` given here never needs a Java object."""
    return (
        StateTtlConfig.new_builder(Time.seconds(config.session.state_ttl_s))
        .set_update_type(StateTtlConfig.UpdateType.OnCreateAndWrite)
        .set_state_visibility(StateTtlConfig.StateVisibility.NeverReturnExpired)
        .disable_cleanup_in_background()
        .cleanup_incrementally(_INCREMENTAL_TTL_CLEANUP_SIZE, False)
        .cleanup_in_rocksdb_compact_filter(_ROCKSDB_TTL_QUERY_TIME_AFTER, Duration(None))
        .build()
    )


def session_states(runtime_context: RuntimeContext, config: AppConfig) -> tuple[ValueState, ...]:
    """The session operator's keyed state: the session, the events held until the watermark
    passes them as one value (``held-events``: now only read, to move what a snapshot of an
    earlier version holds into ``held_states``), and the prompt in flight; each dropped
    ``session.state_ttl_s`` after its last write."""
    ttl = _state_ttl(config)
    states = []
    for name in ("session", "held-events", "pending-prompt"):
        descriptor = ValueStateDescriptor(name, Types.PICKLED_BYTE_ARRAY())
        descriptor.enable_time_to_live(ttl)
        states.append(runtime_context.get_state(descriptor))
    return tuple(states)


def held_states(runtime_context: RuntimeContext, config: AppConfig) -> tuple[ListState, ValueState]:
    """The events held until the watermark passes them, in arrival order, and their count:
    holding one appends it and rewrites the count only, whatever the number held
    (``timeline.hold_event``)."""
    ttl = _state_ttl(config)
    events = ListStateDescriptor("held-list", Types.PICKLED_BYTE_ARRAY())
    events.enable_time_to_live(ttl)
    count = ValueStateDescriptor("held-count", Types.INT())
    count.enable_time_to_live(ttl)
    return runtime_context.get_list_state(events), runtime_context.get_state(count)


class _RecentSessions:
    """The newest session states by shopper, as objects: a read from keyed state unpickles
    the whole session, and the operator is the only writer of that state, so what it last
    wrote is what the state holds. Rebuilt empty whenever the operator opens (a restore
    included)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._states: OrderedDict[str, SessionState] = OrderedDict()

    def get(self, shopper_id: str) -> SessionState | None:
        state = self._states.get(shopper_id)
        if state is not None:
            self._states.move_to_end(shopper_id)
        return state

    def put(self, shopper_id: str, state: SessionState) -> None:
        self._states[shopper_id] = state
        self._states.move_to_end(shopper_id)
        if len(self._states) > self._size:
            self._states.popitem(last=False)


_INSTANCES = itertools.count(1)


def _stop_outbox(outbox: Outbox, task: str) -> None:
    log.info("%s ended: stopping its LLM calls", task)
    outbox.close()


class ShopperSessions(KeyedProcessFunction, _Counted):
    """Keyed by shopper: ``timeline.on_event`` / ``on_timer`` on keyed state, and the
    shopper's prompts through the :class:`~flink_jobs.runtime.outbox.Outbox`.

    Timers are event-time timers, so prompts depend on the topic and not on when it was
    read; the source's watermarks keep advancing when traffic stops
    (``shopperintents.EventTimeWatermarks``), so a shopper's last prompt still fires.

    A prompt sent stays in the ``pending`` state until its outcome is collected, on a
    processing-time timer every ``llm.poll_interval_s`` in the shopper's key context; one
    whose outcome the outbox does not know (the job restarted) is sent again. At the end
    of a bounded input the watermark reaches ``END_OF_INPUT_MS`` and the operator waits
    for every pending outcome before the job finishes.
    """

    def __init__(self, config: AppConfig) -> None:
        self._config = config

    def open(self, runtime_context: RuntimeContext) -> None:
        self._session, self._legacy_held, self._pending = session_states(
            runtime_context, self._config
        )
        self._held, self._held_count = held_states(runtime_context, self._config)
        self._recent = _RecentSessions(self._config.job.session_cache_size)
        self._renderer = ArmRenderer(self._config.prompt)
        self._open_counters(runtime_context, self._config)
        self._outcomes = OutcomeRecorder(self._stats, arms=self._renderer.arm_names)
        self._outcomes.register(self._metrics)
        quiet_http_logs()
        runner = (CallProcess if self._config.llm.call_process else PromptRunner)(self._config)
        self._outbox: Outbox | None = Outbox(
            runner,
            self._config.llm.capacity,
            self._config.llm.max_concurrency,
            rules_first=self._config.llm.rules_first,
            latest_wins=self._config.llm.latest_wins,
        ).start()
        # Numbered within the interpreter: a TaskManager's log holds every attempt it ran,
        # and an instance released late (collected) logs its end beside a newer one's start.
        task = f"shopper sessions #{next(_INSTANCES)}"
        log.info("%s opened: its LLM calls start with its first prompt", task)
        self._retire_outbox = weakref.finalize(self, _stop_outbox, self._live_outbox(), task)
        self._poll_ms = int(self._config.llm.poll_interval_s * 1000)

    def close(self) -> None:
        if getattr(self, "_retire_outbox", None) is not None:
            self._retire_outbox()
        self._outbox = None
        self._close_counters()

    def _live_outbox(self) -> Outbox:
        """The outbox, which the operator has from ``open`` until ``close``."""
        if self._outbox is None:
            raise RuntimeError("the shopper sessions operator is closed: it has no outbox")
        return self._outbox

    def process_element(
        self, event: ShopperEvent | DeadLetter, ctx: KeyedProcessFunction.Context
    ) -> Iterator[Output]:
        if isinstance(event, DeadLetter):  # counted by DecodeEvents
            yield DEAD_LETTERS, _dead_letter_json(event)
            return
        self._gauges.publish()
        watermark = ctx.timer_service().current_watermark()
        if is_held(event, watermark):  # appended: neither the session nor the held are read
            step = hold_event(event, self._held_count.value() or 0, self._config)
            loaded = None
        else:
            loaded, held = self._session_and_held(event.shopper_id)
            step = on_event(loaded, held, event, watermark, self._config, self._renderer.render)
        yield from self._commit(step, ctx, loaded)

    def on_timer(
        self, timestamp: int, ctx: KeyedProcessFunction.OnTimerContext
    ) -> Iterator[Output]:
        poll = ctx.time_domain() == TimeDomain.PROCESSING_TIME
        if poll and self._outbox is None:
            # A poll that fires after close: a bounded input's end waited for every
            # pending prompt before the operator closed, so there is nothing to collect.
            return
        self._gauges.publish()
        if poll:
            yield from self._settle(ctx, wait=False)
            return
        if timestamp == END_OF_INPUT_MS:
            yield from self._settle(ctx, wait=True)
            return
        loaded, held = self._session_and_held(ctx.get_current_key())
        step = on_timer(loaded, held, timestamp, self._config, self._renderer.render)
        yield from self._commit(step, ctx, loaded)

    def _session_and_held(self, shopper_id: str) -> tuple[SessionState | None, list[ShopperEvent]]:
        """The shopper's session and held events (in arrival order: the timeline orders
        them). Held events a snapshot of an earlier version kept in one value move to the
        list, first; a shopper whose session this operator holds in memory has been looked
        at since the operator opened, so that value is read only for the others."""
        held = list(self._held.get() or ())
        state = self._recent.get(shopper_id)
        if state is None:
            state = self._session.value()
            legacy = self._legacy_held.value()
            if legacy:
                held = [*legacy, *held]
                self._held.update(held)
                self._held_count.update(len(held))
                self._legacy_held.clear()
        return state, held

    def _commit(
        self, step: Step, ctx: KeyedProcessFunction.Context, loaded: SessionState | None = None
    ) -> Iterator[Output]:
        """Store what ``step`` changed; ``loaded``: the session it started from, which the
        state already holds (sessions are immutable: a changed one is another object)."""
        if step.state is not None:
            if step.state is not loaded:
                self._session.update(step.state)
            self._recent.put(step.state.shopper_id, step.state)
        if step.held is None:  # appended to, the others untouched
            if step.held_added:
                self._held.add_all(list(step.held_added))
                self._held_count.update((self._held_count.value() or 0) + len(step.held_added))
        elif step.held:
            self._held.update(list(step.held))
            self._held_count.update(len(step.held))
        else:
            self._held.clear()
            self._held_count.clear()
        for when in step.timers:
            ctx.timer_service().register_event_time_timer(when)
        for name, amount in step.counts.items():
            self._count(name, amount)
        for dead_letter in step.dead_letters:
            yield DEAD_LETTERS, _dead_letter_json(dead_letter)
        # A side output nothing consumes is an error in PyFlink ("Unknown OutputTag"): the
        # late events' copy is only emitted when the job wires its topic.
        if self._config.kafka.late_events_topic:
            for event, outcome in step.late_events:
                yield LATE_EVENTS, orjson.dumps({"outcome": outcome.value, "event": event}).decode()
        for task in step.prompts:
            if self._config.kafka.prompts_topic:
                yield PROMPTS, task.audit_json()
            yield from self._send(task, ctx)

    def _send(self, task: PromptTask, ctx: KeyedProcessFunction.Context) -> Iterator[Output]:
        outbox = self._live_outbox()
        replaced = self._pending.value()
        if replaced is not None and not outbox.tracks(task.shopper_id, replaced.seq):
            # Sent before a restart and not yet sent again: this newer prompt replaces it.
            yield from self._record(Settled(replaced, TaskResult("superseded"), _now_ms()))
        # The job's own share of the freshness (Kafka, watermark, trigger, rendering); the
        # rest of event_to_intent_ms is the outbox's queue, the LLM call and the upsert.
        waited_ms = _now_ms() - task.event_time_ms
        self._pending.update(task)
        outbox.submit(task)
        self._outcomes.sent(waited_ms, outbox.in_system, task)
        if ctx.timer_service().current_watermark() >= END_OF_INPUT_MS:
            yield from self._settle(ctx, wait=True)
            return
        self._poll_later(ctx)
        ctx.timer_service().register_event_time_timer(END_OF_INPUT_MS)

    def _settle(self, ctx: KeyedProcessFunction.Context, wait: bool) -> Iterator[Output]:
        """Record the outcomes of the shopper's prompts that settled (model answers and
        rules-only records); keep polling while its newest prompt or a rules write is out,
        and send the prompt again if the outbox has never seen it."""
        outbox = self._live_outbox()
        shopper_id = ctx.get_current_key()
        pending: PromptTask | None = self._pending.value()
        if pending is not None and not outbox.tracks(shopper_id, pending.seq):
            self._count("prompts_resent")
            outbox.submit(pending)
        if wait and pending is not None:
            settled = outbox.wait(shopper_id, pending.seq, self._drain_timeout_s())
        else:
            settled = outbox.collect(shopper_id)
        for outcome in settled:
            yield from self._record(outcome)
        answered = pending is None or any(
            s.task.seq == pending.seq and s.result.source != "rules" for s in settled
        )
        if pending is not None and answered:
            self._pending.clear()
            ctx.timer_service().delete_event_time_timer(END_OF_INPUT_MS)
        if not answered or outbox.writing_rules(shopper_id):
            self._poll_later(ctx)

    def _poll_later(self, ctx: KeyedProcessFunction.Context) -> None:
        ctx.timer_service().register_processing_time_timer(
            ctx.timer_service().current_processing_time() + self._poll_ms
        )

    def _drain_timeout_s(self) -> float:
        """How long the end of a bounded input waits for the shopper's newest prompt: the
        longest call, once for every round of calls ahead of it in the outbox (with
        ``llm.latest_wins`` off, a shopper's earlier prompts are among them)."""
        llm = self._config.llm
        per_call = llm.request_timeout_s * llm.max_attempts + llm.backoff_max_s * llm.max_attempts
        attempts = 1 + llm.invalid_answer_retries
        rounds = 1 + -(-self._live_outbox().in_system // llm.max_concurrency)
        return per_call * attempts * rounds + self._config.redis.write_retry_budget_s

    def _record(self, settled: Settled) -> Iterator[Output]:
        self._outcomes.settled(settled)
        if settled.result.dead_letter is not None:
            yield DEAD_LETTERS, _dead_letter_json(settled.result.dead_letter)
