"""A standalone Flink cluster on one machine: a JobManager and N TaskManagers as local
processes, started from the scripts the PyFlink distribution ships (``pyflink/bin``).

This is how Managed Flink and docker-compose run the job: a long-lived cluster, the job
submitted to it with ``flink run -py``, each TaskManager its own JVM with its own Python
interpreter (thread mode embeds one per TaskManager), so what a single mini-cluster hides
(several subtasks, state split by key group, one TaskManager dying) happens for real.

- Its own configuration folder (``config.yaml`` + log4j files) under ``workdir``, so
  nothing touches the installed ``pyflink/conf``; every port on loopback, picked free.
- Each process runs in the foreground (``jobmanager.sh start-foreground``) as a
  ``LocalProcess``: its own process group, its output in ``workdir/logs``, stopped with
  SIGTERM then SIGKILL, so no daemon pid file in ``/tmp`` is shared with anyone.
- ``submit`` runs ``flink run -d -p P -py <module file>`` (``-s`` to restore a savepoint)
  and returns the job id; ``stop_with_savepoint``, ``status`` and ``cancel`` use the
  REST API; ``kill_taskmanager`` is a crash (SIGKILL), ``add_taskmanager`` a replacement.
- ``ClusterSpec.reporter_ports`` turns on Flink's Prometheus reporter in every process, and
  ``scrape_metrics`` reads what they serve: the series the Grafana dashboard queries.

Errors: ``ServiceStartError`` (a process exited or never became ready, with its log's
tail) and ``ClusterError`` (a submission or a savepoint failed, with what Flink said).
Nothing here imports PyFlink (it only locates its folder), and nothing happens at import.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx
from prometheus_client.parser import text_string_to_metric_families

from flink_jobs.tools.local_services import (
    LOOPBACK,
    LocalProcess,
    ServiceError,
    ServiceNotInstalledError,
    free_port,
)

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 90.0
SUBMIT_TIMEOUT_S = 180.0
SAVEPOINT_TIMEOUT_S = 120.0
#: A killed TaskManager is noticed through its heartbeat: Flink's default (50 s) would make
#: every crash test wait most of a minute before the job restarts.
HEARTBEAT_INTERVAL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 8000
PROMETHEUS_REPORTER = "org.apache.flink.metrics.prometheus.PrometheusReporterFactory"
_JOB_ID = re.compile(r"JobID ([0-9a-f]{32})")


class ClusterError(ServiceError):
    """A job submission, savepoint or REST call failed; the message says what Flink said."""


def flink_home() -> Path:
    """The Flink distribution inside the installed ``pyflink`` package (found, not imported)."""
    spec = importlib.util.find_spec("pyflink")
    if spec is None or not spec.submodule_search_locations:
        raise ServiceNotInstalledError("pyflink", "not importable: run scripts/setup.sh")
    home = Path(next(iter(spec.submodule_search_locations)))
    if not (home / "bin" / "jobmanager.sh").is_file():
        raise ServiceNotInstalledError("Flink's scripts", str(home / "bin"))
    return home


@dataclass(frozen=True)
class ClusterSpec:
    """The cluster's shape. One slot per TaskManager: in thread mode every slot of a
    TaskManager shares its one interpreter (and its GIL), so a second slot adds no CPU."""

    taskmanagers: int = 2
    slots_per_taskmanager: int = 1
    jobmanager_memory: str = "1024m"
    taskmanager_memory: str = "1280m"
    python_executable: str = sys.executable
    #: Flink's Prometheus reporter in every process, each on the first free port of this
    #: range (as docker-compose configures it).
    reporter_ports: range | None = None
    extra: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.taskmanagers < 1 or self.slots_per_taskmanager < 1:
            raise ValueError("a cluster needs at least one TaskManager with one slot")
        if self.reporter_ports is not None and len(self.reporter_ports) < self.taskmanagers + 1:
            raise ValueError("the reporter's port range needs a port per process")


def distribution_java_opts(config_yaml: str) -> str:
    """``env.java.opts.all`` of the distribution's own ``config.yaml``: the ``--add-opens``
    Flink needs on Java 17 (without them ``flink run`` fails in its first reflection)."""
    found = re.search(r"^\s+all:\s*(--add-\S.*)$", config_yaml, re.MULTILINE)
    if found is None:
        raise ServiceError("no env.java.opts.all in the distribution's config.yaml")
    return found.group(1).strip()


def cluster_settings(
    spec: ClusterSpec, rpc_port: int, rest_port: int, blob_port: int, java_opts: str = ""
) -> dict[str, Any]:
    """``config.yaml``'s settings: loopback only, the given ports for the JobManager, any
    free port for the TaskManagers, fast failure detection, the app venv's Python."""
    return {
        "env.java.opts.all": java_opts,
        "jobmanager.rpc.address": LOOPBACK,
        "jobmanager.rpc.port": rpc_port,
        "jobmanager.bind-host": LOOPBACK,
        "jobmanager.memory.process.size": spec.jobmanager_memory,
        "rest.address": LOOPBACK,
        "rest.bind-address": LOOPBACK,
        "rest.port": rest_port,
        "blob.server.port": blob_port,
        "taskmanager.host": LOOPBACK,
        "taskmanager.bind-host": LOOPBACK,
        "taskmanager.rpc.port": 0,
        "taskmanager.data.port": 0,
        "taskmanager.numberOfTaskSlots": spec.slots_per_taskmanager,
        "taskmanager.memory.process.size": spec.taskmanager_memory,
        "heartbeat.interval": HEARTBEAT_INTERVAL_MS,
        "heartbeat.timeout": HEARTBEAT_TIMEOUT_MS,
        "python.executable": spec.python_executable,
        "python.client.executable": spec.python_executable,
        "parallelism.default": 1,
        **(_reporter_settings(spec.reporter_ports) if spec.reporter_ports else {}),
        **dict(spec.extra),
    }


