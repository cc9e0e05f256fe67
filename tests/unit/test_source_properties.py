"""The Kafka source's consumer properties: the job's own, security settings, and a broker's
tuning only where configured (the embedded stack's broker, Tansu, needs a short fetch wait;
Kafka and MSK do not)."""

from __future__ import annotations

from flink_jobs.config import load_config
from flink_jobs.job import source_properties
from flink_jobs.tools.local_services import LOCAL_BROKER_SOURCE_PROPERTIES


def test_no_broker_tuning_unless_configured():
    properties = source_properties(load_config(environ={}))

    assert properties == {
        "partition.discovery.interval.ms": "30000",
        "allow.auto.create.topics": "false",
    }


def test_the_local_brokers_fetch_wait_is_passed_when_configured():
    config = load_config(
        overrides={"kafka": {"source_properties": LOCAL_BROKER_SOURCE_PROPERTIES}}, environ={}
    )

    assert source_properties(config)["fetch.max.wait.ms"] == "50"


def test_source_tuning_comes_after_the_client_properties():
    environ = {
        "SI_KAFKA_CLIENT_PROPERTIES": '{"security.protocol": "SSL", "fetch.min.bytes": "1"}',
        "SI_KAFKA_SOURCE_PROPERTIES": '{"fetch.min.bytes": "1024"}',
    }

    properties = source_properties(load_config(environ=environ))

    assert properties["security.protocol"] == "SSL"
    assert properties["fetch.min.bytes"] == "1024"
