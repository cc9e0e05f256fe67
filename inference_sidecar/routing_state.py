"""The routing state of one pool of interchangeable workers: its policy, in-flight
counts and health (the worker processes themselves are ``workers``').

Synchronous and free of I/O on purpose: the router's asyncio code calls ``choose``,
``start`` and ``finish`` between awaits, so no lock is needed, and tests drive a pool
with plain calls and a fake clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from inference_sidecar import health as h
from inference_sidecar.load_view import WorkerLoad, WorkerLoads, own_loads
from inference_sidecar.policies import Policy

Decision = Literal["sticky", "placed", "spilled", "failed_over", "balanced"]


#: Prompt tokens worth one request's fixed cost (scheduling, decode steps, HTTP): the unit
#: in which a worker's work is counted for outlier detection.
REQUEST_TOKENS = 256


def work_units(uncached_tokens: int) -> float:
    """A request's work in units of a request with nothing to prefill."""
    return 1.0 + uncached_tokens / REQUEST_TOKENS


@dataclass(slots=True, eq=False)
class Ticket:
    """One request in flight: the policy's own ticket and the worker's work meanwhile."""

    policy_ticket: Any
    #: This request's work (``work_units`` of the prompt tokens the policy expects the
    #: worker to compute).
    own_work: float
    #: The work of every request the worker served while this one was in flight, this one
    #: included: what its latency is divided by before it is compared with the peers'.
    work: float
    key: str = ""
    #: The worker sent its first byte: the prompt's prefix is in its cache from then on.
    prefilled: bool = False


@dataclass(frozen=True, slots=True)
class Choice:
    """Where a request goes and how that relates to its key's home worker."""

    worker: str
    decision: Decision


def classify(home: str | None, chosen: str, candidates: Sequence[str]) -> Decision:
    """Sticky: the key's home. Spilled: home was usable but over the bound or dearer
    than another worker. Failed over: home was out of service or already tried.
    Balanced: no affinity. (``RoutingState.choose`` adds "placed": a key seen for the
    first time, put where the policy found it cheapest.)"""
    if home is None:
        return "balanced"
    if chosen == home:
        return "sticky"
    return "spilled" if home in candidates else "failed_over"


