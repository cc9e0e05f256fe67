"""Many shoppers' intents written through the job's own write path while a test moves a
Redis Cluster under them, and a reader polling them meanwhile.

``IntentWriters`` runs the job's runner (``inference.PromptRunner``, its store and client
made from the configuration as the job makes them) on an event loop of its own: each
shopper's rules-only record (``write_rules``, the sink's first write of every prompt), one
after the other per shopper with a growing version, many shoppers at once. Every write
ends as the runner says (``written``, ``stale``, ``dead_letter``) or as a failure (the retry
budget spent: ``RedisUnavailable``), and each acknowledged one (written, or stale: the
store already held it or newer) is logged with its time. ``pause()`` stops new writes and
waits for those in flight to end; ``resume()`` goes on.

``VersionPoller`` reads every shopper's intent with ``IntentReader`` in a loop on a thread
of its own and notes each time a shopper's version was older than one it had seen.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from flink_jobs.config import AppConfig, RedisConfig
from flink_jobs.core.intents import Intent
from flink_jobs.core.prompting import RenderedPrompt
from flink_jobs.core.tasks import PromptTask
from flink_jobs.runtime.inference import PromptRunner, RedisUnavailable
from intent_reader import IntentReader, ReaderUnavailableError
from tests.support.waiting import until

T0 = 1_780_304_400_000  # 2026-06-01T09:00:00Z

PROMPT = RenderedPrompt(
    messages=({"role": "user", "content": "<events>\n+00:01 view\n</events>"},),
    template="shopper_intent_v1.j2",
    template_hash="56171ff6b9a3",
    estimated_tokens=40,
    events_included=1,
    events_dropped=0,
)
RULES = Intent(
    {"intents": [{"label": "browsing", "confidence": 0.5}], "summary": "Browsing."},
    "browsing",
    0.5,
    "Browsing.",
    source="rules",
)


def cluster_config(url: str, prefix: str, **redis: object) -> AppConfig:
    """The job's configuration for a cluster at ``url`` (``redis.cluster``), keys under
    ``prefix``; ``redis`` sets more of the group."""
    config = AppConfig()
    return replace(
        config,
        redis=replace(RedisConfig(url=url, key_prefix=prefix, cluster=True), **redis),
    )


def version_ts(seq: int) -> int:
    """The version written at ``seq``: the later the prompt, the newer its events."""
    return T0 + 1000 * seq


#: How long a cluster test waits for a step (a promotion takes about 2 s with a 1 s node
#: timeout; writes through it a few more).
STEP_TIMEOUT_S = 60.0


@dataclass
class WriteLog:
    """What the writers sent and how each write ended."""

    sent: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    #: Per shopper, each acknowledged write: (seq, monotonic time of the answer).
    acked: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def newest_acked(self, shopper_id: str) -> int:
        return max((seq for seq, _ in self.acked.get(shopper_id, ())), default=0)

    def acked_between(self, shopper_ids: Sequence[str], start: float, end: float) -> int:
        return sum(1 for s in shopper_ids for _, at in self.acked.get(s, ()) if start <= at <= end)


class IntentWriters:
    """``concurrency`` writers, each cycling over its share of ``shoppers``."""

    def __init__(self, config: AppConfig, shoppers: Sequence[str], concurrency: int) -> None:
        self.config = config
        self.shoppers = list(shoppers)
        self.concurrency = concurrency
        self.log = WriteLog()
        self._lock = threading.Condition()
        self._in_flight = 0
        self._paused = False
        self._stopping = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="intent-writers", daemon=True)

    def start(self) -> IntentWriters:
        self._thread.start()
        return self

    def pause(self, timeout_s: float = 60.0) -> None:
        """No new write; returns once every write in flight has ended."""
        with self._lock:
            self._paused = True
            ended = self._lock.wait_for(lambda: self._in_flight == 0, timeout_s)
        assert ended, f"writes still in flight after {timeout_s} s"
        self._raise_error()

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            self._lock.notify_all()

    def stop(self, timeout_s: float = 60.0) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the writers did not stop"
        self._raise_error()

    def wait_acked(self, at_least: int, since: float = 0.0, timeout_s: float = 60.0) -> None:
        """Until every shopper has ``at_least`` writes acknowledged after ``since``."""

        def done() -> bool:
            with self._lock:
                return all(
                    sum(1 for _, at in self.log.acked.get(s, ()) if at >= since) >= at_least
                    for s in self.shoppers
                )

        until(lambda: self._raise_error() or done(), "the shoppers' writes", timeout_s=timeout_s)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise AssertionError("a writer failed") from self._error

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # handed to the test's thread
            self._error = exc
            with self._lock:
                self._lock.notify_all()

    async def _main(self) -> None:
        runner = PromptRunner(self.config)
        try:
            await asyncio.gather(
                *(self._writer(runner, self.shoppers[k :: self.concurrency])
                  for k in range(self.concurrency))
            )  # fmt: skip
        finally:
            await runner.aclose()

    async def _next_turn(self) -> bool:
        """Wait while paused; False once stopping. Counts the write about to be sent."""
        while True:
            with self._lock:
                if self._stopping:
                    return False
                if not self._paused:
                    self._in_flight += 1
                    self.log.sent += 1
                    return True
            await asyncio.sleep(0.01)

    async def _writer(self, runner: PromptRunner, mine: Sequence[str]) -> None:
        seqs = dict.fromkeys(mine, 0)
        while True:
            for shopper_id in mine:
                if not await self._next_turn():
                    return
                seqs[shopper_id] += 1
                seq = seqs[shopper_id]
                at = version_ts(seq)
                task = PromptTask(shopper_id, seq, at, at, PROMPT, rules=RULES)
                try:
                    outcome = (await runner.write_rules(task)).outcome
                except RedisUnavailable as exc:
                    outcome = "failed"
                    self.log.failures.append(str(exc))
                with self._lock:
                    self.log.outcomes[outcome] += 1
                    if outcome in ("written", "stale"):
                        self.log.acked.setdefault(shopper_id, []).append((seq, time.monotonic()))
                    self._in_flight -= 1
                    self._lock.notify_all()


class VersionPoller:
    """Reads every shopper's intent in a loop (one ``get_many`` a round) and notes each
    version older than one already seen for that shopper."""

    def __init__(self, url: str, prefix: str, shoppers: Sequence[str]) -> None:
        self.reader = IntentReader.from_url(url, timeout_s=2.0, cluster=True, prefix=prefix)
        self.shoppers = list(shoppers)
        self.seen: dict[str, tuple[int, int]] = {}
        self.regressions: list[tuple[str, tuple[int, int], tuple[int, int]]] = []
        self.rounds = 0
        self.unavailable = 0
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="version-poller", daemon=True)

    def start(self) -> VersionPoller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.reader.close()
        if self._error is not None:
            raise AssertionError("the poller failed") from self._error

    def _run(self) -> None:
        try:
            self._poll()
        except BaseException as exc:  # handed to the test's thread
            self._error = exc

    def _poll(self) -> None:
        # Paced, not synchronised: a round every few milliseconds leaves the cores to the
        # cluster and the writers.
        while not self._stop.wait(0.005):
            try:
                batch = self.reader.get_many(self.shoppers)
            except ReaderUnavailableError:
                self.unavailable += 1
                continue
            for shopper_id, intent in batch.items():
                if intent is None:
                    continue
                version = (intent.version_ts, intent.version_seq)
                before = self.seen.get(shopper_id)
                if before is not None and version < before:
                    self.regressions.append((shopper_id, before, version))
                self.seen[shopper_id] = max(version, before or version)
            self.rounds += 1
