"""Run an application zip locally the way Managed Flink runs it, to smoke-test it before upload.

    python -m deploy.local_run dist/shopper-intents-managed-flink-py311.zip   # built with --local

The zip is unpacked into a work folder and its ``main.py`` is run by a clean interpreter
(a fresh venv without pip or any package) whose ``PYTHONPATH`` holds only:

1. the zip's ``pyFiles`` folders (``app/``, ``site-packages/``), in that order;
2. PyFlink and the packages it requires, linked from the current environment: what the
   Managed Flink runtime provides.

So an import that works here comes from the zip or from the runtime, never from this
project's venv. Configuration comes from ``SI_*`` variables or ``SI_PROPERTIES_FILE``, as in
any run of the job.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from deploy.vendor import RUNTIME_DISTRIBUTION, TargetPlatform, requirement_closure

#: Variables passed through to the job's process (besides the ones the caller adds).
PASS_THROUGH_ENV = ("PATH", "HOME", "JAVA_HOME", "LANG", "TMPDIR")


@dataclass(frozen=True)
class UnpackedApp:
    root: Path
    python: Path
    pythonpath: tuple[Path, ...]

    @property
    def main_file(self) -> Path:
        return self.root / self.run_options["python"]

    @property
    def run_options(self) -> dict[str, str]:
        return json.loads((self.root / "BUILD_INFO.json").read_text())["run_options"]

    def environment(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {k: os.environ[k] for k in PASS_THROUGH_ENV if k in os.environ}
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in self.pythonpath)
        env["PYTHONNOUSERSITE"] = "1"
        env.update(extra or {})
        return env

    def command(self) -> list[str]:
        return [str(self.python), str(self.main_file)]


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


def unpack(zip_path: Path, workdir: Path) -> UnpackedApp:
    """Unpack ``zip_path`` under ``workdir`` with an interpreter and runtime packages beside it."""
    root = workdir / "unpacked"
    with zipfile.ZipFile(zip_path) as zf:
        zf.extractall(root)
    runtime = link_runtime_packages(workdir / "runtime")
    python = clean_interpreter(workdir / "python")
    options = json.loads((root / "BUILD_INFO.json").read_text())["run_options"]
    py_files = [root / entry.strip() for entry in options["pyFiles"].split(",") if entry.strip()]
    return UnpackedApp(root=root, python=python, pythonpath=(*py_files, runtime))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.local_run", description=__doc__)
    p.add_argument("zip", type=Path, help="a zip built with --local")
    p.add_argument("--workdir", type=Path, default=Path(".cache/managed-flink-local"))
    args = p.parse_args(argv)
    app = unpack(args.zip, args.workdir)
    env = app.environment({k: v for k, v in os.environ.items() if k.startswith("SI_")})
    return subprocess.run(app.command(), env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