class RoutingState:
    """Workers of one role ("worker", "prefill" or "decode") and their routing state.

    The policy weighs each worker's load (``loads``): this router's requests in flight
    there, or with ``worker_loads`` (the ``workers`` load view, ``load_view``) the load
    the workers report, which every router replica sees alike.
    """

    def __init__(
        self,
        name: str,
        workers: Iterable[str],
        policy: Policy,
        health_config: h.HealthConfig | None = None,
        on_event: Callable[[str, h.HealthEvent], None] | None = None,
        worker_loads: WorkerLoads | None = None,
    ) -> None:
        self.name = name
        self.workers: tuple[str, ...] = tuple(dict.fromkeys(workers))
        if not self.workers:
            raise ValueError(f"pool {name!r} has no workers")
        self.policy = policy
        self.health_config = health_config or h.HealthConfig()
        self.health = h.new_pool_health(self.workers)
        self.in_flight: dict[str, int] = dict.fromkeys(self.workers, 0)
        self._open: dict[str, list[Ticket]] = {w: [] for w in self.workers}
        self._on_event = on_event
        self.worker_loads = worker_loads

    def add_worker(self, worker: str) -> bool:
        """Admit ``worker`` at runtime (a worker joining the pool), in service with no
        history; False if it is already a member. The policies take the candidates at each
        call, so a new worker draws new keys (and a hashing policy's share of unseen keys)
        from the next request on, while keys with history stay where their prefix is."""
        if worker in self.workers:
            return False
        self.workers = (*self.workers, worker)
        self.health = self.health.with_worker(worker, h.WorkerHealth())
        self.in_flight.setdefault(worker, 0)  # requests from before a removal still count
        self._open.setdefault(worker, [])
        return True

    def remove_worker(self, worker: str) -> bool:
        """Take ``worker`` out of the pool (an operator's removal); False if it is not a
        member. It is no candidate from now on; its requests in flight end normally and
        are accounted for, their outcomes no longer judged. Raises ``ValueError`` rather
        than leave the pool without a worker."""
        if worker not in self.workers:
            return False
        if len(self.workers) == 1:
            raise ValueError(f"{worker} is the last worker of the {self.name} pool")
        self.workers = tuple(w for w in self.workers if w != worker)
        self.health = self.health.without_worker(worker)
        self._forget_if_idle(worker)
        return True

    def _forget_if_idle(self, worker: str) -> None:
        if worker not in self.workers and self.in_flight.get(worker, 0) == 0:
            self.in_flight.pop(worker, None)
            self._open.pop(worker, None)

    def candidates(self, exclude: Iterable[str] = ()) -> list[str]:
        excluded = set(exclude)
        return [w for w in h.available(self.health) if w not in excluded]

    def choose(
        self,
        key: str,
        exclude: Iterable[str] = (),
        size: int = 0,
        blocks: Sequence[int] = (),
    ) -> Choice | None:
        """Pick a worker for ``key`` (prompt of ``size`` estimated tokens, 0 if unknown,
        and its KV block hashes if known) among those in service and not in ``exclude``."""
        candidates = self.candidates(exclude)
        if not candidates:
            return None
        worker = self.policy.pick(key, candidates, self.loads(), size, blocks)
        home = self.policy.home(key, self.workers)
        decision = classify(home, worker, candidates)
        if decision in ("sticky", "spilled") and self.policy.is_new(key):
            decision = "placed"
        return Choice(worker, decision)

    def start(
        self, worker: str, key: str = "", size: int = 0, blocks: Sequence[int] = ()
    ) -> Ticket:
        """Count a request sent to ``worker``; returns the ticket to end it with."""
        self.in_flight[worker] += 1
        if self.worker_loads is not None:
            self.worker_loads.sent(worker)
        own = work_units(self._uncached_now(key, worker, size, blocks))
        open_ = self._open[worker]
        for other in open_:
            other.work += own
        ticket = Ticket(
            self.policy.on_start(worker, key, size, blocks),
            own,
            own + sum(other.own_work for other in open_),
            key,
        )
        open_.append(ticket)
        return ticket

    def load_figures(self) -> dict[str, WorkerLoad]:
        """Each member's load as the policy weighs it, and where the figure comes from."""
        if self.worker_loads is None:
            return own_loads(self.in_flight, self.workers)
        return self.worker_loads.figures(self.in_flight, self.workers)

    def loads(self) -> Mapping[str, int]:
        """Each member's load as the policy weighs it (the class doc)."""
        if self.worker_loads is None:
            return self.in_flight
        return self.worker_loads.loads(self.in_flight, self.workers)

    def _uncached_now(self, key: str, worker: str, size: int, blocks: Sequence[int]) -> int:
        """The prompt tokens ``worker`` will compute for this request, for its work: the
        policy's estimate, or the whole prompt while an earlier request of the same key is
        still in prefill there. The policy counts that prefix as the worker's already (it
        is where the key belongs), but the worker has not computed it yet, so a hot
        shopper's concurrent requests each compute nearly all of it
        (``docs/decisions.md#latency-ejection-per-unit-of-work``). A request answered whole
        rather than streamed has no first byte to tell, so it counts as in prefill until it
        ends."""
        if size <= 0:
            return 0
        if key and any(t.key == key and not t.prefilled for t in self._open[worker]):
            return size
        return self.policy.uncached(key, worker, size, blocks)

    def prefilled(self, worker: str, ticket: Ticket) -> None:
        """The worker's first output byte arrived: its prefill of this request is done."""
        ticket.prefilled = True
        self.policy.on_prefilled(worker, ticket.policy_ticket)

    def finish(
        self, worker: str, ok: bool | None, latency_s: float, now: float, ticket: Ticket
    ) -> None:
        """End one request; ``ok=None`` means "not the worker's fault" (client error,
        client gone) and feeds nothing to outlier detection. Its latency is judged against
        the work the worker had in hand while it was in flight (``Ticket.work``)."""
        open_ = self._open.get(worker, [])
        if ticket in open_:
            open_.remove(ticket)
        self.in_flight[worker] = max(0, self.in_flight.get(worker, 0) - 1)
        if self.worker_loads is not None:
            self.worker_loads.finished(worker)
        self.policy.on_finish(worker, ticket.policy_ticket, ok)
        if ok is not None:
            self._apply(
                h.record(self.health, worker, ok, latency_s, now, self.health_config, ticket.work)
            )
        self._forget_if_idle(worker)

    def probed(self, worker: str, ok: bool, now: float) -> None:
        self._apply(h.probe(self.health, worker, ok, now, self.health_config))

    def expire(self, now: float) -> None:
        self._apply(h.expire(self.health, now))

    def is_in_service(self, worker: str) -> bool:
        return h.in_service(self.health.get(worker))

    def status(self) -> dict[str, dict[str, object]]:
        """Per-worker view for ``GET /health``: ``load`` is what the policy weighs,
        ``load_source`` where it comes from (``"workers"``: the worker's own report;
        ``"own"``: this router's requests in flight)."""
        loads = self.load_figures()
        return {
            w: {
                "in_service": h.in_service(wh),
                "down": wh.down,
                "ejected": wh.ejected,
                "ejections": wh.ejections,
                "in_flight": self.in_flight[w],
                "load": loads[w].load,
                "load_source": loads[w].source,
            }
            for w, wh in self.health.workers.items()
        }

    def _apply(self, result: tuple[h.PoolHealth, list[h.HealthEvent]]) -> None:
        self.health, events = result
        if self._on_event is not None:
            for event in events:
                self._on_event(self.name, event)