def _reporter_settings(ports: range) -> dict[str, str]:
    return {
        "metrics.reporter.prom.factory.class": PROMETHEUS_REPORTER,
        "metrics.reporter.prom.port": f"{ports.start}-{ports.stop - 1}",
    }


def render_config(settings: Mapping[str, object]) -> str:
    """Flat ``key: value`` lines (Flink 2's YAML reader takes dotted keys)."""
    return "".join(f"{key}: {_yaml_scalar(value)}\n" for key, value in settings.items())


def _yaml_scalar(value: object) -> str:
    text = str(value)
    return text if re.fullmatch(r"[\w./:@-]+", text) else "'" + text.replace("'", "''") + "'"


def job_script() -> Path:
    """The job's main file, ``flink_jobs/job.py``, as ``flink run -py`` takes it."""
    spec = importlib.util.find_spec("flink_jobs.job")
    if spec is None or spec.origin is None:
        raise ServiceNotInstalledError("flink_jobs.job", "not importable")
    return Path(spec.origin)


def settings_env(groups: Mapping[str, Mapping[str, object]]) -> dict[str, str]:
    """``{group: {field: value}}`` as the ``SI_<GROUP>_<FIELD>`` variables ``config.py``
    reads: how a submitted job gets its settings (the driver process reads them)."""
    return {
        f"SI_{group.upper()}_{name.upper()}": (
            json.dumps(dict(value)) if isinstance(value, Mapping) else str(value)
        )
        for group, fields in groups.items()
        for name, value in fields.items()
    }


def parse_job_id(output: str) -> str | None:
    """The job id ``flink run -d`` prints (``Job has been submitted with JobID <hex>``)."""
    found = _JOB_ID.search(output)
    return found.group(1) if found else None


