"""The job's LLM calls, made on a background event loop while the keyed operator goes on.

Why not PyFlink's ``AsyncDataStream``: PyFlink 2.2's Python async operator waits for every
element in flight at the end of each bundle (``AsyncOperation.finish``), so with calls that
take seconds the operator stalls for a whole call again and again; and it is refused in
PyFlink's ``thread`` execution mode, whose keyed state access is much cheaper than
``process`` mode's (``docs/decisions.md#outbox-not-async-datastream``).

So ``operators.ShopperSessions`` hands each prompt to an :class:`Outbox` and returns. The
outbox runs each prompt through its :class:`Runner` (LLM call, answer check, Redis upsert:
``inference.PromptRunner``, by default in a helper process through
``call_process.CallProcess``) on its own thread's event loop:

- **bounded**: at most ``capacity`` prompts are queued or running; :meth:`Outbox.submit`
  blocks beyond that, which back-pressures the job into Kafka;
- **latest context wins**: a queued prompt that a newer one of the same shopper replaces
  is never sent (its outcome is ``superseded``), and takes no extra place; one call per
  shopper runs at a time, so a shopper's next prompt finds its prefix in the worker's cache.
  A newer prompt also stops the shopper's running call if that call is still waiting for
  the LLM (``Runner.supersede``; outcome ``superseded``), so it starts at once instead of
  after a whole call whose intent it would replace. A call that follows a stopped one is
  never stopped itself: a shopper who keeps changing course still gets an intent at
  least every second call;
- **nothing lost**: outcomes wait in the outbox until the operator collects them in the
  shopper's key context (:meth:`Outbox.collect`); the operator keeps the shopper's newest
  prompt in keyed state until then, so a prompt whose outcome a restart lost is sent again
  (and the versioned upsert makes a second write of it harmless);
- **loud**: an exception from ``Runner.run`` (Redis unreachable for its whole retry budget) is
  raised by the next ``submit``/``collect``, which fails the Flink task into a restart
  from its last checkpoint.

**Two speeds.** A prompt that carries a rules-only intent (``PromptTask.rules``) also goes
down a second lane, ``Runner.write_rules`` (the runner's Redis upsert of that intent, no LLM
call; ``rules_first``, ``llm.rules_first``): dispatched at :meth:`Outbox.submit`, it takes
no call slot, waits for no call of the shopper and is never superseded, so the grounded
record lands while the model is still busy (the version order lets the model's answer
replace it, never the reverse: ``intent_store``). Its outcome settles like a call's, with
``source="rules"``, and fails the job the same way; at most ``capacity`` rules writes are in
flight (``submit`` blocks beyond, as for calls).

**In order** (``latest_wins=False``, ``llm.latest_wins``): for evaluation runs that need a
model answer at every trigger point, no queued prompt is replaced and no running call is
stopped: a shopper's prompts queue behind each other and run one at a time, in order, and
each takes a place of ``capacity``.

:meth:`Outbox.close` stops the loop's calls, closes the runner (``Runner.aclose``) and then the
event loop itself, whose selector and self-pipe are three file descriptors.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from flink_jobs.core.tasks import PromptTask, TaskResult

log = logging.getLogger(__name__)


@runtime_checkable
class Runner(Protocol):
    """What the outbox runs prompts with, as an HTTP client sends requests through its
    transport: ``inference.PromptRunner`` (in this interpreter) or
    ``call_process.CallProcess`` (in a helper process). Used from the outbox's event loop."""

    async def run(self, task: PromptTask) -> TaskResult:
        """The prompt's trip: LLM call, answer check, versioned upsert; its outcome."""
        ...

    async def write_rules(self, task: PromptTask) -> TaskResult:
        """The upsert of the prompt's rules-only intent (``task.rules``), no LLM call."""
        ...

    def supersede(self, shopper_id: str, seq: int) -> None:
        """Stop prompt ``seq`` of the shopper if it still waits for the LLM (it then
        settles as ``superseded``); a call past that point runs to its end."""
        ...

    async def aclose(self) -> None:
        """Release what the runner holds (connections, a helper process)."""
        ...


class OutboxFailed(RuntimeError):
    """A call failed in a way that must restart the job (see the module docstring)."""


@dataclass(frozen=True, slots=True)
class Settled:
    task: PromptTask
    result: TaskResult
    settled_at_ms: int
    #: Waiting for a free call slot or for the shopper's previous call (0: never waited, or
    #: never started): the part of a prompt's time outside its LLM call that the job's own
    #: timings cannot show.
    queued_ms: int = 0


