"""The operators register their metrics under ``job.metric_group``: ``KinesisAnalytics``
from the Managed Flink zip, which forwards only that group's metrics to CloudWatch, and
``shopper_intents`` by default, which keeps the Prometheus names the dashboards read."""

from __future__ import annotations

from flink_jobs.config import AppConfig
from flink_jobs.metrics import CLOUDWATCH_METRIC_GROUP, METRIC_GROUP
from flink_jobs.operators import DecodeEvents


class Group:
    def __init__(self, path: tuple[str, ...] = ()) -> None:
        self.path = path
        self.gauges: dict[tuple[str, ...], list[str]] = {}

    def add_group(self, name: str, extra: str | None = None) -> Group:
        child = Group((*self.path, name) if extra is None else (*self.path, f"{name}={extra}"))
        child.gauges = self.gauges
        return child

    def gauge(self, name: str, obj) -> None:
        self.gauges.setdefault(self.path, []).append(name)


class Stats:
    def add(self, name: str, amount: int = 1) -> None:
        pass


class Context:
    def __init__(self, parameters: dict[str, str]) -> None:
        self.parameters = parameters
        self.group = Group()

    def get_job_parameter(self, key: str, default_value: str) -> str:
        return self.parameters.get(key, default_value)

    def get_metrics_group(self) -> Group:
        return self.group


def _registered(group: str) -> dict[tuple[str, ...], list[str]]:
    config = AppConfig().with_overrides({"job": {"metric_group": group}})
    operator = DecodeEvents(config)
    ctx = Context({})
    operator._open_counters(ctx, config)
    operator._retire_stats.detach()  # the Redis stats are not the subject: never flushed
    operator._stats = Stats()
    operator._count("events_in")
    return ctx.group.gauges


def test_on_managed_flink_the_metrics_are_in_the_cloudwatch_group():
    gauges = _registered(CLOUDWATCH_METRIC_GROUP)
    assert gauges == {("KinesisAnalytics",): ["events_in"]}


def test_elsewhere_the_metrics_keep_their_prometheus_group():
    assert _registered("") == {(METRIC_GROUP,): ["events_in"]}
    assert METRIC_GROUP == "shopper_intents"
