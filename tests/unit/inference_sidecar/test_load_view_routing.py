"""The router with the ``workers`` load view, against fake workers that serve vLLM's load
gauges on ``/metrics``: the bound weighs what the workers report (the requests other
router replicas sent included), a worker whose metrics cannot be read counts at this
router's own load, and ``/health`` and ``/metrics`` say which source each figure has."""

from __future__ import annotations

import pytest
from router_harness import BODY, CHAT, A, B, metric, session

from inference_sidecar.policies.bounded_hash import preference_order
from inference_sidecar.router import WORKER_HEADER
from tests.support.waiting import until_async

pytestmark = pytest.mark.anyio


def key_homed_on(worker: str) -> str:
    return next(
        k for k in (f"s{i}" for i in range(100)) if preference_order(k, [A, B])[0] == worker
    )


class TestWorkersView:
    async def test_a_shopper_leaves_a_worker_that_other_routers_filled(
        self, fake, client_for
    ) -> None:
        client, router = client_for(load_view="workers")
        key = key_homed_on(A)
        first = await client.post(CHAT, json=BODY, headers=session(key))
        assert first.headers[WORKER_HEADER] == A
        fake.reported[A] = 10
        await router.poll_loads()
        again = await client.post(CHAT, json=BODY, headers=session(key))
        assert again.headers[WORKER_HEADER] == B

    async def test_with_its_own_view_the_router_sees_none_of_it(self, fake, client_for) -> None:
        client, _ = client_for()
        key = key_homed_on(A)
        await client.post(CHAT, json=BODY, headers=session(key))
        fake.reported[A] = 10
        again = await client.post(CHAT, json=BODY, headers=session(key))
        assert again.headers[WORKER_HEADER] == A
        assert fake.metrics_reads == {}

    async def test_health_names_the_view_and_each_workers_source(self, fake, client_for) -> None:
        client, router = client_for(load_view="workers")
        fake.reported[A] = 4
        fake.behaviour[B] = "no_metrics"
        await router.poll_loads()
        doc = (await client.get("/health")).json()
        assert doc["load_view"] == "workers"
        workers = doc["pools"]["worker"]
        assert (workers[A]["load"], workers[A]["load_source"]) == (4, "workers")
        assert (workers[B]["load"], workers[B]["load_source"]) == (0, "own")
        assert doc["load_errors"] == {B: "status: HTTP 404"}

    async def test_metrics_export_each_workers_load_and_source(self, fake, client_for) -> None:
        client, router = client_for(load_view="workers")
        fake.reported[A] = 4
        fake.behaviour[B] = "no_metrics"
        await router.poll_loads()
        await client.get("/metrics")
        load = "inference_sidecar_worker_load"
        assert metric(router, load, pool="worker", worker=A) == 4
        assert metric(router, f"{load}_source", pool="worker", worker=A, source="workers") == 1
        assert metric(router, f"{load}_source", pool="worker", worker=B, source="own") == 1
        assert metric(router, f"{load}_source", pool="worker", worker=B, source="workers") == 0
        errors = "inference_sidecar_worker_errors_total"
        assert metric(router, errors, pool="load_metrics", worker=B, kind="status") == 1

    async def test_an_unreachable_worker_is_counted_as_a_connect_error(
        self, fake, client_for
    ) -> None:
        _, router = client_for(load_view="workers")
        fake.behaviour[B] = "down"
        await router.poll_loads()
        assert router.worker_loads is not None
        assert router.worker_loads.errors[B].startswith("connect:")

    async def test_a_started_router_polls_every_worker_on_its_period(
        self, fake, client_for
    ) -> None:
        _, router = client_for(load_view="workers", load_poll_interval_s=0.01)
        await router.start()
        await until_async(
            lambda: min(fake.metrics_reads.get(w, 0) for w in (A, B)) >= 3,
            "three polls of each worker",
        )

    async def test_a_worker_that_left_is_polled_no_more_and_forgotten(
        self, fake, client_for
    ) -> None:
        _, router = client_for(load_view="workers")
        fake.reported[B] = 2
        await router.poll_loads()
        router.membership.remove_worker(B)
        await router.poll_loads()
        assert fake.metrics_reads[B] == 1
        assert router.worker_loads is not None
        assert router.worker_loads.figure(B, 0).source == "own"


class TestOwnView:
    async def test_health_counts_the_routers_own_requests(self, fake, client_for) -> None:
        client, _ = client_for()
        doc = (await client.get("/health")).json()
        assert doc["load_view"] == "own"
        assert {w["load_source"] for w in doc["pools"]["worker"].values()} == {"own"}
        assert "load_errors" not in doc
