"""The shopper-intents Flink job, wired top to bottom.

1. Read shopper events from Kafka, each record raw with its topic/partition/offset
   (``shopperintents.KafkaRecordWithMetadata``), with per-partition event-time watermarks
   from the record timestamp (``shopperintents.EventTimeWatermarks``: bounded
   out-of-orderness, following the wall clock once a partition goes quiet).
2. Decode and validate them; refusals go to the dead-letter topic.
3. Key by shopper: events held until the watermark passes them, session state, trigger
   policy on event-time timers, prompt rendering (``timeline.py``).
4. In the same keyed operator, ask the LLM asynchronously (``outbox.py``: bounded,
   latest context wins), validate the answer and upsert the intent to Redis; failures go
   to the dead-letter topic.

Run it with ``python -m flink_jobs.job`` against the endpoints in the configuration
(see ``config.py``); ``shopper-intents demo`` runs it on an embedded stack.
"""

from __future__ import annotations

import logging
import os
import sys
import sysconfig
import tempfile
from pathlib import Path

from pyflink.common import Configuration, Types, WatermarkStrategy
from pyflink.common.serialization import SimpleStringSchema
from pyflink.datastream import CheckpointingMode, StreamExecutionEnvironment
from pyflink.datastream.connectors.base import DeliveryGuarantee
from pyflink.datastream.connectors.kafka import (
    KafkaOffsetsInitializer,
    KafkaRecordSerializationSchema,
    KafkaSink,
    KafkaSource,
)
from pyflink.java_gateway import get_gateway

from flink_jobs.checkpoints import restore_path
from flink_jobs.config import MANAGED_FLINK_PROPERTIES, AppConfig, ConfigError, load_config
from flink_jobs.core.events import MAX_CLOCK_SKEW_MS, record_key
from flink_jobs.core.prompting import ArmRenderer, PromptError
from flink_jobs.core.token_budget import TokenizerError
from flink_jobs.operators import (
    DEAD_LETTERS,
    LATE_EVENTS,
    PROMPTS,
    DecodeEvents,
    ShopperSessions,
)
from flink_jobs.paths import cache_dir
from flink_jobs.runtime.intent_store import NotifyStreamError, check_notify_stream
from intent_reader.clients import UNAVAILABLE_ERRORS, sync_client

log = logging.getLogger(__name__)

REQUIRED_JARS = ("flink-connector-kafka.jar", "kafka-clients.jar", "shopper-intents-connectors.jar")


def connector_jars(config: AppConfig) -> list[str]:
    """Jars for ``pipeline.jars``: the configured ones, else none on Managed Flink (the
    application's jarfile is already on the classpath), else those the setup step built."""
    if config.job.jars:
        return list(config.job.jars)
    if MANAGED_FLINK_PROPERTIES.exists():
        return []
    jar_dir = cache_dir() / "jars"
    missing = [name for name in REQUIRED_JARS if not (jar_dir / name).exists()]
    if missing:
        raise FileNotFoundError(
            f"missing {', '.join(missing)} in {jar_dir}: run scripts/setup.sh (or set job.jars)"
        )
    return [str(p) for p in sorted(jar_dir.glob("*.jar"))]


def python_path() -> str:
    """Where the job's Python code and its dependencies are, for the Python operators.

    In thread mode they run in an interpreter embedded in the JVM, which knows neither
    this virtualenv nor the project folder unless told."""
    project = Path(__file__).resolve().parent.parent
    return os.pathsep.join(dict.fromkeys([str(project), sysconfig.get_paths()["purelib"]]))


