"""The admin routes (``POST``/``DELETE /workers``) decide where prompts go, so anyone who
reaches them could add a rogue "worker" that receives shoppers' prompts. They are off
unless configured, need the admin token or the loopback admin port, and a worker added at
runtime never receives the client's credentials."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from fake_workers import FakeWorkers
from kv_harness import kv_prefix_router
from router_harness import (
    ADMIN,
    ADMIN_TOKEN,
    BODY,
    CHAT,
    A,
    B,
    C,
    assert_openai_error,
    make_router,
    session,
)

from inference_sidecar.config import RouterConfig
from inference_sidecar.exceptions import ConfigError
from inference_sidecar.kv import EventSource
from inference_sidecar.router import build_app
from tests.support.waiting import until_async

pytestmark = pytest.mark.anyio

ADMIN_PORT = 9443
CLIENT_AUTH = {"Authorization": "Bearer sk-client-secret"}


class TestOffUnlessConfigured:
    @pytest.mark.parametrize("method", ["POST", "DELETE"])
    async def test_without_a_token_or_an_admin_port_the_admin_routes_refuse_everyone(
        self, client_for: Any, method: str
    ) -> None:
        client, router = client_for(workers=(A, B))
        reply = await client.request(method, "/workers", json={"url": C}, headers=ADMIN)
        error = assert_openai_error(reply, 403)
        assert "--admin-token-file" in error["message"]
        assert router.serving_pool.workers == (A, B)

    def test_the_token_is_never_shown(self) -> None:
        config = RouterConfig(workers=(A,), admin_token=ADMIN_TOKEN)
        assert ADMIN_TOKEN not in repr(config)

    def test_a_short_token_is_refused_at_start(self) -> None:
        with pytest.raises(ConfigError) as err:
            RouterConfig(workers=(A,), admin_token="secret")
        assert err.value.key == "admin_token"


class TestToken:
    @pytest.mark.parametrize(
        "headers",
        [
            {},
            {"Authorization": "Bearer not-the-admin-token-at-all"},
            {"Authorization": f"Basic {ADMIN_TOKEN}"},
            {"Authorization": f"Bearer {ADMIN_TOKEN}x"},
        ],
    )
    async def test_a_request_without_the_token_is_a_401_and_changes_nothing(
        self, client_for: Any, headers: dict[str, str]
    ) -> None:
        client, router = client_for(workers=(A, B), admin_token=ADMIN_TOKEN)
        reply = await client.post("/workers", json={"url": C}, headers=headers)
        assert_openai_error(reply, 401)
        assert reply.headers["www-authenticate"] == "Bearer"
        assert router.serving_pool.workers == (A, B)

    async def test_the_token_adds_a_worker(self, client_for: Any) -> None:
        client, router = client_for(workers=(A, B), admin_token=ADMIN_TOKEN)
        assert (await client.post("/workers", json={"url": C}, headers=ADMIN)).status_code == 201
        assert router.serving_pool.workers == (A, B, C)


class TestAdminPort:
    def admin_client(self, router: Any, port: int) -> httpx.AsyncClient:
        """A client whose requests arrive on ``port`` of the router's server."""
        return httpx.AsyncClient(
            transport=httpx.ASGITransport(app=build_app(router)),
            base_url=f"http://127.0.0.1:{port}",
        )

    async def test_the_admin_routes_answer_on_the_admin_port_only(self, fake: FakeWorkers) -> None:
        router = make_router(fake, workers=(A, B), admin_port=ADMIN_PORT)
        async with self.admin_client(router, 8000) as public:
            assert_openai_error(await public.post("/workers", json={"url": C}), 403)
        async with self.admin_client(router, ADMIN_PORT) as admin:
            assert (await admin.post("/workers", json={"url": C})).status_code == 201
        assert router.serving_pool.workers == (A, B, C)
        await router.aclose()

    async def test_with_a_token_too_the_admin_port_needs_it(self, fake: FakeWorkers) -> None:
        router = make_router(fake, workers=(A, B), admin_port=ADMIN_PORT, admin_token=ADMIN_TOKEN)
        async with self.admin_client(router, ADMIN_PORT) as admin:
            assert_openai_error(await admin.post("/workers", json={"url": C}), 401)
            reply = await admin.post("/workers", json={"url": C}, headers=ADMIN)
            assert reply.status_code == 201
        await router.aclose()


