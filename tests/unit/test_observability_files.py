"""Static checks of the observability files (no Docker engine here to run them).

The promises: Prometheus scrapes only services and ports that docker-compose.yml has, and
scrapes every service that serves metrics; Flink's Prometheus reporter is configured for
the Flink services; Grafana's provisioning points at the mounted files and at a datasource
that exists; and every metric name a dashboard query reads is one the code registers
(derived from the code, so renaming a metric without the dashboard fails here) or one of
Flink's own (``tests.support.dashboards.FLINK_BUILTIN``, which the service tier checks against a
real reporter's scrape).
"""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from tests.support.compose_file import bind_mounts, command_argv
from tests.support.dashboards import (
    DASHBOARDS,
    FLINK_BUILTIN,
    FLINK_PREFIX,
    dashboards,
    flink_builtin_names_used,
    metric_names,
    panels,
    queries,
)

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
OBSERVABILITY = REPO / "deploy" / "observability"
PROMETHEUS_CONFIG = OBSERVABILITY / "prometheus.yml"
GRAFANA = OBSERVABILITY / "grafana"

PROM_FACTORY = "org.apache.flink.metrics.prometheus.PrometheusReporterFactory"
#: Series every Prometheus has without any exporter.
PROMETHEUS_BUILTIN = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


# --- reading the files -------------------------------------------------------------------


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


@pytest.fixture(scope="module")
def prometheus() -> dict[str, Any]:
    return yaml.safe_load(PROMETHEUS_CONFIG.read_text())


