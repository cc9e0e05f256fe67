"""What the workers' KV caches hold, heard from their KV cache events, for the benchmark's
minimum after a disruption.

The minimum of the steady phase (``minimum_new_tokens``) assumes every earlier prompt is
still cached somewhere. After a worker restart that is false by construction: the
restarted worker's cache is empty, so no router can reuse what it held. The watch keeps
the same index the ``kv_prefix`` router keeps (``KVIndex``, fed by ``KVEventSubscriber``),
in the benchmark's own process, so that the restart and join phases can take the minimum
from what the serving workers actually held once the disruption was over.

It hears every router's phases alike (vllm-router's as well as ours): the workers
publish, whoever sends them requests. The index only ever under-reports after a hole in
a worker's stream (``KVIndex``: a gap clears the worker), which would raise the minimum
and flatter every router; ``holes`` counts them, and the caller drops the minimum when
there was one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence

import httpx

from inference_sidecar.kv import EventBatch, KVIndex
from inference_sidecar.kv.blocks import hashing_from_metrics
from inference_sidecar.kv.sources import EventSource
from inference_sidecar.kv.subscriber import KVEventSubscriber


class CacheWatch:
    """An index of every worker's cached blocks, kept up to date in the background."""

    def __init__(self, sources: Mapping[str, tuple[str, str | None]]) -> None:
        self._lock = threading.Lock()
        self.index = KVIndex(sources)
        self._heard: set[str] = set()
        self.holes = 0
        """Gaps and restarts heard after a worker's first batch, outside ``forget``."""
        self._subscriber = KVEventSubscriber(
            {w: EventSource(events, replay) for w, (events, replay) in sources.items()},
            self._deliver,
        )

    def __enter__(self) -> CacheWatch:
        self._subscriber.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._subscriber.stop()

    def learn_hashing(self, worker: str) -> None:
        """Read the block size and hash algorithm from ``worker``'s metrics, as the router
        does, and check the published hashes against them from then on."""
        hashing = hashing_from_metrics(httpx.get(f"{worker}/metrics", timeout=30).text)
        with self._lock:
            self.index.hashing = hashing

    def add(self, worker: str, events: str, replay: str | None) -> None:
        """Listen to a worker started after the watch (the joiner)."""
        with self._lock:
            self.index.add_worker(worker)
        self._subscriber.add(worker, EventSource(events, replay))

    def forget(self, workers: Iterable[str]) -> None:
        """The caches of ``workers`` were emptied on purpose (reset, restart): drop their
        entries now rather than wait for events that an idle worker may never send."""
        with self._lock:
            for worker in workers:
                self.index.reset(worker, "forgotten")
                self._heard.discard(worker)

    def mismatched(self) -> list[str]:
        """Workers whose published hashes differ from ours (then the minimum is moot)."""
        with self._lock:
            return [w for w, c in self.index.counters.items() if c.mismatches]

    def summary(self) -> dict[str, int]:
        """Chains checked against our hashes, mismatches and holes, over every worker."""
        with self._lock:
            counters = self.index.counters.values()
            return {
                "verified_chains": sum(c.verified for c in counters),
                "mismatched_chains": sum(c.mismatches for c in counters),
                "holes": self.holes,
            }

    def cached_tokens(self, workers: Sequence[str], prompts: Sequence[Sequence[int]]) -> list[int]:
        """Per prompt: tokens of its longest prefix that one of ``workers`` holds now."""
        hashing = self.index.hashing
        assert hashing is not None, "learn_hashing() first"
        block = hashing.block_size
        hashes = [hashing.block_hashes(tokens) for tokens in prompts]
        with self._lock:
            return [
                block * max((self.index.cached_blocks(w, h) for w in workers), default=0)
                for h in hashes
            ]

    def _deliver(self, worker: str, items: list[tuple[EventBatch, bool]]) -> None:
        with self._lock:
            for batch, replayed in items:
                outcome = self.index.apply(worker, batch, replayed=replayed)
                # A first batch numbered above 0 only says the watch started late, after
                # a reset: nothing was cached yet that it could have missed.
                if outcome in ("gap", "restart") and worker in self._heard:
                    self.holes += 1
                self._heard.add(worker)
