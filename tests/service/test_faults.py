"""Faults injected for real while the whole pipeline runs: nothing is lost, nothing is silent.

One scenario is shared by the tests of this module (a PyFlink run costs minutes here). It
runs on a private stack, because it breaks it: a persistent Redis, a Tansu broker, two LLM
stand-ins (``bench/standin_llm.py``: the model is not the subject here; the router's
failover with real vLLM workers is ``tests/model/test_router_vllm.py``'s), the real router
in front of them, and a fault proxy (``fault_proxy.py``) between the router and the second
worker. 36 shoppers' sessions
(six minutes of event time, bad and duplicate records mixed in) are replayed at 2.5x,
event times rebased to the send time, but the last records trickle at 1x while faults
remain: each fault finds prompts flowing however long the ones before it took. One fault
at a time, each bounded in count and time, the first once the router has a request in
flight, and when each happened is recorded:

while all but the last 30 records are sent
    the proxied worker answers with prose instead of an intent, then with 503s, then with
    cut-off JSON, then slowly (6 s late); Redis is stopped with answers on their way
    and started again once one has reached the job (same port, append-only file kept);
    the router is killed with requests in flight and started again on the same port; the
    direct worker is killed with requests in flight. Then the job settles, and its counts
    must balance exactly.
last
    the broker is stopped for 5 s and started again on the same port (Tansu keeps its log
    in memory, so the test writes both topics' records back at their offsets: what a
    broker with durable storage comes back with), and the last records are sent, two bad
    ones among them so that dead letters go through the restarted broker. This fault
    comes last because it makes the job restart from its checkpoint (see
    ``TestBrokerRestarted``), which counts some records twice.

Each test checks one promise: every qualifying shopper ends with a valid intent or a dead
letter saying why, the counts balance, and each fault left its own evidence (router
metrics, proxy counts, the job's retry counters and log, its status history). The run's
figures go to ``<cache>/reports/faults.json``.
"""

from __future__ import annotations

import base64
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import fastjsonschema
import httpx
import orjson
import pytest
import redis

from flink_jobs.config import AppConfig, load_config
from flink_jobs.core.events import load_schema
from flink_jobs.tools.embedded_stack import start_standin_workers
from flink_jobs.tools.local_services import (
    LOCAL_BROKER_SOURCE_PROPERTIES,
    KafkaService,
    LocalProcess,
    RedisService,
    cache_dir,
    create_topics,
    free_port,
    http_ok,
    start_redis,
    start_tansu,
)
from flink_jobs.tools.replay import ReplaySummary, replay_records
from flink_jobs.tools.run_summary import (
    EVENT_OUTCOMES,
    IntentRow,
    is_settled,
    prompts_settled,
    read_dead_letters,
    read_intents,
    read_stats,
)
from flink_jobs.tools.sample_data import SampleConfig, generate_sample
from tests.support.fault_proxy import BAD_INTENT_TEXT, FaultProxy, FaultWindow
from tests.support.metrics_text import metric_sum
from tests.support.waiting import WaitFailed, held_for, passes_within, until

pytestmark = pytest.mark.timeout(15 * 60)

SHOPPERS = 36
SEED = 23
# Each answer takes 1-3 s (seeded), long enough that a fault waiting for a request in
# flight to its victim finds one.
STANDIN_LATENCY = "uniform:1.0,3.0"
# A router attempt gives up first (the slow fault adds 6 s to at most 3), then the job's.
ROUTER_REQUEST_TIMEOUT_S = 15
LLM_REQUEST_TIMEOUT_S = 30.0
# Prompts must still flow when the last fault needs them, and often enough that each
# proxy fault ends before its window. A replay at one speed was too short for the faults
# on a slow host however it was sized (24 shoppers over four minutes, then 36 over six,
# each left the last faults with nothing in flight). So the replay is paced by the
# faults: SPEED, but while they run the last RESERVE records trickle at TRICKLE_SPEED
# (about 100 s more traffic), sent in chunks of CHUNK records.
DURATION_S = 360.0
SPEED = 2.5
TRICKLE_SPEED = 1.0
RESERVE = 80
CHUNK = 20
TAIL = 30  # the last records, sent after the broker restart
# Sent after the broker restart too, so dead letters are written through the restarted
# broker: a record that is not JSON and one that is not an event.
AFTER_BROKER_BAD_RECORDS = [b"{not json", b'{"shopper_id": "shopper-00001"}']
# (mode, faulty answers, extra arguments); each fault lasts at most PROXY_FAULT_MAX_S and
# starts once a request is in flight to the proxied worker (at most IN_FLIGHT_WAIT_S).
PROXY_FAULTS: list[tuple[str, int, dict]] = [
    ("bad_intent", 6, {}),
    # Five: an answer the worker was computing before the fault began may still arrive
    # after its first 503 and break the run of failures that ejects it.
    ("5xx", 5, {}),
    ("invalid_json", 3, {}),
    # Last, and two: the router steers new shoppers away from a worker that answered
    # slowly (for up to a minute), so more came too rarely, and a fault after it once
    # saw no request at all in its 25 s.
    ("slow", 2, {"delay_s": 6.0}),
]
PROXY_FAULT_MAX_S = 40.0
# What the router counts a proxy fault's answers as (the others are answers to it).
ROUTER_ERROR_KINDS = {"5xx": "status_5xx", "invalid_json": "invalid_response"}
# Redis stays down until an answer has reached the job and the job has failed to write it
# (its retry is logged), at least REDIS_MIN_DOWN_S and at most REDIS_MAX_DOWN_S (well inside
# the write retry budget). A fixed second after the router's answer was once too short.
REDIS_RETRY_LOG = "Redis write failed"  # flink_jobs.runtime.inference.upsert_with_retry's warning
REDIS_MIN_DOWN_S = 3.0
REDIS_MAX_DOWN_S = 20.0
ROUTER_DOWN_S = 2.0
BROKER_DOWN_S = 5.0
# Tansu creates a topic with 4 partitions for a client that asks for one it lacks, and the
# job's clients reconnect as soon as the restarted broker listens, before the test can
# create the topics. With the same count, whoever creates them, they are the topics the
# job had; a topic deleted and created again under the job's clients stalled its source.
PARTITIONS = 4
IN_FLIGHT_WAIT_S = 20.0  # how long a kill waits for requests in flight to its victim
FIRST_REQUEST_WAIT_S = 90.0  # the job's start-up and its first prompts
# The dead-letter sink's producer gives up on a record after this (Kafka's default is
# 120 s); see TestBrokerRestarted.
DELIVERY_TIMEOUT_MS = 20_000
SETTLE_TIMEOUT_S = 4 * 60
JOB_STATUS_POLL_S = 0.5


