"""Router configuration: one frozen, validated value built once at start-up."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal
from urllib.parse import urlsplit

from inference_sidecar.exceptions import ConfigError
from inference_sidecar.health import HealthConfig
from inference_sidecar.kv.index import DEFAULT_STALE_AFTER_S
from inference_sidecar.kv.subscriber import EventSource
from inference_sidecar.policies import POLICY_NAMES
from inference_sidecar.policies.bounded_hash import (
    DEFAULT_NEW_KEY_PLACEMENT,
    DEFAULT_REQUEST_COST,
    NEW_KEY_PLACEMENTS,
)
from inference_sidecar.routing_key import DEFAULT_KEY_HEADERS

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_REQUEST_TIMEOUT_S = 120.0
DEFAULT_MAX_CONCURRENT_REQUESTS = 256
"""Far above what the job sends (8 calls in flight per operator instance), and with
``DEFAULT_MAX_BODY_BYTES`` at most 1 GiB of request bodies held at once."""


def redact_url(url: str) -> str:
    """``url`` as it may be shown (logs, errors, ``/health``, metric labels): a user name
    and password, which httpx sends to the worker as Basic auth, become ``***``. Works on
    strings that do not parse as URLs too, since it also guards error messages."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    if "@" not in rest:
        return url
    return f"{scheme}{sep}***@{rest.rpartition('@')[2]}"


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
    load_factor: float = 1.25
    """bounded_hash: bound on a worker's requests in flight, as a multiple of the mean."""
    min_load_bound: int = 3
    residency_factor: float = 1.25
    """bounded_hash: bound on a worker's resident prompt tokens, as a multiple of the
    mean, for where a new key may go."""
    recompute_weight: float = 2.0
    """bounded_hash: weight of a prompt's uncached tokens against a worker's queued ones."""
    request_cost: int = DEFAULT_REQUEST_COST
    """bounded_hash: queue cost of one request in flight, in prompt tokens."""
    new_key_placement: str = DEFAULT_NEW_KEY_PLACEMENT
    """bounded_hash: where a new key goes: "fewest_first" (the fewest requests in flight,
    then the roomy workers among them, then cost), "least_loaded" (the roomy workers with
    the fewest requests in flight, then cost) or "cost" (cost alone)."""
    key_headers: tuple[str, ...] = DEFAULT_KEY_HEADERS
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    connect_timeout_s: float = 2.0
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    """Total seconds one attempt on one worker may take, streamed or not (httpx's own
    timeouts bound each read, not a worker that trickles bytes)."""
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    """Client completion requests served at once; more are refused with a 429 and
    ``Retry-After`` instead of each holding a body and a connection while they wait."""
    max_attempts: int = 3
    """Workers tried per request (per step in disaggregated mode) before giving up."""
    health_interval_s: float = 2.0
    """Seconds between active ``GET /health`` probes of every worker; 0 disables them."""
    health_timeout_s: float = 1.0
    health: HealthConfig = field(default_factory=HealthConfig)
    max_connections: int = 512
    kv_events: Mapping[str, EventSource] = field(default_factory=dict)
    """kv_prefix: each worker's KV event stream (worker URL -> where it publishes)."""
    tokenizer_dir: str | None = None
    """kv_prefix: the model folder the workers serve (its tokenizer and chat template)."""
    kv_stale_after_s: float = DEFAULT_STALE_AFTER_S
    """kv_prefix: silence after a request, in seconds, after which a worker's events are
    no longer trusted and its cache is estimated by hashing."""

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
        if not self.load_factor >= 1.0:
            raise ConfigError("load_factor", f"must be >= 1.0, got {self.load_factor}")
        if not self.residency_factor >= 1.0:
            raise ConfigError("residency_factor", f"must be >= 1.0, got {self.residency_factor}")
        if not self.recompute_weight >= 0:
            raise ConfigError("recompute_weight", f"must be >= 0, got {self.recompute_weight}")
        if self.new_key_placement not in NEW_KEY_PLACEMENTS:
            raise ConfigError(
                "new_key_placement",
                f"must be one of {NEW_KEY_PLACEMENTS}, got {self.new_key_placement!r}",
            )
        if self.request_cost < 0:
            raise ConfigError("request_cost", f"must be >= 0, got {self.request_cost}")
        if not 0 < self.port < 65536:
            raise ConfigError("port", f"must be in 1..65535, got {self.port}")
        if self.max_body_bytes < 1024:
            raise ConfigError("max_body_bytes", "must be at least 1024")
        if self.max_attempts < 1:
            raise ConfigError("max_attempts", "must be >= 1")
        if self.max_concurrent_requests < 1:
            raise ConfigError("max_concurrent_requests", "must be >= 1")
        if self.request_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ConfigError("request_timeout_s", "timeouts must be > 0")
        object.__setattr__(self, "key_headers", tuple(h.lower() for h in self.key_headers))

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
        if not self.kv_stale_after_s > 0:
            raise ConfigError("kv_stale_after_s", f"must be > 0, got {self.kv_stale_after_s}")

    @property
    def mode(self) -> Literal["aggregated", "disaggregated"]:
        return "disaggregated" if self.prefill else "aggregated"
