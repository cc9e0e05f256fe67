"""Child processes we start, watch and stop: vLLM workers, routers, brokers, Redis servers.

``SupervisedProcess`` is the one process handle of the project (``inference_sidecar.workers``
and ``flink_jobs.tools.local_services`` both use it). Each child gets its own process
group, so a stop reaches everything it spawned (vLLM's engine core, a shell's children);
its output is appended to a log file, whose tail goes into every start-up error; a stop
sends SIGTERM to the group, then SIGKILL after a timeout; children still running when the
interpreter exits are stopped.

Errors::

    ProcessError            base of everything raised here
    └── ProcessStartError   the process exited or never became ready (carries the log tail)

A caller with its own error family subclasses both and names them in ``error`` and
``start_error`` of a subclass of ``SupervisedProcess``.

Nothing here imports anything beyond the standard library, and nothing happens at import
time.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, ClassVar, Self

log = logging.getLogger(__name__)

DEFAULT_READY_TIMEOUT_S = 30.0
DEFAULT_STOP_TIMEOUT_S = 10.0
LOG_TAIL_BYTES = 64 * 1024


class ProcessError(RuntimeError):
    """Base error of this module."""


class ProcessStartError(ProcessError):
    """A process exited during start-up or did not become ready in time."""

    def __init__(self, name: str, reason: str, log_path: Path, log_tail: str) -> None:
        self.name = name
        self.reason = reason
        self.log_path = log_path
        self.log_tail = log_tail
        message = f"{name} failed to start: {reason} (log {log_path})"
        if log_tail:
            message += f"; last lines:\n{log_tail}"
        super().__init__(message)


def read_log_tail(path: Path, lines: int, max_bytes: int = LOG_TAIL_BYTES) -> str:
    """The last ``lines`` lines among the last ``max_bytes`` of ``path``; raises ``OSError``."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - max_bytes))
        text = f.read().decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])


_live: set[SupervisedProcess] = set()  #: started and not stopped yet
_live_lock = threading.Lock()
_atexit_registered = False


def _stop_leftovers() -> None:
    with _live_lock:
        leftovers = list(_live)
    for process in leftovers:
        process.stop(timeout_s=2.0)


class SupervisedProcess:
    """A child process in its own process group, its output appended to ``log_path``.

    ``start()`` launches it; ``wait_ready(check)`` polls ``check`` until it returns true and
    raises ``start_error`` (with the log's tail) as soon as the process exits or the timeout
    passes; ``terminate()`` sends SIGTERM to the group without waiting; ``stop()`` sends
    SIGTERM, then SIGKILL after a timeout, and closes the log; ``kill()`` is a crash, not a
    shutdown (fault tests). ``start()`` may be called again once the process has ended.
    """

    error: ClassVar[type[ProcessError]] = ProcessError
    start_error: ClassVar[type[ProcessStartError]] = ProcessStartError

    def __init__(
        self,
        name: str,
        argv: Sequence[str | os.PathLike[str]],
        log_path: Path,
        *,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
        niceness: int = 0,
    ) -> None:
        self.name = name
        self.niceness = niceness
        """Added to the process's scheduling niceness at start (its children inherit it)."""
        self.argv = [os.fspath(a) for a in argv]
        self.log_path = Path(log_path)
        self.cwd = cwd
        self.env = dict(env) if env is not None else None
        """Variables added to this process's environment (None: inherit it unchanged)."""
        self.output_offset = 0
        """Where the child's own output starts in the log (after our header line)."""
        self._popen: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen is not None else None

    @property
    def returncode(self) -> int | None:
        """Exit status once the process has ended (negative: killed by that signal)."""
        return self._popen.poll() if self._popen is not None else None

    @property
    def running(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def start(self) -> Self:
        global _atexit_registered
        if self.running:
            raise self.error(f"{self.name} is already running (pid {self.pid})")
        if self._log_file is not None:  # ended on its own: close the old log handle
            self._log_file.close()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        header = f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting {self.name}: "
        self._log_file.write((header + " ".join(self.argv) + "\n").encode())
        self._log_file.flush()
        self.output_offset = self._log_file.tell()
        env = None if self.env is None else {**os.environ, **self.env}
        self._popen = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            cwd=self.cwd,
            env=env,
            start_new_session=True,  # its own process group: a stop reaches its children
        )
        if self.niceness:
            # Before the child has imported anything, so every process it starts inherits it.
            os.setpriority(
                os.PRIO_PROCESS, self._popen.pid, os.getpriority(os.PRIO_PROCESS, 0) + self.niceness
            )
        with _live_lock:
            _live.add(self)
            if not _atexit_registered:
                atexit.register(_stop_leftovers)
                _atexit_registered = True
        log.debug("started %s (pid %d): %s", self.name, self._popen.pid, self.argv)
        return self

    def wait_ready(
        self,
        check: Callable[[], bool],
        timeout_s: float = DEFAULT_READY_TIMEOUT_S,
        interval_s: float = 0.05,
    ) -> None:
        """Poll ``check()`` until true; fail fast if the process exits meanwhile."""
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.returncode
            if code is not None or self._popen is None:
                raise self.start_error(
                    self.name, f"exited with status {code}", self.log_path, self.log_tail()
                )
            if check():
                return
            if time.monotonic() >= deadline:
                raise self.start_error(
                    self.name, f"not ready after {timeout_s:.0f} s", self.log_path, self.log_tail()
                )
            time.sleep(interval_s)

    def terminate(self) -> None:
        """SIGTERM the process group without waiting (stop several processes at once)."""
        if self.running:
            self.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``timeout_s``; returns the exit status."""
        popen = self._popen
        if popen is None:
            return None
        try:
            if popen.poll() is None:
                self.send_signal(signal.SIGTERM)
                try:
                    popen.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    log.warning("%s ignored SIGTERM for %.0f s; killing it", self.name, timeout_s)
                    self.send_signal(signal.SIGKILL)
                    # A large process can take a moment to be torn down after SIGKILL.
                    popen.wait(timeout=max(timeout_s, DEFAULT_STOP_TIMEOUT_S))
            # Children that outlived the leader (same group) go too.
            self.send_signal(signal.SIGKILL)
        finally:
            with _live_lock:
                _live.discard(self)
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None
        log.debug("stopped %s (pid %d): status %s", self.name, popen.pid, popen.returncode)
        return popen.returncode

    def kill(self, sig: signal.Signals = signal.SIGKILL, timeout_s: float = 10.0) -> int | None:
        """Send ``sig`` to the whole group and reap it: a crash, not a shutdown (faults in
        tests). ``start()`` may be called again afterwards."""
        popen = self._popen
        if popen is None:
            return None
        try:
            self.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=timeout_s)
        finally:
            if popen.poll() is not None:
                self.stop(timeout_s)  # leftovers of the group, the log file
        return popen.returncode

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the process group; a group that is gone already is no error."""
        if self._popen is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._popen.pid, sig)

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the log file."""
        try:
            return read_log_tail(self.log_path, lines)
        except OSError as e:
            return f"(log unreadable: {e})"

    def __enter__(self) -> Self:
        if self._popen is None:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, pid={self.pid}, running={self.running})"
