"""Security settings, each shown for real; the parts that need no
service are in ``tests/unit/test_security.py``.

- **Redis AUTH and TLS**: a real ``redis-server`` with ``requirepass`` and a TLS port (a
  throwaway CA and server certificate made with ``openssl`` per module). The job's intent
  store (as ``inference.PromptRunner`` builds it from ``redis.url``), the stats reporter and the
  reader all work with ``redis://:password@host:port`` and with
  ``rediss://:password@host:tls_port/0?ssl_ca_certs=<ca.pem>``; the certificate is checked;
  a wrong password fails with an error that says so and carries no password.
- **No secrets in logs**: the code paths that log or raise run with secrets configured
  (a Redis password, an LLM API key, a SASL JAAS password) and fail; the secret appears
  in no exception, no dead-letter record and no log record (captured at DEBUG).
- **The router binds to loopback** unless told otherwise (a real ``inference-sidecar
  router`` process; its listening socket read from ``/proc/net/tcp``).
- **Limits**: ``llm.max_tokens`` is what goes on the wire. (Event size: test_events.py
  ``test_oversized_record_is_refused_before_parsing`` and the property tests; prompt size:
  test_prompting.py ``TestTokenBudget``.)

Kafka TLS/SASL passthrough to the Java source and sink is in
tests/service/test_kafka_security_properties.py (it needs the JVM); the replay tool's
producer is covered in the unit file.

The LLM endpoint below is a stand-in that only ever refuses (401/500) and echoes the
credentials it was sent, as some gateways do: the worst case for leaking the key. It is
not a model server and no test here depends on a model's answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import orjson
import pytest
import redis
import redis.asyncio

from flink_jobs.config import AppConfig, LlmConfig, load_config
from flink_jobs.runtime.counters import StatsReporter, stats_key
from flink_jobs.runtime.inference import (
    PromptRunner,
    PromptTask,
    RedisUnavailable,
    run_task,
    upsert_with_retry,
)
from flink_jobs.runtime.intent_store import (
    AsyncIntentStore,
    IntentRecord,
    IntentStore,
    StoreUnavailableError,
)
from flink_jobs.runtime.llm_client import LlmClient, LlmError
from flink_jobs.tools.local_services import (
    LOOPBACK,
    LocalProcess,
    free_port,
    port_accepts,
    redis_server_binary,
)
from intent_reader import IntentReader, ReaderUnavailableError
from tests.support import builders
from tests.support.builders import intent_record
from tests.support.secret_leaks import (
    API_KEY,
    REDIS_PASSWORD,
    WRONG_PASSWORD,
    assert_no_secret,
    exception_chain,
)
from tests.support.waiting import until

T0 = 1_780_304_400_000
INTENT = {
    "intents": [{"label": "comparing_options", "confidence": 0.7, "category": "headphones"}],
    "summary": "Comparing over-ear headphones.",
}


def record(shopper_id: str, version_ts: int = T0) -> IntentRecord:
    return intent_record(shopper_id, version_ts, 1, intent=INTENT)


def prompt_task(shopper_id: str = "shopper-sec-1") -> PromptTask:
    """A one-event prompt of ``shopper_id``, versioned at ``T0``."""
    return builders.prompt_task(
        shopper_id,
        1,
        at_s=0,
        user="<events>\n+00:00 view\n</events>",
        estimated_tokens=20,
        events_included=1,
    )


# --- a Redis with AUTH and TLS -----------------------------------------------------------


@dataclass(frozen=True)
class SecuredRedis:
    port: int
    tls_port: int
    ca_file: Path

    def url(self, tls: bool, password: str = REDIS_PASSWORD, ca: bool = True) -> str:
        if not tls:
            return f"redis://:{password}@{LOOPBACK}:{self.port}/0"
        query = f"?ssl_ca_certs={self.ca_file}" if ca else ""
        return f"rediss://:{password}@{LOOPBACK}:{self.tls_port}/0{query}"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_tls_material(folder: Path) -> None:
    """A throwaway CA and a server certificate for 127.0.0.1 signed by it."""
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=si-test-ca", cwd=folder,
    )  # fmt: skip
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
        "-subj", "/CN=127.0.0.1", cwd=folder,
    )  # fmt: skip
    (folder / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "1", "-out", "server.crt", "-extfile", "san.cnf", cwd=folder,
    )  # fmt: skip


@pytest.fixture(scope="module")
def secured_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredRedis]:
    folder = tmp_path_factory.mktemp("redis-tls")
    make_tls_material(folder)
    port, tls_port = free_port(), free_port()
    argv = [
        str(redis_server_binary()),
        "--port", str(port),
        "--tls-port", str(tls_port),
        "--bind", LOOPBACK,
        "--requirepass", REDIS_PASSWORD,
        "--tls-cert-file", str(folder / "server.crt"),
        "--tls-key-file", str(folder / "server.key"),
        "--tls-ca-cert-file", str(folder / "ca.crt"),
        "--tls-auth-clients", "no",
        "--save", "",
        "--appendonly", "no",
        "--dir", str(folder),
    ]  # fmt: skip
    process = LocalProcess("redis-tls", argv, folder / "redis.log", cwd=folder).start()
    service = SecuredRedis(port, tls_port, folder / "ca.crt")

    def answers() -> bool:
        client = redis.Redis.from_url(service.url(tls=True), socket_connect_timeout=0.5)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    try:
        process.wait_ready(answers, timeout_s=20)
        yield service
    finally:
        process.stop()


TRANSPORTS = [pytest.param(False, id="auth"), pytest.param(True, id="auth+tls")]


def config_for(redis_url: str, **llm: object) -> AppConfig:
    return load_config(
        overrides={"redis": {"url": redis_url, "key_prefix": "sec"}, "llm": dict(llm)},
        environ={},
    )


def job_intent_store(config: AppConfig) -> AsyncIntentStore:
    """The intent store exactly as the job's LLM calls create it."""
    _llm, store = PromptRunner(config).clients()
    return store