# --- the stack's moving parts --------------------------------------------------------------


class Router:
    """``python -m inference_sidecar router`` as the pipeline runs it, on a fixed port so a
    restart keeps the job's ``llm.base_url`` valid."""

    def __init__(self, workers: list[str], log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "inference_sidecar", "router", "--port", str(self.port)]
        argv += ["--health-interval", "1", "--request-timeout", str(ROUTER_REQUEST_TIMEOUT_S)]
        for worker in workers:
            argv += ["--worker", worker]
        self.process = LocalProcess("router", argv, log_dir / "router.log")

    def start(self) -> Router:
        self.process.start()
        self.process.wait_ready(lambda: http_ok(f"{self.url}/health"), timeout_s=30)
        return self

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text

    def stop(self) -> None:
        self.process.stop()


# --- the broker's log, kept across a restart ---------------------------------------------


@dataclass
class TopicLog:
    """Every record of a topic: partition -> [(key, value, timestamp_ms)] in offset order."""

    topic: str
    partitions: dict[int, list[tuple[bytes | None, bytes, int]]]

    @property
    def ends(self) -> dict[int, int]:
        return {p: len(records) for p, records in self.partitions.items()}

    @property
    def count(self) -> int:
        return sum(self.ends.values())


def snapshot_topic(bootstrap: str, topic: str, idle_s: float = 2.0) -> TopicLog:
    """Read ``topic`` from offset 0 until nothing new comes for ``idle_s`` seconds.

    (Tansu's reported high watermarks are not the end of the log when an idempotent
    producer wrote it, so the end is found by reading.)
    """
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"snapshot-{time.time_ns()}",
            "enable.auto.commit": False,
        }
    )
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        log = TopicLog(topic, {p: [] for p in partitions})
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        deadline = time.monotonic() + 60
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < idle_s:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic} kept growing for 60 s")
            msg = consumer.poll(0.2)
            if msg is None or msg.error():
                continue
            records = log.partitions[msg.partition()]
            assert msg.offset() == len(records), f"{topic} has a gap at {msg.offset()}"
            records.append((msg.key(), msg.value(), msg.timestamp()[1]))
            quiet_since = time.monotonic()
    finally:
        consumer.close()
    return log


def recreate_topics(bootstrap: str, topics: list[str]) -> None:
    """Create ``topics`` on the restarted broker, unless the job's clients made it do so
    first, and check that they have the partitions they had (see ``PARTITIONS``)."""
    from confluent_kafka.admin import AdminClient

    create_topics(bootstrap, topics, PARTITIONS)
    listed = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10).topics
    counts = {t: len(listed[t].partitions) if t in listed else 0 for t in topics}
    assert set(counts.values()) == {PARTITIONS}, f"topics came back with {counts} partitions"


def restore_topic(bootstrap: str, log: TopicLog) -> None:
    """Write ``log`` back to its (empty, recreated) topic: same partitions, same offsets."""
    from confluent_kafka import Producer

    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "acks": "all",
            "enable.idempotence": False,
            "max.in.flight.requests.per.connection": 1,
            "linger.ms": 5,
        }
    )
    for partition, records in log.partitions.items():
        for key, value, timestamp_ms in records:
            producer.produce(
                log.topic, value=value, key=key, partition=partition, timestamp=timestamp_ms
            )
    assert producer.flush(30) == 0, f"could not restore {log.topic}"
    restored = snapshot_topic(bootstrap, log.topic, idle_s=1.0)
    assert restored.partitions == log.partitions, f"{log.topic} was not restored as it was"


