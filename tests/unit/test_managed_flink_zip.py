"""deploy: the Managed Flink application zip, its fat jar, vendoring and main file.

The zip is built once for this interpreter (``TargetPlatform.local()``: same layout as the
cp312 build, but importable here) and checked for its layout; its example properties must
load with the job's own configuration reader.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from deploy import build_managed_flink_zip as builder
from deploy import fat_jar, vendor
from deploy.local_run import unpack
from deploy.main import FAT_JAR, PY_FOLDERS, choose_jars
from flink_jobs.config import load_config, read_property_groups

REPO = Path(__file__).resolve().parents[2]
JOB_JAVA_SOURCES = sorted((REPO / "flink_jobs" / "java" / "shopperintents").glob("*.java"))


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


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> builder.BuildResult:
    missing = [n for n in builder.JARS if not (builder.DEFAULT_JARS_DIR / n).is_file()]
    if missing:
        pytest.skip(f"connector jars not built ({', '.join(missing)}): run scripts/setup.sh")
    return builder.build(tmp_path_factory.mktemp("zip"), vendor.TargetPlatform.local())


@pytest.fixture(scope="module")
def names(built: builder.BuildResult) -> set[str]:
    with zipfile.ZipFile(built.zip_path) as zf:
        return set(zf.namelist())


class TestZipLayout:
    def test_main_file_at_the_root(self, names: set[str]):
        assert "main.py" in names
        assert "BUILD_INFO.json" in names and builder.EXAMPLE_PROPERTIES in names

    def test_job_with_schemas_and_prompts_as_package_data(self, names: set[str]):
        for name in ("app/flink_jobs/job.py", "app/flink_jobs/config.py"):
            assert name in names
        assert "app/flink_jobs/schemas/shopper_event.schema.json" in names
        assert "app/flink_jobs/schemas/shopper_intent.schema.json" in names
        assert "app/flink_jobs/prompts/shopper_intent_v1.j2" in names
        assert not any("__pycache__" in n or n.endswith(".java") for n in names)

    def test_exactly_the_packages_the_job_imports(self, names: set[str]):
        """The zip's first-party modules are the job's import closure: no tools, no router."""
        code = (
            "import sys, flink_jobs.job;"
            "print(*sorted(m for m in sys.modules"
            " if m.split('.')[0] in ('flink_jobs', 'intent_reader', 'inference_sidecar')))"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
        )
        imported = {m.replace(".", "/") for m in done.stdout.split()}
        packed = {
            n.removeprefix("app/").removesuffix(".py").removesuffix("/__init__")
            for n in names
            if n.startswith("app/") and n.endswith(".py")
        }
        assert packed == imported

    def test_dependencies_vendored_not_pyflink(self, names: set[str], built):
        tops = {n.split("/")[1] for n in names if n.startswith("site-packages/")}
        for package in (
            "httpx",
            "httpx_aiohttp",
            "aiohttp",
            "multidict",
            "yarl",
            "redis",
            "jinja2",
            "orjson",
            "fastjsonschema",
            "markupsafe",
        ):
            assert package in tops
        assert not tops & {"pyflink", "apache_beam", "pytest", "confluent_kafka", "bin"}
        for compiled in ("orjson", "aiohttp"):
            assert any(
                n.startswith(f"site-packages/{compiled}/") and n.endswith(".so") for n in names
            )
        vendored = {vendor.canonical_name(p.split("==")[0]) for p in built.info["vendored"]}
        assert {vendor.canonical_name(n) for n in vendor.JOB_DISTRIBUTIONS} <= vendored

    def test_run_options_point_into_the_zip(self, names: set[str], built):
        options = built.info["run_options"]
        assert options == builder.run_options()
        assert options["python"] in names and options["jarfile"] in names
        py_files = options["pyFiles"].split(",")
        assert py_files == [f"{folder}/" for folder in PY_FOLDERS]
        for entry in py_files:
            assert any(n.startswith(entry) for n in names)

    def test_one_fat_jar_with_every_connector_class(self, built, tmp_path: Path):
        with zipfile.ZipFile(built.zip_path) as zf:
            assert [n for n in zf.namelist() if n.endswith(".jar")] == [FAT_JAR]
            (tmp_path / "deps.jar").write_bytes(zf.read(FAT_JAR))
        with zipfile.ZipFile(tmp_path / "deps.jar") as jar:
            classes = set(jar.namelist())
        for cls in (
            "org/apache/flink/connector/kafka/source/KafkaSource.class",
            "org/apache/kafka/clients/consumer/KafkaConsumer.class",
            "com/github/luben/zstd/Zstd.class",
            "META-INF/services/org.apache.flink.table.factories.Factory",
            *(f"shopperintents/{java.stem}.class" for java in JOB_JAVA_SOURCES),
        ):
            assert cls in classes

    def test_example_properties_in_the_zip_load(self, built, tmp_path: Path):
        with zipfile.ZipFile(built.zip_path) as zf:
            (tmp_path / "p.json").write_bytes(zf.read(builder.EXAMPLE_PROPERTIES))
        assert read_property_groups(tmp_path / "p.json")
        doc = json.loads((tmp_path / "p.json").read_text())
        assert doc[0]["PropertyGroupId"] == builder.RUN_OPTIONS_GROUP

    def test_job_imports_from_the_zip_alone(self, built, tmp_path: Path):
        """A clean interpreter with only the zip's pyFiles and PyFlink imports the job, and
        the job finds its schemas and prompts inside the unpacked zip."""
        app = unpack(built.zip_path, tmp_path)
        code = (
            "import flink_jobs.job, flink_jobs.core.events as e, httpx;"
            "import flink_jobs.core.prompting as p;"
            "e._event_validator(); print(e.SCHEMAS_DIR); print(p.PROMPTS_DIR);"
            "print(httpx.__file__)"
        )
        done = subprocess.run(
            [str(app.python), "-c", code],
            env=app.environment(),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        schemas, prompts, httpx_file = done.stdout.split()
        assert Path(schemas) == app.root / "app" / "flink_jobs" / "schemas"
        assert Path(prompts) == app.root / "app" / "flink_jobs" / "prompts"
        assert Path(httpx_file).is_relative_to(app.root / "site-packages")
