"""``job.restart_strategy``: empty unless configured (the cluster's strategy then applies),
Flink's restart-strategy settings as a JSON object otherwise, refused without a type."""

from __future__ import annotations

import pytest

from flink_jobs.config import ConfigError, load_config


def test_no_restart_strategy_by_default():
    assert load_config(environ={}).job.restart_strategy == {}


def test_a_configured_strategy_is_read_as_flinks_settings():
    environ = {"SI_JOB_RESTART_STRATEGY": '{"type": "fixed-delay", "fixed-delay.attempts": "10"}'}
    strategy = load_config(environ=environ).job.restart_strategy
    assert strategy == {"type": "fixed-delay", "fixed-delay.attempts": "10"}


def test_a_strategy_without_a_type_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"job\.restart_strategy"):
        load_config(environ={"SI_JOB_RESTART_STRATEGY": '{"fixed-delay.attempts": "10"}'})
