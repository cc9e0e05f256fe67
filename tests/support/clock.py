"""A clock the test moves: for code that takes its clock (and its sleep) as a parameter,
so a test of time-dependent behaviour takes no time and depends on no host's speed."""

from __future__ import annotations


class FakeClock:
    """Seconds that move only when the test (or the code under test, by sleeping) moves
    them. ``clock()`` and ``clock.time()`` read ``now``; ``advance(s)`` and an awaited
    ``sleep(s)`` move it, and each sleep is noted in ``waits``."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now
        self.waits: list[float] = []

    def __call__(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    async def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds
