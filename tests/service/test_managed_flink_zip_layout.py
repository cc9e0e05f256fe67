"""deploy: the built Managed Flink application zip's layout (its fat jar, vendoring,
main file and example properties without a build: ``tests/unit/test_managed_flink_zip.py``).

The zip is built once for this interpreter (``TargetPlatform.local()``: same layout as the
cp312 build, but importable here) and checked for its layout; the job imports from it
alone in a clean interpreter with PyFlink.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from deploy import build_managed_flink_zip as builder
from deploy import vendor
from deploy.local_run import UnpackedApp, unpack
from deploy.main import FAT_JAR, PY_FOLDERS
from flink_jobs.config import read_property_groups
from tests.support.managed_flink import build_local_zip

REPO = Path(__file__).resolve().parents[2]
JOB_JAVA_SOURCES = sorted((REPO / "flink_jobs" / "java" / "shopperintents").glob("*.java"))


# --- the built zip -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> builder.BuildResult:
    return build_local_zip(tmp_path_factory.mktemp("zip"))


def printed_by(app: UnpackedApp, code: str, cwd: Path) -> list[str]:
    """The words ``python -c code`` prints on the unpacked app's clean interpreter, with
    only the zip's folders and PyFlink to import from; it must exit 0."""
    done = subprocess.run(
        [str(app.python), "-c", code],
        env=app.environment(),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


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
        schemas, prompts, httpx_file = printed_by(app, code, tmp_path)
        assert Path(schemas) == app.root / "app" / "flink_jobs" / "schemas"
        assert Path(prompts) == app.root / "app" / "flink_jobs" / "prompts"
        assert Path(httpx_file).is_relative_to(app.root / "site-packages")

    def test_the_job_counts_the_default_templates_tokens_exactly_from_the_zip_alone(
        self, built, tmp_path: Path
    ):
        """The prompt budget's tokenizer (the bundled model's, beside the templates) and the
        tokenizers library come with the zip: without them v3 cannot be shown to fit the
        context, and the job refuses to start (docs/faults.md#prompt-context)."""
        app = unpack(built.zip_path, tmp_path)
        code = (
            "import tokenizers; from flink_jobs.core.token_budget import token_counter;"
            "print(token_counter('auto').method); print(tokenizers.__file__)"
        )
        method, library = printed_by(app, code, tmp_path)
        assert method == "tokenizer"
        assert Path(library).is_relative_to(app.root / "site-packages")