class Outbox:
    """``runner`` makes the calls; at most ``capacity`` prompts queued or running, at most
    ``max_concurrency`` running; ``rules_first``: also write each prompt's rules-only intent
    at once; ``latest_wins``: a newer prompt of a shopper replaces its queued one and stops
    its running one (module docstring); ``clock``: the monotonic seconds a prompt's queued
    time is measured in."""

    def __init__(
        self,
        runner: Runner,
        capacity: int,
        max_concurrency: int,
        *,
        rules_first: bool = True,
        latest_wins: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1 or max_concurrency < 1:
            raise ValueError("capacity and max_concurrency must be >= 1")
        self._runner = runner
        self._rules_first = rules_first
        self._latest_wins = latest_wins
        self._clock = clock
        self._capacity = capacity
        self._max_concurrency = max_concurrency
        self._cond = threading.Condition()
        # Per shopper, in the order shoppers came: its queued prompts, each with the
        # monotonic time it came (one at most while the latest wins).
        self._queued: dict[str, deque[tuple[PromptTask, float]]] = {}
        self._queued_count = 0
        self._running: dict[str, PromptTask] = {}
        self._writing_rules: dict[str, int] = {}  # rules writes in flight, by shopper
        self._rules_in_flight = 0
        self._settled: dict[str, list[Settled]] = {}
        self._stopping: set[str] = set()  # shoppers whose running call was asked to stop
        self._protected: set[str] = set()  # ... and whose running call followed such a one
        self._tasks: set[asyncio.Task[None]] = set()
        self._dispatch_due = False  # a wake-up of the loop to dispatch is already on its way
        self._error: BaseException | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="outbox", daemon=True)

    def start(self) -> Outbox:
        self._thread.start()
        return self

    # --- the operator's side (its task thread) -------------------------------------------

    def submit(self, task: PromptTask) -> None:
        """Queue ``task`` (and dispatch its rules write, if it carries one); blocks while
        ``capacity`` prompts are queued or running, or rules writes in flight."""
        if task.rules is not None and self._rules_first:
            self._submit_rules(task)
        with self._cond:
            self._raise_if_failed()
            line = self._queued.get(task.shopper_id)
            if line and self._latest_wins:
                queued, _ = line[0]
                older, newer = sorted((queued, task), key=lambda t: t.seq)
                if newer is task:  # keeps its place in the line
                    line[0] = (task, self._clock())
                self._settle(older, TaskResult("superseded"))
                return
            while self._queued_count + len(self._running) >= self._capacity:
                self._cond.wait(1.0)
                self._raise_if_failed()
            self._queued.setdefault(task.shopper_id, deque()).append((task, self._clock()))
            self._queued_count += 1
            running = self._running.get(task.shopper_id)
            stopped = running if running is not None and self._may_stop(task.shopper_id) else None
            if stopped is not None:
                self._stopping.add(task.shopper_id)
            # Each wake-up writes to the loop's self-pipe (a syscall and a context switch).
            # None is needed while one is on its way or every slot is busy: the end of a
            # running call dispatches what is queued.
            wake = not self._dispatch_due and len(self._running) < self._max_concurrency
            self._dispatch_due |= wake
        if wake:
            self._loop.call_soon_threadsafe(self._dispatch)
        if stopped is not None:
            self._loop.call_soon_threadsafe(self._stop, stopped)

    def _submit_rules(self, task: PromptTask) -> None:
        with self._cond:
            self._raise_if_failed()
            while self._rules_in_flight >= self._capacity:
                self._cond.wait(1.0)
                self._raise_if_failed()
            self._rules_in_flight += 1
            self._writing_rules[task.shopper_id] = self._writing_rules.get(task.shopper_id, 0) + 1
        self._loop.call_soon_threadsafe(self._start_rules, task)

    def writing_rules(self, shopper_id: str) -> bool:
        """Whether a rules write of the shopper is still in flight (its outcome to come)."""
        with self._cond:
            return shopper_id in self._writing_rules

    def collect(self, shopper_id: str) -> list[Settled]:
        """The outcomes of ``shopper_id``'s prompts that settled since the last collect."""
        with self._cond:
            self._raise_if_failed()
            return self._settled.pop(shopper_id, [])

    def wait(self, shopper_id: str, seq: int, timeout_s: float) -> list[Settled]:
        """Like :meth:`collect`, once prompt ``seq`` of the shopper has settled, and the
        shopper's rules writes too."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not (
                any(_is_call_of(s, seq) for s in self._settled.get(shopper_id, ()))
                and shopper_id not in self._writing_rules
            ):
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
        """Prompts queued or running (rules writes are not counted)."""
        with self._cond:
            return self._queued_count + len(self._running)

    def close(self, timeout_s: float = 10.0) -> None:
        """Cancel what is queued or running (the operator's state still holds it), close
        the runner, then the event loop. Closing twice does nothing more."""
        if self._loop.is_closed():
            return
        if self._thread.is_alive():
            future = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
            try:
                future.result(timeout_s)
            except Exception as exc:  # closing must not hide the reason the job is stopping
                log.warning("outbox did not shut down cleanly: %s", exc)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)
            if self._thread.is_alive():  # a call that ignores cancellation holds the loop
                log.warning(
                    "outbox thread still running after %.0f s; its loop is left open", timeout_s
                )
                return
        self._loop.close()

    # --- the event loop's side -----------------------------------------------------------

    def _dispatch(self) -> None:
        with self._cond:
            self._dispatch_due = False
            while len(self._running) < self._max_concurrency:
                shopper = next((s for s in self._queued if s not in self._running), None)
                if shopper is None:
                    return
                line = self._queued.pop(shopper)
                task, since = line.popleft()
                if line:  # in order: the shopper's next prompt goes to the back of the line
                    self._queued[shopper] = line
                self._queued_count -= 1
                queued_ms = int((self._clock() - since) * 1000)
                self._running[task.shopper_id] = task
                if task.shopper_id in self._stopping:
                    self._stopping.discard(task.shopper_id)
                    self._protected.add(task.shopper_id)
                call = self._loop.create_task(self._call(task, queued_ms))
                self._tasks.add(call)
                call.add_done_callback(self._tasks.discard)

    async def _call(self, task: PromptTask, queued_ms: int) -> None:
        try:
            result = await self._runner.run(task)
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

    def _start_rules(self, task: PromptTask) -> None:
        write = self._loop.create_task(self._call_rules(task))
        self._tasks.add(write)
        write.add_done_callback(self._tasks.discard)

    async def _call_rules(self, task: PromptTask) -> None:
        try:
            result = await self._runner.write_rules(task)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.error("rules write %d of %s failed: %r", task.seq, task.shopper_id, exc)
            with self._cond:
                self._error = exc
                self._end_rules(task)
                self._cond.notify_all()
            return
        with self._cond:
            self._end_rules(task)
            self._settle(task, result)

    def _end_rules(self, task: PromptTask) -> None:
        self._rules_in_flight -= 1
        left = self._writing_rules.get(task.shopper_id, 0) - 1
        if left > 0:
            self._writing_rules[task.shopper_id] = left
        else:
            self._writing_rules.pop(task.shopper_id, None)

    def _stop(self, task: PromptTask) -> None:
        try:
            self._runner.supersede(task.shopper_id, task.seq)
        except Exception as exc:  # the call then just runs to its end
            log.warning("could not stop prompt %d of %s: %r", task.seq, task.shopper_id, exc)

    async def _shutdown(self) -> None:
        for call in list(self._tasks):
            call.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._runner.aclose()

    # --- shared, under the lock ----------------------------------------------------------

    def _settle(self, task: PromptTask, result: TaskResult, queued_ms: int = 0) -> None:
        settled = Settled(task, result, int(time.time() * 1000), queued_ms)
        self._settled.setdefault(task.shopper_id, []).append(settled)
        self._cond.notify_all()

    def _may_stop(self, shopper_id: str) -> bool:
        return (
            self._latest_wins
            and shopper_id not in self._stopping
            and shopper_id not in self._protected
        )

    def _end(self, task: PromptTask) -> None:
        self._running.pop(task.shopper_id, None)
        self._protected.discard(task.shopper_id)

    def _tracks_locked(self, shopper_id: str, seq: int) -> bool:
        """About the prompt's call: its rules write says nothing of whether it was sent."""
        if any(t.seq == seq for t, _ in self._queued.get(shopper_id, ())):
            return True
        running = self._running.get(shopper_id)
        if running is not None and running.seq == seq:
            return True
        return any(_is_call_of(s, seq) for s in self._settled.get(shopper_id, ()))

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise OutboxFailed(f"an LLM call failed for good: {self._error}") from self._error


def _is_call_of(settled: Settled, seq: int) -> bool:
    """Whether ``settled`` is the outcome of prompt ``seq``'s call (not its rules write)."""
    return settled.task.seq == seq and settled.result.source != "rules"
