"""The Managed Flink zip runs the job: unpacked, on a clean interpreter, from its own files.

The zip is built for this interpreter (``--local``), unpacked, and its ``main.py`` is run by
a fresh venv whose ``PYTHONPATH`` holds only the zip's ``pyFiles`` folders and PyFlink with
its requirements (``deploy.local_run``): what Managed Flink gives it. Configuration comes
from a properties file in Managed Flink's format, the connector classes from the zip's fat
jar. Against the session's broker and Redis and a stand-in OpenAI-compatible server (this
test checks the packaging, not the model), 20 events of 5 shoppers must become 5 intents
in Redis.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import orjson
import pytest
import redis

from deploy.local_run import UnpackedApp, unpack
from flink_jobs.tools.local_services import create_topics
from flink_jobs.tools.replay import replay_records
from flink_jobs.tools.run_summary import read_stats
from intent_reader import IntentReader
from tests.support.job_process import job_groups
from tests.support.managed_flink import build_local_zip, shopper_events, write_properties
from tests.support.waiting import until

SHOPPERS = 5
# A bound on the job's start-up (a fresh interpreter, the mini-cluster's JVM, the source's
# first fetch): seconds on a quiet host, minutes beside the model tier's workers on two cores.
JOB_START_TIMEOUT_S = 300.0
INTENTS_TIMEOUT_S = 100.0
STAND_IN_MODEL = "stand-in-model"
STAND_IN_ANSWER = {
    "intents": [{"label": "ready_to_buy", "confidence": 0.9, "category": "Running Shoes"}],
    "summary": "Compared running shoes, then added a pair to the cart",
}


class StandInLlm:
    """A tiny OpenAI-compatible chat endpoint that always gives the same valid intent."""

    def __init__(self) -> None:
        self.session_ids: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                request = orjson.loads(self.rfile.read(length))
                owner.session_ids.append(self.headers.get("X-Session-ID", ""))
                body = orjson.dumps(
                    {
                        "id": f"stand-in-{len(owner.session_ids)}",
                        "object": "chat.completion",
                        "model": request.get("model", STAND_IN_MODEL),
                        "choices": [
                            {
                                "index": 0,
                                "message": {
                                    "role": "assistant",
                                    "content": json.dumps(STAND_IN_ANSWER),
                                },
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": {"prompt_tokens": 100, "completion_tokens": 30},
                    }
                )
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self) -> StandInLlm:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def unpacked_app(tmp_path_factory: pytest.TempPathFactory) -> UnpackedApp:
    result = build_local_zip(tmp_path_factory.mktemp("zip"))
    return unpack(result.zip_path, tmp_path_factory.mktemp("managed-flink"))


def _properties(path: Path, name: str, kafka: str, redis_url: str, llm_url: str) -> Path:
    llm = {"base_url": llm_url, "model": STAND_IN_MODEL, "request_timeout_s": "10"}
    groups = job_groups(name, kafka, redis_url, llm)
    groups["trigger"] = {"quiet_s": "1", "max_wait_s": "2", "min_interval_s": "0"}
    groups["job"] = {"checkpoint_interval_s": "2", "stats_flush_s": "0.5"}
    return write_properties(path, groups)


@pytest.fixture
def running_job(
    unpacked_app: UnpackedApp, kafka_bootstrap: str, redis_url: str, unique_name: str
) -> Iterator[tuple[str, StandInLlm, Path]]:
    workdir = unpacked_app.root.parent
    with StandInLlm() as llm:
        props = _properties(
            workdir / f"{unique_name}.json", unique_name, kafka_bootstrap, redis_url, llm.base_url
        )
        create_topics(kafka_bootstrap, [f"{unique_name}-events", f"{unique_name}-dlq"], 1)
        log_path = workdir / f"{unique_name}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                unpacked_app.command(),
                cwd=workdir,
                env=unpacked_app.environment({"SI_PROPERTIES_FILE": str(props)}),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                _source_task_started(proc, redis_url, unique_name, log_path)
                yield unique_name, llm, log_path
                assert proc.poll() is None, _tail(log_path)
            finally:
                _stop(proc)


def _source_task_started(proc: subprocess.Popen, redis_url: str, name: str, log_path: Path) -> None:
    """Waits until the job counts its source task's start, as the demo waits before its
    replay: the test's intents timeout is then the job's processing alone, not its start-up
    under whatever load the host has."""
    client = redis.Redis.from_url(redis_url)
    until(
        lambda: read_stats(client, name).get("task_starts", 0) >= 1,
        "the job's source task to start",
        timeout_s=JOB_START_TIMEOUT_S,
        interval_s=0.5,
        give_up=lambda: proc.poll() is not None and f"the job exited (code {proc.returncode})",
        explain=lambda: _tail(log_path),
    )
    assert proc.poll() is None, f"the job exited (code {proc.returncode}):\n{_tail(log_path)}"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def test_job_from_the_zip_writes_intents(running_job, kafka_bootstrap: str, redis_url: str):
    name, llm, log_path = running_job
    records = shopper_events(name, SHOPPERS)
    summary = replay_records(kafka_bootstrap, f"{name}-events", records, rate=40.0)
    assert summary.ok, summary.describe(f"{name}-events")

    client = redis.Redis.from_url(redis_url)
    reader = IntentReader(client, prefix=name)
    shoppers = [f"{name}-shopper-{s}" for s in range(SHOPPERS)]
    found: dict = {}

    def every_intent() -> bool:
        found.clear()
        found.update((sid, r) for sid, r in reader.get_many(shoppers).items() if r is not None)
        return len(found) == SHOPPERS

    until(every_intent, f"an intent for each of {SHOPPERS} shoppers",
          timeout_s=INTENTS_TIMEOUT_S, interval_s=1.0,
          explain=lambda: f"intents for {sorted(found)}; job log:\n{_tail(log_path)}")  # fmt: skip

    for shopper_id, result in found.items():
        assert result.top_label == "ready_to_buy"
        assert result.intent["summary"] == STAND_IN_ANSWER["summary"]
        assert result.model == STAND_IN_MODEL
        assert shopper_id in llm.session_ids  # the stickiness header reached the endpoint
    stats = {k.decode(): int(v) for k, v in client.hgetall(f"{name}:stats").items()}
    assert stats.get("events_in", 0) == len(records)
