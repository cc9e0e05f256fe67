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
- ``start_redis_cluster`` returns a started ``RedisClusterService``: a Redis Cluster of
  ``redis-server`` processes, primaries and replicas, with the roles and slot owners its
  nodes report (``primaries()``, ``replicas_of()``, ``owner_of(slot)``), for tests that
  move slots or kill a primary.
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

import httpx

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


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """Whether a GET of ``url`` answers 200: a readiness probe, so a server that cannot be
    reached yet is a no, not an error."""
    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
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


class RedisClusterService:
    """A Redis Cluster of ``primaries`` ``redis-server`` processes (``--cluster-enabled yes``),
    each with ``replicas`` replicas, on loopback ports: what a test of slot migration or
    failover needs.

    The cluster is formed by hand over redis-py, as ``redis-cli --cluster create`` would:
    the slots split in equal ranges over the primaries, a distinct config epoch per node,
    ``CLUSTER MEET``, ``CLUSTER REPLICATE``; then ``start()`` waits until every node says
    ``cluster_state:ok``, knows every other node and every replica's link is up.
    ``node_timeout_ms`` (``cluster-node-timeout``) is how long a node may be unreachable
    before the others fail it over: short here, so a test's failover takes seconds.
    """

    name = "redis-cluster"

    def __init__(
        self,
        workdir: Path | str | None = None,
        *,
        primaries: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = 1000,
        ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
    ) -> None:
        if primaries < 1 or replicas < 0:
            raise ValueError("a cluster needs a primary, and no negative count of replicas")
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="si-redis-cluster-"))
        self.primaries_wanted = primaries
        self.replicas_wanted = replicas
        self.node_timeout_ms = node_timeout_ms
        self.ready_timeout_s = ready_timeout_s
        self.nodes: list[RedisService] = []
        #: Each node's cluster bus port, by its client port.
        self.bus_ports: dict[int, int] = {}

    def _node_args(self, index: int, bus_port: int) -> list[str]:
        return [
            "--cluster-enabled", "yes",
            "--cluster-config-file", str(self.workdir / f"nodes-{index}.conf"),
            "--cluster-node-timeout", str(self.node_timeout_ms),
            # The bus port is picked free like the client port: the default, the client
            # port plus 10000, is past 65535 for a port from the upper ephemeral range.
            "--cluster-port", str(bus_port),
            # A replica's first sync starts at once, not after the default 5 s wait for
            # other replicas to join it.
            "--repl-diskless-sync-delay", "0",
        ]  # fmt: skip

    @property
    def url(self) -> str:
        """A URL of a running node, from which a cluster client finds the others."""
        return next(n.url for n in self.nodes if n.running)

    def client(self, node: RedisService) -> Any:
        import redis

        return redis.Redis(host=node.host, port=node.port, socket_timeout=5)

    def start(self) -> Self:
        import redis

        total = self.primaries_wanted * (1 + self.replicas_wanted)
        try:
            for index in range(total):
                self.nodes.append(self._start_node(index))
            clients = [self.client(n) for n in self.nodes]
            try:
                self._form(clients)
            finally:
                for c in clients:
                    c.close()
            self.wait_ok(self.ready_timeout_s)
        except (ServiceError, redis.RedisError, TimeoutError):
            self.stop()
            raise
        log.info("%s ready: %s", self.name, ", ".join(str(n.port) for n in self.nodes))
        return self

    def _start_node(self, index: int) -> RedisService:
        """Node ``index`` on a free client port and a free bus port, picked again should
        another process take either before the server binds it."""
        for attempt in range(1, _START_ATTEMPTS_ON_FREE_PORT + 1):
            port, bus_port = free_port(), free_port()
            if port == bus_port:
                continue
            node = RedisService(
                port, self.workdir / f"node-{index}", self.ready_timeout_s,
                extra_args=self._node_args(index, bus_port),
            )  # fmt: skip
            try:
                node.start()
            except ServiceStartError:
                if attempt == _START_ATTEMPTS_ON_FREE_PORT:
                    raise
                continue
            self.bus_ports[node.port] = bus_port
            return node
        raise ServiceStartError(self.name, "no two free ports for a node", self.workdir, "")

    def _form(self, clients: list[Any]) -> None:
        primaries = clients[: self.primaries_wanted]
        bounds = [(16384 * i) // len(primaries) for i in range(len(primaries) + 1)]
        for i, client in enumerate(primaries):
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", bounds[i], bounds[i + 1] - 1)
        for epoch, client in enumerate(clients, start=1):
            client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", epoch)
        for node in self.nodes[1:]:
            bus_port = self.bus_ports[node.port]
            clients[0].execute_command("CLUSTER", "MEET", node.host, node.port, bus_port)
        self._wait(lambda: all(_knows(c, len(clients)) for c in clients), "every node to meet")
        ids = [_text(c.execute_command("CLUSTER", "MYID")) for c in clients]
        for index in range(self.primaries_wanted, len(clients)):
            primary = (index - self.primaries_wanted) % self.primaries_wanted
            clients[index].execute_command("CLUSTER", "REPLICATE", ids[primary])

    def wait_ok(self, timeout_s: float | None = None) -> None:
        """Until every running node says ``cluster_state:ok`` and knows every node, and every
        running replica's link to its primary is up."""

        def settled() -> bool:
            import redis

            for node in self.nodes:
                if not node.running:
                    continue
                client = self.client(node)
                try:
                    info = client.cluster("info")
                    if info.get("cluster_state") != "ok" or not _knows(client, len(self.nodes)):
                        return False
                    replication = client.info("replication")
                    if (
                        replication.get("role") == "slave"
                        and replication.get("master_link_status") != "up"
                    ):
                        return False
                except redis.RedisError:
                    return False
                finally:
                    client.close()
            return True

        self._wait(settled, "the cluster to settle", timeout_s)

    def _wait(self, check: Any, what: str, timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (timeout_s or self.ready_timeout_s)
        while not check():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: timed out waiting for {what}")
            time.sleep(0.05)

    def role_of(self, node: RedisService) -> str:
        """``master`` or ``slave``, as the node itself says (INFO replication)."""
        client = self.client(node)
        try:
            return str(client.info("replication")["role"])
        finally:
            client.close()

    def primaries(self) -> list[RedisService]:
        """The running nodes that are primaries now."""
        return [n for n in self.nodes if n.running and self.role_of(n) == "master"]

    def replicas_of(self, primary: RedisService) -> list[RedisService]:
        """The running nodes that replicate ``primary`` now."""
        found = []
        for node in self.nodes:
            if node is primary or not node.running:
                continue
            client = self.client(node)
            try:
                info = client.info("replication")
            finally:
                client.close()
            if info.get("role") == "slave" and int(info.get("master_port", -1)) == primary.port:
                found.append(node)
        return found

    def node_id(self, node: RedisService) -> str:
        client = self.client(node)
        try:
            return _text(client.execute_command("CLUSTER", "MYID"))
        finally:
            client.close()

    def owner_of(self, slot: int) -> RedisService:
        """The primary that serves ``slot``, as a running node's ``CLUSTER SLOTS`` says."""
        for node in self.nodes:
            if not node.running:
                continue
            client = self.client(node)
            try:
                for start, end, primary, *_ in client.execute_command("CLUSTER", "SLOTS"):
                    if start <= slot <= end:
                        return next(n for n in self.nodes if n.port == int(primary[1]))
            finally:
                client.close()
        raise ServiceError(f"no running node of {self.name} knows who serves slot {slot}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> Self:
        if not self.nodes:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _knows(client: Any, count: int) -> bool:
    """Whether the node behind ``client`` knows ``count`` nodes, none still in handshake."""
    lines = _text(client.execute_command("CLUSTER", "NODES")).strip().splitlines()
    return len(lines) == count and not any("handshake" in line for line in lines)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def start_redis_cluster(
    workdir: Path | str | None = None,
    *,
    primaries: int = 3,
    replicas: int = 1,
    node_timeout_ms: int = 1000,
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
) -> RedisClusterService:
    """Start a Redis Cluster of ``primaries`` with ``replicas`` each (``RedisClusterService``)
    and wait until it serves every slot."""
    return RedisClusterService(
        workdir,
        primaries=primaries,
        replicas=replicas,
        node_timeout_ms=node_timeout_ms,
        ready_timeout_s=ready_timeout_s,
    ).start()


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
