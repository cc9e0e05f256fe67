"""Vendor the job's Python dependencies for the Managed Flink runtime: resolve, then unpack.

Managed Flink installs nothing at deploy time, so every third-party package the job
imports must be inside the zip, built for the runtime's interpreter (Flink 2.2: CPython
3.12 on x86_64 Linux). pip does both steps for a platform other than the one it runs on:

1. ``pip install --dry-run --report`` resolves the job's requirements for the target
   (``--platform``, ``--python-version``, ``--implementation cp``, binary wheels only),
   pinned to the versions installed in the current environment (the ones the tests ran
   against) where those exist;
2. every resolved distribution is vendored, also those the runtime has already (PyFlink
   brings e.g. ``redis`` and ``orjson`` through ``apache-beam``): the job then runs with
   the versions it was tested with whatever the runtime holds. Such a copy comes first on
   ``PYTHONPATH`` and shadows the runtime's, so it must satisfy what the runtime's
   packages require of it: ``runtime_conflicts`` checks that against ``apache-flink``'s
   installed requirement tree, and the build refuses a conflicting set (pinning to the
   installed versions, which pip resolved together with ``apache-flink``, avoids one);
3. ``pip install --no-deps --target`` unpacks exactly those (no ``.pyc``: they would be for
   this interpreter, not the runtime's).

Which distributions the job needs is read from ``pyproject.toml`` (the base dependencies
and the ``job`` extra): those named in ``JOB_DISTRIBUTIONS``, with their version ranges
(the router's and the tools' own dependencies are not part of the job).
"""

from __future__ import annotations

import json
import logging
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

log = logging.getLogger(__name__)

#: Distributions the Flink job imports (``flink_jobs.job`` and the modules it loads).
JOB_DISTRIBUTIONS = (
    "httpx",
    "httpx-aiohttp",
    "aiohttp",
    "redis",
    "orjson",
    "jinja2",
    "fastjsonschema",
    "tokenizers",
)
#: Provided by the runtime: PyFlink and everything it requires.
RUNTIME_DISTRIBUTION = "apache-flink"


class VendorError(RuntimeError):
    """Resolving or downloading the dependencies failed; carries pip's output."""

    def __init__(self, step: str, output: str) -> None:
        self.step = step
        self.output = output
        super().__init__(f"{step} failed:\n{output[-4000:]}")


@dataclass(frozen=True)
class TargetPlatform:
    """The interpreter the zip is built for."""

    python_version: str = "3.12"
    platforms: tuple[str, ...] = ("manylinux2014_x86_64",)
    implementation: str = "cp"

    @classmethod
    def local(cls) -> TargetPlatform:
        """This interpreter's version on this machine's architecture (for local runs)."""
        return cls(
            python_version=f"{sys.version_info.major}.{sys.version_info.minor}",
            platforms=(f"manylinux2014_{platform.machine()}",),
        )

    def pip_args(self) -> list[str]:
        args = ["--only-binary=:all:", "--implementation", self.implementation]
        args += ["--python-version", self.python_version]
        for name in self.platforms:
            args += ["--platform", name]
        return args

    def marker_environment(self) -> dict[str, str]:
        return {
            "python_version": self.python_version,
            "python_full_version": f"{self.python_version}.0",
            "platform_system": "Linux",
            "sys_platform": "linux",
            "os_name": "posix",
            "implementation_name": "cpython",
            "platform_python_implementation": "CPython",
            "platform_machine": "aarch64" if "aarch64" in self.platforms[0] else "x86_64",
            "extra": "",
        }


@dataclass(frozen=True)
class Distribution:
    name: str
    version: str

    @property
    def pin(self) -> str:
        return f"{self.name}=={self.version}"


