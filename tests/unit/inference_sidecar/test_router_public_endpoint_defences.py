"""The router's defences against what a public endpoint receives: malformed
headers, more requests than it should hold at once, workers that never finish, and
worker URLs that carry credentials."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import orjson
import pytest
from fake_workers import FakeWorkers
from router_harness import BODY, CHAT, A, B, assert_openai_error, make_router, metric, session

from inference_sidecar import cli
from inference_sidecar.config import DEFAULT_MAX_CONCURRENT_REQUESTS, RouterConfig
from inference_sidecar.exceptions import ConfigError
from inference_sidecar.router import WORKER_HEADER, build_app
from tests.support.waiting import until_async

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
        await router._client.aclose()
        router._client = httpx.AsyncClient(transport=httpx.MockTransport(broken))
        app = build_app(router)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            for _ in range(3):
                assert_openai_error(await client.post(CHAT, json=BODY), 500)
        await router.aclose()
        assert_no_worker_charged(router)


class TestAdmission:
    async def test_a_request_over_the_limit_is_a_429_with_retry_after(
        self, fake: FakeWorkers, client_for: Any
    ) -> None:
        client, router = client_for(max_concurrent_requests=2)
        fake.delay_s = 0.5
        held = [
            asyncio.create_task(client.post(CHAT, json=BODY, headers=session(f"s{i}")))
            for i in range(2)
        ]
        await until_async(lambda: len(fake.received) == 2, "both requests to reach the worker")
        refused = await client.post(CHAT, json=BODY, headers=session("s3"))
        error = assert_openai_error(refused, 429)
        assert error["code"] == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert len(fake.received) == 2  # the refused request reached no worker
        assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]
        requests = "inference_sidecar_requests_total"
        assert metric(router, requests, endpoint="chat/completions", status="429") == 1

    async def test_a_slot_is_free_again_when_its_request_ends(
        self, fake: FakeWorkers, client_for: Any
    ) -> None:
        client, _ = client_for(max_concurrent_requests=1)
        fake.behaviour = {A: "bad_request", B: "bad_request"}
        assert (await client.post(CHAT, json=BODY)).status_code == 400  # a worker's 4xx
        assert (await client.post(CHAT, content=b"{not json")).status_code == 400  # the router's
        fake.behaviour = {}
        assert (await client.post(CHAT, json=BODY)).status_code == 200

    async def test_a_stream_holds_its_slot_until_it_ends(
        self, fake: FakeWorkers, client_for: Any
    ) -> None:
        client, _ = client_for(workers=(A,), max_concurrent_requests=1, request_timeout_s=0.5)
        fake.behaviour = {A: "stall_stream"}
        stream = asyncio.create_task(client.post(CHAT, json={**BODY, "stream": True}))
        await until_async(lambda: fake.chunks_taken.get(A), "the stream's first chunk relayed")
        assert (await client.post(CHAT, json=BODY)).status_code == 429
        await stream
        fake.behaviour = {}
        assert (await client.post(CHAT, json=BODY)).status_code == 200

    def test_the_limit_is_a_flag_with_a_default(self) -> None:
        default = cli.router_config(cli.build_parser().parse_args(["router"]), workers=(A,))
        assert default.max_concurrent_requests == DEFAULT_MAX_CONCURRENT_REQUESTS > 0
        args = cli.build_parser().parse_args(["router", "--max-concurrent-requests", "16"])
        assert cli.router_config(args, workers=(A,)).max_concurrent_requests == 16
        with pytest.raises(ConfigError) as err:
            RouterConfig(workers=(A,), max_concurrent_requests=0)
        assert err.value.key == "max_concurrent_requests"


class TestDeadlines:
    async def test_a_stream_that_stalls_after_its_first_chunk_ends_at_the_deadline(
        self, fake: FakeWorkers, client_for: Any
    ) -> None:
        client, router = client_for(workers=(A,), request_timeout_s=0.3)
        fake.behaviour = {A: "stall_stream"}
        async with asyncio.timeout(5):
            response = await client.post(CHAT, json={**BODY, "stream": True})
        events = [e for e in response.text.split("\n\n") if e]
        assert len(events) == 2  # the worker's first chunk, then the router's error event
        error = orjson.loads(events[-1].removeprefix("data: "))["error"]
        assert error["code"] == 504 and error["type"] == "upstream_error"
        errors = "inference_sidecar_worker_errors_total"
        assert metric(router, errors, pool="worker", worker=A, kind="timeout") == 1
        assert router.pools["worker"].in_flight == {A: 0}

    async def test_models_skips_a_worker_that_never_answers(
        self, fake: FakeWorkers, client_for: Any
    ) -> None:
        client, _ = client_for(workers=(A, B), request_timeout_s=0.2)
        fake.behaviour = {A: "hang"}
        async with asyncio.timeout(5):
            response = await client.get("/v1/models")
        assert response.status_code == 200 and response.json()["data"][0]["id"] == "m"

    async def test_models_with_every_worker_hanging_is_a_502_naming_them(
        self, fake: FakeWorkers, client_for: Any
    ) -> None:
        client, _ = client_for(workers=(A, B), request_timeout_s=0.2)
        fake.behaviour = {A: "hang", B: "hang"}
        async with asyncio.timeout(5):
            error = assert_openai_error(await client.get("/v1/models"), 502)
        assert A in error["message"] and B in error["message"]


PASSWORD = "s3cr3t-pw"
A_WITH_CREDENTIALS = A.replace("http://", f"http://ops:{PASSWORD}@")
A_SHOWN = A.replace("http://", "http://***@")


class TestRedaction:
    """Where the router shows a worker's URL; ``redact_url`` itself:
    ``tests/unit/test_config_errors.py``."""

    @pytest.mark.parametrize(
        "bad", [f"ftp://ops:{PASSWORD}@127.0.0.1:21", f"ops:{PASSWORD}@127.0.0.1:9001"]
    )
    def test_a_bad_worker_url_is_named_without_its_password(self, bad: str) -> None:
        with pytest.raises(ConfigError) as err:
            RouterConfig(workers=(bad,))
        assert PASSWORD not in str(err.value) and "***@127.0.0.1" in str(err.value)

    def test_one_worker_with_two_credentials_is_refused(self) -> None:
        other = A.replace("http://", "http://u:v@")
        with pytest.raises(ConfigError, match="listed twice") as err:
            RouterConfig(workers=(A_WITH_CREDENTIALS, other))
        assert PASSWORD not in str(err.value)
        with pytest.raises(ConfigError, match="two credentials") as err:
            RouterConfig(prefill=(A_WITH_CREDENTIALS,), decode=(other,))
        assert PASSWORD not in str(err.value)

    async def test_health_metrics_headers_and_errors_show_no_credentials(
        self, fake: FakeWorkers, client_for: Any
    ) -> None:
        client, _ = client_for(workers=(A_WITH_CREDENTIALS,))
        answered = await client.post(CHAT, json=BODY)
        assert answered.status_code == 200
        assert fake.received[0].headers["authorization"].startswith("Basic ")  # still sent
        assert answered.headers[WORKER_HEADER] == A_SHOWN
        fake.behaviour = {A: "error500"}
        failed = await client.post(CHAT, json=BODY)
        assert failed.status_code == 502 and A_SHOWN in failed.json()["error"]["message"]
        health = (await client.get("/health")).text
        metrics = (await client.get("/metrics")).text
        assert A_SHOWN in health and f'worker="{A_SHOWN}"' in metrics
        for shown in (answered.headers[WORKER_HEADER], failed.text, health, metrics):
            assert PASSWORD not in shown

    def test_the_start_up_log_shows_no_credentials(
        self, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        import uvicorn

        monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
        with caplog.at_level(logging.INFO, logger="inference_sidecar"):
            cli.serve(RouterConfig(workers=(A_WITH_CREDENTIALS,)), "info")
        assert A_SHOWN in caplog.text and PASSWORD not in caplog.text
