"""A worker joining a running router (``POST /workers``): it takes requests from the next
one on, keys with history stay where their prefix is cached, and with kv_prefix the
router subscribes to its KV events and sends it the prompts it holds."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from fake_workers import FakeWorkers
from kv_harness import (
    FakePublisher,
    kv_prefix_router,
    prompt_tokens,
    stored_batch,
)
from router_harness import (
    ADMIN,
    ADMIN_TOKEN,
    BODY,
    CHAT,
    A,
    B,
    C,
    assert_openai_error,
    metric,
    session,
)

from inference_sidecar.exceptions import ConfigError
from inference_sidecar.kv import EventBatch
from inference_sidecar.kv.sources import EventSource
from inference_sidecar.kv.subscriber import KVEventSubscriber
from inference_sidecar.policies import make_policy
from inference_sidecar.router import build_app
from inference_sidecar.routing_state import RoutingState
from tests.support.waiting import until

pytestmark = pytest.mark.anyio


def test_a_joined_worker_is_a_candidate_in_service_with_nothing_in_flight() -> None:
    pool = RoutingState("worker", [A, B], make_policy("round_robin"))
    assert pool.add_worker(C) is True
    assert pool.workers == (A, B, C)
    assert pool.candidates() == [A, B, C]
    assert pool.status()[C] == {
        "in_service": True,
        "down": False,
        "ejected": False,
        "ejections": 0,
        "in_flight": 0,
        "load": 0,
        "load_source": "own",
    }


def test_joining_twice_changes_nothing() -> None:
    pool = RoutingState("worker", [A, B], make_policy("round_robin"))
    pool.start(A)
    assert pool.add_worker(A) is False
    assert pool.workers == (A, B)
    assert pool.in_flight[A] == 1


def test_a_key_with_history_stays_on_its_worker_when_one_joins() -> None:
    pool = RoutingState("worker", [A, B], make_policy("bounded_hash"))
    homes = {}
    for key in (f"shopper-{i}" for i in range(20)):
        choice = pool.choose(key, size=2000)
        assert choice is not None
        pool.finish(choice.worker, True, 0.1, 0.0, pool.start(choice.worker, key, 2000))
        homes[key] = choice.worker
    pool.add_worker(C)
    again = {key: pool.choose(key, size=2100) for key in homes}
    assert {key: c.worker for key, c in again.items() if c is not None} == homes
    new_keys = [pool.choose(f"new-{i}", size=2000) for i in range(30)]
    assert any(c is not None and c.worker == C for c in new_keys)


async def test_a_worker_added_over_http_takes_requests(client_for, fake: FakeWorkers) -> None:
    client, router = client_for(workers=(A, B), policy="round_robin", admin_token=ADMIN_TOKEN)
    reply = await client.post("/workers", json={"url": C + "/"}, headers=ADMIN)
    assert reply.status_code == 201, reply.text
    assert set(reply.json()["pools"]["worker"]) == {A, B, C}
    for i in range(6):
        assert (await client.post(CHAT, json=BODY, headers=session(f"s{i}"))).status_code == 200
    assert fake.completions_by_worker() == {A: 2, B: 2, C: 2}
    assert metric(router, "inference_sidecar_worker_in_service", pool="worker", worker=C) == 1


async def test_adding_a_member_again_answers_200(client_for) -> None:
    client, _ = client_for(workers=(A, B), admin_token=ADMIN_TOKEN)
    reply = await client.post("/workers", json={"url": A}, headers=ADMIN)
    assert reply.status_code == 200
    assert list(reply.json()["pools"]["worker"]) == [A, B]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{", "not valid JSON"),
        (b'{"role": "worker"}', "url"),
        (b'{"url": "ftp://h:1"}', "http(s)://host:port"),
        (b'{"url": "http://h:1", "role": "prefill"}', "pools are ['worker']"),
        (b'{"url": "http://h:1", "kv_events": {"port": 1}}', "kv_events"),
    ],
)
async def test_a_bad_join_request_says_what_to_fix(client_for, body: bytes, says: str) -> None:
    client, router = client_for(workers=(A, B), admin_token=ADMIN_TOKEN)
    reply = await client.post("/workers", content=body, headers=ADMIN)
    assert says in assert_openai_error(reply, 400)["message"]
    assert router.serving_pool.workers == (A, B)


async def test_kv_prefix_refuses_a_worker_without_its_event_stream(fake: FakeWorkers) -> None:
    router = kv_prefix_router(fake)
    with pytest.raises(ConfigError, match="KV event stream"):
        router.add_worker(C)
    await router.aclose()


async def test_kv_prefix_sends_a_joined_worker_the_prompts_it_holds(fake: FakeWorkers) -> None:
    router = kv_prefix_router(fake)
    router.add_worker(C, kv_events=EventSource("tcp://127.0.0.1:10003"))
    router.apply_kv_events(C, stored_batch(0, prompt_tokens(BODY)))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=build_app(router)), base_url="http://r"
    ) as client:
        for shopper in ("s1", "s2", "s3"):
            reply = await client.post(CHAT, json=BODY, headers=session(shopper))
            assert reply.headers["x-sidecar-worker"] == C
    await router.aclose()


def test_the_subscriber_hears_a_worker_added_while_it_runs(tmp_path: Path) -> None:
    publisher = FakePublisher(tmp_path)
    heard: list[tuple[str, int]] = []

    def deliver(worker: str, items: list[tuple[EventBatch, bool]]) -> None:
        heard.extend((worker, b.seq) for b, _ in items)

    subscriber = KVEventSubscriber({}, deliver)
    subscriber.start()
    try:
        subscriber.add(C, EventSource(publisher.endpoint))
        publisher.publish_until(lambda: heard)
        until(lambda: heard and heard[-1][0] == C, "a batch from C")
    finally:
        subscriber.stop()
        publisher.close()
