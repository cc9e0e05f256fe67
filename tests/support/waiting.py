"""Waiting on a condition: the one way a test lets something happen before it looks.

A test never sleeps to give a thing time to happen: it names the condition and waits for
it with :func:`until` (or :func:`until_async` inside an event loop), bounded by a timeout
sized for the slowest host the tier runs on. A wait that fails says what it waited for, for
how long, and, through ``explain``, what it saw last (a job's log tail, the counters, the
state of the cluster), so a failed run explains itself from the CI output alone.

- ``check`` is polled every ``interval_s`` until it returns something true, which the wait
  returns. An exception from ``check`` ends the wait: a check that may meet a service not
  yet up catches that itself.
- ``give_up`` ends the wait early when what is waited for can no longer come: it returns
  a reason (the job exited, the job FAILED) or something false to go on waiting. The check
  runs once more before the wait gives up: a bounded job may finish as it exits.
- :func:`passes_within` is the wait for a scenario that records whether a thing came
  about, for its tests to assert, instead of failing where it waits.
- :func:`held_for` makes a check that passes only once a state has lasted: a pipeline
  that is settled and stays so past its last timer.

Nothing here connects or starts a process on import: the unit tier imports it too.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: What an in-process condition (a fake's state, a thread's progress) gets by default;
#: a wait on a service or a job passes its own timeout and a slower interval.
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_INTERVAL_S = 0.01


class WaitFailed(AssertionError):
    """A condition did not hold in time, or could no longer come; the message says which
    condition, how long was waited, and what was seen."""


def _describe(explain: Callable[[], object] | None) -> str:
    if explain is None:
        return ""
    seen = str(explain())
    return f"; saw:\n{seen}" if "\n" in seen else f"; saw: {seen}"


def _timed_out(what: str, timeout_s: float, explain: Callable[[], object] | None) -> WaitFailed:
    return WaitFailed(f"timed out after {timeout_s:g} s waiting for {what}{_describe(explain)}")


def _gave_up(
    what: str, reason: object, waited_s: float, explain: Callable[[], object] | None
) -> WaitFailed:
    return WaitFailed(
        f"gave up waiting for {what} after {waited_s:.1f} s: {reason}{_describe(explain)}"
    )


def until(
    check: Callable[[], T],
    what: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    interval_s: float = DEFAULT_INTERVAL_S,
    explain: Callable[[], object] | None = None,
    give_up: Callable[[], object] | None = None,
) -> T:
    """Poll ``check`` until it returns something true, and return that.

    Raises :class:`WaitFailed` naming ``what`` (and ``explain()``) once ``timeout_s`` has
    passed, or as soon as ``give_up()`` returns a reason."""
    started = time.monotonic()
    deadline = started + timeout_s
    while True:
        value = check()
        if value:
            return value
        if give_up is not None and (reason := give_up()):
            if value := check():
                return value
            raise _gave_up(what, reason, time.monotonic() - started, explain)
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout_s, explain)
        time.sleep(interval_s)


async def until_async(
    check: Callable[[], T | Awaitable[T]],
    what: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    interval_s: float = DEFAULT_INTERVAL_S,
    explain: Callable[[], object] | None = None,
    give_up: Callable[[], object] | None = None,
) -> T:
    """:func:`until` inside an event loop: the loop runs between polls, and ``check`` may
    be a coroutine function."""
    started = time.monotonic()
    deadline = started + timeout_s
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if give_up is not None and (reason := give_up()):
            value = check()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value  # type: ignore[return-value]
            raise _gave_up(what, reason, time.monotonic() - started, explain)
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout_s, explain)
        await asyncio.sleep(interval_s)


def passes_within(
    check: Callable[[], object],
    timeout_s: float,
    *,
    interval_s: float = DEFAULT_INTERVAL_S,
    give_up: Callable[[], object] | None = None,
) -> bool:
    """Whether ``check`` passed within ``timeout_s`` (checked once more at the end), for a
    scenario that records it and tests that assert it; ``give_up`` ends the wait early."""
    try:
        until(check, "a recorded condition", timeout_s=timeout_s, interval_s=interval_s,
              give_up=give_up)  # fmt: skip
    except WaitFailed:
        return False
    return True


def held_for(
    check: Callable[[], T],
    seconds: float,
    *,
    unchanged: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> Callable[[], T | None]:
    """A check that passes (with ``check``'s value) once ``check`` has passed at every call
    for ``seconds``; with ``unchanged``, its value must also have stayed the same. A failed
    call, or a changed value, starts the time again."""
    since: float | None = None
    last: Any = None

    def held() -> T | None:
        nonlocal since, last
        value = check()
        now = clock()
        if not value:
            since = None
        elif since is None or (unchanged and value != last):
            since = now
        last = value
        return value if since is not None and now - since >= seconds else None

    return held
