"""One client request as every routing step needs it, and one worker's attempt at it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from inference_sidecar.routing_key import RoutingKey
from inference_sidecar.routing_state import RoutingState, Ticket


@dataclass(frozen=True, slots=True)
class Reply:
    """A complete, non-streamed upstream answer and who produced it."""

    status: int
    body: bytes
    content_type: str
    worker: str


@dataclass(frozen=True, slots=True)
class RoutedRequest:
    """One client completion request, parsed once, as every routing step needs it."""

    #: ``chat/completions`` or ``completions``: the path under ``/v1`` and a metrics label.
    endpoint: str
    #: The client's bytes, sent unchanged in aggregated mode.
    raw: bytes
    body: dict[str, Any]
    key: RoutingKey
    #: What is forwarded to the worker (``Upstream.forwarded_headers``).
    headers: Mapping[str, str]
    #: Router clock when the request arrived (time to first token and latency).
    received: float

    @property
    def path(self) -> str:
        return f"/v1/{self.endpoint}"

    @property
    def streaming(self) -> bool:
        return self.body.get("stream") is True


@dataclass(slots=True, eq=False)
class Attempt:
    """One worker trying one request: what its end reports to the routing state."""

    pool: RoutingState
    worker: str
    started: float
    #: Event-loop time by which the attempt must be over, its stream included.
    deadline: float
    ticket: Ticket
    #: Full KV blocks of the prompt (kv_prefix): a success must make the worker publish.
    blocks: int = 0
    #: The outcome to record: ``None`` when the worker is not to blame (``finish``).
    ok: bool | None = False
    #: A stream's relay ends the attempt, when the stream ends.
    handed_over: bool = False


class AttemptFailed(Exception):
    """One worker failed in a way that allows trying another one."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


#: What a worker is blamed for: the request may go to the key's next worker.
WORKER_FAILURES = (AttemptFailed, httpx.HTTPError, TimeoutError)


def describe_failure(exc: BaseException) -> tuple[str, str]:
    """(kind for the health tracker, text for the error message) of a failed attempt."""
    if isinstance(exc, AttemptFailed):
        return exc.kind, str(exc)
    if isinstance(exc, httpx.TimeoutException | TimeoutError):
        return "timeout", f"timeout: {type(exc).__name__}"
    return "transport", f"transport: {type(exc).__name__}: {exc}"
