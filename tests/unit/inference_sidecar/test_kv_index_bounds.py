"""What one KV event, or an index at its cap, may cost the router's event loop: eviction
at the cap does not copy the index, an event with more blocks or tokens than a worker
publishes at once is refused when it is decoded, a published chain is verified on its
first blocks only, and a message over the size limit is dropped by ZMQ."""

from __future__ import annotations

import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from kv_harness import FakePublisher, Heard

from inference_sidecar.kv import (
    BlockHashing,
    EventBatch,
    EventSource,
    KVEventFormatError,
    KVIndex,
    Stored,
    decode_batch,
)
from inference_sidecar.kv.batches import MAX_EVENT_BLOCKS, MAX_EVENT_TOKENS
from inference_sidecar.kv.index import VERIFY_BLOCKS

A = "http://a:1"
HASHING = BlockHashing(block_size=4)


def stored(first: int, n: int) -> Stored:
    return Stored(tuple(range(first, first + n)), None, (), 4)


class TestEviction:
    def test_evicting_at_the_cap_allocates_nothing_in_proportion_to_the_index(self) -> None:
        cap = 200_000
        index = KVIndex([A], max_blocks=cap)
        index.apply(A, EventBatch(0, (stored(0, cap),)))
        batch = EventBatch(1, (stored(cap, 10),))
        tracemalloc.start()
        try:
            index.apply(A, batch)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert index.block_count(A) == cap
        assert peak < 64 * 1024  # a copy of the keys alone would be 1.6 MB
        assert not index.holds(A, 9) and index.holds(A, 10) and index.holds(A, cap + 9)

    def test_a_reused_block_is_evicted_last(self) -> None:
        index = KVIndex([A], max_blocks=3)
        index.apply(A, EventBatch(0, (stored(0, 3),)))
        index.apply(A, EventBatch(1, (stored(0, 1),)))  # block 0 reused: now the newest
        index.apply(A, EventBatch(2, (stored(100, 1),)))
        assert [index.holds(A, b) for b in (0, 1, 2, 100)] == [True, False, True, True]


def raw_stored(hashes: int, tokens: int) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": list(range(hashes)),
        "parent_block_hash": None,
        "token_ids": [7] * tokens,
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
    }


class TestEventCaps:
    def test_an_event_with_more_token_ids_than_a_worker_publishes_is_refused(self) -> None:
        with pytest.raises(KVEventFormatError, match="token ids"):
            decode_batch(0, [0.0, [raw_stored(1, MAX_EVENT_TOKENS + 1)]])

    def test_an_event_naming_more_blocks_than_a_worker_publishes_is_refused(self) -> None:
        with pytest.raises(KVEventFormatError, match="block hashes"):
            decode_batch(0, [0.0, [raw_stored(MAX_EVENT_BLOCKS + 1, 0)]])
        removed = {"type": "BlockRemoved", "block_hashes": [1] * (MAX_EVENT_BLOCKS + 1)}
        with pytest.raises(KVEventFormatError, match="block hashes"):
            decode_batch(0, [0.0, [removed]])

    def test_an_event_at_the_caps_is_decoded(self) -> None:
        batch = decode_batch(0, [0.0, [raw_stored(MAX_EVENT_BLOCKS, MAX_EVENT_TOKENS)]])
        assert len(batch.events[0].hashes) == MAX_EVENT_BLOCKS  # type: ignore[union-attr]


@dataclass(frozen=True, slots=True)
class CountingHashing(BlockHashing):
    """``BlockHashing`` that notes how many tokens each call hashes."""

    hashed: list[int] = field(default_factory=list, compare=False)

    def block_hashes(self, token_ids: Any, extra_keys: Any = None) -> tuple[int, ...]:
        self.hashed.append(len(token_ids))
        return BlockHashing.block_hashes(self, token_ids, extra_keys)


class TestVerification:
    def test_a_long_chain_is_verified_on_its_first_blocks_only(self) -> None:
        tokens = list(range(4 * 5000))
        hashing = CountingHashing(block_size=4)
        index = KVIndex([A], hashing=hashing)
        chain = HASHING.block_hashes(tokens)
        index.apply(A, EventBatch(0, (Stored(chain, None, tuple(tokens), 4),)))
        assert hashing.hashed == [VERIFY_BLOCKS * 4]
        assert index.counters[A].verified == 1 and index.is_fresh(A)

    def test_a_chain_that_differs_in_its_first_blocks_is_still_caught(self) -> None:
        tokens = list(range(4 * 50))
        index = KVIndex([A], hashing=HASHING)
        other_seed = BlockHashing(block_size=4, seed="another-seed").block_hashes(tokens)
        index.apply(A, EventBatch(0, (Stored(other_seed, None, tuple(tokens), 4),)))
        assert index.counters[A].mismatches == 1 and not index.is_fresh(A)


class TestMessageSize:
    def test_a_message_over_the_size_limit_is_dropped_and_later_ones_arrive(
        self, tmp_path: Path
    ) -> None:
        publisher = FakePublisher(tmp_path)
        heard = Heard()
        subscriber = heard.subscriber({A: EventSource(publisher.endpoint)}, max_msg_bytes=64 * 1024)
        subscriber.start()
        try:
            seq = publisher.publish_until(lambda: heard.seqs(A))
            big = msgspec.msgpack.encode([0.0, [raw_stored(1, 100_000)], 0])
            assert len(big) > 64 * 1024
            publisher.pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), big])
            # heard again after the drop
            publisher.publish_until(
                lambda: any(s > seq for s, _ in heard.seqs(A)), seq + 1, timeout_s=10
            )
            assert seq not in {s for s, _ in heard.seqs(A)}
            assert (A, "disconnected") in heard.errors
        finally:
            subscriber.stop()
            publisher.close()
