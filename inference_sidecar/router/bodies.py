"""Request and error bodies in OpenAI's shapes: what the router reads and what it answers
when something is wrong."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from starlette.responses import Response

from inference_sidecar.exceptions import RequestError

JSON = "application/json"


def error_body(
    message: str, error_type: str, *, param: str | None = None, code: str | int | None = None
) -> bytes:
    """An OpenAI-style error document."""
    return orjson.dumps(
        {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    )


def error_response(
    status: int,
    message: str,
    error_type: str,
    *,
    param: str | None = None,
    code: str | int | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    return Response(
        error_body(message, error_type, param=param, code=code),
        status_code=status,
        media_type=JSON,
        headers=headers,
    )


def request_error_response(exc: RequestError) -> Response:
    """The client's error as its OpenAI-style response."""
    return error_response(exc.status, exc.message, exc.error_type, param=exc.param, code=exc.code)


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be a JSON object; raises ``RequestError`` with the reason."""
    if not raw.strip():
        raise RequestError("the request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def parse_body(raw: bytes) -> dict[str, Any]:
    """Parse and check a completion request body; raises ``RequestError`` with the reason."""
    body = json_object(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise RequestError("you must provide a model parameter (a non-empty string)", param="model")
    return body
