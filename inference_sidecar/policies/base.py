"""The routing-policy interface.

One required method, ``pick``; hooks with empty defaults for policies that keep their
own state (``on_start``/``on_finish``), and ``home`` for policies with affinity so the
router can tell a sticky decision from a spill or a failover without knowing the policy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class Policy:
    """Base class of routing policies; subclasses set ``name`` and implement ``pick``.

    ``name`` doubles as the metrics label, so it must stay short and stable.
    """

    name: str = "policy"

    def pick(self, key: str, workers: Sequence[str], loads: Mapping[str, int]) -> str:
        """Choose one of ``workers`` (non-empty) for ``key``.

        ``loads`` maps a worker to its requests in flight through this router, not
        counting the request being placed; a missing worker has load 0.
        """
        raise NotImplementedError

    def home(self, key: str, workers: Sequence[str]) -> str | None:
        """The worker ``key`` belongs to when nothing is overloaded or down.

        ``None`` means the policy has no affinity (round robin): every decision is
        then reported as "balanced" rather than sticky or spilled.
        """
        return None

    def on_start(self, worker: str) -> None:
        """Called when a request is sent to ``worker``."""

    def on_finish(self, worker: str) -> None:
        """Called when a request to ``worker`` has completed, successfully or not."""
