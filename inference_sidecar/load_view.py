"""The load the bounded-load policies weigh: each worker's requests in flight, as this
router counts them (``own``) or as the workers themselves report them (``workers``).

Pure and synchronous: ``router.load_polling`` reads each worker's ``/metrics`` and feeds
``WorkerLoads``; ``RoutingState`` asks it for the loads at each choice.

Why two views. A router counts only the requests it sent itself. Behind a load balancer
with several router replicas, each replica sees its share only, so the bound of rule 1
(``policies.bounded_hash``) binds on a fraction of the real load and replicas together
can pile several times the bound onto one worker. A vLLM worker counts every request it
holds, whoever sent it (``vllm:num_requests_running`` + ``vllm:num_requests_waiting``),
so every replica polling it sees the same figure
(``docs/decisions.md#router-load-view``).

The rules of the ``workers`` view, per worker:

1. **Reported plus own since the sample**: the load is the reported figure plus the
   requests this router sent there since the answer arrived, minus those it saw end
   there since: a burst sent between two polls is seen at once, not one period later,
   and a finished request stops counting at once. Both are counted from the answer, not
   from the poll's start: a worker busy prefilling takes a large part of a second to
   answer, and every request sent meanwhile that its page already counted would count
   twice until the next answer, enough to spill shoppers off their prefix for nothing
   (``docs/decisions.md#router-load-view``). One sent meanwhile that the page missed is
   still this router's own, which rule 2 counts.
2. **Never below own**: at least this router's own requests in flight there. The worker
   counts a request only while its engine holds it, not while its server parses the
   prompt or streams the last bytes; this router knows its own for their whole life.
3. **Staleness**: a sample is trusted for ``sample_lifetime`` seconds after it arrived
   (two poll periods with their timeouts: one failed or hung poll does not discard it).
   A worker without a trusted sample (none yet, unreadable metrics, a stalled poller)
   falls back to this router's own count, and ``/health`` and ``/metrics`` say so
   (``source``: ``"own"``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from prometheus_client.parser import text_string_to_metric_families

LOAD_VIEWS = ("own", "workers")
#: ``own``, what one router needs; which view a deployment of several gets by default is
#: for the replicas phase of ``bench/routing.py`` to show
#: (``docs/decisions.md#router-load-view``).
DEFAULT_LOAD_VIEW = "own"
#: Seconds between two polls of every worker's ``/metrics``.
DEFAULT_POLL_INTERVAL_S = 0.5
#: The gauges whose sum is a worker's requests in flight (every label set: each engine of
#: a data-parallel worker, each served model name).
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")

Source = Literal["workers", "own"]
LOAD_SOURCES: tuple[Source, ...] = ("workers", "own")


def reported_load(text: str) -> int:
    """A worker's requests in flight from its ``/metrics`` page (Prometheus text format):
    the sum of ``GAUGES`` over their label sets. Raises ``ValueError`` saying why when a
    gauge is missing or not a finite number.

    Only the lines of ``GAUGES`` reach the parser: a vLLM page is about 80-100 kB of
    histograms, which ``text_string_to_metric_families`` takes about 20 ms to parse in
    full on the router's event loop, and 0.3 ms filtered."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(_gauge_lines(text)):
        for sample in family.samples:
            if sample.name in GAUGES:
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    missing = [g for g in GAUGES if g not in found]
    if missing:
        raise ValueError(f"the worker's metrics have no {', '.join(missing)}")
    total = sum(found.values())
    if total != total or total in (float("inf"), float("-inf")):
        raise ValueError(f"the worker reports {total} requests in flight")
    return max(0, round(total))


def _gauge_lines(text: str) -> str:
    """The lines of ``text`` about ``GAUGES``: their samples and their ``# HELP`` and
    ``# TYPE`` lines. A name is matched whole (``vllm:num_requests_waiting_by_reason``
    is another metric, which sums to the waiting gauge: counting it would count twice)."""
    kept = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) > 2 and parts[1] in ("HELP", "TYPE") and parts[2] in GAUGES:
                kept.append(line)
        elif line.startswith(GAUGES) and line.split("{", 1)[0].split(None, 1)[0] in GAUGES:
            kept.append(line)
    return "\n".join(kept) + "\n"


