"""The Managed Flink zip records each merged jar's version and SHA-256 (BUILD_INFO.json),
read from the jar itself, and finds the jars under $SI_CACHE_DIR."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

from deploy import build_managed_flink_zip as builder


def _jar(path: Path, entries: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as jar:
        for name, text in entries.items():
            jar.writestr(name, text)
    return path


def test_the_manifests_implementation_version(tmp_path: Path):
    jar = _jar(
        tmp_path / "flink-connector-kafka.jar",
        {"META-INF/MANIFEST.MF": "Manifest-Version: 1.0\nImplementation-Version: 4.0.1-2.0\n"},
    )
    record = builder.jar_record(jar)
    assert record == {
        "name": "flink-connector-kafka.jar",
        "version": "4.0.1-2.0",
        "sha256": hashlib.sha256(jar.read_bytes()).hexdigest(),
    }


def test_a_version_properties_file(tmp_path: Path):
    jar = _jar(
        tmp_path / "kafka-clients.jar",
        {"META-INF/MANIFEST.MF": "Manifest-Version: 1.0\n", "kafka/kafka-version.properties":
         "commitId=abc\nversion=3.9.1\n"},
    )  # fmt: skip
    assert builder.jar_record(jar)["version"] == "3.9.1"


def test_the_projects_own_jar_carries_the_projects_version(tmp_path: Path):
    jar = _jar(tmp_path / builder.OWN_JAR, {"META-INF/MANIFEST.MF": "Manifest-Version: 1.0\n"})
    assert builder.jar_record(jar)["version"] == builder.project_version()


def test_a_jar_that_records_no_version_says_so(tmp_path: Path):
    assert builder.jar_record(_jar(tmp_path / "x.jar", {"a.class": "x"}))["version"] is None


def test_the_jars_are_found_under_si_cache_dir(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("SI_CACHE_DIR", str(tmp_path))
    assert builder.default_jars_dir() == tmp_path.resolve() / "jars"