def build_environment(config: AppConfig, jars: list[str]) -> StreamExecutionEnvironment:
    flink_conf = Configuration()
    flink_conf.set_string("python.execution-mode", config.job.python_execution_mode)
    flink_conf.set_string("python.executable", sys.executable)
    flink_conf.set_string("python.client.executable", sys.executable)
    if not MANAGED_FLINK_PROPERTIES.exists():
        flink_conf.set_string("python.pythonpath", python_path())
    flink_conf.set_string("python.state.cache-size", str(config.job.python_state_cache_size))
    flink_conf.set_string("python.fn-execution.bundle.size", str(config.job.python_bundle_size))
    flink_conf.set_string("python.fn-execution.bundle.time", str(config.job.python_bundle_time_ms))
    # A strategy set here overrides the cluster's (Managed Flink's restarts without limit):
    # only the one configured, if any.
    for key, value in config.job.restart_strategy.items():
        flink_conf.set_string(f"restart-strategy.{key}", value)
    if jars:
        flink_conf.set_string("pipeline.jars", ";".join(Path(j).resolve().as_uri() for j in jars))
    if config.job.checkpoint_dir:
        flink_conf.set_string(
            "execution.checkpointing.dir", Path(config.job.checkpoint_dir).resolve().as_uri()
        )
        flink_conf.set_string(
            "execution.checkpointing.externalized-checkpoint-retention", "RETAIN_ON_CANCELLATION"
        )
        flink_conf.set_string("execution.checkpointing.num-retained", "3")
    elif not MANAGED_FLINK_PROPERTIES.exists():
        # Flink's default keeps checkpoints in the JobManager's memory, at most 5 MiB: a few
        # thousand shoppers' sessions fail every checkpoint, and then the job.
        scratch = Path(tempfile.mkdtemp(prefix="si-checkpoints-"))
        flink_conf.set_string("execution.checkpointing.dir", scratch.as_uri())
    restore = restore_path(config.job.checkpoint_dir, config.job.restore_from)
    if restore:
        log.info("restoring from %s", restore)
        flink_conf.set_string("execution.state-recovery.path", Path(restore).resolve().as_uri())
    env = StreamExecutionEnvironment.get_execution_environment(flink_conf)
    if config.job.parallelism:
        env.set_parallelism(config.job.parallelism)
    env.set_max_parallelism(config.job.max_parallelism)
    env.get_config().set_auto_watermark_interval(config.job.watermark_interval_ms)
    env.set_buffer_timeout(config.job.buffer_timeout_ms)
    env.enable_checkpointing(
        int(config.job.checkpoint_interval_s * 1000), CheckpointingMode.EXACTLY_ONCE
    )
    return env


def _starting_offsets(config: AppConfig) -> KafkaOffsetsInitializer:
    if config.kafka.starting_offsets == "earliest":
        return KafkaOffsetsInitializer.earliest()
    if config.kafka.starting_offsets == "latest":
        return KafkaOffsetsInitializer.latest()
    # The Python helper names a shaded class that the plain connector jar lacks.
    jvm = get_gateway().jvm
    earliest = jvm.org.apache.kafka.clients.consumer.OffsetResetStrategy.EARLIEST
    initializer = (
        jvm.org.apache.flink.connector.kafka.source.enumerator.initializer.OffsetsInitializer
    )
    return KafkaOffsetsInitializer(initializer.committedOffsets(earliest))


def source_properties(config: AppConfig) -> dict[str, str]:
    """The source's Kafka consumer properties: the job's own, then ``kafka.client_properties``
    (security), then ``kafka.source_properties`` (tuning for a broker). The events topic is
    read, never created: a consumer that may create topics would make a restarted or
    misconfigured broker hand the job a new, empty topic in silence. No broker's tuning
    is set unless configured."""
    return {
        "partition.discovery.interval.ms": "30000",
        "allow.auto.create.topics": "false",
        **config.kafka.client_properties,
        **config.kafka.source_properties,
    }


def kafka_source(config: AppConfig) -> KafkaSource:
    builder = (
        KafkaSource.builder()
        .set_bootstrap_servers(config.kafka.bootstrap_servers)
        .set_topics(config.kafka.events_topic)
        .set_group_id(config.kafka.group_id)
        .set_starting_offsets(_starting_offsets(config))
        .set_properties(source_properties(config))
    )
    builder._j_builder.setDeserializer(get_gateway().jvm.shopperintents.KafkaRecordWithMetadata())
    if config.kafka.bounded:
        builder.set_bounded(KafkaOffsetsInitializer.latest())
    return builder.build()


def topic_sink(config: AppConfig, topic: str) -> KafkaSink:
    """At least once: dead letters, late events and prompt audits are keyed by their
    content, so a consumer can drop the copies a restart replays."""
    builder = (
        KafkaSink.builder()
        .set_bootstrap_servers(config.kafka.bootstrap_servers)
        .set_record_serializer(
            KafkaRecordSerializationSchema.builder()
            .set_topic(topic)
            .set_value_serialization_schema(SimpleStringSchema())
            .build()
        )
        .set_delivery_guarantee(DeliveryGuarantee.AT_LEAST_ONCE)
    )
    # An idempotent producer loses its producer id when the broker restarts and the sink
    # then fails the job with UnknownProducerId; at least once does not need it.
    properties = {"enable.idempotence": "false", **config.kafka.client_properties}
    for key, value in properties.items():
        builder.set_property(key, value)
    return builder.build()


