"""The shopper-intents Flink job, wired top to bottom.

1. Read shopper events from Kafka, each record raw with its topic/partition/offset
   (``shopperintents.KafkaRecordWithMetadata``), with event-time watermarks from the
   record timestamp (bounded out-of-orderness, idle partitions excluded).
2. Decode and validate them; refusals go to the dead-letter topic.
3. Key by shopper: session state, trigger policy, prompt rendering.
4. Ask the LLM asynchronously (unordered, bounded capacity), validate the answer and
   upsert the intent to Redis; failures go to the dead-letter topic.

Run it with ``python -m flink_jobs.job`` against the endpoints in the configuration
(see ``config.py``); ``shopper-intents demo`` runs it on an embedded stack.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from pyflink.common import Configuration, Duration, Time, Types, WatermarkStrategy
from pyflink.common.serialization import SimpleStringSchema
from pyflink.datastream import AsyncDataStream, CheckpointingMode, StreamExecutionEnvironment
from pyflink.datastream.connectors.base import DeliveryGuarantee
from pyflink.datastream.connectors.kafka import (
    KafkaOffsetsInitializer,
    KafkaRecordSerializationSchema,
    KafkaSink,
    KafkaSource,
)
from pyflink.java_gateway import get_gateway

from flink_jobs.config import MANAGED_FLINK_PROPERTIES, AppConfig, load_config
from flink_jobs.local_services import cache_dir
from flink_jobs.operators import DEAD_LETTERS, DecodeEvents, InferIntents, ShopperSessions

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


def build_environment(config: AppConfig, jars: list[str]) -> StreamExecutionEnvironment:
    flink_conf = Configuration()
    flink_conf.set_string("python.execution-mode", "process")
    flink_conf.set_string("python.executable", sys.executable)
    flink_conf.set_string("python.client.executable", sys.executable)
    flink_conf.set_string("python.state.cache-size", str(config.job.python_state_cache_size))
    flink_conf.set_string("python.fn-execution.bundle.size", str(config.job.python_bundle_size))
    flink_conf.set_string("python.fn-execution.bundle.time", str(config.job.python_bundle_time_ms))
    flink_conf.set_string("restart-strategy.type", "fixed-delay")
    flink_conf.set_string("restart-strategy.fixed-delay.attempts", "3")
    flink_conf.set_string("restart-strategy.fixed-delay.delay", "5 s")
    if jars:
        flink_conf.set_string("pipeline.jars", ";".join(Path(j).resolve().as_uri() for j in jars))
    env = StreamExecutionEnvironment.get_execution_environment(flink_conf)
    env.set_parallelism(config.job.parallelism)
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


def kafka_source(config: AppConfig) -> KafkaSource:
    builder = (
        KafkaSource.builder()
        .set_bootstrap_servers(config.kafka.bootstrap_servers)
        .set_topics(config.kafka.events_topic)
        .set_group_id(config.kafka.group_id)
        .set_starting_offsets(_starting_offsets(config))
        .set_property("partition.discovery.interval.ms", "30000")
        .set_properties(dict(config.kafka.client_properties))
    )
    builder._j_builder.setDeserializer(get_gateway().jvm.shopperintents.KafkaRecordWithMetadata())
    return builder.build()


def dead_letter_sink(config: AppConfig) -> KafkaSink:
    builder = (
        KafkaSink.builder()
        .set_bootstrap_servers(config.kafka.bootstrap_servers)
        .set_record_serializer(
            KafkaRecordSerializationSchema.builder()
            .set_topic(config.kafka.dead_letter_topic)
            .set_value_serialization_schema(SimpleStringSchema())
            .build()
        )
        .set_delivery_guarantee(DeliveryGuarantee.AT_LEAST_ONCE)
    )
    for key, value in config.kafka.client_properties.items():
        builder.set_property(key, value)
    return builder.build()


def build_pipeline(env: StreamExecutionEnvironment, config: AppConfig) -> None:
    watermarks = WatermarkStrategy.for_bounded_out_of_orderness(
        Duration.of_millis(int(config.job.out_of_orderness_s * 1000))
    ).with_idleness(Duration.of_millis(int(config.job.source_idleness_s * 1000)))
    records = env.from_source(kafka_source(config), watermarks, "kafka-shopper-events")

    decoded = records.process(DecodeEvents(config), output_type=Types.PICKLED_BYTE_ARRAY()).name(
        "decode-events"
    )
    prompts = (
        decoded.key_by(lambda e: e.shopper_id, key_type=Types.STRING())
        .process(ShopperSessions(config), output_type=Types.PICKLED_BYTE_ARRAY())
        .name("shopper-sessions")
    )
    # Our own per-attempt timeouts and retries finish well inside this; it is a backstop.
    backstop_s = (
        config.llm.request_timeout_s * config.llm.max_attempts
        + config.llm.backoff_max_s * (config.llm.max_attempts)
        + config.redis.write_retry_budget_s
        + 10
    )
    inference_dead_letters = AsyncDataStream.unordered_wait(
        prompts,
        InferIntents(config),
        Time.milliseconds(int(backstop_s * 1000)),
        capacity=config.llm.capacity,
        output_type=Types.STRING(),
    ).name("infer-intents")

    dead_letters = decoded.get_side_output(DEAD_LETTERS).union(
        prompts.get_side_output(DEAD_LETTERS), inference_dead_letters
    )
    dead_letters.sink_to(dead_letter_sink(config)).name("dead-letter-topic")


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
