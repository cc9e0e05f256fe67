"""The routing benchmark's replicas phase, its pure parts: the spreading client's choice of
replica, each run's figures over one replica's, the targets and the report's rows.

The phase runs one router 1, 2 and 3 times over (fresh processes each time) in front of
the same three workers, with the skewed phase's first repeat as the workload, and a
client that spreads its requests over the replicas in turn, one request to the next
replica, as a load balancer without affinity does: a shopper's consecutive requests land
on different replicas, and each replica sees a share of every worker's load. A router
whose placement depends on the worker set and the key alone, and whose bound weighs what
the workers hold, computes as many prompt tokens per request, and balances the workers as
well, with three replicas as with one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from bench._common import target

REPLICA_COUNTS = (1, 2, 3)
#: Targets of our router with 2 and 3 replicas, as multiples of its one-replica figures.
COMPUTED_LIMIT = 1.05
BALANCE_LIMIT = 1.1
#: The figures compared with one replica's: computed prompt tokens per request, and the
#: busiest worker's time-averaged requests in flight over the mean of the three.
COMPARED = ("computed_tokens_per_request", "inflight_max_over_mean")


class RoundRobin:
    """The spreading client's choice: per request, the next replica in turn."""

    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError("RoundRobin needs at least one replica")
        self.urls = tuple(urls)
        self._next = 0

    def __call__(self) -> str:
        url = self.urls[self._next]
        self._next = (self._next + 1) % len(self.urls)
        return url


def ratio(value: float | None, base: float | None) -> float | None:
    """``value / base`` rounded to 3 digits; None when either is missing, NaN or the base
    is 0."""
    if value is None or base is None or math.isnan(value) or math.isnan(base) or base == 0:
        return None
    return round(value / base, 3)


def vs_one_replica(runs: Mapping[int, Mapping[str, Any]]) -> dict[int, dict[str, float | None]]:
    """Per replica count, each ``COMPARED`` figure over the one-replica run's."""
    one = runs.get(1, {})
    return {n: {f: ratio(run.get(f), one.get(f)) for f in COMPARED} for n, run in runs.items()}


def judge_replicas(runs: Mapping[int, Mapping[str, Any]], label: str) -> list[dict[str, Any]]:
    """The targets of our router behind 2 and 3 replicas: computed prompt tokens per request
    within ``COMPUTED_LIMIT`` of one replica's, the busiest worker over the mean within
    ``BALANCE_LIMIT`` of one replica's."""
    ratios = vs_one_replica(runs)
    one = runs.get(1, {})
    targets = []
    for n in REPLICA_COUNTS[1:]:
        run = runs.get(n, {})
        got = ratios.get(n, {})
        targets.append(
            target(
                f"replicas.{n}.computed_per_request_vs_one",
                got.get("computed_tokens_per_request"),
                "<=",
                COMPUTED_LIMIT,
                f"{label}: {run.get('computed_tokens_per_request')} computed prompt tokens "
                f"per request with {n} replicas, {one.get('computed_tokens_per_request')} "
                "with one",
            )
        )
        targets.append(
            target(
                f"replicas.{n}.inflight_max_over_mean_vs_one",
                got.get("inflight_max_over_mean"),
                "<=",
                BALANCE_LIMIT,
                f"{label}: busiest worker's time-averaged in-flight over the mean "
                f"{run.get('inflight_max_over_mean')} with {n} replicas, "
                f"{one.get('inflight_max_over_mean')} with one",
            )
        )
    return targets


#: The report's columns: (header, key of a run's figures or of its ratios).
COLUMNS = (
    ("computed/req", "computed_tokens_per_request"),
    ("x one", "computed_vs_one"),
    ("inflight max/mean", "inflight_max_over_mean"),
    ("x one", "inflight_vs_one"),
    ("lat p99", "latency_p99_s"),
    ("errors", "errors"),
)


def rows(replicas: Mapping[str, Mapping[str, Any]]) -> list[list[Any]]:
    """One row per router and replica count: its label, the count, then ``COLUMNS``
    (``replicas`` as the results file holds them: runs keyed by the count as a string)."""
    out = []
    for entry in replicas.values():
        runs = {int(n): run for n, run in entry.get("runs", {}).items()}
        ratios = vs_one_replica(runs)
        for n in sorted(runs):
            cells = {
                **runs[n],
                "computed_vs_one": ratios[n]["computed_tokens_per_request"],
                "inflight_vs_one": ratios[n]["inflight_max_over_mean"],
            }
            out.append([entry.get("label", ""), n, *(cells.get(k) for _, k in COLUMNS)])
    return out


def header() -> list[str]:
    return ["router / policy", "replicas", *(h for h, _ in COLUMNS)]