class TestRemoval:
    async def test_a_removed_worker_gets_no_more_requests(
        self, client_for: Any, fake: FakeWorkers
    ) -> None:
        client, _ = client_for(workers=(A, B), policy="round_robin", admin_token=ADMIN_TOKEN)
        reply = await client.request("DELETE", "/workers", json={"url": A}, headers=ADMIN)
        assert reply.status_code == 200, reply.text
        assert list(reply.json()["pools"]["worker"]) == [B]
        for i in range(4):
            assert (await client.post(CHAT, json=BODY, headers=session(f"s{i}"))).status_code == 200
        assert fake.completions_by_worker() == {B: 4}
        text = (await client.get("/metrics")).text
        assert f'inference_sidecar_worker_in_service{{pool="worker",worker="{A}"}}' not in text

    async def test_a_request_in_flight_on_a_removed_worker_ends_and_is_accounted_for(
        self, client_for: Any, fake: FakeWorkers
    ) -> None:
        client, router = client_for(workers=(A, B), admin_token=ADMIN_TOKEN)
        fake.delay_s = 0.3
        answer = asyncio.create_task(client.post(CHAT, json=BODY, headers=session("s1")))
        await until_async(lambda: len(fake.received) == 1, "the request to reach a worker")
        busy = fake.received[0].worker
        reply = await client.request("DELETE", "/workers", json={"url": busy}, headers=ADMIN)
        assert reply.status_code == 200
        assert (await answer).status_code == 200
        pool = router.pools["worker"]
        assert busy not in pool.in_flight and set(pool.in_flight.values()) == {0}

    async def test_a_worker_can_join_again_after_leaving(self, client_for: Any) -> None:
        client, router = client_for(workers=(A, B), admin_token=ADMIN_TOKEN)
        await client.request("DELETE", "/workers", json={"url": B}, headers=ADMIN)
        assert (await client.post("/workers", json={"url": B}, headers=ADMIN)).status_code == 201
        assert router.serving_pool.workers == (A, B)

    @pytest.mark.parametrize(
        ("body", "status", "says"),
        [
            ({"url": C}, 404, "no worker of the worker pool"),
            ({"url": A, "role": "decode"}, 400, "pools are ['worker']"),
            ({"role": "worker"}, 400, "url"),
        ],
    )
    async def test_a_removal_that_cannot_be_done_says_why(
        self, client_for: Any, body: dict[str, str], status: int, says: str
    ) -> None:
        client, router = client_for(workers=(A, B), admin_token=ADMIN_TOKEN)
        reply = await client.request("DELETE", "/workers", json=body, headers=ADMIN)
        assert says in assert_openai_error(reply, status)["message"]
        assert router.serving_pool.workers == (A, B)

    async def test_the_last_worker_of_a_pool_cannot_be_removed(self, client_for: Any) -> None:
        client, router = client_for(workers=(A,), admin_token=ADMIN_TOKEN)
        reply = await client.request("DELETE", "/workers", json={"url": A}, headers=ADMIN)
        assert "last worker" in assert_openai_error(reply, 400)["message"]
        assert router.serving_pool.workers == (A,)

    async def test_kv_prefix_forgets_a_removed_workers_blocks(self, fake: FakeWorkers) -> None:
        router = kv_prefix_router(fake)
        router.add_worker(C, kv_events=EventSource("tcp://127.0.0.1:10003"))
        assert router.membership.remove_worker(C) is True
        assert router.kv_index is not None and C not in router.kv_index.workers
        await router.aclose()


class TestCredentials:
    async def test_a_worker_that_joined_at_runtime_never_gets_the_clients_authorization(
        self, client_for: Any, fake: FakeWorkers
    ) -> None:
        client, _ = client_for(workers=(A,), policy="round_robin", admin_token=ADMIN_TOKEN)
        await client.post("/workers", json={"url": C}, headers=ADMIN)
        for i in range(4):
            headers = {**CLIENT_AUTH, **session(f"s{i}")}
            assert (await client.post(CHAT, json=BODY, headers=headers)).status_code == 200
        by_worker = {r.worker: r.headers for r in fake.received}
        assert by_worker[A]["authorization"] == CLIENT_AUTH["Authorization"]
        assert "authorization" not in by_worker[C]
        assert by_worker[C]["x-session-id"]  # the routing key still goes to every worker

    async def test_a_configured_worker_that_left_and_joined_again_is_still_trusted(
        self, client_for: Any, fake: FakeWorkers
    ) -> None:
        client, _ = client_for(workers=(A, B), admin_token=ADMIN_TOKEN)
        await client.request("DELETE", "/workers", json={"url": B}, headers=ADMIN)
        await client.post("/workers", json={"url": B}, headers=ADMIN)
        await client.request("DELETE", "/workers", json={"url": A}, headers=ADMIN)
        await client.post(CHAT, json=BODY, headers=CLIENT_AUTH)
        assert fake.received[-1].worker == B
        assert fake.received[-1].headers["authorization"] == CLIENT_AUTH["Authorization"]
