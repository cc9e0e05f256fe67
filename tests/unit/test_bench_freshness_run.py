"""The freshness benchmark's steps after the run (no stack, no model): staleness while and
after it runs, and the result document built from what was measured, in the shape
``docs/lab_notebook.md`` describes."""

from __future__ import annotations

import threading
import time

import pytest

from bench import freshness
from bench._common import RESULT_KEYS, result_doc
from flink_jobs.config import AppConfig
from flink_jobs.core.events import ShopperEvent
from flink_jobs.tools.sizing.trigger_rate import replay_trigger

T0 = 1_780_304_400_000  # 2026-06-01T09:00:00Z


class FakePipeline:
    def __init__(self, hashes: dict[str, dict[str, bytes]]) -> None:
        self._hashes = hashes
        self._reads: list[tuple[str, str]] = []

    def hget(self, key: str, field: str) -> None:
        self._reads.append((key, field))

    def execute(self) -> list[bytes | None]:
        return [self._hashes.get(key, {}).get(field) for key, field in self._reads]


class FakeStore:
    """The intent store's Redis hashes as ``freshness`` reads them: ``version_ts`` per key."""

    def __init__(self, covered: dict[str, int]) -> None:
        self.client = self
        self._hashes = {self.key(s): {"version_ts": str(v).encode()} for s, v in covered.items()}

    def key(self, shopper_id: str) -> str:
        return f"fresh-1:intent:{shopper_id}"

    def pipeline(self, transaction: bool = False) -> FakePipeline:
        return FakePipeline(self._hashes)


def replayed(events: list[ShopperEvent], config: AppConfig) -> freshness.Replayed:
    timelines = freshness.shopper_timelines(events, config.session, config.trigger)
    done = threading.Thread(target=lambda: None)
    done.start()
    done.join()
    return freshness.Replayed(
        t0=T0,
        plan=list(range(len(events))),
        events=events,
        timelines=timelines,
        qualifying={
            s: [e.event_time_ms for e, _a, q, _s in rows if q] for s, rows in timelines.items()
        },
        event_times={s: [e.event_time_ms for e, *_ in rows] for s, rows in timelines.items()},
        producer=done,
    )


def view(i: int, shopper: str, seconds: float, category: str) -> ShopperEvent:
    return ShopperEvent(
        f"e{i}",
        shopper,
        "view",
        T0 + int(seconds * 1000),
        product_id=f"sku-{i}",
        category=category,
    )


EVENTS = [
    view(0, "shopper-00146", 0, "Electronics > Audio > Headphones"),
    view(1, "shopper-00146", 6, "Home > Kitchen > Kettles"),
    view(2, "shopper-00271", 2, "Sports > Running > Shoes"),
    view(3, "shopper-00388", 1, "Books > Fiction"),
]


def test_the_job_runs_on_the_runs_own_topics_group_and_key_prefix() -> None:
    from flink_jobs.config import load_config

    stack = {
        "kafka": {"bootstrap_servers": "127.0.0.1:39092"},
        "redis": {"url": "redis://127.0.0.1:36379/0"},
        "llm": {"base_url": "http://127.0.0.1:38000/v1"},
    }
    topics = ["fresh-1780304400-events", "fresh-1780304400-dlq"]

    config = load_config(overrides=freshness.job_overrides(stack, "fresh-1780304400", topics))

    assert (config.kafka.events_topic, config.kafka.dead_letter_topic) == tuple(topics)
    assert (config.kafka.group_id, config.kafka.starting_offsets) == (
        "fresh-1780304400",
        "earliest",
    )
    assert config.kafka.bootstrap_servers == "127.0.0.1:39092"
    assert (config.redis.key_prefix, config.job.name) == ("fresh-1780304400", "fresh-1780304400")
    assert config.job.stats_flush_s == 0.5


def test_staleness_now_counts_only_shoppers_active_within_the_session_gap() -> None:
    config = AppConfig()
    run = replayed(EVENTS, config)
    store = FakeStore({"shopper-00146": T0, "shopper-00271": T0 + 2_000})
    now_ms = T0 + 10_000

    values = freshness.staleness_now(store, run, now_ms, gap_s=8.5)

    # shopper-00146: its newest qualifying event (6 s) is uncovered for 4 s; shopper-00271
    # is covered; shopper-00388 was last seen 9 s ago, outside the gap.
    assert values == [4.0, 0.0]


