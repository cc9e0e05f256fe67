"""The compose stack's job submission: restore the newest retained checkpoint when there is
one, start fresh when there is none, and never submit a second copy of a running job."""

from __future__ import annotations

from pathlib import Path

from deploy.compose_submit import JOB_SCRIPT, plan

CHECKPOINT = Path("/opt/flink/checkpoints/4f1c/chk-12")


def test_a_retained_checkpoint_is_restored():
    submission = plan("shopper-intents", [], CHECKPOINT, "jobmanager:8081", 2)
    assert submission.env == {"SI_JOB_RESTORE_FROM": "latest"}
    assert submission.argv == (
        "flink", "run", "-m", "jobmanager:8081", "-d", "-p", "2", "-py", JOB_SCRIPT,
    )  # fmt: skip


def test_without_a_checkpoint_the_job_starts_fresh():
    submission = plan("shopper-intents", [], None, "jobmanager:8081", 2)
    assert submission.argv is not None and submission.env == {}


def test_a_running_job_of_the_same_name_is_left_alone():
    jobs = [{"name": "shopper-intents", "state": "RESTARTING"}]
    submission = plan("shopper-intents", jobs, CHECKPOINT, "jobmanager:8081", 2)
    assert submission.argv is None and "RESTARTING" in submission.reason


def test_a_finished_or_other_job_does_not_block_the_submission():
    jobs = [
        {"name": "shopper-intents", "state": "FAILED"},
        {"name": "another-job", "state": "RUNNING"},
    ]
    assert plan("shopper-intents", jobs, None, "jobmanager:8081", 2).argv is not None
