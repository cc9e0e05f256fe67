"""The watermark generator's promises (``EventTimeWatermarks.java``), checked in the JVM.

The spec (``tests/java/EventTimeWatermarksSpec.java``) drives the generator on a clock it
moves by hand: a busy partition, a quiet one, a paused task, a partition without records.
It is compiled here with the job's own Java sources against PyFlink's jars.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pyflink

from flink_jobs.tools.local_services import cache_dir

REPO = Path(__file__).resolve().parents[2]


def test_the_watermark_generator_keeps_its_promises(tmp_path: Path) -> None:
    javac = shutil.which("javac")
    assert javac, "javac not found: run `make setup` (it installs a JDK)"
    classpath = f"{Path(pyflink.__file__).parent / 'lib'}/*:{cache_dir() / 'jars'}/*"
    sources = [
        *sorted((REPO / "flink_jobs" / "java").rglob("*.java")),
        REPO / "tests" / "java" / "EventTimeWatermarksSpec.java",
    ]
    compiled = subprocess.run(
        [javac, "-nowarn", "-d", str(tmp_path), "-cp", classpath, *map(str, sources)],
        capture_output=True,
        text=True,
    )
    assert compiled.returncode == 0, compiled.stderr
    ran = subprocess.run(
        ["java", "-cp", f"{tmp_path}:{classpath}", "shopperintents.EventTimeWatermarksSpec"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout.count("ok: ") == 7, ran.stdout
