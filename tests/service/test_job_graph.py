"""The job's operators keep fixed ids across versions of the job.

Flink maps the state in a snapshot to operators by id. An operator without a uid gets a
hash of the graph's shape, so any change to the graph (an operator added or taken out)
leaves the saved Kafka offsets and shopper sessions unclaimed: Managed Flink then refuses
to update the application from its snapshot, or drops that state. The stream graph is the one
PyFlink would submit, built on the py4j gateway with no cluster.
"""

from __future__ import annotations

import pytest

from flink_jobs.config import load_config

#: PyFlink chains the decoder and ``key_by``'s key selector into one Python operator (one
#: call into the interpreter per record) while the decoder has no side output.
DECODE_AND_KEY = "decode-events, _stream_key_by_map_operator"


@pytest.fixture(scope="module")
def stream_nodes() -> dict[str, str | None]:
    """Each node of the job's stream graph, by name, with its uid."""
    from flink_jobs.job import create_job

    config = load_config(
        overrides={"kafka": {"late_events_topic": "late", "prompts_topic": "prompts"}},
        environ={},
    )
    graph = create_job(config)._generate_stream_graph(False)
    return {
        str(node.getOperatorName()): node.getTransformationUID()
        for node in graph.getStreamNodes().toArray()
    }


def test_every_operator_that_holds_state_has_a_fixed_uid(
    stream_nodes: dict[str, str | None],
) -> None:
    assert {
        name: stream_nodes.get(name)
        for name in (
            "Source: kafka-shopper-events",
            DECODE_AND_KEY,
            "shopper-sessions",
            "dead-letter-topic: Writer",
            "late-events-topic: Writer",
            "prompts-topic: Writer",
        )
    } == {
        "Source: kafka-shopper-events": "kafka-shopper-events",
        DECODE_AND_KEY: "decode-events",
        "shopper-sessions": "shopper-sessions",
        "dead-letter-topic: Writer": "dead-letter-topic",
        "late-events-topic: Writer": "late-events-topic",
        "prompts-topic: Writer": "prompts-topic",
    }


def test_decoding_and_keying_run_as_one_python_operator(
    stream_nodes: dict[str, str | None],
) -> None:
    """A side output on the decoder splits them: 0.05 ms more JVM CPU per record
    (``DecodeEvents``' docstring)."""
    assert DECODE_AND_KEY in stream_nodes


def test_only_stateless_maps_of_pyflinks_own_go_without_a_uid(
    stream_nodes: dict[str, str | None],
) -> None:
    """``key_by`` and each side output add a map the job cannot name; none holds state."""
    without = {name for name, uid in stream_nodes.items() if not uid}
    assert without <= {"_stream_key_by_map_operator", "Map"}


def test_the_environment_flushes_buffers_and_watermarks_for_latency() -> None:
    """Every prompt waits for the watermark and crosses a network buffer on the way."""
    from flink_jobs.job import build_environment

    config = load_config(environ={})
    env = build_environment(config, jars=[])
    assert env.get_config().get_auto_watermark_interval() == config.job.watermark_interval_ms
    assert env.get_buffer_timeout() == config.job.buffer_timeout_ms == 10


def test_the_source_never_creates_the_topic_it_reads(
    stream_nodes: dict[str, str | None],
) -> None:
    """A restarted broker must not hand the job a new, empty events topic made by its own
    consumer (``stream_nodes`` has put the connector on the gateway)."""
    from flink_jobs.job import kafka_source

    source = kafka_source(load_config(environ={})).get_java_function()
    props = source.getClass().getDeclaredField("props")
    props.setAccessible(True)
    assert props.get(source).getProperty("allow.auto.create.topics") == "false"
