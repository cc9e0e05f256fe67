"""The router's pools: which workers it has, how they join, and their health.

Workers are known by their URLs without credentials (``redact_url``), which are what
logs, errors, ``/health`` and metric labels show; ``urls`` gives the URL to send to.
Active health checks probe every worker's ``GET /health``; the outcomes, and those of
the requests themselves, go to each pool's ``RoutingState``, whose health events are
logged and counted here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import httpx

from inference_sidecar.config import RouterConfig, normalise_url
from inference_sidecar.exceptions import ConfigError
from inference_sidecar.health import HealthEvent
from inference_sidecar.kv.feed import KVFeed
from inference_sidecar.kv.sources import EventSource
from inference_sidecar.load_view import WorkerLoads
from inference_sidecar.metrics import RouterMetrics
from inference_sidecar.policies import Policy
from inference_sidecar.routing_state import RoutingState
from intent_reader.config_errors import redact_url

log = logging.getLogger(__name__)


class Membership:
    """The pools of one router (``worker``, or ``prefill`` and ``decode``) and their health.

    ``make_policy()`` builds each pool's policy; ``clock`` is the router's; ``kv`` is the
    KV feed of a kv_prefix router (a joining worker's events are subscribed to, a worker
    that goes down has its index entries cleared); ``worker_loads`` the loads the workers
    report (the ``workers`` load view), shared by every pool.
    """

    def __init__(
        self,
        config: RouterConfig,
        metrics: RouterMetrics,
        make_policy: Callable[[], Policy],
        clock: Callable[[], float],
        kv: KVFeed | None = None,
        worker_loads: WorkerLoads | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self._clock = clock
        self._kv = kv
        self.worker_loads = worker_loads
        roles = (
            {"worker": config.workers}
            if config.mode == "aggregated"
            else {"prefill": config.prefill, "decode": config.decode}
        )
        self.urls: dict[str, str] = {redact_url(u): u for urls in roles.values() for u in urls}
        self.pools: dict[str, RoutingState] = {
            role: RoutingState(
                role,
                [redact_url(u) for u in urls],
                make_policy(),
                config.health,
                on_event=self.on_health_event,
                worker_loads=worker_loads,
            )
            for role, urls in roles.items()
        }
        for pool in self.pools.values():
            for worker in pool.workers:
                self._show_member(pool, worker)
        self._probed_ok: set[str] = set()

    @property
    def serving_pool(self) -> RoutingState:
        """The pool that produces answers (decode in disaggregated mode)."""
        return self.pools.get("worker") or self.pools["decode"]

    def workers(self) -> list[str]:
        """Every worker of every pool, in pool order."""
        return [w for pool in self.pools.values() for w in pool.workers]

    # ----- joining -------------------------------------------------------------------

    def add_worker(
        self, url: str, role: str = "worker", kv_events: EventSource | None = None
    ) -> bool:
        """Admit a worker that joined at runtime to the ``role`` pool; False if it is
        already one. With kv_prefix its KV event stream is required: the index learns its
        (empty) cache from the first batch, and until then its cached prefixes count as
        none, so it draws the keys no worker has cached. Raises ``ConfigError``."""
        url = normalise_url(url, "url")
        pool = self.pools.get(role)
        if pool is None:
            raise ConfigError("role", f"this router's pools are {sorted(self.pools)}, not {role!r}")
        if kv_events is None and self._kv is not None:
            raise ConfigError("kv_events", "kv_prefix needs the new worker's KV event stream")
        worker = redact_url(url)
        if worker in self.urls and self.urls[worker] != url:
            raise ConfigError("url", f"{worker} is already a worker with other credentials")
        if not pool.add_worker(worker):
            return False
        self.urls[worker] = url
        self._show_member(pool, worker)
        if self._kv is not None:
            assert kv_events is not None
            self._kv.add_worker(worker, kv_events)
        log.info("worker %s joined the %s pool", worker, pool.name)
        return True

    def remove_worker(self, url: str, role: str = "worker") -> bool:
        """Take a worker out of the ``role`` pool (an operator's removal); False if it is
        not a member. Its requests in flight finish; with kv_prefix its event stream is
        dropped and its index entries forgotten. Raises ``ConfigError`` for a bad URL or
        role, or rather than leave the pool without a worker."""
        worker = redact_url(normalise_url(url, "url"))
        pool = self.pools.get(role)
        if pool is None:
            raise ConfigError("role", f"this router's pools are {sorted(self.pools)}, not {role!r}")
        try:
            removed = pool.remove_worker(worker)
        except ValueError as exc:
            raise ConfigError("url", f"{exc}; add another worker first") from exc
        if not removed:
            return False
        if not any(worker in p.workers for p in self.pools.values()):
            self._probed_ok.discard(worker)
            if self._kv is not None:
                self._kv.remove_worker(worker)
            if self.worker_loads is not None:
                self.worker_loads.forget(worker)
        for gauge in (self.metrics.in_service, self.metrics.in_flight):
            with contextlib.suppress(KeyError):
                gauge.remove(pool.name, worker)
        log.info("worker %s left the %s pool", worker, pool.name)
        return True

    def _show_member(self, pool: RoutingState, worker: str) -> None:
        """A new member's metric series: in service, nothing in flight."""
        self.metrics.in_service.labels(pool.name, worker).set(1)
        self.metrics.in_flight.labels(pool.name, worker).set(0)

    # ----- health --------------------------------------------------------------------

    async def probe_all(self, client: httpx.AsyncClient) -> None:
        """Probe every worker's ``/health`` once, concurrently, and feed the results."""
        targets = [(pool, w) for pool in self.pools.values() for w in pool.workers]
        results = await asyncio.gather(*(self._probe(client, w) for _, w in targets))
        now = self._clock()
        for (pool, worker), ok in zip(targets, results, strict=True):
            if ok:
                self._probed_ok.add(worker)
            pool.probed(worker, ok, now)

    async def _probe(self, client: httpx.AsyncClient, worker: str) -> bool:
        try:
            reply = await client.get(
                f"{self.urls[worker]}/health", timeout=self.config.health_timeout_s
            )
        except httpx.HTTPError:
            return False
        return reply.status_code == 200

    async def health_loop(self, client: Callable[[], httpx.AsyncClient]) -> None:
        """Probe every ``health_interval_s`` until cancelled."""
        while True:
            try:
                await self.probe_all(client())
            except Exception:  # never let a bug stop health checking for good
                log.exception("health check round failed")
            await asyncio.sleep(self.config.health_interval_s)

    def on_health_event(self, pool: str, event: HealthEvent) -> None:
        level = logging.WARNING if event.kind in ("ejected", "down") else logging.INFO
        log.log(
            level,
            "worker %s (%s pool) %s: %s%s",
            event.worker,
            pool,
            event.kind,
            event.reason,
            f" ({event.detail})" if event.detail else "",
        )
        self.metrics.health_events.labels(pool, event.worker, event.kind, event.reason).inc()
        if event.kind == "down" and self._kv is not None:
            self._kv.index.reset(event.worker, "down")  # it may come back with an empty cache
        if event.kind == "ejected":
            self.metrics.ejections.labels(pool, event.worker, event.reason).inc()
        self.metrics.in_service.labels(pool, event.worker).set(
            int(self.pools[pool].is_in_service(event.worker))
        )

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready when every pool has a worker in service that answered a probe
        (or, with active checks off, simply a worker in service)."""
        checks_on = self.config.health_interval_s > 0
        ready = all(
            any(
                pool.is_in_service(w) and (not checks_on or w in self._probed_ok)
                for w in pool.workers
            )
            for pool in self.pools.values()
        )
        doc: dict[str, Any] = {
            "status": "ok" if ready else "unavailable",
            "mode": self.config.mode,
            "policy": self.config.policy,
            "load_view": self.config.load_view,
            "pools": {name: pool.status() for name, pool in self.pools.items()},
        }
        if self.worker_loads is not None:  # why a worker's load is this router's own count
            doc["load_errors"] = dict(self.worker_loads.errors)
        if self._kv is not None:
            hashing = self._kv.index.hashing
            doc["kv_blocks"] = (
                {"block_size": hashing.block_size, "hash_algo": hashing.algo}
                if hashing is not None
                else None  # not read from the workers yet: requests are routed by hashing
            )
        return ready, doc