class TestRedisAuthAndTls:
    @pytest.mark.parametrize("tls", TRANSPORTS)
    def test_the_jobs_intent_store_writes_and_the_reader_reads(
        self, secured_redis: SecuredRedis, tls: bool
    ) -> None:
        url = secured_redis.url(tls)
        shopper = f"shopper-{'tls' if tls else 'auth'}-1"

        async def write() -> bool:
            store = job_intent_store(config_for(url))
            try:
                return await store.upsert(record(shopper))
            finally:
                await store.client.aclose()

        assert asyncio.run(write()) is True
        reader = IntentReader.from_url(url, timeout_s=2.0, prefix="sec")
        try:
            intent = reader.get(shopper)
        finally:
            reader.client.close()
        assert intent is not None and intent.top_label == "comparing_options"

    @pytest.mark.parametrize("tls", TRANSPORTS)
    def test_the_stats_reporter_publishes(self, secured_redis: SecuredRedis, tls: bool) -> None:
        url = secured_redis.url(tls)
        prefix = f"sec-stats-{int(tls)}"
        reporter = StatsReporter(url, prefix, flush_interval_s=60)
        reporter.add("events_in", 3)
        reporter.close()  # flushes
        client = redis.Redis.from_url(url)
        try:
            assert client.hget(stats_key(prefix), "events_in") == b"3"
        finally:
            client.close()

    def test_the_tls_port_checks_the_server_certificate(self, secured_redis: SecuredRedis) -> None:
        # Without our CA the system trust store does not know the server's certificate.
        client = redis.Redis.from_url(secured_redis.url(tls=True, ca=False), socket_timeout=2)
        try:
            with pytest.raises(redis.ConnectionError, match=r"(?i)certificate verify failed"):
                client.ping()
        finally:
            client.close()

    def test_no_password_is_refused(self, secured_redis: SecuredRedis) -> None:
        client = redis.Redis(host=LOOPBACK, port=secured_redis.port, socket_timeout=2)
        try:
            with pytest.raises(redis.AuthenticationError):
                client.set("sec:x", "1")
        finally:
            client.close()

    @pytest.mark.parametrize("tls", TRANSPORTS)
    def test_a_wrong_password_fails_clearly_without_the_password(
        self, secured_redis: SecuredRedis, tls: bool, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.DEBUG)
        url = secured_redis.url(tls, password=WRONG_PASSWORD)

        async def write() -> None:
            store = job_intent_store(config_for(url))
            try:
                await store.upsert(record("shopper-wrong-pw"))
            finally:
                await store.client.aclose()

        with pytest.raises(StoreUnavailableError) as raised:
            asyncio.run(write())
        assert "invalid username-password pair" in str(raised.value)

        reader = IntentReader.from_url(url, timeout_s=2.0, prefix="sec")
        with pytest.raises(ReaderUnavailableError) as reader_raised:
            reader.get("shopper-wrong-pw")
        reader.client.close()
        assert "invalid username-password pair" in str(reader_raised.value)

        assert_no_secret(
            *exception_chain(raised.value), *exception_chain(reader_raised.value), caplog.text
        )


# --- no secrets in errors, dead letters or logs ------------------------------------------


