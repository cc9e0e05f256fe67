"""Shared test fixtures.

Shared helpers that are not fixtures live in ``tests/support`` (builders, fakes, the job
process and fault harnesses), and every wait goes through ``tests.support.waiting.until``
(``until_async`` in an event loop): a test waits on a condition, never sleeps to let
something happen, and asserts no wall-clock figure (those are ``bench/``'s). A test module
imports no other test module and no other tier's modules
(``tests/unit/test_test_modules_share_helpers_through_tests_support.py``);
``docs/development.md`` (Writing a test) has the rules.

Sections, in file order:

1. Tiers, by folder, each marked so: ``unit`` (pure: no service, no JVM, no network),
   ``service`` (a real broker, Redis and PyFlink; an LLM stand-in where the model is not
   the subject), ``model`` (real vLLM workers). ``make unit|service|model`` runs one.
   ``compose`` (docker-compose.yml on the project's own Docker Engine) is collected only
   under ``make compose-test``, which sets ``SI_COMPOSE_TEST=1`` after starting that engine
   and building the images: ``make test`` leaves it out.
2. Service backend, an explicit choice: local processes from
   ``flink_jobs.tools.local_services`` (Tansu, redis-server) unless
   ``SI_TEST_SERVICES=docker``, which runs them in containers through testcontainers
   (Apache Kafka in KRaft mode, Redis) on the engine ``DOCKER_HOST`` names. A Docker engine
   that merely answers changes nothing: the compose tier (``make compose-test``) starts
   one of its own, whose registry-less images the other tiers could not use.
3. Redis: ``redis_service`` (handle: ``.url``, ``.restart()``, ``.stop()``), ``redis_url``,
   ``redis_client`` (function-scoped, bytes replies); ``redis_cluster``, a Redis Cluster of
   three primaries with a replica each, always local ``redis-server`` processes
   (``local_services.start_redis_cluster``), for tests that neither move its slots nor
   stop its nodes (those start their own), and ``cluster_client`` (function-scoped).
4. Kafka: ``kafka_service`` (handle: ``.bootstrap``, ``.restart()``, ``.stop()``),
   ``kafka_bootstrap``.

Services are session-scoped and shared by all tests: use unique key prefixes and topic
names, and start a private service (``local_services.start_redis(...)``) for a test that
restarts or breaks one. A service handle keeps its port across ``restart()`` on both
backends.
5. The LLM tier: ``llm_tier`` (two vLLM workers on the CPU behind the router; ``.base_url``,
   ``.worker_urls``), for the model tier; ``standin_tier`` (two LLM STAND-INS,
   ``bench/standin_llm.py``, behind the same router, with the same interface plus
   ``.configure(...)`` and ``.inject(...)``), for service tests whose subject is the stream.
   Each is started once per session.
6. The environment: ``proxy_env``, the test's environment without proxy variables (lower
   and upper case) until the test sets some.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import pytest
import redis
import redis.cluster
from hypothesis import settings

from flink_jobs.tools import embedded_stack, local_services
from tests.support.waiting import until

# Timing is the benchmarks' business (bench/), not the tests': hypothesis checks no
# per-example deadline (a CI run beside the model tier once took 603 ms for one example).
settings.register_profile("shopper-intents", deadline=None)
settings.load_profile("shopper-intents")

if TYPE_CHECKING:
    from testcontainers.core.container import DockerContainer

# --- 1. tiers ----------------------------------------------------------------------------

TIERS = ("unit", "service", "model", "compose")
_TESTS_DIR = Path(__file__).parent
COMPOSE_TEST_ENV = "SI_COMPOSE_TEST"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The compose tier needs the engine and images ``scripts/compose_test.sh`` prepares."""
    if collection_path == _TESTS_DIR / "compose" and os.environ.get(COMPOSE_TEST_ENV) != "1":
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = item.path.relative_to(_TESTS_DIR).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: tests live in tests/{{{','.join(TIERS)}}}/")
        item.add_marker(getattr(pytest.mark, tier))


#: Files run one after the other on one worker, never beside each other: the model tier,
#: which keeps both cores busy on its own, and the overload test, whose freshness phases
#: are calibrated to the job's speed when it starts (beside the vLLM workers on an
#: AVX2-only host its steady phase's p50 was 23 s instead of 3 s, and the burst looked
#: lighter than it).
BOTH_CORES = ("tests/model/", "tests/service/test_overload.py")


