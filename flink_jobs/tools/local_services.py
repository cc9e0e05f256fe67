"""Real services started as local processes: the embedded stack and the test fixtures.

The embedded stack (and the tests on a machine without a Docker engine) runs the same
components a deployment talks to, as child processes on loopback ports:

- Redis: Debian's ``redis-server``, no persistence (``--save '' --appendonly no``) unless
  ``persistent=True`` (an fsynced append-only file, for restart tests).
- A Kafka-protocol broker: Tansu, a static binary that ``scripts/setup.sh`` puts in
  ``<cache>/bin/tansu`` (cache = ``$SI_CACHE_DIR``, default ``<repo>/.cache``). It keeps
  everything in memory, so a restart loses the topics and their records.

Building blocks, top down:

- ``start_redis`` / ``start_tansu`` return a started ``RedisService`` / ``KafkaService``
  (``.url`` / ``.bootstrap``, ``.stop()``, ``.restart()`` on the same port, context manager).
- ``create_topics`` creates topics through the Kafka admin API (idempotent).
- ``LocalProcess`` is the process handle under both: its own process group, output to a
  log file, ``stop()`` = SIGTERM then SIGKILL, and a readiness wait that fails fast, with
  the log's tail, when the process exits.

Errors::

    ServiceError                  base of everything raised here
    ├── ServiceNotInstalledError  a binary is missing (run scripts/setup.sh)
    └── ServiceStartError         a process exited or never became ready (carries the log tail)

Nothing here imports PyFlink, and nothing happens at import time.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, cast

from flink_jobs.paths import cache_dir
from inference_sidecar.processes import (
    DEFAULT_READY_TIMEOUT_S,
    DEFAULT_STOP_TIMEOUT_S,
    ProcessError,
    ProcessStartError,
    SupervisedProcess,
)

if TYPE_CHECKING:
    from confluent_kafka.admin import AdminClient

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
_START_ATTEMPTS_ON_FREE_PORT = 3  #: a port picked by free_port() can be taken before bind


# --- errors ------------------------------------------------------------------------------


class ServiceError(ProcessError):
    """Base error of this module."""


class ServiceNotInstalledError(ServiceError):
    """A service's binary is missing."""

    def __init__(self, name: str, looked_at: str) -> None:
        self.name = name
        self.looked_at = looked_at
        super().__init__(
            f"{name} not found ({looked_at}); run scripts/setup.sh to install the embedded stack"
        )


class ServiceStartError(ServiceError, ProcessStartError):
    """A service process exited during start-up or did not become ready in time."""


# --- locating binaries and ports -----------------------------------------------------------


def tansu_binary() -> Path:
    """Path of the Tansu broker binary in the cache folder."""
    path = cache_dir() / "bin" / "tansu"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ServiceNotInstalledError("tansu", str(path))
    return path


