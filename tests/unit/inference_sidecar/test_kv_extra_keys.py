"""vLLM hashes a block with extra keys besides its tokens: a request's ``cache_salt`` on
its first block, a LoRA adapter's name and path on every block
(``vllm/v1/core/kv_cache_utils.py``). A chain published with them must not make the
router distrust the worker, and a request carrying them must be hashed with them.
(Against a real worker: ``tests/model/test_router_kv_extra_keys_vllm.py``.)"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from inference_sidecar.kv import (
    BlockHashing,
    EventBatch,
    KVIndex,
    PromptTokenizer,
    Stored,
    decode_batch,
)
from inference_sidecar.kv.blocks import BlockExtras, Unverifiable, event_extra_keys
from inference_sidecar.kv.models import WorkerModels, models_from_list
from inference_sidecar.kv.prompt_blocks import prompt_blocks

A = "http://a:1"
HASHING = BlockHashing(block_size=4)
TOKENS = tuple(range(4 * 6))
SALT = "tenant-7"
LORA = ("intent-adapter", "/models/adapters/intent")


def untagged(extras: BlockExtras, blocks: int) -> list[Any]:
    """The per-block extra keys as a KV event publishes them (``to_event_extra_keys``)."""
    out: list[Any] = []
    for i in range(blocks):
        keys = extras(i)
        out.append(None if keys is None else [key[1] for key in keys])
    return out


def published(extras: BlockExtras, lora_name: str | None = None) -> Stored:
    """A root chain as a worker publishes it for ``TOKENS`` hashed with ``extras``."""
    hashes = HASHING.block_hashes(TOKENS, extras)
    return Stored(hashes, None, TOKENS, 4, lora_name, tuple(untagged(extras, len(hashes))))


class TestHashing:
    def test_a_salt_changes_only_the_chain_it_starts(self) -> None:
        salted = HASHING.block_hashes(TOKENS, BlockExtras(cache_salt=SALT))
        plain = HASHING.block_hashes(TOKENS)
        assert all(s != p for s, p in zip(salted, plain, strict=True))  # chained from block 0
        assert salted != HASHING.block_hashes(TOKENS, BlockExtras(cache_salt="another"))

    def test_the_keys_are_tagged_as_vllm_tags_them(self) -> None:
        extras = BlockExtras(lora=LORA, cache_salt=SALT)
        assert extras(0) == (("lora", *LORA), ("cache_salt", SALT))
        assert extras(1) == (("lora", *LORA),)
        assert BlockExtras(cache_salt=SALT)(1) is None


class TestVerifyingPublishedChains:
    def index(self) -> KVIndex:
        index = KVIndex([A], hashing=HASHING)
        index.lora_paths = {LORA[0]: LORA[1]}
        return index

    def test_a_salted_chain_is_verified_and_the_worker_stays_trusted(self) -> None:
        index = self.index()
        index.apply(A, EventBatch(0, (published(BlockExtras(cache_salt=SALT)),)))
        counters = index.counters[A]
        assert (counters.verified, counters.mismatches) == (1, 0) and index.is_fresh(A)

    def test_a_salted_chain_heard_on_the_wire_keeps_the_worker_trusted(self) -> None:
        hashes = HASHING.block_hashes(TOKENS, BlockExtras(cache_salt=SALT))
        raw = {
            "type": "BlockStored",
            "block_hashes": list(hashes),
            "parent_block_hash": None,
            "token_ids": list(TOKENS),
            "block_size": 4,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [[SALT]] + [None] * (len(hashes) - 1),
        }
        wire = msgspec.msgpack.decode(msgspec.msgpack.encode([0.0, [raw], 0]))
        index = self.index()
        index.apply(A, decode_batch(0, wire))
        assert index.counters[A].mismatches == 0 and index.is_fresh(A)

    def test_an_adapters_chain_is_verified_with_its_path(self) -> None:
        index = self.index()
        event = published(BlockExtras(lora=LORA, cache_salt=SALT), lora_name=LORA[0])
        index.apply(A, EventBatch(0, (event,)))
        assert index.counters[A].verified == 1 and index.is_fresh(A)

    def test_an_adapter_of_unknown_path_is_counted_and_judged_neither_way(self) -> None:
        index = KVIndex([A], hashing=HASHING)
        event = published(BlockExtras(lora=LORA), lora_name=LORA[0])
        index.apply(A, EventBatch(0, (event,)))
        counters = index.counters[A]
        assert (counters.unverifiable, counters.mismatches, counters.verified) == (1, 0, 0)
        assert index.is_fresh(A) and index.holds(A, event.hashes[0])

    def test_a_salted_chain_published_as_if_unsalted_is_still_a_mismatch(self) -> None:
        index = self.index()
        hashes = HASHING.block_hashes(TOKENS, BlockExtras(cache_salt=SALT))
        index.apply(A, EventBatch(0, (Stored(hashes, None, TOKENS, 4),)))
        assert index.counters[A].mismatches == 1 and not index.is_fresh(A)

    def test_multimodal_and_embedding_keys_are_tagged_again(self) -> None:
        keys = event_extra_keys([[["img-1", 3]], [b"\x01\x02"], None], None, {})
        assert keys is not None
        assert keys(0) == (("mm", "img-1", 3),) and keys(1) == (("prompt_embeds", b"\x01\x02"),)
        assert keys(2) is None and keys(9) is None

    def test_keys_of_a_shape_vllm_does_not_publish_cannot_be_verified(self) -> None:
        with pytest.raises(Unverifiable):
            event_extra_keys([[3.5]], None, {})

    @pytest.mark.parametrize("array_like", [False, True])
    def test_the_event_carries_its_adapter_and_extra_keys(self, array_like: bool) -> None:
        fields: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": [1, 2],
            "parent_block_hash": None,
            "token_ids": list(range(8)),
            "block_size": 4,
            "lora_id": 1,
            "medium": "GPU",
            "lora_name": LORA[0],
            "extra_keys": [[LORA[0], SALT], [LORA[0]]],
        }
        raw = ["BlockStored", *list(fields.values())[1:]] if array_like else fields
        payload = msgspec.msgpack.decode(msgspec.msgpack.encode([0.0, [raw], 0]))
        event = decode_batch(0, payload).events[0]
        assert isinstance(event, Stored)
        assert event.lora_name == LORA[0]
        assert event.extra_keys == ([LORA[0], SALT], [LORA[0]])


TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


class TestHashingRequests:
    tokenizer = PromptTokenizer(lambda text, special: [ord(c) for c in text], TEMPLATE)

    def blocks(self, models: WorkerModels | None = None, **body: Any) -> Any:
        doc = {"model": "base", "messages": [{"role": "user", "content": "x" * 24}], **body}
        return prompt_blocks(self.tokenizer, "chat/completions", doc, HASHING, 4096, models)

    def test_a_salted_request_is_hashed_with_its_salt(self) -> None:
        salted = self.blocks(cache_salt=SALT)
        assert salted.unhashed is None
        assert salted.blocks == HASHING.block_hashes([ord("x")] * 24, BlockExtras(cache_salt=SALT))
        assert salted.blocks != self.blocks().blocks

    def test_an_adapters_request_is_hashed_with_the_adapter(self) -> None:
        models = WorkerModels(4096, frozenset({"base"}), {LORA[0]: LORA[1]})
        result = self.blocks(models, model=LORA[0])
        assert result.blocks == HASHING.block_hashes([ord("x")] * 24, BlockExtras(lora=LORA))

    def test_a_model_no_worker_lists_is_not_hashed(self) -> None:
        models = WorkerModels(4096, frozenset({"base"}), {})
        assert self.blocks(models, model="other").unhashed == "unknown_model"

    def test_a_salt_vllm_would_refuse_is_not_hashed(self) -> None:
        assert self.blocks(cache_salt="").unhashed == "unreproducible"
        assert self.blocks(cache_salt=7).unhashed == "unreproducible"

    def test_the_adapters_are_read_from_vllms_model_list(self) -> None:
        text = (
            '{"object": "list", "data": ['
            '{"id": "base", "max_model_len": 4096, "root": "/models/base", "parent": null},'
            f'{{"id": "{LORA[0]}", "root": "{LORA[1]}", "parent": "base"}}]}}'
        )
        models = models_from_list(text)
        assert models == WorkerModels(4096, frozenset({"base"}), {LORA[0]: LORA[1]})
