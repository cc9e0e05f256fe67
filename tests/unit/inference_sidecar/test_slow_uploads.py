"""Clients that send their request body slowly, or never finish it: they must not keep
other clients out. A body has a deadline; a request takes an admission slot only once its
body has arrived; the bytes of bodies being read count against a budget."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from fake_workers import FakeWorkers
from router_harness import ADMIN, ADMIN_TOKEN, BODY, CHAT, assert_openai_error, metric, session

from inference_sidecar.router.admission import Admission
from tests.support.waiting import until_async

pytestmark = pytest.mark.anyio

RAW = orjson.dumps(BODY)


async def trickle(
    head: bytes, rest: bytes, gate: asyncio.Event, taken: list[bytes] | None = None
) -> AsyncIterator[bytes]:
    """An upload that sends ``head`` (noted in ``taken`` once the router asked for the
    next chunk), then waits for ``gate`` before sending ``rest``."""
    yield head
    if taken is not None:
        taken.append(head)
    await gate.wait()
    yield rest


class TestSlots:
    async def test_slow_uploads_hold_no_slot_so_other_requests_are_served(
        self, client_for: Any, fake: FakeWorkers
    ) -> None:
        client, router = client_for(max_concurrent_requests=2)
        gate = asyncio.Event()
        taken: list[bytes] = []
        slow = [
            asyncio.create_task(
                client.post(
                    CHAT, content=trickle(RAW[:10], RAW[10:], gate, taken), headers=session(s)
                )
            )
            for s in ("slow-1", "slow-2")
        ]
        await until_async(lambda: len(taken) == 2, "the router to read both bodies")
        for i in range(3):
            reply = await client.post(CHAT, json=BODY, headers=session(f"fast-{i}"))
            assert reply.status_code == 200, reply.text
        gate.set()
        assert [r.status_code for r in await asyncio.gather(*slow)] == [200, 200]
        assert (router.admission.serving, router.admission.body_bytes) == (0, 0)

    async def test_an_upload_past_its_deadline_is_a_408_and_holds_nothing(
        self, client_for: Any, fake: FakeWorkers
    ) -> None:
        client, router = client_for(max_concurrent_requests=1, body_timeout_s=0.2)
        never = asyncio.Event()
        async with asyncio.timeout(5):
            reply = await client.post(CHAT, content=trickle(RAW[:10], RAW[10:], never))
        error = assert_openai_error(reply, 408)
        assert error["code"] == "request_timeout" and "--body-timeout" in error["message"]
        assert fake.received == []
        assert (router.admission.serving, router.admission.body_bytes) == (0, 0)
        requests = "inference_sidecar_requests_total"
        assert metric(router, requests, endpoint="chat/completions", status="408") == 1
        assert (await client.post(CHAT, json=BODY)).status_code == 200

    async def test_the_admin_routes_read_their_body_within_the_deadline_too(
        self, client_for: Any
    ) -> None:
        client, _ = client_for(admin_token=ADMIN_TOKEN, body_timeout_s=0.2)
        never = asyncio.Event()
        async with asyncio.timeout(5):
            reply = await client.post(
                "/workers", content=trickle(b'{"url": ', b'"http://h:1"}', never), headers=ADMIN
            )
        assert_openai_error(reply, 408)


class TestBodyBudget:
    async def test_bodies_being_read_beyond_the_budget_are_refused_with_retry_after(
        self, client_for: Any
    ) -> None:
        # One slot of 2 KiB bodies: 2 KiB of bodies held at most.
        client, router = client_for(max_concurrent_requests=1, max_body_bytes=2048)
        padded = orjson.dumps({**BODY, "user": "x" * 1500})
        gate = asyncio.Event()
        first = asyncio.create_task(
            client.post(CHAT, content=trickle(padded[:1500], padded[1500:], gate))
        )
        await until_async(lambda: router.admission.body_bytes == 1500, "1500 bytes counted")
        refused = await client.post(CHAT, content=padded)
        error = assert_openai_error(refused, 429)
        assert "request bodies" in error["message"] and refused.headers["retry-after"] == "1"
        assert router.admission.body_bytes == 1500  # the refused body's bytes were given back
        gate.set()
        assert (await first).status_code == 200
        assert router.admission.body_bytes == 0


class TestAdmissionBookkeeping:
    def test_slots_are_taken_and_given_back(self) -> None:
        admission = Admission(slots=2, body_budget=100)
        assert admission.take_slot() and admission.take_slot()
        assert admission.full and not admission.take_slot()
        admission.release_slot()
        assert not admission.full

    def test_bytes_past_the_budget_are_not_counted(self) -> None:
        admission = Admission(slots=1, body_budget=100)
        assert admission.hold(60)
        assert not admission.hold(41)
        assert admission.body_bytes == 60
        admission.release(60)
        assert admission.hold(100)


async def test_a_body_read_cut_short_by_cancellation_gives_its_bytes_back(
    client_for: Any,
) -> None:
    client, router = client_for()
    never = asyncio.Event()
    taken: list[bytes] = []
    upload = asyncio.create_task(
        client.post(CHAT, content=trickle(RAW[:10], RAW[10:], never, taken))
    )
    await until_async(lambda: router.admission.body_bytes == 10, "10 bytes counted")
    upload.cancel()
    with pytest.raises(asyncio.CancelledError):
        await upload
    await until_async(lambda: router.admission.body_bytes == 0, "the bytes given back")
