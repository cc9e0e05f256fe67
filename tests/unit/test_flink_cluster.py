"""The standalone cluster's configuration and the CLI output it reads, without a JVM."""

from __future__ import annotations

import pytest

from flink_jobs.tools.flink_cluster import (
    PROMETHEUS_REPORTER,
    ClusterSpec,
    cluster_settings,
    parse_job_id,
    render_config,
    settings_env,
)


def test_every_address_and_bind_host_is_loopback() -> None:
    settings = cluster_settings(ClusterSpec(), rpc_port=1, rest_port=2, blob_port=3)
    addresses = {k: v for k, v in settings.items() if k.endswith(("address", "host"))}
    assert addresses and set(addresses.values()) == {"127.0.0.1"}


def test_the_jobmanager_ports_are_the_given_ones_and_the_taskmanagers_any_free_one() -> None:
    settings = cluster_settings(ClusterSpec(), rpc_port=11, rest_port=12, blob_port=13)
    assert (settings["jobmanager.rpc.port"], settings["rest.port"]) == (11, 12)
    assert settings["blob.server.port"] == 13
    assert settings["taskmanager.rpc.port"] == settings["taskmanager.data.port"] == 0


def test_a_killed_taskmanager_is_noticed_within_seconds_not_flinks_default_50() -> None:
    settings = cluster_settings(ClusterSpec(), 1, 2, 3)
    assert settings["heartbeat.timeout"] <= 10_000


def test_extra_settings_override_the_defaults() -> None:
    spec = ClusterSpec(extra={"taskmanager.numberOfTaskSlots": "2"})
    assert cluster_settings(spec, 1, 2, 3)["taskmanager.numberOfTaskSlots"] == "2"


def test_a_cluster_needs_a_taskmanager() -> None:
    with pytest.raises(ValueError, match="at least one TaskManager"):
        ClusterSpec(taskmanagers=0)


def test_the_config_file_is_flat_yaml_with_odd_values_quoted() -> None:
    text = render_config({"rest.port": 8081, "env.java.opts.all": "-Dx=1 -Dy=2", "a": "it's"})
    assert text == "rest.port: 8081\nenv.java.opts.all: '-Dx=1 -Dy=2'\na: 'it''s'\n"


def test_the_job_id_is_read_from_flink_runs_output() -> None:
    output = "Job has been submitted with JobID 0123456789abcdef0123456789abcdef\n"
    assert parse_job_id("log line\n" + output) == "0123456789abcdef0123456789abcdef"
    assert parse_job_id("org.apache.flink.client.program.ProgramInvocationException") is None


def test_job_settings_become_the_variables_config_reads() -> None:
    env = settings_env({"kafka": {"bounded": True}, "job": {"parallelism": 0}})
    assert env == {"SI_KAFKA_BOUNDED": "True", "SI_JOB_PARALLELISM": "0"}


def test_the_prometheus_reporter_takes_the_first_free_port_of_the_range():
    settings = cluster_settings(ClusterSpec(reporter_ports=range(9300, 9304)), 1, 2, 3)
    assert settings["metrics.reporter.prom.factory.class"] == PROMETHEUS_REPORTER
    assert settings["metrics.reporter.prom.port"] == "9300-9303"
    assert not any(
        k.startswith("metrics.reporter") for k in cluster_settings(ClusterSpec(), 1, 2, 3)
    )


def test_the_reporter_range_needs_a_port_per_process():
    with pytest.raises(ValueError, match="a port per process"):
        ClusterSpec(taskmanagers=2, reporter_ports=range(9300, 9302))
