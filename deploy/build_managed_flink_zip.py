"""Build the application zip for Amazon Managed Service for Apache Flink (Flink 2.2).

    python -m deploy.build_managed_flink_zip          # dist/shopper-intents-managed-flink-py312.zip
    python -m deploy.build_managed_flink_zip --local  # for this interpreter (local smoke tests)

Layout of the zip (paths relative to its root)::

    main.py                            run option `python` (deploy/main.py)
    lib/shopper-intents-deps.jar       run option `jarfile`: one fat jar (Kafka connector,
                                       kafka-clients, zstd-jni, our record deserializer)
    app/flink_jobs/ app/intent_reader/ the packages the job imports (not flink_jobs.tools),
                                       with the schemas and templates as package data
                                       (flink_jobs/schemas/, flink_jobs/prompts/)
    site-packages/                     third-party dependencies, unpacked binary wheels for
                                       the target interpreter (cp312 manylinux by default)
    application_properties.example.json
    BUILD_INFO.json                    target, vendored versions, the merged jars (each
                                       with its version and SHA-256), run options

`app/` and `site-packages/` are the run option `pyFiles` (``app/,site-packages/``).
Steps, in the order ``build`` runs them: stage the main file and the job, vendor the
dependencies (``deploy.vendor``), merge the jars (``deploy.fat_jar``), write the example
properties and build info, zip the staging folder deterministically.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import shutil
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from deploy import fat_jar, vendor
from deploy.main import FAT_JAR, PY_FOLDERS
from flink_jobs.config import BUNDLED_MODEL, AppConfig, config_as_property_groups
from flink_jobs.paths import cache_dir

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
#: The jars merged into the fat jar, in this order (the first copy of a duplicate wins).
OWN_JAR = "shopper-intents-connectors.jar"
JARS = (
    "flink-connector-kafka.jar",
    "kafka-clients.jar",
    "zstd-jni.jar",
    OWN_JAR,
)
RUN_OPTIONS_GROUP = "kinesis.analytics.flink.run.options"
EXAMPLE_PROPERTIES = "application_properties.example.json"
BUILD_INFO = "BUILD_INFO.json"
#: The packages the job imports (``flink_jobs.job`` and what it imports, checked by
#: ``tests/unit/test_managed_flink_zip.py``), copied under app/: the tools, the router and
#: the tests stay out.
APP_PACKAGES = ("flink_jobs", "flink_jobs.core", "flink_jobs.runtime", "intent_reader")
#: Package data the job reads: (folder inside flink_jobs, glob).
APP_DATA = (
    ("schemas", "*.json"),
    ("prompts", "*.j2"),
    (f"prompts/tokenizer/{BUNDLED_MODEL}", "*"),  # the prompt budget's exact count
)

#: Example values for a deployment on AWS (MSK with IAM auth, ElastiCache with TLS).
EXAMPLE_OVERRIDES: dict[str, dict[str, Any]] = {
    "kafka": {
        "bootstrap_servers": (
            "b-1.shopper.abc123.c2.kafka.us-east-1.amazonaws.com:9098,"
            "b-2.shopper.abc123.c2.kafka.us-east-1.amazonaws.com:9098"
        ),
        "client_properties": json.dumps(
            {
                "security.protocol": "SASL_SSL",
                "sasl.mechanism": "AWS_MSK_IAM",
                "sasl.jaas.config": "software.amazon.msk.auth.iam.IAMLoginModule required;",
                "sasl.client.callback.handler.class": (
                    "software.amazon.msk.auth.iam.IAMClientCallbackHandler"
                ),
            }
        ),
    },
    "redis": {"url": "rediss://master.shopper-intents.abc123.use1.cache.amazonaws.com:6379/0"},
    "llm": {"base_url": "http://router.shopper-intents.internal:8000/v1"},
    # parallelism 0: the application's ParallelismConfiguration decides (autoscaling may
    # change it; a value here would pin it).
    "job": {"parallelism": 0, "jars": ""},
}


def run_options() -> dict[str, str]:
    """The ``kinesis.analytics.flink.run.options`` property map for this zip's layout."""
    return {
        "python": "main.py",
        "jarfile": FAT_JAR,
        "pyFiles": ",".join(f"{name}/" for name in PY_FOLDERS),
    }


