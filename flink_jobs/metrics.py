"""Flink metrics from Python operators, as gauges over counts kept in Python, and the
session operator's one recorder of prompt outcomes.

Why not Flink counters: PyFlink records a counter update only while Beam's (thread-local)
state sampler is in the operator's processing scope. Timer callbacks
(``KeyedProcessFunction.on_timer``) and other threads (the outbox's event loop) run outside
that scope: counter and distribution updates made there are dropped without a word. Gauges
are read at the end of each bundle, inside the scope, so a gauge whose value is a count
kept here is reported. Distributions are no help either: the Prometheus reporter shows
them as 0.

:class:`GaugeCounters` is a counter per name, made on first use; :class:`Tally` keeps,
thread-safely, a fixed set of:

- **counts**: cumulative, only growing (``rate()`` works on them as on counters);
- **timings**: per name ``<name>_count`` and ``<name>_sum`` (cumulative: the mean over any
  range is ``rate(sum) / rate(count)``) and ``<name>_p50``, ``<name>_p95``, ``<name>_max``
  over the samples of the last ``window_s`` seconds (0 when there were none).

``register`` turns each into a gauge of a Flink metric group. Per record the cost is a lock
and an addition (and a deque append for a timing); quantiles are computed when read, at
most once per change.

:class:`OutcomeRecorder` takes each settled prompt once (its model answer and its
rules-only record are two outcomes, counted apart) and feeds both places its figures
go: a :class:`Tally` (the Flink gauges, for Managed Flink / CloudWatch) and the Redis stats
(``runtime.counters.StatsReporter``, for the local console and the tests).

:class:`GaugeBoard` is how the gauges reach Flink in thread mode without Flink calling
Python: each is a Java object holding a number (``shopperintents.PublishedGauge``) that the
operator's thread sets from the Python-side value at most every few seconds. A gauge
PyFlink registers in thread mode wraps a Python callable that the JVM calls from its own
threads (a reporter's, the JobManager's metric fetcher); one such call while a finishing
task's interpreter was closing crashed a TaskManager (deploy/README.md). In process mode
Beam reads Python gauges in the Python worker at the end of a bundle, so they stay as
PyFlink gives them.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from flink_jobs.core.tasks import PromptTask
    from flink_jobs.runtime.outbox import Settled

log = logging.getLogger(__name__)

#: The metric group of the job's own metrics on a cluster of its own (compose, a standalone
#: cluster, the embedded demo): the Prometheus reporter names them
#: ``flink_taskmanager_job_task_operator_shopper_intents_<name>``, as the dashboards read.
METRIC_GROUP = "shopper_intents"
#: The group Managed Flink forwards to CloudWatch: it reports only metrics created under the
#: group key ``KinesisAnalytics`` (docs/managed_flink.md#cloudwatch-metric-group). The
#: zip's main file sets ``job.metric_group`` to it.
CLOUDWATCH_METRIC_GROUP = "KinesisAnalytics"


def metric_group(configured: str) -> str:
    """The group the operators register under: ``job.metric_group``, else the default."""
    return configured or METRIC_GROUP


#: Suffixes of the gauges registered for each timing.
TIMING_SUFFIXES = ("count", "sum", "p50", "p95", "max")


class MetricGroup(Protocol):
    def gauge(self, name: str, obj: Callable[[], int]) -> Any: ...

    def add_group(self, name: str, extra: str | None = None) -> MetricGroup: ...


#: The Java gauge class (flink_jobs/java/shopperintents/PublishedGauge.java).
PUBLISHED_GAUGE_CLASS = "shopperintents.PublishedGauge"


def _java_group(group: MetricGroup) -> Any | None:
    """The Java metric group behind a thread-mode PyFlink group, None for any other (process
    mode, a test's fake): PyFlink's embedded ``MetricGroupImpl`` keeps it as ``_metrics``."""
    if type(group).__module__.startswith("pyflink.fn_execution.metrics.embedded"):
        return getattr(group, "_metrics", None)
    return None


def _new_published_gauge() -> Any:
    """A ``PublishedGauge``, loaded by the task thread's class loader: the job's jars are
    on it, while pemja's ``findClass`` sees only the TaskManager's own classpath (and a
    class it cannot find leaves the interpreter unusable). ``Class.newInstance``: through
    pemja, ``getDeclaredConstructor()`` with no arguments crashed the JVM."""
    from pemja import findClass  # only inside PyFlink's embedded interpreter

    loader = findClass("java.lang.Thread").currentThread().getContextClassLoader()
    return loader.loadClass(PUBLISHED_GAUGE_CLASS).newInstance()


#: How often the gauges are copied: Flink's metric fetcher reads every 10 s by default and
#: Prometheus scrapes every 15 s or more; each copy computes the timings' quantiles.
PUBLISH_INTERVAL_S = 5.0


class GaugeBoard:
    """The operator's gauges as values Flink reads on its own (module docstring).

    ``publish`` is called from the operator's thread after each record and timer; it copies
    every value at most once per ``interval_s`` (a clock read otherwise). ``publish_now``
    copies them at once (the operator closing)."""

    def __init__(
        self,
        interval_s: float = PUBLISH_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        new_gauge: Callable[[], Any] = _new_published_gauge,
        java_group: Callable[[MetricGroup], Any | None] = _java_group,
    ) -> None:
        self._interval = interval_s
        self._clock = clock
        self._new_gauge: Callable[[], Any] | None = new_gauge
        self._java_group = java_group
        self._published: list[tuple[Any, Callable[[], int]]] = []
        self._due = 0.0

    def gauge(self, group: MetricGroup, name: str, read: Callable[[], int]) -> None:
        java = self._java_group(group)
        gauge = self._published_gauge() if java is not None else None
        if java is None or gauge is None:
            group.gauge(name, read)
            return
        java.gauge(name, gauge)
        gauge.set(int(read()))
        self._published.append((gauge, read))

    def _published_gauge(self) -> Any | None:
        """A new Java gauge; None once one could not be made (said once, in a warning)."""
        if self._new_gauge is None:
            return None
        try:
            return self._new_gauge()
        except Exception as exc:  # pemja raises what Java threw: any of it means "not here"
            log.warning(
                "%s is not loadable (%s): the job's gauges fall back to Python callables; "
                "put shopper-intents-connectors.jar on the job's classpath",
                PUBLISHED_GAUGE_CLASS,
                exc,
            )
            self._new_gauge = None
            return None

    def publish(self) -> None:
        now = self._clock()
        if now >= self._due:
            self._due = now + self._interval
            self.publish_now()

    def publish_now(self) -> None:
        for gauge, read in self._published:
            gauge.set(int(read()))


class PublishedGroup:
    """A metric group whose gauges, its subgroups' included, go through a
    :class:`GaugeBoard`."""

    def __init__(self, group: Any, board: GaugeBoard) -> None:
        self._group = group
        self._board = board

    def gauge(self, name: str, obj: Callable[[], int]) -> None:
        self._board.gauge(self._group, name, obj)

    def add_group(self, name: str, extra: str | None = None) -> PublishedGroup:
        return PublishedGroup(self._group.add_group(name, extra), self._board)


class GaugeCounters:
    """Counts by name, each registered as a gauge of ``group`` when first incremented.

    Count from the thread that runs the bundles (``process_element``, ``on_timer``): a first
    count registers the gauge, which in thread mode makes a Java gauge (``GaugeBoard``) and in
    process mode a Python one that PyFlink reads there at the end of each bundle.
    """

    def __init__(self, group: MetricGroup) -> None:
        self._group = group
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def inc(self, name: str, amount: int = 1) -> None:
        with self._lock:
            if name not in self._counts:
                self._counts[name] = 0
                self._group.gauge(name, functools.partial(self._counts.__getitem__, name))
            self._counts[name] += amount

    def value(self, name: str) -> int:
        return self._counts.get(name, 0)


def gauge_names(counts: Iterable[str], timings: Iterable[str]) -> list[str]:
    """Every gauge :meth:`Tally.register` adds, in order."""
    return [*counts, *(f"{t}_{s}" for t in timings for s in TIMING_SUFFIXES)]


class _Window:
    __slots__ = ("count", "samples", "sorted", "sum")

    def __init__(self, cap: int) -> None:
        self.count = 0
        self.sum = 0
        self.samples: deque[tuple[float, int]] = deque(maxlen=cap)
        self.sorted: list[int] | None = None


class Tally:
    """Thread-safe counts and timings, read by Flink gauges (module docstring)."""

    def __init__(
        self,
        counts: Iterable[str],
        timings: Iterable[str] = (),
        window_s: float = 60.0,
        window_cap: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window_s <= 0 or window_cap <= 0:
            raise ValueError("window_s and window_cap must be positive")
        self._counts = dict.fromkeys(counts, 0)
        self._windows = {name: _Window(window_cap) for name in timings}
        self._window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()

    # --- writing (any thread) ---------------------------------------------------------

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] += amount

    def observe(self, name: str, value: int | float) -> None:
        """One timing sample (milliseconds); negative values count as 0."""
        sample = max(0, int(value))
        now = self._clock()
        with self._lock:
            window = self._windows[name]
            window.count += 1
            window.sum += sample
            window.samples.append((now, sample))
            window.sorted = None

    # --- reading (the gauges) ---------------------------------------------------------

    def count(self, name: str) -> int:
        return self._counts[name]

    def timing(self, name: str, what: str) -> int:
        """``what`` is one of :data:`TIMING_SUFFIXES`."""
        with self._lock:
            window = self._windows[name]
            if what == "count":
                return window.count
            if what == "sum":
                return window.sum
            recent = self._recent(window)
        if not recent:
            return 0
        if what == "max":
            return recent[-1]
        q = {"p50": 0.50, "p95": 0.95}[what]
        return recent[max(0, math.ceil(q * len(recent)) - 1)]  # nearest rank

    def _recent(self, window: _Window) -> list[int]:
        horizon = self._clock() - self._window_s
        samples = window.samples
        if samples and samples[0][0] < horizon:
            while samples and samples[0][0] < horizon:
                samples.popleft()
            window.sorted = None
        if window.sorted is None:
            window.sorted = sorted(v for _, v in samples)
        return window.sorted

    def register(self, group: MetricGroup) -> list[str]:
        """Add a gauge per count and per timing statistic to ``group``; returns the names."""
        names = []
        for name in self._counts:
            group.gauge(name, functools.partial(self.count, name))
            names.append(name)
        for name in self._windows:
            for what in TIMING_SUFFIXES:
                group.gauge(f"{name}_{what}", functools.partial(self.timing, name, what))
                names.append(f"{name}_{what}")
        return names


# --- prompt outcomes --------------------------------------------------------------------


class StatsSink(Protocol):
    """The Redis stats' side (``runtime.counters.StatsReporter``)."""

    def add(self, name: str, amount: int = 1) -> None: ...

    def sample(self, name: str, value: int) -> None: ...


#: The counter of each prompt outcome (``TaskResult.outcome``), for the model's answer.
OUTCOME_COUNTERS = {
    "written": "intents_written",
    "stale": "intents_stale",
    "superseded": "prompts_superseded",
    "dead_letter": "dead_letter_inference",
}
#: The same for a prompt's rules-only record (``TaskResult.source == "rules"``; never
#: superseded). Each prompt sent ends as one of these too.
RULES_OUTCOME_COUNTERS = {
    "written": "intents_written_rules",
    "stale": "intents_stale_rules",
    "dead_letter": "dead_letter_rules",
}
#: Model answers that named a category outside the session's (dead-lettered).
UNGROUNDED_REASON = "ungrounded_category"
#: The prompt outcomes' Flink metrics (gauges over a :class:`Tally`): counts, then timings
#: in ms.
INFER_COUNTS = (
    *OUTCOME_COUNTERS.values(),
    *RULES_OUTCOME_COUNTERS.values(),
    "answers_ungrounded",
    "llm_retries",
    "llm_prompt_tokens",
    "llm_calls_stopped",
)
INFER_TIMINGS = (
    "llm_latency_ms",
    "event_to_intent_ms",
    "event_to_rules_ms",
    "event_to_prompt_ms",
    "outbox_wait_ms",
)


#: Per A/B arm (``prompt.arms``): the figures that compare arms, as Flink gauges in a group
#: ``arm=<name>`` and, for the counts, Redis stats ``arm:<name>:<count>``.
ARM_COUNTS = (
    "prompts_sent",
    "intents_written",
    "intents_stale",
    "prompts_superseded",
    "dead_letter_inference",
    "intents_written_rules",
    "answers_ungrounded",
    "llm_prompt_tokens",
)
ARM_TIMINGS = ("llm_latency_ms", "event_to_intent_ms")


def arm_stat(arm: str, name: str) -> str:
    """The Redis stats field of count ``name`` for A/B arm ``arm``."""
    return f"arm:{arm}:{name}"


class OutcomeRecorder:
    """Each prompt sent and each outcome settled, taken once and fed to every sink.

    Most figures go to both the Flink gauges and the Redis stats. Three go to the stats
    only: a dead letter's ``dead_letter_<stage>_<reason>`` (open-ended names, while the
    Flink metric set is fixed), ``llm_calls`` and ``outbox_in_system`` (what the console
    and the benchmarks read). Given the A/B arms' names (``arms``), the figures of
    :data:`ARM_COUNTS` and :data:`ARM_TIMINGS` are also kept per arm (the prompt's
    ``RenderedPrompt.arm``).
    """

    def __init__(
        self, stats: StatsSink, tally: Tally | None = None, arms: Iterable[str] = ()
    ) -> None:
        self._stats = stats
        self._tally = tally if tally is not None else Tally(INFER_COUNTS, INFER_TIMINGS)
        self._arms = {name: Tally(ARM_COUNTS, ARM_TIMINGS) for name in arms}

    def register(self, group: MetricGroup) -> list[str]:
        """Add the Flink gauges to ``group`` (from the thread that runs the bundles), each
        arm's in its subgroup ``arm=<name>``; returns the names of the job-wide ones."""
        names = self._tally.register(group)
        for arm, tally in self._arms.items():
            tally.register(group.add_group("arm", arm))
        return names

    def sent(self, waited_ms: int, in_system: int, task: PromptTask | None = None) -> None:
        """A prompt handed to the outbox ``waited_ms`` after the event time that fired it
        (the job's own share of the freshness); ``in_system``: prompts now queued or
        running in the outbox; ``task``: the prompt (counted for its arm)."""
        self._time("event_to_prompt_ms", waited_ms)
        self._stats.sample("outbox_in_system", in_system)
        if task is not None:
            self._arm_add(task, "prompts_sent")

    def settled(self, settled: Settled) -> None:
        result, task = settled.result, settled.task
        if result.dead_letter is not None:
            self._stats.add(f"dead_letter_{result.dead_letter.stage}_{result.dead_letter.reason}")
        if result.source == "rules":
            self._add(RULES_OUTCOME_COUNTERS[result.outcome], task=task)
            if result.outcome == "written":
                self._time("event_to_rules_ms", settled.settled_at_ms - task.event_time_ms)
            return
        self._add(OUTCOME_COUNTERS[result.outcome], task=task)
        if result.dead_letter is not None and result.dead_letter.reason == UNGROUNDED_REASON:
            self._add("answers_ungrounded", task=task)
        if result.attempts > 1:
            self._add("llm_retries", result.attempts - 1)
        if result.prompt_tokens:
            self._add("llm_prompt_tokens", result.prompt_tokens, task=task)
        if result.llm_latency_s:
            self._stats.add("llm_calls")
            self._time("llm_latency_ms", result.llm_latency_s * 1000, task=task)
        elif result.outcome == "superseded" and result.attempts:
            # Stopped while the LLM computed it: a call made, with no latency to report.
            self._stats.add("llm_calls")
            self._add("llm_calls_stopped")
        if result.outcome == "written":
            # The model's answer: a rules-only record's freshness is event_to_rules_ms.
            self._time("event_to_intent_ms", settled.settled_at_ms - task.event_time_ms, task=task)
            self._time("outbox_wait_ms", settled.queued_ms)

    def _add(self, name: str, amount: int = 1, task: PromptTask | None = None) -> None:
        self._tally.add(name, amount)
        self._stats.add(name, amount)
        if task is not None and name in ARM_COUNTS:
            self._arm_add(task, name, amount)

    def _arm_add(self, task: PromptTask, name: str, amount: int = 1) -> None:
        tally = self._arms.get(task.prompt.arm)
        if tally is not None:
            tally.add(name, amount)
            self._stats.add(arm_stat(task.prompt.arm, name), amount)

    def _time(self, name: str, ms: float, task: PromptTask | None = None) -> None:
        self._tally.observe(name, ms)
        self._stats.sample(name, int(ms))
        if task is not None:
            tally = self._arms.get(task.prompt.arm)
            if tally is not None:
                tally.observe(name, ms)