class TestNoSecretsInLogs:
    def test_an_unreachable_redis_with_a_password(self, caplog: pytest.LogCaptureFixture) -> None:
        caplog.set_level(logging.DEBUG)
        url = f"redis://:{REDIS_PASSWORD}@{LOOPBACK}:{free_port()}/0"
        store = IntentStore(redis.Redis.from_url(url, socket_connect_timeout=0.5), "sec")
        with pytest.raises(StoreUnavailableError) as sync_raised:
            store.upsert(record("shopper-unreachable"))

        async def write_with_retry() -> None:
            store = job_intent_store(config_for(url))
            try:
                await upsert_with_retry(store, record("shopper-unreachable"), budget_s=0.3)
            finally:
                await store.client.aclose()

        with pytest.raises(RedisUnavailable) as retry_raised:
            asyncio.run(write_with_retry())
        reporter = StatsReporter(url, "sec", flush_interval_s=60)
        reporter.add("events_in")
        reporter.flush()  # fails and logs a warning
        reporter._stop.set()

        assert "Redis write failed" in caplog.text and "could not publish stats" in caplog.text
        assert_no_secret(
            *exception_chain(sync_raised.value),
            *exception_chain(retry_raised.value),
            caplog.text,
            *(repr(r.args) for r in caplog.records),
        )

    @pytest.mark.parametrize("status", [401, 500])
    def test_llm_refusals_that_echo_the_api_key(
        self, refusing_llm: RefusingLlm, status: int, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.DEBUG)
        refusing_llm.status = status
        config = LlmConfig(
            base_url=refusing_llm.base_url,
            api_key=API_KEY,
            max_attempts=2,
            backoff_initial_s=0.01,
            backoff_max_s=0.01,
            request_timeout_s=5.0,
        )

        async def call() -> None:
            client = LlmClient(config)
            try:
                await client.complete(prompt_task().prompt, "shopper-sec-1")
            finally:
                await client.aclose()

        with pytest.raises(LlmError) as raised:
            asyncio.run(call())

        # The key went out, and the server's answer quoted it back.
        assert refusing_llm.authorizations[-1] == f"Bearer {API_KEY}"
        assert raised.value.status == status and "***" in raised.value.detail
        assert_no_secret(
            *exception_chain(raised.value), raised.value.detail, caplog.text, repr(config)
        )

    def test_the_dead_letter_of_a_refused_llm_call(
        self, refusing_llm: RefusingLlm, secured_redis: SecuredRedis
    ) -> None:
        refusing_llm.status = 401
        config = config_for(secured_redis.url(tls=True), base_url=refusing_llm.base_url)
        config = config.with_overrides({"llm": {"api_key": API_KEY, "max_attempts": 1}})

        async def run() -> bytes:
            llm, store = PromptRunner(config).clients()
            try:
                result = await run_task(prompt_task(), llm, store, config.llm.model, 1.0)
            finally:
                await llm.aclose()
                await store.client.aclose()
            assert result.dead_letter is not None
            return result.dead_letter.to_json(T0)

        dead_letter = orjson.loads(asyncio.run(run()))
        assert dead_letter["stage"] == "llm" and dead_letter["context"]["status"] == 401
        assert_no_secret(json.dumps(dead_letter))


# --- the stand-in LLM endpoint: refuses and echoes the credentials it got ----------------


class RefusingLlm:
    def __init__(self) -> None:
        self.status = 401
        self.authorizations: list[str] = []
        self.bodies: list[dict] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                owner.bodies.append(json.loads(self.rfile.read(length) or b"{}"))
                auth = self.headers.get("Authorization", "")
                owner.authorizations.append(auth)
                body = json.dumps({"error": f"rejected credentials: {auth}"}).encode()
                self.send_response(owner.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer((LOOPBACK, 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def refusing_llm() -> Iterator[RefusingLlm]:
    server = RefusingLlm()
    try:
        yield server
    finally:
        server.close()


# --- the router binds to loopback --------------------------------------------------------


def listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} writes them) listening on ``port``."""
    found: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.rpartition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


@contextmanager
def listening_router(port: int, *extra: str) -> Iterator[None]:
    """A router process started with ``extra`` options, once it listens on ``port``;
    terminated on exit."""
    process = subprocess.Popen(
        [sys.executable, "-m", "inference_sidecar", "router", "--port", str(port),
         "--worker", f"http://{LOOPBACK}:{free_port()}", *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        until(
            lambda: listening_addresses(port),
            f"the router to listen on port {port}",
            timeout_s=20,
            interval_s=0.1,
            give_up=lambda: process.poll() is not None and f"exit code {process.returncode}",
        )
        yield
    finally:
        process.terminate()
        process.wait(timeout=10)


class TestRouterBindsToLoopback:
    def test_a_started_router_listens_on_loopback_only(self) -> None:
        port = free_port()
        with listening_router(port):
            assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1, nothing else
            assert port_accepts(LOOPBACK, port)

    def test_host_opens_it_to_other_interfaces_when_asked(self) -> None:
        port = free_port()
        with listening_router(port, "--host", "0.0.0.0"):
            assert listening_addresses(port) == {"00000000"}  # 0.0.0.0


# --- limits ------------------------------------------------------------------------------


class TestLimits:
    def test_llm_max_tokens_is_what_goes_on_the_wire(self, refusing_llm: RefusingLlm) -> None:
        config = LlmConfig(base_url=refusing_llm.base_url, max_tokens=77, max_attempts=1)

        async def call() -> None:
            client = LlmClient(config)
            try:
                await client.complete(prompt_task().prompt, "shopper-sec-1")
            finally:
                await client.aclose()

        with pytest.raises(LlmError):
            asyncio.run(call())
        assert refusing_llm.bodies[-1]["max_tokens"] == 77