def canonical_name(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def job_requirements(pyproject: Path) -> list[str]:
    """The job's requirement strings, as declared in ``pyproject.toml`` (the base
    dependencies and the ``job`` extra)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    declared = [*project["dependencies"], *project["optional-dependencies"]["job"]]
    wanted = {canonical_name(n) for n in JOB_DISTRIBUTIONS}
    found = [r for r in declared if canonical_name(Requirement(r).name) in wanted]
    missing = wanted - {canonical_name(Requirement(r).name) for r in found}
    if missing:
        raise VendorError("reading pyproject.toml", f"not declared: {', '.join(sorted(missing))}")
    return found


def requirement_closure(root: str, target: TargetPlatform) -> set[str]:
    """Canonical names of ``root`` and everything it requires, from installed metadata."""
    env = target.marker_environment()
    seen: set[str] = set()
    todo = [root]
    while todo:
        name = canonical_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            log.debug("%s is not installed here; its requirements are not followed", name)
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(req.name)
    return seen


def installed_pins() -> list[str]:
    """``name==version`` of every distribution installed in this environment."""
    pins = {canonical_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
    return [f"{name}=={version}" for name, version in sorted(pins.items())]


def resolve(
    requirements: Sequence[str], target: TargetPlatform, constraints: Sequence[str] = ()
) -> list[Distribution]:
    """Resolve ``requirements`` for ``target`` without installing anything."""
    with tempfile.TemporaryDirectory(prefix="si-resolve-") as tmp:
        report = Path(tmp) / "report.json"
        cmd = [*_pip(), "install", "--dry-run", "--ignore-installed", "--quiet"]
        cmd += ["--report", str(report), *target.pip_args()]
        if constraints:
            constraint_file = Path(tmp) / "constraints.txt"
            constraint_file.write_text("\n".join(constraints) + "\n")
            cmd += ["--constraint", str(constraint_file)]
        _run(cmd + list(requirements), "resolving the job's dependencies")
        installs = json.loads(report.read_text())["install"]
    return sorted(
        (Distribution(i["metadata"]["name"], i["metadata"]["version"]) for i in installs),
        key=lambda d: canonical_name(d.name),
    )


def vendor(distributions: Sequence[Distribution], target: TargetPlatform, dest: Path) -> None:
    """Unpack the wheels of exactly ``distributions`` (no dependency resolution) into ``dest``."""
    if not distributions:
        return
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [*_pip(), "install", "--no-deps", "--no-compile", "--quiet", "--target", str(dest)]
    cmd += target.pip_args() + [d.pin for d in distributions]
    _run(cmd, "downloading the job's dependencies")
    shutil.rmtree(dest / "bin", ignore_errors=True)  # console scripts: not used by the job
    for cache in dest.rglob("__pycache__"):
        shutil.rmtree(cache, ignore_errors=True)


def runtime_conflicts(
    vendored: Sequence[Distribution], runtime: set[str], target: TargetPlatform
) -> list[str]:
    """What a vendored version breaks: runtime packages whose requirements it does not meet."""
    env = target.marker_environment()
    versions = {canonical_name(d.name): d.version for d in vendored}
    conflicts = []
    for dist_name in sorted(runtime):
        try:
            requires = metadata.requires(dist_name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            version = versions.get(canonical_name(req.name))
            if version is None or (req.marker is not None and not req.marker.evaluate(env)):
                continue
            if not req.specifier.contains(version, prereleases=True):
                conflicts.append(f"{dist_name} requires {req}, the job would vendor {version}")
    return conflicts


@dataclass(frozen=True)
class VendorPlan:
    requirements: tuple[str, ...]
    vendored: tuple[Distribution, ...]
    #: Vendored distributions the runtime has too (the vendored copy wins on PYTHONPATH).
    shadowing_runtime: tuple[str, ...]


def plan(pyproject: Path, target: TargetPlatform, pin_to_installed: bool = True) -> VendorPlan:
    """Resolve the job's requirements for ``target`` and check them against the runtime's."""
    requirements = job_requirements(pyproject)
    constraints = installed_pins() if pin_to_installed else []
    vendored = tuple(resolve(requirements, target, constraints))
    runtime = requirement_closure(RUNTIME_DISTRIBUTION, target)
    conflicts = runtime_conflicts(vendored, runtime, target)
    if conflicts:
        raise VendorError("checking against the runtime's packages", "\n".join(conflicts))
    shadowing = tuple(d.pin for d in vendored if canonical_name(d.name) in runtime)
    return VendorPlan(tuple(requirements), vendored, shadowing)


def _pip() -> list[str]:
    return [sys.executable, "-m", "pip", "--disable-pip-version-check"]


def _run(cmd: list[str], step: str) -> None:
    log.debug("running %s", " ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=600)
    if done.returncode != 0:
        raise VendorError(step, done.stdout + done.stderr)
