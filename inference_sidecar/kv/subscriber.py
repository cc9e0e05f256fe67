"""The router's ears on the workers' KV cache events: one ZMQ subscriber per worker.

vLLM's ``ZmqEventPublisher`` sends each batch as three frames, ``(topic, sequence number
as 8 bytes big-endian, msgpack payload)``, on a PUB socket, and keeps its last batches
for a ROUTER "replay" socket: send it a starting sequence number (8 bytes) and it sends
back every buffered batch from there, then an end marker (sequence -1).

One thread polls every worker's SUB socket (ZMQ sockets are not for asyncio's loop, and
decoding stays off it); each decoded batch is handed to the event loop with
``call_soon_threadsafe`` and applied there to the ``KVIndex``, so the index is only ever
touched by one thread. When a worker's sequence skips ahead and it has a replay
endpoint, the thread first asks for the missing batches and hands them over, marked as
replayed, before the batch that revealed the hole; the index clears the worker only if
the hole is still there.

ZMQ reconnects by itself to a worker that restarts; a payload that does not decode is
counted (``on_error``) and skipped, which the index then sees as a gap.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from inference_sidecar.kv.batches import EventBatch, KVEventFormatError, decode_batch

log = logging.getLogger(__name__)

END_SEQ = -1
POLL_MS = 200
REPLAY_TIMEOUT_MS = 1000


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where one worker publishes: its PUB endpoint, and its replay endpoint if any."""

    endpoint: str
    replay: str | None = None
    topic: str = ""


Deliver = Callable[[str, list[tuple[EventBatch, bool]]], None]
"""``(worker, [(batch, replayed), ...])``: called in the subscriber's thread."""


class KVEventSubscriber:
    """Subscribes to every worker's stream in one background thread."""

    def __init__(
        self,
        sources: Mapping[str, EventSource],
        deliver: Deliver,
        on_error: Callable[[str, str], None] = lambda worker, kind: None,
    ) -> None:
        self.sources = dict(sources)
        self._deliver = deliver
        self._on_error = on_error
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next: dict[str, int] = {}
        self._lock = threading.Lock()
        self._joined: list[str] = []  # workers added since the thread last looked
        self._left: list[str] = []  # workers removed since the thread last looked

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run, name="kv-event-subscriber", daemon=True
            )
            self._thread.start()

    def add(self, worker: str, source: EventSource) -> None:
        """Subscribe to a worker that joined at runtime; the thread connects to it within
        one poll interval."""
        with self._lock:
            self.sources[worker] = source
            self._joined.append(worker)

    def remove(self, worker: str) -> None:
        """Stop hearing a worker that left; the thread closes its socket within one poll
        interval."""
        with self._lock:
            self.sources.pop(worker, None)
            self._left.append(worker)

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        import msgspec
        import zmq

        ctx = zmq.Context()
        decoder = msgspec.msgpack.Decoder()
        sockets: dict[zmq.Socket, str] = {}
        poller = zmq.Poller()

        def subscribe(worker: str) -> None:
            source = self.sources[worker]
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt_string(zmq.SUBSCRIBE, source.topic)
            sub.connect(source.endpoint)
            poller.register(sub, zmq.POLLIN)
            sockets[sub] = worker

        try:
            with self._lock:
                self._joined.clear()
                for worker in list(self.sources):
                    subscribe(worker)
            while not self._stop.is_set():
                if self._joined or self._left:  # a plain read first: the lock only then
                    with self._lock:
                        joined, self._joined = self._joined, []
                        left, self._left = self._left, []
                    for worker in left:
                        for sock in [s for s, w in sockets.items() if w == worker]:
                            poller.unregister(sock)
                            del sockets[sock]
                            sock.close(linger=0)
                    for worker in joined:
                        if worker in self.sources:
                            subscribe(worker)
                for sock, _ in poller.poll(POLL_MS):
                    worker = sockets[sock]  # type: ignore[index]
                    frames = sock.recv_multipart()  # type: ignore[union-attr]
                    try:
                        self._received(ctx, decoder, worker, frames)
                    except Exception:  # one bad batch must not stop the subscriber
                        log.exception("KV events from %s could not be handled", worker)
                        self._on_error(worker, "internal")
        finally:
            for sock in sockets:
                sock.close(linger=0)
            ctx.term()

    def _decode(self, decoder: object, worker: str, frames: list[bytes]) -> EventBatch | None:
        if len(frames) != 3:
            self._on_error(worker, "frames")
            return None
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        try:
            return decode_batch(seq, decoder.decode(payload))  # type: ignore[attr-defined]
        except (KVEventFormatError, ValueError) as exc:
            log.warning("undecodable KV event batch %d from %s: %s", seq, worker, exc)
            self._on_error(worker, "format")
            return None

    def _received(self, ctx: object, decoder: object, worker: str, frames: list[bytes]) -> None:
        batch = self._decode(decoder, worker, frames)
        if batch is None:
            return
        expected = self._next.get(worker, 0)
        items: list[tuple[EventBatch, bool]] = []
        replay = self.sources[worker].replay
        if batch.seq > expected and replay is not None:
            items = [
                (b, True)
                for b in self._replay(ctx, decoder, worker, replay, expected)
                if b.seq < batch.seq
            ]
        items.append((batch, False))
        self._next[worker] = batch.seq + 1
        self._deliver(worker, items)

    def _replay(
        self, ctx: object, decoder: object, worker: str, endpoint: str, start: int
    ) -> list[EventBatch]:
        """The worker's buffered batches from ``start`` on (empty if it does not answer)."""
        import zmq

        sock = ctx.socket(zmq.DEALER)  # type: ignore[attr-defined]
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, REPLAY_TIMEOUT_MS)
        out: list[EventBatch] = []
        try:
            sock.connect(endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = sock.recv_multipart()
                if len(frames) == 4 and int.from_bytes(frames[2], "big", signed=True) == END_SEQ:
                    break
                if len(frames) == 4:
                    batch = self._decode(decoder, worker, frames[1:])
                    if batch is not None:
                        out.append(batch)
        except zmq.Again:
            log.warning("no replay from %s within %d ms", worker, REPLAY_TIMEOUT_MS)
            self._on_error(worker, "replay_timeout")
        finally:
            sock.close(linger=0)
        return out