class FlinkCluster:
    """A JobManager and ``spec.taskmanagers`` TaskManagers on loopback (context manager)."""

    def __init__(self, workdir: Path, spec: ClusterSpec | None = None) -> None:
        self.spec = spec or ClusterSpec()
        self.workdir = Path(workdir)
        self.conf_dir = self.workdir / "conf"
        self.log_dir = self.workdir / "logs"
        self.lib_dir = self.workdir / "lib"
        self.home = flink_home()
        self.rest_port = free_port()
        self.jobmanager: LocalProcess | None = None
        self.taskmanagers: list[LocalProcess] = []
        self._started_tms = 0

    @property
    def rest_url(self) -> str:
        return f"http://{LOOPBACK}:{self.rest_port}"

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> Self:
        if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
            raise ServiceNotInstalledError("java", "not on PATH and JAVA_HOME unset")
        self._write_conf()
        try:
            self.jobmanager = self._process("jobmanager", "jobmanager.sh")
            self.jobmanager.start()
            self.jobmanager.wait_ready(lambda: self._rest("/overview") is not None, READY_TIMEOUT_S)
            for _ in range(self.spec.taskmanagers):
                self.add_taskmanager(wait=False)
            self.wait_taskmanagers(self.spec.taskmanagers)
        except BaseException:
            self.stop()
            raise
        log.info(
            "Flink cluster up at %s: %d TaskManager(s) x %d slot(s)",
            self.rest_url,
            self.spec.taskmanagers,
            self.spec.slots_per_taskmanager,
        )
        return self

    def add_taskmanager(self, wait: bool = True) -> LocalProcess:
        """Start one more TaskManager (a replacement after a crash, or a scale-out)."""
        self._started_tms += 1
        process = self._process(f"taskmanager-{self._started_tms}", "taskmanager.sh")
        process.start()
        self.taskmanagers.append(process)
        if wait:
            self.wait_taskmanagers(len(self.live_taskmanagers()))
        return process

    def live_taskmanagers(self) -> list[LocalProcess]:
        return [tm for tm in self.taskmanagers if tm.running]

    def wait_taskmanagers(self, count: int, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until ``count`` TaskManagers are registered; fails fast if one exits."""
        deadline = time.monotonic() + timeout_s
        while True:
            for tm in self.taskmanagers:
                if tm.returncode is not None and tm.returncode > 0:
                    raise ClusterError(f"{tm.name} exited ({tm.returncode}):\n{tm.log_tail()}")
            registered = self._rest("/taskmanagers")
            if registered is not None and len(registered["taskmanagers"]) >= count:
                return
            if time.monotonic() >= deadline:
                raise ClusterError(
                    f"{count} TaskManager(s) not registered after {timeout_s:.0f} s; see "
                    f"{self.log_dir}"
                )
            time.sleep(0.3)

    def kill_taskmanager(self, index: int = 0) -> LocalProcess:
        """SIGKILL a live TaskManager's process group (its JVM, its interpreter, the call
        process): a crash, with no final checkpoint and no goodbye to the JobManager."""
        victim = self.live_taskmanagers()[index]
        victim.kill()
        log.info("killed %s", victim.name)
        return victim

    def stop(self) -> None:
        """TaskManagers first (their tasks end), then the JobManager; each SIGTERM then
        SIGKILL, so nothing outlives the cluster even when it is wedged."""
        for tm in self.taskmanagers:
            tm.terminate()
        for tm in self.taskmanagers:
            tm.stop(timeout_s=20)
        if self.jobmanager is not None:
            self.jobmanager.stop(timeout_s=20)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- jobs ----------------------------------------------------------------------------

    def submit(
        self,
        script: Path,
        env: Mapping[str, str],
        parallelism: int,
        savepoint: str | None = None,
        log_name: str = "submit",
    ) -> str:
        """``flink run -d -p P -py script`` (``-s savepoint`` to restore one) with ``env``
        added to the client's environment (the job's settings); returns the job id."""
        argv = [
            str(self.home / "bin" / "flink"), "run", "-d",
            "-p", str(parallelism),
            "-pyclientexec", self.spec.python_executable,
            "-pyexec", self.spec.python_executable,
        ]  # fmt: skip
        if savepoint:
            argv += ["-s", savepoint]
        argv += ["-py", str(script)]
        out_path = self.log_dir / f"{log_name}.log"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with out_path.open("wb") as out:
            done = subprocess.run(
                argv,
                env={**os.environ, **self._env(), **env},
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=SUBMIT_TIMEOUT_S,
                check=False,
            )
        output = out_path.read_text(errors="replace")
        job_id = parse_job_id(output)
        if done.returncode != 0 or job_id is None:
            raise ClusterError(
                f"flink run exited with {done.returncode} and no job id; its output "
                f"({out_path}) ends:\n{output[-4000:]}"
            )
        log.info("submitted job %s at parallelism %d", job_id, parallelism)
        return job_id

    def status(self, job_id: str) -> str:
        found = self._rest(f"/jobs/{job_id}")
        return found["state"] if found else "UNKNOWN"

    def job(self, job_id: str) -> dict[str, Any]:
        return self._rest(f"/jobs/{job_id}") or {}

    def wait_running(self, job_id: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until every task of the job runs (a restored job first deploys, then restores)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.job(job_id)
            if found.get("state") in ("FAILED", "CANCELED", "FINISHED"):
                raise ClusterError(f"job {job_id} is {found['state']}: {self.exceptions(job_id)}")
            vertices = found.get("vertices") or []
            if vertices and all(v.get("status") == "RUNNING" for v in vertices):
                return
            time.sleep(0.3)
        raise ClusterError(f"job {job_id} not running after {timeout_s:.0f} s")

    def placement(self, job_id: str) -> dict[str, list[str]]:
        """Each operator chain's subtasks' TaskManagers (their process names), by vertex
        name, as the REST API reports the job's current attempt."""
        hosts = {}
        for vertex in self.job(job_id).get("vertices", []):
            found = self._rest(f"/jobs/{job_id}/vertices/{vertex['id']}") or {}
            hosts[vertex["name"]] = [s["taskmanager-id"] for s in found.get("subtasks", [])]
        return hosts

    def taskmanager_running(self, job_id: str, vertex_prefix: str) -> LocalProcess:
        """The live TaskManager that runs the job's one subtask of the vertex whose name
        starts with ``vertex_prefix`` (a job at parallelism 1)."""
        names = {
            host
            for vertex, hosts in self.placement(job_id).items()
            if vertex.startswith(vertex_prefix)
            for host in hosts
        }
        running = [tm for tm in self.live_taskmanagers() if tm.name in names]
        if len(running) != 1:
            raise ClusterError(
                f"{vertex_prefix!r} of job {job_id} runs on {sorted(names) or 'no'} "
                f"TaskManager(s), of which {len(running)} live: {self.placement(job_id)}"
            )
        return running[0]

    def exceptions(self, job_id: str) -> str:
        found = self._rest(f"/jobs/{job_id}/exceptions") or {}
        history = found.get("exceptionHistory", {}).get("entries") or []
        return "\n".join(e.get("stacktrace", "")[:2000] for e in history[:3]) or "(none)"

    def stop_with_savepoint(
        self, job_id: str, target_dir: Path, timeout_s: float = SAVEPOINT_TIMEOUT_S
    ) -> str:
        """Stop the job with a savepoint (what Managed Flink does before a rescale) and
        return the savepoint's path."""
        body = {"targetDirectory": target_dir.resolve().as_uri(), "drain": False}
        response = httpx.post(f"{self.rest_url}/jobs/{job_id}/stop", json=body, timeout=10)
        if response.status_code >= 300:
            raise ClusterError(f"stop-with-savepoint of {job_id}: {response.text}")
        trigger = response.json()["request-id"]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self._rest(f"/jobs/{job_id}/savepoints/{trigger}") or {}
            if found.get("status", {}).get("id") == "COMPLETED":
                operation = found.get("operation", {})
                if "failure-cause" in operation:
                    raise ClusterError(f"savepoint of {job_id} failed: {operation}")
                self._wait_ended(job_id, deadline)
                return str(operation["location"])
            time.sleep(0.3)
        raise ClusterError(f"savepoint of {job_id} not done after {timeout_s:.0f} s")

    def _wait_ended(self, job_id: str, deadline: float) -> None:
        """Until the stopped job's tasks have closed (its operators flush what they hold)."""
        while self.status(job_id) not in ("FINISHED", "CANCELED", "FAILED"):
            if time.monotonic() >= deadline:
                raise ClusterError(f"job {job_id} still {self.status(job_id)} after its savepoint")
            time.sleep(0.2)

    def scrape_metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        """Every series the processes' Prometheus reporters serve: name -> (labels, value)
        (empty without ``ClusterSpec.reporter_ports``). A port in the range that answers
        something else (another service took it) is skipped."""
        series: dict[str, list[tuple[dict[str, str], float]]] = {}
        for port in self.spec.reporter_ports or ():
            try:
                response = httpx.get(f"http://{LOOPBACK}:{port}/metrics", timeout=5)
                families = list(text_string_to_metric_families(response.text))
            except (httpx.HTTPError, ValueError):
                continue
            for family in families:
                for sample in family.samples:
                    series.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
        return series

    def cancel(self, job_id: str) -> None:
        httpx.patch(f"{self.rest_url}/jobs/{job_id}?mode=cancel", timeout=10)

    # --- internals -------------------------------------------------------------------------

    def _write_lib(self) -> None:
        """The cluster's classpath: the distribution's ``lib`` plus ``opt/flink-python``
        (the Python operators' runtime, which the pip package leaves out of ``lib``: the
        JobManager cannot even read a Python job's graph without it), linked, not copied."""
        self.lib_dir.mkdir(parents=True, exist_ok=True)
        jars = [*(self.home / "lib").glob("*.jar"), *(self.home / "opt").glob("flink-python*.jar")]
        for jar in jars:
            link = self.lib_dir / jar.name
            if not link.exists():
                link.symlink_to(jar)

    def _write_conf(self) -> None:
        self._write_lib()
        self.conf_dir.mkdir(parents=True, exist_ok=True)
        for name in ("log4j-console.properties", "log4j-cli.properties", "log4j.properties"):
            shutil.copy(self.home / "conf" / name, self.conf_dir / name)
        java_opts = distribution_java_opts((self.home / "conf" / "config.yaml").read_text())
        settings = cluster_settings(self.spec, free_port(), self.rest_port, free_port(), java_opts)
        (self.conf_dir / "config.yaml").write_text(render_config(settings))

    def _env(self) -> dict[str, str]:
        """Flink's scripts find their home with ``python`` from PATH: the app venv's first."""
        venv_bin = str(Path(self.spec.python_executable).parent)
        return {
            "PATH": os.pathsep.join([venv_bin, os.environ.get("PATH", "")]),
            "FLINK_HOME": str(self.home),
            "FLINK_CONF_DIR": str(self.conf_dir),
            "FLINK_LIB_DIR": str(self.lib_dir),
            "FLINK_LOG_DIR": str(self.log_dir),
            "FLINK_PID_DIR": str(self.workdir / "pids"),
        }

    def _process(self, name: str, script: str) -> LocalProcess:
        argv = [str(self.home / "bin" / script), "start-foreground"]
        if script == "taskmanager.sh":
            # Flink's id of the TaskManager is its process's name, so the job's placement
            # (``taskmanager_running``) maps to a process here.
            argv.append(f"-Dtaskmanager.resource-id={name}")
        return LocalProcess(name, argv, self.log_dir / f"{name}.out", env=self._env())

    def _rest(self, path: str) -> dict[str, Any] | None:
        try:
            response = httpx.get(f"{self.rest_url}{path}", timeout=3)
        except httpx.HTTPError:
            return None
        return response.json() if response.status_code == 200 else None
