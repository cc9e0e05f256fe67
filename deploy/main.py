"""The Python main file of the Managed Flink application (``main.py`` at the zip's root).

1. Make the zip's Python folders importable in this process (Managed Flink also adds the
   ``pyFiles`` entries to ``PYTHONPATH``; repeating them here keeps ``python main.py``
   working from an unpacked zip).
2. Load and validate the configuration (``/etc/flink/application_properties.json`` when
   deployed; see ``flink_jobs/config.py``).
3. Choose the jars for ``pipeline.jars``: the configured ``job.jars``; else none when
   deployed (Managed Flink already put the ``jarfile`` on the classpath); else the
   zip's own fat jar (a local run of the unpacked zip).
4. Build the job (``flink_jobs.job``) with its metrics under the group Managed Flink
   forwards to CloudWatch (``job.metric_group``: ``KinesisAnalytics`` unless set), and
   run it. The restart strategy is
   the application's: the job sets none unless ``job.restart_strategy`` says so.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
#: The zip's ``pyFiles`` folders, in PYTHONPATH order.
PY_FOLDERS = ("app", "site-packages")
#: The zip's ``jarfile``.
FAT_JAR = "lib/shopper-intents-deps.jar"


def add_python_folders(root: Path = ROOT) -> None:
    for name in reversed(PY_FOLDERS):
        folder = str(root / name)
        if (root / name).is_dir() and folder not in sys.path:
            sys.path.insert(0, folder)


def choose_jars(configured: tuple[str, ...], deployed: bool, root: Path = ROOT) -> list[str]:
    if configured:
        return list(configured)
    if deployed:
        return []
    bundled = root / FAT_JAR
    if not bundled.is_file():
        raise FileNotFoundError(f"{bundled} is missing and job.jars is empty")
    return [str(bundled)]


def main() -> None:
    add_python_folders()
    from flink_jobs.config import MANAGED_FLINK_PROPERTIES, load_config
    from flink_jobs.job import build_environment, build_pipeline
    from flink_jobs.metrics import CLOUDWATCH_METRIC_GROUP

    logging.basicConfig(level=os.environ.get("SI_LOG_LEVEL", "INFO"))
    config = load_config()
    jars = choose_jars(config.job.jars, deployed=MANAGED_FLINK_PROPERTIES.exists())
    if not config.job.metric_group:
        job = dataclasses.replace(config.job, metric_group=CLOUDWATCH_METRIC_GROUP)
        config = dataclasses.replace(config, job=job)
    env = build_environment(config, jars)
    build_pipeline(env, config)
    env.execute(config.job.name)


if __name__ == "__main__":
    main()
