"""The worker processes' lifecycle, with a stand-in for vLLM that serves /health on loopback:
started, waited for, stopped, failed fast, restarted once when silent (planning, which is
pure, is in ``tests/unit/inference_sidecar/test_sidecar_workers.py``)."""

from __future__ import annotations

import os
import socket
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from inference_sidecar.exceptions import ConfigError, WorkerStartError
from inference_sidecar.workers import (
    ClusterConfig,
    WorkerProcesses,
    find_free_port_range,
)
from tests.support.worker_config import resolved

FAKE_VLLM = textwrap.dedent(
    """\
    #!{python}
    # Stands in for vLLM: serves /health on --port, or exits at once if FAKE_EXIT is set.
    import http.server, os, sys, time
    time.sleep(float(os.environ.get("FAKE_SILENT_IMPORT_S", "0")))
    print("fake vllm starting", sys.argv[1:], flush=True)
    if os.environ.get("FAKE_EXIT"):
        print("boom: engine failed", flush=True)
        sys.exit(3)
    marker = os.environ.get("FAKE_HANG_ONCE")
    if marker and not os.path.exists(marker):
        open(marker, "w").close()
        time.sleep(600)  # hangs silently, the first time only
    port = int(sys.argv[sys.argv.index("--port") + 1])
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    path = tmp_path / "fake-python"
    path.write_text(FAKE_VLLM.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


class TestWorkerProcesses:
    def config(self, tmp_path: Path, fake_python: Path, **kw) -> ClusterConfig:
        (tmp_path / "model").mkdir(exist_ok=True)
        return resolved(tmp_path, python=fake_python, base_port=find_free_port_range(3), **kw)

    def test_start_wait_stop(self, tmp_path: Path, fake_python: Path) -> None:
        cfg = self.config(tmp_path, fake_python, mode="disaggregated")
        with WorkerProcesses(cfg, ready_timeout_s=20) as pool:
            assert len(pool.prefill_urls) == 1 and len(pool.decode_urls) == 1
            assert pool.urls == pool.prefill_urls + pool.decode_urls
            pids = [pool.pid(s.name) for s in pool.specs]
            assert pool.kv_dir.is_dir()
        for pid in pids:
            assert pid is not None
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert not pool.kv_dir.exists()
        assert "fake vllm starting" in (tmp_path / "logs" / "decode-0.log").read_text()

    def test_exiting_worker_fails_fast_with_its_log(
        self, tmp_path: Path, fake_python: Path
    ) -> None:
        cfg = self.config(tmp_path, fake_python, env={"FAKE_EXIT": "1"})
        pool = WorkerProcesses(cfg, ready_timeout_s=60)
        with pytest.raises(WorkerStartError, match="boom: engine failed") as err:
            pool.__enter__()
        assert "exited with code" in str(err.value)  # at its exit, not the ready timeout's
        assert err.value.worker.startswith("worker-")

    def test_silent_worker_is_restarted_once(self, tmp_path: Path, fake_python: Path) -> None:
        cfg = self.config(tmp_path, fake_python, env={"FAKE_HANG_ONCE": str(tmp_path / "hung")})
        pool = WorkerProcesses(cfg, ready_timeout_s=30, stall_timeout_s=5.0)
        with pool:
            # the marker is shared: only the worker that started first hung
            assert sum(pool.restarts.values()) == 1

    def test_silence_before_the_first_line_is_not_a_stall(
        self, tmp_path: Path, fake_python: Path
    ) -> None:
        cfg = self.config(tmp_path, fake_python, env={"FAKE_SILENT_IMPORT_S": "4"})
        with WorkerProcesses(cfg, ready_timeout_s=30, stall_timeout_s=1.0) as pool:
            assert pool.restarts == {}

    def test_workers_run_at_the_configured_niceness(
        self, tmp_path: Path, fake_python: Path
    ) -> None:
        cfg = self.config(tmp_path, fake_python, niceness=7)
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        with WorkerProcesses(cfg, ready_timeout_s=20) as pool:
            pids = [pool.pid(s.name) for s in pool.specs]
            assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in pids] == [mine + 7] * 2

    def test_busy_port_is_reported(self, tmp_path: Path, fake_python: Path) -> None:
        cfg = self.config(tmp_path, fake_python)
        with socket.socket() as s:
            s.bind(("127.0.0.1", cfg.base_port))
            s.listen()
            with pytest.raises(ConfigError, match="in use"):
                WorkerProcesses(cfg).start()
