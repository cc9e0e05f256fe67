"""deploy: the Managed Flink application zip's fat jar, vendoring plan, main file and
example properties (which must load with the job's own configuration reader). The built
zip's layout is checked in ``tests/service/test_managed_flink_zip_layout.py``.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from deploy import build_managed_flink_zip as builder
from deploy import fat_jar, vendor
from deploy.main import FAT_JAR, choose_jars
from flink_jobs.config import load_config, read_property_groups

REPO = Path(__file__).resolve().parents[2]


def make_jar(path: Path, entries: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    return path


class TestFatJar:
    def test_merge_rules(self, tmp_path: Path):
        a = make_jar(
            tmp_path / "a.jar",
            {
                "META-INF/MANIFEST.MF": b"Manifest-Version: 1.0\r\nMain-Class: A\r\n",
                "META-INF/services/x.Factory": b"# comment\na.One\nshared.Two\n",
                "META-INF/SIGNER.SF": b"sig",
                "META-INF/SIGNER.RSA": b"sig",
                "META-INF/LICENSE": b"license a",
                "a/One.class": b"1",
            },
        )
        b = make_jar(
            tmp_path / "b.jar",
            {
                "META-INF/services/x.Factory": b"shared.Two\nb.Three\n",
                "META-INF/LICENSE": b"license b",
                "b/Three.class": b"3",
            },
        )
        report = fat_jar.merge_jars([a, b], tmp_path / "out.jar")
        with zipfile.ZipFile(tmp_path / "out.jar") as zf:
            names = set(zf.namelist())
            assert zf.read("META-INF/services/x.Factory") == b"a.One\nshared.Two\nb.Three\n"
            assert zf.read("META-INF/LICENSE") == b"license a"
            assert b"Main-Class" not in zf.read("META-INF/MANIFEST.MF")
        assert {"a/One.class", "b/Three.class", "a/", "b/"} <= names
        assert not any(n.endswith((".SF", ".RSA")) for n in names)
        assert report.signatures_dropped == 2 and report.duplicates_skipped == 1

    def test_output_is_deterministic(self, tmp_path: Path):
        jar = make_jar(tmp_path / "a.jar", {"z.class": b"z", "a.class": b"a"})
        fat_jar.merge_jars([jar], tmp_path / "1.jar")
        fat_jar.merge_jars([jar], tmp_path / "2.jar")
        assert (tmp_path / "1.jar").read_bytes() == (tmp_path / "2.jar").read_bytes()

    @pytest.mark.parametrize(
        ("name", "expected"),
        [
            ("META-INF/FOO.SF", True),
            ("META-INF/foo.rsa", True),
            ("META-INF/x/FOO.SF", False),
            ("a/B.SF", False),
            ("META-INF/NOTICE", False),
        ],
    )
    def test_signature_files(self, name: str, expected: bool):
        assert fat_jar.is_signature_file(name) is expected

    def test_needs_a_jar(self, tmp_path: Path):
        with pytest.raises(ValueError):
            fat_jar.merge_jars([], tmp_path / "out.jar")


class TestVendorPlan:
    def test_job_requirements_come_from_pyproject(self):
        reqs = vendor.job_requirements(REPO / "pyproject.toml")
        names = {vendor.canonical_name(r.split("<")[0].split(">")[0].split("=")[0]) for r in reqs}
        assert names == {vendor.canonical_name(n) for n in vendor.JOB_DISTRIBUTIONS}
        assert not any(r.startswith("apache-flink") for r in reqs)

    def test_default_target_is_managed_flink_2_2(self):
        target = vendor.TargetPlatform()
        args = target.pip_args()
        assert args[args.index("--python-version") + 1] == "3.12"
        assert "manylinux2014_x86_64" in args and "--only-binary=:all:" in args

    def test_runtime_closure_is_pyflink_and_its_requirements(self):
        closure = vendor.requirement_closure("apache-flink", vendor.TargetPlatform.local())
        assert {"apache-flink", "apache-flink-libraries", "apache-beam", "py4j"} <= closure
        assert "httpx" not in closure and "jinja2" not in closure

    def test_a_version_the_runtime_cannot_take_is_a_conflict(self):
        target = vendor.TargetPlatform.local()
        runtime = vendor.requirement_closure("apache-flink", target)
        beam_redis = [
            r for r in vendor.metadata.requires("apache-beam") or () if r.startswith("redis")
        ]
        if not beam_redis:
            pytest.skip("this apache-beam does not require redis")
        conflicts = vendor.runtime_conflicts(
            [vendor.Distribution("redis", "99.0.0")], runtime, target
        )
        assert conflicts and "redis" in conflicts[0]


class TestMainFile:
    def test_configured_jars_win(self, tmp_path: Path):
        assert choose_jars(("x.jar",), deployed=True, root=tmp_path) == ["x.jar"]

    def test_deployed_uses_the_runtime_classpath(self, tmp_path: Path):
        assert choose_jars((), deployed=True, root=tmp_path) == []

    def test_local_run_uses_the_bundled_jar(self, tmp_path: Path):
        with pytest.raises(FileNotFoundError):
            choose_jars((), deployed=False, root=tmp_path)
        (tmp_path / FAT_JAR).parent.mkdir(parents=True)
        (tmp_path / FAT_JAR).write_bytes(b"")
        assert choose_jars((), deployed=False, root=tmp_path) == [str(tmp_path / FAT_JAR)]


class TestExampleProperties:
    def test_committed_example_is_up_to_date(self):
        committed = (REPO / "deploy" / builder.EXAMPLE_PROPERTIES).read_text()
        assert committed == builder.example_properties_json(), (
            "regenerate: python -m deploy.build_managed_flink_zip "
            "--write-example deploy/application_properties.example.json"
        )

    def test_cli_writes_the_example(self, tmp_path: Path, capsys):
        assert builder.main(["--write-example", str(tmp_path / "p.json")]) == 0
        assert (tmp_path / "p.json").read_text() == builder.example_properties_json()

    def test_example_loads_and_validates(self, tmp_path: Path):
        path = tmp_path / "props.json"
        path.write_text(builder.example_properties_json())
        groups = read_property_groups(path)
        assert set(groups) == {"kafka", "redis", "llm", "session", "trigger", "prompt", "job"}
        config = load_config(properties_file=path, environ={})
        assert config.kafka.client_properties["sasl.mechanism"] == "AWS_MSK_IAM"
        assert config.job.jars == ()


# --- the built zip -----------------------------------------------------------------------