def flink_properties(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    text = env.get("FLINK_PROPERTIES", "") if isinstance(env, dict) else ""
    props = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip():
            props[key.strip()] = value.strip()
    return props


def _port_range(value: str) -> set[int]:
    low, _, high = str(value).partition("-")
    return set(range(int(low), int(high or low) + 1))


def listening_ports(service: dict[str, Any]) -> set[int]:
    """Ports a service listens on: published or exposed container ports, ``--port`` and
    ``--metrics-port`` in its command, and the ports of its Flink metric reporters."""
    ports: set[int] = set()
    for entry in service.get("ports") or []:
        target = entry.get("target") if isinstance(entry, dict) else str(entry).split(":")[-1]
        ports |= _port_range(str(target).split("/")[0])
    for entry in service.get("expose") or []:
        ports |= _port_range(str(entry).split("/")[0])
    argv = command_argv(service)
    for flag, value in itertools.pairwise(argv):
        if flag in ("--port", "--metrics-port") and value.isdigit():
            ports.add(int(value))
    for key, value in flink_properties(service).items():
        if re.fullmatch(r"metrics\.reporter\.[^.]+\.port", key):
            ports |= _port_range(value)
    return ports


def hosts(services: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Each name a service is reachable by on the compose network -> the services."""
    out: dict[str, list[str]] = {}
    for name, service in services.items():
        out.setdefault(name, []).append(name)
        networks = service.get("networks") or {}
        if isinstance(networks, dict):
            for network in networks.values():
                for alias in (network or {}).get("aliases") or []:
                    out.setdefault(alias, []).append(name)
    return out


def scrape_targets(prometheus: dict[str, Any]) -> list[tuple[str, str, int]]:
    """(job, host, port) of every static target and every name DNS service discovery
    resolves (each of its addresses becomes a target)."""
    out = []
    for job in prometheus["scrape_configs"]:
        for group in job.get("static_configs") or []:
            for target in group["targets"]:
                host, _, port = target.rpartition(":")
                out.append((job["job_name"], host, int(port)))
        for group in job.get("dns_sd_configs") or []:
            for name in group["names"]:
                out.append((job["job_name"], name, int(group["port"])))
    return out


def static_hosts(prometheus: dict[str, Any]) -> set[str]:
    return {
        target.rpartition(":")[0]
        for job in prometheus["scrape_configs"]
        for group in job.get("static_configs") or []
        for target in group["targets"]
    }


# --- what the code registers -------------------------------------------------------------


def _literal_names(call: ast.Call) -> set[str]:
    """The metric name(s) a ``count``/``_count``/``counter``/``meter``/``gauge`` call makes."""
    from flink_jobs.core.session import Outcome

    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return {arg.value}
    # f"events_{outcome.value}": one name per session.Outcome (timeline.py counts these).
    if isinstance(arg, ast.JoinedStr) and len(arg.values) == 2:
        prefix, formatted = arg.values
        if (
            isinstance(prefix, ast.Constant)
            and prefix.value == "events_"
            and isinstance(formatted, ast.FormattedValue)
            and isinstance(formatted.value, ast.Attribute)
            and formatted.value.attr == "value"
        ):
            return {f"events_{o.value}" for o in Outcome}
    return set()  # other dynamic names (dead-letter reasons...) are not for dashboards


def flink_metric_names() -> set[str]:
    """Prometheus names of the job's Flink metrics: what the operators count (directly or
    through ``timeline``'s step counts) and the async operator's gauges."""
    from flink_jobs.metrics import gauge_names
    from flink_jobs.operators import INFER_COUNTS, INFER_TIMINGS

    names = set(gauge_names(INFER_COUNTS, INFER_TIMINGS))
    for path in sorted((REPO / "flink_jobs").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in {"count", "_count", "counter", "meter", "gauge"}
                and node.args
            ):
                names |= _literal_names(node)
    return {FLINK_PREFIX + name for name in names}


def registry_names(registry: Any) -> set[str]:
    """Series names a prometheus_client registry exposes, labelled series included."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("_sum", "_count", "_created", ""),
        "gauge": ("",),
    }
    return {
        family.name + suffix
        for family in registry.collect()
        for suffix in suffixes.get(family.type, ("",))
    }


def router_metric_names() -> set[str]:
    from inference_sidecar.metrics import RouterMetrics

    return registry_names(RouterMetrics().registry)


def replay_metric_names() -> set[str]:
    from flink_jobs.tools.replay import ReplayMetrics

    return registry_names(ReplayMetrics().registry)


def vllm_metric_names() -> set[str] | None:
    """Names vLLM's Prometheus logger registers, read from the installed vLLM (None if the
    LLM venv is not set up)."""
    found = sorted(REPO.glob(".cache/vllm-venv/lib/python*/site-packages/vllm/v1/metrics/*.py"))
    if not found:
        return None
    names = set()
    for path in found:
        for base in re.findall(r'name="(vllm:[a-z0-9_:]+)"', path.read_text()):
            names |= {base + s for s in ("", "_total", "_bucket", "_sum", "_count", "_created")}
    return names


def known_metric_names() -> set[str]:
    return (
        flink_metric_names()
        | FLINK_BUILTIN
        | router_metric_names()
        | replay_metric_names()
        | PROMETHEUS_BUILTIN
    )


# --- Prometheus --------------------------------------------------------------------------


def test_prometheus_config_parses(prometheus: dict[str, Any]) -> None:
    assert prometheus["scrape_configs"], "no scrape jobs"
    jobs = [job["job_name"] for job in prometheus["scrape_configs"]]
    assert len(jobs) == len(set(jobs)), f"duplicate job names: {jobs}"


def test_every_scrape_target_is_a_compose_service_and_port(services, prometheus) -> None:
    by_host = hosts(services)
    for job, host, port in scrape_targets(prometheus):
        assert host in by_host, f"{job}: {host} is no service or network alias in the compose file"
        for name in by_host[host]:
            assert port in listening_ports(services[name]), (
                f"{job}: {name} does not listen on {port} (it does on "
                f"{sorted(listening_ports(services[name]))})"
            )


def test_every_metrics_endpoint_is_scraped(services, prometheus) -> None:
    scraped = {(host, port) for _job, host, port in scrape_targets(prometheus)}
    by_host = hosts(services)
    scraped_services = {name for host, _ in scraped for name in by_host.get(host, [])}
    for name, service in services.items():
        argv = command_argv(service)
        serves = (
            (
                any(k.startswith("metrics.reporter.") for k in flink_properties(service))
                and name != "job-submit"  # a client: no cluster metrics of its own
            )
            or "vllm" in str(service.get("image", ""))
            or argv[:4] == ["python", "-m", "inference_sidecar", "router"]
            or "--metrics-port" in argv
        )
        if serves:
            assert name in scraped_services, f"{name} serves metrics but is not scraped"


def test_replicated_services_are_scraped_per_replica(services, prometheus) -> None:
    """A service with replicas answers on its name from one replica at a time: a static
    target would flap between them under one ``instance``. DNS service discovery (type A)
    makes each replica's address a target of its own."""
    replicated = {n for n, s in services.items() if (s.get("deploy") or {}).get("replicas")}
    assert "taskmanager" in replicated
    discovered = {
        name
        for job in prometheus["scrape_configs"]
        for group in job.get("dns_sd_configs") or []
        if group.get("type", "SRV") == "A"
        for name in group["names"]
    }
    assert replicated <= discovered, f"not discovered per replica: {replicated - discovered}"
    assert not replicated & static_hosts(prometheus), "a replicated service is a static target"


def test_flink_services_run_the_prometheus_reporter(services, prometheus) -> None:
    flink_ports = {port for job, _h, port in scrape_targets(prometheus) if job == "flink"}
    for name in ("jobmanager", "taskmanager"):
        props = flink_properties(services[name])
        assert props.get("metrics.reporter.prom.factory.class") == PROM_FACTORY, name
        assert _port_range(props["metrics.reporter.prom.port"]) & flink_ports, name
    dockerfile = (REPO / "Dockerfile.flink").read_text()
    assert "plugins/metrics-prometheus" in dockerfile, "the image should check the plugin jar"


# --- Grafana -----------------------------------------------------------------------------


def _mount_target(service: dict[str, Any], source: Path) -> PurePosixPath:
    for host, target in bind_mounts(service):
        if (REPO / host).resolve() == source.resolve():
            return target
    raise AssertionError(f"{source.relative_to(REPO)} is not mounted into grafana")


def test_grafana_mounts_what_its_provisioning_names(services) -> None:
    grafana = services["grafana"]
    assert _mount_target(grafana, GRAFANA / "provisioning") == PurePosixPath(
        "/etc/grafana/provisioning"
    )
    dashboards_dir = _mount_target(grafana, GRAFANA / "dashboards")
    providers = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "shopper-intents.yml").read_text()
    )["providers"]
    assert [PurePosixPath(p["options"]["path"]) for p in providers] == [dashboards_dir]
    assert DASHBOARDS, "no dashboard JSON"