def event_time_watermarks(config: AppConfig) -> WatermarkStrategy:
    """Per-partition watermarks from the record timestamps (``EventTimeWatermarks.java``)."""
    return WatermarkStrategy(
        get_gateway().jvm.shopperintents.EventTimeWatermarks(
            int(config.job.out_of_orderness_s * 1000),
            int(config.job.watermark_idle_advance_s * 1000),
            int(config.job.source_idleness_s * 1000),
            MAX_CLOCK_SKEW_MS,
        )
    )


def check_redis_layout(config: AppConfig) -> None:
    """Refuse at start a ``redis.notify_stream`` key (or, on a cluster, a shard's key) that
    exists and is not a stream (:class:`ConfigError`): every write would fail on it. Were
    Redis unreachable from here, the write script still checks the key before it writes
    anything."""
    rc = config.redis
    if not rc.notify_stream:
        return
    client = None
    try:
        # A cluster client reads the topology as it is made: it may fail here already.
        client = sync_client(
            rc.url, cluster=rc.cluster, socket_timeout=5.0, socket_connect_timeout=5.0
        )
        check_notify_stream(client, rc.notify_stream, rc.layout())
    except NotifyStreamError as exc:
        raise ConfigError("redis.notify_stream", str(exc)) from None
    except UNAVAILABLE_ERRORS as exc:
        log.warning(
            "could not check redis.notify_stream's type at start (%s); each write checks it", exc
        )
    finally:
        if client is not None:
            client.close()


def check_prompts(config: AppConfig) -> None:
    """Refuse at start (:class:`ConfigError`) prompts that cannot be rendered within their
    budget: a template (or an arm's) whose fixed text alone is over ``prompt.max_prompt_tokens``
    by the count in use, a tokenizer that does not load. The operators would otherwise fail
    to open, and again after every restart."""
    try:
        ArmRenderer(config.prompt)
    except PromptError as exc:
        raise ConfigError("prompt", str(exc)) from None
    except TokenizerError as exc:
        raise ConfigError("prompt.tokenizer_path", str(exc)) from None


def build_pipeline(env: StreamExecutionEnvironment, config: AppConfig) -> None:
    """Each operator's uid is its name. Flink matches a snapshot's state to operators by
    uid, so the Kafka offsets and shopper sessions survive an update that changes the
    graph (Managed Flink restores an update from a snapshot)."""
    check_prompts(config)
    check_redis_layout(config)
    records = env.from_source(
        kafka_source(config), event_time_watermarks(config), "kafka-shopper-events"
    ).uid("kafka-shopper-events")
    decoded = (
        records.process(DecodeEvents(config), output_type=Types.PICKLED_BYTE_ARRAY())
        .name("decode-events")
        .uid("decode-events")
    )
    sessions = (
        decoded.key_by(record_key, key_type=Types.STRING())
        .process(ShopperSessions(config), output_type=Types.STRING())
        .name("shopper-sessions")
        .uid("shopper-sessions")
    )
    dead_letters = sessions.get_side_output(DEAD_LETTERS)
    sinks = [(dead_letters, "dead-letter-topic", config.kafka.dead_letter_topic)]
    if config.kafka.late_events_topic:
        sinks.append(
            (
                sessions.get_side_output(LATE_EVENTS),
                "late-events-topic",
                config.kafka.late_events_topic,
            )
        )
    if config.kafka.prompts_topic:
        sinks.append(
            (sessions.get_side_output(PROMPTS), "prompts-topic", config.kafka.prompts_topic)
        )
    for stream, name, topic in sinks:
        stream.sink_to(topic_sink(config, topic)).name(name).uid(name)


def create_job(config: AppConfig) -> StreamExecutionEnvironment:
    env = build_environment(config, connector_jars(config))
    build_pipeline(env, config)
    return env


def main() -> None:
    logging.basicConfig(level=os.environ.get("SI_LOG_LEVEL", "INFO"))
    config = load_config()
    create_job(config).execute(config.job.name)


if __name__ == "__main__":
    main()
