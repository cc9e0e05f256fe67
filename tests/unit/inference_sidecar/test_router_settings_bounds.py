"""Numbers the router cannot work with (NaN, infinities, negatives, zero where a positive
is needed) are refused at start, on the command line with the flag's name and in
``RouterConfig`` with the key's, instead of starting a router that misbehaves."""

from __future__ import annotations

import math

import pytest

from inference_sidecar import cli
from inference_sidecar.config import RouterConfig
from inference_sidecar.exceptions import ConfigError

A = "http://127.0.0.1:9001"

#: flag -> values it must refuse
ROUTER_FLAGS = {
    "--port": ["0", "-1", "70000"],
    "--load-factor": ["nan", "inf", "0.5", "-1"],
    "--residency-factor": ["nan", "inf", "0", "-2"],
    "--min-load-bound": ["0", "-3"],
    "--recompute-weight": ["nan", "inf", "-1"],
    "--request-cost": ["-1"],
    "--kv-stale-after": ["nan", "inf", "0", "-5"],
    "--max-attempts": ["0", "-1"],
    "--request-timeout": ["nan", "inf", "0", "-1"],
    "--body-timeout": ["nan", "inf", "0", "-1"],
    "--max-concurrent-requests": ["0", "-1"],
    "--health-interval": ["nan", "inf", "-1"],
    "--max-body-bytes": ["0", "-1", "100"],
    "--max-model-len": ["0", "-1"],
    "--kv-block-size": ["0", "-16"],
    "--tokenizer-workers": ["-1"],
    "--admin-port": ["0", "-1", "70000"],
    "--load-view": ["both", ""],
    "--load-poll-interval": ["nan", "inf", "0", "-1"],
}
CLUSTER_FLAGS = {
    "--workers": ["0", "-1"],
    "--prefill-workers": ["0"],
    "--decode-workers": ["-2"],
    "--base-port": ["0", "-1"],
    "--max-model-len": ["0", "-4096"],
    "--kv-cache-bytes": ["0", "-1"],
    "--ready-timeout": ["nan", "inf", "0", "-1"],
    "--cores": ["-1", "0,-2"],
}


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value"), [(f, v) for f, values in ROUTER_FLAGS.items() for v in values]
)
def test_a_router_flag_refuses_a_value_it_cannot_use_and_names_itself(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(["router", "--worker", A, f"{flag}={value}"], capsys)
    assert f"argument {flag}" in err


@pytest.mark.parametrize(
    ("flag", "value"), [(f, v) for f, values in CLUSTER_FLAGS.items() for v in values]
)
def test_a_cluster_flag_refuses_a_value_it_cannot_use_and_names_itself(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(["cluster", f"{flag}={value}"], capsys)
    assert f"argument {flag}" in err


def test_zero_still_turns_health_checks_off() -> None:
    args = cli.build_parser().parse_args(["router", "--health-interval", "0"])
    assert cli.router_config(args, workers=(A,)).health_interval_s == 0


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("request_timeout_s", math.nan),
        ("request_timeout_s", math.inf),
        ("connect_timeout_s", math.nan),
        ("connect_timeout_s", 0.0),
        ("body_timeout_s", 0.0),
        ("body_timeout_s", math.nan),
        ("health_interval_s", -1.0),
        ("health_interval_s", math.nan),
        ("health_timeout_s", 0.0),
        ("health_timeout_s", math.nan),
        ("load_factor", math.inf),
        ("residency_factor", math.inf),
        ("recompute_weight", math.inf),
        ("min_load_bound", 0),
        ("max_connections", 0),
        ("kv_stale_after_s", math.nan),
        ("kv_stale_after_s", 0.0),
        ("max_model_len", 0),
        ("kv_block_size", 0),
        ("tokenizer_workers", -1),
        ("admin_port", 0),
        ("load_poll_interval_s", 0.0),
        ("load_poll_interval_s", math.nan),
        ("load_view", "both"),
    ],
)
def test_the_config_refuses_a_value_it_cannot_use_and_names_the_key(key: str, value: float) -> None:
    with pytest.raises(ConfigError) as err:
        RouterConfig(workers=(A,), **{key: value})
    assert err.value.key == key