# --- the scenario --------------------------------------------------------------------------


@dataclass
class Fault:
    name: str
    started_at: float  # epoch s
    ended_at: float
    detail: dict = field(default_factory=dict)


@dataclass
class Scenario:
    config: AppConfig
    expected: dict
    produced: int  # records sent in all
    produced_before_broker: int
    after_broker_bad_records: list[bytes]
    faults: dict[str, Fault]
    proxy_windows: dict[str, FaultWindow]
    proxy_shoppers: dict[str, list[str]]  # shoppers whose requests a proxy fault changed
    proxy_url: str
    direct_url: str
    router_metrics_after_proxy_fault: dict[str, str]  # mode -> router metrics once it ended
    router_metrics_before_restart: str
    router_metrics_after_kill: str
    stats_by_fault: dict[str, dict[str, int]]  # stats read when each fault started
    stats_before_broker: dict[str, int]
    settled_before_broker: bool
    stats: dict[str, int]
    settled: bool
    intents: dict[str, IntentRow]
    dead_letters: list[dict]
    job_statuses: list[tuple[float, str]]  # (epoch s, status) at each change
    redis_retry_log: list[str]  # the job's "Redis write failed ... retrying" warnings
    trickled: int  # records sent at TRICKLE_SPEED, waiting for the faults
    faults_lasted_s: float  # from the job's submission to the kill, the last fault
    elapsed_s: float

    def restarts_between(self, start: float, end: float) -> int:
        return sum(1 for t, s in self.job_statuses if s == "RESTARTING" and start <= t <= end)

    def dead_letters_of(self, shopper_id: str) -> list[dict]:
        return [d for d in self.dead_letters if d.get("shopper_id") == shopper_id]


class JobWatcher:
    """Polls the job's status in a thread and keeps every change with its time: a restart
    shows as RESTARTING (the restart strategy waits 5 s), a loud failure as FAILED."""

    def __init__(self, job_client) -> None:
        self.job_client = job_client
        self.statuses: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="job-watcher", daemon=True)
        self._thread.start()

    @property
    def current(self) -> str:
        return self.statuses[-1][1] if self.statuses else "UNKNOWN"

    @property
    def ended(self) -> bool:
        """FAILED, CANCELED, or gone (a local cluster shuts down with its failed job)."""
        return self.current in ("FAILED", "CANCELED", "FINISHED") or self.current.startswith(
            "UNREACHABLE"
        )

    @property
    def restarted(self) -> bool:
        return any(s == "RESTARTING" for _, s in self.statuses)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                status = str(self.job_client.get_job_status().result()).rsplit(".", 1)[-1]
            except Exception as exc:  # a finished job stops answering
                status = f"UNREACHABLE({type(exc).__name__})"
            if status != self.current:
                self.statuses.append((time.time(), status))
            if status in ("FAILED", "CANCELED", "FINISHED") or status.startswith("UNREACHABLE"):
                return
            self._stop.wait(JOB_STATUS_POLL_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class Injector:
    """Runs fault steps in a thread; an exception in a step is re-raised by ``join``."""

    def __init__(self, name: str, steps: Callable[[], None]) -> None:
        self.error: BaseException | None = None
        self.ended_at: float | None = None  # time.monotonic()

        def run() -> None:
            try:
                steps()
            except BaseException as exc:  # handed to join()
                self.error = exc
            finally:
                self.ended_at = time.monotonic()

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return self.ended_at is not None

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"{self._thread.name} still running after {timeout_s:.0f} s")
        if self.error is not None:
            raise self.error


def replay_paced_by_faults(
    bootstrap: str, topic: str, records: list, faults: Injector
) -> tuple[list[ReplaySummary], int]:
    """Send ``records`` at SPEED, but the last RESERVE at TRICKLE_SPEED while ``faults``
    runs. Returns each chunk's summary and how many records trickled."""
    summaries: list[ReplaySummary] = []
    trickled = 0
    for start in range(0, len(records), CHUNK):
        chunk = records[start : start + CHUNK]
        trickle = len(records) - start <= RESERVE and not faults.done
        speed = TRICKLE_SPEED if trickle else SPEED
        summaries.append(replay_records(bootstrap, topic, chunk, speed=speed, rebase_time="send"))
        trickled += len(chunk) if trickle else 0
    return summaries, trickled