def sample_lifetime(interval_s: float, timeout_s: float) -> float:
    """Seconds a sample is trusted after it arrived (rule 3): the next poll replaces it
    within one period and one timeout; twice that lets one poll fail or hang."""
    return 2 * (interval_s + timeout_s)


@dataclass(frozen=True, slots=True)
class Sample:
    """One poll's answer about one worker."""

    reported: int
    """The worker's requests in flight, as it reported them."""
    taken_at: float
    """The router's clock when the answer arrived."""
    sent_mark: int
    """This router's count of requests sent to the worker when the answer arrived."""
    finished_mark: int = 0
    """This router's count of its requests to the worker that ended, when the answer
    arrived."""


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """The load one worker counts at in the policy's eyes, and where it comes from."""

    load: int
    source: Source
    reported: int | None = None
    sent_since_sample: int = 0
    sample_age_s: float | None = None


def combine(
    own_in_flight: int,
    sample: Sample | None,
    sent_total: int,
    now: float,
    lifetime_s: float,
    finished_total: int = 0,
) -> WorkerLoad:
    """One worker's load under the ``workers`` view (module doc, rules 1-3):
    ``max(own, reported + sent since the answer - ended since the answer)`` while the
    sample is trusted, else the router's own count."""
    if sample is None or now - sample.taken_at > lifetime_s:
        return WorkerLoad(own_in_flight, "own")
    since = max(0, sent_total - sample.sent_mark)
    ended = max(0, finished_total - sample.finished_mark)
    return WorkerLoad(
        max(own_in_flight, sample.reported + since - ended),
        "workers",
        sample.reported,
        since,
        max(0.0, now - sample.taken_at),
    )


def own_loads(in_flight: Mapping[str, int], workers: Iterable[str]) -> dict[str, WorkerLoad]:
    """Each worker's load under the ``own`` view: this router's requests in flight."""
    return {w: WorkerLoad(in_flight.get(w, 0), "own") for w in workers}


class WorkerLoads:
    """The workers' reported loads and this router's sends since each report.

    ``lifetime_s``: how long a sample is trusted (``sample_lifetime``); ``clock`` is the
    router's. One instance serves every pool of a router, so a worker in two pools counts
    the sends of both.
    """

    def __init__(self, lifetime_s: float, clock: Callable[[], float]) -> None:
        self.lifetime_s = lifetime_s
        self._clock = clock
        self._samples: dict[str, Sample] = {}
        self._sent: dict[str, int] = {}
        self._finished: dict[str, int] = {}
        self.errors: dict[str, str] = {}
        """Per worker: why its last poll failed, until one succeeds."""

    def sent(self, worker: str) -> None:
        """This router sent a request to ``worker``."""
        self._sent[worker] = self._sent.get(worker, 0) + 1

    def finished(self, worker: str) -> None:
        """A request this router sent to ``worker`` ended."""
        self._finished[worker] = self._finished.get(worker, 0) + 1

    def record(self, worker: str, reported: int) -> bool:
        """A poll's answer, as it arrives; True when it ends a run of failures."""
        sent, finished = self._sent.get(worker, 0), self._finished.get(worker, 0)
        self._samples[worker] = Sample(reported, self._clock(), sent, finished)
        return self.errors.pop(worker, None) is not None

    def failed(self, worker: str, reason: str) -> bool:
        """A poll of ``worker`` failed (its last sample stays until it is stale); True when
        it is the first failure since a success."""
        first = worker not in self.errors
        self.errors[worker] = reason
        return first

    def forget(self, worker: str) -> None:
        """``worker`` left the router."""
        for table in (self._samples, self._sent, self._finished, self.errors):
            table.pop(worker, None)

    def figure(self, worker: str, own_in_flight: int) -> WorkerLoad:
        return combine(
            own_in_flight,
            self._samples.get(worker),
            self._sent.get(worker, 0),
            self._clock(),
            self.lifetime_s,
            self._finished.get(worker, 0),
        )

    def figures(
        self, in_flight: Mapping[str, int], workers: Iterable[str]
    ) -> dict[str, WorkerLoad]:
        return {w: self.figure(w, in_flight.get(w, 0)) for w in workers}

    def loads(self, in_flight: Mapping[str, int], workers: Iterable[str]) -> dict[str, int]:
        """Each of ``workers``' load, given this router's requests in flight."""
        return {w: f.load for w, f in self.figures(in_flight, workers).items()}
