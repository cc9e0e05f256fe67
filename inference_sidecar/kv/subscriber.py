"""The router's ears on the workers' KV cache events: one ZMQ subscriber per worker.

vLLM's ``ZmqEventPublisher`` sends each batch as three frames, ``(topic, sequence number
as 8 bytes big-endian, msgpack payload)``, on a PUB socket, and keeps its last batches
for a ROUTER "replay" socket: send it a starting sequence number (8 bytes) and it sends
back every buffered batch from there, then an end marker (sequence -1).

One thread polls every worker's sockets (ZMQ sockets are not for asyncio's loop, and
decoding stays off it); each decoded batch is handed over with ``deliver`` (the router
applies it on its event loop, so the index is only ever touched by one thread). When a
worker's sequence skips ahead and it has a replay endpoint, the missing batches are asked
for, without blocking anyone else: that worker's batches wait (``held``) until the replay
ends, passes ``replay_timeout_s`` or ``max_replay_batches``, then the replayed batches
and the held ones are delivered in order; the index clears the worker only if a hole is
still there. A worker whose replay failed is not asked again for ``replay_backoff_s``.

Every failure stays with its worker and is counted (``on_error(worker, kind)``):
``connect`` (its endpoint cannot be connected: its socket is closed and ``on_stream(worker,
False)`` says its events cannot be trusted), ``frames`` and ``format`` (a batch that does
not decode, skipped: the index then sees a gap), ``replay_timeout``, ``replay_overrun``,
``internal``. A message over ``max_msg_bytes`` makes ZMQ drop the connection, and ZMQ
does not reconnect after that (a protocol error, unlike a worker that restarts), so each
SUB socket is watched (a ZMQ monitor) and subscribed again when it is disconnected
(``disconnected``); the batches missed meanwhile are a gap. The thread never stops for
one worker's fault; the context is destroyed with linger 0, so stopping never hangs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from inference_sidecar.kv.batches import EventBatch, KVEventFormatError, decode_batch
from inference_sidecar.kv.sources import EventSource

log = logging.getLogger(__name__)

END_SEQ = -1
POLL_MS = 200
#: Per replay: how long a worker's batches may wait for the batches it missed.
REPLAY_TIMEOUT_S = 1.0
#: Per replay: batches taken from the replay buffer (vLLM keeps its last few thousand).
MAX_REPLAY_BATCHES = 1024
#: Per replay: live batches of the worker held back meanwhile.
MAX_HELD_BATCHES = 1024
#: After a failed replay, that worker's holes are left as gaps for this long.
REPLAY_BACKOFF_S = 30.0
#: ``ZMQ_MAXMSGSIZE``: far above a batch of one engine step (a long prompt's blocks are a
#: few hundred KiB), and a bound on what one message can make the router decode.
MAX_MSG_BYTES = 16 * 1024 * 1024

#: ``(worker, [(batch, replayed), ...])``: called in the subscriber's thread.
Deliver = Callable[[str, list[tuple[EventBatch, bool]]], None]


@dataclass(slots=True, eq=False)
class _Replay:
    """A replay in progress: the batches a worker missed, asked for from its buffer."""

    worker: str
    sock: Any
    #: The sequence number of the batch that revealed the hole (not replayed).
    until: int
    deadline: float
    got: list[EventBatch] = field(default_factory=list)
    #: The worker's live batches since the hole, the revealing one first.
    held: list[EventBatch] = field(default_factory=list)


class KVEventSubscriber:
    """Subscribes to every worker's stream in one background thread."""

    def __init__(
        self,
        sources: Mapping[str, EventSource],
        deliver: Deliver,
        on_error: Callable[[str, str], None] = lambda worker, kind: None,
        on_stream: Callable[[str, bool], None] = lambda worker, ok: None,
        *,
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
        max_replay_batches: int = MAX_REPLAY_BATCHES,
        replay_backoff_s: float = REPLAY_BACKOFF_S,
        max_msg_bytes: int = MAX_MSG_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sources = dict(sources)
        self._deliver = deliver
        self._on_error = on_error
        self._on_stream = on_stream
        self.replay_timeout_s = replay_timeout_s
        self.max_replay_batches = max_replay_batches
        self.replay_backoff_s = replay_backoff_s
        self.max_msg_bytes = max_msg_bytes
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._joined: list[str] = []  # workers added since the thread last looked
        self._left: list[str] = []  # workers removed since the thread last looked
        # Owned by the thread:
        self._next: dict[str, int] = {}
        self._subs: dict[Any, str] = {}
        self._monitors: dict[Any, tuple[str, Any]] = {}  # monitor -> (worker, its socket)
        self._replays: dict[str, _Replay] = {}
        self._no_replay_until: dict[str, float] = {}
        self._poller: Any = None
        self._ctx: Any = None

    # ----- control (any thread) ------------------------------------------------------

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
        """Stop hearing a worker that left; the thread closes its sockets within one poll
        interval."""
        with self._lock:
            self.sources.pop(worker, None)
            self._left.append(worker)

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    # ----- the thread ----------------------------------------------------------------

    def _run(self) -> None:
        import msgspec
        import zmq

        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        decoder = msgspec.msgpack.Decoder()
        try:
            with self._lock:
                self._joined.clear()
                first = list(self.sources)
            for worker in first:
                self._subscribe(worker)
            while not self._stop.is_set():
                self._follow_membership()
                for sock, _ in self._poller.poll(self._poll_ms()):
                    self._readable(sock, decoder)
                self._expire_replays()
        except Exception:
            log.exception("the KV event subscriber stopped; no worker's events are trusted")
            for worker in list(self.sources):
                self._on_error(worker, "internal")
                self._on_stream(worker, False)
        finally:
            self._ctx.destroy(linger=0)  # closes every socket first: term cannot hang

    def _follow_membership(self) -> None:
        if not (self._joined or self._left):  # a plain read first: the lock only then
            return
        with self._lock:
            joined, self._joined = self._joined, []
            left, self._left = self._left, []
            sources = dict(self.sources)
        for worker in left:
            self._unsubscribe(worker)
            self._next.pop(worker, None)
        for worker in joined:
            if worker in sources:
                self._subscribe(worker)

    def _socket(self, kind: int) -> Any:
        import zmq

        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_msg_bytes)
        return sock

    def _subscribe(self, worker: str) -> None:
        import zmq

        self._unsubscribe(worker)
        source = self.sources.get(worker)
        if source is None:
            return
        sock = self._socket(zmq.SUB)
        try:
            sock.setsockopt_string(zmq.SUBSCRIBE, source.topic)
            sock.connect(source.endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            log.warning(
                "cannot subscribe to %s's KV events at %s: %s", worker, source.endpoint, exc
            )
            self._on_error(worker, "connect")
            self._on_stream(worker, False)
            return
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        for s in (sock, monitor):
            self._poller.register(s, zmq.POLLIN)
        self._subs[sock] = worker
        self._monitors[monitor] = (worker, sock)
        self._on_stream(worker, True)

    def _unsubscribe(self, worker: str) -> None:
        for monitor, (w, sock) in list(self._monitors.items()):
            if w == worker:
                self._poller.unregister(monitor)
                del self._monitors[monitor]
                sock.disable_monitor()
                monitor.close(linger=0)
        for sock in [s for s, w in self._subs.items() if w == worker]:
            self._poller.unregister(sock)
            del self._subs[sock]
            sock.close(linger=0)
        replay = self._replays.pop(worker, None)
        if replay is not None:
            self._close(replay)

    def _disconnected(self, monitor: Any) -> None:
        """A SUB socket lost its connection: subscribe again (ZMQ gives up on a connection
        it dropped for a message over ``max_msg_bytes``)."""
        from zmq.utils.monitor import recv_monitor_message

        worker, _ = self._monitors[monitor]
        recv_monitor_message(monitor)
        log.warning("%s's KV event stream was disconnected; subscribing again", worker)
        self._on_error(worker, "disconnected")
        self._subscribe(worker)

    def _poll_ms(self) -> int:
        if not self._replays:
            return POLL_MS
        soonest = min(r.deadline for r in self._replays.values()) - self._clock()
        return max(0, min(POLL_MS, int(soonest * 1000) + 1))

    def _readable(self, sock: Any, decoder: Any) -> None:
        if sock in self._monitors:
            self._disconnected(sock)
            return
        worker = self._subs.get(sock)
        replay = None if worker is not None else self._replay_of(sock)
        if worker is not None:
            name = worker
        elif replay is not None:
            name = replay.worker
        else:
            return
        try:
            frames = sock.recv_multipart()
            if replay is not None:
                self._replayed(replay, decoder, frames)
            else:
                batch = self._decode(decoder, name, frames)
                if batch is not None:
                    self._received(name, batch)
        except Exception:  # one bad batch must not stop the subscriber
            log.exception("KV events from %s could not be handled", name)
            self._on_error(name, "internal")

    def _replay_of(self, sock: Any) -> _Replay | None:
        return next((r for r in self._replays.values() if r.sock is sock), None)

    def _decode(self, decoder: Any, worker: str, frames: list[bytes]) -> EventBatch | None:
        if len(frames) != 3:
            self._on_error(worker, "frames")
            return None
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        try:
            return decode_batch(seq, decoder.decode(payload))
        except (KVEventFormatError, ValueError) as exc:
            log.warning("undecodable KV event batch %d from %s: %s", seq, worker, exc)
            self._on_error(worker, "format")
            return None

    # ----- sequencing and replays ----------------------------------------------------

    def _received(self, worker: str, batch: EventBatch) -> None:
        replay = self._replays.get(worker)
        if replay is not None:
            replay.held.append(batch)
            if len(replay.held) >= MAX_HELD_BATCHES:
                self._finish(replay, "replay_overrun")
            return
        expected = self._next.get(worker, 0)
        source = self.sources.get(worker)
        if (
            batch.seq > expected
            and source is not None
            and source.replay is not None
            and self._clock() >= self._no_replay_until.get(worker, 0.0)
            and self._ask_replay(worker, source.replay, expected, batch)
        ):
            return
        self._next[worker] = batch.seq + 1
        self._deliver(worker, [(batch, False)])

    def _ask_replay(self, worker: str, endpoint: str, start: int, batch: EventBatch) -> bool:
        """Ask ``worker``'s replay socket for the batches from ``start`` on; False when
        it cannot even be asked."""
        import zmq

        sock = self._socket(zmq.DEALER)
        try:
            sock.connect(endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            log.warning("cannot ask %s for a replay at %s: %s", worker, endpoint, exc)
            self._on_error(worker, "replay_connect")
            return False
        self._poller.register(sock, zmq.POLLIN)
        deadline = self._clock() + self.replay_timeout_s
        self._replays[worker] = _Replay(worker, sock, batch.seq, deadline, held=[batch])
        return True

    def _replayed(self, replay: _Replay, decoder: Any, frames: list[bytes]) -> None:
        if len(frames) != 4:
            self._on_error(replay.worker, "frames")
            return
        if int.from_bytes(frames[2], "big", signed=True) == END_SEQ:
            self._finish(replay, None)
            return
        batch = self._decode(decoder, replay.worker, frames[1:])
        if batch is not None:
            replay.got.append(batch)
            if batch.seq >= replay.until - 1:
                self._finish(replay, None)  # everything missed is here
                return
        if len(replay.got) >= self.max_replay_batches:
            self._finish(replay, "replay_overrun")

    def _expire_replays(self) -> None:
        now = self._clock()
        for replay in [r for r in self._replays.values() if now >= r.deadline]:
            log.warning(
                "no complete replay from %s within %.1f s", replay.worker, self.replay_timeout_s
            )
            self._finish(replay, "replay_timeout")

    def _finish(self, replay: _Replay, error: str | None) -> None:
        """Deliver what the replay brought, then the batches held meanwhile, in order."""
        self._replays.pop(replay.worker, None)
        self._close(replay)
        if error is not None:
            self._on_error(replay.worker, error)
            self._no_replay_until[replay.worker] = self._clock() + self.replay_backoff_s
        first_live = replay.held[0].seq
        items = [(b, True) for b in replay.got if b.seq < first_live]
        items += [(b, False) for b in replay.held]
        self._next[replay.worker] = replay.held[-1].seq + 1
        self._deliver(replay.worker, items)

    def _close(self, replay: _Replay) -> None:
        self._poller.unregister(replay.sock)
        replay.sock.close(linger=0)
