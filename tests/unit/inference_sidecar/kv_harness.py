"""What the kv_prefix tests share: a character tokenizer, a kv_prefix router in front of
fake workers, event batches, and vLLM's ZMQ publisher's wire format on ``ipc://``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq
from fake_workers import FakeWorkers
from router_harness import A, B

from inference_sidecar.config import RouterConfig
from inference_sidecar.kv import (
    BlockHashing,
    EventBatch,
    EventSource,
    KVEventSubscriber,
    PromptTokenizer,
    Stored,
)
from inference_sidecar.router import Router
from tests.support.waiting import until

HASHING = BlockHashing(block_size=4)
EVENTS = {A: EventSource("tcp://127.0.0.1:10001"), B: EventSource("tcp://127.0.0.1:10002")}


def char_tokenizer() -> PromptTokenizer:
    """One token per character of the concatenated message contents."""
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return PromptTokenizer(lambda text, special: [ord(c) for c in text], template)


class FakePublisher:
    """vLLM's ZmqEventPublisher's wire format, on ipc:// sockets, with a replay buffer."""

    def __init__(self, tmp_path: Path) -> None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.ctx = zmq.Context()
        self.endpoint = f"ipc://{tmp_path}/events"
        self.replay_endpoint = f"ipc://{tmp_path}/replay"
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(self.endpoint)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(self.replay_endpoint)
        self.buffer: list[tuple[int, bytes]] = []
        self.replays = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replays, daemon=True)
        self._thread.start()

    @staticmethod
    def payload(tokens: list[int]) -> bytes:
        event = {
            "type": "BlockStored",
            "block_hashes": list(HASHING.block_hashes(tokens)),
            "parent_block_hash": None,
            "token_ids": tokens,
            "block_size": HASHING.block_size,
            "lora_id": None,
            "medium": "GPU",
        }
        return msgspec.msgpack.encode([time.time(), [event], 0])

    def publish(self, seq: int, tokens: list[int], *, drop: bool = False) -> None:
        payload = self.payload(tokens)
        self.buffer.append((seq, payload))
        if not drop:
            self.pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), payload])

    def publish_until(
        self,
        heard: Callable[[], object],
        seq: int = 0,
        *,
        replayable: bool = True,
        timeout_s: float = 5.0,
    ) -> int:
        """Publish batches ``seq``, ``seq + 1``, ... until ``heard()``: a SUB socket misses
        what is sent before it has joined, and when it has is not observable. Without
        ``replayable`` only the newest batch stays in the replay buffer. Returns the next
        sequence number."""
        next_seq = seq

        def probe() -> bool:
            nonlocal next_seq
            if heard():
                return True
            if not replayable:
                self.buffer.clear()
            self.publish(next_seq, list(range(8)))
            next_seq += 1
            return False

        until(probe, "the subscriber to hear a batch", timeout_s=timeout_s, interval_s=0.05)
        return next_seq

    def _serve_replays(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            client, _, start = self.router.recv_multipart()
            self.replays += 1
            first = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= first:
                    frames = [client, b"", b"kv-events", seq.to_bytes(8, "big"), payload]
                    self.router.send_multipart(frames)
            end = (-1).to_bytes(8, "big", signed=True)
            self.router.send_multipart([client, b"", b"", end, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


def kv_prefix_router(fake: FakeWorkers) -> Router:
    """A kv_prefix router over workers A and B, with their events fed by hand."""
    config = RouterConfig(
        workers=(A, B),
        policy="kv_prefix",
        kv_events=EVENTS,
        tokenizer_dir="unused",
        health_interval_s=0,
    )
    return Router(
        config, transport=fake.transport(), tokenizer=char_tokenizer(), kv_hashing=HASHING
    )


def prompt_tokens(body: dict[str, Any]) -> list[int]:
    return [ord(c) for c in body["messages"][0]["content"]]


def stored_batch(seq: int, tokens: list[int]) -> list[tuple[EventBatch, bool]]:
    event = Stored(HASHING.block_hashes(tokens), None, tuple(tokens), HASHING.block_size)
    return [(EventBatch(seq, (event,)), False)]


class Heard:
    """What a subscriber delivered and reported, per worker, in order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.deliveries: list[tuple[str, list[tuple[int, bool]]]] = []
        self.errors: list[tuple[str, str]] = []
        self.streams: list[tuple[str, bool]] = []

    def deliver(self, worker: str, items: list[tuple[EventBatch, bool]]) -> None:
        with self.lock:
            self.deliveries.append((worker, [(b.seq, replayed) for b, replayed in items]))

    def error(self, worker: str, kind: str) -> None:
        with self.lock:
            self.errors.append((worker, kind))

    def stream(self, worker: str, ok: bool) -> None:
        with self.lock:
            self.streams.append((worker, ok))

    def seqs(self, worker: str) -> list[tuple[int, bool]]:
        with self.lock:
            return [item for w, items in self.deliveries if w == worker for item in items]

    def subscriber(self, sources: dict[str, EventSource], **kw: Any) -> KVEventSubscriber:
        return KVEventSubscriber(sources, self.deliver, self.error, self.stream, **kw)
