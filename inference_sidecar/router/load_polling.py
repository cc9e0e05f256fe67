"""The ``workers`` load view's I/O: every worker's ``/metrics`` read on a period, each
answer handed to ``WorkerLoads`` (``load_view``, where the rules are).

Runs on the router's event loop as one task: each round reads every worker at once, each
read bounded by a timeout, so a silent worker delays nothing but its own figure, and a
request being routed never waits for a poll (it reads the last samples).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

import httpx

from inference_sidecar.load_view import WorkerLoads, reported_load

log = logging.getLogger(__name__)

#: ``read(worker)``: the text of the worker's ``GET /metrics``; raises an httpx error
#: (``HTTPStatusError`` for a status that is not 2xx) when it cannot.
Read = Callable[[str], Awaitable[str]]
#: ``on_error(worker, kind)``: a failed poll, by kind: timeout, connect, status, unparsable.
OnError = Callable[[str, str], None]


async def poll_once(
    loads: WorkerLoads, workers: Iterable[str], read: Read, timeout_s: float, on_error: OnError
) -> None:
    """Read every worker's load once, concurrently, and record each answer or failure."""

    async def one(worker: str) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                text = await read(worker)
            reported = reported_load(text)
        except (TimeoutError, httpx.TimeoutException):
            kind, detail = "timeout", f"no answer within {timeout_s:g} s"
        except httpx.HTTPStatusError as exc:
            kind, detail = "status", f"HTTP {exc.response.status_code}"
        except httpx.HTTPError as exc:
            kind, detail = "connect", f"{type(exc).__name__}: {exc}"
        except ValueError as exc:
            kind, detail = "unparsable", str(exc)
        else:
            if loads.record(worker, reported):
                log.info("%s: its load is read from its metrics again", worker)
            return
        on_error(worker, kind)
        if loads.failed(worker, f"{kind}: {detail}"):
            log.warning(
                "%s: cannot read its load (%s: %s); this router's own count stands in once "
                "its last sample is %.1f s old",
                worker,
                kind,
                detail,
                loads.lifetime_s,
            )

    await asyncio.gather(*(one(w) for w in dict.fromkeys(workers)))


async def poll_loop(
    loads: WorkerLoads,
    workers: Callable[[], Iterable[str]],
    read: Read,
    interval_s: float,
    timeout_s: float,
    on_error: OnError,
) -> None:
    """``poll_once`` every ``interval_s`` (a fixed schedule: the next round is due
    ``interval_s`` after the previous one began) until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        began = loop.time()
        try:
            await poll_once(loads, workers(), read, timeout_s, on_error)
        except Exception:  # never let a bug stop the polling for good
            log.exception("load polling round failed")
        await asyncio.sleep(max(0.0, interval_s - (loop.time() - began)))
