"""What a results file records of the code it ran on: the commit, and whether the tree held
changes not committed. The benchmarks (``bench/_common.py``) and the eval
(``eval_runner``) write it under ``git``; ``bench/report.py`` shows it in the figures table.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def git_state(repo: Path = REPO) -> dict[str, Any]:
    """The commit measured and whether the tree had uncommitted changes (other than the
    results a run before this one just wrote, under ``bench/results``). Outside a git
    checkout: no commit, no changes."""

    def run(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=repo, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "commit": run("rev-parse", "HEAD") or None,
        "dirty": bool(run("status", "--short", "--", ".", ":!bench/results")),
    }
