"""The router's side of kv_prefix: the workers' events into the index, a request's blocks.

``KVFeed`` owns the index, the subscriber thread and the prompt tokenizer. The thread
decodes each worker's batches and hands them to the event loop
(``call_soon_threadsafe``), where ``apply`` feeds them to the index, so the index is only
ever touched by the loop's thread. Until the workers' block size and hash algorithm are
read from one of them (``learn_hashing``: its ``/metrics``), requests are routed by
hashing and counted as ``no_hashing``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from inference_sidecar.kv.batches import EventBatch
from inference_sidecar.kv.blocks import BlockHashing, hashing_from_metrics
from inference_sidecar.kv.index import KVIndex
from inference_sidecar.kv.prompt_tokens import PromptTokenizer
from inference_sidecar.kv.subscriber import EventSource, KVEventSubscriber
from inference_sidecar.routing_key import RoutingKey

log = logging.getLogger(__name__)

#: Seconds between attempts to read the workers' block size and hash algorithm.
KV_CONFIG_RETRY_S = 1.0


class KVFeed:
    """The index of the workers' KV blocks, kept up to date from their event streams.

    ``on_error(worker, kind)`` counts a stream's errors; ``on_unhashed(reason)`` counts a
    request routed without block hashes.
    """

    def __init__(
        self,
        workers: Iterable[str],
        sources: Mapping[str, EventSource],
        tokenizer: PromptTokenizer,
        *,
        hashing: BlockHashing | None,
        stale_after_s: float,
        clock: Callable[[], float],
        on_error: Callable[[str, str], None],
        on_unhashed: Callable[[str], None],
    ) -> None:
        self.index = KVIndex(workers, hashing=hashing, stale_after_s=stale_after_s, clock=clock)
        self.tokenizer = tokenizer
        self._on_unhashed = on_unhashed
        self._subscriber = KVEventSubscriber(
            sources, self._delivered, on_error, self._stream_changed
        )
        self._loop: asyncio.AbstractEventLoop | None = None

    # ----- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        """Start the subscriber thread; batches are applied on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._subscriber.start()

    async def stop(self) -> None:
        await asyncio.to_thread(self._subscriber.stop)

    async def learn_hashing(
        self,
        workers: Callable[[], Iterable[str]],
        read_metrics: Callable[[str], Awaitable[str]],
        errors: tuple[type[BaseException], ...],
    ) -> None:
        """Read the block size and hash algorithm from the first of ``workers()`` whose
        ``/metrics`` (``read_metrics(worker)``, failing with one of ``errors``) says
        them; until then requests are routed by hashing."""
        reported: set[tuple[str, str]] = set()
        while self.index.hashing is None:
            for worker in workers():
                try:
                    hashing = hashing_from_metrics(await read_metrics(worker))
                except errors:
                    continue
                except ValueError as exc:
                    if (worker, str(exc)) not in reported:
                        reported.add((worker, str(exc)))
                        log.warning("%s: no KV-aware routing yet: %s", worker, exc)
                    continue
                self.index.hashing = hashing
                log.info("KV blocks of %s: %s", worker, hashing)
                return
            await asyncio.sleep(KV_CONFIG_RETRY_S)

    # ----- membership ----------------------------------------------------------------

    def add_worker(self, worker: str, source: EventSource) -> None:
        self.index.add_worker(worker)
        self._subscriber.add(worker, source)

    def remove_worker(self, worker: str) -> None:
        """Stop hearing ``worker`` and forget what it held."""
        self._subscriber.remove(worker)
        self.index.remove_worker(worker)

    # ----- events --------------------------------------------------------------------

    def _delivered(self, worker: str, items: list[tuple[EventBatch, bool]]) -> None:
        """Called in the subscriber's thread: apply on the event loop's."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.apply, worker, items)

    def _stream_changed(self, worker: str, ok: bool) -> None:
        """Called in the subscriber's thread: a worker's stream is up, or cannot be heard."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.index.set_stream, worker, ok)

    def apply(self, worker: str, items: list[tuple[EventBatch, bool]]) -> None:
        """Apply a worker's batches, in order, to the index (on the event loop); those of
        a worker that left meanwhile are dropped."""
        if worker not in self.index.workers:
            return
        for batch, replayed in items:
            outcome = self.index.apply(worker, batch, replayed=replayed)
            if outcome in ("gap", "restart"):
                log.info("KV index of %s cleared: %s at batch %d", worker, outcome, batch.seq)

    # ----- requests ------------------------------------------------------------------

    def with_blocks(self, key: RoutingKey, endpoint: str, body: dict[str, Any]) -> RoutingKey:
        """``key`` with the prompt's exact size and block hashes, when they can be had."""
        hashing = self.index.hashing
        if hashing is None:
            self._on_unhashed("no_hashing")
            return key
        tokens = self.tokenizer.token_ids(endpoint, body)
        if tokens is None:
            self._on_unhashed("unreproducible")
            return key
        return dataclasses.replace(key, size=len(tokens), blocks=hashing.block_hashes(tokens))
