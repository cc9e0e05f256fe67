"""The kv_prefix policy wired in: configuration, worker launch, the ZMQ subscriber (over
Unix-domain ``ipc://`` sockets, no network) and the router in front of fake workers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from fake_workers import FakeWorkers
from kv_harness import (
    EVENTS,
    HASHING,
    FakePublisher,
    char_tokenizer,
    kv_prefix_router,
    prompt_tokens,
    stored_batch,
)
from router_harness import BODY, CHAT, A, B, C, metric, session

from inference_sidecar.cli import build_parser, cluster_config, parse_kv_events
from inference_sidecar.config import RouterConfig
from inference_sidecar.exceptions import ConfigError
from inference_sidecar.health import HealthEvent
from inference_sidecar.kv import EventBatch, Stored
from inference_sidecar.kv.sources import EventSource
from inference_sidecar.kv.subscriber import KVEventSubscriber
from inference_sidecar.router import Router, build_app
from inference_sidecar.workers import KV_EVENTS_OFFSET, ClusterConfig, plan_workers
from tests.support.clock import FakeClock
from tests.support.waiting import until


class TestConfig:
    def test_kv_prefix_needs_every_workers_events(self) -> None:
        with pytest.raises(ConfigError, match="every worker"):
            RouterConfig(
                workers=(A, B), policy="kv_prefix", kv_events={A: EVENTS[A]}, tokenizer_dir="m"
            )

    def test_kv_prefix_needs_a_tokenizer(self) -> None:
        with pytest.raises(ConfigError, match="tokenizer"):
            RouterConfig(workers=(A, B), policy="kv_prefix", kv_events=EVENTS)

    def test_events_of_an_unknown_worker_are_refused(self) -> None:
        with pytest.raises(ConfigError, match="not a worker"):
            RouterConfig(workers=(A,), kv_events=EVENTS)

    def test_command_line_sources(self) -> None:
        parsed = parse_kv_events([f"{A}=tcp://h:1,tcp://h:2", f"{B}=tcp://h:3"])
        assert parsed == {A: EventSource("tcp://h:1", "tcp://h:2"), B: EventSource("tcp://h:3")}
        with pytest.raises(ConfigError):
            parse_kv_events([f"{A}=http://h:1"])

    def test_the_cluster_command_turns_events_on_for_kv_prefix(self) -> None:
        args = build_parser().parse_args(["cluster", "--policy", "kv_prefix"])
        assert cluster_config(args).kv_events
        args = build_parser().parse_args(["cluster"])
        assert not cluster_config(args).kv_events


class TestWorkerLaunch:
    def test_each_worker_publishes_on_its_own_port_with_a_replay_buffer(
        self, tmp_path: Path
    ) -> None:
        cfg = ClusterConfig(
            workers=2,
            base_port=9100,
            kv_events=True,
            python=tmp_path / "python",
            model_dir=tmp_path / "model",
            log_dir=tmp_path / "logs",
            cache_dir=tmp_path,
            cores=(0, 1),
        )
        specs = plan_workers(cfg)
        docs = [json.loads(s.argv[s.argv.index("--kv-events-config") + 1]) for s in specs]
        assert [d["endpoint"] for d in docs] == [
            f"tcp://*:{9100 + KV_EVENTS_OFFSET}",
            f"tcp://*:{9101 + KV_EVENTS_OFFSET}",
        ]
        assert all(d["enable_kv_cache_events"] and d["replay_endpoint"] for d in docs)
        assert specs[0].kv_events == f"tcp://127.0.0.1:{9100 + KV_EVENTS_OFFSET}"
        assert len({s.kv_replay for s in specs}) == 2

    def test_no_events_unless_asked(self, tmp_path: Path) -> None:
        cfg = ClusterConfig(
            python=tmp_path / "p", model_dir=tmp_path, log_dir=tmp_path, cache_dir=tmp_path
        )
        assert all("--kv-events-config" not in s.argv for s in plan_workers(cfg))


class TestSubscriber:
    def test_batches_arrive_decoded_and_a_hole_is_filled_from_the_replay_buffer(
        self, tmp_path: Path
    ) -> None:
        publisher = FakePublisher(tmp_path)
        received: list[tuple[int, bool]] = []
        stored: list[EventBatch] = []

        def deliver(worker: str, items: list[tuple[EventBatch, bool]]) -> None:
            assert worker == A
            received.extend((b.seq, replayed) for b, replayed in items)
            stored.extend(b for b, _ in items)

        source = EventSource(publisher.endpoint, publisher.replay_endpoint)
        subscriber = KVEventSubscriber({A: source}, deliver)
        subscriber.start()
        try:
            publisher.publish_until(lambda: received, replayable=False)
            received.clear()
            replays = publisher.replays  # joining after batch 0 asked for a replay already
            first = stored[-1].seq + 1
            publisher.publish(first, list(range(12)), drop=True)  # lost on the way
            publisher.publish(first + 1, list(range(16)))
            until(lambda: len(received) == 2, "both batches after the lost one")
            assert received == [(first, True), (first + 1, False)]
            assert publisher.replays == replays + 1
            assert stored[-1].events[0] == Stored(
                HASHING.block_hashes(list(range(16))), None, tuple(range(16)), 4
            )
        finally:
            subscriber.stop()
            publisher.close()


@pytest.fixture
def kv_router(fake: FakeWorkers) -> Router:
    return kv_prefix_router(fake)


@pytest.mark.anyio
class TestRouter:
    async def test_a_request_goes_to_the_worker_holding_its_prefix(
        self, kv_router: Router, fake: FakeWorkers
    ) -> None:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=build_app(kv_router)), base_url="http://r"
        ) as client:
            for holder in (A, B, A):
                kv_router.apply_kv_events(holder, stored_batch(0, prompt_tokens(BODY)))
                other = B if holder == A else A
                kv_router.kv_index.reset(other)  # type: ignore[union-attr]
                for shopper in ("s1", "s2", "s3"):
                    reply = await client.post(CHAT, json=BODY, headers=session(shopper))
                    assert reply.headers["x-sidecar-worker"] == holder
        await kv_router.aclose()

    async def test_disaggregated_prefill_goes_to_the_prefill_worker_holding_the_prefix(
        self, fake: FakeWorkers
    ) -> None:
        config = RouterConfig(
            prefill=(A, B),
            decode=(C,),
            policy="kv_prefix",
            kv_events={**EVENTS, C: EventSource("tcp://127.0.0.1:10003")},
            tokenizer_dir="unused",
            health_interval_s=0,
        )
        router = Router(
            config, transport=fake.transport(), tokenizer=char_tokenizer(), kv_hashing=HASHING
        )
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=build_app(router)), base_url="http://r"
        ) as client:
            for holder in (A, B):
                router.apply_kv_events(holder, stored_batch(0, prompt_tokens(BODY)))
                router.kv_index.reset(A if holder == B else B)  # type: ignore[union-attr]
                for shopper in ("s1", "s2", "s3"):
                    reply = await client.post(CHAT, json=BODY, headers=session(shopper))
                    assert reply.headers["x-sidecar-prefill-worker"] == holder
                    assert reply.headers["x-sidecar-worker"] == C
        await router.aclose()

    async def test_metrics_say_what_the_index_applied_and_which_worker_falls_back(
        self, kv_router: Router
    ) -> None:
        kv_router.apply_kv_events(A, stored_batch(0, prompt_tokens(BODY)))
        kv_router.apply_kv_events(A, stored_batch(5, prompt_tokens(BODY)))
        kv_router._on_health_event("worker", HealthEvent("down", B, "probe"))
        assert metric(kv_router, "inference_sidecar_kv_event_batches_total", worker=A) == 2
        assert metric(kv_router, "inference_sidecar_kv_resyncs_total", worker=A, reason="gap") == 1
        assert metric(kv_router, "inference_sidecar_kv_resyncs_total", worker=B, reason="down") == 1
        assert metric(kv_router, "inference_sidecar_kv_fresh", worker=A) == 1
        kv_router.kv_index.expect_events(A)  # type: ignore[union-attr]
        kv_router.kv_index._clock = lambda: time.monotonic() + 3600  # type: ignore[union-attr]
        assert metric(kv_router, "inference_sidecar_kv_fresh", worker=A) == 0
        await kv_router.aclose()

    async def test_a_prompt_it_cannot_tokenize_is_routed_by_hashing_and_counted(
        self, kv_router: Router
    ) -> None:
        body = {**BODY, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=build_app(kv_router)), base_url="http://r"
        ) as client:
            reply = await client.post(CHAT, json=body, headers=session("s"))
        assert reply.status_code == 200
        assert (
            metric(
                kv_router, "inference_sidecar_kv_unhashed_requests_total", reason="unreproducible"
            )
            == 1
        )
        await kv_router.aclose()

    async def test_a_served_request_without_events_makes_its_worker_stale(
        self, kv_router: Router, fake: FakeWorkers
    ) -> None:
        clock = FakeClock(1000.0)
        index = kv_router.kv_index
        assert index is not None
        index._clock = clock
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=build_app(kv_router)), base_url="http://r"
        ) as client:
            reply = await client.post(CHAT, json=BODY, headers=session("s"))
        worker = reply.headers["x-sidecar-worker"]
        clock.advance(index.stale_after_s + 1)
        assert not index.is_fresh(worker)
        await kv_router.aclose()
