"""Router configuration: one frozen, validated value built once at start-up.

Every number is checked at start (finite, and within the range the router can work
with), so a typo or a NaN stops the router with a ``ConfigError`` naming the key instead
of a router that times out every call or never checks its workers.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal
from urllib.parse import urlsplit

from inference_sidecar.exceptions import ConfigError
from inference_sidecar.health import HealthConfig
from inference_sidecar.kv.blocks import SUPPORTED_ALGOS
from inference_sidecar.kv.index import DEFAULT_STALE_AFTER_S
from inference_sidecar.kv.sources import EventSource
from inference_sidecar.load_view import DEFAULT_LOAD_VIEW, DEFAULT_POLL_INTERVAL_S, LOAD_VIEWS
from inference_sidecar.policies import POLICY_NAMES
from inference_sidecar.policies.bounded_hash import (
    DEFAULT_NEW_KEY_PLACEMENT,
    DEFAULT_REQUEST_COST,
    NEW_KEY_PLACEMENTS,
)
from inference_sidecar.routing_key import DEFAULT_KEY_HEADERS
from intent_reader.config_errors import redact_url

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_REQUEST_TIMEOUT_S = 120.0
#: Far above what the job sends (8 calls in flight per operator instance); with
#: ``DEFAULT_MAX_BODY_BYTES`` it also bounds the request bodies held at once (1 GiB).
DEFAULT_MAX_CONCURRENT_REQUESTS = 256
#: A 4 MiB body at about 1 Mbit/s; the job's prompts take milliseconds on a LAN.
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_TOKENIZER_WORKERS = 1
MIN_ADMIN_TOKEN_CHARS = 16
#: The admin port listens on the loopback interface only.
ADMIN_HOST = "127.0.0.1"


class Secret:
    """A secret string: never shown in ``repr`` or logs, compared in constant time."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def __repr__(self) -> str:
        return "Secret('***')"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and self.matches(other._value)

    def __hash__(self) -> int:
        return hash(Secret)

    def matches(self, given: str) -> bool:
        """Whether ``given`` is the secret, in time that does not depend on where they
        differ (``hmac.compare_digest``)."""
        return hmac.compare_digest(given.encode(), self._value.encode())

    def reveal(self) -> str:
        return self._value


