"""The replayer's Kafka credentials come from its environment and reach the replay tool
inside the process, never on its command line."""

from __future__ import annotations

import pytest

from deploy.compose_replay import PropertiesError, client_properties, with_client_properties
from flink_jobs.tools.replay import _build_parser

SECRET = {"sasl.username": "app", "sasl.password": "s3cret"}


def test_properties_are_read_from_the_environment():
    environ = {"SI_REPLAY_CLIENT_PROPERTIES": '{"sasl.username": "app", "sasl.password": "s3cret"}'}
    assert client_properties(environ) == SECRET


def test_no_variable_means_no_properties():
    assert client_properties({}) == {}


def test_a_malformed_value_is_refused_without_repeating_it():
    with pytest.raises(PropertiesError) as raised:
        client_properties({"SI_REPLAY_CLIENT_PROPERTIES": '{"sasl.password": s3cret}'})
    assert "s3cret" not in str(raised.value)


def test_a_non_string_value_is_refused():
    with pytest.raises(PropertiesError):
        client_properties({"SI_REPLAY_CLIENT_PROPERTIES": '{"sasl.password": 7}'})


def test_the_properties_become_the_replay_tools_client_properties():
    argv = ["replay", "data/sample_sessions.jsonl", "--bootstrap", "kafka:9092", "--speed", "30"]
    args = _build_parser().parse_args(with_client_properties(argv, SECRET))
    assert dict(args.client_property) == SECRET
    assert args.bootstrap == "kafka:9092" and args.speed == 30.0


def test_without_properties_the_arguments_are_unchanged():
    argv = ["replay", "events.jsonl"]
    assert with_client_properties(argv, {}) == argv
