"""The trigger rate of a stream of events: prompts and LLM calls per accepted event, from
the job's own session and trigger code replayed offline (pure: no Flink, no LLM).

The rate belongs to the traffic, not to the machine: how close together a shopper's
events come decides how many of them one prompt covers. So it is computed from the events
themselves, by the code the job runs on them:

1. each record is decoded as the job's source decodes it (``events.decode_event``): a
   record the job refuses is dead-lettered (``dead_letter_decode``) and never accepted;
2. the events go, in the order given, through ``timeline.on_event`` and ``on_timer`` per
   shopper (session, trigger and prompt rendering inside, as ``operators.ShopperSessions``
   calls them), under the watermark a partition read in that order gets: the newest event
   time so far minus ``job.out_of_orderness_s`` and 1 ms (``EventTimeWatermarks``),
   advanced after each record, every event-time timer it passes fired in time order. An
   event that arrives behind it is applied at once, as in the job. No clock is involved:
   each record is taken as read at its own time, so none is refused as ahead of the clock,
   and the watermark follows the events' own times (what the replay tool stamps as their
   Kafka timestamps);
3. when the records end, every timer left fires at its own time, as the job's watermark
   follows the clock once traffic stops (``settle``); a replay that models a window closing
   with the last record leaves them out.

Accepted events are those that changed a session: ``events_accepted`` and
``events_late_folded`` in the job's stats (a duplicate, a late event dropped, an event
beyond ``session.max_held_events`` and a refused record are not). Prompts are
``prompts_sent``: every prompt the trigger fires, each rendered by the job's renderer.

LLM calls per event equal prompts per event here: every prompt is handed to the outbox,
and the only prompts that make no call are those a newer prompt of the same shopper
supersedes while they wait for a call slot (``llm.latest_wins``), which depends on how
long calls take, not on the events. So the replay's LLM calls per event are an upper
bound, reached when each call is done before its shopper's next prompt (the capacity
drain's stand-in LLM, which answers at once, comes within a few prompts of it).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from flink_jobs.config import AppConfig
from flink_jobs.core.events import DeadLetter, ShopperEvent, decode_event
from flink_jobs.core.session import SessionState
from flink_jobs.core.timeline import Renderer, Step, on_event, on_timer
from flink_jobs.tools.sizing.costs import INPUT, Figure

#: Offline there is no clock for an event to be ahead of: records are decoded as if read at
#: their own time, so the decoder's ``event_time_in_future`` check never refuses one.
NO_CLOCK_MS = 2**62
#: The job's counters of events that changed a session.
ACCEPTED_COUNTS = ("events_accepted", "events_late_folded")


@dataclass(frozen=True)
class TriggerReplay:
    """What the job's session and trigger code did with a sequence of records."""

    #: Records replayed, the uncounted ones before ``measured_from`` included.
    records: int
    #: Records from ``measured_from`` on.
    counted_records: int
    #: The job's counters over the counted steps, named as in its stats hash
    #: (``events_accepted``, ``prompts_sent``, ``prompts_reason_quiet_period``, ...), with
    #: ``dead_letter_decode`` and ``dead_letter_decode_<reason>`` for refused records.
    counts: Mapping[str, int]
    #: Per shopper, the event times its counted prompts fired at, ascending.
    fires: Mapping[str, tuple[int, ...]]
    #: The trigger settings of the replay, as ``trigger.<name>``: the rate holds for them.
    trigger: Mapping[str, float]
    #: The watermark's bound, ``job.out_of_orderness_s``.
    out_of_orderness_s: float

    @property
    def accepted_events(self) -> int:
        return sum(self.counts.get(name, 0) for name in ACCEPTED_COUNTS)

    @property
    def prompts(self) -> int:
        return self.counts.get("prompts_sent", 0)

    @property
    def refused(self) -> dict[str, int]:
        """Records the decoder refused, by reason."""
        prefix = "dead_letter_decode_"
        return {k.removeprefix(prefix): n for k, n in self.counts.items() if k.startswith(prefix)}

    @property
    def prompts_per_event(self) -> float | None:
        """Prompts per accepted event; None when no event was accepted."""
        return self.prompts / self.accepted_events if self.accepted_events else None

    @property
    def llm_calls_per_event(self) -> float | None:
        """LLM calls per accepted event: one per prompt, the upper bound (module docstring)."""
        return self.prompts_per_event


def rate_figures(replay: TriggerReplay, source: str) -> dict[str, Figure]:
    """The trigger rate of ``replay`` as a plan's ``prompts_per_event`` and
    ``llm_calls_per_event`` (kind ``input``: the user's own events), citing ``source`` and
    the counts; ValueError saying so when no event was accepted."""
    rate = replay.prompts_per_event
    if rate is None:
        raise ValueError(f"{source}: no valid events: {_nothing_accepted(replay)}")
    settings = ", ".join(f"{name} {value:g}" for name, value in replay.trigger.items())
    how = (
        f"{replay.prompts:,} prompts / {replay.accepted_events:,} accepted events of"
        f" {replay.records:,} records, replayed through the job's trigger ({settings})"
    )
    return {
        "prompts_per_event": Figure(rate, source, how, INPUT),
        "llm_calls_per_event": Figure(
            rate, source, f"{how}; one LLM call per prompt, at most", INPUT
        ),
    }


