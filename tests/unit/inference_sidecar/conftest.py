"""Fixtures of the router's tests: fake workers and routers served in-process."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fake_workers import FakeWorkers
from router_harness import make_router

from inference_sidecar.router import Router, build_app


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def fake() -> FakeWorkers:
    return FakeWorkers()


@pytest.fixture
async def client_for(fake: FakeWorkers) -> AsyncIterator[Any]:
    """``client_for(**config)``: a client of a new router in front of ``fake``; all are
    closed at the end of the test."""
    routers: list[Router] = []
    clients: list[httpx.AsyncClient] = []

    def factory(**kw: Any) -> tuple[httpx.AsyncClient, Router]:
        router = make_router(fake, **kw)
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=build_app(router)), base_url="http://router"
        )
        routers.append(router)
        clients.append(client)
        return client, router

    yield factory
    for client in clients:
        await client.aclose()
    for router in routers:
        await router.aclose()
