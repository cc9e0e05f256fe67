"""Finding the checkpoint a local run restarts from.

Flink keeps retained checkpoints as ``<checkpoint_dir>/<job id>/chk-<n>/_metadata``; a
restart of the job is a new job id, so "the latest" is the newest completed one across
all of them. Managed Flink restores by itself and never calls this.
"""

from __future__ import annotations

from pathlib import Path

from flink_jobs.config import ConfigError


def latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The newest completed checkpoint (one with ``_metadata``) under ``checkpoint_dir``."""
    completed = Path(checkpoint_dir).glob("*/chk-*/_metadata")
    newest = max(completed, key=lambda p: p.stat().st_mtime_ns, default=None)
    return newest.parent if newest is not None else None


def restore_path(checkpoint_dir: str, restore_from: str) -> str | None:
    """What ``job.restore_from`` names, as a path Flink can restore from; None: a fresh start."""
    if not restore_from:
        return None
    if restore_from != "latest":
        if not Path(restore_from).exists():
            raise ConfigError("job.restore_from", f"{restore_from!r} does not exist")
        return restore_from
    found = latest_checkpoint(checkpoint_dir)
    if found is None:
        raise ConfigError(
            "job.restore_from", f"is 'latest' but {checkpoint_dir!r} holds no completed checkpoint"
        )
    return str(found)