def test_staleness_at_end_is_how_far_each_intent_is_behind_the_last_qualifying_event() -> None:
    qualifying = {"a": [1_000, 6_000], "b": [2_000], "c": [3_000], "d": []}
    covered = {"a": 1_000, "b": 2_000, "c": None, "d": None}

    assert freshness.staleness_at_end(qualifying, covered) == [5.0, 0.0, 0.0]


def test_call_figures_compare_the_job_with_the_call_per_event_baseline() -> None:
    stats = {
        "prompts_sent": 30,
        "llm_calls": 25,
        "llm_calls_stopped": 2,
        "llm_prompt_tokens": 50_000,
    }
    offline = freshness.Offline(
        baseline_calls=100, baseline_tokens=120_000, fires={}, delays=[], across_samples=[]
    )

    calls = freshness.call_figures(stats, accepted=100, offline=offline)

    assert calls["llm_calls_per_event"] == 0.25
    assert calls["prompt_tokens_per_event"] == 500.0
    assert calls["baseline_prompt_tokens_per_event"] == 1200.0
    assert calls["calls_over_baseline"] == 0.25
    assert calls["prompt_tokens_over_baseline"] == 0.417


@pytest.fixture
def document() -> dict:
    config = AppConfig()
    args = freshness.build_parser().parse_args(["--shoppers", "3", "--duration-s", "60"])
    setup = freshness.JobSetup(stack=None, up_s=41.27, config=config, client=None, store=None)
    run = replayed(EVENTS, config)
    measured = freshness.Measured(
        stats={"events_in": 4, "events_accepted": 4, "prompts_sent": 3, "llm_calls": 3},
        series=[{"t_s": 1.0, "events_in": 4}],
        staleness_during=[0.0, 3.5, 6.2],
        staleness_at_end=[0.0, 0.0, 0.0],
        freshness_ms=[5_200, 7_900, 6_100],
        llm_ms=[4_800, 5_100, 5_600],
        outbox_wait_ms=[0, 2_300, 0],
    )
    fires = replay_trigger(EVENTS, config, lambda state, facts: None).fires
    offline = freshness.Offline(
        baseline_calls=4,
        baseline_tokens=2_400,
        fires=fires,
        delays=freshness.policy_delays_s(run.qualifying, fires),
        across_samples=[{"seed": 8, "prompts_per_event": 0.4}],
    )
    figures = freshness.result_figures(args, len(EVENTS), setup, run, measured, offline)
    figures["memory_peak"] = {"redis": {"processes": 1, "max_mib": 12.5, "sum_mib": 12.5}}
    targets = freshness.freshness_targets(figures)
    return result_doc(freshness.BENCHMARK, time.monotonic(), targets, freshness.NOTES, **figures)


def test_the_result_document_has_the_freshness_keys_in_order(document: dict) -> None:
    assert list(document) == [
        *RESULT_KEYS,
        "workload",
        "stack_start_s",
        "settled",
        "stats",
        "freshness_s",
        "llm_latency_s",
        "freshness_p99_minus_llm_p99_s",
        "outside_call",
        "calls",
        "policy",
        "staleness_s",
        "freshness_ms",
        "llm_latency_ms",
        "outbox_wait_ms",
        "series",
        "memory_peak",
    ]
    assert list(document["staleness_s"]) == [
        "during_run",
        "at_end",
        "shoppers_with_qualifying_events",
    ]
    assert list(document["policy"]) == [
        "prompts_per_event_offline",
        "delay_to_prompt_s",
        "across_samples",
        "prompts_per_event_across_samples",
    ]


def test_the_result_document_judges_the_four_targets(document: dict) -> None:
    verdicts = {t["name"]: (t["value"], t["met"]) for t in document["targets"]}
    assert verdicts == {
        "freshness p99 - LLM p99 (s)": (2.3, False),
        "LLM calls per accepted event": (0.75, False),
        "trigger policy: qualifying event to the prompt covering it, max (s)": (
            document["policy"]["delay_to_prompt_s"]["max"],
            document["policy"]["delay_to_prompt_s"]["max"] <= freshness.MAX_STALENESS_S,
        ),
        "staleness of active shoppers' intents, max over the run (s)": (6.2, False),
    }
    assert document["all_targets_met"] is False


def test_the_result_document_reads_as_the_summary_table(document: dict) -> None:
    text = freshness.table(document)
    assert "freshness p50 6.1 s  p99 7.9 s" in text
    assert "outside the call median 0.5 s (queued 0.0 s)" in text
    assert "memory  redis" in text
