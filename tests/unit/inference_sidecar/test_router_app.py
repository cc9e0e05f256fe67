"""The router's request/response handling, against fake workers (no network).

The app is called through ``httpx.ASGITransport``; upstream calls go to ``FakeWorkers``
through ``httpx.MockTransport``.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from fake_workers import KV_PARAMS_FROM_PREFILL
from router_harness import (
    BODY,
    CHAT,
    A,
    B,
    C,
    assert_openai_error,
    make_router,
    metric,
    session,
)

from inference_sidecar.health import HealthConfig
from inference_sidecar.pd import PREFILL_KV_TRANSFER_PARAMS
from inference_sidecar.router import WORKER_HEADER, build_app
from tests.support.clock import FakeClock
from tests.support.waiting import until_async

pytestmark = pytest.mark.anyio


class TestPassThrough:
    async def test_body_reaches_the_worker_byte_for_byte(self, fake, client_for) -> None:
        client, _ = client_for()
        raw = b'{"model": "m",  "messages": [{"role":"user","content":"x"}], "z": 1.50}'
        r = await client.post(CHAT, content=raw, headers=session("s1"))
        assert r.status_code == 200
        assert fake.received[0].content == raw
        assert fake.received[0].path == CHAT
        assert fake.received[0].headers["x-session-id"] == "s1"
        assert r.headers[WORKER_HEADER] == fake.received[0].worker

    async def test_completions_endpoint(self, fake, client_for) -> None:
        client, _ = client_for()
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        assert r.status_code == 200 and fake.received[0].path == "/v1/completions"

    async def test_worker_answer_is_returned_unchanged(self, fake, client_for) -> None:
        client, _ = client_for()
        r = await client.post(CHAT, json=BODY, headers=session("s1"))
        assert r.json()["choices"][0]["message"]["content"] == "hi"

    async def test_models_proxied(self, fake, client_for) -> None:
        client, _ = client_for()
        r = await client.get("/v1/models")
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "m"


class TestStickiness:
    async def test_same_shopper_same_worker(self, fake, client_for) -> None:
        client, router = client_for(workers=(A, B, C))
        for sid in ("s1", "s2", "s3", "s4"):
            workers = set()
            for _ in range(5):
                r = await client.post(CHAT, json=BODY, headers=session(sid))
                workers.add(r.headers[WORKER_HEADER])
            assert len(workers) == 1, sid

        def decisions(kind: str) -> float:
            return metric(
                router,
                "inference_sidecar_routing_decisions_total",
                policy="bounded_hash",
                pool="worker",
                decision=kind,
            )

        assert (decisions("placed"), decisions("sticky")) == (4, 16)  # first request: placed

    async def test_shoppers_spread_over_workers(self, fake, client_for) -> None:
        client, _ = client_for(workers=(A, B, C))
        for i in range(60):
            await client.post(CHAT, json=BODY, headers=session(f"shopper-{i}"))
        counts = fake.completions_by_worker()
        assert set(counts) == {A, B, C} and min(counts.values()) >= 10

    async def test_user_field_is_the_key_without_header(self, fake, client_for) -> None:
        client, _ = client_for(workers=(A, B, C))
        seen = {
            (await client.post(CHAT, json={**BODY, "user": "u7"})).headers[WORKER_HEADER]
            for _ in range(5)
        }
        assert len(seen) == 1

    async def test_the_policy_gets_both_of_the_configured_bounds(self, fake, client_for) -> None:
        _, router = client_for(load_factor=2.0, residency_factor=1.5)
        policy = next(iter(router.pools.values())).policy
        assert (policy.load_factor, policy.residency_factor) == (2.0, 1.5)

    async def test_hot_key_spills_under_concurrency(self, fake, client_for) -> None:
        """Eight concurrent requests of one shopper: the home worker takes what the
        bound allows and the rest spill to the other worker."""
        client, router = client_for(load_factor=1.25)
        fake.delay_s = 0.2
        await asyncio.gather(
            *(client.post(CHAT, json=BODY, headers=session("hot")) for _ in range(8))
        )
        counts = fake.completions_by_worker()
        assert set(counts) == {A, B}
        # final picks: total 7 in flight -> bound ceil(1.25 * 8 / 2) = 5
        assert max(fake.max_in_flight.values()) <= 5
        spilled = metric(
            router,
            "inference_sidecar_routing_decisions_total",
            policy="bounded_hash",
            pool="worker",
            decision="spilled",
        )
        assert spilled >= 2

    async def test_new_shopper_avoids_the_worker_busy_with_a_long_prompt(
        self, fake, client_for
    ) -> None:
        """A long prompt in flight on one worker: a new shopper's prompt, which costs
        the same everywhere, goes to the other worker (queued prefill tokens, not only
        request counts)."""
        client, router = client_for(workers=(A, B))
        policy = router.pools["worker"].policy
        newcomer = "newcomer-0"
        assert policy.home(newcomer, (A, B)) == policy.home("s1", (A, B))  # same rendezvous home
        fake.delay_s = 1.0
        long_body = {**BODY, "messages": [{"role": "user", "content": "e" * 12_000}]}
        first = asyncio.create_task(client.post(CHAT, json=long_body, headers=session("s1")))
        # in flight from here for the fake's delay
        await until_async(lambda: fake.received, "the long prompt to reach a worker", timeout_s=10)
        busy = fake.received[0].worker
        second = await client.post(CHAT, json=BODY, headers=session(newcomer))
        assert second.headers[WORKER_HEADER] != busy
        await first

    async def test_streamed_requests_release_their_queued_tokens(self, fake, client_for) -> None:
        client, router = client_for(workers=(A, B))
        body = {**BODY, "stream": True}
        for sid in ("s1", "s2", "s3"):
            r = await client.post(CHAT, json=body, headers=session(sid))
            assert r.status_code == 200
        policy = router.pools["worker"].policy
        assert [policy.queued_tokens(w) for w in (A, B)] == [0, 0]  # type: ignore[attr-defined]
        assert policy.visits("s1")[0][1] > 0  # type: ignore[attr-defined]

    async def test_round_robin_has_no_affinity(self, fake, client_for) -> None:
        client, router = client_for(policy="round_robin")
        for _ in range(4):
            await client.post(CHAT, json=BODY, headers=session("s1"))
        assert fake.completions_by_worker() == {A: 2, B: 2}
        assert (
            metric(
                router,
                "inference_sidecar_routing_decisions_total",
                policy="round_robin",
                pool="worker",
                decision="balanced",
            )
            == 4
        )


class TestBadInput:
    async def test_malformed_json(self, client_for) -> None:
        client, _ = client_for()
        error = assert_openai_error(await client.post(CHAT, content=b"{not json"), 400)
        assert "not valid JSON" in error["message"]

    async def test_empty_body(self, client_for) -> None:
        client, _ = client_for()
        assert_openai_error(await client.post(CHAT, content=b""), 400)

    async def test_body_not_an_object(self, client_for) -> None:
        client, _ = client_for()
        assert_openai_error(await client.post(CHAT, content=b"[1, 2]"), 400)

    @pytest.mark.parametrize("model", [None, "", 3])
    async def test_missing_or_bad_model(self, client_for, model) -> None:
        client, _ = client_for()
        body = {k: v for k, v in BODY.items() if k != "model"}
        if model is not None:
            body["model"] = model
        error = assert_openai_error(await client.post(CHAT, json=body), 400)
        assert error["param"] == "model"

    async def test_oversized_body(self, fake, client_for) -> None:
        client, _ = client_for(max_body_bytes=2048)
        big = {**BODY, "messages": [{"role": "user", "content": "x" * 5000}]}
        error = assert_openai_error(await client.post(CHAT, json=big), 413)
        assert error["code"] == "request_too_large"
        assert fake.received == []

    async def test_oversized_streamed_body_without_length(self, fake, client_for) -> None:
        client, _ = client_for(max_body_bytes=2048)

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(10):
                yield b" " * 1000

        assert_openai_error(await client.post(CHAT, content=chunks()), 413)

    async def test_unknown_path_and_method(self, client_for) -> None:
        client, _ = client_for()
        assert_openai_error(await client.get("/v1/nothing"), 404)
        assert_openai_error(await client.get(CHAT), 405)

    async def test_worker_4xx_is_passed_through_without_retry(self, fake, client_for) -> None:
        client, router = client_for()
        fake.behaviour = {A: "bad_request", B: "bad_request"}
        r = await client.post(CHAT, json=BODY, headers=session("s1"))
        assert r.status_code == 400 and r.json()["error"]["message"] == "prompt too long"
        assert len(fake.received) == 1
        assert router.pools["worker"].health.get(fake.received[0].worker).outcomes == ()


class TestFailover:
    async def _home(self, client: httpx.AsyncClient, sid: str) -> str:
        return (await client.post(CHAT, json=BODY, headers=session(sid))).headers[WORKER_HEADER]

    @pytest.mark.parametrize("failure", ["down", "error500", "garbage"])
    async def test_failed_worker_is_retried_elsewhere(self, fake, client_for, failure) -> None:
        client, router = client_for()
        home = await self._home(client, "s1")
        other = B if home == A else A
        fake.behaviour = {home: failure}
        r = await client.post(CHAT, json=BODY, headers=session("s1"))
        assert r.status_code == 200 and r.headers[WORKER_HEADER] == other
        assert (
            metric(
                router,
                "inference_sidecar_routing_decisions_total",
                policy="bounded_hash",
                pool="worker",
                decision="failed_over",
            )
            == 1
        )

    async def test_all_workers_failing_gives_502_naming_them(self, fake, client_for) -> None:
        client, _ = client_for()
        fake.behaviour = {A: "error500", B: "garbage"}
        error = assert_openai_error(await client.post(CHAT, json=BODY), 502)
        assert A in error["message"] and B in error["message"]

    async def test_timeout_is_retried(self, fake, client_for) -> None:
        client, _ = client_for(request_timeout_s=0.1)
        home = await self._home(client, "s1")
        fake.behaviour = {home: "hang"}
        r = await client.post(CHAT, json=BODY, headers=session("s1"))
        assert r.status_code == 200 and r.headers[WORKER_HEADER] != home

    async def test_attempts_are_bounded(self, fake, client_for) -> None:
        client, _ = client_for(workers=(A, B, C), max_attempts=2)
        fake.behaviour = {A: "down", B: "down", C: "down"}
        assert_openai_error(await client.post(CHAT, json=BODY), 502)
        assert sum(fake.completions_by_worker().values()) == 0  # refused before reading

    async def test_failing_worker_is_ejected_then_skipped(self, fake, client_for) -> None:
        client, router = client_for(workers=(A, B, C))
        fake.behaviour = {A: "error500"}
        for i in range(30):
            r = await client.post(CHAT, json=BODY, headers=session(f"s{i}"))
            assert r.status_code == 200
        assert not router.pools["worker"].is_in_service(A)
        assert (
            metric(
                router,
                "inference_sidecar_ejections_total",
                pool="worker",
                worker=A,
                reason="consecutive_failures",
            )
            == 1
        )
        assert metric(router, "inference_sidecar_worker_in_service", pool="worker", worker=A) == 0
        before = len(fake.sent_to(A))
        for i in range(10):
            await client.post(CHAT, json=BODY, headers=session(f"t{i}"))
        assert len(fake.sent_to(A)) == before

    async def test_lost_workers_shoppers_spread_over_survivors(self, fake, client_for) -> None:
        client, _ = client_for(workers=(A, B, C))
        homes = {f"s{i}": await self._home(client, f"s{i}") for i in range(60)}
        fake.behaviour = {A: "down"}
        moved = Counter()
        for sid, home in homes.items():
            now = await self._home(client, sid)
            if home == A:
                moved[now] += 1
            else:
                assert now == home  # others keep their worker
        assert set(moved) == {B, C}

    async def test_slow_worker_is_ejected_on_latency(self, fake, client_for) -> None:
        health = HealthConfig(min_requests=3, latency_factor=3.0, latency_floor_s=0.1)
        client, router = client_for(workers=(A, B, C), health=health)
        fake.behaviour = {A: "slow"}
        # Returning shoppers: a key whose prefix is on A stays there although A is slow
        # (new keys learn to avoid it), until A is ejected.
        for i in range(40):
            await client.post(CHAT, json=BODY, headers=session(f"s{i % 8}"))
        assert not router.pools["worker"].is_in_service(A)
        assert (
            metric(
                router,
                "inference_sidecar_ejections_total",
                pool="worker",
                worker=A,
                reason="latency",
            )
            == 1
        )


class TestStreaming:
    async def test_stream_is_passed_through(self, fake, client_for) -> None:
        client, _ = client_for()
        r = await client.post(CHAT, json={**BODY, "stream": True}, headers=session("s1"))
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [e for e in r.text.split("\n\n") if e]
        assert len(events) == 4 and events[-1] == "data: [DONE]"

    async def test_stream_retried_when_worker_fails_before_first_byte(
        self, fake, client_for
    ) -> None:
        client, _ = client_for()
        fake.behaviour = {A: "down", B: "down"}
        home_fails = await client.post(CHAT, json={**BODY, "stream": True}, headers=session("s1"))
        assert home_fails.status_code == 502
        fake.behaviour = {A: "error500"}
        r = await client.post(CHAT, json={**BODY, "stream": True}, headers=session("s1"))
        assert r.status_code == 200 and r.headers[WORKER_HEADER] == B

    async def test_stream_broken_midway_ends_with_error_event(self, fake, client_for) -> None:
        client, router = client_for(workers=(A,))
        fake.behaviour = {A: "break_stream"}
        r = await client.post(CHAT, json={**BODY, "stream": True}, headers=session("s1"))
        events = [e for e in r.text.split("\n\n") if e]
        assert orjson.loads(events[-1].removeprefix("data: "))["error"]["code"] == 502
        assert router.pools["worker"].in_flight[A] == 0
        assert (
            metric(
                router,
                "inference_sidecar_worker_errors_total",
                pool="worker",
                worker=A,
                kind="stream_broken",
            )
            == 1
        )

    async def test_in_flight_returns_to_zero(self, fake, client_for) -> None:
        client, router = client_for()
        for i in range(5):
            await client.post(CHAT, json={**BODY, "stream": True}, headers=session(f"s{i}"))
            await client.post(CHAT, json=BODY, headers=session(f"s{i}"))
        assert router.pools["worker"].in_flight == {A: 0, B: 0}


class TestClientGone:
    async def test_a_client_hanging_up_cancels_its_request_to_the_worker(self, fake) -> None:
        fake.behaviour = {A: "hang", B: "hang"}
        router = make_router(fake)
        body = orjson.dumps(BODY)
        hung_up = asyncio.Event()
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            if not hung_up.is_set():
                hung_up.set()
                return {"type": "http.request", "body": body, "more_body": False}
            await until_async(lambda: fake.received, "the worker to have the request")
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": CHAT,
            "headers": [(b"content-type", b"application/json"), (b"x-session-id", b"s1")],
            "query_string": b"",
        }
        try:
            await asyncio.wait_for(build_app(router)(scope, receive, send), timeout=5)
        finally:
            await router.aclose()

        assert len(fake.received) == 1
        assert fake.in_flight == {fake.received[0].worker: 0}  # its handler was cancelled
        assert router.pools["worker"].in_flight == {A: 0, B: 0}
        assert sent[0]["status"] == 400

    async def test_a_cancelled_handler_leaves_no_request_running(self) -> None:
        from starlette.requests import Request

        from inference_sidecar.router.app import _unless_disconnected

        async def receive() -> dict[str, Any]:
            await asyncio.sleep(60)  # the client stays
            return {"type": "http.disconnect"}

        worker_call_started, worker_call_cancelled = asyncio.Event(), asyncio.Event()

        async def answer() -> Any:
            worker_call_started.set()
            try:
                await asyncio.sleep(60)  # a worker that takes its time
            finally:
                worker_call_cancelled.set()

        handler = asyncio.create_task(
            _unless_disconnected(Request({"type": "http", "method": "POST"}, receive), answer())
        )
        await until_async(worker_call_started.is_set, "the worker call to start")
        handler.cancel()

        with pytest.raises(asyncio.CancelledError):
            await handler
        assert worker_call_cancelled.is_set()


class TestDisaggregated:
    async def test_prefill_then_decode_with_kv_params(self, fake, client_for) -> None:
        client, _ = client_for(workers=(), prefill=(A,), decode=(B,))
        r = await client.post(
            CHAT, json={**BODY, "max_completion_tokens": 30}, headers=session("s1")
        )
        assert r.status_code == 200
        (prefill,) = fake.sent_to(A)
        (decode,) = fake.sent_to(B)
        assert prefill.body["max_tokens"] == 1 and prefill.body["max_completion_tokens"] == 1
        assert prefill.body["stream"] is False
        assert prefill.body["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
        assert prefill.body["response_format"] == BODY["response_format"]
        assert decode.body["kv_transfer_params"] == {**KV_PARAMS_FROM_PREFILL, "from": A}
        assert decode.body["max_tokens"] == 50 and decode.body["max_completion_tokens"] == 30
        assert r.headers[WORKER_HEADER] == B
        assert r.headers["x-sidecar-prefill-worker"] == A

    async def test_both_steps_sticky(self, fake, client_for) -> None:
        client, _ = client_for(workers=(), prefill=(A, B), decode=(C, "http://127.0.0.1:9004"))
        for sid in ("s1", "s2", "s3"):
            pairs = set()
            for _ in range(4):
                r = await client.post(CHAT, json=BODY, headers=session(sid))
                pairs.add((r.headers["x-sidecar-prefill-worker"], r.headers[WORKER_HEADER]))
            assert len(pairs) == 1

    async def test_streamed_decode(self, fake, client_for) -> None:
        client, _ = client_for(workers=(), prefill=(A,), decode=(B,))
        r = await client.post(CHAT, json={**BODY, "stream": True}, headers=session("s1"))
        assert r.text.endswith("data: [DONE]\n\n")
        assert fake.sent_to(A)[0].body["stream"] is False
        assert fake.sent_to(B)[0].body["stream"] is True

    async def test_prefill_failover(self, fake, client_for) -> None:
        client, _ = client_for(workers=(), prefill=(A, C), decode=(B,))
        fake.behaviour = {A: "down"}
        r = await client.post(CHAT, json=BODY, headers=session("s1"))
        assert r.status_code == 200 and r.headers["x-sidecar-prefill-worker"] == C

    async def test_no_prefill_worker_decode_computes_the_prompt(self, fake, client_for) -> None:
        client, router = client_for(workers=(), prefill=(A,), decode=(B,))
        fake.behaviour = {A: "down"}
        r = await client.post(CHAT, json=BODY, headers=session("s1"))
        assert r.status_code == 200 and r.headers[WORKER_HEADER] == B
        assert "kv_transfer_params" not in fake.sent_to(B)[0].body
        assert "x-sidecar-prefill-worker" not in r.headers
        assert (
            metric(
                router,
                "inference_sidecar_routing_decisions_total",
                policy="bounded_hash",
                pool="prefill",
                decision="pd_fallback",
            )
            == 1
        )

    async def test_no_decode_worker_prefill_worker_runs_it_all(self, fake, client_for) -> None:
        client, router = client_for(workers=(), prefill=(A,), decode=(B,))
        fake.behaviour = {B: "error500"}
        r = await client.post(CHAT, json={**BODY, "stream": True}, headers=session("s1"))
        assert r.status_code == 200 and r.headers[WORKER_HEADER] == A
        whole = fake.sent_to(A)[-1].body
        assert whole["max_tokens"] == 50 and "kv_transfer_params" not in whole
        assert (
            metric(
                router,
                "inference_sidecar_routing_decisions_total",
                policy="bounded_hash",
                pool="decode",
                decision="pd_fallback",
            )
            == 1
        )

    async def test_both_pools_down_is_a_502(self, fake, client_for) -> None:
        client, _ = client_for(workers=(), prefill=(A,), decode=(B,))
        fake.behaviour = {A: "down", B: "down"}
        assert_openai_error(await client.post(CHAT, json=BODY), 502)

    async def test_prefill_client_error_is_returned(self, fake, client_for) -> None:
        client, _ = client_for(workers=(), prefill=(A,), decode=(B,))
        fake.behaviour = {A: "bad_request"}
        r = await client.post(CHAT, json=BODY)
        assert r.status_code == 400 and fake.sent_to(B) == []


class TestHealthAndMetrics:
    async def test_health_reflects_probes(self, fake, client_for) -> None:
        client, router = client_for(health_interval_s=5)
        assert (await client.get("/health")).status_code == 503  # nothing probed yet
        await router.probe_all()
        r = await client.get("/health")
        assert r.status_code == 200 and r.json()["pools"]["worker"][A]["in_service"]
        fake.behaviour = {A: "down", B: "down"}
        await router.probe_all()
        await router.probe_all()
        r = await client.get("/health")
        assert r.status_code == 503 and r.json()["pools"]["worker"][A]["down"]

    async def test_ejected_worker_is_readmitted_by_probe(self, fake, client_for) -> None:
        clock = FakeClock()
        _, router = client_for(health_interval_s=5)
        router.clock = clock
        pool = router.pools["worker"]
        for _ in range(3):
            pool.finish(A, False, 0.1, clock.now, pool.start(A))
        assert not pool.is_in_service(A)
        clock.advance(100.0)
        await router.probe_all()
        assert pool.is_in_service(A)
        assert (
            metric(
                router,
                "inference_sidecar_health_events_total",
                pool="worker",
                worker=A,
                event="readmitted",
                reason="probe_ok",
            )
            == 1
        )

    async def test_metrics_endpoint(self, fake, client_for) -> None:
        client, _ = client_for()
        await client.post(CHAT, json=BODY, headers=session("s1"))
        text = (await client.get("/metrics")).text
        for name in (
            "inference_sidecar_requests_total",
            "inference_sidecar_worker_requests_total",
            "inference_sidecar_worker_in_flight",
            "inference_sidecar_routing_decisions_total",
            "inference_sidecar_request_latency_seconds_bucket",
            "inference_sidecar_ttft_seconds",
        ):
            assert name in text

    async def test_lifespan_runs_health_checks_and_closes(self, fake) -> None:
        router = make_router(fake, health_interval_s=0.02)
        app = build_app(router)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as c,
        ):

            async def health() -> dict[str, Any]:
                return (await c.get("/health")).json()

            async def up() -> bool:
                return (await c.get("/health")).status_code == 200

            async def a_down() -> bool:
                return (await health())["pools"]["worker"][A]["down"]

            await until_async(up, "the first health checks", interval_s=0.02)
            assert (await health())["status"] == "ok"
            fake.behaviour = {A: "down"}
            await until_async(a_down, "the health checks to find A down", interval_s=0.02)
            assert not router.pools["worker"].is_in_service(A)
        assert router._health_task is None
