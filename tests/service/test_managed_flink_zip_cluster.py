"""The Managed Flink zip on a standalone cluster of each runtime's Flink release, as
Managed Flink runs it, and the job's settings that matter there.

For each runtime of ``deploy.local_run.RUNTIMES`` (FLINK-2_2: Flink 2.2.1, FLINK-2_3:
Flink 2.3.0, from the apache-flink wheel of that release): the zip is built for this
interpreter, unpacked, and its ``main.py`` submitted with ``flink run -py`` to a JobManager
and a TaskManager of that release, the zip's ``pyFiles`` shipped to the TaskManager, the
Python being that release's PyFlink and the zip's folders only (``deploy.local_run``).
Against the session's broker and Redis and LLM stand-ins behind the router (the model is
not the subject): intents land, the metrics are registered under the group Managed Flink
forwards to CloudWatch (``KinesisAnalytics``) and no restart strategy comes from the job.

Without a cluster, the job's environment as PyFlink builds it on the py4j gateway: no
restart strategy unless ``job.restart_strategy`` names one.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from deploy.local_run import RUNTIMES, on_cluster, unpack
from flink_jobs.config import load_config
from flink_jobs.tools.local_services import create_topics, free_port
from flink_jobs.tools.replay import replay_records
from flink_jobs.tools.run_summary import read_stats
from intent_reader.layout import intent_key
from tests.support.job_process import job_groups
from tests.support.managed_flink import build_local_zip, shopper_events, write_properties
from tests.support.waiting import until

pytestmark = pytest.mark.timeout(25 * 60)

SHOPPERS = 5
#: A cluster of two JVMs starting beside other tests on two shared cores, then the job's
#: first fetch: 40-90 s seen; the other release is first installed (about a minute).
JOB_START_TIMEOUT_S = 420.0
INTENTS_TIMEOUT_S = 180.0
METRICS_TIMEOUT_S = 90.0
CLOUDWATCH_PREFIX = "flink_taskmanager_job_task_operator_KinesisAnalytics_"
PROMETHEUS_PREFIX = "flink_taskmanager_job_task_operator_shopper_intents_"


@pytest.fixture(scope="module")
def zip_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_local_zip(tmp_path_factory.mktemp("zip")).zip_path


def _properties(path: Path, name: str, kafka: str, redis_url: str, llm: dict) -> Path:
    groups = job_groups(name, kafka, redis_url, {k: str(v) for k, v in llm.items()})
    groups["trigger"] = {"quiet_s": "1", "max_wait_s": "2", "min_interval_s": "0"}
    groups["job"] = {"checkpoint_interval_s": "2", "stats_flush_s": "0.5", "parallelism": "0"}
    return write_properties(path, groups)


@dataclass
class ClusterRun:
    flink_version: str
    cluster_version: str
    intents: set[str]
    shoppers: set[str]
    metric_names: set[str]
    job_config: dict[str, str]


@pytest.fixture(scope="module", params=sorted(RUNTIMES), ids=sorted(RUNTIMES))
def cluster_run(
    request, zip_path, kafka_bootstrap, redis_url, standin_tier, tmp_path_factory
) -> ClusterRun:
    version = RUNTIMES[request.param]
    workdir = tmp_path_factory.mktemp(request.param)
    name = f"mf-{request.param.lower().replace('_', '')}-{time.monotonic_ns()}"
    app = unpack(zip_path, workdir, version)
    props = _properties(
        workdir / "props.json", name, kafka_bootstrap, redis_url, standin_tier.job_settings()
    )
    create_topics(kafka_bootstrap, [f"{name}-events", f"{name}-dlq"], 1)
    client = redis.Redis.from_url(redis_url)
    first = free_port()
    with on_cluster(
        app, {"SI_PROPERTIES_FILE": str(props)}, workdir / "cluster", range(first, first + 4)
    ) as (cluster, job_id):
        cluster.wait_running(job_id, timeout_s=JOB_START_TIMEOUT_S)
        until(
            lambda: read_stats(client, name).get("task_starts", 0) >= 1,
            "the job's source task to start",
            timeout_s=JOB_START_TIMEOUT_S,
            interval_s=0.2,
        )
        sent = replay_records(
            kafka_bootstrap, f"{name}-events", shopper_events(name, SHOPPERS), rate=40.0
        )
        assert sent.ok, sent.describe(f"{name}-events")
        shoppers = {f"{name}-shopper-{s}" for s in range(SHOPPERS)}

        def landed() -> set[str]:
            return {s for s in shoppers if client.exists(intent_key(s, name))}

        until(lambda: landed() == shoppers, "an intent for every shopper",
              timeout_s=INTENTS_TIMEOUT_S, interval_s=1,
              explain=lambda: (landed(), cluster.exceptions(job_id)))  # fmt: skip
        names = until(
            lambda: {n for n in cluster.scrape_metrics() if n.startswith(CLOUDWATCH_PREFIX)},
            "the job's metrics from the TaskManager's reporter",
            timeout_s=METRICS_TIMEOUT_S, interval_s=1,
            explain=lambda: sorted(n for n in cluster.scrape_metrics() if "events_in" in n),
        )  # fmt: skip
        every_name = set(cluster.scrape_metrics())
        entries = cluster._rest(f"/jobs/{job_id}/jobmanager/config") or []
        overview = cluster._rest("/overview") or {}
        run = ClusterRun(
            flink_version=version,
            cluster_version=overview.get("flink-version", ""),
            intents=landed(),
            shoppers=shoppers,
            metric_names=names | {n for n in every_name if n.startswith(PROMETHEUS_PREFIX)},
            job_config={e["key"]: e["value"] for e in entries},
        )
    client.close()
    return run


def test_the_cluster_runs_the_runtimes_flink_release(cluster_run: ClusterRun):
    assert cluster_run.cluster_version == cluster_run.flink_version


def test_the_zip_writes_an_intent_for_every_shopper(cluster_run: ClusterRun):
    assert cluster_run.intents == cluster_run.shoppers


def test_the_metrics_are_in_the_group_managed_flink_forwards_to_cloudwatch(
    cluster_run: ClusterRun,
):
    assert CLOUDWATCH_PREFIX + "events_in" in cluster_run.metric_names
    assert CLOUDWATCH_PREFIX + "intents_written_rules" in cluster_run.metric_names
    assert not {n for n in cluster_run.metric_names if n.startswith(PROMETHEUS_PREFIX)}


def test_the_job_leaves_the_restart_strategy_to_the_cluster(cluster_run: ClusterRun):
    assert cluster_run.job_config, "the JobManager reported no job configuration"
    assert not {k for k in cluster_run.job_config if k.startswith("restart-strategy")}


# --- the environment the job builds (py4j gateway, no cluster) ----------------------------


def _restart_settings(overrides: dict) -> dict[str, str]:
    from flink_jobs.job import build_environment

    env = build_environment(load_config(overrides=overrides, environ={}), [])
    settings = env._j_stream_execution_environment.getConfiguration().toMap()
    return {str(k): str(settings[k]) for k in settings if str(k).startswith("restart-strategy")}


def test_the_job_sets_no_restart_strategy_unless_configured():
    assert _restart_settings({}) == {}


def test_a_configured_restart_strategy_is_the_jobs():
    strategy = {"type": "fixed-delay", "fixed-delay.attempts": "10", "fixed-delay.delay": "10 s"}
    assert _restart_settings({"job": {"restart_strategy": json.dumps(strategy)}}) == {
        "restart-strategy.type": "fixed-delay",
        "restart-strategy.fixed-delay.attempts": "10",
        "restart-strategy.fixed-delay.delay": "10 s",
    }
