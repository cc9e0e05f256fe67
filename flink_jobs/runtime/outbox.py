"""The job's LLM calls, made on a background event loop while the keyed operator goes on.

Why not PyFlink's ``AsyncDataStream``: PyFlink 2.2's Python async operator waits for every
element in flight at the end of each bundle (``AsyncOperation.finish``), so with calls that
take seconds the operator stalls for a whole call again and again; and it is refused in
PyFlink's ``thread`` execution mode, whose keyed state access is much cheaper than
``process`` mode's (figures in ``bench/README.md``).

So ``operators.ShopperSessions`` hands each prompt to an :class:`Outbox` and returns. The
outbox runs ``run(task)`` (LLM call, answer check, Redis upsert: ``inference.PromptRunner``,
by default in a helper process through ``call_process.CallProcess``) on its own thread's
event loop:

- **bounded**: at most ``capacity`` prompts are queued or running; :meth:`Outbox.submit`
  blocks beyond that, which back-pressures the job into Kafka;
- **latest context wins**: a queued prompt that a newer one of the same shopper replaces
  is never sent (its outcome is ``superseded``), and takes no extra place; one call per
  shopper runs at a time, so a shopper's next prompt finds its prefix in the worker's cache.
  A newer prompt also stops the shopper's running call if that call is still waiting for
  the LLM (``supersede_run``; outcome ``superseded``), so it starts at once instead of
  after a whole call whose intent it would replace. A call that follows a stopped one is
  never stopped itself: a shopper who keeps changing course still gets an intent at
  least every second call;
- **nothing lost**: outcomes wait in the outbox until the operator collects them in the
  shopper's key context (:meth:`Outbox.collect`); the operator keeps the shopper's newest
  prompt in keyed state until then, so a prompt whose outcome a restart lost is sent again
  (and the versioned upsert makes a second write of it harmless);
- **loud**: an exception from ``run`` (Redis unreachable for its whole retry budget) is
  raised by the next ``submit``/``collect``, which fails the Flink task into a restart
  from its last checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from flink_jobs.core.tasks import PromptTask, TaskResult

log = logging.getLogger(__name__)

Run = Callable[[PromptTask], Awaitable[TaskResult]]


class OutboxFailed(RuntimeError):
    """A call failed in a way that must restart the job (see the module docstring)."""


@dataclass(frozen=True, slots=True)
class Settled:
    task: PromptTask
    result: TaskResult
    settled_at_ms: int
    # Waiting for a free call slot or for the shopper's previous call (0: never waited, or
    # never started): the part of a prompt's time outside its LLM call that the job's own
    # timings cannot show.
    queued_ms: int = 0


class Outbox:
    def __init__(
        self,
        run: Run,
        capacity: int,
        max_concurrency: int,
        close_run: Callable[[], Awaitable[None]] | None = None,
        supersede_run: Callable[[str, int], None] | None = None,
    ) -> None:
        if capacity < 1 or max_concurrency < 1:
            raise ValueError("capacity and max_concurrency must be >= 1")
        self._run = run
        self._close_run = close_run
        self._supersede_run = supersede_run
        self._capacity = capacity
        self._max_concurrency = max_concurrency
        self._cond = threading.Condition()
        self._queued: dict[str, PromptTask] = {}  # in arrival order
        self._queued_since: dict[str, float] = {}  # monotonic time each queued prompt came
        self._running: dict[str, PromptTask] = {}
        self._settled: dict[str, list[Settled]] = {}
        self._stopping: set[str] = set()  # shoppers whose running call was asked to stop
        self._protected: set[str] = set()  # ... and whose running call followed such a one
        self._tasks: set[asyncio.Task] = set()
        self._dispatch_due = False  # a wake-up of the loop to dispatch is already on its way
        self._error: BaseException | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="outbox", daemon=True)

    def start(self) -> Outbox:
        self._thread.start()
        return self

    # --- the operator's side (its task thread) -------------------------------------------

    def submit(self, task: PromptTask) -> None:
        """Queue ``task``; blocks while ``capacity`` prompts are queued or running."""
        with self._cond:
            self._raise_if_failed()
            queued = self._queued.get(task.shopper_id)
            if queued is not None:
                older, newer = sorted((queued, task), key=lambda t: t.seq)
                self._queued[task.shopper_id] = newer  # keeps its place in the line
                if newer is task:
                    self._queued_since[task.shopper_id] = time.monotonic()
                self._settle(older, TaskResult("superseded"))
                return
            while len(self._queued) + len(self._running) >= self._capacity:
                self._cond.wait(1.0)
                self._raise_if_failed()
            self._queued[task.shopper_id] = task
            self._queued_since[task.shopper_id] = time.monotonic()
            running = self._running.get(task.shopper_id)
            stop = running is not None and self._may_stop(task.shopper_id)
            if stop:
                self._stopping.add(task.shopper_id)
            # Each wake-up writes to the loop's self-pipe (a syscall and a context switch).
            # None is needed while one is on its way or every slot is busy: the end of a
            # running call dispatches what is queued.
            wake = not self._dispatch_due and len(self._running) < self._max_concurrency
            self._dispatch_due |= wake
        if wake:
            self._loop.call_soon_threadsafe(self._dispatch)
        if stop:
            self._loop.call_soon_threadsafe(self._stop, running)

    def collect(self, shopper_id: str) -> list[Settled]:
        """The outcomes of ``shopper_id``'s prompts that settled since the last collect."""
        with self._cond:
            self._raise_if_failed()
            return self._settled.pop(shopper_id, [])

    def wait(self, shopper_id: str, seq: int, timeout_s: float) -> list[Settled]:
        """Like :meth:`collect`, once prompt ``seq`` of the shopper has settled."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not any(s.task.seq == seq for s in self._settled.get(shopper_id, ())):
                self._raise_if_failed()
                if not self._tracks_locked(shopper_id, seq):
                    raise ValueError(f"prompt {seq} of {shopper_id} was never submitted")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"prompt {seq} of {shopper_id} did not settle in time")
                self._cond.wait(min(left, 1.0))
            return self._settled.pop(shopper_id)

    def tracks(self, shopper_id: str, seq: int) -> bool:
        """Whether prompt ``seq`` of the shopper is queued, running or settled uncollected."""
        with self._cond:
            return self._tracks_locked(shopper_id, seq)

    @property
    def in_system(self) -> int:
        with self._cond:
            return len(self._queued) + len(self._running)

    def close(self, timeout_s: float = 10.0) -> None:
        """Cancel what is queued or running (the operator's state still holds it)."""
        if not self._thread.is_alive():
            return
        future = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        try:
            future.result(timeout_s)
        except Exception as exc:  # closing must not hide the reason the job is stopping
            log.warning("outbox did not shut down cleanly: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)

    # --- the event loop's side -----------------------------------------------------------

    def _dispatch(self) -> None:
        with self._cond:
            self._dispatch_due = False
            while len(self._running) < self._max_concurrency:
                task = next((t for s, t in self._queued.items() if s not in self._running), None)
                if task is None:
                    return
                del self._queued[task.shopper_id]
                queued_ms = int((time.monotonic() - self._queued_since.pop(task.shopper_id)) * 1000)
                self._running[task.shopper_id] = task
                if task.shopper_id in self._stopping:
                    self._stopping.discard(task.shopper_id)
                    self._protected.add(task.shopper_id)
                call = self._loop.create_task(self._call(task, queued_ms))
                self._tasks.add(call)
                call.add_done_callback(self._tasks.discard)

    async def _call(self, task: PromptTask, queued_ms: int) -> None:
        try:
            result = await self._run(task)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.error("prompt %d of %s failed: %r", task.seq, task.shopper_id, exc)
            with self._cond:
                self._error = exc
                self._end(task)
                self._cond.notify_all()
            return
        with self._cond:
            self._end(task)
            self._settle(task, result, queued_ms)
        self._dispatch()

    def _stop(self, task: PromptTask) -> None:
        try:
            self._supersede_run(task.shopper_id, task.seq)
        except Exception as exc:  # the call then just runs to its end
            log.warning("could not stop prompt %d of %s: %r", task.seq, task.shopper_id, exc)

    async def _shutdown(self) -> None:
        for call in list(self._tasks):
            call.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._close_run is not None:
            await self._close_run()

    # --- shared, under the lock ----------------------------------------------------------

    def _settle(self, task: PromptTask, result: TaskResult, queued_ms: int = 0) -> None:
        settled = Settled(task, result, int(time.time() * 1000), queued_ms)
        self._settled.setdefault(task.shopper_id, []).append(settled)
        self._cond.notify_all()

    def _may_stop(self, shopper_id: str) -> bool:
        return (
            self._supersede_run is not None
            and shopper_id not in self._stopping
            and shopper_id not in self._protected
        )

    def _end(self, task: PromptTask) -> None:
        self._running.pop(task.shopper_id, None)
        self._protected.discard(task.shopper_id)

    def _tracks_locked(self, shopper_id: str, seq: int) -> bool:
        for waiting in (self._queued, self._running):
            task = waiting.get(shopper_id)
            if task is not None and task.seq == seq:
                return True
        return any(s.task.seq == seq for s in self._settled.get(shopper_id, ()))

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise OutboxFailed(f"an LLM call failed for good: {self._error}") from self._error