def work_unit(nodeid: str) -> str:
    """What one pytest-xdist worker runs in a row (``make test`` runs ``-n 2``): a file's
    tests, which share its module fixtures, or all of ``BOTH_CORES``: the whole model tier,
    so a run starts one set of vLLM workers (``llm_tier``), and the overload test."""
    path = nodeid.split("::", 1)[0]
    return "both-cores" if path.startswith(BOTH_CORES) else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    # A scheduler rather than xdist_group marks: pytest-xdist 3.8 marks a test's group on its
    # node id, which pytest 9.2 no longer lets a plugin change.
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByWorkUnit(config, log)


# --- 2. service backend ------------------------------------------------------------------

SERVICES_ENV = "SI_TEST_SERVICES"
REDIS_IMAGE = "redis:7.2"
KAFKA_IMAGE = "apache/kafka:3.9.1"
SERVICE_READY_TIMEOUT_S = 90.0


class RedisHandle(Protocol):
    @property
    def url(self) -> str: ...
    def restart(self) -> object: ...
    def stop(self) -> None: ...


class KafkaHandle(Protocol):
    @property
    def bootstrap(self) -> str: ...
    def restart(self) -> object: ...
    def stop(self) -> None: ...


def choose_backend(environ: Mapping[str, str]) -> str:
    """``"docker"`` only when ``SI_TEST_SERVICES`` says so, else ``"local"``."""
    chosen = environ.get(SERVICES_ENV, "").strip().lower() or "local"
    if chosen not in ("docker", "local"):
        raise pytest.UsageError(f"{SERVICES_ENV} must be 'docker' or 'local', got {chosen!r}")
    return chosen


@pytest.fixture(scope="session")
def service_backend() -> str:
    """``"docker"`` or ``"local"``: where this session's services run."""
    return choose_backend(os.environ)


@pytest.fixture(scope="session")
def services_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Working folders and logs of the session's local services."""
    return tmp_path_factory.mktemp("services")


def _redis_answers(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def _kafka_answers(bootstrap: str) -> bool:
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    try:
        AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=2)
    except KafkaException:
        return False
    return True


class _ContainerService:
    """A started testcontainers container behind the same handle as a local service.

    The host port is bound explicitly, so ``restart()`` (a Docker restart) keeps it.
    """

    def __init__(self, container: DockerContainer, container_port: int) -> None:
        self.container = container
        self.container_port = container_port

    def ready(self) -> bool:
        raise NotImplementedError

    @property
    def host(self) -> str:
        return self.container.get_container_host_ip()

    @property
    def port(self) -> int:
        return int(self.container.get_exposed_port(self.container_port))

    def restart(self) -> _ContainerService:
        self.container.get_wrapped_container().restart(timeout=10)
        until(
            self.ready,
            f"{type(self).__name__} to answer",
            timeout_s=SERVICE_READY_TIMEOUT_S,
            interval_s=0.2,
        )
        return self

    def stop(self) -> None:
        self.container.stop()


class _RedisContainerService(_ContainerService):
    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def ready(self) -> bool:
        return _redis_answers(self.url)


class _KafkaContainerService(_ContainerService):
    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def ready(self) -> bool:
        return _kafka_answers(self.bootstrap)


def _start_redis_container() -> _RedisContainerService:
    from testcontainers.redis import RedisContainer

    container = RedisContainer(REDIS_IMAGE).with_bind_ports(6379, local_services.free_port())
    container.start()
    service = _RedisContainerService(container, 6379)
    until(
        service.ready,
        "the Redis container to answer",
        timeout_s=SERVICE_READY_TIMEOUT_S,
        interval_s=0.2,
    )
    return service


