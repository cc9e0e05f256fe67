"""The job as its own process (``python -m flink_jobs.job``), so a test can kill it for
real: SIGKILL to the process group takes the Python driver, the Flink JVM and its Python
workers down at once, as a crashed task manager would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from flink_jobs.tools.flink_cluster import settings_env
from flink_jobs.tools.local_services import LOCAL_BROKER_SOURCE_PROPERTIES
from tests.support.waiting import passes_within


def call_processes(root: int) -> list[int]:
    """Pids of the LLM call processes (``flink_jobs.runtime.call_process``) below ``root``."""
    pids = []
    for child in psutil.Process(root).children(recursive=True):
        try:
            if "flink_jobs.runtime.call_process" in child.cmdline():
                pids.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


def job_groups(
    name: str, bootstrap: str, redis_url: str, llm: Mapping[str, Any]
) -> dict[str, dict[str, Any]]:
    """A job reading ``<name>-events`` from the start, dead letters to ``<name>-dlq``, its
    Redis keys and consumer group named ``name``."""
    return {
        "kafka": {
            "bootstrap_servers": bootstrap,
            "source_properties": LOCAL_BROKER_SOURCE_PROPERTIES,
            "events_topic": f"{name}-events",
            "dead_letter_topic": f"{name}-dlq",
            "group_id": name,
            "starting_offsets": "earliest",
        },
        "redis": {"url": redis_url, "key_prefix": name},
        "llm": dict(llm),
    }


def _inherited_by_accident(name: str) -> bool:
    """This process's own job settings, and PyFlink's in-worker flag: a job run inside the
    test process (loopback mode) sets ``PYFLINK_GATEWAY_DISABLED`` in ``os.environ`` for
    good, and a child that inherits it refuses to start its own gateway."""
    return name.startswith("SI_") or name == "PYFLINK_GATEWAY_DISABLED"


class JobProcess:
    def __init__(
        self,
        groups: Mapping[str, Mapping[str, Any]],
        log_path: Path,
        command: Sequence[str] = ("-m", "flink_jobs.job"),
    ) -> None:
        """``python <command>`` with the job settings ``groups``: the job unless told."""
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if not _inherited_by_accident(k)}
        env.update(settings_env(groups))
        self._log = log_path.open("wb")
        self._proc = subprocess.Popen(
            [sys.executable, *command],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self._proc.pid

    def running(self) -> bool:
        return self._proc.poll() is None

    def wait(self, timeout_s: float) -> int:
        """The exit code of a job that ends by itself (a bounded input)."""
        return self._proc.wait(timeout=timeout_s)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the job's log, for a failed wait to show."""
        return f"job log tail:\n{self.log_text()[-chars:]}"

    def exited(self) -> str | None:
        """Why a wait on this job can stop (``give_up`` of ``tests.support.waiting``): that
        it exited, with its code, or ``None`` while it runs."""
        code = self._proc.poll()
        return None if code is None else f"the job exited (code {code})"

    def waits(
        self, timeout_s: float, interval_s: float = 0.5, state: Callable[[], object] | None = None
    ) -> dict[str, Any]:
        """The settings of a wait on something this job does: ``until(check, what,
        **job.waits(timeout_s))`` stops as soon as the job exits and shows ``state()`` (what
        was still missing) and the end of the job's log."""

        def explain() -> str:
            return f"{state()}\n{self.log_tail()}" if state is not None else self.log_tail()

        return {
            "timeout_s": timeout_s,
            "interval_s": interval_s,
            "give_up": self.exited,
            "explain": explain,
        }

    def kill(self) -> None:
        """SIGKILL the whole process group: no shutdown hooks, no final checkpoint."""
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=30)
        # The JVM's Python workers may outlive the group leader for a moment.
        passes_within(self._group_gone_after_kill, 10, interval_s=0.2)
        self._log.close()

    def _group_gone_after_kill(self) -> bool:
        """Whether the process group is gone; a SIGKILL to whatever is left of it."""
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return True
        return False
