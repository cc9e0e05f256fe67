"""``WorkerProcesses``: the plan's worker processes, launched, watched and stopped.

Each worker is a ``processes.SupervisedProcess`` (one process group and one log file);
readiness is polled on ``/health`` (failing fast with the log tail when a process dies),
and stopping sends SIGTERM to each whole group, then SIGKILL after a grace period.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import httpx

from inference_sidecar.exceptions import ConfigError, WorkerStartError
from inference_sidecar.processes import SupervisedProcess, read_log_tail
from inference_sidecar.workers.config import ClusterConfig, Role, default_cache_dir
from inference_sidecar.workers.launch import WorkerSpec, plan_workers, port_is_free

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 40


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of a worker's log, after the log's first root-cause lines.

    vLLM's front end prints its own traceback after the engine core's, so the tail of a
    failed start names only "Engine core initialization failed. See root cause above";
    the lines saying what went wrong (``...Error: ...``) come earlier. Empty when there
    is no log.
    """
    try:
        tail = read_log_tail(path, lines)
        with open(path, encoding="utf-8", errors="replace") as f:
            causes = [line.rstrip() for line in f if _ROOT_CAUSE.match(line)]
    except OSError:
        return ""
    causes = [c for c in dict.fromkeys(causes) if c not in tail][:5]
    if not causes:
        return tail
    return "\n".join(["--- error lines earlier in the log ---", *causes, "--- tail ---", tail])


#: An exception line as Python prints it: ``zmq.error.ZMQError: Address already in use``.
_ROOT_CAUSE = re.compile(r"^\s*(?:\(\w+ pid=\d+\)\s*)?[\w.]*(?:Error|Exception): ")