def _start_kafka_container() -> _KafkaContainerService:
    from testcontainers.kafka import KafkaContainer

    class ApacheKafkaContainer(KafkaContainer):
        """``KafkaContainer`` for the ``apache/kafka`` image in KRaft mode.

        testcontainers' class starts Confluent images through their
        ``/etc/confluent/docker`` scripts; the Apache image has ``/etc/kafka/docker/run``
        and reads the same ``KAFKA_*`` variables. So: the same listeners and start-script
        mechanism (the command waits for a script that exports the advertised listeners
        once the mapped port is known), KRaft settings, and the Apache entry point.
        """

        def configure(self) -> None:
            self.wait_for = r".*Kafka Server started.*"
            self.env.pop("KAFKA_BROKER_ID", None)  # KRaft names the node KAFKA_NODE_ID
            self.with_env("CLUSTER_ID", self.cluster_id)
            self.with_env("KAFKA_NODE_ID", "1")
            self.with_env("KAFKA_PROCESS_ROLES", "broker,controller")
            self.with_env("KAFKA_LISTENERS", f"{self.listeners},CONTROLLER://0.0.0.0:9094")
            self.with_env(
                "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP",
                f"{self.security_protocol_map},CONTROLLER:PLAINTEXT",
            )
            self.with_env("KAFKA_CONTROLLER_LISTENER_NAMES", "CONTROLLER")
            self.with_env("KAFKA_CONTROLLER_QUORUM_VOTERS", "1@localhost:9094")
            self.with_env("KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", "1")
            self.with_env("KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", "1")

        def tc_start(self) -> None:
            host = self.get_container_host_ip()
            port = self.get_exposed_port(self.port)
            script = (
                "#!/bin/bash\n"
                f"export KAFKA_ADVERTISED_LISTENERS=PLAINTEXT://{host}:{port},"
                "BROKER://$(hostname -i | cut -d' ' -f1):9092\n"
                "exec /etc/kafka/docker/run\n"
            )
            self.create_file(script.encode(), self.TC_START_SCRIPT)

    container = ApacheKafkaContainer(KAFKA_IMAGE, port=9093)
    container.with_bind_ports(9093, local_services.free_port())
    container.start(timeout=int(SERVICE_READY_TIMEOUT_S))
    service = _KafkaContainerService(container, 9093)
    until(
        service.ready,
        "the Kafka container to answer",
        timeout_s=SERVICE_READY_TIMEOUT_S,
        interval_s=0.2,
    )
    return service


# --- 3. Redis ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_service(service_backend: str, services_dir: Path) -> Iterator[RedisHandle]:
    """A Redis server for the whole session (container or local ``redis-server``)."""
    if service_backend == "docker":
        service: RedisHandle = _start_redis_container()
    else:
        service = local_services.start_redis(workdir=services_dir / "redis")
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="session")
def redis_url(redis_service: RedisHandle) -> str:
    return redis_service.url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A client of the session's Redis (bytes replies), closed after the test."""
    client = redis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def redis_cluster(services_dir: Path) -> Iterator[local_services.RedisClusterService]:
    """A Redis Cluster for the whole session: share it with unique key prefixes."""
    with local_services.start_redis_cluster(services_dir / "redis-cluster") as cluster:
        yield cluster


@pytest.fixture
def cluster_client(
    redis_cluster: local_services.RedisClusterService,
) -> Iterator[redis.cluster.RedisCluster]:
    """A cluster client of the session's Redis Cluster (bytes replies), closed after the
    test."""
    client = redis.cluster.RedisCluster.from_url(redis_cluster.url, socket_timeout=5)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def unique_name() -> str:
    """A short name unique to this test run, for key prefixes and topic names."""
    return f"t{uuid.uuid4().hex[:10]}"


# --- 4. Kafka ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def kafka_service(service_backend: str, services_dir: Path) -> Iterator[KafkaHandle]:
    """A Kafka-protocol broker for the whole session (Apache Kafka container or Tansu)."""
    if service_backend == "docker":
        service: KafkaHandle = _start_kafka_container()
    else:
        service = local_services.start_tansu(workdir=services_dir / "tansu")
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="session")
def kafka_bootstrap(kafka_service: KafkaHandle) -> str:
    return kafka_service.bootstrap


# --- 5. the LLM tier ---------------------------------------------------------------------
# vLLM on the CPU is the real model server users run; it takes about a minute to start,
# so two workers (one core each) and the router in front of them serve the whole session.
# Where the model is not the subject, stand-ins take its place behind the same router: they
# start in a second and answer within their configured latency.

STANDIN_LATENCY = "0.05"


@pytest.fixture(scope="session")
def llm_tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[embedded_stack.LlmTier]:
    tier = embedded_stack.start_llm_tier(tmp_path_factory.mktemp("llm"), workers=2)
    yield tier
    tier.stop()


@pytest.fixture(scope="session")
def standin_tier(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[embedded_stack.StandInTier]:
    """Two LLM stand-ins (``STANDIN_LATENCY`` seconds, no failures) behind the real router.
    A test that changes their latency or injects faults puts them back as they were."""
    tier = embedded_stack.start_standin_tier(
        tmp_path_factory.mktemp("standin"), workers=2, latency=STANDIN_LATENCY
    )
    yield tier
    tier.stop()


# --- 6. the environment ------------------------------------------------------------------

PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


@pytest.fixture
def proxy_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """An environment with no proxy variables but those a test sets."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    return monkeypatch
