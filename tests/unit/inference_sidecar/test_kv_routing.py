"""KV-event-aware routing: block hashes, the event index, prompt tokens and the policy."""

from __future__ import annotations

import hashlib
import pickle
import random
from typing import Any

import pytest

from inference_sidecar.kv import (
    Cleared,
    EventBatch,
    KVEventFormatError,
    KVIndex,
    Removed,
    Stored,
    decode_batch,
)
from inference_sidecar.kv.blocks import (
    BlockHashing,
    cache_config_from_metrics,
    external_hash,
    hashing_from_metrics,
)
from inference_sidecar.kv.prompt_tokens import PromptTokenizer, message_text
from inference_sidecar.policies import BoundedHashPolicy, KVPrefixPolicy, make_policy
from inference_sidecar.policies.bounded_hash import load_bound
from tests.support.clock import FakeClock

A, B, C = "http://a:1", "http://b:1", "http://c:1"
HASHING = BlockHashing(block_size=4)


def stored(tokens: list[int], hashing: BlockHashing = HASHING) -> Stored:
    """The event a worker publishes after caching ``tokens`` from the root."""
    return Stored(hashing.block_hashes(tokens), None, tuple(tokens), hashing.block_size)


def batch(seq: int, *events: Any) -> EventBatch:
    return EventBatch(seq, tuple(events))


PROMPT = list(range(1, 41))  # 10 blocks of 4


class TestBlockHashing:
    def test_a_block_hash_is_the_chained_sha256_of_the_pickled_parent_and_tokens(self) -> None:
        root = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
        first = hashlib.sha256(pickle.dumps((root, (1, 2, 3, 4), None), protocol=5)).digest()
        second = hashlib.sha256(pickle.dumps((first, (5, 6, 7, 8), None), protocol=5)).digest()
        assert HASHING.chain([1, 2, 3, 4, 5, 6, 7, 8]) == (first, second)

    def test_only_full_blocks_are_hashed(self) -> None:
        assert len(HASHING.block_hashes(list(range(11)))) == 2
        assert HASHING.block_hashes([1, 2, 3]) == ()

    def test_a_block_hash_depends_on_every_token_before_it(self) -> None:
        changed = [99, *PROMPT[1:]]
        ours, theirs = HASHING.block_hashes(PROMPT), HASHING.block_hashes(changed)
        assert all(a != b for a, b in zip(ours, theirs, strict=True))

    def test_the_seed_changes_every_hash(self) -> None:
        other = BlockHashing(4, seed="42")
        assert not set(other.block_hashes(PROMPT)) & set(HASHING.block_hashes(PROMPT))

    def test_published_digests_and_ints_fold_to_the_same_64_bits(self) -> None:
        digest = HASHING.chain(PROMPT)[0]
        as_int = int.from_bytes(digest, "big") & ((1 << 64) - 1)
        assert external_hash(digest) == external_hash(as_int) == HASHING.block_hashes(PROMPT)[0]

    def test_unreproducible_algorithms_are_refused(self) -> None:
        with pytest.raises(ValueError, match="xxhash"):
            BlockHashing(16, "xxhash")