def redis_server_binary() -> Path:
    """Path of ``redis-server`` on PATH."""
    found = shutil.which("redis-server")
    if found is None:
        raise ServiceNotInstalledError("redis-server", "not on PATH")
    return Path(found)


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on ``host`` right now (another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_accepts(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether a TCP connection to ``host:port`` succeeds."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


# --- the process handle ------------------------------------------------------------------


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def stop_on_sigterm() -> None:
    """Make SIGTERM unwind the program like Ctrl-C. Its default action ends the interpreter
    without running ``finally`` blocks or ``atexit``, so the brokers, Redis servers and vLLM
    workers a command started would outlive it (``kill`` of a benchmark left five behind).
    SIGTERM is also unblocked: a signal mask is inherited across ``exec``, so a program
    started by a thread that had it blocked would otherwise ignore every SIGTERM (a CI run
    once timed out waiting for one). Entry points call this; a library import never changes
    signal handling."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


class LocalProcess(SupervisedProcess):
    """A ``SupervisedProcess`` whose errors are this module's: ``ServiceError`` and
    ``ServiceStartError`` (with the log's tail)."""

    error = ServiceError
    start_error = ServiceStartError


# --- services ----------------------------------------------------------------------------


class _LocalService:
    """A service on a fixed loopback port, run as a ``LocalProcess`` in ``workdir``.

    Subclasses give the command line and the readiness check. ``restart()`` stops the
    process and starts a new one on the same port.
    """

    name = "service"

    def __init__(
        self,
        port: int | None,
        workdir: Path | str | None,
        ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
    ) -> None:
        self._port_chosen = port is None
        self.port = port if port is not None else free_port()
        self.host = LOOPBACK
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix=f"si-{self.name}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ready_timeout_s = ready_timeout_s
        self.log_path = self.workdir / f"{self.name}.log"
        self.process: LocalProcess | None = None

    def _argv(self) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.running

    def start(self) -> Self:
        """Start the process and wait until it serves; a port picked here is re-picked if taken."""
        if self.running:
            raise ServiceError(f"{self.name} is already running on port {self.port}")
        attempts = _START_ATTEMPTS_ON_FREE_PORT if self._port_chosen else 1
        for attempt in range(1, attempts + 1):
            # Something already answering there would pass the readiness check for us.
            if port_accepts(self.host, self.port):
                if attempt == attempts:
                    reason = f"port {self.port} is already in use"
                    raise ServiceStartError(self.name, reason, self.log_path, "")
                self.port = free_port()
                continue
            self.process = LocalProcess(self.name, self._argv(), self.log_path, cwd=self.workdir)
            self.process.start()
            try:
                self.process.wait_ready(self._ready, timeout_s=self.ready_timeout_s)
            except ServiceStartError:
                self.process.stop()
                if attempt == attempts:
                    raise
                log.debug("%s did not start on port %d; trying another", self.name, self.port)
                self.port = free_port()
            else:
                break
        self._port_chosen = False  # from now on the port is part of the service's identity
        log.info("%s ready on %s:%d", self.name, self.host, self.port)
        return self

    def stop(self, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> None:
        if self.process is not None:
            self.process.stop(timeout_s)

    def restart(self, down_for_s: float = 0.0) -> Self:
        """Stop, optionally stay down ``down_for_s`` seconds, start again on the same port."""
        self.stop()
        if down_for_s > 0:
            time.sleep(down_for_s)
        return self.start()

    def log_tail(self, lines: int = 30) -> str:
        return self.process.log_tail(lines) if self.process is not None else ""

    def __enter__(self) -> Self:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(port={self.port}, running={self.running})"


class RedisService(_LocalService):
    """``redis-server`` on a loopback port; without persistence unless ``persistent``.

    A persistent server appends every write to ``<workdir>/appendonly*`` and fsyncs it
    before answering (``appendfsync always``), so ``restart()`` (same port, same workdir)
    comes back with every acknowledged write: what a test of a Redis restart needs.
    """

    name = "redis"

    def __init__(
        self,
        port: int | None,
        workdir: Path | str | None,
        ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
        persistent: bool = False,
        extra_args: Sequence[str] = (),
    ) -> None:
        super().__init__(port, workdir, ready_timeout_s)
        self.persistent = persistent
        self.extra_args = tuple(extra_args)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def _argv(self) -> list[str]:
        return [
            str(redis_server_binary()),
            "--port", str(self.port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "yes" if self.persistent else "no",
            "--appendfsync", "always",
            "--dir", str(self.workdir),
            *self.extra_args,
        ]  # fmt: skip

    def _ready(self) -> bool:
        import redis

        client = redis.Redis(
            host=self.host, port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5
        )
        try:
            # The server that answers must be ours, not one that held the port before.
            info = cast(dict[str, Any], client.info("server"))
            return self.process is not None and info.get("process_id") == self.process.pid
        except redis.RedisError:
            return False
        finally:
            client.close()


#: The job's source tuning for the local broker (``kafka.source_properties``): Tansu holds a
#: fetch for its whole ``fetch.max.wait.ms`` even with records waiting, where Kafka answers
#: as soon as a record is in, so the client's default (500 ms) would add that much latency
#: to every event. A Kafka broker needs none of it.
LOCAL_BROKER_SOURCE_PROPERTIES = {"fetch.max.wait.ms": "50"}


class KafkaService(_LocalService):
    """The Tansu broker (Kafka protocol, in-memory storage) on a loopback port."""

    name = "tansu"

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def _argv(self) -> list[str]:
        listener = f"tcp://{self.host}:{self.port}"
        return [
            str(tansu_binary()),
            "broker",
            "--listener-url", listener,
            "--advertised-listener-url", listener,
            "--storage-engine", "memory://tansu/",
        ]  # fmt: skip

    def _ready(self) -> bool:
        # A plain TCP probe first keeps librdkafka's connection-refused chatter out of the way.
        if not port_accepts(self.host, self.port):
            return False
        from confluent_kafka import KafkaException

        admin = _quiet_admin(self.bootstrap)
        try:
            admin.list_topics(timeout=2.0)
        except KafkaException:
            return False
        return True


def start_redis(
    port: int | None = None,
    workdir: Path | str | None = None,
    *,
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
    persistent: bool = False,
    extra_args: Sequence[str] = (),
) -> RedisService:
    """Start ``redis-server`` on ``port`` (a free one if None) and wait until it answers PING;
    ``persistent`` keeps its data across ``restart()`` (see ``RedisService``); ``extra_args``
    are more server options (``--cluster-enabled yes``)."""
    return RedisService(port, workdir, ready_timeout_s, persistent, extra_args).start()


def start_tansu(
    port: int | None = None,
    workdir: Path | str | None = None,
    *,
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
) -> KafkaService:
    """Start the Tansu broker on ``port`` (a free one if None); ready when metadata answers."""
    return KafkaService(port, workdir, ready_timeout_s).start()


# --- Kafka admin -------------------------------------------------------------------------


def _quiet_admin(bootstrap: str) -> AdminClient:
    """An admin client that fails fast and logs through this module's logger."""
    from confluent_kafka.admin import AdminClient

    return AdminClient(
        {"bootstrap.servers": bootstrap, "socket.connection.setup.timeout.ms": 2000},
        logger=logging.getLogger(f"{__name__}.librdkafka"),
    )


def create_topics(
    bootstrap: str,
    names: Iterable[str],
    partitions: int = 1,
    *,
    replication_factor: int = 1,
    timeout_s: float = 30.0,
) -> None:
    """Create ``names`` with ``partitions`` each; topics that already exist are left alone.

    Existing topics are not checked for their partition count (Tansu cannot add
    partitions anyway).
    """
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import NewTopic

    wanted = list(dict.fromkeys(names))
    if not wanted:
        return
    admin = _quiet_admin(bootstrap)
    new_topics = [NewTopic(n, partitions, replication_factor) for n in wanted]
    futures = admin.create_topics(
        new_topics,
        operation_timeout=timeout_s,
        request_timeout=timeout_s,
    )
    for name, future in futures.items():
        try:
            future.result(timeout=timeout_s)
            log.debug("created topic %s (%d partitions)", name, partitions)
        except KafkaException as e:
            error = e.args[0] if e.args else None
            if isinstance(error, KafkaError) and error.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                log.debug("topic %s already exists", name)
                continue
            raise ServiceError(f"could not create topic {name!r} on {bootstrap}: {e}") from e
