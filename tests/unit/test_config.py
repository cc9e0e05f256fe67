"""The job's configuration: typed defaults, then a Managed Flink properties file, then
``SI_<GROUP>_<FIELD>`` environment variables, then explicit overrides; anything unknown or
malformed fails with an error naming the key."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from flink_jobs.config import (
    AppConfig,
    Bounds,
    ConfigError,
    check_bounds,
    config_as_property_groups,
    load_config,
    read_property_groups,
)


def write_properties(path: Path, groups: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps(groups))
    return path


class TestDefaults:
    def test_defaults_are_valid(self) -> None:
        config = load_config(environ={})

        assert config == AppConfig()
        assert config.kafka.starting_offsets == "committed"
        assert config.trigger.max_wait_s >= config.trigger.quiet_s

    def test_unrelated_environment_variables_are_ignored(self) -> None:
        environ = {"PATH": "/usr/bin", "SI_TEST_SERVICES": "local", "SI_CACHE_DIR": "/tmp/x"}

        assert load_config(environ=environ) == AppConfig()


class TestEnvironment:
    def test_si_group_field_overrides_the_default(self) -> None:
        config = load_config(environ={"SI_KAFKA_BOOTSTRAP_SERVERS": "broker-1:9092,broker-2:9092"})

        assert config.kafka.bootstrap_servers == "broker-1:9092,broker-2:9092"

    def test_values_are_converted_to_the_field_type(self) -> None:
        config = load_config(
            environ={
                "SI_LLM_MAX_TOKENS": "128",
                "SI_TRIGGER_QUIET_S": "1.5",
                "SI_LLM_GUIDED_JSON": "off",
            }
        )

        assert config.llm.max_tokens == 128
        assert config.trigger.quiet_s == 1.5
        assert config.llm.guided_json is False

    def test_unknown_key_of_a_known_group_raises(self) -> None:
        with pytest.raises(ConfigError, match=r"^redis\.urll: unknown key"):
            load_config(environ={"SI_REDIS_URLL": "redis://elsewhere:6379/0"})

    def test_named_properties_file_that_does_not_exist_raises(self, tmp_path: Path) -> None:
        missing = tmp_path / "nope.json"

        with pytest.raises(ConfigError, match="SI_PROPERTIES_FILE"):
            load_config(environ={"SI_PROPERTIES_FILE": str(missing)})


class TestPropertiesFile:
    def test_reads_the_managed_flink_format(self, tmp_path: Path) -> None:
        path = write_properties(
            tmp_path / "application_properties.json",
            [
                {
                    "PropertyGroupId": "kafka",
                    "PropertyMap": {"bootstrap_servers": "b-1.msk:9098", "group_id": "si-prod"},
                },
                {"PropertyGroupId": "redis", "PropertyMap": {"intent_ttl_s": "3600"}},
            ],
        )

        config = load_config(environ={}, properties_file=path)

        assert config.kafka.bootstrap_servers == "b-1.msk:9098"
        assert config.kafka.group_id == "si-prod"
        assert config.redis.intent_ttl_s == 3600

    def test_groups_of_other_applications_are_ignored(self, tmp_path: Path) -> None:
        path = write_properties(
            tmp_path / "props.json",
            [
                {
                    "PropertyGroupId": "kinesis.analytics.flink.run.options",
                    "PropertyMap": {"python": "main.py"},
                }
            ],
        )

        assert load_config(environ={}, properties_file=path) == AppConfig()

    def test_is_found_through_si_properties_file(self, tmp_path: Path) -> None:
        path = write_properties(
            tmp_path / "props.json",
            [{"PropertyGroupId": "llm", "PropertyMap": {"model": "smollm2"}}],
        )

        config = load_config(environ={"SI_PROPERTIES_FILE": str(path)})

        assert config.llm.model == "smollm2"

    def test_environment_beats_file_and_overrides_beat_environment(self, tmp_path: Path) -> None:
        path = write_properties(
            tmp_path / "props.json",
            [{"PropertyGroupId": "job", "PropertyMap": {"name": "from-file", "parallelism": "2"}}],
        )

        config = load_config(
            overrides={"job": {"parallelism": 4}},
            environ={"SI_JOB_NAME": "from-env", "SI_JOB_PARALLELISM": "3"},
            properties_file=path,
        )

        assert config.job.name == "from-env"
        assert config.job.parallelism == 4

    def test_round_trips_through_config_as_property_groups(self, tmp_path: Path) -> None:
        original = AppConfig().with_overrides(
            {
                "kafka": {"client_properties": {"security.protocol": "SSL"}},
                "trigger": {"high_signal_types": ("purchase",)},
            }
        )
        path = write_properties(tmp_path / "props.json", config_as_property_groups(original))

        assert load_config(environ={}, properties_file=path) == original

    @pytest.mark.parametrize(
        ("content", "message"),
        [
            ("{not json", "cannot read the properties file"),
            ('{"kafka": {}}', "expected a JSON list"),
            ('[{"PropertyMap": {}}]', "PropertyGroupId"),
        ],
    )
    def test_malformed_file_raises(self, tmp_path: Path, content: str, message: str) -> None:
        path = tmp_path / "props.json"
        path.write_text(content)

        with pytest.raises(ConfigError, match=message):
            read_property_groups(path)

    def test_unknown_key_in_the_file_raises_naming_it(self, tmp_path: Path) -> None:
        path = write_properties(
            tmp_path / "props.json",
            [{"PropertyGroupId": "session", "PropertyMap": {"max_event": "10"}}],
        )

        with pytest.raises(ConfigError, match=r"session\.max_event\b.*max_events"):
            load_config(environ={}, properties_file=path)


class TestBadValues:
    def test_unknown_group_raises_listing_the_known_ones(self) -> None:
        with pytest.raises(ConfigError, match=r"^kafak: no such property group.*kafka"):
            load_config(overrides={"kafak": {"group_id": "x"}}, environ={})

    @pytest.mark.parametrize(
        ("group", "key", "value"),
        [
            ("llm", "max_tokens", "many"),
            ("llm", "max_tokens", 2.5),
            ("llm", "guided_json", "maybe"),
            ("trigger", "quiet_s", "soon"),
            ("kafka", "client_properties", "[1, 2]"),
            ("kafka", "client_properties", "{broken"),
        ],
    )
    def test_value_of_the_wrong_shape_raises_naming_the_key(
        self, group: str, key: str, value: Any
    ) -> None:
        with pytest.raises(ConfigError, match=rf"^{group}\.{key}: cannot use"):
            load_config(overrides={group: {key: value}}, environ={})

    @pytest.mark.parametrize(
        ("group", "key", "value"),
        [
            ("session", "max_events", "0"),
            ("llm", "max_concurrency", "-1"),
            ("redis", "intent_ttl_s", "0"),
            ("job", "max_parallelism", "0"),
            ("job", "watermark_interval_ms", "0"),
            ("prompt", "max_prompt_tokens", "0"),
        ],
    )
    def test_non_positive_value_raises_naming_the_key(
        self, group: str, key: str, value: str
    ) -> None:
        with pytest.raises(ConfigError, match=rf"{group}\.{key}: must be >=? [01] "):
            load_config(overrides={group: {key: value}}, environ={})

    def test_a_parallelism_of_0_is_left_to_the_cluster(self) -> None:
        """``flink run -p`` or Managed Flink's parallelism setting decides, and may change."""
        assert load_config(overrides={"job": {"parallelism": "0"}}, environ={}).job.parallelism == 0

    def test_a_parallelism_above_the_max_parallelism_is_refused(self) -> None:
        """The key groups (max parallelism) bound the subtasks that can share them."""
        with pytest.raises(ConfigError, match=r"job\.parallelism: 200 must be <= job\.max_p"):
            load_config(overrides={"job": {"parallelism": "200"}}, environ={})

    def test_a_negative_buffer_timeout_is_refused(self) -> None:
        """Flink reads -1 as "send a buffer only when full": fine for a batch, not here."""
        with pytest.raises(ConfigError, match=r"job\.buffer_timeout_ms: must be >= 0"):
            load_config(overrides={"job": {"buffer_timeout_ms": "-1"}}, environ={})

    def test_starting_offsets_must_be_a_known_mode(self) -> None:
        with pytest.raises(ConfigError, match=r"kafka\.starting_offsets: must be one of"):
            load_config(environ={"SI_KAFKA_STARTING_OFFSETS": "beginning"})

    def test_empty_bootstrap_servers_raise_naming_the_variable(self) -> None:
        with pytest.raises(ConfigError, match="SI_KAFKA_BOOTSTRAP_SERVERS"):
            load_config(environ={"SI_KAFKA_BOOTSTRAP_SERVERS": ""})

    def test_redis_url_needs_a_redis_scheme(self) -> None:
        with pytest.raises(ConfigError, match=r"redis\.url"):
            load_config(environ={"SI_REDIS_URL": "http://127.0.0.1:6379"})

    def test_llm_base_url_must_be_http(self) -> None:
        with pytest.raises(ConfigError, match=r"llm\.base_url"):
            load_config(environ={"SI_LLM_BASE_URL": "127.0.0.1:8000/v1"})

    def test_llm_proxy_url_must_be_http(self) -> None:
        with pytest.raises(ConfigError, match=r"llm\.proxy_url"):
            load_config(environ={"SI_LLM_PROXY_URL": "proxy.corp:3128"})

    def test_a_refused_llm_proxy_url_is_shown_without_its_password(self) -> None:
        with pytest.raises(ConfigError, match=r"llm\.proxy_url") as caught:
            load_config(environ={"SI_LLM_PROXY_URL": "socks5://u:hunter2@proxy.corp:1080"})

        assert "hunter2" not in str(caught.value)

    def test_max_wait_shorter_than_quiet_period_raises(self) -> None:
        with pytest.raises(ConfigError, match=r"trigger\.max_wait_s: must be >= trigger\.quiet_s"):
            load_config(overrides={"trigger": {"quiet_s": 10, "max_wait_s": 5}}, environ={})

    def test_negative_min_interval_raises(self) -> None:
        with pytest.raises(ConfigError, match=r"trigger\.min_interval_s"):
            load_config(overrides={"trigger": {"min_interval_s": -1}}, environ={})


