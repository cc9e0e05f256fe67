"""In-memory stand-ins for where the job's figures go: a Flink metric group and the Redis
stats reporter, for unit tests of what the job counts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable


class FakeStats:
    """What ``runtime.counters.StatsReporter`` is given, kept in memory instead of Redis."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.samples: dict[str, list[int]] = {}

    def add(self, name: str, amount: int = 1) -> None:
        self.counts[name] += amount

    def sample(self, name: str, value: int) -> None:
        self.samples.setdefault(name, []).append(value)


class FakeGroup:
    """A Flink metric group as PyFlink uses it: keeps each gauge's callable, reads it later."""

    def __init__(self) -> None:
        self.gauges: dict[str, Callable[[], int]] = {}

    def gauge(self, name: str, obj: Callable[[], int]) -> None:
        self.gauges[name] = obj

    def read(self) -> dict[str, int]:
        return {name: read() for name, read in self.gauges.items()}