def test_the_datasource_is_the_compose_prometheus(services) -> None:
    config = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )
    (source,) = config["datasources"]
    host, _, port = source["url"].removeprefix("http://").partition(":")
    assert host in services and int(port) in listening_ports(services[host])
    assert source["type"] == "prometheus" and source["uid"]


def test_dashboards_parse_and_use_the_provisioned_datasource() -> None:
    config = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )
    uids = {source["uid"] for source in config["datasources"]}
    for dashboard in dashboards():
        assert dashboard["uid"] and dashboard["title"]
        ids = [panel["id"] for panel in panels(dashboard)]
        assert len(ids) == len(set(ids)), "panel ids must be unique"
        for panel in panels(dashboard):
            grid = panel["gridPos"]
            assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
            if panel["type"] == "row":
                continue
            assert panel.get("targets"), f"{panel['title']}: no query"
            for target in panel["targets"]:
                for ref in (panel.get("datasource"), target.get("datasource")):
                    assert ref and ref["uid"] in uids, f"{panel['title']}: datasource {ref}"


# --- metric names ------------------------------------------------------------------------


def test_name_extraction_finds_metrics_not_functions_or_labels() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, endpoint) (rate(x_seconds_bucket{job="r"}[5m])))'
        " / sum(rate(vllm:hits_total[1m])) * 1e-3"
    )
    assert metric_names(expr) == {"x_seconds_bucket", "vllm:hits_total"}


def test_the_check_catches_a_renamed_metric() -> None:
    known = known_metric_names()
    assert FLINK_PREFIX + "intents_written" in known
    assert FLINK_PREFIX + "intents_writen" not in known
    assert "inference_sidecar_worker_requests_total" in known
    assert "inference_sidecar_worker_request_total" not in known


def test_dashboard_queries_read_only_metrics_the_code_registers() -> None:
    known = known_metric_names()
    unknown = []
    for dashboard in dashboards():
        for title, expr in queries(dashboard):
            names = metric_names(expr)
            assert names, f"{title}: {expr!r} reads no metric"
            for name in names:
                if name.startswith("vllm:"):
                    continue  # test_dashboard_vllm_names_exist
                if name not in known:
                    unknown.append(f"{title}: {name}")
    assert not unknown, "dashboard metrics no code registers:\n" + "\n".join(unknown)


def test_the_flink_builtin_list_is_exactly_what_the_dashboard_reads() -> None:
    """The service tier scrapes a real reporter for each name of the list: a name the
    dashboard stopped reading would be checked for nothing."""
    assert flink_builtin_names_used() == FLINK_BUILTIN


def test_dashboard_vllm_names_exist() -> None:
    vllm = vllm_metric_names()
    if vllm is None:
        pytest.skip("vLLM is not installed (.cache/vllm-venv): run scripts/setup.sh")
    used = {
        name
        for dashboard in dashboards()
        for _title, expr in queries(dashboard)
        for name in metric_names(expr)
        if name.startswith("vllm:")
    }
    assert used, "the dashboard should show the vLLM prefix-cache hit ratio"
    assert used <= vllm, f"not registered by vLLM: {sorted(used - vllm)}"


def test_dashboard_covers_the_pipeline_and_router_metrics() -> None:
    used = {
        name
        for dashboard in dashboards()
        for _title, expr in queries(dashboard)
        for name in metric_names(expr)
    }
    wanted = {
        FLINK_PREFIX + name
        for name in (
            "events_in",
            "events_accepted",
            "dead_letter_decode",
            "events_late_folded",
            "events_late_dropped",
            "prompts_sent",
            "prompts_superseded",
            "prompts_skipped_unchanged",
            "intents_written",
            "llm_latency_ms_p95",
            "event_to_intent_ms_p95",
        )
    } | {
        "inference_sidecar_worker_requests_total",
        "inference_sidecar_worker_in_flight",
        "inference_sidecar_worker_errors_total",
        "inference_sidecar_routing_decisions_total",
        "inference_sidecar_ejections_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
    }
    assert wanted <= used, f"missing from the dashboard: {sorted(wanted - used)}"
