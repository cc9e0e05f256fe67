"""Driving one compose project from a test: ``docker compose`` with the shipped file and the
test's override, the Flink REST API, Prometheus and Redis on the ports the override
publishes; the test waits on them with ``tests.support.waiting.until``.

The engine is the one ``DOCKER_HOST`` names (``scripts/compose_test.sh`` starts it), the
settings are ``SI_COMPOSE_ENV_FILE`` and the ``SI_TEST_*_PORT`` variables it exports.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
FILES = (REPO / "docker-compose.yml", REPO / "tests" / "compose" / "docker-compose.test.yml")
PROFILE = "cpu"
#: docker compose calls that change the stack (up, run, down) may take minutes on two
#: shared cores; those that read it, seconds.
COMPOSE_TIMEOUT_S = 900.0


#: How often a wait polls the stack (``tests.support.waiting.until``): each poll is a docker
#: compose call, a REST call or a query.
POLL_S = 1.0


def env_values(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep and not line.lstrip().startswith("#"):
            values[name.strip()] = value.strip()
    return values


@dataclass
class Stack:
    """One compose project (``name``) of the shipped file with the test's override."""

    name: str
    env_file: Path

    @classmethod
    def from_environment(cls, name: str) -> Stack:
        return cls(name, Path(os.environ["SI_COMPOSE_ENV_FILE"]))

    @property
    def secrets(self) -> dict[str, str]:
        return {k: v for k, v in env_values(self.env_file).items() if k.endswith("PASSWORD")}

    def port(self, what: str) -> int:
        return int(os.environ[f"SI_TEST_{what.upper()}_PORT"])

    @property
    def flink_url(self) -> str:
        return f"http://127.0.0.1:{self.port('flink')}"

    @property
    def prometheus_url(self) -> str:
        return f"http://127.0.0.1:{self.port('prometheus')}"

    @property
    def redis_url(self) -> str:
        return f"redis://:{self.secrets['REDIS_PASSWORD']}@127.0.0.1:{self.port('redis')}/0"

    # --- docker compose ------------------------------------------------------------------

    def compose_argv(self, *args: str) -> list[str]:
        argv = ["docker", "compose", "-p", self.name, "--env-file", str(self.env_file)]
        for path in FILES:
            argv += ["-f", str(path)]
        return [*argv, "--profile", PROFILE, *args]

    def compose(
        self, *args: str, input_text: str | None = None, timeout_s: float = COMPOSE_TIMEOUT_S
    ) -> str:
        done = subprocess.run(
            self.compose_argv(*args), cwd=REPO, input=input_text, capture_output=True,
            text=True, timeout=timeout_s, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise AssertionError(
                f"docker compose {' '.join(args)} exited {done.returncode}:\n"
                f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        return done.stdout

    def containers(self, service: str | None = None, all_: bool = False) -> list[dict]:
        args = ["ps", "--format", "json"] + (["--all"] if all_ else [])
        out = self.compose(*args, *([service] if service else []), timeout_s=60)
        rows = [json.loads(line) for line in out.splitlines() if line.strip()]
        return rows

    def logs(self, *services: str, tail: int = 60) -> str:
        try:
            return self.compose("logs", "--no-color", "--tail", str(tail), *services, timeout_s=60)
        except (AssertionError, subprocess.TimeoutExpired) as exc:
            return f"(no logs: {exc})"

    def exec_python(self, service: str, script: Path) -> Any:
        """Run ``script`` with the service's Python inside its container; its JSON output."""
        out = self.compose("exec", "-T", service, "python", "-", input_text=script.read_text(),
                           timeout_s=120)  # fmt: skip
        return json.loads(out.strip().splitlines()[-1])

    def leftovers(self) -> dict[str, list[str]]:
        """The project's containers, networks and volumes the engine still has."""
        label = f"label=com.docker.compose.project={self.name}"
        found = {}
        for kind, argv in (
            ("containers", ["docker", "ps", "-a", "--filter", label, "--format", "{{.Names}}"]),
            ("networks", ["docker", "network", "ls", "--filter", label, "--format", "{{.Name}}"]),
            ("volumes", ["docker", "volume", "ls", "--filter", label, "--format", "{{.Name}}"]),
        ):
            done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60)
            found[kind] = done.stdout.split()
        return found

    # --- Flink, Prometheus ---------------------------------------------------------------

    def flink(self, path: str) -> Any:
        try:
            response = httpx.get(f"{self.flink_url}{path}", timeout=5)
        except httpx.HTTPError:
            return None
        return response.json() if response.status_code == 200 else None

    def running_job(self) -> dict | None:
        """The job with every task running, else None."""
        overview = self.flink("/jobs/overview") or {}
        for job in overview.get("jobs", []):
            if job.get("state") != "RUNNING":
                continue
            detail = self.flink(f"/jobs/{job['jid']}") or {}
            vertices = detail.get("vertices") or []
            if vertices and all(v.get("status") == "RUNNING" for v in vertices):
                return detail
        return None

    def prometheus(self, path: str, params: dict | None = None) -> Any:
        try:
            response = httpx.get(f"{self.prometheus_url}{path}", params=params, timeout=5)
        except httpx.HTTPError:
            return None
        return response.json().get("data") if response.status_code == 200 else None

    def scrape_targets(self) -> list[dict]:
        return (self.prometheus("/api/v1/targets") or {}).get("activeTargets", [])


def docker(*args: str, timeout_s: float = 120) -> str:
    done = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if done.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} exited {done.returncode}: {done.stderr}")
    return done.stdout