def normalise_url(url: str, key: str) -> str:
    """``http://host:port`` without a trailing slash; raises ``ConfigError`` naming ``key``."""
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(key, f"expected an http(s)://host:port URL, got {redact_url(url)!r}")
    if parts.path.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Everything the router needs; ``workers`` XOR (``prefill`` and ``decode``)."""

    workers: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    policy: str = "bounded_hash"
    #: bounded_hash: bound on a worker's requests in flight, as a multiple of the mean.
    load_factor: float = 1.25
    min_load_bound: int = 3
    #: bounded_hash: bound on a worker's resident prompt tokens, as a multiple of the mean,
    #: for where a new key may go.
    residency_factor: float = 1.25
    #: bounded_hash: weight of a prompt's uncached tokens against a worker's queued ones.
    recompute_weight: float = 2.0
    #: bounded_hash: queue cost of one request in flight, in prompt tokens.
    request_cost: int = DEFAULT_REQUEST_COST
    #: bounded_hash: where a new key goes: "fewest_first" (the fewest requests in flight,
    #: then the roomy workers among them, then cost), "least_loaded" (the roomy workers with
    #: the fewest requests in flight, then cost), "cost" (cost alone) or "hash" (its
    #: rendezvous order under the load bound, as every router replica would place it).
    new_key_placement: str = DEFAULT_NEW_KEY_PLACEMENT
    #: The load the policy weighs per worker: "own" (this router's requests in flight) or
    #: "workers" (what each worker reports on its ``/metrics``, polled, plus what this
    #: router sent since). Several router replicas behind one load balancer need
    #: "workers": each one's own count is a fraction of a worker's load.
    load_view: str = DEFAULT_LOAD_VIEW
    #: load_view "workers": seconds between two polls of every worker's ``/metrics``
    #: (each poll bounded by ``health_timeout_s``).
    load_poll_interval_s: float = DEFAULT_POLL_INTERVAL_S
    key_headers: tuple[str, ...] = DEFAULT_KEY_HEADERS
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    #: Seconds a client may take to send a request's body; past it the request is a 408.
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    connect_timeout_s: float = 2.0
    #: Total seconds one attempt on one worker may take, streamed or not (httpx's own
    #: timeouts bound each read, not a worker that trickles bytes).
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    #: Client completion requests served at once; more are refused with a 429 and
    #: ``Retry-After`` instead of each holding a body and a connection while they wait.
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    #: Workers tried per request (per step in disaggregated mode) before giving up.
    max_attempts: int = 3
    #: Seconds between active ``GET /health`` probes of every worker; 0 disables them.
    health_interval_s: float = 2.0
    health_timeout_s: float = 1.0
    health: HealthConfig = field(default_factory=HealthConfig)
    max_connections: int = 512
    #: kv_prefix: each worker's KV event stream (worker URL -> where it publishes).
    kv_events: Mapping[str, EventSource] = field(default_factory=dict)
    #: kv_prefix: the model folder the workers serve (its tokenizer and chat template).
    tokenizer_dir: str | None = None
    #: kv_prefix: silence after a request, in seconds, after which a worker's events are no
    #: longer trusted and its cache is estimated by hashing.
    kv_stale_after_s: float = DEFAULT_STALE_AFTER_S
    #: kv_prefix: the workers' KV block size; None reads it (and the hash algorithm) from a
    #: worker's ``/metrics``.
    kv_block_size: int | None = None
    #: kv_prefix, with ``kv_block_size``: the workers' ``prefix_caching_hash_algo``.
    kv_hash_algo: str = "sha256"
    #: kv_prefix: the workers' context in tokens; None reads it from a worker's
    #: ``/v1/models``. A prompt that cannot fit is never tokenized.
    max_model_len: int | None = None
    #: kv_prefix: processes that tokenize and hash prompts, off the event loop; 0 does it in
    #: a thread of the router's process (the tokenizer holds the interpreter's lock, so the
    #: event loop then waits for it: for tests and tiny prompts).
    tokenizer_workers: int = DEFAULT_TOKENIZER_WORKERS
    #: Enables the admin routes (``POST``/``DELETE /workers``): a request must carry
    #: ``Authorization: Bearer <token>``.
    admin_token: Secret | None = None
    #: Serves the admin routes on this port of the loopback interface only (and not on
    #: ``port``); with ``admin_token`` too, the token is required there as well.
    admin_port: int | None = None

    def __post_init__(self) -> None:
        shown_as: dict[str, str] = {}
        for name in ("workers", "prefill", "decode"):
            urls = tuple(normalise_url(u, name) for u in getattr(self, name))
            if len({redact_url(u) for u in urls}) != len(urls):
                raise ConfigError(name, "the same URL is listed twice")
            for url in urls:  # the router knows a worker by its redacted URL
                if shown_as.setdefault(redact_url(url), url) != url:
                    raise ConfigError(name, f"{redact_url(url)} is listed with two credentials")
            object.__setattr__(self, name, urls)
        if self.workers and (self.prefill or self.decode):
            raise ConfigError("workers", "give either workers or prefill+decode, not both")
        if not self.workers and not (self.prefill and self.decode):
            raise ConfigError(
                "workers", "give at least one worker, or at least one prefill and one decode"
            )
        if self.policy not in POLICY_NAMES:
            raise ConfigError("policy", f"unknown policy {self.policy!r}; one of {POLICY_NAMES}")
        self._check_kv_events()
        if self.new_key_placement not in NEW_KEY_PLACEMENTS:
            raise ConfigError(
                "new_key_placement",
                f"must be one of {NEW_KEY_PLACEMENTS}, got {self.new_key_placement!r}",
            )
        if self.load_view not in LOAD_VIEWS:
            raise ConfigError(
                "load_view",
                f"must be one of {LOAD_VIEWS}, got {self.load_view!r} (several router "
                "replicas behind one load balancer need 'workers')",
            )
        self._check_numbers()
        self._check_admin()
        object.__setattr__(self, "key_headers", tuple(h.lower() for h in self.key_headers))

    def _check_numbers(self) -> None:
        for key in ("load_factor", "residency_factor"):
            _check_number(self, key, minimum=1.0)
        _check_number(self, "recompute_weight", minimum=0.0)
        for key in ("connect_timeout_s", "request_timeout_s", "body_timeout_s"):
            _check_number(self, key, minimum=0.0, exclusive=True)
        for key in ("health_timeout_s", "kv_stale_after_s", "load_poll_interval_s"):
            _check_number(self, key, minimum=0.0, exclusive=True)
        _check_number(self, "health_interval_s", minimum=0.0)  # 0 turns the checks off
        _check_int(self, "port", 1, 65535)
        _check_int(self, "request_cost", 0)
        _check_int(self, "min_load_bound", 1)
        _check_int(self, "max_body_bytes", 1024)
        _check_int(self, "max_attempts", 1)
        _check_int(self, "max_concurrent_requests", 1)
        _check_int(self, "max_connections", 1)
        _check_int(self, "tokenizer_workers", 0)
        for key in ("max_model_len", "kv_block_size"):
            if getattr(self, key) is not None:
                _check_int(self, key, 1)
        if self.kv_hash_algo not in SUPPORTED_ALGOS:
            raise ConfigError(
                "kv_hash_algo", f"must be one of {SUPPORTED_ALGOS}, got {self.kv_hash_algo!r}"
            )

    def _check_admin(self) -> None:
        if self.admin_port is not None:
            _check_int(self, "admin_port", 1, 65535)
            if self.admin_port == self.port:
                raise ConfigError("admin_port", "must differ from the router's own port")
        token: object = self.admin_token  # as given: a config file's string is the token
        if token is None:
            return
        if isinstance(token, str):
            token = Secret(token)
            object.__setattr__(self, "admin_token", token)
        if not isinstance(token, Secret):
            raise ConfigError("admin_token", "give the token as a string")
        value = token.reveal()
        if len(value) < MIN_ADMIN_TOKEN_CHARS or not value.isascii() or not value.isprintable():
            raise ConfigError(
                "admin_token",
                f"use at least {MIN_ADMIN_TOKEN_CHARS} printable ASCII characters "
                "(e.g. the output of `openssl rand -hex 24`)",
            )

    @property
    def admin_enabled(self) -> bool:
        """Whether the admin routes are served at all (off unless configured)."""
        return self.admin_token is not None or self.admin_port is not None

    def _check_kv_events(self) -> None:
        sources = {
            normalise_url(url, "kv_events"): (
                source if isinstance(source, EventSource) else EventSource(str(source))
            )
            for url, source in self.kv_events.items()
        }
        workers = {*self.workers, *self.prefill, *self.decode}
        unknown = sorted(redact_url(u) for u in sources if u not in workers)
        if unknown:
            raise ConfigError("kv_events", f"not a worker of this router: {unknown}")
        object.__setattr__(self, "kv_events", MappingProxyType(sources))
        if self.policy != "kv_prefix":
            return
        missing = sorted(redact_url(u) for u in workers if u not in sources)
        if missing:
            raise ConfigError("kv_events", f"kv_prefix needs every worker's events: {missing}")
        if not self.tokenizer_dir:
            raise ConfigError("tokenizer_dir", "kv_prefix needs the model folder's tokenizer")

    @property
    def mode(self) -> Literal["aggregated", "disaggregated"]:
        return "disaggregated" if self.prefill else "aggregated"


def _check_number(
    config: RouterConfig, key: str, *, minimum: float, exclusive: bool = False
) -> None:
    """``config.<key>`` must be a finite number at least (or, exclusive, above) minimum."""
    value = getattr(config, key)
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < minimum or (exclusive and value == minimum):
        bound = f"> {minimum:g}" if exclusive else f">= {minimum:g}"
        raise ConfigError(key, f"must be a finite number {bound}, got {value!r}")


def _check_int(config: RouterConfig, key: str, minimum: int, maximum: int | None = None) -> None:
    """``config.<key>`` must be an integer in ``minimum..maximum``."""
    value = getattr(config, key)
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    if not ok or (maximum is not None and value > maximum):
        span = f"in {minimum}..{maximum}" if maximum is not None else f">= {minimum}"
        raise ConfigError(key, f"must be an integer {span}, got {value!r}")