def _nothing_accepted(replay: TriggerReplay) -> str:
    if not replay.records:
        return "there are no records"
    refused = replay.refused
    if sum(refused.values()) == replay.records:
        reasons = ", ".join(f"{reason} {n:,}" for reason, n in sorted(refused.items()))
        return f"the job's decoder refuses all {replay.records:,} records ({reasons})"
    return f"none of its {replay.records:,} records changed a session (duplicates, or late)"


def decode_records(
    values: Iterable[bytes], max_bytes: int | None = None
) -> list[ShopperEvent | DeadLetter]:
    """Each record's bytes decoded as the job's source decodes them (no Kafka position, no
    clock); ``max_bytes``: ``job.max_event_bytes`` (default: the configuration's default)."""
    limit = AppConfig().job.max_event_bytes if max_bytes is None else max_bytes
    return [decode_event(value, None, NO_CLOCK_MS, limit) for value in values]


def replay_trigger(
    records: Iterable[ShopperEvent | DeadLetter],
    config: AppConfig | None = None,
    render: Renderer | None = None,
    *,
    measured_from: int = 0,
    settle: bool = True,
) -> TriggerReplay:
    """Replay ``records`` (decoded, in arrival order) through the job's timeline under
    ``config`` (default: the configuration's defaults) and count what it did.

    ``render``: the prompt renderer (default: the job's, ``prompting.ArmRenderer``).
    ``measured_from``: the index of the first record counted: the records before it are
    replayed, so the sessions and timers they leave carry on, but neither they nor the
    timers fired before it arrives are counted. ``settle``: fire the timers left once the
    records end (False: the count stops with the last record's watermark)."""
    config = config or AppConfig()
    if render is None:
        from flink_jobs.core.prompting import ArmRenderer

        render = ArmRenderer(config.prompt).render
    run = _Run(config, render)
    total = counted = 0
    for index, record in enumerate(records):
        total += 1
        run.counting = index >= measured_from
        counted += run.counting
        run.arrive(record)
    if settle:
        run.fire_until(None)
    trigger = config.trigger
    return TriggerReplay(
        records=total,
        counted_records=counted,
        counts=dict(run.counts),
        fires={s: tuple(sorted(times)) for s, times in run.fires.items()},
        trigger={
            "quiet_s": trigger.quiet_s,
            "max_wait_s": trigger.max_wait_s,
            "min_interval_s": trigger.min_interval_s,
        },
        out_of_orderness_s=config.job.out_of_orderness_s,
    )


@dataclass
class _Run:
    """The keyed operator's state and event-time timers, for every shopper at once."""

    config: AppConfig
    render: Renderer
    counting: bool = True
    watermark_ms: int = -(2**63)
    newest_ms: int = -(2**63)
    states: dict[str, SessionState | None] = field(default_factory=dict)
    held: dict[str, tuple[ShopperEvent, ...]] = field(default_factory=dict)
    #: (time, shopper), one entry per registered timer; Flink keeps one per key and time.
    timers: list[tuple[int, str]] = field(default_factory=list)
    registered: set[tuple[int, str]] = field(default_factory=set)
    counts: Counter[str] = field(default_factory=Counter)
    fires: dict[str, list[int]] = field(default_factory=dict)

    def arrive(self, record: ShopperEvent | DeadLetter) -> None:
        if isinstance(record, DeadLetter):
            self._count({"dead_letter_decode": 1, f"dead_letter_decode_{record.reason}": 1})
            return
        shopper = record.shopper_id
        step = on_event(
            self.states.get(shopper),
            self.held.get(shopper, ()),
            record,
            self.watermark_ms,
            self.config,
            self.render,
        )
        self._take(shopper, step)
        self.newest_ms = max(self.newest_ms, record.event_time_ms)
        bound_ms = int(self.config.job.out_of_orderness_s * 1000)
        self.fire_until(self.newest_ms - bound_ms - 1)

    def fire_until(self, watermark_ms: int | None) -> None:
        """Advance the watermark to ``watermark_ms`` (None: past every timer) and fire the
        timers it passes, earliest first (those the firings register included)."""
        if watermark_ms is not None:
            if watermark_ms <= self.watermark_ms:
                return
            self.watermark_ms = watermark_ms
        while self.timers and (watermark_ms is None or self.timers[0][0] <= watermark_ms):
            when, shopper = heapq.heappop(self.timers)
            self.registered.discard((when, shopper))
            step = on_timer(
                self.states.get(shopper), self.held.get(shopper, ()), when, self.config, self.render
            )
            self._take(shopper, step)

    def _take(self, shopper: str, step: Step) -> None:
        if step.state is not None:
            self.states[shopper] = step.state
        self.held[shopper] = step.held_after(self.held.get(shopper, ()))
        for when in step.timers:
            if (when, shopper) not in self.registered:
                self.registered.add((when, shopper))
                heapq.heappush(self.timers, (when, shopper))
        if self.counting:
            self._count(step.counts)
            if step.prompts:
                self.fires.setdefault(shopper, []).extend(p.event_time_ms for p in step.prompts)

    def _count(self, counts: Mapping[str, int]) -> None:
        if self.counting:
            self.counts.update(counts)
