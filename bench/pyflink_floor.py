"""The floor under pipeline capacity: the job's PyFlink graph with none of the job's work.

The capacity target is a rate for the whole job, but part of each event's cost is
PyFlink's own: the Kafka source, a record handed into the embedded interpreter and back
for every Python operator, ``key_by``'s key selector, keyed state and timers reached
through PEMJA. These jobs keep the real job's source (the same deserializer, watermarks
and environment, from ``flink_jobs.job``) and its shape, and do nothing else, so the rate
they drain at is what no Python job of that shape can beat on the host, measured beside
the real job in ``bench.pipeline_capacity`` (phase ``floor``). The gap between the two is
what the job's own code costs; the floor's distance from a target is what it does not.

Four shapes, each a measure of its own:

* ``bare``: decode (read the shopper id with orjson), ``key_by``, and a keyed operator
  that only counts the event;
* ``state_timer``: the same, and the keyed operator reads and writes one small value in
  keyed state and registers one event-time timer per event, whose firing reads it again:
  the least a session operator that holds events until the watermark passes them does;
* ``job_decode``: ``state_timer`` behind the job's own decode operator
  (``flink_jobs.operators.DecodeEvents``: size check, JSON Schema, the ``ShopperEvent``
  handed on), so the difference from ``state_timer`` is what decoding costs the job;
* ``job_state``: ``job_decode`` with the session operator's own keyed state (three
  ``ValueState``s with TTL, a session of up to 40 events pickled on every write, the
  event held until its timer), so the difference from ``job_decode`` is what the job's
  state costs, apart from its logic, prompts and calls.

Each event is counted as ``events_accepted`` in the job's stats hash
(``flink_jobs.runtime.counters``), so the benchmark's drain measures both jobs the same
way; a timer's firing as ``floor_timers_fired``.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

import orjson
from pyflink.common import Row, Types
from pyflink.datastream import (
    KeyedProcessFunction,
    ProcessFunction,
    RuntimeContext,
    StreamExecutionEnvironment,
)
from pyflink.datastream.connectors.base import Sink
from pyflink.datastream.state import ValueStateDescriptor
from pyflink.java_gateway import get_gateway

from flink_jobs.config import AppConfig, load_config
from flink_jobs.core.events import DeadLetter, ShopperEvent, record_key
from flink_jobs.job import (
    build_environment,
    connector_jars,
    event_time_watermarks,
    kafka_source,
)
from flink_jobs.operators import DecodeEvents, session_states
from flink_jobs.runtime.counters import StatsReporter


class _Reporting:
    """Counts to the stats hash; first among the bases, so that its ``open`` and ``close``
    (the last flush) are the ones Flink calls, not the functions' empty ones."""

    def __init__(self, config: AppConfig) -> None:
        self._config = config

    def open(self, runtime_context: RuntimeContext) -> None:
        config = self._config
        self._stats = StatsReporter(
            config.redis.url, config.redis.key_prefix, config.job.stats_flush_s
        )

    def close(self) -> None:
        self._stats.close()


class DecodeFloor(_Reporting, ProcessFunction):
    def process_element(self, value: Row, ctx: ProcessFunction.Context):
        self._stats.add("events_in")
        yield orjson.loads(bytes(value[4]))["shopper_id"]


class CountFloor(_Reporting, KeyedProcessFunction):
    def process_element(self, event: object, ctx: KeyedProcessFunction.Context):
        self._stats.add("events_accepted")
        return iter(())


class StateTimerFloor(CountFloor):
    def open(self, runtime_context: RuntimeContext) -> None:
        super().open(runtime_context)
        descriptor = ValueStateDescriptor("seen", Types.PICKLED_BYTE_ARRAY())
        self._seen = runtime_context.get_state(descriptor)

    def process_element(self, event: object, ctx: KeyedProcessFunction.Context):
        self._seen.update((self._seen.value() or 0) + 1)
        ctx.timer_service().register_event_time_timer(ctx.timestamp())
        self._stats.add("events_accepted")
        return iter(())

    def on_timer(self, timestamp: int, ctx: KeyedProcessFunction.OnTimerContext):
        self._seen.value()
        self._stats.add("floor_timers_fired")
        return iter(())


class JobStateFloor(CountFloor):
    """The session operator's keyed state without its logic: the same three TTL'd states,
    and per event the reads, writes and timer the operator makes for an event that only
    joins the session: the last ``session.max_events`` events written back (and kept as
    objects, read from state only when not kept, as the operator does), the event held
    until the watermark passes it, whose timer releases it."""

    def open(self, runtime_context: RuntimeContext) -> None:
        super().open(runtime_context)
        self._session, self._held, _ = session_states(runtime_context, self._config)
        self._keep = self._config.session.max_events
        self._recent: dict[str, tuple[ShopperEvent, ...]] = {}

    def process_element(self, event: ShopperEvent, ctx: KeyedProcessFunction.Context):
        shopper_id = ctx.get_current_key()
        session = self._recent.get(shopper_id) or self._session.value() or ()
        session = self._recent[shopper_id] = (*session, event)[-self._keep :]
        self._session.update(session)
        self._held.update((*(self._held.value() or ()), event))
        ctx.timer_service().register_event_time_timer(ctx.timestamp())
        self._stats.add("events_accepted")
        return iter(())

    def on_timer(self, timestamp: int, ctx: KeyedProcessFunction.OnTimerContext):
        self._held.value()
        self._held.clear()
        self._stats.add("floor_timers_fired")
        return iter(())


SHAPES = {
    "bare": (DecodeFloor, CountFloor),
    "state_timer": (DecodeFloor, StateTimerFloor),
    "job_decode": (DecodeEvents, StateTimerFloor),
    "job_state": (DecodeEvents, JobStateFloor),
}
"""Each shape's decode and keyed operators."""


def _shopper_id(record: str | ShopperEvent | DeadLetter) -> str:
    return record if isinstance(record, str) else record_key(record)


def create_floor_job(config: AppConfig, shape: str) -> StreamExecutionEnvironment:
    """A job of ``shape`` (a key of ``SHAPES``) reading the configured topic."""
    decode, keyed = SHAPES[shape]
    env = build_environment(config, connector_jars(config))
    decoded = env.from_source(
        kafka_source(config), event_time_watermarks(config), "kafka-shopper-events"
    ).process(decode(config), output_type=Types.PICKLED_BYTE_ARRAY())
    discard = get_gateway().jvm.org.apache.flink.streaming.api.functions.sink.v2.DiscardingSink()
    (
        decoded.key_by(_shopper_id, key_type=Types.STRING())
        .process(keyed(config), output_type=Types.STRING())
        .sink_to(Sink(discard))
    )
    return env


def main(argv: Sequence[str] | None = None) -> None:
    """Run a floor job on the job's configuration (env / file), like ``flink_jobs.job``."""
    parser = argparse.ArgumentParser(prog="python -m bench.pyflink_floor")
    parser.add_argument("shape", choices=sorted(SHAPES))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    config = load_config()
    create_floor_job(config, args.shape).execute(config.job.name)


if __name__ == "__main__":
    main()
