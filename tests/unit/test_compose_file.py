"""Static checks of docker-compose.yml (no Docker engine here to run it).

Each check is one promise a user of Compose relies on: the file parses; every image is
pinned; host ports do not collide; long-running services report health; ``depends_on``
names existing services with valid conditions that the dependency can meet; the files
that bind mounts, commands and the image build refer to exist; and the project's own
commands parse with the project's own argument parsers.

Paths under ``.cache/`` are made by ``make setup`` (models, jars): they must be folders
``scripts/setup.sh`` creates, and need not exist in a fresh clone.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
APP_ROOT = PurePosixPath("/opt/shopper-intents")  # where Dockerfile.flink puts the repo
APP_IMAGE_DOCKERFILE = "Dockerfile.flink"
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
#: File types a command may name (scripts, data, configs).
FILE_TOKEN = re.compile(r"^[\w./-]+\.(py|jsonl|json|csv|j2|ya?ml|toml|sh|jar)$")


def load() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load()


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def one_shot(service: dict[str, Any]) -> bool:
    """A service that runs to completion (topic creation, job submission, replays)."""
    return str(service.get("restart", "")).lower() == "no"


def command_argv(service: dict[str, Any]) -> list[str]:
    command = service.get("command") or []
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command]


def uses_app_image(service: dict[str, Any]) -> bool:
    build = service.get("build") or {}
    return isinstance(build, dict) and build.get("dockerfile") == APP_IMAGE_DOCKERFILE


def bind_mounts(service: dict[str, Any]) -> list[tuple[str, PurePosixPath]]:
    """(host path, container path) of each bind mount; named volumes are left out."""
    out = []
    for volume in service.get("volumes") or []:
        if isinstance(volume, dict):
            if volume.get("type") == "bind":
                out.append((volume["source"], PurePosixPath(volume["target"])))
            continue
        source, _, rest = volume.partition(":")
        if source.startswith((".", "/", "~")):
            out.append((source, PurePosixPath(rest.split(":")[0])))
    return out


def host_ports(service: dict[str, Any]) -> list[str]:
    ports = []
    for entry in service.get("ports") or []:
        if isinstance(entry, dict):
            if entry.get("published"):
                ports.append(f"{entry.get('host_ip', '')}:{entry['published']}")
            continue
        parts = str(entry).split(":")
        if len(parts) >= 2:  # [ip:]host:container; a bare container port binds no fixed port
            ports.append(":".join(parts[:-1]) if len(parts) == 3 else f":{parts[0]}")
    return ports


def assert_exists_or_made_by_setup(host: Path, what: str) -> None:
    relative = host.resolve().relative_to(REPO)
    if relative.parts and relative.parts[0] == ".cache":
        made = (REPO / "scripts" / "setup.sh").read_text()
        assert len(relative.parts) > 1 and relative.parts[1] in made, (
            f"{what}: {relative} is under .cache/ but scripts/setup.sh does not make it"
        )
        return
    assert host.exists(), f"{what}: {relative} does not exist in the repository"


def container_to_host(service: dict[str, Any], path: PurePosixPath) -> Path | None:
    """The repository path a container path comes from (bind mount, else the app image)."""
    for source, target in sorted(bind_mounts(service), key=lambda m: -len(m[1].parts)):
        if path == target or target in path.parents:
            return (REPO / source / path.relative_to(target)).resolve()
    if uses_app_image(service) and (path == APP_ROOT or APP_ROOT in path.parents):
        return REPO / path.relative_to(APP_ROOT)
    return None


def test_parses_with_services(compose: dict[str, Any]):
    assert isinstance(compose, dict) and isinstance(compose.get("services"), dict)
    assert compose["services"], "no services"


def test_every_service_has_a_pinned_image(services):
    for name, service in services.items():
        image = service.get("image")
        assert image or service.get("build"), f"{name}: neither image nor build"
        if not image:
            continue
        if "@sha256:" in image:
            continue
        repo, _, tag = image.rpartition(":")
        assert repo and "/" not in tag, f"{name}: image {image!r} has no tag"
        assert tag != "latest", f"{name}: image {image!r} uses latest"
        assert re.search(r"\d", tag), f"{name}: tag of {image!r} names no version"


def test_host_ports_are_unique(services):
    seen: dict[str, str] = {}
    for name, service in services.items():
        for port in host_ports(service):
            assert port not in seen, f"host port {port} of {name} is also {seen[port]}'s"
            seen[port] = name


def test_long_running_services_have_healthchecks(services):
    for name, service in services.items():
        if one_shot(service):
            continue
        check = service.get("healthcheck") or {}
        assert check.get("test") and not check.get("disable"), f"{name}: no healthcheck"


def test_depends_on_is_valid(services):
    for name, service in services.items():
        depends = service.get("depends_on") or {}
        if isinstance(depends, list):
            depends = {d: {"condition": "service_started"} for d in depends}
        for dep, spec in depends.items():
            assert dep in services, f"{name} depends on unknown service {dep!r}"
            assert dep != name, f"{name} depends on itself"
            condition = (spec or {}).get("condition", "service_started")
            assert condition in CONDITIONS, f"{name} -> {dep}: unknown condition {condition!r}"
            target = services[dep]
            if condition == "service_healthy":
                assert target.get("healthcheck"), f"{name} waits for {dep}'s health: none"
            if condition == "service_completed_successfully":
                assert one_shot(target), f"{name} waits for {dep} to finish: it never does"
            # A dependency must be active whenever the dependent is.
            mine, theirs = set(service.get("profiles") or []), set(target.get("profiles") or [])
            assert not theirs or (mine and mine <= theirs), (
                f"{name} (profiles {sorted(mine) or 'always'}) depends on {dep} "
                f"(profiles {sorted(theirs)}), which may not be running"
            )


def test_named_volumes_are_declared(compose: dict[str, Any], services):
    declared = set(compose.get("volumes") or {})
    for name, service in services.items():
        for volume in service.get("volumes") or []:
            source = volume.get("source") if isinstance(volume, dict) else volume.split(":")[0]
            if isinstance(volume, dict) and volume.get("type") != "volume":
                continue
            if source and not source.startswith((".", "/", "~")):
                assert source in declared, f"{name}: volume {source!r} is not declared"


def test_bind_mount_sources_exist(services):
    for name, service in services.items():
        for source, _target in bind_mounts(service):
            assert not source.startswith(("/", "~")), f"{name}: host-specific mount {source}"
            assert_exists_or_made_by_setup(REPO / source, f"{name} mount")


def test_files_named_by_commands_exist(services):
    checked = 0
    for name, service in services.items():
        workdir = PurePosixPath(service.get("working_dir") or APP_ROOT)
        argv = command_argv(service)
        for i, token in enumerate(argv):
            if argv[i - 1] == "-m" and i > 0 and re.fullmatch(r"[\w.]+", token):
                host = container_to_host(service, workdir)
                if host is not None:
                    module = host / Path(*token.split("."))
                    assert (module.with_suffix(".py")).is_file() or (
                        module / "__main__.py"
                    ).is_file(), f"{name}: module {token} not found"
                    checked += 1
                continue
            if not FILE_TOKEN.match(token) and not token.startswith("/"):
                continue
            path = PurePosixPath(token)
            if not path.is_absolute():
                path = workdir / path
            host = container_to_host(service, path)
            if host is not None:
                assert_exists_or_made_by_setup(host, f"{name} command")
                checked += 1
    assert checked >= 4  # job.py, the replayed file, the modules, the model folder


def test_project_commands_parse(services):
    """The router and replay commands are valid for the project's own CLIs."""
    from flink_jobs.tools.replay import _build_parser as replay_parser
    from inference_sidecar.cli import build_parser as sidecar_parser

    parsers = {"inference_sidecar": sidecar_parser, "flink_jobs.tools.replay": replay_parser}
    parsed = 0
    for name, service in services.items():
        argv = command_argv(service)
        if len(argv) > 2 and argv[1] == "-m" and argv[2] in parsers:
            try:
                parsers[argv[2]]().parse_args(argv[3:])
            except SystemExit as exc:
                pytest.fail(f"{name}: {' '.join(argv)} does not parse ({exc})")
            parsed += 1
    assert parsed >= 3


def test_app_image_build_inputs_exist(services):
    builds = {
        (s["build"]["context"], s["build"]["dockerfile"])
        for s in services.values()
        if isinstance(s.get("build"), dict)
    }
    assert builds, "no service builds the application image"
    for context, dockerfile in builds:
        path = REPO / context / dockerfile
        assert path.is_file(), f"{dockerfile} is missing"
        for line in path.read_text().splitlines():
            words = line.split()
            if not words or words[0] != "COPY":
                continue
            sources = [w for w in words[1:-1] if not w.startswith("--")]
            for source in sources:
                assert_exists_or_made_by_setup(REPO / context / source, f"{dockerfile} COPY")
        ignore = path.with_name(path.name + ".dockerignore")
        assert ignore.is_file(), f"{ignore.name} keeps .cache's venvs out of the build context"


def test_flink_services_run_the_app_image(services):
    for name in ("jobmanager", "taskmanager", "job-submit"):
        assert uses_app_image(services[name]), f"{name} needs PyFlink: build {APP_IMAGE_DOCKERFILE}"
