"""When a shopper's session is worth a prompt.

A prompt costs a few seconds of GPU; an event costs nothing. So the policy sends one:

* at once after a high-signal event (add to cart, purchase, ...): the intent changes now;
* after a quiet period while the shopper browses, so one prompt covers a burst of views;
* never later than ``max_wait`` after the first event not yet covered, so a shopper who
  never pauses still gets fresh intents;
* never when nothing material changed since the last prompt: what the intent is about is
  the kinds of things the shopper did (browse, search, cart, purchase, ...) and the
  categories they did them in, so a third pair of headphones viewed after two others, or
  a refined query in the same category, asks for nothing new;
* at most once per ``min_interval`` per shopper.

:func:`decide` is pure: the operator calls it when an event arrives and when a timer fires,
and schedules a timer for the ``wake_at_ms`` it returns.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import Enum

from flink_jobs.config import TriggerConfig
from flink_jobs.core.events import ShopperEvent
from flink_jobs.core.session import SessionState

#: Flink's last watermark (``Long.MAX_VALUE``): a bounded input has ended. Records can still
#: arrive behind it (seen in a bounded run at parallelism 2, most likely an idle input that
#: Flink left out of the watermark while the others ended; a watermark never goes back).
END_OF_TIME_MS = 2**63 - 1


class Verdict(Enum):
    FIRE = "fire"
    WAIT = "wait"
    IDLE = "idle"  #: nothing pending
    UNCHANGED = "unchanged"  #: pending events changed nothing material


@dataclass(frozen=True, slots=True)
class Decision:
    verdict: Verdict
    reason: str
    wake_at_ms: int | None = None
    fingerprint: int = 0


#: Views and clicks are one kind of action, browsing; every other event type is its own.
_KIND = {"view": "browse", "click": "browse"}


def material_fingerprint(state: SessionState) -> int:
    """What the prompt would be about: the kinds of action and the categories they touch,
    and the shopper's history; not times, repetitions, products or query wording."""
    digest = hashlib.blake2b(digest_size=8)
    for kind in sorted(
        {f"{_KIND.get(e.event_type, e.event_type)}\x1f{e.category}" for e in state.events}
    ):
        digest.update(kind.encode() + b"\x1e")
    digest.update(repr(state.history).encode())
    return int.from_bytes(digest.digest(), "big")


def decide(state: SessionState, now_ms: int, config: TriggerConfig) -> Decision:
    if state.pending_since_ms is None:
        return Decision(Verdict.IDLE, "nothing pending")
    fingerprint = material_fingerprint(state)
    if state.last_prompt_ms is not None and fingerprint == state.last_prompt_fingerprint:
        return Decision(Verdict.UNCHANGED, "nothing material changed", fingerprint=fingerprint)

    if now_ms >= END_OF_TIME_MS:
        # No later time exists to wait for (nor to register a timer at): what is pending
        # is final.
        return Decision(Verdict.FIRE, "end of input", fingerprint=fingerprint)
    earliest_allowed = (
        state.last_prompt_ms + int(config.min_interval_s * 1000)
        if state.last_prompt_ms is not None
        else now_ms
    )
    if state.pending_high_signal:
        due, reason = now_ms, "high-signal event"
    else:
        quiet_due = _quiet_ends_ms(state.newest_event_ms, config)
        max_wait_due = state.pending_since_ms + int(config.max_wait_s * 1000)
        due, reason = (
            (quiet_due, "quiet period") if quiet_due <= max_wait_due else (max_wait_due, "max wait")
        )
    due = max(due, earliest_allowed)
    if now_ms >= due:
        return Decision(Verdict.FIRE, reason, fingerprint=fingerprint)
    return Decision(Verdict.WAIT, reason, wake_at_ms=due, fingerprint=fingerprint)


def earliest_fire_ms(event: ShopperEvent, config: TriggerConfig) -> int:
    """The earliest event time at which ``event`` can be what makes :func:`decide` fire:
    its own for a high-signal event, else the end of its quiet period. A held event
    needs applying no sooner (``timeline.on_event``), which saves a browsing event the
    trigger then waits after one of its two timer firings."""
    if event.event_type in config.high_signal_types:
        return event.event_time_ms
    return _quiet_ends_ms(event.event_time_ms, config)


def _quiet_ends_ms(newest_event_ms: int, config: TriggerConfig) -> int:
    return newest_event_ms + int(config.quiet_s * 1000)
