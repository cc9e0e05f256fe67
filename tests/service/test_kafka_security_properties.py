"""Kafka TLS and SASL settings reach the Java connectors.

``kafka.client_properties`` (a JSON object in the configuration) is the one place for the
Kafka client's security settings. These tests build the job's ``KafkaSource`` and every
``KafkaSink`` with ``flink_jobs.job`` (the functions ``build_pipeline`` uses) on the py4j
gateway, no cluster, and read the ``java.util.Properties`` each Java object will hand
to its Kafka clients, by reflection: SCRAM over TLS and the MSK IAM mechanism arrive
intact, next to the settings the job makes itself.

The replay tool (confluent-kafka) takes librdkafka's properties with ``-X``; the last test
shows them reaching the wire against the test broker.

Building does not load the IAM callback handler class, so the MSK IAM case needs no
``aws-msk-iam-auth`` jar here; a deployment merges it into the fat jar (deploy/README.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from flink_jobs.config import AppConfig, load_config

SCRAM_OVER_TLS = {
    "security.protocol": "SASL_SSL",
    "sasl.mechanism": "SCRAM-SHA-512",
    "sasl.jaas.config": (
        "org.apache.kafka.common.security.scram.ScramLoginModule required "
        'username="shopper-intents" password="jaas-pw-5e81d2";'
    ),
    "ssl.truststore.type": "PEM",
    "ssl.truststore.location": "/etc/pki/kafka/ca.pem",
    "ssl.endpoint.identification.algorithm": "https",
}
MSK_IAM = {
    "security.protocol": "SASL_SSL",
    "sasl.mechanism": "AWS_MSK_IAM",
    "sasl.jaas.config": "software.amazon.msk.auth.iam.IAMLoginModule required;",
    "sasl.client.callback.handler.class": ("software.amazon.msk.auth.iam.IAMClientCallbackHandler"),
}
REPLAY_PASSWORD = "replay-pw-0c7a3e"
SECURITY_SETTINGS = [
    pytest.param(SCRAM_OVER_TLS, id="scram-sha-512-over-tls"),
    pytest.param(MSK_IAM, id="msk-iam"),
]


def config_with(properties: Mapping[str, str]) -> AppConfig:
    return load_config(
        overrides={
            "kafka": {
                "bootstrap_servers": "b-1.example.kafka.us-east-1.amazonaws.com:9098",
                "client_properties": json.dumps(dict(properties)),
            }
        },
        environ={},
    )


@pytest.fixture(scope="module")
def flink_env() -> Iterator[Any]:
    """One gateway with the connector jars on its class path (the job's own environment)."""
    from flink_jobs.job import build_environment, connector_jars

    config = load_config(environ={})
    yield build_environment(config, connector_jars(config))


def java_properties(java_object: Any, field_name: str) -> dict[str, str]:
    """A private ``java.util.Properties`` field of a Java object, as a dict."""
    field = java_object.getClass().getDeclaredField(field_name)
    field.setAccessible(True)
    properties = field.get(java_object)
    return {
        str(name): str(properties.getProperty(name)) for name in properties.stringPropertyNames()
    }


@pytest.mark.parametrize("settings", SECURITY_SETTINGS)
def test_the_source_gets_every_security_property(
    flink_env: Any, settings: Mapping[str, str]
) -> None:
    from flink_jobs.job import kafka_source

    config = config_with(settings)
    props = java_properties(kafka_source(config).get_java_function(), "props")

    assert {name: props.get(name) for name in settings} == dict(settings)
    assert props["bootstrap.servers"] == config.kafka.bootstrap_servers
    assert props["group.id"] == config.kafka.group_id


@pytest.mark.parametrize("settings", SECURITY_SETTINGS)
def test_every_sink_gets_every_security_property(
    flink_env: Any, settings: Mapping[str, str]
) -> None:
    from flink_jobs.job import topic_sink

    config = config_with(settings)
    for topic in (config.kafka.dead_letter_topic, "late-events", "prompts"):
        sink = topic_sink(config, topic).get_java_function()
        props = java_properties(sink, "kafkaProducerConfig")

        assert {name: props.get(name) for name in settings} == dict(settings), topic
        assert props["bootstrap.servers"] == config.kafka.bootstrap_servers


def test_without_settings_the_clients_use_plaintext(flink_env: Any) -> None:
    from flink_jobs.job import kafka_source, topic_sink

    config = load_config(environ={})
    source = java_properties(kafka_source(config).get_java_function(), "props")
    sink = java_properties(
        topic_sink(config, config.kafka.dead_letter_topic).get_java_function(),
        "kafkaProducerConfig",
    )
    for props in (source, sink):
        assert "security.protocol" not in props and "sasl.jaas.config" not in props


def test_the_replay_tool_speaks_sasl_when_told(
    kafka_bootstrap: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """``-X`` settings reach librdkafka on the wire: against the plaintext test broker the
    producer opens a SCRAM-SHA-512 handshake (refused: no such user), so nothing is
    delivered, the replay says so with a failing status, and the password is not shown."""
    from flink_jobs.tools import replay

    events = tmp_path / "events.jsonl"
    events.write_text('{"event_id": "e-1", "shopper_id": "shopper-1"}\n')
    status = replay.main(
        ["replay", str(events), "--bootstrap", kafka_bootstrap, "--topic", "sasl-probe",
         "--quiet", "-X", "security.protocol=SASL_PLAINTEXT",
         "-X", "sasl.mechanism=SCRAM-SHA-512", "-X", "sasl.username=replayer",
         "-X", f"sasl.password={REPLAY_PASSWORD}", "-X", "message.timeout.ms=3000"]
    )  # fmt: skip
    out, err = capfd.readouterr()

    assert status == 1
    assert "SCRAM-SHA-512" in err and "SASL" in err
    assert REPLAY_PASSWORD not in out + err
