"""Which checkpoint a local run restarts from."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flink_jobs.checkpoints import latest_checkpoint, restore_path
from flink_jobs.config import AppConfig, ConfigError


def completed(root: Path, job_id: str, n: int, mtime: int) -> Path:
    chk = root / job_id / f"chk-{n}"
    chk.mkdir(parents=True)
    (chk / "_metadata").write_bytes(b"meta")
    os.utime(chk / "_metadata", (mtime, mtime))
    return chk


def test_the_latest_is_the_newest_completed_checkpoint_across_job_ids(tmp_path: Path) -> None:
    completed(tmp_path, "a1", 7, mtime=1_000)
    newest = completed(tmp_path, "b2", 2, mtime=2_000)

    assert latest_checkpoint(tmp_path) == newest


def test_a_checkpoint_without_metadata_is_not_complete(tmp_path: Path) -> None:
    done = completed(tmp_path, "a1", 3, mtime=1_000)
    (tmp_path / "a1" / "chk-4").mkdir()

    assert latest_checkpoint(tmp_path) == done


def test_no_restore_is_a_fresh_start(tmp_path: Path) -> None:
    assert restore_path(str(tmp_path), "") is None


def test_restoring_latest_from_an_empty_folder_says_there_is_none(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="holds no completed checkpoint"):
        restore_path(str(tmp_path), "latest")


def test_restoring_from_a_missing_path_names_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        restore_path(str(tmp_path), str(tmp_path / "chk-9"))


def test_restoring_latest_needs_a_checkpoint_dir() -> None:
    with pytest.raises(ConfigError, match=r"needs job\.checkpoint_dir"):
        AppConfig().with_overrides({"job": {"restore_from": "latest"}}).validate()


def test_a_negative_out_of_orderness_bound_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"job\.out_of_orderness_s: must be >= 0"):
        AppConfig().with_overrides({"job": {"out_of_orderness_s": "-1"}}).validate()
