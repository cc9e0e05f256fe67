"""The router's defences against what a public endpoint receives (issue 28): malformed
headers, more requests than it should hold at once, workers that never finish, and
worker URLs that carry credentials."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fake_workers import FakeWorkers
from router_harness import BODY, CHAT, A, B, assert_openai_error, make_router, metric

from inference_sidecar.router import build_app

pytestmark = pytest.mark.anyio


def assert_no_worker_charged(router: Any) -> None:
    """No outcome recorded against any worker, none ejected (an ejection clears outcomes)."""
    pool = router.pools["worker"]
    for worker in pool.workers:
        health = pool.health.get(worker)
        assert (health.outcomes, health.ejections) == ((), 0), worker
        assert pool.is_in_service(worker)
    assert set(pool.in_flight.values()) == {0}


class TestMalformedHeaders:
    @pytest.mark.parametrize(
        ("header", "value"),
        [
            ("X-Session-ID", "shopper-café-42".encode()),  # UTF-8 bytes
            ("Authorization", b"Bearer sk-\xe9\xe9"),  # Latin-1 bytes
            ("X-Request-ID", "req-№7".encode()),
            ("X-Request-ID", b"req-\x01-7"),  # a control character
        ],
    )
    async def test_a_header_no_worker_can_be_sent_is_a_400_that_charges_no_worker(
        self, fake: FakeWorkers, client_for: Any, header: str, value: bytes
    ) -> None:
        client, router = client_for()
        for _ in range(3):  # three failures in a row would eject a worker
            response = await client.post(CHAT, json=BODY, headers={header: value})
            error = assert_openai_error(response, 400)
            assert error["param"] == header.lower()
        assert fake.received == []
        assert_no_worker_charged(router)

    async def test_a_router_fault_during_an_attempt_is_a_500_that_charges_no_worker(
        self, fake: FakeWorkers
    ) -> None:
        def broken(request: httpx.Request) -> httpx.Response:
            raise RuntimeError("a bug on the router's side of the call")

        router = make_router(fake)
        router._client = httpx.AsyncClient(transport=httpx.MockTransport(broken))
        app = build_app(router)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            for _ in range(3):
                assert_openai_error(await client.post(CHAT, json=BODY), 500)
        await router.aclose()
        assert_no_worker_charged(router)
        errors = "inference_sidecar_worker_errors_total"
        assert (
            sum(metric(router, errors, pool="worker", worker=w, kind="transport") for w in (A, B))
            == 0
        )
