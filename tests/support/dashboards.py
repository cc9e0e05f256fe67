"""Reading the Grafana dashboards: the panels, their PromQL, the metric names and grouping
labels it reads. The unit tier checks the names against what the code registers
(tests/unit/test_observability_files.py); the service tier checks Flink's own against what
a real Prometheus reporter serves (tests/service/test_scale_out.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((REPO / "deploy/observability/grafana/dashboards").glob("*.json"))

#: Flink's Prometheus reporter names a user metric ``flink_<scope>_<group>_<name>``; for the
#: job's operators that is this prefix and the name (``flink_jobs/metrics.py``).
FLINK_PREFIX = "flink_taskmanager_job_task_operator_shopper_intents_"
#: Flink's own metrics the dashboard's scaling panels read, as the reporter names them:
#: the service tier scrapes a real standalone cluster for each of them.
FLINK_BUILTIN = frozenset(
    {
        # checkpoints (the JobManager, per job)
        "flink_jobmanager_job_lastCheckpointDuration",
        "flink_jobmanager_job_lastCheckpointSize",
        "flink_jobmanager_job_numberOfFailedCheckpoints",
        # busy and back-pressured time (per task, by task_name and subtask_index)
        "flink_taskmanager_job_task_busyTimeMsPerSecond",
        "flink_taskmanager_job_task_backPressuredTimeMsPerSecond",
        # the Kafka source: per reader subtask, and per topic and partition
        "flink_taskmanager_job_task_operator_pendingRecords",
        "flink_taskmanager_job_task_operator_KafkaSourceReader_KafkaConsumer_records_lag_max",
        "flink_taskmanager_job_task_operator_KafkaSourceReader_topic_partition_currentOffset",
        "flink_taskmanager_job_task_operator_KafkaSourceReader_topic_partition_committedOffset",
        # the cluster
        "flink_jobmanager_numRegisteredTaskManagers",
        "flink_jobmanager_taskSlotsAvailable",
        "flink_jobmanager_job_numRestarts",
    }
)

#: PromQL functions, aggregations and keywords (what is not a metric name in a query).
PROMQL_WORDS = {
    "abs", "and", "avg", "avg_over_time", "bool", "bottomk", "ceil", "clamp_max",
    "clamp_min", "count", "count_over_time", "delta", "deriv", "floor", "group_left",
    "group_right", "histogram_quantile", "idelta", "ignoring", "increase", "irate",
    "label_replace", "max", "max_over_time", "min", "min_over_time", "offset", "on", "or",
    "quantile", "quantile_over_time", "rate", "round", "scalar", "sort", "sort_desc", "sum",
    "sum_over_time", "time", "topk", "unless", "vector",
}  # fmt: skip


def dashboards() -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in DASHBOARDS]


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels") or [])  # collapsed rows keep theirs inside
    return out


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target."""
    return [
        (panel["title"], target["expr"])
        for panel in panels(dashboard)
        for target in panel.get("targets") or []
    ]


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # label values
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"(?<![\w:])\d+(\.\d+)?([eE][-+]?\d+)?", "", text)  # numbers
    return {t for t in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text) if t not in PROMQL_WORDS}


def flink_builtin_names_used() -> set[str]:
    """Flink's own metrics (not the job's) that some dashboard query reads."""
    return {
        name
        for dashboard in dashboards()
        for _title, expr in queries(dashboard)
        for name in metric_names(expr)
        if name.startswith("flink_") and not name.startswith(FLINK_PREFIX)
    }


def grouping_labels_used() -> dict[str, set[str]]:
    """Per metric name, the labels of the ``by (...)`` clauses of the queries that read it."""
    out: dict[str, set[str]] = {}
    for dashboard in dashboards():
        for _title, expr in queries(dashboard):
            labels = {
                label.strip()
                for group in re.findall(r"\bby\s*\(([^)]*)\)", expr)
                for label in group.split(",")
                if label.strip()
            }
            for name in metric_names(expr):
                out.setdefault(name, set()).update(labels)
    return out