def _numeric_fields() -> list[tuple[str, dataclasses.Field]]:
    """Every int or float setting of every group (``bool`` is not a number here)."""
    config = AppConfig()
    return [
        (group.name, f)
        for group in dataclasses.fields(config)
        for f in dataclasses.fields(getattr(config, group.name))
        if f.type in ("int", "float")
    ]


NUMERIC_FIELDS = _numeric_fields()
BOUNDED = [(group, f.name, f.metadata["bounds"]) for group, f in NUMERIC_FIELDS]


def _outside(bounds: Bounds) -> list[float]:
    """Values just outside ``bounds`` on each side it has."""
    values = []
    if bounds.low is not None:
        values.append(bounds.low if bounds.low_open else bounds.low - 1)
    if bounds.high is not None:
        values.append(bounds.high if bounds.high_open else bounds.high + 1)
    return values


class TestBounds:
    """Every numeric setting declares its allowed range beside it; a value outside it, NaN
    or an infinity is refused at start with the key, its variable and the range."""

    def test_every_numeric_setting_declares_its_bounds(self) -> None:
        undeclared = [f"{g}.{f.name}" for g, f in NUMERIC_FIELDS if "bounds" not in f.metadata]

        assert NUMERIC_FIELDS and undeclared == []

    def test_every_default_is_within_its_bounds(self) -> None:
        config = AppConfig()

        for group, name, bounds in BOUNDED:
            assert bounds.admits(getattr(getattr(config, group), name)), f"{group}.{name}"

    def test_negative_invalid_answer_retries_are_refused_naming_variable_and_range(
        self,
    ) -> None:
        """With -1 no answer is ever asked for, and every call failed instead."""
        with pytest.raises(ConfigError) as caught:
            load_config(environ={"SI_LLM_INVALID_ANSWER_RETRIES": "-1"})

        assert str(caught.value) == (
            "llm.invalid_answer_retries: must be >= 0 and <= 10 "
            "(SI_LLM_INVALID_ANSWER_RETRIES; got -1)"
        )

    def test_a_redis_write_timeout_of_zero_is_refused(self) -> None:
        """A zero timeout times out every write."""
        with pytest.raises(ConfigError, match=r"^redis\.write_timeout_s: must be > 0 \(SI_REDIS_"):
            load_config(environ={"SI_REDIS_WRITE_TIMEOUT_S": "0"})

    @pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-inf", "Infinity"])
    @pytest.mark.parametrize(
        ("group", "name"),
        [(g, f.name) for g, f in NUMERIC_FIELDS if f.type == "float"],
    )
    def test_non_finite_floats_are_refused(self, group: str, name: str, text: str) -> None:
        with pytest.raises(ConfigError, match=rf"^{group}\.{name}: must be .*\(SI_"):
            load_config(environ={f"SI_{group.upper()}_{name.upper()}": text})

    @pytest.mark.parametrize(("group", "name", "bounds"), BOUNDED, ids=lambda v: str(v))
    def test_a_value_just_outside_the_bounds_is_refused(
        self, group: str, name: str, bounds: Bounds
    ) -> None:
        section = getattr(AppConfig(), group)
        for value in _outside(bounds):
            value = value if isinstance(getattr(section, name), float) else int(value)
            with pytest.raises(
                ConfigError, match=rf"^{group}\.{name}: must be {bounds.describe()}"
            ):
                check_bounds(dataclasses.replace(section, **{name: value}), group)

    @pytest.mark.parametrize(("group", "name", "bounds"), BOUNDED, ids=lambda v: str(v))
    def test_a_value_on_an_inclusive_bound_is_accepted(
        self, group: str, name: str, bounds: Bounds
    ) -> None:
        section = getattr(AppConfig(), group)
        edges = [
            b
            for b, is_open in ((bounds.low, bounds.low_open), (bounds.high, bounds.high_open))
            if b is not None and not is_open
        ]
        for value in edges:
            check_bounds(dataclasses.replace(section, **{name: value}), group)

    def test_bounds_describe_their_range(self) -> None:
        assert Bounds(0, low_open=True).describe() == "> 0"
        assert Bounds(0, 10).describe() == ">= 0 and <= 10"
        assert not Bounds(0, 10).admits(math.nan)