def example_property_groups() -> list[dict[str, Any]]:
    """Every property group of the job with example deployment values, plus the run options."""
    config = AppConfig().with_overrides(EXAMPLE_OVERRIDES).validate()
    groups = config_as_property_groups(config)
    return [{"PropertyGroupId": RUN_OPTIONS_GROUP, "PropertyMap": run_options()}, *groups]


def example_properties_json() -> str:
    return json.dumps(example_property_groups(), indent=2) + "\n"


@dataclass(frozen=True)
class BuildResult:
    zip_path: Path
    info: dict[str, Any]


def default_jars_dir() -> Path:
    """Where ``scripts/setup.sh`` puts the connector jars: ``$SI_CACHE_DIR/jars``, else
    ``.cache/jars`` in the checkout (``flink_jobs.paths.cache_dir``)."""
    return cache_dir() / "jars"


def jar_version(path: Path) -> str | None:
    """A jar's version as it records it: ``Implementation-Version`` or ``Bundle-Version`` in
    its manifest, or the ``version`` of a ``*-version.properties`` (kafka-clients keeps it
    there); None when it records none."""
    with zipfile.ZipFile(path) as jar:
        names = set(jar.namelist())
        if "META-INF/MANIFEST.MF" in names:
            manifest = jar.read("META-INF/MANIFEST.MF").decode("utf-8", "replace")
            for key in ("Implementation-Version", "Bundle-Version"):
                found = re.search(rf"^{key}:\s*(\S+)", manifest, re.MULTILINE)
                if found:
                    return found.group(1)
        for name in sorted(n for n in names if n.endswith("-version.properties")):
            text = jar.read(name).decode("utf-8", "replace")
            found = re.search(r"^version=(\S+)", text, re.MULTILINE)
            if found:
                return found.group(1)
    return None


def project_version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def jar_record(path: Path) -> dict[str, Any]:
    """What ``BUILD_INFO.json`` says of a merged jar: its name, version and SHA-256. The
    project's own connector jar records none, so it carries the project's version."""
    version = jar_version(path)
    if version is None and path.name == OWN_JAR:
        version = project_version()
    return {
        "name": path.name,
        "version": version,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    }


def zip_name(target: vendor.TargetPlatform) -> str:
    return f"shopper-intents-managed-flink-py{target.python_version.replace('.', '')}.zip"


def build(
    out_dir: Path,
    target: vendor.TargetPlatform,
    jars_dir: Path | None = None,
    extra_jars: Sequence[Path] = (),
    pin_to_installed: bool = True,
) -> BuildResult:
    """Build the zip into ``out_dir`` (see the module docstring) and return where it is.
    ``jars_dir``: the connector jars' folder (default: :func:`default_jars_dir`)."""
    jars_dir = default_jars_dir() if jars_dir is None else jars_dir
    jars = [jars_dir / name for name in JARS] + list(extra_jars)
    missing = [str(j) for j in jars if not j.is_file()]
    if missing:
        raise FileNotFoundError(
            f"missing jars: {', '.join(missing)} (make package-deps, or set SI_CACHE_DIR)"
        )
    with tempfile.TemporaryDirectory(prefix="si-zip-") as tmp:
        stage = Path(tmp)
        shutil.copyfile(REPO / "deploy" / "main.py", stage / "main.py")
        _copy_app(stage / "app")
        plan = vendor.plan(REPO / "pyproject.toml", target, pin_to_installed)
        vendor.vendor(plan.vendored, target, stage / "site-packages")
        fat_jar.merge_jars(jars, stage / FAT_JAR)
        (stage / EXAMPLE_PROPERTIES).write_text(example_properties_json())
        info = {
            "target": asdict(target),
            "requirements": list(plan.requirements),
            "vendored": [d.pin for d in plan.vendored],
            "shadowing_runtime": list(plan.shadowing_runtime),
            "jars": [jar_record(j) for j in jars],
            "run_options": run_options(),
        }
        (stage / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
        out_dir.mkdir(parents=True, exist_ok=True)
        zip_path = out_dir / zip_name(target)
        _zip_folder(stage, zip_path)
    return BuildResult(zip_path, info)


def _copy_app(dest: Path) -> None:
    copies = [(package.replace(".", "/"), "*.py") for package in APP_PACKAGES]
    copies += [(f"flink_jobs/{folder}", pattern) for folder, pattern in APP_DATA]
    for folder, pattern in copies:
        for src in sorted((REPO / folder).glob(pattern)):
            (dest / folder).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest / folder / src.name)  # follows the source tree's links