@pytest.fixture(scope="module")
def scenario() -> Iterator[Scenario]:
    from flink_jobs.job import create_job

    # Under the cache, not tmp_path: concurrent pytest runs rotate old tmp_path folders.
    workdir = cache_dir() / "logs" / "test-faults" / str(os.getpid())
    sample = generate_sample(SampleConfig(shoppers=SHOPPERS, seed=SEED, duration_s=DURATION_S))
    main, tail = sample.records[:-TAIL], [*sample.records[-TAIL:], *AFTER_BROKER_BAD_RECORDS]
    name = f"faults-{time.monotonic_ns()}"

    with ExitStack() as stack:
        redis_service: RedisService = stack.enter_context(
            start_redis(workdir=workdir / "redis", persistent=True)
        )
        broker: KafkaService = stack.enter_context(start_tansu(workdir=workdir / "tansu"))
        direct_worker, proxied_worker = start_standin_workers(
            workdir / "llm", stack, workers=2, latency=STANDIN_LATENCY, seed=SEED
        )
        proxy = FaultProxy(proxied_worker.url, free_port())
        stack.callback(proxy.close)
        router = Router([direct_worker.url, proxy.url], workdir / "llm").start()
        stack.callback(router.stop)

        config = load_config(
            overrides={
                "kafka": {
                    "bootstrap_servers": broker.bootstrap,
                    "source_properties": LOCAL_BROKER_SOURCE_PROPERTIES,
                    "events_topic": f"{name}-events",
                    "dead_letter_topic": f"{name}-dlq",
                    "group_id": name,
                    "starting_offsets": "earliest",
                    "client_properties": {
                        "delivery.timeout.ms": str(DELIVERY_TIMEOUT_MS),
                        "request.timeout.ms": str(DELIVERY_TIMEOUT_MS // 2),
                    },
                },
                "redis": {"url": redis_service.url, "key_prefix": name},
                # Six attempts: the client's backoff (0.5 s doubling, jittered) then spans
                # at least 7.75 s, longer than a router restart takes. Four calls at once.
                "llm": {
                    "base_url": f"{router.url}/v1",
                    "max_concurrency": 4,
                    "request_timeout_s": LLM_REQUEST_TIMEOUT_S,
                },
                "job": {"checkpoint_interval_s": 5},
            },
            environ={},
        )
        topics = [config.kafka.events_topic, config.kafka.dead_letter_topic]
        create_topics(broker.bootstrap, topics, PARTITIONS)
        client = redis.Redis.from_url(redis_service.url, socket_timeout=5)
        stack.callback(client.close)
        faults: dict[str, Fault] = {}
        stats_by_fault: dict[str, dict[str, int]] = {}
        metrics_before_restart: list[str] = []
        metrics_after_proxy_fault: dict[str, str] = {}
        redis_retry_lines: list[str] = []

        def stats_now() -> dict[str, int]:
            try:
                return read_stats(client, config.redis.key_prefix)
            except redis.RedisError:
                return {}

        def began(fault: str) -> float:
            stats_by_fault[fault] = stats_now()
            return time.time()

        def in_flight(**labels: str) -> Callable[[], bool]:
            def check() -> bool:
                try:
                    text = router.metrics()
                except httpx.HTTPError:
                    return False
                return metric_sum(text, "inference_sidecar_worker_in_flight", **labels) > 0

            return check

        def answers_sent() -> float:
            try:
                text = router.metrics()
            except httpx.HTTPError:
                return 0.0
            return metric_sum(text, "inference_sidecar_requests_total", status="200")

        def fault_answered(mode: str) -> Callable[[], bool]:
            """Every answer the fault changed has left the proxy, and the router has
            counted each one it takes for a failure."""

            def check() -> bool:
                if proxy.changing:
                    return False
                kind = ROUTER_ERROR_KINDS.get(mode)
                if kind is None:
                    return True
                try:
                    text = router.metrics()
                except httpx.HTTPError:
                    return False
                errors = metric_sum(
                    text, "inference_sidecar_worker_errors_total", worker=proxy.url, kind=kind
                )
                return errors >= proxy.served[mode]

            return check

        def inject_faults() -> None:
            passes_within(in_flight(), FIRST_REQUEST_WAIT_S, interval_s=0.25)
            for mode, count, extra in PROXY_FAULTS:
                passes_within(in_flight(worker=proxy.url), IN_FLIGHT_WAIT_S, interval_s=0.25)
                began(mode)
                proxy.inject(mode, count, PROXY_FAULT_MAX_S, **extra)
                proxy.wait_done(PROXY_FAULT_MAX_S + 5)
                passes_within(fault_answered(mode), ROUTER_REQUEST_TIMEOUT_S, interval_s=0.25)
                metrics_after_proxy_fault[mode] = router.metrics()

            # Redis goes away while answers are on their way, and comes back once one has
            # reached the job and its write has failed: that write has to wait for it.
            busy = passes_within(in_flight(), IN_FLIGHT_WAIT_S, interval_s=0.25)
            pid_before = redis_service.process.pid
            answered_before = answers_sent()
            retries_before = len(_job_log_lines(REDIS_RETRY_LOG))
            started = began("redis")
            redis_service.stop()
            time.sleep(REDIS_MIN_DOWN_S)
            answered = passes_within(
                lambda: answers_sent() > answered_before,
                REDIS_MAX_DOWN_S - REDIS_MIN_DOWN_S,
                interval_s=0.25,
            )
            passes_within(
                lambda: len(_job_log_lines(REDIS_RETRY_LOG)) > retries_before,
                max(0.0, started + REDIS_MAX_DOWN_S - time.time()),
                interval_s=0.25,
            )
            # Kept now: the Flink log file is shared by every PyFlink run from this venv,
            # and another run starting truncates it.
            redis_retry_lines.extend(_job_log_lines(REDIS_RETRY_LOG))
            redis_service.start()
            written_before = stats_by_fault["redis"].get("intents_written", 0)
            faults["redis"] = Fault(
                "redis",
                started,
                time.time(),
                {
                    "in_flight": busy,
                    "answered_while_down": answered,
                    "pid_before": pid_before,
                    "pid_after": redis_service.process.pid,
                },
            )
            passes_within(  # the job writes again before the next fault
                lambda: stats_now().get("intents_written", 0) > written_before,
                IN_FLIGHT_WAIT_S,
                interval_s=0.25,
            )

            metrics_before_restart.append(router.metrics())
            pid_before = router.process.pid
            passes_within(in_flight(), IN_FLIGHT_WAIT_S, interval_s=0.25)
            started = began("router")
            # Checked again with nothing between it and the kill: reading the job's counters
            # took long enough on a loaded host for the request seen first to be answered.
            busy = passes_within(in_flight(), IN_FLIGHT_WAIT_S, interval_s=0.05)
            router.process.kill()
            time.sleep(ROUTER_DOWN_S)
            router.start()
            faults["router"] = Fault(
                "router",
                started,
                time.time(),
                {"in_flight": busy, "pid_before": pid_before, "pid_after": router.process.pid},
            )
            # The restarted router answers again before the next fault.
            passes_within(lambda: answers_sent() > 0, IN_FLIGHT_WAIT_S, interval_s=0.25)

            passes_within(in_flight(worker=direct_worker.url), IN_FLIGHT_WAIT_S, interval_s=0.25)
            started = began("worker_kill")
            busy = passes_within(
                in_flight(worker=direct_worker.url), IN_FLIGHT_WAIT_S, interval_s=0.05
            )
            direct_worker.process.kill()
            faults["worker_kill"] = Fault("worker_kill", started, time.time(), {"in_flight": busy})

        job = create_job(config).execute_async(name)
        watcher = JobWatcher(job)
        stack.callback(watcher.stop)
        try:
            started = time.monotonic()
            injector = Injector("faults", inject_faults)
            chunks, trickled = replay_paced_by_faults(
                broker.bootstrap, config.kafka.events_topic, main, injector
            )
            for sent in chunks:
                assert sent.ok, sent.describe(config.kafka.events_topic)
            injector.join(6 * 60)
            faults_lasted_s = injector.ended_at - started
            for mode, window in _windows_by_mode(proxy.windows).items():
                faults[mode] = Fault(mode, window.started_at, window.ended_at)
            stats_before_broker, settled_before_broker = _settled_stats(
                stats_now, config, len(main), watcher
            )
            router_metrics_after_kill = router.metrics()

            # The broker, last: its restart makes the job restart (see TestBrokerRestarted),
            # which would blur the other faults' evidence. Tansu keeps its log in memory,
            # so the test keeps both topics' records and writes them back at their offsets.
            logs = [snapshot_topic(broker.bootstrap, t) for t in topics]
            broker_started = began("broker")
            broker.stop()
            time.sleep(BROKER_DOWN_S)
            broker.start()
            recreate_topics(broker.bootstrap, topics)
            for log in logs:
                restore_topic(broker.bootstrap, log)
            broker_up = time.time()
            sent = replay_records(
                broker.bootstrap, config.kafka.events_topic, tail, speed=SPEED, rebase_time="send"
            )
            assert sent.ok, sent.describe(config.kafka.events_topic)
            produced = len(main) + len(tail)
            stats, settled = _settled_stats(stats_now, config, produced, watcher)
            faults["broker"] = Fault(
                "broker",
                broker_started,
                broker_up,
                {
                    "restored": {log.topic: sum(log.ends.values()) for log in logs},
                    "settled_after_s": round(time.time() - broker_up, 1) if settled else None,
                },
            )
            elapsed_s = time.monotonic() - started
        finally:
            watcher.stop()
            if watcher.current in ("RUNNING", "RESTARTING", "CREATED", "INITIALIZING"):
                try:
                    job.cancel().result()
                except Exception as exc:  # the job ended meanwhile (its status says how)
                    watcher.statuses.append((time.time(), f"GONE({type(exc).__name__})"))

        dead_letters = read_dead_letters(
            broker.bootstrap, topics[1], expected=_dead_letters_counted(stats), timeout_s=10
        )
        run = Scenario(
            config=config,
            expected=orjson.loads(sample.expected.to_json()),
            produced=produced,
            produced_before_broker=len(main),
            after_broker_bad_records=list(AFTER_BROKER_BAD_RECORDS),
            faults=faults,
            proxy_windows=_windows_by_mode(proxy.windows),
            proxy_shoppers={m: sorted(set(s)) for m, s in proxy.shoppers.items()},
            proxy_url=proxy.url,
            direct_url=direct_worker.url,
            router_metrics_after_proxy_fault=metrics_after_proxy_fault,
            router_metrics_before_restart=metrics_before_restart[0],
            router_metrics_after_kill=router_metrics_after_kill,
            stats_by_fault=stats_by_fault,
            stats_before_broker=stats_before_broker,
            settled_before_broker=settled_before_broker,
            stats=stats,
            settled=settled,
            intents={r.shopper_id: r for r in read_intents(client, config.redis.key_prefix)},
            dead_letters=dead_letters,
            job_statuses=list(watcher.statuses),
            redis_retry_log=sorted({*redis_retry_lines, *_job_log_lines(REDIS_RETRY_LOG)}),
            trickled=trickled,
            faults_lasted_s=faults_lasted_s,
            elapsed_s=elapsed_s,
        )
        _write_report(run)
        yield run


def _dead_letters_counted(stats: dict[str, int]) -> int:
    """Dead letters the job has emitted, by its own counters."""
    return (
        stats.get("dead_letter_decode", 0)
        + stats.get("dead_letter_inference", 0)
        + stats.get("dead_letter_prompt", 0)
        + stats.get("events_late_dropped", 0)
    )


def _windows_by_mode(windows: list[FaultWindow]) -> dict[str, FaultWindow]:
    return {w.mode: w for w in windows}


def _job_log_lines(text: str) -> list[str]:
    """Lines of this process's Flink log (the Python workers' logging lands there too)."""
    import pyflink

    logs = sorted((Path(pyflink.__file__).parent / "log").glob("flink-*.log"))
    lines: list[str] = []
    for path in logs:
        with open(path, errors="replace") as f:
            # Lines can start with NUL padding where another process's writer truncated
            # the shared log while this one appended (a CI run saw one).
            lines += [line.rstrip().lstrip("\x00") for line in f if text in line]
    return lines


def _log_time(line: str) -> float:
    """Epoch seconds of a log4j line (``2026-11-22 07:55:08,393 WARN ...``, local time)."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _settled_stats(
    read: Callable[[], dict[str, int]], config: AppConfig, produced: int, watcher: JobWatcher
) -> tuple[dict[str, int], bool]:
    """The stats once every record and prompt has an outcome and they stay put for longer
    than the trigger's max wait, and whether that came. A job that restarted counts the
    records read after its last checkpoint twice, so then every record merely has to be in
    and the stats still. Gives up when the job fails (loudly: the tests see the status) or
    after the timeout."""

    def done() -> dict[str, int] | None:
        if watcher.ended:
            return None
        stats = read()
        finished = is_settled(stats, produced) or (
            watcher.restarted and stats.get("events_in", 0) >= produced
        )
        return stats if finished else None

    still = held_for(done, config.trigger.max_wait_s + 5, unchanged=True)
    try:
        stats = until(
            still,
            "the job to settle",
            timeout_s=SETTLE_TIMEOUT_S,
            interval_s=1.0,
            give_up=lambda: watcher.ended and f"the job is {watcher.current}",
        )
    except WaitFailed:
        return read(), False
    return stats, True


def _write_report(run: Scenario) -> None:
    report = {
        "shoppers": SHOPPERS,
        "records": run.produced,
        "records_trickled": run.trickled,
        "faults_lasted_s": round(run.faults_lasted_s, 1),
        "elapsed_s": round(run.elapsed_s, 1),
        "settled_before_broker": run.settled_before_broker,
        "settled": run.settled,
        "job_statuses": [(round(t, 1), s) for t, s in run.job_statuses],
        "faults": {
            name: {
                "started_at": round(f.started_at, 1),
                "lasted_s": round(f.ended_at - f.started_at, 1),
                **f.detail,
            }
            for name, f in run.faults.items()
        },
        "proxy_answers": {m: w.served for m, w in run.proxy_windows.items()},
        "redis_write_retries_logged": len(run.redis_retry_log),
        "intents": len(run.intents),
        "dead_letters": dict(Counter(f"{d['stage']}/{d['reason']}" for d in run.dead_letters)),
        "stats_before_broker": run.stats_before_broker,
        "stats": run.stats,
    }
    out = cache_dir() / "reports" / "faults.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    print("\nfaults report:", out.read_text())


# --- nothing lost ------------------------------------------------------------------------


def _unique_decode_dead_letters(dead_letters: list[dict]) -> dict[tuple, dict]:
    """Decode dead letters by source position (a job restart may write one twice)."""
    return {
        (d["source"]["partition"], d["source"]["offset"]): d
        for d in dead_letters
        if d["stage"] == "decode"
    }


class TestNothingLost:
    def test_the_job_settled_after_every_fault(self, scenario: Scenario):
        assert scenario.settled_before_broker, scenario.stats_before_broker
        assert scenario.settled, (scenario.job_statuses, scenario.stats)

    def test_every_qualifying_shopper_has_an_intent_or_a_dead_letter(self, scenario: Scenario):
        qualifying = scenario.expected["qualifying_shoppers"]
        neither = [
            s for s in qualifying if s not in scenario.intents and not scenario.dead_letters_of(s)
        ]
        assert not neither, f"{len(neither)} shoppers with neither: {neither}"

    def test_every_intent_is_schema_valid(self, scenario: Scenario):
        validate = fastjsonschema.compile(load_schema("shopper_intent.schema.json"))
        assert scenario.intents
        for row in scenario.intents.values():
            validate(row.intent)

    def test_every_dead_letter_says_why(self, scenario: Scenario):
        for d in scenario.dead_letters:
            assert d["stage"] and d["reason"] and d["detail"], d

    def test_no_prompt_was_dead_lettered_for_an_unreachable_llm(self, scenario: Scenario):
        """Router failover and the client's retries absorbed every infrastructure fault."""
        assert not [d for d in scenario.dead_letters if d["stage"] == "llm"]

    def test_the_counts_balance_before_the_broker_restart(self, scenario: Scenario):
        """Up to the broker restart the job never restarted, so the counts are exact:
        ``events_in = accepted + late_folded + duplicate + late_dropped + decode dead
        letters``, and every prompt sent has an outcome."""
        s = scenario.stats_before_broker
        assert scenario.restarts_between(0, scenario.faults["broker"].started_at) == 0
        assert s["events_in"] == scenario.produced_before_broker
        assert sum(s.get(name, 0) for name in EVENT_OUTCOMES) == s["events_in"]
        assert prompts_settled(s) == s["prompts_sent"] > 0

    def test_after_the_job_restart_every_record_is_counted_at_least_once(self, scenario: Scenario):
        """The stats hash is at-least-once: after a restart from a checkpoint the records
        read since that checkpoint are counted again."""
        s = scenario.stats
        assert s["events_in"] >= scenario.produced
        assert sum(s.get(name, 0) for name in EVENT_OUTCOMES) >= scenario.produced

    def test_each_bad_record_is_dead_lettered_with_its_reason(self, scenario: Scenario):
        unique = _unique_decode_dead_letters(scenario.dead_letters)
        expected = Counter(scenario.expected["dead_letter_by_reason"])
        expected.update(["malformed_json", "schema_violation"])  # AFTER_BROKER_BAD_RECORDS
        assert Counter(d["reason"] for d in unique.values()) == expected


# --- each fault's own evidence ---------------------------------------------------------------


class TestSlowWorker:
    def test_slowed_answers_were_used(self, scenario: Scenario):
        assert scenario.proxy_windows["slow"].served >= 1
        slowed = scenario.proxy_shoppers["slow"]
        assert slowed and all(s in scenario.intents for s in slowed), slowed


class TestWorkerAnswersProse:
    def test_answers_that_are_not_intents_are_dead_lettered_with_the_answer(
        self, scenario: Scenario
    ):
        """The job asks once more (the router keeps the shopper on the same worker), then
        dead-letters the prompt with the answer it got."""
        assert scenario.proxy_windows["bad_intent"].served >= 1
        refused = [d for d in scenario.dead_letters if d["stage"] == "intent"]
        assert refused, "no prose answer was dead-lettered"
        for d in refused:
            assert d["reason"] == "not_json"
            assert d["context"]["answer"] == BAD_INTENT_TEXT
            assert d["shopper_id"] in scenario.proxy_shoppers["bad_intent"]

    def test_those_shoppers_end_with_an_intent_or_that_dead_letter(self, scenario: Scenario):
        for shopper in scenario.proxy_shoppers["bad_intent"]:
            assert shopper in scenario.intents or scenario.dead_letters_of(shopper), shopper


class TestWorker5xx:
    def test_router_counted_each_503_and_failed_over(self, scenario: Scenario):
        served = scenario.proxy_windows["5xx"].served
        text = scenario.router_metrics_before_restart
        errors = metric_sum(
            text,
            "inference_sidecar_worker_errors_total",
            worker=scenario.proxy_url,
            kind="status_5xx",
        )
        assert served >= 1 and errors == served
        assert metric_sum(text, "inference_sidecar_routing_decisions_total",
                          decision="failed_over") >= served  # fmt: skip

    def test_503s_in_a_row_ejected_the_worker(self, scenario: Scenario):
        """``HealthConfig.consecutive_failures``: three failures in a row eject a worker
        whatever its peers do (the prose answers before were successes to the router)."""
        assert scenario.proxy_windows["5xx"].served == _faulty_answers()["5xx"]
        after = scenario.router_metrics_after_proxy_fault
        ejections = [
            metric_sum(
                after[mode],
                "inference_sidecar_ejections_total",
                worker=scenario.proxy_url,
                reason="consecutive_failures",
            )
            for mode in ("bad_intent", "5xx")
        ]
        assert ejections[1] - ejections[0] >= 1, ejections

    def test_the_job_never_saw_the_errors(self, scenario: Scenario):
        """Every request the proxied worker failed was answered by the other one."""
        assert _errors_answered_during(scenario, "5xx") == 0


def _faulty_answers() -> dict[str, int]:
    """Mode -> how many answers the proxy changes."""
    return {mode: count for mode, count, _ in PROXY_FAULTS}


def _errors_answered_during(scenario: Scenario, mode: str) -> float:
    """Requests the router answered with a server error (what the job would retry), from
    the end of the proxy fault before ``mode`` to the end of it. (A call the job stops
    because a newer prompt superseded it ends with a client-side status, not counted.)"""
    order = [m for m, _, _ in PROXY_FAULTS]
    before = scenario.router_metrics_after_proxy_fault[order[order.index(mode) - 1]]
    after = scenario.router_metrics_after_proxy_fault[mode]

    def errors(text: str) -> float:
        name = "inference_sidecar_requests_total"
        return sum(metric_sum(text, name, status=str(s)) for s in range(500, 512))

    return errors(after) - errors(before)


def _failed_over_during(scenario: Scenario, mode: str) -> float:
    """Router failovers from the end of the proxy fault before ``mode`` to the end of it."""
    order = [m for m, _, _ in PROXY_FAULTS]
    before = scenario.router_metrics_after_proxy_fault[order[order.index(mode) - 1]]
    after = scenario.router_metrics_after_proxy_fault[mode]
    name = "inference_sidecar_routing_decisions_total"
    return metric_sum(after, name, decision="failed_over") - metric_sum(
        before, name, decision="failed_over"
    )


class TestWorkerInvalidJson:
    def test_router_counted_each_cut_off_body_and_failed_over(self, scenario: Scenario):
        served = scenario.proxy_windows["invalid_json"].served
        errors = metric_sum(
            scenario.router_metrics_before_restart,
            "inference_sidecar_worker_errors_total",
            worker=scenario.proxy_url,
            kind="invalid_response",
        )
        assert served >= 1 and errors == served

    def test_each_cut_off_body_was_retried_on_the_next_worker(self, scenario: Scenario):
        """The router tried the other worker and answered the job, and every shopper whose
        answer was cut off has an intent."""
        served = scenario.proxy_windows["invalid_json"].served
        assert _failed_over_during(scenario, "invalid_json") >= served >= 1
        assert _errors_answered_during(scenario, "invalid_json") == 0
        cut_off = scenario.proxy_shoppers["invalid_json"]
        assert cut_off and all(s in scenario.intents for s in cut_off), cut_off


class TestWorkerKilled:
    def test_it_was_killed_with_requests_in_flight(self, scenario: Scenario):
        assert scenario.faults["worker_kill"].detail["in_flight"]

    def test_router_saw_it_fail_failed_over_and_marked_it_down(self, scenario: Scenario):
        text = scenario.router_metrics_after_kill
        failures = metric_sum(
            text, "inference_sidecar_worker_errors_total", worker=scenario.direct_url
        )
        down = metric_sum(
            text, "inference_sidecar_health_events_total", worker=scenario.direct_url, event="down"
        )
        failed_over = metric_sum(
            text, "inference_sidecar_routing_decisions_total", decision="failed_over"
        )
        assert failures >= 1 and down == 1 and failed_over >= 1, (failures, down, failed_over)


class TestRedisRestarted:
    def test_it_was_a_new_server_with_the_old_data(self, scenario: Scenario):
        detail = scenario.faults["redis"].detail
        assert detail["pid_before"] != detail["pid_after"]
        before = scenario.stats_by_fault["redis"]
        assert before.get("intents_written", 0) > 0
        assert all(scenario.stats.get(k, 0) >= v for k, v in before.items())

    def test_writes_were_retried_while_it_was_down(self, scenario: Scenario):
        fault = scenario.faults["redis"]
        assert fault.detail["in_flight"] and fault.detail["answered_while_down"]
        during = [
            line
            for line in scenario.redis_retry_log
            if fault.started_at - 1 <= _log_time(line) <= fault.ended_at + 1
        ]
        assert during, scenario.redis_retry_log

    def test_the_job_waited_instead_of_restarting(self, scenario: Scenario):
        """The outage is shorter than ``redis.write_retry_budget_s``: back-pressure, no
        restart, intents kept coming after it."""
        fault = scenario.faults["redis"]
        assert fault.ended_at - fault.started_at < scenario.config.redis.write_retry_budget_s
        assert scenario.restarts_between(fault.started_at, fault.ended_at + 30) == 0
        assert [r for r in scenario.intents.values() if r.written_at_ms / 1000 > fault.ended_at]


class TestRouterRestarted:
    def test_it_was_killed_with_requests_in_flight_and_came_back(self, scenario: Scenario):
        detail = scenario.faults["router"].detail
        assert detail["in_flight"]
        assert detail["pid_before"] != detail["pid_after"]

    def test_the_job_retried_its_calls(self, scenario: Scenario):
        """(The faults after this one are absorbed by the router, so the retries counted
        from here to the broker restart are this fault's.)"""
        before = scenario.stats_by_fault["router"].get("llm_retries", 0)
        assert scenario.stats_before_broker.get("llm_retries", 0) > before


class TestBrokerRestarted:
    def test_the_job_recovered_or_failed_loudly_never_stalled(self, scenario: Scenario):
        """Every record sent after the restart has an outcome (recovered), or the job's
        status is FAILED (loud). Neither within the bound is a silent stall."""
        statuses = [s for _, s in scenario.job_statuses]
        loud = statuses[-1] == "FAILED" or statuses[-1].startswith("UNREACHABLE")
        assert scenario.settled or loud, (statuses, scenario.stats)

    def test_the_records_sent_after_the_restart_were_read(self, scenario: Scenario):
        assert scenario.stats["events_in"] >= scenario.produced

    def test_dead_letters_written_after_the_restart_reach_the_topic(self, scenario: Scenario):
        raw = {
            base64.b64decode(d["raw_base64"])
            for d in _unique_decode_dead_letters(scenario.dead_letters).values()
        }
        assert set(scenario.after_broker_bad_records) <= raw
