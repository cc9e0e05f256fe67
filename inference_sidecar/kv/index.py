"""Which worker holds which KV block, kept from the workers' KV cache events.

Pure and synchronous, like ``routing_state``: the ZMQ shell (``kv.subscriber``) decodes
each worker's batches (``kv.batches``) and the router's event loop hands them to
``KVIndex.apply`` one at a time, so no lock is needed and tests drive the index with plain
calls and a fake clock.

The index never trusts a worker's entries across a hole in what it heard:

* a batch whose sequence number skips ahead (``gap``: the subscriber missed some, or the
  router joined late) clears the worker's entries first, unless the shell filled the hole
  from the worker's replay buffer (batches handed in with ``replayed=True``);
* a number that goes back (``restart``: a new worker process, whose cache is empty)
  clears them too;
* ``reset`` clears them on demand (the worker went down).

A cleared worker's index only under-reports (blocks it still holds look uncached, which
costs a recomputation, never a wrong hit), and heals: a request that reuses a block makes
the worker publish it again.

Memory is bounded by the workers' caches, not by the number of shoppers: a worker holds at
most its ``num_gpu_blocks`` blocks, and each worker's entries are capped at
``max_blocks`` (oldest dropped first, one at a time from an ordered dict: the cost of an
eviction does not grow with the index) in case a removal is ever missed. What one event
can cost is bounded where it is decoded (``batches``: blocks and tokens per event) and
here: a chain is verified on its first ``VERIFY_BLOCKS`` blocks only.

Staleness: a request of at least one full block always makes its worker publish a
``BlockStored`` (new or reused blocks). ``expect_events`` notes such a request served
with no batch heard since it was sent; a worker that has not published for
``stale_after_s`` since is stale, and the policy goes
back to estimating its cache by hashing (``KVPrefixPolicy``) until a batch arrives.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from inference_sidecar.kv.batches import EventBatch, Removed, Stored
from inference_sidecar.kv.blocks import BlockHashing, Unverifiable, event_extra_keys

#: Per worker: more than an 80 GB GPU holds of SmolLM2-135M's KV (23 KiB a token: about
#: 217,000 blocks of 16 tokens), the smallest model served here; about 30 MiB of index.
DEFAULT_MAX_BLOCKS = 1 << 18
DEFAULT_STALE_AFTER_S = 10.0
#: Leading blocks of a published root chain compared with our computation: enough to tell
#: another seed or algorithm, at a cost that does not grow with the prompt.
VERIFY_BLOCKS = 4

Outcome = Literal["applied", "gap", "restart", "duplicate"]


@dataclass(slots=True)
class WorkerBlocks:
    """What the index knows of one worker."""

    #: Block hashes, least recently stored first (an ordered set).
    blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)
    next_seq: int = 0
    last_batch_at: float | None = None
    #: When a request that must make the worker publish was prefilled, unanswered yet.
    awaiting_since: float | None = None
    #: Its published hashes do not match ours (another seed or algorithm): never trusted.
    mismatched: bool = False
    #: Its event stream is subscribed to; False when the subscriber cannot hear it.
    heard: bool = True


@dataclass(slots=True)
class IndexCounters:
    """Totals per worker since start, read by the metrics."""

    batches: int = 0
    events: int = 0
    ignored: int = 0
    duplicates: int = 0
    #: Clears by reason: gap, restart, cleared (AllBlocksCleared), reset, down, overflow,
    #: stream_lost.
    resyncs: dict[str, int] = field(default_factory=dict)
    verified: int = 0
    mismatches: int = 0
    #: Root chains with extra keys that cannot be rebuilt here: neither trusted nor not.
    unverifiable: int = 0


class KVIndex:
    """Block hash -> workers holding it, per worker, from their event streams."""

    def __init__(
        self,
        workers: Iterable[str] = (),
        *,
        hashing: BlockHashing | None = None,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_blocks < 1 or stale_after_s <= 0:
            raise ValueError("max_blocks must be >= 1 and stale_after_s > 0")
        self.hashing = hashing
        self.lora_paths: dict[str, str] = {}
        """LoRA adapter name -> path, as the workers list them (extra keys of its blocks)."""
        self.max_blocks = max_blocks
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._workers: dict[str, WorkerBlocks] = {}
        self.counters: dict[str, IndexCounters] = {}
        for worker in workers:
            self.add_worker(worker)

    # ----- workers -------------------------------------------------------------------

    def add_worker(self, worker: str) -> None:
        self._workers.setdefault(worker, WorkerBlocks())
        self.counters.setdefault(worker, IndexCounters())

    def remove_worker(self, worker: str) -> None:
        """Forget ``worker`` altogether (it left the pool)."""
        self._workers.pop(worker, None)
        self.counters.pop(worker, None)

    @property
    def workers(self) -> tuple[str, ...]:
        return tuple(self._workers)

    def reset(self, worker: str, reason: str = "reset") -> None:
        """Forget every block of ``worker`` (its cache may be gone); counted by reason."""
        state = self._workers.get(worker)
        if state is None:
            return
        state.blocks.clear()
        counts = self.counters[worker].resyncs
        counts[reason] = counts.get(reason, 0) + 1

    def set_stream(self, worker: str, ok: bool) -> None:
        """The subscriber can (``ok``) or cannot hear ``worker``'s events; while it cannot,
        the worker's entries are cleared and it is not fresh."""
        state = self._workers.get(worker)
        if state is None or state.heard == ok:
            return
        state.heard = ok
        if not ok:
            self.reset(worker, "stream_lost")

    # ----- events --------------------------------------------------------------------

    def expected_seq(self, worker: str) -> int:
        """The sequence number the next batch from ``worker`` should carry."""
        state = self._workers.get(worker)
        return state.next_seq if state is not None else 0

    def apply(self, worker: str, batch: EventBatch, *, replayed: bool = False) -> Outcome:
        """Apply one batch from ``worker`` (module doc: gaps and restarts clear first).

        ``replayed``: the batch came from the worker's replay buffer, where a number
        below the expected one is a duplicate rather than a restart.
        """
        self.add_worker(worker)
        state, counters = self._workers[worker], self.counters[worker]
        outcome: Outcome = "applied"
        if batch.seq < state.next_seq:
            if replayed:
                counters.duplicates += 1
                return "duplicate"
            outcome = "restart"
            self.reset(worker, "restart")
        elif batch.seq > state.next_seq:
            outcome = "gap"
            self.reset(worker, "gap")
        state.next_seq = batch.seq + 1
        state.last_batch_at = self._clock()
        state.awaiting_since = None
        counters.batches += 1
        counters.ignored += batch.ignored
        for event in batch.events:
            counters.events += 1
            if isinstance(event, Stored):
                self._store(worker, state, event)
            elif isinstance(event, Removed):
                for h in event.hashes:
                    state.blocks.pop(h, None)
            else:
                if state.blocks:
                    self.reset(worker, "cleared")
        return outcome

    def _store(self, worker: str, state: WorkerBlocks, event: Stored) -> None:
        if event.parent is None and event.token_ids and self.hashing is not None:
            self._verify(worker, state, event)
        blocks = state.blocks
        for h in event.hashes:
            if h in blocks:
                blocks.move_to_end(h)  # a reused block becomes the newest
            else:
                blocks[h] = None
        if len(blocks) > self.max_blocks:
            while len(blocks) > self.max_blocks:
                blocks.popitem(last=False)
            counts = self.counters[worker].resyncs
            counts["overflow"] = counts.get("overflow", 0) + 1

    def _verify(self, worker: str, state: WorkerBlocks, event: Stored) -> None:
        """A chain published from its root must equal ours for the same tokens and extra
        keys (its first ``VERIFY_BLOCKS`` blocks); one whose extra keys cannot be rebuilt
        is counted and judged neither way."""
        assert self.hashing is not None
        counters = self.counters[worker]
        try:
            keys = event_extra_keys(event.extra_keys, event.lora_name, self.lora_paths)
        except Unverifiable:
            counters.unverifiable += 1
            return
        size = self.hashing.block_size
        if event.block_size != size:
            ours: tuple[int, ...] = ()
        else:
            ours = self.hashing.block_hashes(event.token_ids[: VERIFY_BLOCKS * size], keys)
        if ours and ours == event.hashes[: len(ours)]:
            counters.verified += 1
            state.mismatched = False
        else:
            counters.mismatches += 1
            state.mismatched = True

    # ----- staleness -----------------------------------------------------------------

    def expect_events(self, worker: str, since: float | None = None) -> None:
        """A request of at least one full block, sent at ``since`` (index clock; None:
        now), was served by ``worker``: unless a batch arrived after it was sent, the
        worker must publish soon, or its stream is broken."""
        state = self._workers.get(worker)
        if state is None or state.awaiting_since is not None:
            return
        now = self._clock()
        if since is not None and state.last_batch_at is not None and state.last_batch_at >= since:
            return
        state.awaiting_since = now

    def is_fresh(self, worker: str) -> bool:
        """True when ``worker``'s entries can be trusted: its stream is heard, its hashes
        match ours and it has not kept silent past ``stale_after_s`` after a request that
        must make it publish."""
        state = self._workers.get(worker)
        if state is None or state.mismatched or not state.heard:
            return False
        waiting = state.awaiting_since
        return waiting is None or self._clock() - waiting <= self.stale_after_s

    # ----- lookups -------------------------------------------------------------------

    def cached_blocks(self, worker: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` ``worker`` holds (a prefix hit stops at
        the first block missing, as vLLM's own lookup does)."""
        state = self._workers.get(worker)
        if state is None:
            return 0
        blocks = state.blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def holds(self, worker: str, block: int) -> bool:
        state = self._workers.get(worker)
        return state is not None and block in state.blocks

    def block_count(self, worker: str) -> int:
        state = self._workers.get(worker)
        return len(state.blocks) if state is not None else 0