class TestStructuredFields:
    def test_tuple_field_reads_comma_separated_text(self) -> None:
        config = load_config(environ={"SI_TRIGGER_HIGH_SIGNAL_TYPES": "add_to_cart, purchase,"})

        assert config.trigger.high_signal_types == ("add_to_cart", "purchase")

    def test_tuple_field_accepts_a_list(self) -> None:
        config = load_config(overrides={"job": {"jars": ["/opt/a.jar", "/opt/b.jar"]}}, environ={})

        assert config.job.jars == ("/opt/a.jar", "/opt/b.jar")

    def test_json_object_field_reads_json_text(self) -> None:
        config = load_config(
            environ={
                "SI_KAFKA_CLIENT_PROPERTIES": (
                    '{"security.protocol": "SASL_SSL", "sasl.mechanism": "AWS_MSK_IAM"}'
                )
            }
        )

        assert config.kafka.client_properties == {
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": "AWS_MSK_IAM",
        }

    def test_json_object_values_become_strings(self) -> None:
        config = load_config(
            overrides={"kafka": {"client_properties": {"request.timeout.ms": 30000}}}, environ={}
        )

        assert config.kafka.client_properties == {"request.timeout.ms": "30000"}


class TestSecrets:
    def test_secrets_never_appear_in_the_config_repr(self) -> None:
        config = load_config(
            overrides={
                "kafka": {"client_properties": '{"sasl.jaas.config": "password=\\"hunter2\\""}'},
                "redis": {"url": "rediss://:hunter2@cache.internal:6380/0"},
                "llm": {"api_key": "hunter2"},
            },
            environ={},
        )

        assert "hunter2" not in repr(config)
