"""Worker health: passive outlier ejection and active-check bookkeeping, as pure functions.

The router feeds this module two kinds of signals and acts on the events it returns:

* every completed upstream request (``record``): success or failure, its latency and the
  work the worker had in hand meanwhile;
* every active probe of ``GET /health`` (``probe``): reachable or not.

A worker is taken out ("ejected") when, over its recent window of requests, its error
rate or its median latency stands out from its peers', or after a run of consecutive
failures. Comparing with peers rather than with fixed limits is what keeps a slow model
or a burst of long prompts from ejecting everybody: only the odd one out goes. Latency is
compared per unit of work: the worker's requests in flight meanwhile, each weighed by the
prompt tokens the policy expected it to compute. A worker that sticky routing gave a hot
shopper's three concurrent requests, or the cold shoppers' whole prompts while a peer
served cached ones, answers more slowly because it has more to compute, not because it is
sick, and ejecting it would move every prefix it caches for nothing
(``docs/decisions.md#latency-ejection-per-unit-of-work``).
An ejected worker stays out for a back-off period that doubles with each ejection, then
comes back once a probe succeeds. A worker failing its active checks is "down" until a
probe succeeds again. Ejection never leaves fewer than ``min_healthy`` workers in
service; active checks can (a dead worker is dead), and then the router falls back to
trying every worker ("panic mode") rather than refusing traffic.

State is a frozen ``PoolHealth``; every function returns a new state and the events to
act on (log, count, gauge), so the logic is tested without clocks, sockets or asyncio.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Literal

EventKind = Literal["ejected", "readmitted", "down", "up"]


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """Thresholds of outlier ejection and active checks (defaults suit 2-16 workers)."""

    #: Recent outcomes kept per worker.
    window: int = 32
    #: Outcomes a worker needs before its rates are judged at all.
    min_requests: int = 6
    #: An error rate at or above this may eject...
    max_error_rate: float = 0.5
    #: ...if it also exceeds the peers' mean error rate by this much.
    error_rate_margin: float = 0.3
    #: A median latency per request in flight above this multiple of the peers' may eject...
    latency_factor: float = 4.0
    #: ...if it is also this much slower in absolute terms (ignores jitter on fast calls).
    latency_floor_s: float = 1.0
    #: This many failures in a row eject whatever the peers do.
    consecutive_failures: int = 3
    base_ejection_s: float = 5.0
    max_ejection_s: float = 120.0
    #: Ejection never leaves fewer workers in service than this.
    min_healthy: int = 1
    #: Consecutive failed active probes that mark a worker down.
    unhealthy_probes: int = 2

    def __post_init__(self) -> None:
        if self.window < 1 or self.min_requests < 1:
            raise ValueError("window and min_requests must be >= 1")
        if self.min_requests > self.window:
            raise ValueError("min_requests must not exceed window")
        if self.min_healthy < 0:
            raise ValueError("min_healthy must be >= 0")


@dataclass(frozen=True, slots=True)
class Outcome:
    ok: bool
    #: Per unit of work: the latency over the work the worker had in hand meanwhile.
    latency_s: float


@dataclass(frozen=True, slots=True)
class WorkerHealth:
    outcomes: tuple[Outcome, ...] = ()
    consecutive_failures: int = 0
    ejected_until: float | None = None
    ejections: int = 0
    failed_probes: int = 0
    down: bool = False

    @property
    def ejected(self) -> bool:
        return self.ejected_until is not None


@dataclass(frozen=True, slots=True)
class HealthEvent:
    """Something the router should log and count; ``reason`` says why."""

    kind: EventKind
    worker: str
    reason: str = ""
    #: The figures behind ``reason``, for the log (not a metric label).
    detail: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class PoolHealth:
    """Health of every worker of one pool; treat as immutable."""

    workers: Mapping[str, WorkerHealth] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "workers", MappingProxyType(dict(self.workers)))

    def get(self, worker: str) -> WorkerHealth:
        return self.workers[worker]

    def with_worker(self, worker: str, health: WorkerHealth) -> PoolHealth:
        return PoolHealth({**self.workers, worker: health})

    def without_worker(self, worker: str) -> PoolHealth:
        return PoolHealth({w: h for w, h in self.workers.items() if w != worker})


def new_pool_health(workers: Iterable[str]) -> PoolHealth:
    return PoolHealth({w: WorkerHealth() for w in workers})


def in_service(health: WorkerHealth) -> bool:
    return not health.ejected and not health.down


def available(state: PoolHealth) -> list[str]:
    """Workers to route to, in pool order; all non-down (or all) workers if none is."""
    healthy = [w for w, h in state.workers.items() if in_service(h)]
    if healthy:
        return healthy
    alive = [w for w, h in state.workers.items() if not h.down]
    return alive or list(state.workers)


def _error_rate(h: WorkerHealth) -> float:
    return sum(not o.ok for o in h.outcomes) / len(h.outcomes)


def _median_latency(h: WorkerHealth) -> float | None:
    latencies = [o.latency_s for o in h.outcomes if o.ok]
    return statistics.median(latencies) if latencies else None


def outlier_reason(state: PoolHealth, worker: str, cfg: HealthConfig) -> str | None:
    """Why ``worker`` should be ejected now, or ``None`` when it looks like its peers."""
    me = state.get(worker)
    if me.consecutive_failures >= cfg.consecutive_failures:
        return "consecutive_failures"
    if len(me.outcomes) < cfg.min_requests:
        return None
    peers = [
        h
        for w, h in state.workers.items()
        if w != worker and in_service(h) and len(h.outcomes) >= cfg.min_requests
    ]
    rate = _error_rate(me)
    peer_rate = statistics.fmean(_error_rate(p) for p in peers) if peers else 0.0
    if rate >= cfg.max_error_rate and rate - peer_rate >= cfg.error_rate_margin:
        return "error_rate"
    mine = _median_latency(me)
    peer_latencies = [lat for p in peers if (lat := _median_latency(p)) is not None]
    if mine is not None and peer_latencies:
        peer_median = statistics.median(peer_latencies)
        if mine > cfg.latency_factor * peer_median and mine - peer_median > cfg.latency_floor_s:
            return "latency"
    return None


def _latency_detail(state: PoolHealth, worker: str) -> str:
    """The median latencies per unit of work that a latency ejection compared."""
    medians = {w: lat for w, h in state.workers.items() if (lat := _median_latency(h)) is not None}
    figures = ", ".join(
        f"{'this worker' if w == worker else w} {lat:.3f} s" for w, lat in medians.items()
    )
    return f"median latency per unit of work over the recent requests: {figures}"


def _may_eject(state: PoolHealth, worker: str, cfg: HealthConfig) -> bool:
    others = sum(1 for w, h in state.workers.items() if w != worker and in_service(h))
    return others >= cfg.min_healthy and others > 0


def _eject(
    state: PoolHealth, worker: str, reason: str, now: float, cfg: HealthConfig
) -> tuple[PoolHealth, list[HealthEvent]]:
    h = state.get(worker)
    detail = _latency_detail(state, worker) if reason == "latency" else ""
    ejections = h.ejections + 1
    period = min(cfg.base_ejection_s * 2 ** (ejections - 1), cfg.max_ejection_s)
    ejected = replace(
        h, outcomes=(), consecutive_failures=0, ejected_until=now + period, ejections=ejections
    )
    return state.with_worker(worker, ejected), [HealthEvent("ejected", worker, reason, detail)]


def record(
    state: PoolHealth,
    worker: str,
    ok: bool,
    latency_s: float,
    now: float,
    cfg: HealthConfig,
    work: float = 1.0,
) -> tuple[PoolHealth, list[HealthEvent]]:
    """Account one finished request to ``worker``; may eject it. ``work`` is what the
    worker had to do while this request was in flight, itself included, in units of one
    request with nothing to prefill (``routing_state.work_units``; the requests served
    meanwhile, when their sizes are unknown).

    Outcomes of a worker already out of service are ignored: they are requests sent
    before it was taken out and say nothing new.
    """
    if worker not in state.workers:
        return state, []
    h = state.get(worker)
    if not in_service(h):
        return state, []
    outcomes = (*h.outcomes, Outcome(ok, latency_s / max(1.0, work)))[-cfg.window :]
    h = replace(h, outcomes=outcomes, consecutive_failures=0 if ok else h.consecutive_failures + 1)
    state = state.with_worker(worker, h)
    reason = outlier_reason(state, worker, cfg)
    if reason is None or not _may_eject(state, worker, cfg):
        return state, []
    return _eject(state, worker, reason, now, cfg)


def probe(
    state: PoolHealth, worker: str, ok: bool, now: float, cfg: HealthConfig
) -> tuple[PoolHealth, list[HealthEvent]]:
    """Account one active health probe of ``worker``.

    A success clears "down" and re-admits an ejected worker whose back-off has expired
    (with a clean window, so old failures do not eject it again at once). Failures mark
    the worker down after ``unhealthy_probes`` in a row.
    """
    if worker not in state.workers:
        return state, []
    h = state.get(worker)
    events: list[HealthEvent] = []
    if ok:
        if h.down:
            events.append(HealthEvent("up", worker, "probe_ok"))
        h = replace(h, failed_probes=0, down=False)
        if h.ejected_until is not None and now >= h.ejected_until:
            h = replace(h, ejected_until=None, outcomes=(), consecutive_failures=0)
            events.append(HealthEvent("readmitted", worker, "probe_ok"))
        return state.with_worker(worker, h), events
    failed = h.failed_probes + 1
    down = h.down or failed >= cfg.unhealthy_probes
    if down and not h.down:
        events.append(HealthEvent("down", worker, "probe_failed"))
    return state.with_worker(worker, replace(h, failed_probes=failed, down=down)), events


def expire(state: PoolHealth, now: float) -> tuple[PoolHealth, list[HealthEvent]]:
    """Re-admit every ejected worker whose back-off is over, without a probe.

    For routers running without active checks; with them, ``probe`` re-admits.
    """
    events: list[HealthEvent] = []
    for worker, h in state.workers.items():
        if h.ejected_until is not None and now >= h.ejected_until:
            state = state.with_worker(
                worker, replace(h, ejected_until=None, outcomes=(), consecutive_failures=0)
            )
            events.append(HealthEvent("readmitted", worker, "backoff_expired"))
    return state, events
