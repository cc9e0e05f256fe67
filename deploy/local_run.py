"""Run an application zip locally the way Managed Flink runs it, to smoke-test it before upload.

    python -m deploy.local_run dist/shopper-intents-managed-flink-py311.zip   # built with --local
    python -m deploy.local_run ZIP --cluster                 # on a standalone cluster, Flink 2.2
    python -m deploy.local_run ZIP --cluster --runtime FLINK-2_3

The zip is unpacked into a work folder and its ``main.py`` is run by the runtime's
interpreter: a Python whose only packages are PyFlink of the runtime's Flink release and
what it requires (``runtime_interpreter``), with ``PYTHONPATH`` holding only the zip's
``pyFiles`` folders (``app/``, ``site-packages/``), which come first as on Managed Flink.
So an import that works here comes from the zip or from the runtime, never from this
project's venv.

Without ``--cluster``, ``main.py`` runs the job in a mini-cluster inside that process. With
it, a standalone cluster of the runtime's Flink release (a JobManager and a TaskManager
from that release's distribution, ``flink_jobs.tools.flink_cluster``) runs the job
submitted with ``flink run -py main.py``, the ``pyFiles`` shipped to the TaskManager as
``python.files``: the shape of Managed Flink's, where the job's Python runs in the
TaskManager, not in the process that built the graph. The runtime's release other than the
installed one is installed once into ``$SI_CACHE_DIR/flink-runtimes/``.

Configuration comes from ``SI_*`` variables or ``SI_PROPERTIES_FILE``, as in any run of
the job.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from deploy.vendor import RUNTIME_DISTRIBUTION, TargetPlatform, requirement_closure
from flink_jobs.paths import cache_dir

#: Variables passed through to the job's process (besides the ones the caller adds).
PASS_THROUGH_ENV = ("PATH", "HOME", "JAVA_HOME", "LANG", "TMPDIR")
#: Managed Flink's runtimes and the Flink release of each that the zip is checked against
#: (``aws kinesisanalyticsv2 create-application --runtime-environment``).
RUNTIMES = {"FLINK-2_2": "2.2.1", "FLINK-2_3": "2.3.0"}
DEFAULT_RUNTIME = "FLINK-2_2"
#: Installing a runtime's PyFlink (~860 MB) took about a minute with a warm pip cache.
INSTALL_TIMEOUT_S = 1200


@dataclass(frozen=True)
class UnpackedApp:
    root: Path
    python: Path
    #: The zip's ``pyFiles`` folders, in order.
    pythonpath: tuple[Path, ...]
    #: Folders after them on ``PYTHONPATH``: the installed runtime's packages, which an
    #: interpreter PyFlink embeds (thread mode) finds only there, not through the venv's
    #: ``.pth`` file.
    runtime_path: tuple[Path, ...] = ()

    @property
    def main_file(self) -> Path:
        return self.root / self.run_options["python"]

    @property
    def run_options(self) -> dict[str, str]:
        return json.loads((self.root / "BUILD_INFO.json").read_text())["run_options"]

    def environment(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {k: os.environ[k] for k in PASS_THROUGH_ENV if k in os.environ}
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (*self.pythonpath, *self.runtime_path))
        env["PYTHONNOUSERSITE"] = "1"
        env.update(extra or {})
        return env

    def command(self) -> list[str]:
        return [str(self.python), str(self.main_file)]


def installed_flink_version() -> str:
    return metadata.version(RUNTIME_DISTRIBUTION)


def link_runtime_packages(dest: Path) -> Path:
    """A folder of links to PyFlink and everything it requires, from this environment."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in sorted(requirement_closure(RUNTIME_DISTRIBUTION, TargetPlatform.local())):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        tops = {f.parts[0] for f in dist.files or () if f.parts} - {"..", "__pycache__"}
        for top in sorted(tops):
            source = Path(str(dist.locate_file(top)))
            link = dest / top
            if source.exists() and not link.exists():
                link.symlink_to(source, target_is_directory=source.is_dir())
    return dest


def clean_interpreter(dest: Path) -> Path:
    """A venv of this interpreter with nothing installed (not even pip)."""
    if not (dest / "bin" / "python").exists():
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", "--without-pip", str(dest)], check=True, timeout=120)
    return dest / "bin" / "python"


def _printed_path(python: Path, code: str, timeout_s: float) -> Path:
    """The path that ``python -c code`` prints."""
    done = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, check=True, timeout=timeout_s
    )
    return Path(done.stdout.strip())


def _site_packages(python: Path) -> Path:
    return _printed_path(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])", 60)


