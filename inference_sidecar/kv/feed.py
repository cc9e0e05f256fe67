"""The router's side of kv_prefix: the workers' events into the index, a request's blocks.

``KVFeed`` owns the index, the subscriber thread and the block computer (the prompt
tokenizer, in processes of its own: ``prompt_blocks``). The thread decodes each worker's
batches and hands them to the event loop (``call_soon_threadsafe``), where ``apply``
feeds them to the index, so the index is only ever touched by the loop's thread. Until
the workers' block size and hash algorithm are known (given, or read by
``learn_workers`` from a worker's ``/metrics``), requests are routed by hashing and
counted as ``no_hashing``. The model's context (given, or read from a worker's
``/v1/models``) bounds what is tokenized.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from inference_sidecar.kv.batches import EventBatch
from inference_sidecar.kv.blocks import BlockHashing, hashing_from_metrics
from inference_sidecar.kv.index import KVIndex
from inference_sidecar.kv.models import WorkerModels, models_from_list
from inference_sidecar.kv.prompt_blocks import BlockComputer
from inference_sidecar.kv.sources import EventSource
from inference_sidecar.kv.subscriber import KVEventSubscriber
from inference_sidecar.routing_key import RoutingKey

log = logging.getLogger(__name__)

#: Seconds between attempts to read the workers' block size and hash algorithm.
KV_CONFIG_RETRY_S = 1.0
#: The context assumed while no worker has said its own (and none was configured).
DEFAULT_MAX_PROMPT_TOKENS = 1 << 17

#: ``read(worker, path)``: the text of a worker's ``GET path``.
Read = Callable[[str, str], Awaitable[str]]


class KVFeed:
    """The index of the workers' KV blocks, kept up to date from their event streams.

    ``on_error(worker, kind)`` counts a stream's errors; ``on_unhashed(reason)`` counts a
    request routed without block hashes.
    """

    def __init__(
        self,
        workers: Iterable[str],
        sources: Mapping[str, EventSource],
        computer: BlockComputer,
        *,
        hashing: BlockHashing | None,
        max_model_len: int | None,
        stale_after_s: float,
        clock: Callable[[], float],
        on_error: Callable[[str, str], None],
        on_unhashed: Callable[[str], None],
    ) -> None:
        self.index = KVIndex(workers, hashing=hashing, stale_after_s=stale_after_s, clock=clock)
        self.computer = computer
        self.max_model_len = max_model_len
        """The workers' context in tokens, once given or read; None until then."""
        self.models = WorkerModels(max_model_len)
        """What the workers serve (adapters' paths), once read from one of them."""
        self._on_unhashed = on_unhashed
        self._subscriber = KVEventSubscriber(
            sources, self._delivered, on_error, self._stream_changed
        )
        self._loop: asyncio.AbstractEventLoop | None = None

    # ----- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Start the subscriber thread (batches are applied on the running loop) and the
        tokenizer processes."""
        self._loop = asyncio.get_running_loop()
        self._subscriber.start()
        await self.computer.start()

    async def stop(self) -> None:
        await asyncio.to_thread(self._subscriber.stop)
        await self.computer.stop()

    @property
    def max_prompt_tokens(self) -> int:
        """The most tokens a prompt is tokenized to: the workers' context."""
        return self.max_model_len or DEFAULT_MAX_PROMPT_TOKENS

    async def learn_workers(
        self,
        workers: Callable[[], Iterable[str]],
        read: Read,
        errors: tuple[type[BaseException], ...],
    ) -> None:
        """Read what was not configured from the workers (``read``, failing with one of
        ``errors``): the block size and hash algorithm from the first ``/metrics`` that
        says them (until then requests are routed by hashing), and the context from that
        worker's ``/v1/models``."""
        reported: set[tuple[str, str]] = set()
        while self.index.hashing is None:
            for worker in workers():
                try:
                    hashing = hashing_from_metrics(await read(worker, "/metrics"))
                except errors:
                    continue
                except ValueError as exc:
                    if (worker, str(exc)) not in reported:
                        reported.add((worker, str(exc)))
                        log.warning("%s: no KV-aware routing yet: %s", worker, exc)
                    continue
                with contextlib.suppress(*errors):
                    self._learn_models(models_from_list(await read(worker, "/v1/models")))
                self.index.hashing = hashing
                log.info("KV blocks of %s: %s; context %s", worker, hashing, self.max_model_len)
                break
            else:
                await asyncio.sleep(KV_CONFIG_RETRY_S)
        if self.max_model_len is None:
            log.warning(
                "no worker says its context (max_model_len); prompts are tokenized up to %d "
                "tokens (set --max-model-len)",
                DEFAULT_MAX_PROMPT_TOKENS,
            )

    def _learn_models(self, models: WorkerModels | None) -> None:
        if models is None:
            return
        if self.max_model_len is None:
            self.max_model_len = models.max_model_len
        self.models = WorkerModels(self.max_model_len, models.base, dict(models.loras))
        self.index.lora_paths = dict(models.loras)

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

    async def with_blocks(
        self, key: RoutingKey, endpoint: str, raw: bytes, body: dict[str, Any]
    ) -> RoutingKey:
        """``key`` with the prompt's exact size and block hashes, when they can be had
        (computed off the event loop)."""
        hashing = self.index.hashing
        if hashing is None:
            self._on_unhashed("no_hashing")
            return key
        result = await self.computer.compute(
            endpoint, raw, body, hashing, self.max_prompt_tokens, self.models
        )
        if result.unhashed is not None:
            self._on_unhashed(result.unhashed)
            return key
        return dataclasses.replace(key, size=result.tokens, blocks=result.blocks)
