"""The routing-policy interface.

One required method, ``pick``; hooks with empty defaults for policies that keep their
own state (``on_start``/``on_prefilled``/``on_finish``), ``home`` for policies with
affinity so the router can tell a sticky decision from a spill or a failover without
knowing the policy, and ``is_new`` so a key seen for the first time is reported as
"placed" rather than as sticky or spilled.

``size`` is the request's estimated prompt tokens (``routing_key.estimate_prompt_tokens``);
0 means unknown, and a policy must then still work (on request counts alone). ``blocks``
are the prompt's KV block hashes, given only to a policy whose ``wants_blocks`` is True
(computing them costs a tokenization), and possibly empty even then.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class Policy:
    """Base class of routing policies; subclasses set ``name`` and implement ``pick``.

    ``name`` doubles as the metrics label, so it must stay short and stable.
    """

    name: str = "policy"
    wants_blocks: bool = False

    def pick(
        self,
        key: str,
        workers: Sequence[str],
        loads: Mapping[str, int],
        size: int = 0,
        blocks: Sequence[int] = (),
    ) -> str:
        """Choose one of ``workers`` (non-empty) for ``key``.

        ``loads`` maps a worker to its requests in flight, not counting the request
        being placed: through this router, or as the workers report them (the router's
        ``load_view``, ``inference_sidecar.load_view``); a missing worker has load 0.
        """
        raise NotImplementedError

    def home(self, key: str, workers: Sequence[str]) -> str | None:
        """The worker ``key`` belongs to when nothing is overloaded or down.

        ``None`` means the policy has no affinity (round robin): every decision is
        then reported as "balanced" rather than sticky or spilled.
        """
        return None

    def is_new(self, key: str) -> bool:
        """True when the policy knows nothing of ``key`` yet (its first placement)."""
        return False

    def uncached(self, key: str, worker: str, size: int, blocks: Sequence[int] = ()) -> int:
        """Estimated prompt tokens ``worker`` must compute for ``key``'s prompt of ``size``;
        a policy that knows nothing of the workers' caches counts the whole prompt."""
        return size

    def on_start(
        self, worker: str, key: str = "", size: int = 0, blocks: Sequence[int] = ()
    ) -> Any:
        """Called when a request is sent to ``worker``; the value returned (a ticket) is
        handed back to ``on_prefilled`` and ``on_finish`` for that request."""
        return None

    def on_prefilled(self, worker: str, ticket: Any = None) -> None:
        """Called when the worker produced its first output byte (its prefill is done)."""

    def on_finish(self, worker: str, ticket: Any = None, ok: bool | None = None) -> None:
        """Called when a request to ``worker`` has completed; ``ok`` is False when the
        worker failed it, None when the outcome says nothing about the worker."""