def runtime_interpreter(flink_version: str, workdir: Path, runtimes_dir: Path) -> Path:
    """An interpreter whose packages are PyFlink ``flink_version`` and its requirements only.

    The installed release: a clean venv whose ``site-packages`` names (a ``.pth`` file) a
    folder of links to this environment's PyFlink and its requirements. Another release: a
    venv of its own under ``runtimes_dir``, made once with pip."""
    if flink_version == installed_flink_version():
        python = clean_interpreter(workdir / "python")
        runtime = link_runtime_packages(workdir / "runtime")
        (_site_packages(python) / "flink-runtime.pth").write_text(f"{runtime}\n")
        return python
    venv = runtimes_dir / f"{RUNTIME_DISTRIBUTION}-{flink_version}"
    python = venv / "bin" / "python"
    stamp = venv / ".installed"
    if not stamp.exists():
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=120)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
             f"{RUNTIME_DISTRIBUTION}=={flink_version}"],
            check=True, timeout=INSTALL_TIMEOUT_S,
        )  # fmt: skip
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "pip"], check=True)
        stamp.write_text(flink_version)
    return python


def unpack(zip_path: Path, workdir: Path, flink_version: str | None = None) -> UnpackedApp:
    """Unpack ``zip_path`` under ``workdir`` with the runtime's interpreter beside it
    (``flink_version``: the runtime's Flink release, default the installed one)."""
    root = workdir / "unpacked"
    with zipfile.ZipFile(zip_path) as zf:
        zf.extractall(root)
    version = flink_version or installed_flink_version()
    python = runtime_interpreter(version, workdir, cache_dir() / "flink-runtimes")
    options = json.loads((root / "BUILD_INFO.json").read_text())["run_options"]
    links = workdir / "runtime"
    return UnpackedApp(
        root=root,
        python=python,
        pythonpath=tuple(py_files(root, options)),
        runtime_path=(links,) if links.is_dir() else (),
    )


def py_files(root: Path, run_options: Mapping[str, str]) -> list[Path]:
    """The run option ``pyFiles`` as folders of the unpacked zip, in its order."""
    return [root / entry.strip() for entry in run_options["pyFiles"].split(",") if entry.strip()]


def flink_home_of(python: Path) -> Path:
    """The Flink distribution inside the PyFlink that ``python`` imports."""
    return _printed_path(
        python, "import os, pyflink; print(os.path.dirname(pyflink.__file__))", 120
    )


def cluster_settings(app: UnpackedApp) -> dict[str, str]:
    """What Managed Flink's run options become on a standalone cluster: the ``pyFiles``
    shipped with the job (``python.files``, Flink's ``-pyfs``)."""
    return {"python.files": ",".join(str(p) for p in app.pythonpath)}


@contextmanager
def on_cluster(
    app: UnpackedApp,
    env: Mapping[str, str],
    workdir: Path,
    reporter_ports: range | None = None,
    parallelism: int = 1,
) -> Iterator[tuple[object, str]]:
    """The app's job running on a standalone cluster of its runtime's Flink release:
    yields ``(cluster, job id)``; the cluster (a ``FlinkCluster``) stops on exit.
    ``reporter_ports``: Flink's Prometheus reporter in every process, on these ports."""
    from flink_jobs.tools.flink_cluster import ClusterSpec, FlinkCluster

    class RuntimeCluster(FlinkCluster):
        """The runtime's distribution (``home``); its processes see no ``PYTHONPATH`` of
        the caller's, so the TaskManager's Python finds the job only in the shipped
        ``pyFiles``."""

        def _env(self) -> dict[str, str]:
            return {**super()._env(), "PYTHONPATH": ""}

    spec = ClusterSpec(
        taskmanagers=1,
        slots_per_taskmanager=parallelism,
        python_executable=str(app.python),
        reporter_ports=reporter_ports,
        extra=cluster_settings(app),
    )
    cluster = RuntimeCluster(workdir, spec)
    cluster.home = flink_home_of(app.python)
    with cluster:
        # The cluster's PATH (the runtime interpreter's folder first) is kept.
        job_env = {k: v for k, v in {**app.environment(), **env}.items() if k != "PATH"}
        job_id = cluster.submit(app.main_file, job_env, parallelism, log_name="local-run")
        yield cluster, job_id


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.local_run", description=__doc__)
    p.add_argument("zip", type=Path, help="a zip built with --local")
    p.add_argument("--workdir", type=Path, default=Path(".cache/managed-flink-local"))
    p.add_argument("--cluster", action="store_true", help="on a standalone Flink cluster")
    p.add_argument(
        "--runtime", choices=sorted(RUNTIMES), default=DEFAULT_RUNTIME,
        help=f"Managed Flink runtime whose Flink release runs the job (default {DEFAULT_RUNTIME})",
    )  # fmt: skip
    args = p.parse_args(argv)
    app = unpack(args.zip, args.workdir, RUNTIMES[args.runtime])
    env = app.environment({k: v for k, v in os.environ.items() if k.startswith("SI_")})
    if not args.cluster:
        return subprocess.run(app.command(), env=env, check=False).returncode
    with on_cluster(app, env, args.workdir / "cluster") as (cluster, job_id):
        print(f"job {job_id} on {cluster.rest_url} (Flink {RUNTIMES[args.runtime]}); Ctrl-C stops")
        try:
            while cluster.status(job_id) not in ("FINISHED", "FAILED", "CANCELED"):
                time.sleep(2)
        except KeyboardInterrupt:
            return 130
        return 0 if cluster.status(job_id) == "FINISHED" else 1


if __name__ == "__main__":
    sys.exit(main())
