"""Round robin: the baseline with no affinity at all.

It spreads load perfectly and ignores KV-cache locality, which is what the routing
benchmark compares the hash policy against.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from inference_sidecar.policies.base import Policy


class RoundRobinPolicy(Policy):
    """Cycle through the candidate workers, whatever the key."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(
        self,
        key: str,
        workers: Sequence[str],
        loads: Mapping[str, int],
        size: int = 0,
        blocks: Sequence[int] = (),
    ) -> str:
        if not workers:
            raise ValueError("pick() needs at least one worker")
        return workers[next(self._counter) % len(workers)]
