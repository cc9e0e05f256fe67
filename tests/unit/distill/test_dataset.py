"""Training examples: the job's own trigger points, the compact prompt, the split."""

from __future__ import annotations

import heapq
import itertools
from pathlib import Path

from flink_jobs.config import load_config
from flink_jobs.core.events import ShopperEvent, decode_event
from flink_jobs.core.prompting import PromptRenderer
from flink_jobs.core.timeline import on_event, on_timer
from flink_jobs.core.trigger import END_OF_TIME_MS
from flink_jobs.tools.distill.dataset import (
    Example,
    build_examples,
    by_shopper,
    read_examples,
    write_examples,
)
from flink_jobs.tools.distill.splits import split_of
from flink_jobs.tools.eval_runner import select_records

SAMPLE = Path(__file__).resolve().parents[3] / "data" / "sample_sessions.jsonl"


def sample_events(shoppers: int) -> list[ShopperEvent]:
    decoded = (
        decode_event(v, None, now_ms=END_OF_TIME_MS - 1, max_bytes=len(v) + 1)
        for v in select_records(SAMPLE, shoppers)
    )
    return [e for e in decoded if isinstance(e, ShopperEvent)]


def job_prompt_times(events: list[ShopperEvent]) -> list[tuple[str, int]]:
    """The prompts the operator's pure core fires when the events arrive in time order with
    the watermark 0.5 s behind the newest, and every timer it asks for fires as the
    watermark passes it (what ``operators.ShopperSessions`` does), then the end of input."""
    config = load_config(environ={})
    render = PromptRenderer(config.prompt).render
    fired = []
    for shopper_events in by_shopper(events).values():
        state, held, timers = None, (), []
        for e in shopper_events:
            watermark = e.event_time_ms - int(config.job.out_of_orderness_s * 1000)
            while timers and timers[0] <= watermark:
                t = heapq.heappop(timers)
                step = on_timer(state, held, t, config, render)
                state, held = step.state or state, step.held_after(held)
                fired += [(p.shopper_id, p.version_ts) for p in step.prompts]
                for timer in step.timers:
                    heapq.heappush(timers, timer)
            step = on_event(state, held, e, watermark, config, render)
            state, held = step.state or state, step.held_after(held)
            fired += [(p.shopper_id, p.version_ts) for p in step.prompts]
            for timer in step.timers:
                heapq.heappush(timers, timer)
        step = on_timer(state, held, END_OF_TIME_MS, config, render)
        fired += [(p.shopper_id, p.version_ts) for p in step.prompts]
    return sorted(fired)


def test_the_examples_are_the_prompts_the_job_fires_on_the_same_events():
    events = sample_events(24)

    examples = build_examples("sample", events)

    assert sorted((x.shopper_id, x.version_ts) for x in examples) == job_prompt_times(events)


def test_the_compact_prompt_takes_under_three_tenths_of_v3s_tokens_on_the_same_sessions():
    events = sample_events(60)

    compact = build_examples("sample", events)
    v3 = build_examples("sample", events, template="shopper_intent_v3.j2")

    assert len(compact) == len(v3)
    ratio = sum(x.estimated_tokens for x in compact) / sum(x.estimated_tokens for x in v3)
    assert ratio <= 0.3


def test_the_compact_prompts_system_part_is_the_same_for_every_prompt():
    examples = build_examples("sample", sample_events(24))

    assert len({x.messages[0]["content"] for x in examples}) == 1


def test_a_shoppers_next_prompt_in_the_session_repeats_the_earlier_one_up_to_its_facts():
    """The prefix cache keeps a shopper's earlier prompt: within a session (the same
    history line), a later prompt starts with the earlier one's text up to its facts."""
    examples = build_examples("sample", sample_events(40))
    pairs = 0
    for earlier, later in itertools.pairwise(examples):
        a, b = earlier.messages[1]["content"], later.messages[1]["content"]
        same_session = earlier.shopper_id == later.shopper_id and (
            a.split("\n", 1)[0] == b.split("\n", 1)[0]
        )
        if same_session:
            pairs += 1
            assert b.startswith(a.split("categories:", 1)[0])
    assert pairs > 10


def test_every_example_is_filed_under_its_shoppers_split_and_reads_back(tmp_path):
    examples = build_examples("sample", sample_events(24))
    path = tmp_path / "examples.jsonl"

    write_examples(path, examples)
    test_only = read_examples(path, ["test"])

    assert all(x.split == split_of(x.shopper_id) for x in examples)
    assert read_examples(path) == examples
    assert test_only and all(x.split == "test" for x in test_only)


def test_the_target_text_is_compact_json():
    [first, *_] = build_examples("sample", sample_events(5))

    assert " " not in first.target_text.split('"summary"')[0]
    assert Example.from_json(first.as_json()) == first
