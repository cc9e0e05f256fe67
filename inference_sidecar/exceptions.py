"""Errors raised by the inference sidecar.

Hierarchy::

    SidecarError
    ├── ConfigError          a configuration value is missing or wrong (names the key); also
    │                        an ``intent_reader.config_errors.ConfigError``, the one every
    │                        package raises, so ``except`` on either catches it
    ├── RequestError         the client sent something the router cannot route (HTTP 4xx)
    ├── UpstreamError        every worker tried for a request failed (carries the workers)
    │   └── NoWorkerAvailable  a pool has no worker to try at all
    └── WorkerStartError     a vLLM worker process exited or never became ready

Lower-layer errors (httpx, OSError, JSON decoding) are translated into these at the I/O
boundary and raised ``from`` the original, so callers handle one family.
"""

from __future__ import annotations

from intent_reader import config_errors


class SidecarError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(SidecarError, config_errors.ConfigError):
    """A configuration value is missing or invalid; ``key`` names it. The shared
    ``ConfigError`` (constructor, ``key``, message) as one of this package's errors."""


class RequestError(SidecarError):
    """The client's request is unusable; rendered as an OpenAI-style error body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | int | None = None,
        error_type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.error_type = error_type


class UpstreamError(SidecarError):
    """No worker produced a usable answer; ``attempts`` lists (worker, reason) pairs."""

    def __init__(self, message: str, attempts: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.attempts = attempts


class NoWorkerAvailable(UpstreamError):
    """A pool had no candidate worker left (all excluded, or the pool is empty)."""


class WorkerStartError(SidecarError):
    """A worker process died during start-up or missed its deadline; carries its log tail."""

    def __init__(self, worker: str, message: str, log_tail: str = "") -> None:
        detail = f"{worker}: {message}"
        if log_tail:
            detail += f"\n--- last lines of the log of {worker} ---\n{log_tail}"
        super().__init__(detail)
        self.worker = worker
        self.log_tail = log_tail