METRICS = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
vllm:cache_config_info{block_size="32",enable_prefix_caching="True",engine="0",\
hash_block_size="32",prefix_caching_hash_algo="sha256"} 1.0
vllm:num_requests_running{engine="0"} 0.0
"""


class TestHashingFromMetrics:
    def test_reads_block_size_and_algorithm(self) -> None:
        assert hashing_from_metrics(METRICS) == BlockHashing(32, "sha256")

    def test_a_hash_block_size_of_none_means_the_block_size(self) -> None:
        text = METRICS.replace('hash_block_size="32"', 'hash_block_size="None"')
        assert hashing_from_metrics(text).block_size == 32

    def test_reads_every_label(self) -> None:
        assert cache_config_from_metrics(METRICS)["engine"] == "0"

    def test_prefix_caching_off_is_an_error(self) -> None:
        with pytest.raises(ValueError, match="prefix caching off"):
            hashing_from_metrics(METRICS.replace('caching="True"', 'caching="False"'))

    def test_no_cache_config_is_an_error(self) -> None:
        with pytest.raises(ValueError, match="cache_config_info"):
            hashing_from_metrics("vllm:num_requests_running 0\n")


class TestDecodeBatch:
    def test_decodes_the_three_event_kinds(self) -> None:
        payload = [
            1.5,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [7, b"\x00" * 24 + b"\x00\x00\x00\x00\x00\x00\x00\x08"],
                    "parent_block_hash": None,
                    "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
                    "block_size": 4,
                    "lora_id": None,
                    "medium": "GPU",
                },
                {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
                {"type": "AllBlocksCleared"},
            ],
            0,
        ]
        decoded = decode_batch(3, payload)
        assert decoded.seq == 3 and decoded.ts == 1.5
        assert decoded.events == (
            Stored((7, 8), None, (1, 2, 3, 4, 5, 6, 7, 8), 4),
            Removed((7,)),
            Cleared(),
        )

    def test_events_of_another_medium_are_ignored_and_counted(self) -> None:
        payload = [0.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU"}]]
        decoded = decode_batch(0, payload)
        assert decoded.events == () and decoded.ignored == 1

    @pytest.mark.parametrize(
        "payload",
        [None, [1.0], [1.0, "x"], [1.0, [{"type": "BlockStored", "block_hashes": "x"}]]],
    )
    def test_malformed_payloads_raise(self, payload: Any) -> None:
        with pytest.raises(KVEventFormatError):
            decode_batch(0, payload)


class TestIndexEvents:
    def index(self, **kw: Any) -> KVIndex:
        return KVIndex([A, B], hashing=HASHING, **kw)

    def test_stored_blocks_count_as_a_cached_prefix(self) -> None:
        index = self.index()
        assert index.apply(A, batch(0, stored(PROMPT[:20]))) == "applied"
        assert index.cached_blocks(A, HASHING.block_hashes(PROMPT)) == 5
        assert index.cached_blocks(B, HASHING.block_hashes(PROMPT)) == 0

    def test_a_prefix_stops_at_the_first_missing_block(self) -> None:
        index = self.index()
        hashes = HASHING.block_hashes(PROMPT)
        index.apply(A, batch(0, stored(PROMPT), Removed((hashes[2],))))
        assert index.cached_blocks(A, hashes) == 2

    def test_events_are_applied_in_order(self) -> None:
        index = self.index()
        hashes = HASHING.block_hashes(PROMPT)
        index.apply(A, batch(0, stored(PROMPT[:8])))
        index.apply(A, batch(1, Removed(hashes[:2])))
        index.apply(A, batch(2, stored(PROMPT[:8])))
        assert index.cached_blocks(A, hashes) == 2
        index.apply(A, batch(3, stored(PROMPT[:8]), Removed(hashes[:1])))
        assert index.cached_blocks(A, hashes) == 0

    def test_all_blocks_cleared_empties_the_worker(self) -> None:
        index = self.index()
        index.apply(A, batch(0, stored(PROMPT)))
        index.apply(A, batch(1, Cleared()))
        assert index.block_count(A) == 0 and index.counters[A].resyncs == {"cleared": 1}

    def test_a_missed_batch_clears_the_worker_before_applying(self) -> None:
        index = self.index()
        index.apply(A, batch(0, stored(PROMPT)))
        assert index.apply(A, batch(2, stored(PROMPT[:8]))) == "gap"
        assert index.cached_blocks(A, HASHING.block_hashes(PROMPT)) == 2
        assert index.counters[A].resyncs == {"gap": 1}
        assert index.expected_seq(A) == 3

    def test_a_router_that_joins_late_starts_from_a_gap(self) -> None:
        index = self.index()
        assert index.apply(A, batch(57, stored(PROMPT[:8]))) == "gap"
        assert index.apply(A, batch(58, stored(PROMPT[8:16]))) == "applied"

    def test_replayed_batches_fill_a_gap_without_clearing(self) -> None:
        index = self.index()
        index.apply(A, batch(0, stored(PROMPT[:8])))
        replay = [batch(0, stored(PROMPT[:8])), batch(1, stored(PROMPT[:16]))]
        outcomes = [index.apply(A, b, replayed=True) for b in replay]
        assert outcomes == ["duplicate", "applied"]
        assert index.apply(A, batch(2, stored(PROMPT))) == "applied"
        assert index.counters[A].resyncs == {}
        assert index.cached_blocks(A, HASHING.block_hashes(PROMPT)) == 10

    def test_a_sequence_that_goes_back_is_a_restarted_worker(self) -> None:
        index = self.index()
        index.apply(A, batch(0, stored(PROMPT)))
        index.apply(A, batch(1, stored(PROMPT[:4])))
        assert index.apply(A, batch(0, stored(PROMPT[:4]))) == "restart"
        assert index.cached_blocks(A, HASHING.block_hashes(PROMPT)) == 1

    def test_a_removed_worker_holds_nothing(self) -> None:
        index = self.index()
        index.apply(A, batch(0, stored(PROMPT)))
        index.remove_worker(A)
        assert A not in index.workers
        assert index.cached_blocks(A, HASHING.block_hashes(PROMPT)) == 0

    def test_reset_forgets_a_worker_and_counts_why(self) -> None:
        index = self.index()
        index.apply(A, batch(0, stored(PROMPT)))
        index.reset(A, "down")
        assert index.block_count(A) == 0 and index.counters[A].resyncs == {"down": 1}

    def test_entries_are_bounded_per_worker_oldest_dropped_first(self) -> None:
        index = self.index(max_blocks=6)
        index.apply(A, batch(0, stored(PROMPT)))
        hashes = HASHING.block_hashes(PROMPT)
        assert index.block_count(A) == 6
        assert index.cached_blocks(A, hashes) == 0  # the first blocks went first
        assert index.counters[A].resyncs == {"overflow": 1}

    def test_memory_follows_the_cache_not_the_shoppers(self) -> None:
        index = self.index(max_blocks=50)
        rng = random.Random(1)
        for seq in range(2000):  # 2000 distinct shoppers' prompts
            tokens = [rng.randrange(1000) for _ in range(16)]
            index.apply(A, batch(seq, stored(tokens)))
        assert index.block_count(A) == 50


class TestIndexFreshness:
    def test_a_worker_that_stops_publishing_after_a_request_becomes_stale(self) -> None:
        clock = FakeClock(100.0)
        index = KVIndex([A], hashing=HASHING, stale_after_s=5, clock=clock)
        index.expect_events(A)
        clock.now += 5
        assert index.is_fresh(A)
        clock.now += 0.1
        assert not index.is_fresh(A)
        index.apply(A, batch(0, stored(PROMPT)))
        assert index.is_fresh(A)

    def test_a_request_whose_events_already_arrived_expects_nothing_more(self) -> None:
        clock = FakeClock(100.0)
        index = KVIndex([A], hashing=HASHING, stale_after_s=5, clock=clock)
        sent = clock.now
        clock.now += 0.5
        index.apply(A, batch(0, stored(PROMPT)))  # published while the request ran
        clock.now += 1
        index.expect_events(A, since=sent)
        clock.now += 60
        assert index.is_fresh(A)

    def test_an_idle_worker_stays_fresh(self) -> None:
        clock = FakeClock(100.0)
        index = KVIndex([A], hashing=HASHING, stale_after_s=5, clock=clock)
        clock.now += 1000
        assert index.is_fresh(A)

    def test_a_worker_whose_hashes_differ_from_ours_is_not_trusted(self) -> None:
        index = KVIndex([A], hashing=HASHING)
        other_seed = BlockHashing(4, seed="123")
        index.apply(A, batch(0, stored(PROMPT, other_seed)))
        assert not index.is_fresh(A)
        assert index.counters[A].mismatches == 1
        index.apply(A, batch(1, stored(PROMPT)))
        assert index.is_fresh(A) and index.counters[A].verified == 1


class TestPromptTokenizer:
    TEMPLATE = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}\n"
        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )

    def tokenizer(self) -> PromptTokenizer:
        def encode(text: str, add_special: bool) -> list[int]:
            return ([0] if add_special else []) + [ord(c) for c in text]

        return PromptTokenizer(encode, self.TEMPLATE, {"eos_token": "|"})

    def test_chat_renders_the_template_with_a_generation_prompt_and_no_special_tokens(
        self,
    ) -> None:
        body = {"messages": [{"role": "user", "content": "hi"}]}
        ids = self.tokenizer().token_ids("chat/completions", body)
        assert ids == [ord(c) for c in "<user>hi|\n<assistant>"]

    def test_text_parts_are_joined_by_newlines(self) -> None:
        assert message_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == (
            "a\nb"
        )

    @pytest.mark.parametrize(
        "body",
        [
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            {"messages": [{"role": "user", "content": "x"}], "tools": [{}]},
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [{}]}]},
            {"messages": []},
        ],
    )
    def test_prompts_it_cannot_reproduce_give_none(self, body: dict[str, Any]) -> None:
        assert self.tokenizer().token_ids("chat/completions", body) is None

    def test_completions_add_special_tokens_and_pass_token_ids_through(self) -> None:
        tokenizer = self.tokenizer()
        assert tokenizer.token_ids("completions", {"prompt": "ab"}) == [0, 97, 98]
        assert tokenizer.token_ids("completions", {"prompt": [5, 6]}) == [5, 6]


def warm(index: KVIndex, worker: str, tokens: list[int], seq: int = 0) -> None:
    index.apply(worker, batch(seq, stored(tokens)))


class TestKVPrefixPolicy:
    def policy(self, **kw: Any) -> tuple[KVPrefixPolicy, KVIndex, FakeClock]:
        clock = FakeClock(100.0)
        index = KVIndex([A, B, C], hashing=HASHING, stale_after_s=5, clock=clock)
        return KVPrefixPolicy(index, clock=clock, **kw), index, clock

    def test_the_factory_builds_it_with_the_routers_index(self) -> None:
        index = KVIndex()
        policy = make_policy("kv_prefix", kv_index=index, load_factor=2.0)
        assert isinstance(policy, KVPrefixPolicy) and policy.index is index
        assert policy.wants_blocks and not BoundedHashPolicy.wants_blocks

    def test_a_new_key_goes_where_its_prefix_is_cached(self) -> None:
        # Every key with this prompt goes to the worker holding it, whatever its hash order.
        for holder in (A, B, C):
            policy, index, _ = self.policy()
            warm(index, holder, PROMPT[:32])
            blocks = HASHING.block_hashes(PROMPT)
            for key in (f"shopper-{i}" for i in range(20)):
                assert policy.pick(key, [A, B, C], {}, len(PROMPT), blocks) == holder

    def test_a_new_key_follows_its_prefix_onto_a_worker_over_its_residency_share(self) -> None:
        policy, index, _ = self.policy()
        blocks = HASHING.block_hashes(PROMPT)
        for i in range(3):  # A is home to three keys' prompts: over its residency share
            policy.on_finish(A, policy.on_start(A, f"old-{i}", 400), True)
        warm(index, A, PROMPT)
        assert A not in policy.roomy([A, B, C])
        assert policy.pick("new", [A, B, C], {}, 40, blocks) == A

    def test_a_shared_instruction_prefix_alone_does_not_herd_new_keys(self) -> None:
        policy, index, _ = self.policy()
        for i in range(3):
            policy.on_finish(A, policy.on_start(A, f"old-{i}", 400), True)
        warm(index, A, PROMPT[:12])  # 12 of 40 tokens: the instructions every prompt has
        blocks = HASHING.block_hashes(PROMPT)
        assert all(policy.pick(f"new-{i}", [A, B, C], {}, 40, blocks) != A for i in range(30))

    def test_residency_still_holds_for_a_prompt_cached_nowhere(self) -> None:
        policy, _, _ = self.policy()
        for i in range(3):
            policy.on_finish(A, policy.on_start(A, f"old-{i}", 400), True)
        other = [t + 1000 for t in PROMPT]
        blocks = HASHING.block_hashes(other)
        assert all(policy.pick(f"new-{i}", [A, B, C], {}, 40, blocks) != A for i in range(30))

    def test_a_keys_next_request_follows_its_previous_one_still_in_flight(self) -> None:
        policy, _, _ = self.policy(request_cost=0)  # prompts this small: no request cost
        blocks = HASHING.block_hashes(PROMPT)
        first = policy.pick("hot", [A, B, C], {}, 40, blocks)
        ticket = policy.on_start(first, "hot", 40, blocks)  # no event yet: being prefilled
        loads = {first: 1}
        assert policy.pick("hot", [A, B, C], loads, 40, blocks) == first
        assert policy.pick("another", [A, B, C], loads, 40, blocks) == first
        policy.on_finish(first, ticket, True)  # over, and no event came: nothing cached
        assert policy.cached_tokens(first, blocks) == 0

    def test_the_longest_cached_prefix_wins(self) -> None:
        policy, index, _ = self.policy()
        warm(index, A, PROMPT[:12])
        warm(index, B, PROMPT[:28])
        warm(index, C, PROMPT[:20])
        assert policy.pick("k", [A, B, C], {}, 40, HASHING.block_hashes(PROMPT)) == B

    def test_a_key_leaves_its_history_for_where_the_prefix_really_is(self) -> None:
        policy, index, _ = self.policy()
        blocks = HASHING.block_hashes(PROMPT)
        policy.on_start(A, "k", 40, blocks)  # history says A, but A evicted it (no events)
        warm(index, B, PROMPT)
        assert policy.pick("k", [A, B, C], {}, 40, blocks) == B

    def test_the_load_bound_comes_before_the_cached_prefix(self) -> None:
        policy, index, _ = self.policy(min_bound=1, load_factor=1.25)
        warm(index, A, PROMPT)
        loads = {A: 3, B: 1, C: 1}
        assert load_bound(5, 3, 1.25, 1) <= loads[A]
        assert policy.pick("k", [A, B, C], loads, 40, HASHING.block_hashes(PROMPT)) != A

    def test_no_worker_is_ever_above_the_bound(self) -> None:
        policy, index, _ = self.policy(min_bound=1)
        warm(index, A, PROMPT)  # every request wants A
        blocks = HASHING.block_hashes(PROMPT)
        loads = {A: 0, B: 0, C: 0}
        rng = random.Random(7)
        for i in range(500):
            total = sum(loads.values())
            bound = load_bound(total, 3, policy.load_factor, 1)
            worker = policy.pick(f"k{i % 17}", [A, B, C], loads, 40, blocks)
            assert loads[worker] < bound
            loads[worker] += 1
            if rng.random() < 0.5:  # some finish
                busy = [w for w in loads if loads[w]]
                loads[rng.choice(busy)] -= 1

    def test_a_stale_worker_is_judged_by_hashing_and_counted(self) -> None:
        policy, index, clock = self.policy()
        blocks = HASHING.block_hashes(PROMPT)
        warm(index, A, PROMPT)
        index.expect_events(A)
        clock.now += 6  # A went silent after a request: its entries are not trusted
        ticket = policy.on_start(C, "k", 40, blocks)  # the key's history says C
        policy.on_finish(C, ticket, True)
        # A's 10 cached blocks no longer count: like every other worker it must compute
        # the whole prompt, and the tie goes to the key's own worker.
        assert policy.pick("k", [A, B, C], {}, 40, blocks) == C
        assert policy.fallbacks == {A: 1}

    def test_without_blocks_it_routes_as_bounded_hash_does(self) -> None:
        policy, index, _ = self.policy()
        reference = BoundedHashPolicy()
        warm(index, A, PROMPT)
        for i in range(50):
            key = f"shopper-{i}"
            assert policy.pick(key, [A, B, C], {}, 40) == reference.pick(key, [A, B, C], {}, 40)
        assert policy.fallbacks == {}

    def test_the_queue_counts_only_what_the_chosen_worker_must_compute(self) -> None:
        policy, index, _ = self.policy()
        warm(index, A, PROMPT[:32])
        policy.on_start(A, "k", 40, HASHING.block_hashes(PROMPT))
        assert policy.queued_tokens(A) == 8
