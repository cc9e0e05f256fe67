"""A worker's KV event stream that is misconfigured or misbehaves stays that worker's
problem: a bad endpoint is refused when it is given, one that cannot be connected is
counted and makes the worker's events untrusted, the subscriber never hangs on stopping,
and a replay endpoint that never answers (or never stops) delays only its own worker,
within a bound."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from fake_workers import FakeWorkers
from kv_harness import FakePublisher, Heard, kv_prefix_router
from router_harness import ADMIN, ADMIN_TOKEN, A, B, C, assert_openai_error

from inference_sidecar.config import RouterConfig
from inference_sidecar.exceptions import ConfigError
from inference_sidecar.kv import EventSource
from tests.support.waiting import until

BAD_ENDPOINTS = [
    "tcp://127.0.0.1",  # no port: libzmq refuses it in connect()
    "tcp://*:5557",  # a bind address, not one to connect to
    "udp://127.0.0.1:5557",
    "tcp://127.0.0.1:0",
    "ipc://",
    "ipc:///tmp/" + "x" * 120,  # longer than a Unix socket path can be
    "worker-4:5557",
]


def heard_from(publisher: FakePublisher, heard: Heard, worker: str) -> int:
    """Publish until ``worker``'s subscriber hears a batch (a SUB socket misses what is
    sent before it has joined); returns the next sequence number."""
    publisher.publish_until(lambda: heard.seqs(worker), replayable=False)
    return heard.seqs(worker)[-1][0] + 1


def publish_until_asked(publisher: FakePublisher, seq: int, replay: SilentReplay) -> None:
    """Publish batch ``seq`` (a hole before it) until the subscriber asks ``replay`` for
    the missing ones: the first copies may be sent before the subscriber has joined."""
    for _ in range(100):
        publisher.publish(seq, list(range(8)))
        if replay.asked.wait(0.05):
            return
    raise AssertionError("the subscriber never asked for a replay")


class SilentReplay:
    """A replay endpoint that takes requests and answers only when ``answer()`` is called
    (or, ``endless``, streams batches that never reach the end marker)."""

    def __init__(self, tmp_path: Path, publisher: FakePublisher, *, endless: bool = False):
        self.ctx = zmq.Context()
        self.endpoint = f"ipc://{tmp_path}/silent-replay"
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(self.endpoint)
        self.publisher = publisher
        self.endless = endless
        self.asked = threading.Event()
        self._answer = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def answer(self) -> None:
        self._answer.set()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            client, _, start = self.sock.recv_multipart()
            self.asked.set()
            seq = int.from_bytes(start, "big")
            while not self._stop.is_set():
                if self.endless:  # batches below the hole, forever
                    payload = self.publisher.payload(list(range(8)))
                    frames = [client, b"", b"kv-events", seq.to_bytes(8, "big"), payload]
                    self.sock.send_multipart(frames)
                    time.sleep(0.001)
                elif self._answer.wait(0.02):
                    end = (-1).to_bytes(8, "big", signed=True)
                    self.sock.send_multipart([client, b"", b"", end, b""])
                    break

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close(0)
        self.ctx.term()


@pytest.mark.anyio
class TestEndpoints:
    @pytest.mark.parametrize("endpoint", BAD_ENDPOINTS)
    async def test_a_join_with_an_unusable_endpoint_is_a_400_naming_it(
        self, client_for: Any, endpoint: str
    ) -> None:
        client, router = client_for(workers=(A, B), admin_token=ADMIN_TOKEN)
        body = {"url": C, "kv_events": {"endpoint": endpoint}}
        reply = await client.post("/workers", json=body, headers=ADMIN)
        error = assert_openai_error(reply, 400)
        assert error["param"] == "kv_events.endpoint"
        assert router.serving_pool.workers == (A, B)

    async def test_a_bad_replay_endpoint_is_a_400_too(self, client_for: Any) -> None:
        client, _ = client_for(workers=(A, B), admin_token=ADMIN_TOKEN)
        body = {"url": C, "kv_events": {"endpoint": "tcp://h:1", "replay": "tcp://h"}}
        reply = await client.post("/workers", json=body, headers=ADMIN)
        assert assert_openai_error(reply, 400)["param"] == "kv_events.replay"

    @pytest.mark.parametrize("endpoint", BAD_ENDPOINTS)
    def test_the_config_refuses_an_unusable_endpoint(self, endpoint: str) -> None:
        with pytest.raises(ConfigError):
            RouterConfig(workers=(A,), kv_events={A: EventSource(endpoint)})


def unconnectable() -> EventSource:
    """A source past validation that libzmq still refuses to connect (as an endpoint that
    is valid text but not for this host would be)."""
    source = EventSource("tcp://127.0.0.1:5557")
    object.__setattr__(source, "endpoint", "tcp://127.0.0.1")
    return source


class TestConnectFailure:
    def test_a_stream_that_cannot_be_connected_is_counted_and_the_others_go_on(
        self, tmp_path: Path
    ) -> None:
        publisher = FakePublisher(tmp_path)
        heard = Heard()
        subscriber = heard.subscriber({A: unconnectable(), B: EventSource(publisher.endpoint)})
        subscriber.start()
        thread = subscriber._thread
        try:
            heard_from(publisher, heard, B)
            assert (A, "connect") in heard.errors
            assert (A, False) in heard.streams and (B, True) in heard.streams
        finally:
            subscriber.stop()
            publisher.close()
        assert thread is not None and not thread.is_alive()  # stopping did not hang

    def test_the_worker_that_cannot_be_heard_is_not_fresh(self, fake: FakeWorkers) -> None:
        router = kv_prefix_router(fake)
        index = router.kv_index
        assert index is not None and index.is_fresh(A)
        index.set_stream(A, False)
        assert not index.is_fresh(A) and index.is_fresh(B)
        assert index.counters[A].resyncs == {"stream_lost": 1}
        index.set_stream(A, True)
        assert index.is_fresh(A)


class TestReplays:
    def test_a_replay_that_does_not_answer_holds_back_only_its_own_worker(
        self, tmp_path: Path
    ) -> None:
        slow = FakePublisher(tmp_path / "a")
        other = FakePublisher(tmp_path / "b")
        silent = SilentReplay(tmp_path, slow)
        heard = Heard()
        sources = {
            A: EventSource(slow.endpoint, silent.endpoint),
            B: EventSource(other.endpoint),
        }
        subscriber = heard.subscriber(sources, replay_timeout_s=30.0)
        subscriber.start()
        try:
            seq_b = heard_from(other, heard, B)
            publish_until_asked(slow, 5, silent)  # A's batch 5 skips 0..4: a replay
            other.publish(seq_b, list(range(12)))
            until(lambda: (seq_b, False) in heard.seqs(B), "B's batch")
            assert heard.seqs(A) == []  # A's batch waits for its replay, B's did not
            silent.answer()
            until(lambda: heard.seqs(A), "A's batches after its replay")
            assert set(heard.seqs(A)) == {(5, False)}
        finally:
            subscriber.stop()
            silent.close()
            slow.close()
            other.close()

    def test_a_replay_past_its_deadline_delivers_the_held_batches_and_is_counted(
        self, tmp_path: Path
    ) -> None:
        publisher = FakePublisher(tmp_path / "a")
        silent = SilentReplay(tmp_path, publisher)
        heard = Heard()
        subscriber = heard.subscriber(
            {A: EventSource(publisher.endpoint, silent.endpoint)}, replay_timeout_s=0.2
        )
        subscriber.start()
        try:
            publish_until_asked(publisher, 5, silent)
            publisher.publish(6, list(range(8)))
            until(lambda: (6, False) in heard.seqs(A), "A's batch 6")
            assert set(heard.seqs(A)) == {(5, False), (6, False)}  # held, then delivered
            assert (A, "replay_timeout") in heard.errors
        finally:
            subscriber.stop()
            silent.close()
            publisher.close()

    def test_a_replay_that_never_ends_is_cut_at_its_batch_bound(self, tmp_path: Path) -> None:
        publisher = FakePublisher(tmp_path / "a")
        endless = SilentReplay(tmp_path, publisher, endless=True)
        heard = Heard()
        subscriber = heard.subscriber(
            {A: EventSource(publisher.endpoint, endless.endpoint)},
            replay_timeout_s=30.0,
            max_replay_batches=50,
        )
        subscriber.start()
        try:
            publish_until_asked(publisher, 10_000, endless)
            until(lambda: (10_000, False) in heard.seqs(A), "A's batch 10000")
            replayed = [seq for seq, replayed in heard.seqs(A) if replayed]
            assert 0 < len(replayed) <= 50
            assert (A, "replay_overrun") in heard.errors
        finally:
            subscriber.stop()
            endless.close()
            publisher.close()
