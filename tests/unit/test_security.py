"""Security settings, the parts that need no service; the parts shown
against a real Redis, a refusing LLM endpoint and a started router are in
``tests/service/test_security_services.py``.

- **No secrets in logs**: a malformed Redis URL or Kafka client property, and the job
  CLI's configuration error, name no secret (``redact_url`` itself:
  ``tests/unit/test_config_errors.py``).
- **The router binds to loopback** by default, in every subcommand.
- **Limits**: every limit is a validated setting. (Event size: test_events.py
  ``test_oversized_record_is_refused_before_parsing`` and the property tests; prompt size:
  test_prompting.py ``TestTokenBudget``.)
- **The replay tool's producer** takes the Kafka client's security properties (the Java
  source and sink: tests/service/test_kafka_security_properties.py, it needs the JVM).
"""

from __future__ import annotations

import logging
import os

import pytest

from flink_jobs.config import ConfigError, load_config
from flink_jobs.tools import cli as job_cli
from flink_jobs.tools import replay
from inference_sidecar import cli as router_cli
from tests.support.secret_leaks import (
    JAAS_PASSWORD,
    REDIS_PASSWORD,
    assert_no_secret,
    exception_chain,
)

# --- no secrets in errors, dead letters or logs ------------------------------------------


class TestNoSecretsInLogs:
    def test_a_malformed_redis_url_with_a_password(self) -> None:
        with pytest.raises(ConfigError) as raised:
            load_config(
                overrides={"redis": {"url": f"http://:{REDIS_PASSWORD}@cache:6379"}}, environ={}
            )
        assert "redis.url" in str(raised.value) and "***" in str(raised.value)
        assert_no_secret(*exception_chain(raised.value))

    def test_malformed_kafka_client_properties_with_a_jaas_password(self) -> None:
        jaas = f'ScramLoginModule required password=\\"{JAAS_PASSWORD}\\"'
        broken = '{"sasl.jaas.config": "' + jaas + '"'  # no closing brace
        with pytest.raises(ConfigError) as raised:
            load_config(overrides={"kafka": {"client_properties": broken}}, environ={})
        assert "kafka.client_properties" in str(raised.value)
        assert_no_secret(*exception_chain(raised.value))

    def test_the_job_cli_logs_a_config_error_without_the_password(
        self, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.DEBUG)
        for key in [k for k in os.environ if k.startswith("SI_") and k != "SI_CACHE_DIR"]:
            monkeypatch.delenv(key)
        monkeypatch.setenv("SI_REDIS_URL", f"tcp://admin:{REDIS_PASSWORD}@cache:6379")
        assert job_cli.main(["run"]) == 2
        assert "configuration error" in caplog.text and "redis.url" in caplog.text
        assert_no_secret(caplog.text)


# --- the router binds to loopback --------------------------------------------------------


class TestRouterBindsToLoopback:
    def test_the_default_host_of_every_subcommand_is_loopback(self) -> None:
        parser = router_cli.build_parser()
        for argv in (["router", "--worker", "http://127.0.0.1:9001"], ["cluster"]):
            args = parser.parse_args(argv)
            assert args.host == "127.0.0.1"
        args = parser.parse_args(["router", "--worker", "http://127.0.0.1:9001"])
        assert router_cli.router_config(args, workers=tuple(args.worker)).host == "127.0.0.1"


# --- limits ------------------------------------------------------------------------------


class TestLimits:
    def test_every_limit_is_a_validated_setting(self) -> None:
        for group, name in (
            ("job", "max_event_bytes"),
            ("prompt", "max_prompt_tokens"),
            ("prompt", "max_text_chars"),
            ("llm", "max_tokens"),
        ):
            with pytest.raises(ConfigError, match=f"{group}.{name}"):
                load_config(overrides={group: {name: 0}}, environ={})


# --- the replay tool's producer takes the same security properties ----------------------


SASL_PRODUCER_SETTINGS = {
    "security.protocol": "SASL_SSL",
    "sasl.mechanism": "SCRAM-SHA-512",
    "sasl.username": "replayer",
    "sasl.password": JAAS_PASSWORD,
    "ssl.ca.location": "/etc/ssl/certs/ca-certificates.crt",
}


class TestReplaySecurityProperties:
    def test_extra_config_reaches_the_producer(self) -> None:
        config = replay.producer_config("broker:9096", SASL_PRODUCER_SETTINGS)
        assert {k: config[k] for k in SASL_PRODUCER_SETTINGS} == SASL_PRODUCER_SETTINGS
        from confluent_kafka import Producer

        Producer(config).flush(0)  # librdkafka accepts every key (it raises on unknown ones)

    def test_the_cli_takes_client_properties_with_x(self) -> None:
        args = replay._build_parser().parse_args(
            ["replay", "events.jsonl", "-X", "sasl.mechanism=SCRAM-SHA-512",
             "-X", f"sasl.password={JAAS_PASSWORD}=x"]
        )  # fmt: skip
        assert dict(args.client_property) == {
            "sasl.mechanism": "SCRAM-SHA-512",
            "sasl.password": f"{JAAS_PASSWORD}=x",
        }

    def test_a_malformed_x_is_refused_without_repeating_it(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        with pytest.raises(SystemExit):
            replay._build_parser().parse_args(["record", "--out", "o", "-X", JAAS_PASSWORD])
        err = capsys.readouterr().err
        assert "expected KEY=VALUE" in err
        assert_no_secret(err)
