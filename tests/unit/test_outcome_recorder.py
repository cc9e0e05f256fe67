"""The outcome recorder: each prompt sent and each outcome settled is taken once and lands in
both sinks, the Flink gauges (a ``Tally``) and the Redis stats, with the figures that only
the stats keep kept out of the Flink metric set."""

from __future__ import annotations

import pytest

from flink_jobs.core.events import DeadLetter
from flink_jobs.core.tasks import PromptTask, TaskResult
from flink_jobs.metrics import INFER_COUNTS, INFER_TIMINGS, OutcomeRecorder, gauge_names
from flink_jobs.runtime.outbox import Settled
from tests.support import builders
from tests.support.fake_metrics import FakeGroup, FakeStats

T0 = 1_780_304_400_000  # 2026-06-01T09:00:00Z


def prompt_task(seq: int = 4) -> PromptTask:
    """A prompt of three events (1230 tokens estimated), versioned at ``T0``."""
    return builders.prompt_task(
        "shopper-00146",
        seq,
        at_s=0,
        user="<events>\n+00:00 view Sonique Studio Pro\n</events>",
        estimated_tokens=1230,
        events_included=3,
    )


def settled(result: TaskResult, after_ms: int = 4_000, queued_ms: int = 0) -> Settled:
    return Settled(prompt_task(), result, settled_at_ms=T0 + after_ms, queued_ms=queued_ms)


@pytest.fixture
def stats() -> FakeStats:
    return FakeStats()


@pytest.fixture
def group() -> FakeGroup:
    return FakeGroup()


@pytest.fixture
def recorder(stats: FakeStats, group: FakeGroup) -> OutcomeRecorder:
    recorder = OutcomeRecorder(stats)
    recorder.register(group)
    return recorder


def test_register_adds_a_gauge_per_outcome_count_and_timing(stats: FakeStats) -> None:
    group = FakeGroup()
    names = OutcomeRecorder(stats).register(group)
    assert names == gauge_names(INFER_COUNTS, INFER_TIMINGS)
    assert set(group.read().values()) == {0}


def test_a_written_intent_lands_in_both_sinks(recorder, stats, group) -> None:
    written = TaskResult("written", attempts=1, llm_latency_s=2.5, prompt_tokens=1230)
    recorder.settled(settled(written, after_ms=4_000, queued_ms=300))

    gauges = group.read()
    assert stats.counts == {"intents_written": 1, "llm_prompt_tokens": 1230, "llm_calls": 1}
    assert (gauges["intents_written"], gauges["llm_prompt_tokens"]) == (1, 1230)
    assert stats.samples == {
        "llm_latency_ms": [2500],
        "event_to_intent_ms": [4000],
        "outbox_wait_ms": [300],
    }
    for name, value in stats.samples.items():
        assert (gauges[f"{name}_count"], gauges[f"{name}_sum"]) == (1, value[0])


def test_retries_count_the_attempts_after_the_first(recorder, stats, group) -> None:
    recorder.settled(settled(TaskResult("written", attempts=3, llm_latency_s=7.0)))
    assert stats.counts["llm_retries"] == group.read()["llm_retries"] == 2


def test_a_dead_letter_is_counted_by_stage_and_reason_in_the_stats_only(
    recorder, stats, group
) -> None:
    dead_letter = DeadLetter("llm", "timeout", "no answer within 30.0 s", "shopper-00146")
    recorder.settled(settled(TaskResult("dead_letter", dead_letter, attempts=3)))

    assert stats.counts == {
        "dead_letter_inference": 1,
        "dead_letter_llm_timeout": 1,
        "llm_retries": 2,
    }
    assert group.read()["dead_letter_inference"] == 1
    assert "dead_letter_llm_timeout" not in group.gauges
    assert "event_to_intent_ms" not in stats.samples


def test_a_call_stopped_while_the_llm_computed_it_is_a_call_without_latency(
    recorder, stats, group
) -> None:
    recorder.settled(settled(TaskResult("superseded", attempts=1)))

    assert stats.counts == {"prompts_superseded": 1, "llm_calls": 1, "llm_calls_stopped": 1}
    gauges = group.read()
    assert (gauges["prompts_superseded"], gauges["llm_calls_stopped"]) == (1, 1)
    assert stats.samples == {}
    assert gauges["llm_latency_ms_count"] == 0


def test_a_prompt_replaced_before_its_call_counts_no_call(recorder, stats, group) -> None:
    recorder.settled(settled(TaskResult("superseded")))

    assert stats.counts == {"prompts_superseded": 1}
    assert group.read()["llm_calls_stopped"] == 0


def test_a_stale_intent_has_its_call_timed_but_no_freshness(recorder, stats, group) -> None:
    recorder.settled(settled(TaskResult("stale", attempts=1, llm_latency_s=1.2), queued_ms=50))

    assert stats.counts == {"intents_stale": 1, "llm_calls": 1}
    assert stats.samples == {"llm_latency_ms": [1200]}
    gauges = group.read()
    assert gauges["intents_stale"] == 1
    assert (gauges["event_to_intent_ms_count"], gauges["outbox_wait_ms_count"]) == (0, 0)


def test_a_prompt_sent_times_its_wait_in_both_and_the_outbox_size_in_the_stats(
    recorder, stats, group
) -> None:
    recorder.sent(waited_ms=850, in_system=12)

    assert stats.samples == {"event_to_prompt_ms": [850], "outbox_in_system": [12]}
    gauges = group.read()
    assert (gauges["event_to_prompt_ms_count"], gauges["event_to_prompt_ms_sum"]) == (1, 850)
    assert not any(name.startswith("outbox_in_system") for name in group.gauges)


def test_each_outcome_is_counted_once_per_call(recorder, stats, group) -> None:
    for _ in range(3):
        recorder.settled(settled(TaskResult("written", attempts=1, llm_latency_s=2.0)))
    assert stats.counts["intents_written"] == group.read()["intents_written"] == 3
    assert len(stats.samples["event_to_intent_ms"]) == group.read()["event_to_intent_ms_count"] == 3
