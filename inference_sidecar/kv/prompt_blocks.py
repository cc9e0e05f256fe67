"""A request's prompt blocks, computed off the router's event loop.

Tokenizing a prompt costs seconds per MiB of text, and the tokenizer holds the
interpreter's lock while it runs: in a thread of the router's process the event loop
waits for it all the same (``docs/decisions.md#prompt-blocks-in-processes``). So
``BlockComputer`` runs ``prompt_blocks`` in worker processes of its own, each with the
model folder's tokenizer loaded once (``tokenizer_workers``); with 0 of them, or a
tokenizer given in code (tests), it runs in a thread.

``prompt_blocks`` never tokenizes past the model's context (``max_tokens``): such a
prompt cannot be served anyway (``PromptTokenizer``'s ``OverContext``).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from concurrent.futures import Executor, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from inference_sidecar.kv.blocks import BlockHashing
from inference_sidecar.kv.models import UnknownModel, WorkerModels
from inference_sidecar.kv.prompt_tokens import OverContext, PromptTokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """A prompt's exact token count and block hashes, or why there are none."""

    tokens: int = 0
    blocks: tuple[int, ...] = ()
    #: ``unreproducible``, ``unknown_model``, ``over_context`` or ``tokenizer_failed`` when
    #: not computed.
    unhashed: str | None = None


def prompt_blocks(
    tokenizer: PromptTokenizer,
    endpoint: str,
    body: dict[str, Any],
    hashing: BlockHashing,
    max_tokens: int,
    models: WorkerModels | None = None,
) -> PromptBlocks:
    """The prompt's blocks as the worker will hash them, its LoRA adapter and
    ``cache_salt`` included (``models``: what the workers serve; pure; the slow part)."""
    try:
        extras = (models or WorkerModels()).extras(body)
    except UnknownModel:
        return PromptBlocks(unhashed="unknown_model")
    except ValueError:
        return PromptBlocks(unhashed="unreproducible")
    try:
        tokens = tokenizer.token_ids(endpoint, body, max_tokens)
    except OverContext:
        return PromptBlocks(unhashed="over_context")
    if tokens is None:
        return PromptBlocks(unhashed="unreproducible")
    return PromptBlocks(len(tokens), hashing.block_hashes(tokens, extras))


# ----- in a worker process -----------------------------------------------------------

_process_tokenizer: PromptTokenizer | None = None


def _load(model_dir: str) -> None:
    global _process_tokenizer
    _process_tokenizer = PromptTokenizer.from_model_dir(model_dir)


def _in_process(
    endpoint: str, raw: bytes, hashing: BlockHashing, max_tokens: int, models: WorkerModels
) -> PromptBlocks:
    assert _process_tokenizer is not None  # _load ran first (the pool's initializer)
    body = orjson.loads(raw)
    return prompt_blocks(_process_tokenizer, endpoint, body, hashing, max_tokens, models)


def _ready() -> bool:
    return _process_tokenizer is not None


class BlockComputer:
    """Computes requests' prompt blocks in ``workers`` processes that load the tokenizer
    of ``model_dir`` (or in a thread with ``tokenizer`` when ``workers`` is 0)."""

    def __init__(
        self,
        tokenizer: PromptTokenizer | None,
        model_dir: str | Path | None,
        workers: int,
    ) -> None:
        if workers > 0 and model_dir is None:
            raise ValueError("tokenizer processes need the model folder")
        if workers == 0 and tokenizer is None:
            raise ValueError("a thread needs a tokenizer")
        self.tokenizer = tokenizer
        self.model_dir = str(model_dir) if model_dir is not None else None
        self.workers = workers
        self._pool: Executor | None = None

    @property
    def in_processes(self) -> bool:
        return self.workers > 0

    def _new_pool(self) -> Executor:
        assert self.model_dir is not None  # __init__ refuses processes without it
        # spawn, not fork: the router's process has threads (the KV event subscriber).
        return ProcessPoolExecutor(
            self.workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_load,
            initargs=(self.model_dir,),
        )

    async def start(self) -> None:
        """Start the processes and load their tokenizers before the first request."""
        if self.in_processes and self._pool is None:
            self._pool = self._new_pool()
            loop = asyncio.get_running_loop()
            await asyncio.gather(
                *(loop.run_in_executor(self._pool, _ready) for _ in range(self.workers))
            )

    async def stop(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True)

    async def compute(
        self,
        endpoint: str,
        raw: bytes,
        body: dict[str, Any],
        hashing: BlockHashing,
        max_tokens: int,
        models: WorkerModels,
    ) -> PromptBlocks:
        """The blocks of a request (``raw``: its bytes, ``body``: them parsed)."""
        if not self.in_processes:
            assert self.tokenizer is not None
            return await asyncio.to_thread(
                prompt_blocks, self.tokenizer, endpoint, body, hashing, max_tokens, models
            )
        if self._pool is None:
            self._pool = self._new_pool()
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(
                self._pool, _in_process, endpoint, raw, hashing, max_tokens, models
            )
        except BrokenProcessPool:
            log.warning("a tokenizer process died; starting new ones")
            broken, self._pool = self._pool, None
            if broken is not None:
                broken.shutdown(wait=False, cancel_futures=True)
            return PromptBlocks(unhashed="tokenizer_failed")
