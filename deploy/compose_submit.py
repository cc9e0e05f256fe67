"""The compose stack's job submission (the ``job-submit`` service of docker-compose.yml).

    python -m deploy.compose_submit            # in the application image

1. Ask the JobManager which jobs it runs: a job of the same name that is running (or
   restarting) is left alone, so ``docker compose up`` again never starts a second copy.
2. Otherwise submit ``flink_jobs/job.py`` with ``flink run -d``, restoring the newest
   retained checkpoint under ``job.checkpoint_dir`` when there is one
   (``SI_JOB_RESTORE_FROM=latest``), else starting fresh: the stack picks up where it was
   after ``docker compose down`` and ``up`` (the checkpoint volume outlives the containers;
   ``down -v`` removes it).

The decision (:func:`plan`) is plain data in and out; ``main`` only reads the JobManager's
REST API and the checkpoint folder, and execs ``flink run``. The parallelism is ``flink run
-p`` (``SI_PARALLELISM``), the JobManager ``SI_JOBMANAGER`` (host:port).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from flink_jobs.checkpoints import latest_checkpoint

log = logging.getLogger(__name__)

#: Job states in which a job of that name still holds the pipeline.
ACTIVE_STATES = frozenset(
    {"CREATED", "INITIALIZING", "RUNNING", "RESTARTING", "FAILING", "CANCELLING", "RECONCILING"}
)
JOB_SCRIPT = "/opt/shopper-intents/flink_jobs/job.py"
#: The JobManager answers within a minute of its container starting; job-submit starts
#: after the TaskManagers report healthy, so this bound is for a stack under load.
REST_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Submission:
    """``argv`` to exec, or None with ``reason`` when nothing is to be submitted."""

    argv: tuple[str, ...] | None
    env: Mapping[str, str]
    reason: str


def plan(
    job_name: str,
    jobs: Sequence[Mapping[str, str]],
    checkpoint: Path | None,
    jobmanager: str,
    parallelism: int,
) -> Submission:
    """What to do given the JobManager's jobs (``name``, ``state``) and the newest retained
    checkpoint (None: there is none)."""
    for job in jobs:
        if job.get("name") == job_name and job.get("state") in ACTIVE_STATES:
            return Submission(None, {}, f"{job_name} is already {job['state']}: not submitted")
    argv = ("flink", "run", "-m", jobmanager, "-d", "-p", str(parallelism), "-py", JOB_SCRIPT)
    if checkpoint is None:
        return Submission(argv, {}, "no retained checkpoint: starting fresh")
    return Submission(argv, {"SI_JOB_RESTORE_FROM": "latest"}, f"restoring {checkpoint}")


def running_jobs(jobmanager: str, timeout_s: float = REST_TIMEOUT_S) -> list[dict[str, str]]:
    """The JobManager's jobs (``/jobs/overview``), waiting for it to answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://{jobmanager}/jobs/overview", timeout=5) as r:
                return list(json.load(r)["jobs"])
        except (OSError, urllib.error.URLError, ValueError, KeyError) as exc:
            if time.monotonic() >= deadline:
                raise SystemExit(
                    f"the JobManager at {jobmanager} did not answer within {timeout_s:.0f} s "
                    f"({exc})"
                ) from exc
            time.sleep(1)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="job-submit: %(message)s")
    from flink_jobs.config import load_config

    config = load_config()
    jobmanager = os.environ.get("SI_JOBMANAGER", "jobmanager:8081")
    checkpoint_dir = config.job.checkpoint_dir
    checkpoint = latest_checkpoint(checkpoint_dir) if checkpoint_dir else None
    submission = plan(
        config.job.name,
        running_jobs(jobmanager),
        checkpoint,
        jobmanager,
        int(os.environ.get("SI_PARALLELISM", "2")),
    )
    log.info(submission.reason)
    if submission.argv is None:
        return
    sys.stdout.flush()
    os.execvpe(submission.argv[0], list(submission.argv), {**os.environ, **submission.env})


if __name__ == "__main__":
    main()
