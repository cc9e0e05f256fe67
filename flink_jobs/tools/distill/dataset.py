"""Training examples from recorded events: every trigger point the job would fire on, its
compact prompt, and the intent hindsight gives it.

Steps, in the order :func:`build_examples` takes them:

1. group the events by shopper, in event-time order (arrival order on ties);
2. replay each shopper's timeline with the job's own pure core
   (``core.timeline.on_timer`` up to the end of input, with the job's default session
   and trigger settings): every prompt it fires is a trigger point, rendered with the
   compact template as the job renders it;
3. take the shopper's events after the point within the same session (no quiet gap longer
   than ``session.gap_s``) and write the target with ``hindsight.hindsight_intent``;
4. file the example under its shopper's split (``splits.split_of``).

Sources (``load_source``): a JSON Lines events file (the sample generator's, The Complete
Journey's conversion), a CSV, or a recording of ``flink_jobs.tools.replay record``; any
record that does not decode to an event is left out and counted.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from flink_jobs.config import AppConfig, load_config
from flink_jobs.core.events import ShopperEvent, decode_event
from flink_jobs.core.grounding import GroundedFacts
from flink_jobs.core.prompting import PromptRenderer, RenderedPrompt
from flink_jobs.core.session import SessionState
from flink_jobs.core.timeline import on_timer
from flink_jobs.core.trigger import END_OF_TIME_MS
from flink_jobs.tools.distill.hindsight import hindsight_intent
from flink_jobs.tools.distill.splits import Split, split_of

COMPACT_TEMPLATE = "shopper_intent_compact.j2"
#: Records larger than this are not events (the job's own bound is ``job.max_event_bytes``).
MAX_RECORD_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Example:
    """One trigger point: the prompt the job renders there and the hindsight target."""

    source: str
    shopper_id: str
    split: Split
    version_ts: int  #: event time of the newest event the prompt covers
    events_covered: int  #: the shopper's events up to the point (a run-independent position)
    messages: tuple[dict[str, str], ...]
    target: dict[str, Any]  #: the intent body
    categories: tuple[str, ...]  #: the request's category enum
    rules_label: str
    estimated_tokens: int

    def as_json(self) -> bytes:
        return orjson.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, line: bytes | str) -> Example:
        doc = orjson.loads(line)
        doc["messages"] = tuple(doc["messages"])
        doc["categories"] = tuple(doc["categories"])
        return cls(**doc)

    @property
    def target_text(self) -> str:
        """The target as the model writes it: compact JSON, no whitespace (what guided
        decoding with ``disable_any_whitespace`` produces)."""
        return orjson.dumps(self.target).decode()


def load_source(path: Path) -> tuple[list[ShopperEvent], int]:
    """The events a file decodes to, and how many of its records did not decode."""
    from flink_jobs.tools.replay import read_records

    events: list[ShopperEvent] = []
    refused = 0
    for record in read_records(path):
        decoded = decode_event(
            record.value, None, now_ms=END_OF_TIME_MS - 1, max_bytes=MAX_RECORD_BYTES
        )
        if isinstance(decoded, ShopperEvent):
            events.append(decoded)
        else:
            refused += 1
    return events, refused


def by_shopper(events: Iterable[ShopperEvent]) -> dict[str, list[ShopperEvent]]:
    """Each shopper's events in event-time order (arrival order on ties)."""
    grouped: dict[str, list[ShopperEvent]] = defaultdict(list)
    for e in events:
        grouped[e.shopper_id].append(e)
    for shopper_events in grouped.values():
        shopper_events.sort(key=lambda e: e.event_time_ms)
    return dict(grouped)


def session_after(
    events: Sequence[ShopperEvent], covered: int, gap_ms: float
) -> list[ShopperEvent]:
    """The events after the first ``covered`` ones until the first quiet gap over
    ``gap_ms`` (the rest of the session)."""
    after = []
    previous = events[covered - 1].event_time_ms if covered else None
    for e in events[covered:]:
        if previous is not None and e.event_time_ms - previous > gap_ms:
            break
        after.append(e)
        previous = e.event_time_ms
    return after


def shopper_examples(
    source: str,
    events: Sequence[ShopperEvent],
    config: AppConfig,
    renderer: PromptRenderer,
) -> list[Example]:
    """Every trigger point of one shopper's events (event-time order) with its target."""
    rendered: list[tuple[SessionState, GroundedFacts, RenderedPrompt]] = []

    def render(state: SessionState, facts: GroundedFacts) -> RenderedPrompt:
        prompt = renderer.render(state, facts)
        rendered.append((state, facts, prompt))
        return prompt

    step = on_timer(None, events, END_OF_TIME_MS, config, render)
    if len(step.prompts) != len(rendered):
        raise AssertionError("every prompt the timeline fired was rendered once")
    shopper_id = events[0].shopper_id
    split = split_of(shopper_id)
    gap_ms = config.session.gap_s * 1000
    times = [e.event_time_ms for e in events]
    examples = []
    for task, (_state, facts, prompt) in zip(step.prompts, rendered, strict=True):
        covered = sum(1 for t in times if t <= task.version_ts)
        after = session_after(events, covered, gap_ms)
        assert task.rules is not None
        target = hindsight_intent(facts, task.rules, task.categories, after)
        examples.append(
            Example(
                source=source,
                shopper_id=shopper_id,
                split=split,
                version_ts=task.version_ts,
                events_covered=covered,
                messages=prompt.messages,
                target=target.body,
                categories=tuple(task.categories),
                rules_label=task.rules.top_label,
                estimated_tokens=prompt.estimated_tokens,
            )
        )
    return examples


def build_examples(
    source: str,
    events: Iterable[ShopperEvent],
    config: AppConfig | None = None,
    template: str = COMPACT_TEMPLATE,
) -> list[Example]:
    """Every shopper's examples (shoppers in id order, points in time order)."""
    config = config or load_config(environ={})
    renderer = PromptRenderer(dataclasses.replace(config.prompt, template=template))
    examples: list[Example] = []
    for _shopper, shopper_events in sorted(by_shopper(events).items()):
        examples.extend(shopper_examples(source, shopper_events, config, renderer))
    return examples


def summarise(examples: Sequence[Example]) -> dict[str, Any]:
    """Counts per source and split: examples, shoppers and target labels."""
    out: dict[str, Any] = {}
    for (source, split), group in _grouped(examples).items():
        entry = out.setdefault(source, {}).setdefault(split, {})
        entry["examples"] = len(group)
        entry["shoppers"] = len({x.shopper_id for x in group})
        entry["target_top_labels"] = dict(
            Counter(x.target["intents"][0]["label"] for x in group).most_common()
        )
        entry["mean_estimated_tokens"] = round(
            sum(x.estimated_tokens for x in group) / len(group), 1
        )
    return out


def _grouped(examples: Sequence[Example]) -> dict[tuple[str, str], list[Example]]:
    groups: dict[tuple[str, str], list[Example]] = defaultdict(list)
    for x in examples:
        groups[(x.source, x.split)].append(x)
    return dict(sorted(groups.items()))


def write_examples(path: Path, examples: Sequence[Example]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as out:
        for x in examples:
            out.write(x.as_json() + b"\n")


def read_examples(path: Path, splits: Sequence[str] | None = None) -> list[Example]:
    examples = [Example.from_json(line) for line in path.read_bytes().splitlines() if line]
    return [x for x in examples if splits is None or x.split in splits]