class WorkerProcesses:
    """Launches and owns the worker processes of a ``ClusterConfig``; a context manager.

    ``with WorkerProcesses(cfg) as workers:`` starts every worker, waits until all answer
    ``/health`` (``ready_timeout_s``), and stops them all on exit, even on error.
    """

    def __init__(
        self,
        config: ClusterConfig,
        ready_timeout_s: float = 300.0,
        stall_timeout_s: float = 90.0,
        max_restarts: int = 1,
    ) -> None:
        self.config = config.resolved()
        self.ready_timeout_s = ready_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.max_restarts = max_restarts
        self.restarts: dict[str, int] = {}
        self.kv_dir = (
            (self.config.cache_dir or default_cache_dir())
            / "kv-shared"
            / (f"{self.config.base_port}-{os.getpid()}")
        )
        self.specs = plan_workers(self.config, self.kv_dir)
        self._procs: dict[str, SupervisedProcess] = {}
        self._janitor_stop = threading.Event()
        self._janitor: threading.Thread | None = None

    # ----- addresses ----------------------------------------------------------------

    def _urls(self, *roles: Role) -> list[str]:
        return [s.url for s in self.specs if s.role in roles]

    @property
    def urls(self) -> list[str]:
        """Every worker (aggregated workers, or prefill then decode)."""
        return [s.url for s in self.specs]

    @property
    def prefill_urls(self) -> list[str]:
        return self._urls("prefill")

    @property
    def decode_urls(self) -> list[str]:
        return self._urls("decode")

    @property
    def worker_urls(self) -> list[str]:
        return self._urls("worker")

    @property
    def kv_event_sources(self) -> dict[str, tuple[str, str | None]]:
        """Worker URL -> (KV events endpoint, replay endpoint), for workers publishing."""
        return {s.url: (s.kv_events, s.kv_replay) for s in self.specs if s.kv_events}

    def _bound_ports(self) -> list[int]:
        """The HTTP ports, plus the KV events and replay ports when workers publish them."""
        ports = [s.port for s in self.specs]
        for spec in self.specs:
            for endpoint in (spec.kv_events, spec.kv_replay):
                if endpoint:
                    ports.append(int(endpoint.rsplit(":", 1)[1]))
        return ports

    def pid(self, name: str) -> int | None:
        proc = self._procs.get(name)
        return proc.pid if proc is not None else None

    # ----- lifecycle ----------------------------------------------------------------

    def start(self) -> WorkerProcesses:
        busy = [port for port in self._bound_ports() if not port_is_free(self.config.host, port)]
        if busy:
            raise ConfigError("base_port", f"port(s) already in use: {busy}")
        if self.config.log_dir is not None:
            self.config.log_dir.mkdir(parents=True, exist_ok=True)
        if self.config.mode == "disaggregated" and self.config.kv_connector == "ExampleConnector":
            self.kv_dir.mkdir(parents=True, exist_ok=True)
            self._janitor_stop.clear()
            self._janitor = threading.Thread(
                target=self._prune_kv_store, name="kv-store-janitor", daemon=True
            )
            self._janitor.start()
        try:
            for spec in self.specs:
                self._launch(spec)
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self, spec: WorkerSpec) -> None:
        proc = SupervisedProcess(
            spec.name, spec.argv, spec.log_path, env=spec.env, niceness=self.config.niceness
        )
        self._procs[spec.name] = proc.start()
        log.info("started %s (pid %d) on %s, log %s", spec.name, proc.pid, spec.url, spec.log_path)

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until every worker answers ``GET /health`` with 200.

        Raises ``WorkerStartError`` with the log tail as soon as a worker exits, or
        when the deadline passes. A worker whose log has not grown for
        ``stall_timeout_s`` is killed and started again (at most ``max_restarts``
        times): on a crowded machine vLLM's start-up was seen to hang for good right
        after binding its OpenMP threads, while a second start went through. Silence
        before a worker's first line is not a stall: that is Python importing vLLM,
        which can take minutes on a host with heavy CPU steal, so only the deadline
        bounds it.
        """
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.ready_timeout_s)
        pending = {s.name: s for s in self.specs}
        with httpx.Client(timeout=2.0) as client:
            while pending:
                for name, spec in list(pending.items()):
                    proc = self._procs.get(name)
                    if proc is None:
                        raise WorkerStartError(name, "was never started (call start() first)")
                    code = proc.returncode
                    if code is not None:
                        raise WorkerStartError(
                            name, f"exited with code {code}", log_tail(spec.log_path)
                        )
                    if self._stalled(spec):
                        self._restart(spec)
                        continue
                    try:
                        if client.get(f"{spec.url}/health").status_code == 200:
                            del pending[name]
                            log.info("%s is ready on %s", name, spec.url)
                    except httpx.HTTPError:
                        pass
                if not pending:
                    return
                if time.monotonic() > deadline:
                    name, spec = next(iter(pending.items()))
                    raise WorkerStartError(
                        name,
                        f"not ready after {timeout_s or self.ready_timeout_s:.0f} s",
                        log_tail(spec.log_path),
                    )
                time.sleep(0.5)

    def _stalled(self, spec: WorkerSpec) -> bool:
        if self.restarts.get(spec.name, 0) >= self.max_restarts:
            return False
        try:
            log = spec.log_path.stat()
        except OSError:
            return False
        proc = self._procs.get(spec.name)
        if proc is None or log.st_size <= proc.output_offset:
            return False
        return time.time() - log.st_mtime > self.stall_timeout_s

    def _restart(self, spec: WorkerSpec) -> None:
        log.warning(
            "%s wrote nothing for %.0f s while starting; restarting it",
            spec.name,
            self.stall_timeout_s,
        )
        self._procs.pop(spec.name).kill(signal.SIGKILL)
        self.restarts[spec.name] = self.restarts.get(spec.name, 0) + 1
        self._launch(spec)

    def _prune_kv_store(self) -> None:
        """Delete ExampleConnector KV folders older than ``kv_store_ttl_s``, until stopped.

        Each prompt leaves megabytes of KV on disk; without this the disk fills up.
        """
        ttl = self.config.kv_store_ttl_s
        while not self._janitor_stop.wait(min(ttl / 2, 30.0)):
            prune_older_than(self.kv_dir, time.time() - ttl)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM every worker's process group, then SIGKILL what is left after ``grace_s``."""
        self._janitor_stop.set()
        for name, proc in self._procs.items():
            if proc.running:
                proc.terminate()
                log.info("stopping %s (pid %d)", name, proc.pid)
        deadline = time.monotonic() + grace_s
        for proc in self._procs.values():
            # Also kills what is left of the group: vLLM's engine core runs as a child.
            proc.stop(timeout_s=max(0.1, deadline - time.monotonic()))
        self._procs.clear()
        shutil.rmtree(self.kv_dir, ignore_errors=True)

    def restart(self, name: str, grace_s: float = 15.0) -> None:
        """Stop one worker (its whole group) and start it again with the same command;
        ``wait_ready`` then waits for it. Its KV cache starts empty, as after a crash."""
        spec = next(s for s in self.specs if s.name == name)
        proc = self._procs.pop(name, None)
        if proc is not None:
            proc.terminate()
            proc.stop(timeout_s=grace_s)
        self._launch(spec)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one worker's process group (fault-injection in tests)."""
        self._procs[name].send_signal(sig)

    def __enter__(self) -> WorkerProcesses:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def prune_older_than(directory: Path, cutoff: float) -> int:
    """Remove the entries of ``directory`` last modified before ``cutoff``; returns how many."""
    removed = 0
    try:
        entries = list(directory.iterdir())
    except OSError:
        return 0
    for entry in entries:
        try:
            if entry.stat().st_mtime < cutoff:
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                removed += 1
        except OSError:
            continue
    return removed
