"""The session's broker works end to end; local services start, fail, stop and restart.

The broker round trip runs against whichever broker the session uses (Apache Kafka in a
container, or Tansu). The restart and failure tests start private local processes, so
they never disturb the session's services.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import redis
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from flink_jobs import paths
from flink_jobs.tools import local_services
from flink_jobs.tools.local_services import (
    LocalProcess,
    ServiceNotInstalledError,
    ServiceStartError,
    create_topics,
    start_redis,
    start_tansu,
)
from tests.support.waiting import until

# --- the session's broker ----------------------------------------------------------------


def _consume(bootstrap: str, topic: str, partitions: int, expected: int) -> list[tuple]:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"{topic}-reader",
            "enable.auto.commit": False,
            "session.timeout.ms": 6000,
        }
    )
    consumer.assign(
        [TopicPartition(topic, p, 0) for p in range(partitions)]  # from the first offset
    )
    received: list[tuple] = []
    deadline = time.monotonic() + 30
    try:
        while len(received) < expected and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None:
                continue
            assert message.error() is None, message.error()
            received.append(
                (message.partition(), message.key(), message.value(), message.headers())
            )
    finally:
        consumer.close()
    return received


def test_broker_produce_consume_round_trip(kafka_bootstrap: str, unique_name: str) -> None:
    topic = f"{unique_name}-events"
    create_topics(kafka_bootstrap, [topic], partitions=3)
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    delivered: list[str] = []
    sent = []
    for i in range(30):
        key = f"shopper-{i % 5}".encode()
        value = f'{{"seq": {i}}}'.encode()
        sent.append((key, value))
        producer.produce(
            topic,
            key=key,
            value=value,
            headers=[("source", b"test")],
            on_delivery=lambda err, _msg: delivered.append("ok" if err is None else str(err)),
        )
    assert producer.flush(30) == 0
    assert delivered == ["ok"] * 30

    received = _consume(kafka_bootstrap, topic, partitions=3, expected=30)

    assert sorted((k, v) for _, k, v, _ in received) == sorted(sent)
    assert all(h == [("source", b"test")] for *_, h in received)
    partition_of: dict[bytes, set[int]] = {}
    for partition, key, _, _ in received:
        partition_of.setdefault(key, set()).add(partition)
    assert all(len(p) == 1 for p in partition_of.values()), "one key, one partition"
    for key in partition_of:  # order per key is kept
        values = [v for _, k, v, _ in received if k == key]
        assert values == [v for k, v in sent if k == key]


def test_create_topics_is_idempotent(kafka_bootstrap: str, unique_name: str) -> None:
    names = [f"{unique_name}-a", f"{unique_name}-b"]
    create_topics(kafka_bootstrap, names, partitions=2)
    create_topics(kafka_bootstrap, [*names, f"{unique_name}-c"], partitions=2)
    topics = AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(timeout=10).topics
    for name in [*names, f"{unique_name}-c"]:
        assert len(topics[name].partitions) == 2


# --- private local services --------------------------------------------------------------


@pytest.fixture
def need_local_binaries(service_backend: str) -> Callable[[Callable[[], Path]], None]:
    """Fail when a binary is missing, except on Docker machines, where it may be absent."""

    def check(locate: Callable[[], Path]) -> None:
        try:
            locate()
        except ServiceNotInstalledError as e:
            if service_backend == "docker":
                pytest.skip(str(e))
            raise

    return check


def test_redis_restart_keeps_the_port(tmp_path: Path, need_local_binaries) -> None:
    need_local_binaries(local_services.redis_server_binary)
    with start_redis(workdir=tmp_path) as service:
        port, url, pid = service.port, service.url, service.process.pid
        client = redis.Redis.from_url(url)
        client.set("k", "v")

        service.restart()

        assert (service.port, service.url) == (port, url)
        assert service.process.pid != pid
        assert client.ping()  # the same client reconnects
        assert client.get("k") is None  # no persistence: a restart starts empty
        client.close()
    assert not service.running


def test_tansu_restart_keeps_the_port(tmp_path: Path, need_local_binaries) -> None:
    need_local_binaries(local_services.tansu_binary)
    with start_tansu(workdir=tmp_path) as service:
        port, bootstrap = service.port, service.bootstrap
        create_topics(bootstrap, ["before-restart"], partitions=1)

        service.restart(down_for_s=0.2)

        assert (service.port, service.bootstrap) == (port, bootstrap)
        create_topics(bootstrap, ["after-restart"], partitions=1)
        topics = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10).topics
        assert "after-restart" in topics
    assert not service.running


def test_port_in_use_is_refused(tmp_path: Path, need_local_binaries) -> None:
    need_local_binaries(local_services.redis_server_binary)
    with start_redis(workdir=tmp_path / "first") as first:
        with pytest.raises(ServiceStartError, match="already in use"):
            start_redis(port=first.port, workdir=tmp_path / "second")
        assert first.running


def test_readiness_fails_fast_with_the_log_tail(tmp_path: Path) -> None:
    process = LocalProcess("doomed", ["sh", "-c", "echo boom >&2; exit 3"], tmp_path / "d.log")
    with process, pytest.raises(ServiceStartError) as caught:
        process.wait_ready(lambda: False, timeout_s=30)
    assert caught.value.reason == "exited with status 3"  # at its exit, not the timeout's
    assert "boom" in caught.value.log_tail
    assert "boom" in str(caught.value)


def test_missing_tansu_names_the_setup_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(paths.CACHE_DIR_ENV, str(tmp_path))
    with pytest.raises(ServiceNotInstalledError, match=r"scripts/setup\.sh"):
        start_tansu(workdir=tmp_path)


def test_stop_escalates_to_sigkill(tmp_path: Path) -> None:
    stubborn = LocalProcess(
        "stubborn", ["sh", "-c", "trap '' TERM; sleep 30 & wait"], tmp_path / "stubborn.log"
    )
    with stubborn:
        # The shell starts its sleep once its trap is installed.
        until(lambda: psutil.Process(stubborn.pid).children(), "the shell's trap", timeout_s=10)
        assert stubborn.stop(timeout_s=0.5) == -9
    assert not stubborn.running


_STARTS_A_SERVICE_THEN_WAITS = """
import sys, time
from pathlib import Path
from flink_jobs.tools.local_services import LocalProcess, stop_on_sigterm
stop_on_sigterm()
service = LocalProcess("sleeper", ["sleep", "120"], Path(sys.argv[1])).start()
print(service.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("started_with_sigterm_blocked", [False, True])
def test_sigterm_to_an_entry_point_stops_the_services_it_started(
    tmp_path: Path, started_with_sigterm_blocked: bool
) -> None:
    """A program inherits its parent's signal mask, so one started by a thread that had
    SIGTERM blocked must unblock it to be stoppable."""
    blocked = {signal.SIGTERM} if started_with_sigterm_blocked else set()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        program = subprocess.Popen(
            [sys.executable, "-c", _STARTS_A_SERVICE_THEN_WAITS, str(tmp_path / "sleeper.log")],
            stdout=subprocess.PIPE,
            text=True,
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
    service_pid = int(program.stdout.readline())
    try:
        program.send_signal(signal.SIGTERM)
        program.wait(timeout=20)
        assert not psutil.pid_exists(service_pid), "the service outlived its program"
    finally:
        program.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(service_pid, signal.SIGKILL)
