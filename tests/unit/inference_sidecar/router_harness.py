"""What the router's tests share: worker URLs, a request body, a router wired to fake
workers, and checks of the OpenAI error shape and of metric values."""

from __future__ import annotations

from typing import Any

import httpx
from fake_workers import FakeWorkers

from inference_sidecar.config import RouterConfig
from inference_sidecar.router import Router

A, B, C = "http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"
CHAT = "/v1/chat/completions"
BODY: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "what will shopper 1 buy?"}],
    "max_tokens": 50,
    "response_format": {"type": "json_schema", "json_schema": {"name": "i", "schema": {}}},
}


ADMIN_TOKEN = "admin-token-for-the-router-tests"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
"""What an operator's admin request carries (``RouterConfig.admin_token``)."""


def make_router(fake: FakeWorkers, **kw: Any) -> Router:
    kw.setdefault("workers", (A, B))
    kw.setdefault("health_interval_s", 0)
    return Router(RouterConfig(**kw), transport=fake.transport())


def session(sid: str) -> dict[str, str]:
    return {"X-Session-ID": sid}


def metric(router: Router, name: str, **labels: str) -> float:
    value = router.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error