def _zip_folder(folder: Path, out: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    tmp_out = out.with_suffix(".zip.tmp")
    with zipfile.ZipFile(tmp_out, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in files:
            info = zipfile.ZipInfo(path.relative_to(folder).as_posix(), fat_jar.FIXED_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = (0o755 if path.stat().st_mode & 0o111 else 0o644) << 16
            zf.writestr(info, path.read_bytes())
    tmp_out.replace(out)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m deploy.build_managed_flink_zip",
        description="Build the Managed Service for Apache Flink application zip.",
    )
    default = vendor.TargetPlatform()
    p.add_argument("--out", type=Path, default=REPO / "dist", help="output folder (dist/)")
    p.add_argument(
        "--python-version",
        default=default.python_version,
        help=f"runtime Python (default {default.python_version}, Flink 2.2's)",
    )
    p.add_argument(
        "--platform",
        action="append",
        dest="platforms",
        help=f"wheel platform tag, repeatable (default {default.platforms[0]})",
    )
    p.add_argument(
        "--local", action="store_true", help="build for this interpreter and machine instead"
    )
    p.add_argument("--jars-dir", type=Path, help="the connector jars (default: $SI_CACHE_DIR/jars)")
    p.add_argument(
        "--extra-jar",
        type=Path,
        action="append",
        default=[],
        help="another jar to merge in, e.g. aws-msk-iam-auth-<version>-all.jar for MSK IAM auth",
    )
    p.add_argument(
        "--no-pin",
        action="store_true",
        help="resolve the newest allowed versions instead of the ones installed here",
    )
    p.add_argument(
        "--write-example",
        type=Path,
        metavar="PATH",
        help="only write the example application_properties.json to PATH",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.write_example:
        args.write_example.write_text(example_properties_json())
        print(f"wrote {args.write_example}")
        return 0
    if args.local:
        target = vendor.TargetPlatform.local()
    else:
        platforms = tuple(args.platforms or vendor.TargetPlatform().platforms)
        target = vendor.TargetPlatform(python_version=args.python_version, platforms=platforms)
    try:
        result = build(args.out, target, args.jars_dir, args.extra_jar, not args.no_pin)
    except (FileNotFoundError, vendor.VendorError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    size_mb = result.zip_path.stat().st_size / 1e6
    print(f"built {result.zip_path} ({size_mb:.1f} MB) for {target.implementation}")
    print(f"  python {target.python_version} on {', '.join(target.platforms)}")
    print(f"  vendored: {', '.join(result.info['vendored'])}")
    shadowing = ", ".join(result.info["shadowing_runtime"]) or "-"
    print(f"  also in the runtime (vendored copy first on PYTHONPATH): {shadowing}")
    print(f"  {RUN_OPTIONS_GROUP}: {json.dumps(result.info['run_options'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
