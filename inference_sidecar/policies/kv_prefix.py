"""KV-event-aware routing: send a prompt where its longest prefix is cached, under the bound.

``bounded_hash`` guesses what each worker caches from where it sent each key. This policy
knows: the workers publish their KV cache events, ``kv.index.KVIndex`` keeps which blocks
each one holds, and the router gives the policy the request's block hashes (computed as
the workers compute them, ``kv.blocks``). A worker's uncached tokens are then the prompt's
tokens beyond the longest run of leading blocks the worker holds, exact up to events in
flight, and independent of who sent the prefix there (another shopper sharing a template,
a spill, a router restart) or whether the worker evicted it since.

Everything else is ``bounded_hash``'s, unchanged, so the guarantees are the same: the load
bound (rule 1) filters the candidates first, the cost ``recompute_weight * uncached +
queued`` (rule 3) chooses among them with ties to the key's recent workers, residency
(rule 5) holds for new keys, and the router's ejection and failover act on the candidate
list before the policy sees it.

Requests in flight: a worker publishes a prompt's blocks only once it has computed them,
so a shopper's next request, sent while its previous one is still being prefilled, would
find its prefix nowhere and go to the least busy worker. The blocks of the requests in
flight on a worker therefore count as cached there (``bounded_hash`` records a key's
worker when its request starts for the same reason), until the request ends.

Falling back: for a worker whose entries cannot be trusted (``KVIndex.is_fresh``: its
events stopped after a request that must have produced some, or its hashes do not match
ours) and for a request whose blocks the router could not compute, the uncached estimate
is ``bounded_hash``'s, from the key's history. ``fallbacks`` counts, per worker, the
choices with blocks in which it was judged that way; the router exports it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from inference_sidecar.kv.index import KVIndex
from inference_sidecar.policies.bounded_hash import (
    SAME_PROMPT_SHARE,
    BoundedHashPolicy,
    Ticket,
)


class KVPrefixPolicy(BoundedHashPolicy):
    """``bounded_hash`` whose uncached-token estimate comes from the workers' KV events."""

    name = "kv_prefix"
    wants_blocks = True

    def __init__(
        self,
        kv_index: KVIndex | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        **tuning: Any,
    ) -> None:
        """``tuning``: ``bounded_hash``'s own keyword arguments, passed on unchanged."""
        super().__init__(clock=clock, **tuning)
        self.index = kv_index if kv_index is not None else KVIndex(clock=clock)
        self.fallbacks: Counter[str] = Counter()
        """Per worker: choices in which its cache was estimated by hashing."""
        self._inflight: dict[str, Counter[int]] = {}
        """Per worker: the blocks of the requests in flight there (with multiplicity)."""
        self._ticket_blocks: dict[int, tuple[str, tuple[int, ...]]] = {}

    def knows(self, worker: str, blocks: Sequence[int]) -> bool:
        """True when ``worker``'s cached prefix of ``blocks`` comes from the index."""
        return bool(blocks) and self.index.hashing is not None and self.index.is_fresh(worker)

    def cached_tokens(self, worker: str, blocks: Sequence[int]) -> int:
        """Tokens of the prompt's leading blocks ``worker`` holds, per the index, or is
        computing for a request in flight."""
        if self.index.hashing is None:
            return 0
        pending = self._inflight.get(worker, Counter())
        n = 0
        for block in blocks:
            if not (self.index.holds(worker, block) or pending[block] > 0):
                break
            n += 1
        return n * self.index.hashing.block_size

    def on_start(
        self, worker: str, key: str = "", size: int = 0, blocks: Sequence[int] = ()
    ) -> Ticket:
        ticket = super().on_start(worker, key, size, blocks)
        if blocks:
            self._inflight.setdefault(worker, Counter()).update(blocks)
            self._ticket_blocks[id(ticket)] = (worker, tuple(blocks))
        return ticket

    def on_finish(self, worker: str, ticket: object = None, ok: bool | None = None) -> None:
        super().on_finish(worker, ticket, ok)
        entry = self._ticket_blocks.pop(id(ticket), None)
        if entry is not None:
            started_on, blocks = entry
            pending = self._inflight[started_on]
            pending.subtract(blocks)
            for block in blocks:
                if pending[block] <= 0:
                    del pending[block]

    def uncached(self, key: str, worker: str, size: int, blocks: Sequence[int] = ()) -> int:
        if self.knows(worker, blocks):
            return max(0, size - self.cached_tokens(worker, blocks))
        return super().uncached(key, worker, size)

    def new_key_candidates(
        self, allowed: Sequence[str], size: int = 0, blocks: Sequence[int] = ()
    ) -> list[str]:
        """Residency (``bounded_hash`` rule 5) with one exception: a worker over its share
        stays a candidate when it holds at least ``SAME_PROMPT_SHARE`` of this prompt
        beyond what the best roomy worker holds: a repeated prompt under a new key adds
        little to its cache. A shared instruction prefix alone does not qualify, or every
        new shopper would follow it to the first worker that cached it."""
        roomy = super().new_key_candidates(allowed, size, blocks)
        known = [w for w in allowed if self.knows(w, blocks)]
        if not known or size <= 0:
            return roomy
        best_roomy = max((self.cached_tokens(w, blocks) for w in roomy if w in known), default=0)
        margin = SAME_PROMPT_SHARE * size
        return [
            w
            for w in allowed
            if w in roomy or (w in known and self.cached_tokens(w, blocks) - best_roomy >= margin)
        ]

    def pick(
        self,
        key: str,
        workers: Sequence[str],
        loads: Mapping[str, int],
        size: int = 0,
        blocks: Sequence[int] = (),
    ) -> str:
        if blocks:
            for worker in workers:
                if not self.knows(worker, blocks):
                    self.fallbacks[worker] += 1
        return super().pick(key, workers, loads, size, blocks)
